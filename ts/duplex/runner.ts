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
//
// Files: this one is the Runner (the mailbox and the orchestration); context.ts the shared state
// and collaborators (DuplexRunState, DuplexSessionContext, the mailbox's items); response.ts one
// response (ResponseRecord) and how it ends; feed.ts the EngineFeed; delivery.ts the Delivery.

import type { Engine } from '../engine'
import { OrtexError } from '../errors'
import type { Request, Turn } from '../request'
import type { FinishReason, TurnOptions, TurnResult, TurnUsage } from '../types'
import { DuplexRunState, type DuplexSessionContext, type MailboxItem, type RunnerServices, SessionTasks } from './context'
import type { SessionRules } from './core'
import { Delivery } from './delivery'
import type { Fence, ResponseStatus, SessionEventQueue } from './events'
import { EngineFeed } from './feed'
import type { EndedResponse } from './session'
import {
  CANCELLED,
  NO_CONTEXT,
  type ResponseEnding,
  ResponseRecord,
  deliveredUsage,
  heldBackText,
  statusOf,
} from './response'

/** Responses whose end a session store remembers (the latest), with where their output lies in
 *  the conversation: a client that resumes on another process and has not seen one of them end
 *  has it taken back (docs/scaling.md). More than a client that pipelines its turns has ended
 *  unseen in any but a pathological case; older ones stay in the conversation. */
export const RECENT_RESPONSES = 32

/** What a session store keeps of a session's responses and conversation. */
export interface ConversationSnapshot {
  /** The conversation without the output of the responses in `pending`. */
  tokens: Int32Array
  /** Responses whose response.done has not been emitted: a new owner ends them failed. */
  pending: Fence[]
  /** The latest responses that ended, oldest first. */
  ended: EndedResponse[]
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
  /** The latest responses whose response.done was emitted, oldest first (RECENT_RESPONSES). */
  private readonly recent: ResponseRecord[] = []

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

  /** What a session store keeps: the conversation without the output of the responses that
   *  have not ended (a new owner ends them failed), and where the latest ended ones lie in it. */
  snapshot(): ConversationSnapshot {
    const unfinished = [...this.undone].filter((response) => !response.doneEmitted)
    const ended = this.recent.map((response) => {
      const { start, end } = this.feed.outputRange(response)
      return { fence: { ...response.fence }, start, length: end - start }
    })
    return {
      tokens: this.feed.committedContext(unfinished),
      pending: unfinished.map((response) => ({ ...response.fence })),
      ended,
    }
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
    this.recent.push(response)
    if (this.recent.length > RECENT_RESPONSES) this.recent.shift()
    // The commit point first: the event is stamped with the commits it depends on (events.ts).
    this.hooks.committed()
    this.ctx.events.push({ type: 'response.done', fence: response.fence, status, finishReason, errorCode, usage: { ...usage } })
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
