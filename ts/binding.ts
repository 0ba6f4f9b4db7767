// The low-level interface that both bindings export (crates/ortex-napi as a .node addon,
// crates/ortex-wasm as a wasm-bindgen package). The facade in ts/ is the only caller; it validates
// every argument's type first, so the bindings only convert and forward to ortex-core.
//
// Every object that crosses is typed by ts/generated/boundary.ts, which is generated from the Rust
// side (crates/ortex-boundary's inputs and views; `cargo test` fails while it is stale): the binding
// deserializes an input object into its Rust mirror (unknown fields refused) and answers with a
// view object.
//
// Errors: every method throws an Error whose `code` property is one of OrtexError's codes
// (INVALID_ARGUMENT, REQUEST_CLOSED, ...); the facade turns it into an OrtexError.
//
// Events: `run*` writes events into `events` (an Int32Array of at least capacity * EVENT_STRIDE
// words); the record's layout is EVENT_WORDS (generated from crates/ortex-core/src/events.rs).
// The run's text and log-probabilities, which the records point into, are `runText()` and
// `runLogprobs()` until the next run.

import type {
  AppendPlanView,
  CancelView,
  ChatFilesInput,
  ChatRenderInput,
  ChatTurnView,
  CommitView,
  ConfigView,
  ConfigsInput,
  ContinuationInput,
  ContinuationView,
  ExecutorStatsView,
  ExpiryView,
  FenceInput,
  ModelOptionsInput,
  RequestOptionsInput,
  SessionView,
  SessionsOptionsInput,
  SimOptionsInput,
  StatsView,
  TurnOptionsInput,
} from './generated/boundary'

export { EVENT_STRIDE } from './generated/boundary'

// The public types against the generated ones (compile time only).
import './boundary-check'

export interface CoreEngine {
  config(): ConfigView
  /** Returns the request id. */
  createRequest(options: RequestOptionsInput): number
  /** Returns the new turn id. */
  beginTurn(requestId: number, tokens: Int32Array, options: TurnOptionsInput): number
  /** Throws INVALID_ARGUMENT where beginTurn would refuse `options` (every rule of
   *  TurnOptions::resolve, the vocabulary's included); begins nothing. */
  validateTurnOptions(options: TurnOptionsInput): void
  /** A chat turn in one call: `chat` renders `renderInput` with a generation prompt (marked unless
   *  `parseSpecialTokens`: crates/ortex-boundary/src/prompt_text.rs), this engine's codec
   *  tokenizes it, the template's single-token end strings join `options.eosTokenIds`, and the
   *  turn begins. Throws with the CHAT_* codes as render does, and as beginTurn. */
  beginChatTurn(requestId: number, chat: CoreChat, renderInput: ChatRenderInput, parseSpecialTokens: boolean, options: TurnOptionsInput): ChatTurnView
  /** A conversation's memory of its last send (crates/ortex-boundary's Conversation). */
  createConversation(): CoreConversation
  /** A conversation's send in one call: `chat` renders `renderInput` (the whole conversation) as
   *  beginChatTurn does; what is not resident yet on the request is appended, after cutting the
   *  context where the render no longer matches it (crates/ortex-boundary/src/conversation.rs).
   *  Bad options throw before the context changes; otherwise the codes of beginChatTurn and
   *  truncate. */
  beginConversationTurn(
    requestId: number,
    conversation: CoreConversation,
    chat: CoreChat,
    renderInput: ChatRenderInput,
    parseSpecialTokens: boolean,
    options: TurnOptionsInput,
  ): ChatTurnView
  prefill(requestId: number, tokens: Int32Array): void
  cancelTurn(requestId: number, turnId: number): boolean
  /** Holds the running turn `turnId`: the scheduler plans nothing for it until `releaseTurn`
   *  (its consumer reads nothing). The hold ends with the turn. False when it was not running. */
  holdTurn(requestId: number, turnId: number): boolean
  releaseTurn(requestId: number, turnId: number): boolean
  closeRequest(requestId: number): void
  /** The facade lost its last handle (FinalizationRegistry); reclaimed at the next boundary. */
  abandonRequest(requestId: number): void
  /** An index into REQUEST_STATES. */
  requestState(requestId: number): number
  requestTokenCount(requestId: number): number
  /** Drains retained events or executes one transaction on the calling thread. */
  runSync(events: Int32Array, capacity: number): number
  /** The text of the last run's events: one string, each event's text a slice of it (its text
   *  words, in UTF-16 units). */
  runText(): string
  /** The log-probability numbers of the last run's events (LOGPROB_HEAD, then alternatives). */
  runLogprobs(): Float64Array
  hasPendingWork(): boolean
  stats(): StatsView
  tokenize(text: string): Int32Array
  /** A text that starts a request's context: the tokenizer's prompt prefix (its BOS) first. */
  tokenizePrompt(text: string): Int32Array
  /** A prompt from CoreChat.renderMarked: control strings that came from the caller's text
   *  tokenize as plain text (crates/ortex-boundary/src/prompt_text.rs). */
  tokenizeMarked(marked: string): Int32Array
  /** The strings `tokenize` turns into control tokens (a tokenizer's special tokens). */
  controlStrings(): string[]
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
  /** A full-duplex session manager over ortex-core's session rules. */
  createSessions(options: SessionsOptionsInput): CoreSessions
}

/**
 * ortex-core's session rules (crates/ortex-core/src/session) through crates/ortex-boundary: typed
 * inputs and views. Times are milliseconds as JS numbers.
 */
