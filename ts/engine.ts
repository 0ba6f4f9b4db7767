// The Engine facade: one class over both bindings. The entry points (index.ts for the native
// addon, wasm.ts for WebAssembly) each export a subclass that names its backend; everything else
// is shared, so the two behave the same.
//
// The facade owns ergonomics, not engine logic: it validates arguments, serializes run() calls
// and routes each run's events to their Turns (engine-runs.ts, router.ts), runs the driven loop
// (driver.ts), begins chat turns (engine-chat.ts), and reports collected Requests to the core
// (registry.ts). Scheduling, KV and sampling are the core's.
//
// The handles reach the engine only through narrow links (link.ts): a Request and its turns get
// an EngineLink, the duplex sessions a DuplexHost; the run queue and the chat calls get theirs
// (RunsHost, ChatEngineHost), so none of those modules imports this one.

import type { Backend } from './backend'
import type { CoreEngine, CoreSessions, NativeCoreEngine } from './binding'
import type * as chat from './chat'
import { Driver, type DriverHost } from './driver'
import { type ChatEngineHost, EngineChat } from './engine-chat'
import { EngineRuns, type RunsHost } from './engine-runs'
import { OrtexError, toOrtexError } from './errors'
import { EventBuffer, type EventOwner } from './events'
import { modelFolder } from './model-source'
import type { ConfigView, RequestOptionsInput, SessionsOptionsInput } from './generated/boundary'
import type { DuplexHost, EngineEndReason } from './link'
import { RequestRegistry } from './registry'
import { Request, type RequestLink, type RequestRecord, type Turn } from './request'
import type { RouterHost } from './router'
import type { TurnState } from './turn-state'
import type {
  BackendKind,
  ChatMessage,
  ChatOptions,
  ChatTemplateOptions,
  CreateChatOptions,
  EngineConfig,
  EngineStats,
  EventErrorCode,
  ExecutorStats,
  NodePlacement,
  GenerateOptions,
  LoadOptions,
  RequestOptions,
  SimulatedOptions,
  TurnOptions,
} from './types'
import * as opts from './options'
import * as v from './validate'

export type { EngineEndReason } from './link'

/** Capacity of the driven loop's own event buffer. One run writes at most one event per
 *  affected request; the rest is retained and drained by the next runs. */
const DRIVER_BUFFER_CAPACITY = 1024

interface EngineInit {
  core: CoreEngine
  backend: Backend
  /** The model folder (its chat files; a GGUF file's import in the cache); null: the simulated
   *  model, whose template is ChatML. */
  modelDir: string | null
  /** What Engine.load was given: the folder, or the GGUF file; null: the simulated model. */
  modelPath: string | null
}

function noop(): void {}

const CANCELLED_BY_CLOSE = { reason: 'cancelled', errorCode: 'none', usage: null, stop: null } as const

export class Engine implements EventOwner {
  /** @internal The backend of this entry point's Engine class (set by the subclass). */
  static _backend: Backend | null = null

  /** An ONNX model folder, or a GGUF file (imported into the cache on first use). */
  static async load(modelDir: string, options?: LoadOptions): Promise<Engine> {
    const path = v.string('modelDir', modelDir)
    if (path.length === 0) throw v.invalidArgumentFor('modelDir', 'must not be empty')
    const checked = opts.loadOptions('options', options)
    const backend = backendOf(this)
    const dir = await modelFolder(path, checked.gguf, backend.kind).catch((error: unknown) => {
      throw toOrtexError(error, 'MODEL_LOAD')
    })
    const core = await backend.load(dir, checked.engine).catch((error: unknown) => {
      throw toOrtexError(error, 'MODEL_LOAD')
    })
    return new this({ core, backend, modelDir: dir, modelPath: path } satisfies EngineInit as never)
  }

