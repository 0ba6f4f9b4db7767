// One session's runner: it serializes the client's commands and the engine's outputs through one
// mailbox, in the shape of vllm-omni's DuplexSessionRunner (its shared state is described in
// vllm-omni's vllm_omni/engine/duplex/session/context.py):
//
// - DuplexRunState: the few flags more than one component reads or writes (`grep '\.run\.'`
//   finds every mutation).
// - DuplexSessionContext: the read-mostly collaborators every component is built with.
// - RunnerServices: the one thing a component may ask the runner for, a tracked task.
//
// Components:
// - EngineFeed (engine side): the session's one Request. Appended input is prefilled as it
//   arrives, except the newest token, which is held back so that a response can always start with
//   fresh input; input that arrives while a response runs waits in `ops` (the core refuses prefill
//   while a turn runs) and goes in, in order, when the turn ends or is cancelled.
// - Delivery (client side): one tracked task that turns responses into events, in order:
//   response.created, the deltas (paced by the consumer), response.done, and after a close the
//   one terminal event.
//
//   client command ─────────────┐                     ┌─▶ EngineFeed ─▶ Request (prefill, Turn)
//   (append, respond, cancel,   ├─▶ Runner (mailbox) ─┤
//    truncate, close)           │   drops what a      └─▶ Delivery ──▶ SessionEventQueue
//   engine output ──────────────┘   cancel made stale     (announce, deltas, done, terminal)
//   (turn finished, deltas)
//
// Client commands run synchronously (they return values); engine outputs are posted as mailbox
// items and handled one at a time, each checked against the response it belongs to, so that
// nothing of a response a barge-in cancelled is delivered after its response.done.

import type { Engine } from '../engine'
import { OrtexError } from '../errors'
import type { Request, Turn } from '../request'
import type { TurnCursor } from '../turn-state'
import type { EventErrorCode, FinishReason, TurnOptions, TurnResult, TurnUsage } from '../types'
import type { SessionRules } from './core'
import type { Fence, ResponseStatus, SessionEventQueue } from './events'

/** The flags several components touch. Every field is written by one component and read by
 *  another; that is the criterion for living here. */
export class DuplexRunState {
  /** An irreversible close has begun: commands are refused with SESSION_CLOSED. */
  closing = false
  /** session.closed / session.expired has left the runner. */
  closedEmitted = false
  /** The terminal event waits until the manager has finalized the close (the slot is free). */
  closeDeferred = false
  closeReason: string | null = null
  terminalKind: 'session.closed' | 'session.expired' | null = null
  /** The session's fence as of the latest core call, for the terminal event. */
  fence: Fence
  constructor(fence: Fence) {
    this.fence = fence
  }
}

/** The only thing a component may ask the runner for. */
export interface RunnerServices {
  /** Runs `task` as a tracked background task of the session. */
  spawn(task: () => Promise<void>, name: string): void
  /** Posts an engine output to the mailbox. */
  post(item: MailboxItem): void
}

/** Tracked task handles of one session. */
export class SessionTasks {
  private readonly running = new Map<Promise<void>, string>()

  track(task: Promise<void>, name: string): void {
    this.running.set(task, name)
    void task.finally(() => this.running.delete(task))
  }

  /** Names of the tasks still running (diagnostics). */
  names(): string[] {
    return [...this.running.values()]
  }
}

/** The collaborators one session's components are built with. Read-mostly: mutable flags live in
 *  `run`; the request and rules are changed through their own APIs. */
export interface DuplexSessionContext {
  readonly sessionId: string
  readonly engine: Engine
  readonly request: Request
  readonly rules: SessionRules
  readonly now: () => number
  readonly events: SessionEventQueue
  readonly run: DuplexRunState
  readonly tasks: SessionTasks
  readonly services: RunnerServices
  /** The request's token limit: appended input beyond it is refused at append time. */
  readonly maxSessionTokens: number
}

type LiveStatus = 'queued' | 'running'

/** How the runner ends a response that its turn did not end: a cancel or a close ends it
 *  'cancelled'; a failed engine ends it 'failed' with the engine's error code. */
export interface ResponseEnding {
  status: Exclude<ResponseStatus, 'completed'>
  finishReason: FinishReason
  errorCode: EventErrorCode
}

