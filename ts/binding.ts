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
  /** Drops the request's tokens past `tokenCount` and frees the KV blocks past them. Only between
   *  turns (TURN_ACTIVE); RUN_IN_PROGRESS (retryable) while the request's row is in the step in
   *  flight. */
  truncate(requestId: number, tokenCount: number): void
  /** tokens[start, end) of the request's whole context (prompts, prefills, generated), clamped. */
  requestTokens(requestId: number, start: number, end: number): Int32Array
  /** A full-duplex session manager over ortex-core's session rules. optionsJson:
   *  {maxSessions?: number | null, idleTtlMs?: number | null, disconnectGraceMs?: number,
   *   completedAppendLimit?: number} (absent = api.md's defaults; idleTtlMs null disables). */
  createSessions(optionsJson: string): CoreSessions
}

/**
 * ortex-core's session rules (crates/ortex-core/src/session), JSON in and out. Times are
 * milliseconds as JS numbers. JSON shapes (camelCase):
 *   Fence    {sessionId, incarnation, epoch, turnId, responseSeq}
 *   View     {fence, state: 'open'|'detached'|'closing'|'closed', leaseGeneration, configGeneration,
 *             closeReason, seq, turnSeq, lastActivityMs, detachedAtMs, operationsInFlight}
 *   Result   {seq, turnSeq, turnId, final, replayed}
 * A fence argument is a Fence's JSON or "null".
 */
export interface CoreSessions {
  /** Returns the View. CAPACITY_EXHAUSTED (retryable), SESSION_EXISTS, INVALID_ARGUMENT. */
  open(sessionId: string, nowMs: number): string
  /** The View; SESSION_CLOSED for a finalized id, INVALID_ARGUMENT for an unknown one. */
  get(sessionId: string): string
  /** Records the engine request the session owns, under its current fence. */
  bindRequest(sessionId: string, requestId: number): void
  /** requestJson: {fence?, final?, operationId?, inputDigest?}. Returns {"replay": Result} or
   *  {"reservation": id, "result": Result}. Changes nothing. */
  prepareAppend(sessionId: string, requestJson: string): string
  /** Returns {"result": Result, "session": View}; STALE_RESERVATION when its base moved. */
  commitAppend(reservationId: number, nowMs: number): string
  discardReservation(reservationId: number): void
  /** Advances responseSeq; returns the View. */
  startResponse(sessionId: string, nowMs: number): string
  /** Returns {cancelled: Fence, fence: Fence, advanced, requestIds, session: View}. */
  cancel(sessionId: string, cancelledFenceJson: string, nowMs: number): string
  /** FENCE_MISMATCH for a stale fence. */
  validateFence(sessionId: string, fenceJson: string): void
  /** activity: append | respond | cancel | heartbeat | attach | detach | model-output | config */
  touch(sessionId: string, nowMs: number, activity: string): void
  detach(sessionId: string, nowMs: number): string
  /** Compare-and-swap on the lease generation; returns the View. LEASE_GENERATION_MISMATCH. */
  resume(sessionId: string, nowMs: number, expectedGeneration: number): string
  beginOperation(sessionId: string, nowMs: number, operationId: string): void
  endOperation(sessionId: string, nowMs: number, operationId: string): void
  /** configsJson: {session?: {[k]: string} | null, runtime?: ... | null}; returns the generation. */
  replaceConfigs(sessionId: string, configsJson: string): number
  /** Returns whether this call began the close; a stale fence is FENCE_MISMATCH. */
  beginClose(sessionId: string, fenceJson: string, reason: string): boolean
  /** Frees the slot; returns the JSON array of request ids still bound. */
  finalizeClose(sessionId: string): string
  /** JSON array of {sessionId, fence, leaseGeneration, reason, submittedRequestIds,
   *  reservedRequestIds}; each one's close has begun. */
  collectExpired(nowMs: number): string
  numSessions(): number
  /** Test hook: throws (native) or traps (wasm) on a broken invariant. */
  checkInvariants(): void
}

/** The native addon's engine adds an asynchronous run: the transaction executes off the JS thread
 *  (a model's on the engine's own step thread, the simulated model's on the libuv thread pool);
 *  the events are written into `events` on the JS thread when it resolves. */
export interface NativeCoreEngine extends CoreEngine {
  run(events: Int32Array, capacity: number): Promise<number>
  /** The ONNX executor's cumulative timings as JSON: {steps, invocations, rows, tokens, gatherUs,
   *  runUs, scatterUs, executeUs, hugePageBytes, weightChunkBytes}; null for the simulated model. */
  executorStatsJson(): string | null
}

export interface NativeBinding {
  CoreEngine: {
    simulated(optionsJson: string): NativeCoreEngine
    /** An ONNX model folder (absolute path); optionsJson: EngineOptions as JSON, with
     *  executionProvider and intraOpThreads. ortLibraryPath: the ONNX Runtime library to open when
     *  ORTEX_ORT_DYLIB / ORT_DYLIB_PATH name none. Rejects with MODEL_LOAD, INVALID_ARGUMENT. */
    load(modelDir: string, optionsJson: string, ortLibraryPath: string | null): Promise<NativeCoreEngine>
  }
}

export interface WasmBinding {
  CoreEngine: { simulated(optionsJson: string): CoreEngine }
}