  /** The deterministic simulated model. */
  static simulated(options?: SimulatedOptions): Engine {
    const checked = opts.simulatedOptions('options', options)
    const backend = backendOf(this)
    let core: CoreEngine
    try {
      core = backend.simulated(checked)
    } catch (error) {
      // A missing binding is already an OrtexError (UNSUPPORTED); anything else that is not one of
      // the core's coded errors is an internal failure, never "unsupported".
      throw toOrtexError(error)
    }
    return new this({ core, backend, modelDir: null, modelPath: null } satisfies EngineInit as never)
  }

  readonly backend: BackendKind
  /** Resolved configuration. */
  readonly config: Readonly<EngineConfig>
  /** @internal What the duplex sessions need from this engine. */
  readonly _duplex: DuplexHost

  private readonly core: CoreEngine
  private readonly backendImpl: Backend
  /** Addition: the model folder this engine loaded (a GGUF file's import in the cache); null for
   *  the simulated model. */
  readonly modelDir: string | null
  /** Addition: what Engine.load was given, the model folder or the GGUF file; null for the
   *  simulated model. */
  readonly modelPath: string | null
  /** The chat calls and the chat template they load once (engine-chat.ts). */
  private readonly chats: EngineChat
  private closed = false
  /** Set by an engine-level Failed event (or an internal error): the engine is unhealthy and
   *  this is the event's error code. */
  private failure: EventErrorCode | null = null
  private readonly registry: RequestRegistry
  private readonly link: RequestLink
  private readonly router: RouterHost
  private readonly driver: Driver
  private driverBuffer: EventBuffer | null = null
  /** The run queue and the delivery of each run's events (engine-runs.ts). */
  private readonly runs: EngineRuns
  private closing: Promise<void> | null = null
  /** Told once when the engine fails (an engine-level failure) or is closed. */
  private readonly endListeners = new Set<(reason: EngineEndReason) => void>()

  /** Engines are made by Engine.simulated() and Engine.load(). */
  protected constructor(init: never) {
    const { core, backend, modelDir, modelPath } = init as EngineInit
    this.core = core
    this.backendImpl = backend
    this.modelDir = modelDir
    this.modelPath = modelPath
    this.backend = backend.kind
    this.config = Object.freeze(frozenConfig(core.config()))
    this.registry = new RequestRegistry({ onRequestCollected: (record) => this.onRequestCollected(record) })
    this.link = this.makeLink()
    this._duplex = this.makeDuplexHost()
    this.chats = new EngineChat(this.makeChatHost())
    this.router = {
      registry: this.registry,
      engineFailed: (code) => this.markUnhealthy(code),
      abandonCollected: (requestId) => this.abandonCollected(requestId),
    }
    const host: DriverHost = {
      _driveOnce: () => this.driveOnce(),
      _hasWorkQuietly: () => this.hasWorkQuietly(),
      _pinRequests: (driven) => this.pinRequests(driven),
    }
    this.driver = new Driver(host)
    this.runs = new EngineRuns(this.makeRunsHost())
    // Weakly: the backend's note must not keep an engine the program dropped alive.
    const self = new WeakRef(this)
    backend.onTrap?.(core, () => self.deref()?.markUnhealthy('engine-execution-failure'))
  }

  createRequest(options?: RequestOptions): Request {
    const checked = opts.requestOptions('options', v.options('options', options, opts.REQUEST_KEYS))
    return this.newRequest(checked)
  }

  /** A buffer for run/runSync of this engine; capacity 0 is allowed (every run is a no-op). */
  createEventBuffer(capacity: number): EventBuffer {
    v.capacity('capacity', capacity)
    this.checkOpen()
    return EventBuffer._create(this, capacity)
  }

  /** Drains retained events or executes at most one transaction. Native: the model work happens
   *  off the JS thread. Calls on one engine run one after another. */
  run(buffer: EventBuffer): Promise<number> {
    try {
      this.checkRun(buffer)
    } catch (error) {
      return Promise.reject(error)
    }
    return this.runs.enqueueRun(buffer)
  }

  /** The same as run() on the calling thread. */
  runSync(buffer: EventBuffer): number {
    this.checkRun(buffer)
    return this.runs.runSync(buffer)
  }