export interface CoreSessions {
  /** CAPACITY_EXHAUSTED (retryable), SESSION_EXISTS, INVALID_ARGUMENT. */
  open(sessionId: string, nowMs: number): SessionView
  /** A session stored by another process, opened at its incarnation and lease generation (a
   *  failover), its fence, append counters and completed appends carrying on from `continuation`
   *  (at zero without one). SESSION_EXISTS when the id lives here or lived here at that
   *  incarnation or later; INVALID_ARGUMENT for a continuation that does not fit. */
  restore(sessionId: string, nowMs: number, incarnation: number, leaseGeneration: number, continuation: ContinuationInput | null): SessionView
  /** What a session store keeps of the session's rules, for another process's restore(). */
  continuation(sessionId: string): ContinuationView
  /** SESSION_CLOSED for a finalized id, INVALID_ARGUMENT for an unknown one. */
  get(sessionId: string): SessionView
  /** Records the engine request the session owns, under its current fence. */
  bindRequest(sessionId: string, requestId: number): void
  /** Changes nothing: a replay (reservation 0) or a reservation to commit or discard. */
  prepareAppend(sessionId: string, final: boolean, operationId: string | null, inputDigest: number, fence: FenceInput | null): AppendPlanView
  /** STALE_RESERVATION when its base moved. */
  commitAppend(reservationId: number, nowMs: number): CommitView
  discardReservation(reservationId: number): void
  /** Advances responseSeq. */
  startResponse(sessionId: string, nowMs: number): SessionView
  cancel(sessionId: string, cancelled: FenceInput | null, nowMs: number): CancelView
  /** FENCE_MISMATCH for a stale fence. */
  validateFence(sessionId: string, fence: FenceInput): void
  /** activity: append | respond | cancel | heartbeat | attach | detach | model-output | config */
  touch(sessionId: string, nowMs: number, activity: string): void
  detach(sessionId: string, nowMs: number): SessionView
  /** Compare-and-swap on the lease generation. LEASE_GENERATION_MISMATCH. */
  resume(sessionId: string, nowMs: number, expectedGeneration: number): SessionView
  beginOperation(sessionId: string, nowMs: number, operationId: string): void
  endOperation(sessionId: string, nowMs: number, operationId: string): void
  /** Returns the configuration generation. */
  replaceConfigs(sessionId: string, configs: ConfigsInput): number
  /** Returns whether this call began the close; a stale fence is FENCE_MISMATCH. */
  beginClose(sessionId: string, fence: FenceInput | null, reason: string): boolean
  /** Frees the slot; returns the request ids still bound. */
  finalizeClose(sessionId: string): number[]
  /** Each one's close has begun. */
  collectExpired(nowMs: number): ExpiryView[]
  numSessions(): number
  /** Test hook: throws (native) or traps (wasm) on a broken invariant. */
  checkInvariants(): void
}

/** crates/ortex-napi's node_placement_view (NodePlacement in types.ts). */
export interface NodePlacementView {
  executionProvider: 'cpu' | 'cuda'
  providers: Record<string, Record<string, number>>
  cpuFallback: string | null
}

/** The native addon's engine adds an asynchronous run: the transaction executes off the JS thread
 *  (a model's on the engine's own step thread, the simulated model's on the libuv thread pool);
 *  the events are written into `events` on the JS thread when it resolves. */
export interface NativeCoreEngine extends CoreEngine {
  run(events: Int32Array, capacity: number): Promise<number>
  /** The ONNX executor's cumulative counters; null for the simulated model. */
  executorStats(): ExecutorStatsView | null
  /** Which execution provider runs each node of the session; null for the simulated model. */
  nodePlacement(): NodePlacementView | null
  /** beginChatTurn with the render and the tokenizing on the libuv thread pool (the input as
   *  JSON text); the turn begins on the JS thread when it resolves. Rejects with the same codes. */
  beginChatTurnAsync(requestId: number, chat: CoreChat, inputJson: string, parseSpecialTokens: boolean, options: TurnOptionsInput): Promise<ChatTurnView>
}

/** A model's chat template, compiled once (crates/ortex-boundary's Chat). render throws with the
 *  CHAT_* codes (CHAT_TEMPLATE_MISSING, CHAT_TEMPLATE_RAISED, ...) or INVALID_ARGUMENT. */
export interface CoreChat {
  /** The prompt as plain text. */
  render(input: ChatRenderInput): string
  /** The prompt with every string of the input marked, for CoreEngine.tokenizeMarked. */
  renderMarked(input: ChatRenderInput): string
  stopStrings(): string[]
  hasTemplate(): boolean
}

/** Opaque: what a conversation's last send left resident, held by its Chat. */
export type CoreConversation = object

export interface CoreChatFactory {
  /** CHAT_CONFIG_INVALID, CHAT_TEMPLATE_INVALID. */
  fromFiles(files: ChatFilesInput, controls: string[]): CoreChat
  chatml(controls: string[]): CoreChat
}

export interface NativeBinding {
  CoreChat: CoreChatFactory
  CoreEngine: {
    simulated(options: SimOptionsInput): NativeCoreEngine
    /** An ONNX model folder (absolute path). ortLibraryPath: the ONNX Runtime library to open
     *  when ORTEX_ORT_DYLIB / ORT_DYLIB_PATH name none. Rejects with MODEL_LOAD, INVALID_ARGUMENT. */
    load(modelDir: string, options: ModelOptionsInput, ortLibraryPath: string | null): Promise<NativeCoreEngine>
    /** The ONNX Runtime library the process opened (its first model load decides); null before. */
    loadedOrtLibrary(): string | null
  }
}

export interface WasmBinding {
  CoreEngine: { simulated(options: SimOptionsInput): CoreEngine }
  CoreChat: CoreChatFactory
}