export const CANCELLED: ResponseEnding = { status: 'cancelled', finishReason: 'cancelled', errorCode: 'none' }
/** A response that could not begin (no context to respond to, or the engine refused it). */
const NO_CONTEXT: ResponseEnding = { status: 'failed', finishReason: 'failed', errorCode: 'none' }

/** One response: a Turn on the session's Request, started under `fence`. */
export class ResponseRecord {
  status: LiveStatus | ResponseStatus = 'queued'
  turn: Turn | null = null
  /** Set when the turn was cancelled in the core; its Turn may still deliver its finish. */
  turnCancelled = false
  /** How the runner ended the response, when its turn did not. */
  ending: ResponseEnding | null = null
  /** response.created was emitted. */
  announced = false
  doneEmitted = false
  /** Deltas delivered. */
  delivered = 0
  /** What reads the turn's chunks for delivery (it knows what the end added to the last one). */
  cursor: TurnCursor | null = null
  /** Context length where the response's output starts, once its turn began. */
  startTokenCount = -1
  /** The turn's new input, once it began. */
  promptTokens = 0
  /** Tokens the engine generated, once its turn finished. */
  generatedTokens = 0
  /** The lease operation that keeps the session from idling out while the response runs. */
  operationId: string | null = null
  /** Resolved when the response ends or is cancelled: wakes whatever waits on it. */
  readonly stopped: Promise<void>
  private resolveStopped!: () => void
  private changeWaiters: (() => void)[] = []

  constructor(
    readonly fence: Fence,
    /** Input to begin the turn with; null: continue from the context (the last token). */
    public input: Int32Array | null,
    readonly options: TurnOptions,
  ) {
    this.stopped = new Promise((resolve) => {
      this.resolveStopped = resolve
    })
  }

  get ended(): boolean {
    return this.status !== 'queued' && this.status !== 'running'
  }

  /** Resolves at the next status change. */
  changed(): Promise<void> {
    return new Promise((resolve) => this.changeWaiters.push(resolve))
  }

  transitionTo(status: LiveStatus | ResponseStatus): void {
    this.status = status
    if (this.ended) this.resolveStopped()
    const waiters = this.changeWaiters
    this.changeWaiters = []
    for (const wake of waiters) wake()
  }
}

export type MailboxItem =
  | { kind: 'turn-finished'; response: ResponseRecord; result: TurnResult }
  | { kind: 'announce'; response: ResponseRecord }
  | { kind: 'delta'; response: ResponseRecord; index: number; token: number; text: string }
  | { kind: 'response-done'; response: ResponseRecord; result: TurnResult }
  | { kind: 'terminal' }

type EngineOp =
  | { kind: 'prefill'; tokens: Int32Array }
  | { kind: 'begin'; response: ResponseRecord }
  | { kind: 'truncate'; response: ResponseRecord; playedTokens: number }

/** Responses one session may have waiting behind the running one (each final append in
 *  'on-final' mode queues one); beyond it a final append is refused as retryable capacity. */
export const MAX_QUEUED_RESPONSES = 16

/** Longest wait before retrying an engine op the core refused for now (retryable). */
const MAX_RETRY_BACKOFF_MS = 50

/**
 * The engine side: the session's Request, its held-back token, and the ops that wait for the
 * running response to end.
 */
export class EngineFeed {
  /** The response whose Turn the engine has, until its finish was handled. */
  active: ResponseRecord | null = null
  /** The latest response that began, and whether input was appended after it (truncate needs
   *  the response to be the tail of the context). */
  lastResponse: ResponseRecord | null = null
  inputSinceLastResponse = false
  private ops: EngineOp[] = []
  /** The newest input token, not yet given to the engine (see the file comment). */
  private held: number | null = null
  private retryTimer: NodeJS.Timeout | null = null
  private retryBackoffMs = 0

  constructor(
    private readonly ctx: DuplexSessionContext,
    private readonly onFailure: (reason: string) => void,
    /** The context changed at a commit point (a truncate applied). */
    private readonly onCommitted: () => void,
  ) {}

