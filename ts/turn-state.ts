// A turn's state in the facade: a view of the core's turn, and the cursors that read it.
//
// - TurnState is a view of the core's turn: it collects the tokens and text deltas its events
//   carry, whoever runs the engine (the driven loop or the caller's run/runSync), and resolves
//   `done` exactly once, never rejecting. The engine holds it by request id and routes events to
//   it directly. The core makes the text (detokenizing, stop strings: output.rs); the text here is
//   the concatenation of the deltas.
// - TurnCursor reads a turn's chunks in order, each once: Turn's iterator (request.ts) and the
//   duplex session's delivery both read through one.
//
// This module imports nothing of request.ts or engine.ts: the public handles (Request, Turn) and
// the engine point at it, never the other way round.
//
// TurnState never points at its Turn or its Request (except a request the engine must keep alive:
// a generate() request, or any request while the engine is driven). So a Request and Turn the
// program drops can be collected and reclaimed while the turn runs: the event router reaches the
// state without WeakRef.deref(), which would keep the Request alive for the rest of each job.
//
//   beginTurn ──▶ tokens and text arrive (pushToken) ──▶ finish event / close / reclaim / failure
//                                                  │
//                                                  ▼
//                                  finish: done resolves, cursors end
//
// Generation is paced by the reader: while every iterator of a turn (Turn's async iteration) is
// `STREAM_HOLD_EVENTS` or more chunks behind, the turn is held in the core (Engine::hold_turn: the
// scheduler plans nothing for it, its KV stays), and it is released once the fastest iterator is
// within half of that again. A turn nobody iterates (read through `done`) is never held.

import type { TurnLink } from './link'
import type { EventErrorCode, FinishReason, StopMatch, TokenLogprob, TurnChunk, TurnResult, TurnUsage } from './types'

/** @internal Undelivered chunks an iterated turn may have before it is held in the core. */
export const STREAM_HOLD_EVENTS = 256

/** How a turn ended, as its finish event (or whatever ended it) said. */
export interface TurnEnding {
  reason: FinishReason
  errorCode: EventErrorCode
  usage: TurnUsage | null
  stop: StopMatch | null
}

/** @internal */
export class TurnState {
  readonly requestId: number
  readonly turnId: number
  readonly done: Promise<TurnResult>
  finished = false
  /** The request this turn keeps alive: its own (generate) for the whole turn, or any request
   *  while the engine is driven. */
  pinned: unknown = null
  /** engine.generate: the request is the engine's and is closed when the turn finishes. */
  readonly ownedRequest: { close(): void } | null
  tokens = new Int32Array(16)
  count = 0
  /** logprobs[i]: token i's, when the turn asked for them (its event carried it). */
  logprobs: TokenLogprob[] | null = null
  /** chunkTexts[i]: the text token i added; the last one also gets what the turn's end added. */
  private readonly chunkTexts: string[] = []
  private readonly link: TurnLink
  private resolveDone!: (result: TurnResult) => void
  private readonly promptTokens: number
  private waiters: (() => void)[] = []
  /** The iterators reading this turn (pacing: see the module comment). */
  private readonly readers = new Set<TurnCursor>()
  /** Held in the core because every iterator fell behind. */
  private held = false
  private signal: AbortSignal | null = null
  private readonly onAbort = (): void => {
    this.cancel()
  }

  constructor(
    link: TurnLink,
    ids: { requestId: number; turnId: number },
    promptTokens: number,
    ownedRequest: { close(): void } | null,
  ) {
    this.link = link
    this.requestId = ids.requestId
    this.turnId = ids.turnId
    this.promptTokens = promptTokens
    this.ownedRequest = ownedRequest
    this.pinned = ownedRequest
    this.done = new Promise<TurnResult>((resolve) => {
      this.resolveDone = resolve
    })
  }

  /** No more tokens will be recorded. */
  get ended(): boolean {
    return this.finished
  }

  /** Never throws. */
  cancel(): boolean {
    if (this.ended) return false
    return this.link.cancelTurnQuietly(this.requestId, this.turnId)
  }

  attachSignal(signal: AbortSignal): void {
    if (signal.aborted) {
      this.cancel()
      return
    }
    this.signal = signal
    signal.addEventListener('abort', this.onAbort, { once: true })
  }

  /** Waits for the next token or the end. */
  wait(): Promise<void> {
    return new Promise<void>((resolve) => this.waiters.push(resolve))
  }

  /** The text token `i` added. */
  chunkText(i: number): string {
    return this.chunkTexts[i]!
  }

