// The Engine facade: one class over both bindings. The entry points (index.ts for the native
// addon, wasm.ts for WebAssembly) each export a subclass that names its backend; everything else
// is shared, so the two behave the same.
//
// The facade owns ergonomics, not engine logic: it validates arguments, serializes run() calls,
// routes each run's events to their Turns (whoever runs the engine), runs the driven loop, and
// reports collected Requests to the core. Scheduling, KV and sampling are the core's.

import type { Backend } from './backend'
import { EVENT_STRIDE, type CoreEngine, type NativeCoreEngine } from './binding'
import { Driver, type DriverHost } from './driver'
import { OrtexError, toOrtexError } from './errors'
import {
  EventBuffer,
  EventFlags,
  type EventOwner,
  W,
  errorCodeOf,
  finishReasonOf,
  usageAt,
} from './events'
import type { ConfigView, RequestOptionsInput } from './generated/boundary'
import { Request, type RequestRecord } from './request'
import type { Turn, TurnState } from './turn'
import type {
  BackendKind,
  EngineConfig,
  EngineOptions,
  EngineStats,
  EventErrorCode,
  ExecutorStats,
  GenerateOptions,
  RequestOptions,
  SimulatedOptions,
} from './types'
import * as v from './validate'

/** Capacity of the driven loop's own event buffer. One run writes at most one event per
 *  affected request; the rest is retained and drained by the next runs. */
const DRIVER_BUFFER_CAPACITY = 1024

/** Events that show a run moved something (CapacityBlocked alone does not). */
const PROGRESS_FLAGS = EventFlags.Token | EventFlags.TurnFinished | EventFlags.Failed | EventFlags.Retryable

/** Why an engine stopped serving: an engine-level failure, or close(). */
export type EngineEndReason = 'engine_failure' | 'engine_closed'

interface EngineInit {
  core: CoreEngine
  backend: Backend
}

function noop(): void {}

/**
 * One registry for every engine, never collected: Node 20's V8 stops running FinalizationRegistry
 * cleanups for good once a registry is collected while one of its cleanups is queued, so a
 * registry per engine could silently end reclamation in the whole process. The held value points
 * at the engine weakly, so the registry keeps no engine alive.
 */
const REQUEST_REGISTRY = new FinalizationRegistry<{ engine: WeakRef<Engine>; record: RequestRecord }>(
  ({ engine, record }) => engine.deref()?._onRequestCollected(record),
)

export class Engine implements EventOwner {
  /** @internal The backend of this entry point's Engine class (set by the subclass). */
  static _backend: Backend | null = null

  /** An ONNX model folder. */
  static async load(modelDir: string, options?: EngineOptions): Promise<Engine> {
    const dir = v.string('modelDir', modelDir)
    if (dir.length === 0) throw v.invalidArgumentFor('modelDir', 'must not be empty')
    const checked = v.engineOptions('options', options)
    const backend = backendOf(this)
    const core = await backend.load(dir, checked).catch((error: unknown) => {
      throw toOrtexError(error, 'MODEL_LOAD')
    })
    return new this({ core, backend } satisfies EngineInit as never)
  }

  /** The deterministic simulated model. */
  static simulated(options?: SimulatedOptions): Engine {
    const checked = v.simulatedOptions('options', options)
    const backend = backendOf(this)
    let core: CoreEngine
    try {
      core = backend.simulated(checked)
    } catch (error) {
      // A missing binding is already an OrtexError (UNSUPPORTED); anything else that is not one of
      // the core's coded errors is an internal failure, never "unsupported".
      throw toOrtexError(error)
    }
    return new this({ core, backend } satisfies EngineInit as never)
  }

  readonly backend: BackendKind
  /** Resolved configuration. */
  readonly config: Readonly<EngineConfig>