  /**
   * The committed conversation: every token a new owner must prefill to continue the session
   * (docs/scaling.md). That is the request's context, less the output of a response still
   * running (it is lost in a failover), then the input not yet in the engine: the held-back
   * token, queued prefills and the input of queued responses, in order.
   */
  committedContext(): Int32Array {
    const request = this.ctx.request
    const running = this.active !== null && !this.active.turnCancelled ? this.active : null
    const end = running === null ? request.tokenCount : running.startTokenCount
    const parts: Int32Array[] = [request.tokens(0, end)]
    if (this.held !== null) parts.push(Int32Array.of(this.held))
    for (const op of this.ops) {
      if (op.kind === 'prefill') parts.push(op.tokens)
      else if (op.kind === 'begin' && op.response.input !== null) parts.push(op.response.input)
    }
    const all = new Int32Array(parts.reduce((sum, part) => sum + part.length, 0))
    let at = 0
    for (const part of parts) {
      all.set(part, at)
      at += part.length
    }
    return all
  }

  /** Tokens accepted but not yet in the engine's context. */
  pendingTokens(): number {
    let count = this.held === null ? 0 : 1
    for (const op of this.ops) {
      if (op.kind === 'prefill') count += op.tokens.length
      else if (op.kind === 'begin' && op.response.input !== null) count += op.response.input.length
    }
    return count
  }

  /** Responses waiting for the running one to end. */
  queuedResponses(): number {
    let count = 0
    for (const op of this.ops) if (op.kind === 'begin') count++
    return count
  }

  /** Whether `tokens` more fit the request's limit with everything already accepted. */
  hasRoomFor(tokens: number): boolean {
    return this.ctx.request.tokenCount + this.pendingTokens() + tokens < this.ctx.maxSessionTokens
  }

  /** Whether a response could begin right now (respond() returns its Turn synchronously). */
  readiness(): 'ready' | 'turn-active' | 'events-pending' {
    if (this.active !== null && !this.active.turnCancelled) return 'turn-active'
    if (this.ops.some((op) => op.kind === 'begin')) return 'turn-active'
    if (this.active !== null || this.ops.length > 0) return 'events-pending'
    return 'ready'
  }

  /** Whether the context holds anything a response could continue from. */
  hasContext(): boolean {
    return this.held !== null || this.pendingTokens() > 0 || this.ctx.request.tokenCount > 0
  }

  addInput(tokens: Int32Array): void {
    if (tokens.length === 0) return
    this.ops.push({ kind: 'prefill', tokens })
    this.inputSinceLastResponse = true
    this.flush()
  }

  addResponse(response: ResponseRecord): void {
    this.ops.push({ kind: 'begin', response })
    this.lastResponse = response
    this.inputSinceLastResponse = false
    this.flush()
  }

  /** Begins `response` now (respond()); the caller checked readiness() first. */
  beginNow(response: ResponseRecord): 'began' | 'retry' | 'no-context' {
    this.lastResponse = response
    this.inputSinceLastResponse = false
    return this.begin(response)
  }

  addTruncate(response: ResponseRecord, playedTokens: number): void {
    this.ops.push({ kind: 'truncate', response, playedTokens })
    this.flush()
  }

  /** A response was cancelled: its queued begin becomes plain input (what the user said stays in
   *  the context), and input queued behind a running turn may go in now. */
  cancelled(response: ResponseRecord): void {
    const at = this.ops.findIndex((op) => op.kind === 'begin' && op.response === response)
    if (at !== -1) {
      const input = response.input
      if (input !== null && input.length > 0) this.ops[at] = { kind: 'prefill', tokens: input }
      else this.ops.splice(at, 1)
      this.inputSinceLastResponse = true
    }
    if (this.active === response) response.turnCancelled = true
    this.flush()
  }

  /** The engine finished the active response's turn (its finish event was delivered). */
  turnFinished(response: ResponseRecord, result: TurnResult): void {
    response.generatedTokens = result.tokens.length
    if (this.active === response) this.active = null
    this.flush()
  }

  /** The session is closing: nothing more goes into the engine. */
  stop(): void {
    this.ops = []
    this.held = null
    if (this.retryTimer !== null) {
      clearTimeout(this.retryTimer)
      this.retryTimer = null
    }
  }

