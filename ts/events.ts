// Events: the flags, the caller's EventBuffer and the lazy decoding of its Int32Array.
//
// One event is EVENT_STRIDE 32-bit words; the layout (EVENT_WORDS) is generated from
// crates/ortex-core/src/events.rs:
//
//   flags   request id (0: engine-level)   turn id (0: none)   token (-1: none)
//   finish reason   error code   prompt / generated / cached prompt tokens   usage present
//   stop kind (0 none, 1 token ids, 2 string)   stop index (-1: none)
//
// A run writes the words; nothing crosses the boundary per event. `at(i)` builds a plain object
// only when the caller reads event i.

import { EVENT_STRIDE } from './binding'
import { invalidArgument } from './errors'
import { EVENT_ERROR_CODES, EVENT_FLAGS, EVENT_WORDS, FINISH_REASONS, STOP_KINDS } from './generated/boundary'
import type { Request } from './request'
import type { EventErrorCode, FinishReason, StopMatch, TurnUsage } from './types'
import { describe } from './validate'

/** The flag bits of an event (crates/ortex-core/src/events.rs, through ts/generated). */
export const EventFlags = Object.freeze({ ...EVENT_FLAGS })
export type EventFlags = (typeof EventFlags)[keyof typeof EventFlags]

export interface EngineEvent {
  /** A bitmask of EventFlags: a last token carries Token | TurnFinished. */
  flags: number
  /** null for engine-level events (and for a request the program no longer holds). */
  request: Request | null
  /** 0 when the event belongs to no turn. */
  turnId: number
  /** -1 when the event carries no token. */
  token: number
  finishReason: FinishReason
  errorCode: EventErrorCode
  /** Set on TurnFinished. */
  usage: TurnUsage | null
  /** Set on a TurnFinished with finishReason 'stop': which stop sequence it was. */
  stop: StopMatch | null
}

/** Word offsets inside one event record. */
export const W = EVENT_WORDS

export function finishReasonOf(code: number): FinishReason {
  return FINISH_REASONS[code] ?? 'none'
}

export function errorCodeOf(code: number): EventErrorCode {
  return EVENT_ERROR_CODES[code] ?? 'none'
}

export function usageAt(words: Int32Array, base: number): TurnUsage | null {
  if (words[base + W.hasUsage] !== 1) return null
  return {
    promptTokens: words[base + W.promptTokens]!,
    generatedTokens: words[base + W.generatedTokens]!,
    cachedPromptTokens: words[base + W.cachedPromptTokens]!,
  }
}

export function stopAt(words: Int32Array, base: number): StopMatch | null {
  const kind = STOP_KINDS[words[base + W.stopKind]!]
  if (kind === undefined || kind === 'none') return null
  return { kind, index: words[base + W.stopIndex]! }
}

/** What a buffer needs from its engine: the Request behind an id. */
export interface EventOwner {
  /** @internal */
  _requestById(id: number): Request | null
}

/**
 * A caller-owned event buffer, made by `engine.createEventBuffer(capacity)` and usable only with
 * that engine. Its events are valid until the buffer's next run.
 */
export class EventBuffer implements Iterable<EngineEvent> {
  readonly capacity: number
  /** @internal */
  readonly _engine: EventOwner
  /** @internal The event records, capacity * EVENT_STRIDE words. */
  readonly _words: Int32Array
  /** @internal */
  _count = 0

  private constructor(engine: EventOwner, capacity: number) {
    this.capacity = capacity
    this._engine = engine
    this._words = new Int32Array(capacity * EVENT_STRIDE)
  }

  /** @internal */
  static _create(engine: EventOwner, capacity: number): EventBuffer {
    return new EventBuffer(engine, capacity)
  }

  /** Events written by the last run. */
  get count(): number {
    return this._count
  }

  /** Decodes event i into a new plain object (own enumerable data fields). */
  at(i: number): EngineEvent {
    if (typeof i !== 'number' || !Number.isInteger(i) || i < 0 || i >= this._count) {
      throw invalidArgument(`index must be an integer in [0, ${this._count}), the buffer's event count; got ${describe(i)}`)
    }
    const words = this._words
    const base = i * EVENT_STRIDE
    const requestId = words[base + W.request]!
    return {
      flags: words[base + W.flags]!,
      request: requestId === 0 ? null : this._engine._requestById(requestId),
      turnId: words[base + W.turn]!,
      token: words[base + W.token]!,
      finishReason: finishReasonOf(words[base + W.finish]!),
      errorCode: errorCodeOf(words[base + W.error]!),
      usage: usageAt(words, base),
      stop: stopAt(words, base),
    }
  }

  *[Symbol.iterator](): Iterator<EngineEvent> {
    for (let i = 0; i < this._count; i++) yield this.at(i)
  }
}
