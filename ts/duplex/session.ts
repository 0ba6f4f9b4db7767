// DuplexSession: one full-duplex conversation over one engine Request (docs/api.md "Full-duplex
// sessions"). Every command asks the core's session rules first (fences, leases, idempotent
// appends, cancel, close), then has the runner do the engine work. The session owns no rule of
// its own: it validates arguments, keeps the core's latest view, and orchestrates.
//
//   open ──append*──▶ final append ──▶ response (a Turn) ──▶ ... ──close / expire──▶ closed
//            ▲                              │ cancel (barge-in): epoch + 1, the Turn cancelled
//            └──────────────────────────────┘ in the same tick, appends accepted at once

import type { Engine } from '../engine'
import type { DuplexHost } from '../link'
import { OrtexError, invalidArgument } from '../errors'
import type { Request, Turn } from '../request'
import type { TurnOptions } from '../types'
import * as opts from '../options'
import * as v from '../validate'
import type { SessionRules, SessionView } from './core'
import type { Fence, SessionEvent, SessionEventQueue, SessionState } from './events'
import { MAX_QUEUED_RESPONSES } from './feed'
import { CANCELLED, type ResponseEnding } from './response'
import { Runner } from './runner'

/** When a response starts: on the final append of a user turn (default), or only by respond(). */
export type RespondMode = 'on-final' | 'manual'

export interface DuplexSessionOptions {
  /** Default: a random UUID. */
  sessionId?: string
  /** Options of every response (respond() may override them). */
  turn?: TurnOptions
  respond?: RespondMode
}

/** A session's replaceable configuration (session.update in the protocol). */
export interface DuplexSessionConfig {
  turn?: TurnOptions
  respond?: RespondMode
}

export interface DuplexAppendOptions {
  /** Ends the user turn ('on-final': starts the response). */
  final?: boolean
  /** Makes the append idempotent: a retry with the same id and input returns the first result. */
  operationId?: string
  /** The fence the caller believes current; a stale one is FENCE_MISMATCH. */
  fence?: Fence
}

export interface DuplexAppendResult {
  /** Position of the append in the current epoch, from 1. */
  seq: number
  /** Position of the append in its user turn, from 1. */
  turnSeq: number
  /** The user turn the input belongs to. */
  turnId: number
  final: boolean
  /** True when answered from the completed-append cache: nothing was applied again. */
  replayed: boolean
  /** The session's fence after the append. */
  fence: Fence
}

export interface DuplexTruncateOptions {
  /** The fence of the response to truncate (its response.* events carry it); default: the
   *  latest response. */
  fence?: Fence
}

/** What a session needs from its manager. */
export interface SessionHost {
  readonly engine: Engine
  /** What the session needs of its engine beyond the public API. */
  readonly duplex: DuplexHost
  readonly rules: SessionRules
  readonly now: () => number
  /** The second phase of a close: frees the session's slot. */
  finalize(session: DuplexSession): Fence
  /** A commit point: what a session store keeps of the session changed. */
  committed(session: DuplexSession): void
}

/** A response that ended, as a session store keeps it: its output is `length` tokens of the
 *  stored conversation from `start` (0 and 0 when it never began). */
export interface EndedResponse {
  fence: Fence
  start: number
  length: number
}

/** What a session store keeps of a session (ts/store/session-store.ts; internal). */
export interface SessionSnapshot {
  tokens: Int32Array
  pendingResponses: Fence[]
  endedResponses: EndedResponse[]
  /** The core's continuation (fence position, append counters, completed appends), as JSON. */
  continuation: string
  config: string
}

/** @internal What DuplexSession's constructor takes. */
export interface SessionInit {
  host: SessionHost
  request: Request
  view: SessionView
  config: Required<DuplexSessionConfig>
  events: SessionEventQueue
}

export class DuplexSession {
  readonly id: string
  private view: SessionView
  private config: Required<DuplexSessionConfig>
  private readonly host: SessionHost
  private readonly runner: Runner
  private readonly events_: SessionEventQueue
  private finalized = false

