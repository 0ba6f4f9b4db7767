// The engine's registry of the Requests the program may still hold and of their unfinished turns.
//
// - Requests are held weakly (WeakRef): the facade never keeps one alive. A shared
//   FinalizationRegistry says when one was collected; the engine then tells the core, which
//   reclaims it at its next owner boundary, and the request's turn ends 'cancelled'.
// - Turns are held by request id (one unfinished turn per request at most), strongly: the event
//   router reaches a turn's state without WeakRef.deref(), which would keep the Request alive
//   for the rest of each job.

import type { Request, RequestRecord } from './request'
import type { TurnState } from './turn-state'

/** What the registry asks its engine when a Request was collected. */
export interface CollectedHandler {
  onRequestCollected(record: RequestRecord): void
}

/**
 * One registry for every engine, never collected: Node 20's V8 stops running FinalizationRegistry
 * cleanups for good once a registry is collected while one of its cleanups is queued, so a
 * registry per engine could silently end reclamation in the whole process. The held value points
 * at the engine weakly, so the registry keeps no engine alive.
 */
const COLLECTED = new FinalizationRegistry<{ handler: WeakRef<CollectedHandler>; record: RequestRecord }>(
  ({ handler, record }) => handler.deref()?.onRequestCollected(record),
)

export class RequestRegistry {
  /** Every Request the program may still hold, by id. */
  private readonly requests = new Map<number, WeakRef<Request>>()
  /** The unfinished turn of each request, by request id: where events are routed. */
  private readonly turns = new Map<number, TurnState>()
  /** The shared FinalizationRegistry reaches the handler weakly (it must keep no engine alive);
   *  the registry, which its engine holds, keeps it alive as long as the engine lives. */
  private readonly handler: CollectedHandler
  private readonly handlerRef: WeakRef<CollectedHandler>

  constructor(handler: CollectedHandler) {
    this.handler = handler
    this.handlerRef = new WeakRef(handler)
  }

  add(request: Request): void {
    this.requests.set(request.id, new WeakRef(request))
    // The record, not the Request, is the held value; it stays registered after close() so the
    // map entry goes when the Request does (events read after a close still name it).
    COLLECTED.register(request, { handler: this.handlerRef, record: request._record })
  }

  request(id: number): Request | null {
    return this.requests.get(id)?.deref() ?? null
  }

  /** Whether the program may still hold request `id` (deref keeps a live one alive this job). */
  holds(id: number): boolean {
    return this.requests.get(id)?.deref() !== undefined
  }

  /** Forgets a request the collector took. */
  forget(id: number): void {
    const ref = this.requests.get(id)
    if (ref !== undefined && ref.deref() === undefined) this.requests.delete(id)
  }

  /** Forgets request `id` whatever its reference says (its events could not be delivered). */
  drop(id: number): void {
    this.requests.delete(id)
  }

  *liveRequests(): Iterable<Request> {
    for (const ref of this.requests.values()) {
      const request = ref.deref()
      if (request !== undefined) yield request
    }
  }

  turnOf(requestId: number): TurnState | undefined {
    return this.turns.get(requestId)
  }

  /** Every turn ends exactly once: a new turn never takes the place of an unfinished one. */
  turnBegun(state: TurnState): void {
    const previous = this.turns.get(state.requestId)
    if (previous !== undefined && !previous.finished) {
      // Request refuses this (EVENTS_PENDING); reaching here would lose a turn's `done` for good.
      throw new Error(`internal error: turn ${state.turnId} of request ${state.requestId} replaces unfinished turn ${previous.turnId}`)
    }
    this.turns.set(state.requestId, state)
  }

  turnFinished(state: TurnState): void {
    if (this.turns.get(state.requestId) === state) this.turns.delete(state.requestId)
  }

  /** The unfinished turns, as a list (finishing one removes it from the registry). */
  unfinishedTurns(): TurnState[] {
    return [...this.turns.values()]
  }
}