  /** Runs the queued ops, in order, as far as the engine allows. */
  flush(): void {
    while (this.ops.length > 0 && !this.ctx.run.closing) {
      const op = this.ops[0]!
      const outcome = this.tryRun(op)
      if (outcome === 'wait') return
      if (outcome === 'retry') {
        this.retryLater()
        return
      }
      this.ops.shift()
    }
    this.retryBackoffMs = 0
  }

  private tryRun(op: EngineOp): 'done' | 'wait' | 'retry' {
    try {
      switch (op.kind) {
        case 'prefill':
          // The core refuses prefill while a turn runs; a cancelled turn no longer runs.
          if (this.active !== null && !this.active.turnCancelled) return 'wait'
          this.prefill(op.tokens)
          return 'done'
        case 'begin': {
          if (this.active !== null) return 'wait'
          if (op.response.ended) return 'done'
          const outcome = this.begin(op.response)
          if (outcome === 'no-context') this.failResponse(op.response)
          return outcome === 'retry' ? 'retry' : 'done'
        }
        case 'truncate': {
          if (this.active !== null) return 'wait'
          const outcome = this.truncate(op.response, op.playedTokens)
          if (outcome === 'done') this.onCommitted()
          return outcome
        }
      }
    } catch (error) {
      const code = error instanceof OrtexError ? error.code : 'ENGINE_UNHEALTHY'
      if (op.kind === 'begin') this.failResponse(op.response)
      this.onFailure(code === 'INVALID_ARGUMENT' ? 'context_full' : code === 'ENGINE_CLOSED' ? 'engine_closed' : 'engine_failure')
      return 'wait'
    }
  }

  /** Prefills all but the newest token, which is held back for the next response to start with. */
  private prefill(tokens: Int32Array): void {
    const all = this.withHeld(tokens)
    const body = all.subarray(0, all.length - 1)
    if (body.length > 0) this.ctx.request.prefill(body)
    this.held = all[all.length - 1]!
  }

  /**
   * Begins the response's turn with the held-back token and its own input. With neither (a
   * response right after another), the context's last token is taken back out of the engine and
   * becomes the input: one token is recomputed, and the response still starts in one step.
   */
  private begin(response: ResponseRecord): 'began' | 'retry' | 'no-context' {
    const request = this.ctx.request
    if (this.held === null && (response.input === null || response.input.length === 0)) {
      const count = request.tokenCount
      if (count === 0) return 'no-context'
      const last = request.tokens(count - 1, count)[0]!
      try {
        request.truncate(count - 1)
      } catch (error) {
        if (isRetryable(error)) return 'retry'
        throw error
      }
      this.held = last
    }
    const input = this.withHeld(response.input ?? new Int32Array(0))
    let turn: Turn
    try {
      turn = request.beginTurn(input, response.options)
    } catch (error) {
      if (isRetryable(error)) return 'retry'
      throw error
    }
    this.held = null
    response.input = null
    response.promptTokens = input.length
    response.turn = turn
    response.startTokenCount = request.tokenCount
    this.active = response
    response.transitionTo('running')
    this.beginOperation(response)
    void turn.done.then((result) => this.ctx.services.post({ kind: 'turn-finished', response, result }))
    return 'began'
  }

  /** Keeps what the client played of `response`: the context ends `playedTokens` into it. */
  private truncate(response: ResponseRecord, playedTokens: number): 'done' | 'retry' {
    if (response.startTokenCount < 0) return 'done'
    const count = response.startTokenCount + Math.min(playedTokens, response.generatedTokens)
    if (count >= this.ctx.request.tokenCount) return 'done'
    try {
      this.ctx.request.truncate(count)
    } catch (error) {
      if (isRetryable(error)) return 'retry'
      throw error
    }
    return 'done'
  }

  private withHeld(tokens: Int32Array): Int32Array {
    if (this.held === null) return tokens
    const all = new Int32Array(tokens.length + 1)
    all[0] = this.held
    all.set(tokens, 1)
    return all
  }

  private failResponse(response: ResponseRecord): void {
    if (!response.ended) response.transitionTo('failed')
  }

  private beginOperation(response: ResponseRecord): void {
    const id = `response:${response.fence.epoch}:${response.fence.responseSeq}`
    try {
      this.ctx.rules.beginOperation(this.ctx.sessionId, this.ctx.now(), id)
      response.operationId = id
    } catch {
      // A lease that cannot track the operation (ended, or full) only loses idle protection.
    }
  }