  /** Sessions are made by DuplexSessionManager.open(). */
  private constructor(init: SessionInit) {
    const { host, request, view, config, events } = init
    this.id = view.fence.sessionId
    this.host = host
    this.view = view
    this.config = config
    this.events_ = events
    this.runner = new Runner(
      {
        sessionId: this.id,
        engine: host.engine,
        request,
        rules: host.rules,
        now: host.now,
        events,
        fence: view.fence,
        maxSessionTokens: host.engine.config.maxLength,
      },
      { engineFailed: (reason) => this.endAfterEngineFailure(reason), committed: () => this.committed() },
    )
  }

  /** @internal */
  static _create(init: SessionInit): DuplexSession {
    return new DuplexSession(init)
  }

  /** The session's current fence. */
  get fence(): Fence {
    return { ...this.view.fence }
  }

  get state(): SessionState {
    if (this.finalized) return 'closed'
    if (this.runner.run.closing) return 'closing'
    return this.view.state
  }

  /** Starts at 0; each successful resume() increments it. */
  get leaseGeneration(): number {
    return this.view.leaseGeneration
  }

  /** Whether a response has not ended yet: queued, running, or still being delivered. */
  get responding(): boolean {
    return this.runner.responding
  }

  /** How responses start (see DuplexSessionConfig). */
  get respondMode(): RespondMode {
    return this.config.respond
  }

  /**
   * Appends user input. It is prefilled as it arrives (the newest token is held back until the
   * response starts); while a response runs it waits in the session and goes in, in order, when
   * that response ends or is cancelled. A final append ends the user turn and, in 'on-final'
   * mode, starts a response. An empty input is allowed only for a final append (a commit).
   */
  append(input: string | ArrayLike<number>, opts?: DuplexAppendOptions): DuplexAppendResult {
    const checkedInput = v.input('input', input)
    const present = v.options('opts', opts, ['final', 'operationId', 'fence'])
    const isFinal = present.has('final') ? v.boolean('opts.final', present.get('final')) : false
    const operationId = present.has('operationId') ? v.text('opts.operationId', present.get('operationId')) : null
    const fence = present.has('fence') ? checkFence('opts.fence', present.get('fence')) : null
    this.checkOpen()
    const tokens = this.inputTokens(checkedInput)
    if (tokens.length === 0 && !isFinal) throw invalidArgument('input is empty (only a final append may be empty)')
    // The clock is read once, before anything is reserved: a clock that fails leaves nothing held.
    const now = this.host.now()
    const rules = this.host.rules
    const plan = rules.prepareAppend(this.id, { fence, final: isFinal, operationId, inputDigest: digestOf(tokens) })
    if (plan.reservation === 0) {
      rules.touch(this.id, now, 'append')
      return { ...plan.result, fence: this.fence }
    }
    const respondNow = isFinal && this.config.respond === 'on-final'
    let committed: ReturnType<SessionRules['commitAppend']>
    try {
      this.applyAppend(tokens, respondNow)
      committed = rules.commitAppend(plan.reservation, now)
    } catch (error) {
      // Whatever fails between the reservation and its commit releases the reservation.
      rules.discardReservation(plan.reservation)
      throw error
    }
    this.setView(committed.session)
    if (respondNow) this.startResponse(tokens, this.config.turn, now)
    this.committed()
    return { ...committed.result, fence: this.fence }
  }

  /** The engine part of an append, between its reservation and its commit, so that a refusal
   *  leaves nothing counted. A final append in 'on-final' mode gives its input to the response. */
  private applyAppend(tokens: Int32Array, respondNow: boolean): void {
    const feed = this.runner.feed
    if (!feed.hasRoomFor(tokens.length)) {
      throw invalidArgument(`input of ${tokens.length} tokens does not fit the session's context of ${this.host.engine.config.maxLength}`)
    }
    if (respondNow && tokens.length === 0 && !feed.hasContext()) {
      throw invalidArgument('the session has no input to respond to')
    }
    if (respondNow && feed.queuedResponses() >= MAX_QUEUED_RESPONSES) {
      throw new OrtexError('CAPACITY_EXHAUSTED', `session ${this.id} has ${MAX_QUEUED_RESPONSES} responses waiting; cancel or wait`)
    }
    if (!respondNow) feed.addInput(tokens)
  }

