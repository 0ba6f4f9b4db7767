// What a full-duplex session reports (docs/api.md "Full-duplex sessions"), and the bounded queue
// that holds it until the session's consumer reads it.
//
// Every event carries the fence it belongs to. A response's events carry the fence the response
// was started under, so a consumer can tell the responses of an older epoch (cancelled by a
// barge-in) from the current one.
//
//   response.created ──▶ response.delta* ──▶ response.done {completed | cancelled | failed}
//   ...responses...  ──▶ session.closed {reason} | session.expired {reason}     (exactly one)
//
// Nothing of a response follows its response.done, and nothing at all follows the terminal event.

import type { EventErrorCode, FinishReason, TurnUsage } from '../types'

/** The identity and position a session command is issued under (ortex-core's `Fence`). */
export interface Fence {
  sessionId: string
  /** Counts the lives of one session id: a closed id opened again gets the next value. */
  incarnation: number
  /** Advanced only by cancel() (barge-in). */
  epoch: number
  /** The user turn; the final append of a turn advances it. */
  turnId: number
  /** Counts responses; each response advances it. */
  responseSeq: number
}

export type SessionState = 'open' | 'detached' | 'closing' | 'closed'
export type ResponseStatus = 'completed' | 'cancelled' | 'failed'

export interface ResponseCreatedEvent {
  type: 'response.created'
  fence: Fence
}

export interface ResponseDeltaEvent {
  type: 'response.delta'
  fence: Fence
  /** Text this token completes ('' while an incomplete character is held back). */
  text: string
  /** The token id, or null for the text a detokenizer held back until the response ended. */
  token: number | null
  /** Position of the token in the response, from 0 (the count of tokens played so far). */
  index: number
}

export interface ResponseDoneEvent {
  type: 'response.done'
  fence: Fence
  status: ResponseStatus
  finishReason: FinishReason
  errorCode: EventErrorCode
  /** For a cancelled response: the tokens delivered before the cancel. What the engine generated
   *  and kept in context may be one step more; truncate() drops what the client did not play. */
  usage: TurnUsage
}

export interface SessionClosedEvent {
  type: 'session.closed'
  fence: Fence
  reason: string
}

export interface SessionExpiredEvent {
  type: 'session.expired'
  fence: Fence
  /** 'disconnect_grace_expired' or 'idle_ttl_expired'. */
  reason: string
}

export type SessionEvent =
  | ResponseCreatedEvent
  | ResponseDeltaEvent
  | ResponseDoneEvent
  | SessionClosedEvent
  | SessionExpiredEvent

/** Events one session holds for its consumer by default. Deltas wait for room (the response is
 *  paced by its reader); control events are always admitted, and there are few of them. */
export const DEFAULT_EVENT_BUFFER_CAPACITY = 1024

/**
 * The session's events until its consumer reads them. Iterators share the queue: each event goes
 * to one of them (normally there is one consumer). Iteration ends after the terminal event.
 *
 * Each event is stamped, as it is pushed, with the count of the session's commit points so far
 * (`stamp`; always 0 without a session store): the server sends it once the store holds that
 * many, so a delta produced before a response's end does not wait for that end's write.
 */
export class SessionEventQueue implements AsyncIterable<SessionEvent> {
  private items: SessionEvent[] = []
  private head = 0
  private ended = false
  private readers: (() => void)[] = []
  private roomWaiters: (() => void)[] = []
  private readonly stamps = new WeakMap<SessionEvent, number>()

  constructor(
    readonly capacity: number,
    private readonly stamp: () => number = () => 0,
  ) {}

  /** The commit points the session had made when `event` was pushed. */
  stampOf(event: SessionEvent): number {
    return this.stamps.get(event) ?? 0
  }

  /** Events waiting to be read. */
  get size(): number {
    return this.items.length - this.head
  }

  hasRoom(): boolean {
    return this.size < this.capacity
  }

  push(event: SessionEvent): void {
    if (this.ended) return
    this.stamps.set(event, this.stamp())
    this.items.push(event)
    wakeAll(this.readers)
    this.readers = []
  }

  /** @internal Puts back an event a reader took but could not deliver (its connection went
   *  away meanwhile): the next reader gets it first. */
  putBack(event: SessionEvent): void {
    if (this.head > 0) {
      this.head--
      this.items[this.head] = event
    } else {
      this.items.unshift(event)
    }
    wakeAll(this.readers)
    this.readers = []
  }

  /** No event follows: iterators end once they have read everything. */
  end(): void {
    this.ended = true
    wakeAll(this.readers)
    this.readers = []
    this.wakeRoomWaiters()
  }

  /** Resolves when a reader took an event (or whenever the session's state changes). */
  waitForRoom(): Promise<void> {
    return new Promise((resolve) => this.roomWaiters.push(resolve))
  }

  /** Wakes whoever waits for room, so that it re-checks what it waits for (a cancel, say). */
  wakeRoomWaiters(): void {
    const waiters = this.roomWaiters
    this.roomWaiters = []
    wakeAll(waiters)
  }

  [Symbol.asyncIterator](): AsyncIterator<SessionEvent> {
    let stopped = false
    return {
      next: async (): Promise<IteratorResult<SessionEvent>> => {
        for (;;) {
          if (stopped) return { value: undefined, done: true }
          const event = this.take()
          if (event !== undefined) return { value: event, done: false }
          if (this.ended) return { value: undefined, done: true }
          await new Promise<void>((resolve) => this.readers.push(resolve))
        }
      },
      return: async (): Promise<IteratorResult<SessionEvent>> => {
        stopped = true
        return { value: undefined, done: true }
      },
    }
  }

  private take(): SessionEvent | undefined {
    if (this.head === this.items.length) return undefined
    const event = this.items[this.head]!
    this.head++
    if (this.head > 64 && this.head * 2 > this.items.length) {
      this.items = this.items.slice(this.head)
      this.head = 0
    }
    if (this.roomWaiters.length > 0) this.wakeRoomWaiters()
    return event
  }
}

function wakeAll(waiters: readonly (() => void)[]): void {
  for (const wake of waiters) wake()
}
