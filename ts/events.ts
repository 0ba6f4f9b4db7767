// Events: the flags, the caller's EventBuffer and the lazy decoding of its Int32Array.
//
// One event is EVENT_STRIDE 32-bit words; the layout (EVENT_WORDS) is generated from
// crates/ortex-core/src/events.rs:
//
//   flags   request id (0: engine-level)   turn id (0: none)   token (-1: none)
//   finish reason   error code   prompt / generated / cached prompt tokens   usage present
//   stop kind (0 none, 1 token ids, 2 string)   stop index (-1: none)
//   text start, text length (UTF-16 units in the run's text)   logprobs offset (-1: none)
//
// A run writes the words, and its events' text as one string (RunOutput.text), their
// log-probabilities as one Float64Array: nothing crosses the boundary per event. An event's text
// is a slice of the run's string. `at(i)` builds a plain object only when the caller reads event i.

import { EVENT_STRIDE } from './binding'
import { invalidArgument } from './errors'
import { EVENT_ERROR_CODES, EVENT_FLAGS, EVENT_WORDS, FINISH_REASONS, LOGPROB_ALTERNATIVE, LOGPROB_HEAD, STOP_KINDS } from './generated/boundary'
import type { Request } from './request'
import type { EventErrorCode, FinishReason, StopMatch, TokenLogprob, TurnUsage } from './types'
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
  /** The text this event adds to its turn's ('' when none): a token's text delta, and on a
   *  finish the text held back until the end. */
  text: string
  /** The token's log-probabilities, when its turn asked for them (`logprobs`); null otherwise. */
  logprob: TokenLogprob | null
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

/** What a run handed over besides its event records (events.rs RunOutput). */
export interface RunOutput {
  /** The events' text, one string: each event's is a slice of it. */
  text: string
  /** The log-probability entries of the events that carry one. */
  logprobs: Float64Array | null
}

export const NO_RUN_OUTPUT: RunOutput = Object.freeze({ text: '', logprobs: null })

/** The text of the event at `base`: a slice of the run's text. */
export function textAt(words: Int32Array, base: number, output: RunOutput): string {
  const length = words[base + W.textLength]!
  if (length === 0) return ''
  const start = words[base + W.textStart]!
  return output.text.slice(start, start + length)
}

const HEAD = Object.fromEntries(LOGPROB_HEAD.map((name, i) => [name, i])) as Record<(typeof LOGPROB_HEAD)[number], number>
const ALTERNATIVE = Object.fromEntries(LOGPROB_ALTERNATIVE.map((name, i) => [name, i])) as Record<(typeof LOGPROB_ALTERNATIVE)[number], number>

/** The log-probabilities of the event at `base`, or null when it carries none. */
export function logprobAt(words: Int32Array, base: number, output: RunOutput): TokenLogprob | null {
  const at = words[base + W.logprobs]!
  const numbers = output.logprobs
  if (at < 0 || numbers === null) return null
  const text = (start: number) => output.text.slice(numbers[start + HEAD.textStart]!, numbers[start + HEAD.textStart]! + numbers[start + HEAD.textLength]!)
  const top: TokenLogprob['top'] = []
  const count = numbers[at + HEAD.topCount]!
  for (let i = 0; i < count; i++) {
    const alt = at + LOGPROB_HEAD.length + i * LOGPROB_ALTERNATIVE.length
    const altText = output.text.slice(numbers[alt + ALTERNATIVE.textStart]!, numbers[alt + ALTERNATIVE.textStart]! + numbers[alt + ALTERNATIVE.textLength]!)
    top.push({ token: numbers[alt + ALTERNATIVE.token]!, logprob: numbers[alt + ALTERNATIVE.logprob]!, text: altText })
  }
  return { token: numbers[at + HEAD.token]!, logprob: numbers[at + HEAD.logprob]!, text: text(at), top }
}

/** Which of a run's outputs its events point into: the text when one has text, the numbers when
 *  one has log-probabilities (one scan; each is fetched from the core at most once per run). */
export function outputsNeeded(words: Int32Array, count: number): { text: boolean; logprobs: boolean } {
  let text = false
  let logprobs = false
  for (let i = 0; i < count; i++) {
    const base = i * EVENT_STRIDE
    if (words[base + W.textLength] !== 0) text = true
    if (words[base + W.logprobs] !== -1) logprobs = true
  }
  return { text, logprobs }
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
  /** @internal The last run's text and log-probabilities, which the records point into. */
  _output: RunOutput = NO_RUN_OUTPUT

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
      text: textAt(words, base, this._output),
      logprob: logprobAt(words, base, this._output),
    }
  }

  *[Symbol.iterator](): Iterator<EngineEvent> {
    for (let i = 0; i < this._count; i++) yield this.at(i)
  }
}