  /** A refusal the engine lifts by itself (events not yet delivered, a step in flight): retried
   *  after a short unref'd timer, so a caller-driven engine that nobody runs does not spin. */
  private retryLater(): void {
    if (this.retryTimer !== null) return
    this.retryBackoffMs = Math.min(Math.max(1, this.retryBackoffMs * 2), MAX_RETRY_BACKOFF_MS)
    this.retryTimer = setTimeout(() => {
      this.retryTimer = null
      this.flush()
    }, this.retryBackoffMs)
    this.retryTimer.unref()
  }
}

function isRetryable(error: unknown): boolean {
  return (
    error instanceof OrtexError &&
    (error.code === 'EVENTS_PENDING' || error.code === 'TURN_ACTIVE' || error.code === 'RUN_IN_PROGRESS')
  )
}

/**
 * The client side: one tracked task turns responses into events, in the order they were
 * created, paced by the consumer (a delta waits for room in the event queue).
 */
export class Delivery {
  private readonly queue: ResponseRecord[] = []
  private wake: (() => void) | null = null

  constructor(private readonly ctx: DuplexSessionContext) {}

  start(): void {
    this.ctx.services.spawn(() => this.loop(), 'delivery')
  }

  enqueue(response: ResponseRecord): void {
    this.queue.push(response)
    this.poke()
  }

  /** Something changed (a response queued, the session closing). */
  poke(): void {
    const wake = this.wake
    this.wake = null
    wake?.()
  }

  private async loop(): Promise<void> {
    for (;;) {
      const response = this.queue.shift()
      if (response === undefined) {
        if (this.ctx.run.closing && !this.ctx.run.closeDeferred) {
          this.ctx.services.post({ kind: 'terminal' })
          return
        }
        await new Promise<void>((resolve) => {
          this.wake = resolve
        })
        continue
      }
      await this.deliver(response)
    }
  }

  private async deliver(response: ResponseRecord): Promise<void> {
    this.ctx.services.post({ kind: 'announce', response })
    while (response.status === 'queued') await response.changed()
    if (response.status !== 'running' || response.turn === null) return
    const turn = response.turn
    const cursor = turn._cursor()
    response.cursor = cursor
    let index = 0
    for (;;) {
      if (response.status !== 'running') return
      if (!this.ctx.events.hasRoom()) {
        await Promise.race([this.ctx.events.waitForRoom(), response.stopped])
        continue
      }
      const chunk = cursor.read()
      if (chunk !== null) {
        this.ctx.services.post({ kind: 'delta', response, index: index++, token: chunk.token, text: chunk.text })
        continue
      }
      if (cursor.ended) break
      await Promise.race([cursor.wait(), response.stopped])
    }
    const result = await Promise.race([turn.done, response.stopped.then(() => null)])
    if (result !== null) this.ctx.services.post({ kind: 'response-done', response, result })
  }
}

/** The text the detokenizer added to the response's last delta when the turn ended. */
export function heldBackText(response: ResponseRecord): string {
  const cursor = response.cursor
  if (cursor === null || response.delivered === 0) return ''
  return cursor.heldBack()
}

export function statusOf(reason: FinishReason): ResponseStatus {
  if (reason === 'cancelled') return 'cancelled'
  if (reason === 'failed') return 'failed'
  return 'completed'
}

export function deliveredUsage(response: ResponseRecord): TurnUsage {
  return { promptTokens: response.promptTokens, generatedTokens: response.delivered, cachedPromptTokens: 0 }
}

export interface RunnerInit {
  sessionId: string
  engine: Engine
  request: Request
  rules: SessionRules
  now: () => number
  events: SessionEventQueue
  fence: Fence
  maxSessionTokens: number
}

/** What the runner asks of its session: the session owns the core calls of a close. */
export interface RunnerHooks {
  /** The engine refused the session's work for good (unhealthy, closed, context full). */
  engineFailed(reason: string): void
  /** A commit point: a response ended (response.done) or a truncate was applied. */
  committed(): void
}

/**
 * The session's runner: the mailbox and the orchestration of responses over EngineFeed and
 * Delivery. Every method runs to completion before the next item is handled.
 */