  /** True while any turn is queued or active, any prefill is queued, any event is retained, or a
   *  dropped request awaits reclamation. */
  hasPendingWork(): boolean {
    this.checkOpen()
    return this.call(() => this.core.hasPendingWork())
  }

  stats(): EngineStats {
    this.checkOpen()
    return this.call(() => this.core.stats())
  }

  /** Addition: the ONNX executor's cumulative timings; null for the simulated model. */
  executorStats(): ExecutorStats | null {
    this.checkOpen()
    const core = this.core as Partial<NativeCoreEngine>
    return core.executorStats === undefined ? null : this.call(() => core.executorStats!())
  }

  /** Addition: which execution provider runs each node of the model (for 'cuda': the nodes ONNX
   *  Runtime runs on the CPU instead); null for the simulated model. */
  nodePlacement(): NodePlacement | null {
    this.checkOpen()
    const core = this.core as Partial<NativeCoreEngine>
    return core.nodePlacement === undefined ? null : this.call(() => core.nodePlacement!())
  }

  tokenize(text: string): Int32Array {
    v.string('text', text)
    this.checkOpen()
    return this.call(() => this.core.tokenize(text))
  }

  detokenize(tokens: ArrayLike<number>): string {
    const ids = v.tokens('tokens', tokens)
    this.checkOpen()
    return this.call(() => this.core.detokenize(ids))
  }

  /** Driven mode: an internal loop runs the engine and routes events to turns. */
  start(): void {
    this.checkOpen()
    this.driver.start()
  }

  /** Back to caller-driven mode once the current transaction commits. */
  stop(): Promise<void> {
    if (this.closed) return Promise.reject(closedError())
    return this.driver.stop()
  }

  /**
   * A turn on its own request, which is closed when the turn finishes (its `done` still resolves
   * with everything). Implies start().
   */
  generate(input: string | ArrayLike<number>, options?: GenerateOptions): Turn {
    const checkedInput = v.input('input', input)
    const present = v.options('options', options, [...opts.REQUEST_KEYS, ...opts.TURN_KEYS])
    const { request, checked } = this.ownedRequest(present)
    let turn: Turn
    try {
      turn = request._begin(checkedInput, checked, true)
    } catch (error) {
      request.close()
      throw error
    }
    this.driver.start()
    return turn
  }

  /** A request for one turn (generate, chat) from the options present: the request's are taken
   *  out, the rest are the turn's, checked. */
  private ownedRequest(present: Map<string, unknown>): { request: Request; checked: opts.CheckedTurnOptions } {
    const requestPresent = new Map<string, unknown>()
    for (const key of opts.REQUEST_KEYS) {
      if (present.has(key)) {
        requestPresent.set(key, present.get(key))
        present.delete(key)
      }
    }
    const requestOptions = opts.requestOptions('options', requestPresent)
    const checked = opts.turnOptions('options', present)
    return { request: this.newRequest(requestOptions), checked }
  }

  /** The text the model reads for `messages`, rendered with the model folder's chat template
   *  (the simulated model's: ChatML). CHAT_TEMPLATE_MISSING names what a folder lacks. */
  applyChatTemplate(messages: ChatMessage[], options?: ChatTemplateOptions): string {
    return this.chats.applyChatTemplate(messages, options)
  }

  /** One chat turn on its own request (closed when it finishes), as generate: the messages are
   *  rendered with a generation prompt; the template's end-of-turn token ends it with 'eos'. */
  chat(messages: ChatMessage[], options?: ChatOptions): Turn {
    return this.chats.chat(messages, options)
  }

  /** Addition: chat() with the template rendered and the prompt tokenized off the JS thread on
   *  native (the libuv thread pool), so a large conversation does not hold the event loop; the
   *  turn begins once the prompt is ready. WebAssembly renders on the calling thread. Rejects
   *  where chat() throws. */
  chatAsync(messages: ChatMessage[], options?: ChatOptions): Promise<Turn> {
    return this.chats.chatAsync(messages, options)
  }

