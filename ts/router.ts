// Event routing: each run's events go to their turns, whoever ran the engine (the driven loop or
// the caller's run/runSync). Reads the words directly; nothing is allocated for a token event of
// a turn nobody iterates.

import { EVENT_STRIDE } from './binding'
import { EventFlags, type RunOutput, W, errorCodeOf, finishReasonOf, logprobAt, stopAt, textAt, usageAt } from './events'
import type { RequestRegistry } from './registry'
import type { EventErrorCode } from './types'

/** Events that show a run moved something (CapacityBlocked alone does not). */
export const PROGRESS_FLAGS = EventFlags.Token | EventFlags.TurnFinished | EventFlags.Failed | EventFlags.Retryable

export interface RouterHost {
  readonly registry: RequestRegistry
  /** An engine-level Failed event arrived with this code. */
  engineFailed(code: EventErrorCode): void
  /** The program dropped this request and the collector took it before the registry said so. */
  abandonCollected(requestId: number): void
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
export function dropEventsOfCollected(words: Int32Array, count: number, host: RouterHost): number {
  let kept = 0
  let lastId = 0
  for (let i = 0; i < count; i++) {
    const base = i * EVENT_STRIDE
    const requestId = words[base + W.request]!
    if (requestId !== 0 && requestId !== lastId) {
      if (!host.registry.holds(requestId)) {
        host.abandonCollected(requestId)
        continue
      }
      lastId = requestId
    }
    if (kept !== i) words.copyWithin(kept * EVENT_STRIDE, base, base + EVENT_STRIDE)
    kept++
  }
  return kept
}

/** Hands each event to its turn: tokens are appended with their text (a slice of the run's),
 *  a finish resolves `done`. Returns whether any event showed progress. */
export function routeEvents(words: Int32Array, count: number, host: RouterHost, output: RunOutput): boolean {
  let progressed = false
  for (let i = 0; i < count; i++) {
    const base = i * EVENT_STRIDE
    const flags = words[base + W.flags]!
    if ((flags & PROGRESS_FLAGS) !== 0) progressed = true
    const requestId = words[base + W.request]!
    if (requestId === 0) {
      if ((flags & EventFlags.Failed) !== 0) host.engineFailed(errorCodeOf(words[base + W.error]!))
      continue
    }
    if ((flags & (EventFlags.Token | EventFlags.TurnFinished)) === 0) continue
    const turn = host.registry.turnOf(requestId)
    if (turn === undefined || turn.turnId !== words[base + W.turn]) continue
    const text = textAt(words, base, output)
    const isToken = (flags & EventFlags.Token) !== 0
    if (isToken) turn.pushToken(words[base + W.token]!, text, turn.logprobs === null ? null : logprobAt(words, base, output))
    if ((flags & EventFlags.TurnFinished) !== 0) {
      turn.finish(
        {
          reason: finishReasonOf(words[base + W.finish]!),
          errorCode: errorCodeOf(words[base + W.error]!),
          usage: usageAt(words, base),
          stop: stopAt(words, base),
        },
        isToken ? '' : text,
      )
    }
  }
  return progressed
}

/** Whether a buffer's events show progress (the driven loop's stall detection). */
export function anyProgress(words: Int32Array, count: number): boolean {
  for (let i = 0; i < count; i++) {
    if ((words[i * EVENT_STRIDE + W.flags]! & PROGRESS_FLAGS) !== 0) return true
  }
  return false
}