  /** @internal */
  readonly _core: CoreEngine
  /** @internal */
  _closed = false
  /** @internal Set by an engine-level Failed event (or an internal error): the engine is
   *  unhealthy and this is the event's error code. */
  _failure: EventErrorCode | null = null
  private readonly backendImpl: Backend
  /** Every Request the program may still hold, by id. Weak: the facade never keeps one alive. */
  private readonly requests = new Map<number, WeakRef<Request>>()
  /** The unfinished turn of each request, by request id: where run() routes events. */
  private readonly turns = new Map<number, TurnState>()
  private readonly driver: Driver
  private driverBuffer: EventBuffer | null = null
  /** The last run() in the queue; run() calls execute one after another. */
  private runTail: Promise<unknown> = Promise.resolve()
  private runsQueued = 0
  /** stats().steps as last seen by the driven loop, to tell a prefill step from a stall. */
  private lastSteps = -1
  private closing: Promise<void> | null = null
  /** Told once when the engine fails (an engine-level failure) or is closed. */
  private readonly endListeners = new Set<(reason: EngineEndReason) => void>()

  /** Engines are made by Engine.simulated() and Engine.load(). */
  protected constructor(init: never) {
    const { core, backend } = init as EngineInit
    this._core = core
    this.backendImpl = backend
    this.backend = backend.kind
    this.config = Object.freeze(frozenConfig(core.config()))
    const host: DriverHost = {
      _driveOnce: () => this.driveOnce(),
      _hasWorkQuietly: () => this.hasWorkQuietly(),
      _pinRequests: (driven) => this.pinRequests(driven),
    }
    this.driver = new Driver(host)
  }

  createRequest(options?: RequestOptions): Request {
    const json = v.requestOptions('options', v.options('options', options, v.REQUEST_KEYS))
    return this.newRequest(json)
  }

  /** A buffer for run/runSync of this engine; capacity 0 is allowed (every run is a no-op). */
  createEventBuffer(capacity: number): EventBuffer {
    v.capacity('capacity', capacity)
    this._checkOpen()
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
    return this.enqueueRun(buffer)
  }

  /** The same as run() on the calling thread. */
  runSync(buffer: EventBuffer): number {
    this.checkRun(buffer)
    if (this.runsQueued > 0) {
      throw new OrtexError('RUN_IN_PROGRESS', 'a run() of this engine has not finished yet; await it first')
    }
    const written = this._call(() => this._core.runSync(buffer._words, buffer.capacity))
    const count = this.dropEventsOfCollectedRequests(buffer._words, written)
    buffer._count = count
    this.route(buffer._words, count)
    return count
  }

  /** True while any turn is queued or active, any prefill is queued, any event is retained, or a
   *  dropped request awaits reclamation. */
  hasPendingWork(): boolean {
    this._checkOpen()
    return this._call(() => this._core.hasPendingWork())
  }

  stats(): EngineStats {
    this._checkOpen()
    return this._call(() => this._core.stats())
  }

  /** Addition: the ONNX executor's cumulative timings; null for the simulated model. */
  executorStats(): ExecutorStats | null {
    this._checkOpen()
    const core = this._core as Partial<NativeCoreEngine>
    return core.executorStats === undefined ? null : this._call(() => core.executorStats!())
  }

  tokenize(text: string): Int32Array {
    v.string('text', text)
    this._checkOpen()
    return this._call(() => this._core.tokenize(text))
  }

  detokenize(tokens: ArrayLike<number>): string {
    const ids = v.tokens('tokens', tokens)
    this._checkOpen()
    return this._call(() => this._core.detokenize(ids))
  }

  /** Driven mode: an internal loop runs the engine and routes events to turns. */
  start(): void {
    this._checkOpen()
    this.driver.start()
  }

  /** Back to caller-driven mode once the current transaction commits. */
  stop(): Promise<void> {
    if (this._closed) return Promise.reject(closedError())
    return this.driver.stop()
  }