  /** Starts a response now (for 'manual' mode, or to respond again). Throws TURN_ACTIVE while a
   *  response runs and EVENTS_PENDING while a cancelled one has not finished in the engine. */
  respond(options?: TurnOptions): Turn {
    this.host.engine._validateTurnOptions(options)
    this.checkOpen()
    this.host.duplex.checkUsable()
    const feed = this.runner.feed
    const readiness = feed.readiness()
    if (readiness === 'turn-active') {
      throw new OrtexError('TURN_ACTIVE', `session ${this.id} has a response running; cancel() it first`)
    }
    if (readiness === 'events-pending') {
      throw new OrtexError(
        'EVENTS_PENDING',
        `session ${this.id}: the cancelled response has not finished in the engine yet; the engine must run first`,
      )
    }
    if (!feed.hasContext()) throw invalidArgument(`session ${this.id} has no input to respond to`)
    if (!feed.hasRoomFor(1)) throw invalidArgument(`session ${this.id} has no room left in its context`)
    const view = this.host.rules.startResponse(this.id, this.host.now())
    this.setView(view)
    const turn = this.runner.respondNow(view.fence, { ...this.config.turn, ...options })
    this.committed()
    return turn
  }

  /**
   * Barge-in: cancels the response (and any queued one), advances the epoch and returns the new
   * fence, all in this call. Nothing of a cancelled response is delivered after its
   * response.done {status: 'cancelled'}; what it generated stays in context (see truncate()).
   * With the fence of an older cancel (a retry), it only cleans up what that fence left.
   */
  cancel(cancelled?: Fence): Fence {
    const fence = cancelled === undefined ? null : checkFence('cancelled', cancelled)
    this.checkOpen()
    const outcome = this.host.rules.cancel(this.id, fence, this.host.now())
    this.setView(outcome.session)
    if (outcome.advanced) {
      const epoch = outcome.fence.epoch
      this.runner.cancelResponses((response) => response.fence.epoch < epoch)
    } else {
      this.runner.cancelResponses((response) => sameFence(response.fence, outcome.cancelled))
    }
    this.committed()
    return { ...outcome.fence }
  }

  /**
   * Keeps only the first `playedTokens` tokens of the latest response in the context (an
   * addition, after the OpenAI Realtime API's conversation.item.truncate): the client confirms
   * what it played, and the rest is dropped with its KV. The latest response must still be the
   * end of the context (no input appended after it). Applied once that response's turn has
   * finished in the engine.
   */
  truncate(playedTokens: number, opts?: DuplexTruncateOptions): void {
    v.integer('playedTokens', playedTokens)
    const present = v.options('opts', opts, ['fence'])
    const fence = present.has('fence') ? checkFence('opts.fence', present.get('fence')) : null
    this.checkOpen()
    const feed = this.runner.feed
    const response = feed.lastResponse
    if (response === null || feed.inputSinceLastResponse) {
      throw invalidArgument(`session ${this.id} has no response at the end of its context to truncate`)
    }
    if (fence !== null && !sameFence(fence, response.fence)) {
      throw new OrtexError('FENCE_MISMATCH', `truncate names another response than the latest one of session ${this.id}`)
    }
    feed.addTruncate(response, playedTokens)
  }

  /** Replaces the session's configuration as one generation (addition; session.update in the
   *  protocol). Returns the configuration generation. */
  update(config: DuplexSessionConfig): number {
    const checked = checkConfig('config', config, this.host.engine)
    this.checkOpen()
    const next = { ...this.config, ...checked }
    const generation = this.host.rules.replaceConfigs(this.id, {
      session: { respond: next.respond, turn: JSON.stringify(turnJson(next.turn)) },
    })
    this.config = next
    this.setView(this.host.rules.view(this.id))
    this.committed()
    return generation
  }

  /** Records client activity that keeps the session from idling out (addition). */
  heartbeat(): void {
    this.checkOpen()
    this.host.rules.touch(this.id, this.host.now(), 'heartbeat')
  }

  /** The client went away; the session waits disconnectGraceMs for a resume. The lease
   *  generation is kept. */
  detach(): void {
    this.checkOpen()
    this.setView(this.host.rules.detach(this.id, this.host.now()))
    this.committed()
  }