  /** @internal Turn options checked as a turn's begin checks them (their types here, every other
   *  rule in the core), beginning nothing: the OpenAI server refuses a request with them before
   *  it starts one. */
  _validateTurnOptions(options: TurnOptions | undefined): void {
    const checked = opts.turnOptions('options', v.options('options', options, opts.TURN_KEYS))
    this.call(() => this.core.validateTurnOptions(checked.core))
  }

  /** A conversation on one request: `send(content)` returns the reply's Turn and prefills only
   *  what the new message adds. */
  createChat(options?: CreateChatOptions): chat.Chat {
    return this.chats.createChat(options)
  }

  /**
   * Closes every request (pending `done` promises resolve 'cancelled'); afterwards every call but
   * close() and Request.close() throws ENGINE_CLOSED. Resolves once a transaction in flight has
   * returned.
   */
  close(): Promise<void> {
    if (this.closing !== null) return this.closing
    this.closed = true
    void this.driver.stop()
    for (const state of this.registry.unfinishedTurns()) state.finish(CANCELLED_BY_CLOSE)
    for (const request of this.registry.liveRequests()) request._closeForEngine()
    try {
      this.core.close()
    } catch {
      // Closing is best effort and never throws.
    }
    this.notifyEnd('engine_closed')
    this.closing = this.runs.settled()
    return this.closing
  }

  /** Test hook: runs the core's accounting invariants (blocks conserved, retained events
   *  counted, ...) and throws if one is broken. Cheap enough to call after every run. */
  checkInvariants(): void {
    this.checkOpen()
    this.call(() => this.core.checkInvariants())
  }

  /** @internal For EventBuffer: the Request behind an id, if the program still holds it. */
  _requestById(id: number): Request | null {
    return this.registry.request(id)
  }

  // ---------------------------------------------------------------------------------------------
  // The links: what Requests, Turns, the chat calls and the duplex sessions may ask of this engine
  // ---------------------------------------------------------------------------------------------

  private makeLink(): RequestLink {
    const engine = this
    return {
      core: this.core,
      get closed() {
        return engine.closed
      },
      call: (fn) => this.call(fn),
      checkOpen: () => this.checkOpen(),
      checkUsable: () => this.checkUsable(),
      inputTokens: (input, startsContext) => this.inputTokens(input, startsContext),
      wake: () => this.driver.kick(),
      ensureStarted: () => {
        if (!this.closed) this.driver.start()
      },
      turnBegun: (state, request) => this.turnBegun(state, request),
      turnFinished: (state) => this.turnFinished(state as TurnState),
      cancelTurnQuietly: (requestId, turnId) => this.endTurnQuietly(() => this.core.cancelTurn(requestId, turnId)),
      holdTurnQuietly: (requestId, turnId, held) => this.holdTurnQuietly(requestId, turnId, held),
    }
  }

  private makeRunsHost(): RunsHost {
    const engine = this
    return {
      core: this.core,
      backend: this.backendImpl,
      router: this.router,
      get ended() {
        return engine.closed || engine.failure !== null
      },
      call: (fn) => this.call(fn),
      convertError: (error) => this.convertError(error),
      checkUsable: () => this.checkUsable(),
    }
  }

  private makeChatHost(): ChatEngineHost {
    return {
      core: this.core,
      backend: this.backendImpl,
      modelDir: this.modelDir,
      call: (fn) => this.call(fn),
      convertError: (error) => this.convertError(error),
      checkOpen: () => this.checkOpen(),
      checkUsable: () => this.checkUsable(),
      ownedRequest: (present) => this.ownedRequest(present),
      createRequest: (options) => this.createRequest(options),
      start: () => this.driver.start(),
    }
  }

  private makeDuplexHost(): DuplexHost {
    const engine = this
    return {
      createSessions: (options: SessionsOptionsInput): CoreSessions => this.call(() => this.core.createSessions(options)),
      checkUsable: () => this.checkUsable(),
      checkOpen: () => this.checkOpen(),
      get failure() {
        return engine.failure
      },
      onEnd: (listener) => this.onEnd(listener),
      closeRequest: (requestId) => this.registry.request(requestId)?.close(),
    }
  }