export class Runner implements RunnerServices {
  readonly run: DuplexRunState
  readonly ctx: DuplexSessionContext
  readonly feed: EngineFeed
  readonly delivery: Delivery
  /** Resolved once the terminal event left the runner. */
  readonly terminal: Promise<void>
  private resolveTerminal!: () => void
  private mailbox: MailboxItem[] = []
  private draining = false
  /** Responses whose response.done has not been emitted: queued, running in the engine, or
   *  finished in the engine but still being delivered to a slow reader. */
  private readonly undone = new Set<ResponseRecord>()

  constructor(
    init: RunnerInit,
    private readonly hooks: RunnerHooks,
  ) {
    this.run = new DuplexRunState(init.fence)
    this.ctx = {
      sessionId: init.sessionId,
      engine: init.engine,
      request: init.request,
      rules: init.rules,
      now: init.now,
      events: init.events,
      run: this.run,
      tasks: new SessionTasks(),
      services: this,
      maxSessionTokens: init.maxSessionTokens,
    }
    this.terminal = new Promise((resolve) => {
      this.resolveTerminal = resolve
    })
    this.feed = new EngineFeed(
      this.ctx,
      (reason) => hooks.engineFailed(reason),
      () => hooks.committed(),
    )
    this.delivery = new Delivery(this.ctx)
    this.delivery.start()
  }

  // ---- RunnerServices ------------------------------------------------------------------------

  spawn(task: () => Promise<void>, name: string): void {
    const tracked = task().catch(() => {
      // A component task must not fail; if one does, the session cannot keep its promises.
      this.hooks.engineFailed('internal_error')
    })
    this.ctx.tasks.track(tracked, name)
  }

  post(item: MailboxItem): void {
    this.mailbox.push(item)
    if (this.draining) return
    this.draining = true
    try {
      for (let next = this.mailbox.shift(); next !== undefined; next = this.mailbox.shift()) this.handle(next)
    } finally {
      this.draining = false
    }
  }

  /** Whether a response has not ended yet (queued, running, or not yet delivered). */
  get responding(): boolean {
    return this.undone.size > 0
  }

  /** The fences of the responses whose response.done has not been emitted. */
  pendingFences(): Fence[] {
    return [...this.undone].filter((response) => !response.doneEmitted).map((response) => ({ ...response.fence }))
  }

  // ---- responses -----------------------------------------------------------------------------

  /** A response started by a final append: begins now, or once the running one has ended. */
  queueResponse(fence: Fence, input: Int32Array, options: TurnOptions): void {
    const response = new ResponseRecord(fence, input, options)
    this.undone.add(response)
    this.delivery.enqueue(response)
    this.feed.addResponse(response)
  }

  /** respond(): the caller checked feed.readiness() and feed.hasContext(). */
  respondNow(fence: Fence, options: TurnOptions): Turn {
    const response = new ResponseRecord(fence, null, options)
    this.undone.add(response)
    this.delivery.enqueue(response)
    const outcome = this.feed.beginNow(response)
    if (outcome === 'began') return response.turn!
    // Readiness was checked, so this is the engine holding an event we have not seen yet.
    response.transitionTo('failed')
    throw outcome === 'retry'
      ? new OrtexError('EVENTS_PENDING', `session ${this.ctx.sessionId}: the engine still holds undelivered events`)
      : new OrtexError('INVALID_ARGUMENT', `session ${this.ctx.sessionId} has no context to respond to`)
  }

  /** Cancels every response `which` selects that has not ended: all of them in the same tick
   *  (including one the engine finished but a slow reader has not received yet), then lets input
   *  queued behind them go in. */
  cancelResponses(which: (response: ResponseRecord) => boolean, ending: ResponseEnding = CANCELLED): void {
    const cancelled = [...this.undone].filter((response) => !response.ended && which(response))
    for (const response of cancelled) {
      response.ending = ending
      response.transitionTo(ending.status)
    }
    for (const response of cancelled) {
      // The turn ends in the core now (one finish event, cancelled); nothing more is sampled.
      if (response.turn !== null) response.turn.cancel()
      this.endOperation(response)
      if (response.announced && !response.doneEmitted) {
        this.emitDone(response, ending.status, ending.finishReason, ending.errorCode, deliveredUsage(response))
      }
    }
    for (const response of cancelled) this.feed.cancelled(response)
    if (cancelled.length > 0) this.ctx.events.wakeRoomWaiters()
  }