  /** A Token event of this turn, with the text it adds and, when asked for, its logprobs. */
  pushToken(token: number, text: string, logprob: TokenLogprob | null): void {
    if (this.ended) return
    if (this.count === this.tokens.length) {
      const grown = new Int32Array(this.tokens.length * 2)
      grown.set(this.tokens)
      this.tokens = grown
    }
    this.tokens[this.count++] = token
    this.chunkTexts.push(text)
    // A closed core has no entry: a placeholder keeps the indices aligned.
    if (this.logprobs !== null) this.logprobs.push(logprob ?? { token, logprob: Number.NaN, text: '', top: [] })
    this.pace()
    this.wake()
  }

  /** An iterator starts (`attach`) or stops reading this turn. */
  setReader(cursor: TurnCursor, attach: boolean): void {
    if (attach) this.readers.add(cursor)
    else this.readers.delete(cursor)
    this.pace()
  }

  /**
   * Holds the turn in the core while every iterator is `STREAM_HOLD_EVENTS` or more chunks behind,
   * and releases it once the fastest one is within half of that (or none is left). Called when a
   * token arrives, when an iterator reads, and when one starts or stops.
   */
  pace(): void {
    if (this.ended) return // the core ended the hold with the turn
    let lag = Number.POSITIVE_INFINITY
    for (const reader of this.readers) lag = Math.min(lag, this.count - reader.position)
    if (this.readers.size === 0) lag = 0
    if (!this.held && lag >= STREAM_HOLD_EVENTS) {
      this.held = this.link.holdTurnQuietly(this.requestId, this.turnId, true)
    } else if (this.held && lag <= STREAM_HOLD_EVENTS / 2) {
      this.held = false
      this.link.holdTurnQuietly(this.requestId, this.turnId, false)
    }
  }

  /** The turn asked for log-probabilities: each token's comes with its event. */
  recordLogprobs(): void {
    this.logprobs = []
  }

  /** Ends the turn: by its finish event (a Token it carried already pushed), by a close or a
   *  reclaim ('cancelled', usage counted here), by an engine failure ('failed'). `text`: what a
   *  finish event without a token adds (the text the core held back until the end), which goes
   *  to the last chunk. */
  finish(ending: TurnEnding, text = ''): void {
    if (this.finished) return
    this.finished = true
    if (text.length > 0 && this.count > 0) this.chunkTexts[this.count - 1] += text
    if (this.signal !== null) {
      this.signal.removeEventListener('abort', this.onAbort)
      this.signal = null
    }
    this.pinned = null
    this.resolveDone(this.result(ending))
    this.wake()
    this.link.turnFinished(this)
  }

  /** How the finish event (or whatever ended the turn) says it ended, with what arrived. */
  private result(ending: TurnEnding): TurnResult {
    return {
      finishReason: ending.reason,
      errorCode: ending.errorCode,
      usage: ending.usage ?? { promptTokens: this.promptTokens, generatedTokens: this.count, cachedPromptTokens: 0 },
      tokens: this.tokens.slice(0, this.count),
      text: this.chunkTexts.join(''),
      stop: ending.stop,
      ...(this.logprobs === null ? {} : { logprobs: this.logprobs.slice(0, this.count) }),
    }
  }

  private wake(): void {
    const waiters = this.waiters
    if (waiters.length === 0) return
    this.waiters = []
    for (const resolve of waiters) resolve()
  }
}

/**
 * @internal Reads a turn's chunks in order, each once (Turn's iterator; the duplex delivery).
 * A chunk's text may grow after it was read when the turn's end adds held-back text to the last
 * chunk (a cancel's finish): `heldBack()` is that growth.
 */
export class TurnCursor {
  /** Chunks read so far. */
  position = 0
  private lastReadText = ''

  /** `paced`: the turn's generation waits for this reader (Turn's iterator). */
  constructor(
    private readonly state: TurnState,
    private readonly paced = false,
  ) {
    if (paced) state.setReader(this, true)
  }

  /** A paced reader stops reading: the turn no longer waits for it. */
  detach(): void {
    if (this.paced) this.state.setReader(this, false)
  }

  /** The next chunk, or null when none has arrived yet (see `ended` and `wait`). */
  read(): TurnChunk | null {
    const state = this.state
    if (this.position >= state.count) return null
    const i = this.position++
    this.lastReadText = state.chunkText(i)
    if (this.paced) state.pace()
    const logprob = state.logprobs?.[i]
    return logprob === undefined ? { token: state.tokens[i]!, text: this.lastReadText } : { token: state.tokens[i]!, text: this.lastReadText, logprob }
  }

  /** Every chunk was read and no more will come. */
  get ended(): boolean {
    return this.state.ended && this.position >= this.state.count
  }

  /** Resolves at the next token or the end. */
  wait(): Promise<void> {
    return this.state.wait()
  }

  /** After the end: the text the turn's end added to the last chunk after it was read. */
  heldBack(): string {
    const state = this.state
    if (this.position === 0 || this.position !== state.count) return ''
    const last = state.chunkText(this.position - 1)
    return last.startsWith(this.lastReadText) ? last.slice(this.lastReadText.length) : ''
  }
}