  /** Calls the binding and converts what it throws into an OrtexError. */
  private call<T>(fn: () => T): T {
    try {
      return fn()
    } catch (error) {
      throw this.convertError(error)
    }
  }

  /** The value of `fn`, or `fallback` when it throws (a closed engine still decodes until its
   *  core is gone; then there is no text). */
  private quietly<T>(fn: () => T, fallback: T): T {
    try {
      return fn()
    } catch {
      return fallback
    }
  }

  /** Turn.cancel and AbortSignal: never throws; wakes the loop when it ended one. */
  private endTurnQuietly(end: () => boolean): boolean {
    if (this.closed) return false
    const ended = this.quietly(end, false)
    if (ended) this.driver.kick()
    return ended
  }

  /** Pacing a streamed turn: never throws; a release wakes the loop (the held turn was no work). */
  private holdTurnQuietly(requestId: number, turnId: number, held: boolean): boolean {
    if (this.closed) return false
    const core = this.core
    const changed = this.quietly(() => (held ? core.holdTurn(requestId, turnId) : core.releaseTurn(requestId, turnId)), false)
    if (!held) this.driver.kick()
    return held && changed
  }

  private checkOpen(): void {
    if (this.closed) throw closedError()
  }

  /** Addition: false once the engine is closed or an engine-level failure made it unhealthy
   *  (then every call but close() throws); what a health probe reports. */
  get healthy(): boolean {
    return !this.closed && this.failure === null
  }

  /** Addition: the code of the engine-level failure that made it unhealthy; null while healthy. */
  get failureCode(): EventErrorCode | null {
    return this.failure
  }

  /** Open and healthy: what createRequest, beginTurn and a queued run need. */
  private checkUsable(): void {
    this.checkOpen()
    if (this.failure !== null) throw unhealthyError(this.failure)
  }

  /** Text is tokenized here (a text that starts a request's context with the tokenizer's BOS,
   *  where it adds one, as Hugging Face's tokenizer(text) and llama.cpp do); token ids pass through. */
  private inputTokens(input: string | Int32Array, startsContext: boolean): Int32Array {
    const tokens = typeof input === 'string' ? this.call(() => (startsContext ? this.core.tokenizePrompt(input) : this.core.tokenize(input))) : input
    if (tokens.length === 0) throw v.invalidArgumentFor('input', 'is empty')
    return tokens
  }

  private turnBegun(state: TurnState, request: Request): void {
    this.registry.turnBegun(state)
    if (this.driver.driven) state.pinned = request
    this.driver.kick()
  }

  private turnFinished(state: TurnState): void {
    this.registry.turnFinished(state)
    state.ownedRequest?.close()
  }

  /** Calls `listener` once when the engine fails or is closed (at once if it already has);
   *  returns a function that removes it. */
  private onEnd(listener: (reason: EngineEndReason) => void): () => void {
    if (this.closed || this.failure !== null) {
      listener(this.closed ? 'engine_closed' : 'engine_failure')
      return noop
    }
    this.endListeners.add(listener)
    return () => this.endListeners.delete(listener)
  }

  // ---------------------------------------------------------------------------------------------
  // Requests and their reclamation
  // ---------------------------------------------------------------------------------------------

  private newRequest(options: RequestOptionsInput): Request {
    this.checkUsable()
    const id = this.call(() => this.core.createRequest(options))
    const request = Request._create(this.link, id)
    this.registry.add(request)
    return request
  }

  /** The shared FinalizationRegistry says a Request of this engine is gone. */
  private onRequestCollected(record: RequestRecord): void {
    this.registry.forget(record.id)
    if (record.closed || this.closed) return
    this.abandonInCore(record.id)
    this.driver.kick()
  }

