// One response of a duplex session: a Turn on the session's Request started under a fence
// (ResponseRecord, with its status and what was delivered of it), how the runner ends one its
// turn did not end (ResponseEnding), and what its response.done reports.

import type { Turn } from '../request'
import type { TurnCursor } from '../turn-state'
import type { EventErrorCode, FinishReason, TurnOptions, TurnUsage } from '../types'
import type { Fence, ResponseStatus } from './events'

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
export const NO_CONTEXT: ResponseEnding = { status: 'failed', finishReason: 'failed', errorCode: 'none' }

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
  /** Tokens of its output still in the context, once its turn finished (a truncate keeps fewer). */
  keptTokens = 0
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