  // ---- close ---------------------------------------------------------------------------------

  /**
   * The runner's half of a close (the session began it in the core): every response ends, the
   * request is closed (its KV freed), and the terminal event waits for finishClose().
   */
  terminate(reason: string, kind: 'session.closed' | 'session.expired', ending: ResponseEnding = CANCELLED): void {
    if (this.run.closing) return
    this.run.closing = true
    this.run.closeReason = reason
    this.run.terminalKind = kind
    this.run.closeDeferred = true
    this.cancelResponses(() => true, ending)
    this.feed.stop()
    this.ctx.request.close()
    this.delivery.poke()
  }

  /** The manager finalized the close: the slot is free, the terminal event may go. */
  finishClose(fence: Fence): void {
    this.run.fence = fence
    this.run.closeDeferred = false
    this.delivery.poke()
  }

  // ---- mailbox -------------------------------------------------------------------------------

  private handle(item: MailboxItem): void {
    switch (item.kind) {
      case 'turn-finished':
        this.turnFinished(item.response, item.result)
        return
      case 'announce':
        this.announce(item.response)
        return
      case 'delta':
        this.delta(item.response, item.index, item.token, item.text)
        return
      case 'response-done':
        this.responseDone(item.response, item.result)
        return
      case 'terminal':
        this.emitTerminal()
        return
    }
  }

  private turnFinished(response: ResponseRecord, result: TurnResult): void {
    this.endOperation(response)
    if (!this.run.closing) {
      try {
        this.ctx.rules.touch(this.ctx.sessionId, this.ctx.now(), 'model-output')
      } catch {
        // The session may have begun closing meanwhile.
      }
    }
    this.feed.turnFinished(response, result)
  }

  private announce(response: ResponseRecord): void {
    if (this.run.closedEmitted || response.announced) return
    response.announced = true
    this.ctx.events.push({ type: 'response.created', fence: response.fence })
    if (response.ended && !response.doneEmitted) {
      const ending = response.ending ?? (response.status === 'cancelled' ? CANCELLED : NO_CONTEXT)
      this.emitDone(response, ending.status, ending.finishReason, ending.errorCode, deliveredUsage(response))
    }
  }

  private delta(response: ResponseRecord, index: number, token: number, text: string): void {
    // The barge-in rule: a cancelled (or closed) response delivers nothing more.
    if (response.status !== 'running' || response.doneEmitted || this.run.closedEmitted) return
    this.ctx.events.push({ type: 'response.delta', fence: response.fence, text, token, index })
    response.delivered = index + 1
  }

  private responseDone(response: ResponseRecord, result: TurnResult): void {
    if (response.doneEmitted || response.status !== 'running') return
    const rest = heldBackText(response)
    if (rest.length > 0) {
      this.ctx.events.push({ type: 'response.delta', fence: response.fence, text: rest, token: null, index: response.delivered - 1 })
    }
    const status = statusOf(result.finishReason)
    response.transitionTo(status)
    this.emitDone(response, status, result.finishReason, result.errorCode, result.usage)
  }

  private emitDone(
    response: ResponseRecord,
    status: ResponseStatus,
    finishReason: FinishReason,
    errorCode: TurnResult['errorCode'],
    usage: TurnUsage,
  ): void {
    response.doneEmitted = true
    this.undone.delete(response)
    this.ctx.events.push({ type: 'response.done', fence: response.fence, status, finishReason, errorCode, usage: { ...usage } })
    this.hooks.committed()
  }

  private emitTerminal(): void {
    if (this.run.closedEmitted) return
    this.run.closedEmitted = true
    const type = this.run.terminalKind ?? 'session.closed'
    this.ctx.events.push({ type, fence: this.run.fence, reason: this.run.closeReason ?? 'closed' })
    this.ctx.events.end()
    this.resolveTerminal()
  }

  private endOperation(response: ResponseRecord): void {
    const id = response.operationId
    if (id === null) return
    response.operationId = null
    if (this.run.closing) return
    try {
      this.ctx.rules.endOperation(this.ctx.sessionId, this.ctx.now(), id)
    } catch {
      // Ending the lease clears its operations; nothing is left to end.
    }
  }
}
