// The low-level interface that both bindings export (crates/ortex-napi as a .node addon,
// crates/ortex-wasm as a wasm-bindgen package). The facade in ts/ is the only caller; it validates
// every argument's type first, so the bindings only convert and forward to ortex-core.
//
// Errors: every method throws an Error whose `code` property is one of OrtexError's codes
// (INVALID_ARGUMENT, REQUEST_CLOSED, ...); the facade turns it into an OrtexError.
//
// Events: `run*` writes events into `events` (an Int32Array of at least capacity * EVENT_STRIDE
// words); layout in crates/ortex-core/src/events.rs.

export const EVENT_STRIDE = 10

export interface CoreEngine {
  /** Resolved configuration as JSON: {batching, blockSize, numBlocks, maxBatchSize,
   *  maxScheduledTokens, prefillChunkSize, maxPrefillWaitSteps, maxRequests, vocabSize,
   *  eosTokenIds, maxLength}. */
  configJson(): string
  /** optionsJson: RequestOptions as JSON ({"maxSessionTokens":n}). Returns the request id. */
  createRequest(optionsJson: string): number
  /** Returns the new turn id. optionsJson: TurnOptions as JSON, camelCase, without signal/stop. */
  beginTurn(requestId: number, tokens: Int32Array, optionsJson: string): number
  prefill(requestId: number, tokens: Int32Array): void
  cancelTurn(requestId: number, turnId: number): boolean
  closeRequest(requestId: number): void
  /** The facade lost its last handle (FinalizationRegistry); reclaimed at the next boundary. */
  abandonRequest(requestId: number): void
  /** 0 created, 1 queued, 2 active, 3 turn-complete, 4 closed */
  requestState(requestId: number): number
  requestTokenCount(requestId: number): number
  /** Drains retained events or executes one transaction on the calling thread. */
  runSync(events: Int32Array, capacity: number): number
  hasPendingWork(): boolean
  /** JSON: {totalBlocks, freeBlocks, activeRequests, pendingTurns, retainedEvents, steps,
   *  promptTokens, generatedTokens, virtualTimeUs} */
  statsJson(): string
  tokenize(text: string): Int32Array
  detokenize(tokens: Int32Array): string
  close(): void
  /** Test hook: runs the core's accounting invariants; throws if one is broken. */
  checkInvariants(): void
}

/** The native addon's engine adds an asynchronous run: the model transaction executes on the
 *  libuv thread pool; the events are written into `events` on the JS thread when it resolves. */
export interface NativeCoreEngine extends CoreEngine {
  run(events: Int32Array, capacity: number): Promise<number>
}

export interface NativeBinding {
  CoreEngine: { simulated(optionsJson: string): NativeCoreEngine }
}

export interface WasmBinding {
  CoreEngine: { simulated(optionsJson: string): CoreEngine }
}
