// A duplex session's engine side (EngineFeed): its one Request. Appended input is prefilled as it
// arrives, except the newest token, which is held back so that a response can always start with
// fresh input; input that arrives while a response runs waits in `ops` (the core refuses prefill
// while a turn runs) and goes in, in order, when the turn ends or is cancelled. An op the core
// refuses for now (retryable) is retried with a short backoff.

import { OrtexError } from '../errors'
import type { Turn } from '../request'
import type { TurnResult } from '../types'
import type { DuplexSessionContext } from './context'
import type { ResponseRecord } from './response'

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
   * (docs/scaling.md). That is the request's context, less the output of each response in
   * `unfinished` (those whose response.done has not been emitted: a failover ends them failed,
   * without their output), then the input not yet in the engine: the held-back token, queued
   * prefills and the input of queued responses, in order.
   */
  committedContext(unfinished: readonly ResponseRecord[]): Int32Array {
    const request = this.ctx.request
    const parts: Int32Array[] = []
    let at = 0
    for (const { start, end } of unfinished.map((response) => this.outputRange(response)).sort((a, b) => a.start - b.start)) {
      if (start < at || start === end) continue
      parts.push(request.tokens(at, start))
      at = end
    }
    parts.push(request.tokens(at, request.tokenCount))
    if (this.held !== null) parts.push(Int32Array.of(this.held))
    for (const op of this.ops) {
      if (op.kind === 'prefill') parts.push(op.tokens)
      else if (op.kind === 'begin' && op.response.input !== null) parts.push(op.response.input)
    }
    const all = new Int32Array(parts.reduce((sum, part) => sum + part.length, 0))
    let offset = 0
    for (const part of parts) {
      all.set(part, offset)
      offset += part.length
    }
    return all
  }

  /** Where `response`'s output lies in the request's context: [start, end), empty when its turn
   *  never began. A turn still in the engine (running, or cancelled but not yet finished) owns
   *  the context's end. */
  outputRange(response: ResponseRecord): { start: number; end: number } {
    const start = response.startTokenCount
    if (start < 0) return { start: 0, end: 0 }
    const end = this.active === response ? this.ctx.request.tokenCount : start + response.keptTokens
    return { start, end }
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
    response.keptTokens = result.tokens.length
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
    response.keptTokens = count - response.startTokenCount
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