  /** Compare-and-swap: succeeds only when `expectedLeaseGeneration` is the current one, then
   *  increments it and returns the new value (LEASE_GENERATION_MISMATCH otherwise). */
  resume(expectedLeaseGeneration: number): number {
    v.integer('expectedLeaseGeneration', expectedLeaseGeneration, 0, Number.MAX_SAFE_INTEGER)
    this.checkOpen()
    this.setView(this.host.rules.resume(this.id, this.host.now(), expectedLeaseGeneration))
    return this.view.leaseGeneration
  }

  /** Closes the session: the response (if any) is cancelled, the request closed (its KV freed),
   *  the slot freed; resolves once the terminal session.closed event has been queued. */
  close(reason?: string): Promise<void> {
    if (this.runner.run.closing) return this.runner.terminal
    try {
      const why = reason === undefined ? 'client_close' : v.text('reason', reason)
      this.host.rules.beginClose(this.id, null, why)
      this.end(why, 'session.closed')
    } catch (error) {
      // An async method rejects; it never throws.
      return Promise.reject(error)
    }
    return this.runner.terminal
  }

  /** The session's events, in order; iteration ends after session.closed / session.expired.
   *  Deltas wait for room in a bounded buffer: a response is paced by its reader. */
  events(): AsyncIterable<SessionEvent> {
    return this.events_
  }

  /** Why the session closed (null while it is open). */
  get closeReason(): string | null {
    return this.runner.run.closeReason
  }

  /** @internal What a session store keeps: the committed conversation, the responses that have
   *  not ended and the latest that did, the core's continuation, the configuration. */
  _snapshot(): SessionSnapshot {
    const conversation = this.runner.snapshot()
    return {
      tokens: conversation.tokens,
      pendingResponses: conversation.pending,
      endedResponses: conversation.ended,
      continuation: JSON.stringify(this.host.rules.continuation(this.id)),
      config: JSON.stringify({ turn: turnJson(this.config.turn), respond: this.config.respond }),
    }
  }

  /** @internal A session rebuilt from a store (opened by the core at its stored incarnation and
   *  lease generation): its conversation is prefilled. */
  _restore(tokens: Int32Array): void {
    if (tokens.length > 0) {
      if (!this.runner.feed.hasRoomFor(tokens.length)) {
        throw invalidArgument(`the stored conversation of ${tokens.length} tokens does not fit the context of ${this.host.engine.config.maxLength}`)
      }
      this.runner.feed.addInput(tokens)
    }
  }

  /** A commit point: the host (a session store) is told, unless the session is closing. */
  private committed(): void {
    if (!this.runner.run.closing) this.host.committed(this)
  }

  /** @internal The event queue itself (the server puts back an event it could not send). */
  get _eventQueue(): SessionEventQueue {
    return this.events_
  }

  /** @internal collectExpired began the close in the core. */
  _expire(reason: string, fence: Fence): void {
    this.view = { ...this.view, fence, state: 'closing' }
    this.end(reason, 'session.expired')
  }

  // ---------------------------------------------------------------------------------------------

  /** @internal The engine failed or was closed: the session closes with that reason; a running
   *  response ends 'failed' (a failure) or 'cancelled' (a close), as its turn did. */
  _endForEngine(reason: 'engine_failure' | 'engine_closed'): void {
    const failure = this.host.duplex.failure
    const ending: ResponseEnding =
      reason === 'engine_failure' ? { status: 'failed', finishReason: 'failed', errorCode: failure ?? 'engine-execution-failure' } : CANCELLED
    this.endAfterEngineFailure(reason, ending)
  }

  private end(reason: string, kind: 'session.closed' | 'session.expired', ending: ResponseEnding = CANCELLED): void {
    this.runner.terminate(reason, kind, ending)
    const fence = this.host.finalize(this)
    this.finalized = true
    this.view = { ...this.view, fence, state: 'closed' }
    this.runner.finishClose(fence)
  }

  private endAfterEngineFailure(reason: string, ending: ResponseEnding = CANCELLED): void {
    if (this.runner.run.closing) return
    try {
      this.host.rules.beginClose(this.id, null, reason)
    } catch {
      // Already closing in the core: the runner's half still has to run.
    }
    this.end(reason, 'session.closed', ending)
  }

  private setView(view: SessionView): void {
    this.view = view
    this.runner.run.fence = view.fence
  }