  private abandonCollected(requestId: number): void {
    this.registry.drop(requestId)
    this.abandonInCore(requestId)
  }

  /** The core reclaims the request at its next owner boundary and drops its events: its turn
   *  ends here. */
  private abandonInCore(requestId: number): void {
    try {
      this.core.abandonRequest(requestId)
    } catch {
      // An engine that cannot take the note has nothing left to reclaim.
    }
    this.registry.turnOf(requestId)?.finish(CANCELLED_BY_CLOSE)
  }

  private pinRequests(driven: boolean): void {
    for (const state of this.registry.unfinishedTurns()) {
      state.pinned = driven ? (this.registry.request(state.requestId) ?? state.ownedRequest) : state.ownedRequest
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Runs
  // ---------------------------------------------------------------------------------------------

  private checkRun(buffer: EventBuffer): void {
    if (!(buffer instanceof EventBuffer)) {
      throw v.invalidArgumentFor('buffer', `must be an EventBuffer, got ${v.describe(buffer)}`)
    }
    this.checkOpen()
    if (buffer._engine !== this) {
      throw new OrtexError('WRONG_ENGINE', 'the event buffer belongs to another engine')
    }
    if (this.driver.driven) {
      throw new OrtexError('ENGINE_DRIVEN', 'the engine is driven by start()/generate(); call stop() first')
    }
    if (this.failure !== null) throw unhealthyError(this.failure)
  }

  /** An engine-level failure: every pending turn resolves 'failed' with the event's code. */
  private markUnhealthy(code: EventErrorCode): void {
    if (this.failure !== null) return
    this.failure = code
    const failed = { reason: 'failed', errorCode: code, usage: null, stop: null } as const
    for (const state of this.registry.unfinishedTurns()) state.finish(failed)
    this.notifyEnd('engine_failure')
  }

  private notifyEnd(reason: EngineEndReason): void {
    const listeners = [...this.endListeners]
    this.endListeners.clear()
    for (const listener of listeners) {
      try {
        listener(reason)
      } catch {
        // A listener's failure is its own; the engine's state is already final.
      }
    }
  }

  private convertError(error: unknown): OrtexError {
    const converted = toOrtexError(error)
    if (converted.code === 'ENGINE_UNHEALTHY' && !this.closed) {
      // An internal error (a WebAssembly trap, say) leaves the engine unusable, as does a core
      // that reports itself unhealthy before its Failed event reached us.
      this.markUnhealthy('engine-execution-failure')
    }
    return converted
  }

  /** The driven loop's run. A model's transaction executes off the JS thread (native: the
   *  engine's step thread). The simulated model's is microseconds of work (its costs are virtual),
   *  less than the trip to the libuv pool and back that run() makes on native (about 40 us a
   *  run, half the time of a 64-turn step): the loop executes it on the JS thread, as WebAssembly
   *  always does. */
  private driveOnce(): Promise<boolean> {
    this.driverBuffer ??= EventBuffer._create(this, DRIVER_BUFFER_CAPACITY)
    return this.runs.driveOnce(this.driverBuffer, this.modelDir === null)
  }

  private hasWorkQuietly(): boolean {
    if (this.closed || this.failure !== null) return false
    return this.quietly(() => this.core.hasPendingWork(), false)
  }
}

function backendOf(engineClass: { _backend: Backend | null }): Backend {
  const backend = engineClass._backend
  if (backend === null) {
    throw new OrtexError('UNSUPPORTED', "import Engine from 'ortex' (native) or 'ortex/wasm' (WebAssembly)")
  }
  return backend
}

function closedError(): OrtexError {
  return new OrtexError('ENGINE_CLOSED', 'the engine is closed')
}

function unhealthyError(code: EventErrorCode): OrtexError {
  return new OrtexError('ENGINE_UNHEALTHY', `the engine is unhealthy after an engine-level failure (${code}); close it`)
}

function frozenConfig(view: ConfigView): EngineConfig {
  return { ...view, eosTokenIds: Object.freeze([...view.eosTokenIds]) as number[] }
}