  /**
   * A turn on its own request, which is closed when the turn finishes (its `done` still resolves
   * with everything). Implies start().
   */
  generate(input: string | ArrayLike<number>, options?: GenerateOptions): Turn {
    const checkedInput = v.input('input', input)
    const present = v.options('options', options, [...v.REQUEST_KEYS, ...v.TURN_KEYS])
    const requestPresent = new Map<string, unknown>()
    for (const key of v.REQUEST_KEYS) {
      if (present.has(key)) {
        requestPresent.set(key, present.get(key))
        present.delete(key)
      }
    }
    const requestJson = v.requestOptions('options', requestPresent)
    const checked = v.turnOptions('options', present)
    const request = this.newRequest(requestJson)
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

  /**
   * Closes every request (pending `done` promises resolve 'cancelled'); afterwards every call but
   * close() and Request.close() throws ENGINE_CLOSED. Resolves once a transaction in flight has
   * returned.
   */
  close(): Promise<void> {
    if (this.closing !== null) return this.closing
    this._closed = true
    void this.driver.stop()
    for (const state of [...this.turns.values()]) state.finish('cancelled', 'none', null)
    for (const request of this.liveRequests()) request._closeForEngine()
    try {
      this._core.close()
    } catch {
      // Closing is best effort and never throws.
    }
    this.notifyEnd('engine_closed')
    this.closing = this.runTail.then(noop, noop)
    return this.closing
  }

  /** Test hook: runs the core's accounting invariants (blocks conserved, retained events
   *  counted, ...) and throws if one is broken. Cheap enough to call after every run. */
  checkInvariants(): void {
    this._checkOpen()
    this._call(() => this._core.checkInvariants())
  }

  // ---------------------------------------------------------------------------------------------
  // For Request, Turn and EventBuffer
  // ---------------------------------------------------------------------------------------------

  /** @internal */
  _requestById(id: number): Request | null {
    return this.requests.get(id)?.deref() ?? null
  }

  /** @internal Calls the binding and converts what it throws into an OrtexError. */
  _call<T>(fn: () => T): T {
    try {
      return fn()
    } catch (error) {
      throw this.convertError(error)
    }
  }

  /** @internal */
  _checkOpen(): void {
    if (this._closed) throw closedError()
  }

  /** @internal Open and healthy: what createRequest, beginTurn and a queued run need. */
  _checkUsable(): void {
    this._checkOpen()
    if (this._failure !== null) throw unhealthyError(this._failure)
  }

  /** @internal Text is tokenized here; token ids pass through. */
  _inputTokens(input: string | Int32Array): Int32Array {
    const tokens = typeof input === 'string' ? this._call(() => this._core.tokenize(input)) : input
    if (tokens.length === 0) throw v.invalidArgumentFor('input', 'is empty')
    return tokens
  }

  /** @internal For Turn's text: never throws (a closed engine still decodes until its core is
   *  gone; then there is no text). */
  _detokenizeQuietly(tokens: Int32Array): string {
    try {
      return this._core.detokenize(tokens)
    } catch {
      return ''
    }
  }

  /** @internal Turn.cancel and AbortSignal: never throws. */
  _cancelTurnQuietly(requestId: number, turnId: number): boolean {
    if (this._closed) return false
    try {
      const cancelled = this._core.cancelTurn(requestId, turnId)
      if (cancelled) this.driver.kick()
      return cancelled
    } catch {
      return false
    }
  }

  /** @internal New work may be ready for the driven loop. */
  _wake(): void {
    this.driver.kick()
  }

  /** @internal Iterating a turn starts the loop; never throws. */
  _ensureStarted(): void {
    if (!this._closed) this.driver.start()
  }

  /** @internal */
  _turnBegun(state: TurnState, request: Request): void {
    const previous = this.turns.get(state.requestId)
    if (previous !== undefined && !previous.finished) {
      // Request._begin refuses this; reaching here would lose a turn's `done` for good.
      throw new Error(`internal error: turn ${state.turnId} of request ${state.requestId} replaces unfinished turn ${previous.turnId}`)
    }
    this.turns.set(state.requestId, state)
    if (this.driver.driven) state.pinned = request
    this.driver.kick()
  }

  /** @internal */
  _turnFinished(state: TurnState): void {
    if (this.turns.get(state.requestId) === state) this.turns.delete(state.requestId)
    state.ownedRequest?.close()
  }

  /** @internal Calls `listener` once when the engine fails or is closed (at once if it already
   *  has); returns a function that removes it. The duplex sessions close on it. */
  _onEnd(listener: (reason: EngineEndReason) => void): () => void {
    if (this._closed || this._failure !== null) {
      listener(this._closed ? 'engine_closed' : 'engine_failure')
      return noop
    }
    this.endListeners.add(listener)
    return () => this.endListeners.delete(listener)
  }

  /** @internal A closed request freed its blocks: a request waiting for capacity may fit now. */
  _requestClosed(_request: Request): void {
    this.driver.kick()
  }

  // ---------------------------------------------------------------------------------------------
  // Internals
  // ---------------------------------------------------------------------------------------------

  private newRequest(options: RequestOptionsInput): Request {
    this._checkUsable()
    const id = this._call(() => this._core.createRequest(options))
    const request = Request._create(this, id)
    this.requests.set(id, new WeakRef(request))
    // The record, not the Request, is the held value; it stays registered after close() so the
    // map entry goes when the Request does (events read after a close still name it).
    REQUEST_REGISTRY.register(request, { engine: new WeakRef(this), record: request._record })
    return request
  }

  /** @internal Called by the shared FinalizationRegistry when a Request of this engine is gone. */
  _onRequestCollected(record: RequestRecord): void {
    const ref = this.requests.get(record.id)
    if (ref !== undefined && ref.deref() === undefined) this.requests.delete(record.id)
    if (record.closed || this._closed) return
    try {
      this._core.abandonRequest(record.id)
    } catch {
      // Reclamation is the core's; an engine that cannot take the note has nothing to reclaim.
    }
    // The core drops a reclaimed request's events: its turn ends here.
    this.turns.get(record.id)?.finish('cancelled', 'none', null)
    this.driver.kick()
  }

  private *liveRequests(): Iterable<Request> {
    for (const ref of this.requests.values()) {
      const request = ref.deref()
      if (request !== undefined) yield request
    }
  }

  private pinRequests(driven: boolean): void {
    for (const state of this.turns.values()) {
      state.pinned = driven ? (this._requestById(state.requestId) ?? state.ownedRequest) : state.ownedRequest
    }
  }

  private checkRun(buffer: EventBuffer): void {
    if (!(buffer instanceof EventBuffer)) {
      throw v.invalidArgumentFor('buffer', `must be an EventBuffer, got ${v.describe(buffer)}`)
    }
    this._checkOpen()
    if (buffer._engine !== this) {
      throw new OrtexError('WRONG_ENGINE', 'the event buffer belongs to another engine')
    }
    if (this.driver.driven) {
      throw new OrtexError('ENGINE_DRIVEN', 'the engine is driven by start()/generate(); call stop() first')
    }
    if (this._failure !== null) throw unhealthyError(this._failure)
  }

  /** Runs `buffer` after the runs already queued, or at once when there are none (the driven
   *  loop's case: while driven, run() is refused, so nothing else queues). */
  private enqueueRun(buffer: EventBuffer): Promise<number> {
    // A queued run starts however the one before it ended.
    const next = () => this.runNow(buffer)
    const ahead = this.runsQueued++
    const run = ahead === 0 ? next() : this.runTail.then(next, next)
    this.runTail = run
    return run
  }

  /** One run of the queue; leaves it (runsQueued) before its promise settles. */
  private async runNow(buffer: EventBuffer): Promise<number> {
    try {
      this._checkUsable()
      let count: number
      try {
        count = await this.backendImpl.run(this._core, buffer._words, buffer.capacity)
      } catch (error) {
        throw this.convertError(error)
      }
      count = this.dropEventsOfCollectedRequests(buffer._words, count)
      buffer._count = count
      this.route(buffer._words, count)
      return count
    } finally {
      this.runsQueued--
    }
  }

  /**
   * Removes, in place, the events of requests the program dropped and the garbage collector took
   * before the FinalizationRegistry said so: nobody can receive them, and an event whose request
   * reads as null would pass for an engine-level one. Returns the new count.
   *
   * WeakRef.deref() keeps a live request alive until the current job ends (ECMAScript's
   * KeepDuringJob), so a collection later in the same job as this run cannot take a request this
   * run saw; the next job can. That is the price of never handing out an event without its request.
   */
  private dropEventsOfCollectedRequests(words: Int32Array, count: number): number {
    let kept = 0
    let lastId = 0
    for (let i = 0; i < count; i++) {
      const base = i * EVENT_STRIDE
      const requestId = words[base + W.request]!
      if (requestId !== 0 && requestId !== lastId) {
        if (this.requests.get(requestId)?.deref() === undefined) {
          this.abandonCollected(requestId)
          continue
        }
        lastId = requestId
      }
      if (kept !== i) words.copyWithin(kept * EVENT_STRIDE, base, base + EVENT_STRIDE)
      kept++
    }
    return kept
  }

  private abandonCollected(requestId: number): void {
    this.requests.delete(requestId)
    try {
      this._core.abandonRequest(requestId)
    } catch {
      // An engine that cannot take the note has nothing left to reclaim.
    }
    this.turns.get(requestId)?.finish('cancelled', 'none', null)
  }

  /**
   * Hands each event to its turn: tokens are appended, a finish resolves `done`. Reads the words
   * directly; nothing is allocated for a token event of a turn nobody iterates. Returns whether
   * any event showed progress.
   */
  private route(words: Int32Array, count: number): boolean {
    let progressed = false
    for (let i = 0; i < count; i++) {
      const base = i * EVENT_STRIDE
      const flags = words[base + W.flags]!
      if ((flags & PROGRESS_FLAGS) !== 0) progressed = true
      const requestId = words[base + W.request]!
      if (requestId === 0) {
        if ((flags & EventFlags.Failed) !== 0) this.markUnhealthy(errorCodeOf(words[base + W.error]!))
        continue
      }
      if ((flags & (EventFlags.Token | EventFlags.TurnFinished)) === 0) continue
      const turn = this.turns.get(requestId)
      if (turn === undefined || turn.turnId !== words[base + W.turn]) continue
      if ((flags & EventFlags.Token) !== 0) turn.pushToken(words[base + W.token]!)
      if ((flags & EventFlags.TurnFinished) !== 0) {
        turn.finish(
          finishReasonOf(words[base + W.finish]!),
          errorCodeOf(words[base + W.error]!),
          usageAt(words, base),
        )
      }
    }
    return progressed
  }

  /** An engine-level failure: every pending turn resolves 'failed' with the event's code. */
  private markUnhealthy(code: EventErrorCode): void {
    if (this._failure !== null) return
    this._failure = code
    for (const state of [...this.turns.values()]) state.finish('failed', code, null)
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
    if (converted.code === 'ENGINE_UNHEALTHY' && !this._closed) {
      // An internal error (a WebAssembly trap, say) leaves the engine unusable, as does a core
      // that reports itself unhealthy before its Failed event reached us.
      this.markUnhealthy('engine-execution-failure')
    }
    return converted
  }

  private driveOnce(): Promise<boolean> {
    this.driverBuffer ??= EventBuffer._create(this, DRIVER_BUFFER_CAPACITY)
    const buffer = this.driverBuffer
    return this.enqueueRun(buffer).then(() => this.lastRunProgressed(buffer))
  }

  /** A run with only CapacityBlocked events (or none) may still have prefilled a prompt chunk;
   *  the step counter tells. */
  private lastRunProgressed(buffer: EventBuffer): boolean {
    const words = buffer._words
    for (let i = 0; i < buffer._count; i++) {
      if ((words[i * EVENT_STRIDE + W.flags]! & PROGRESS_FLAGS) !== 0) return true
    }
    if (this._closed || this._failure !== null) return false
    let steps: number
    try {
      steps = this._core.stats().steps
    } catch {
      return false
    }
    const moved = steps !== this.lastSteps
    this.lastSteps = steps
    return moved
  }

  private hasWorkQuietly(): boolean {
    if (this._closed || this._failure !== null) return false
    try {
      return this._core.hasPendingWork()
    } catch {
      return false
    }
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