  private checkOpen(): void {
    if (this.runner.run.closing) {
      throw new OrtexError('SESSION_CLOSED', `session ${this.id} is closed: ${this.runner.run.closeReason ?? 'closed'}`)
    }
  }

  private inputTokens(input: string | Int32Array): Int32Array {
    const engine = this.host.engine
    if (typeof input === 'string') return input.length === 0 ? new Int32Array(0) : engine.tokenize(input)
    const vocab = engine.config.vocabSize
    for (let i = 0; i < input.length; i++) {
      const token = input[i]!
      if (token < 0 || token >= vocab) throw invalidArgument(`input[${i}] is ${token}, outside the vocabulary of ${vocab}`)
    }
    // A copy: input that waits behind a running response must not change if the caller reuses
    // its array.
    return input.slice()
  }

  private startResponse(input: Int32Array, options: TurnOptions, now: number): void {
    const view = this.host.rules.startResponse(this.id, now)
    this.setView(view)
    this.runner.queueResponse(view.fence, input, options)
  }
}

// -----------------------------------------------------------------------------------------------

export function sameFence(a: Fence, b: Fence): boolean {
  return (
    a.sessionId === b.sessionId &&
    a.incarnation === b.incarnation &&
    a.epoch === b.epoch &&
    a.turnId === b.turnId &&
    a.responseSeq === b.responseSeq
  )
}

const FENCE_KEYS = ['sessionId', 'incarnation', 'epoch', 'turnId', 'responseSeq'] as const

/** A fence argument: exactly its five fields. */
export function checkFence(name: string, value: unknown): Fence {
  const present = v.options(name, value, FENCE_KEYS)
  for (const key of FENCE_KEYS) {
    if (!present.has(key)) throw invalidArgument(`${name}.${key} is missing`)
  }
  return {
    sessionId: v.sessionId(`${name}.sessionId`, present.get('sessionId')),
    incarnation: v.integer(`${name}.incarnation`, present.get('incarnation'), 0, Number.MAX_SAFE_INTEGER),
    epoch: v.integer(`${name}.epoch`, present.get('epoch'), 0, Number.MAX_SAFE_INTEGER),
    turnId: v.integer(`${name}.turnId`, present.get('turnId'), 0, Number.MAX_SAFE_INTEGER),
    responseSeq: v.integer(`${name}.responseSeq`, present.get('responseSeq'), 0, Number.MAX_SAFE_INTEGER),
  }
}

/** A configuration argument (turn options are checked as beginTurn checks them, by `engine`). */
export function checkConfig(name: string, value: unknown, engine: Engine): DuplexSessionConfig {
  const present = v.options(name, value, ['turn', 'respond'])
  const out: DuplexSessionConfig = {}
  if (present.has('respond')) out.respond = v.oneOf(`${name}.respond`, present.get('respond'), ['on-final', 'manual'] as const)
  if (present.has('turn')) {
    out.turn = checkedTurn(`${name}.turn`, present.get('turn'))
    engine._validateTurnOptions(out.turn)
  }
  return out
}

/** Turn options built from the checked values only (the caller's object is read once, and its
 *  arrays are copied): the session keeps them and the core's configuration record gets them as
 *  JSON, so what was checked is what is used. */
function checkedTurn(name: string, value: unknown): TurnOptions {
  const { core, signal } = opts.turnOptions(name, v.options(name, value, opts.TURN_KEYS))
  return { ...core, ...(signal === null ? {} : { signal }) }
}

/** The serializable part of turn options, for the core's configuration record. */
function turnJson(turn: TurnOptions): Record<string, unknown> {
  const { signal: _signal, ...rest } = turn
  return rest
}

/** A 53-bit digest of the appended tokens: how the core tells a retry carrying other input from
 *  a replay (it never sees the input itself). Two FNV-1a lanes. */
export function digestOf(tokens: Int32Array): number {
  let low = 0x811c9dc5
  let high = 0x01000193 ^ tokens.length
  for (let i = 0; i < tokens.length; i++) {
    const t = tokens[i]!
    low = Math.imul(low ^ t, 0x01000193) >>> 0
    high = Math.imul(high ^ (t >>> 0) ^ 0x5bd1e995, 0x01000193) >>> 0
  }
  return (high & 0x1fffff) * 0x1_0000_0000 + low
}
