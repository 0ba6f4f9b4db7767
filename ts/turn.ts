// A Turn: one generation on a Request.
//
// Three objects make a turn:
// - TurnState (internal) collects the tokens its events carry, whoever runs the engine (the
//   driven loop or the caller's run/runSync), produces text, and resolves `done` exactly once,
//   never rejecting. The engine holds it by request id and routes events to it directly.
// - TurnCursor (internal) reads a turn's chunks in order, each once: Turn's iterator and the
//   duplex session's delivery both read through one.
// - Turn (public) is the handle: id, request, done, cancel(), text(), async iteration.
//
// TurnState never points at its Turn or its Request (except a request the engine must keep alive:
// a generate() request, or any request while the engine is driven). So a Request and Turn the
// program drops can be collected and reclaimed while the turn runs: the event router reaches the
// state without WeakRef.deref(), which would keep the Request alive for the rest of each job.
//
//   beginTurn ──▶ tokens arrive (pushToken) ──▶ finish event / close / reclaim / engine failure
//                                                  │
//                                                  ▼
//                                  finish: done resolves, cursors end
//
// Text is produced lazily: a turn nobody iterates and without `stop` strings stores only token
// ids (no allocation per token beyond its growing Int32Array) and detokenizes once when it
// finishes. Iterating (or `stop`) switches on streaming detokenization, replaying what already
// arrived.
//
// Generation is paced by the reader: while every iterator of a turn (Turn's async iteration) is
// `STREAM_HOLD_EVENTS` or more chunks behind, the turn is held in the core (Engine::hold_turn: the
// scheduler plans nothing for it, its KV stays), and it is released once the fastest iterator is
// within half of that again. A turn nobody iterates (read through `done`) is never held.

import type { TurnLink } from './link'
// Type only: at run time this module imports nothing of request.ts (which imports this one).
import type { Request } from './request'
import { StopMatcher, StreamingDetokenizer } from './text'
import type { EventErrorCode, FinishReason, StopMatch, TokenLogprob, TurnChunk, TurnResult, TurnUsage } from './types'

/** @internal Undelivered chunks an iterated turn may have before it is held in the core. */
export const STREAM_HOLD_EVENTS = 256

/** Streaming state, present once someone iterates or the turn has `stop` strings. */
interface TextStream {
  detokenizer: StreamingDetokenizer
  stopper: StopMatcher | null
  /** chunkTexts[i]: the text token i completed. */
  chunkTexts: string[]
  /** All emitted text, for `done`. */
  text: string
}

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
  /** The index of the stop string found in the text; the turn is being stopped in the core. */
  stoppedBy: number | null = null
  /** The request this turn keeps alive: its own (generate) for the whole turn, or any request
   *  while the engine is driven. */
  pinned: unknown = null
  /** engine.generate: the request is the engine's and is closed when the turn finishes. */
  readonly ownedRequest: { close(): void } | null
  tokens = new Int32Array(16)
  count = 0
  /** logprobs[i]: token i's, when the turn asked for them (read from the core as it arrives). */
  logprobs: TokenLogprob[] | null = null
  private stream: TextStream | null = null
  private readonly link: TurnLink
  private resolveDone!: (result: TurnResult) => void
  private readonly promptTokens: number
  private readonly stops: readonly string[] | null
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
    stops: readonly string[] | null,
    ownedRequest: { close(): void } | null,
  ) {
    this.link = link
    this.requestId = ids.requestId
    this.turnId = ids.turnId
    this.promptTokens = promptTokens
    this.stops = stops
    this.ownedRequest = ownedRequest
    this.pinned = ownedRequest
    this.done = new Promise<TurnResult>((resolve) => {
      this.resolveDone = resolve
    })
    if (stops !== null) this.enableStream()
  }

  /** No more tokens will be recorded: finished, or a stop string ended the text. */
  get ended(): boolean {
    return this.finished || this.stoppedBy !== null
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

  /** The text token `i` completed (streaming must be on). */
  chunkText(i: number): string {
    return this.stream!.chunkTexts[i]!
  }

  /** A Token event of this turn. */
  pushToken(token: number): void {
    if (this.ended) return
    if (this.count === this.tokens.length) {
      const grown = new Int32Array(this.tokens.length * 2)
      grown.set(this.tokens)
      this.tokens = grown
    }
    this.tokens[this.count++] = token
    if (this.logprobs !== null) this.recordLogprob(token)
    if (this.stream !== null) this.streamToken()
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

  /** The turn asked for log-probabilities: each token's is read as its event arrives. */
  recordLogprobs(): void {
    this.logprobs = []
  }

  private recordLogprob(token: number): void {
    const entry = this.link.logprobQuietly(this.requestId, this.count - 1)
    // The core's entry is this very token's (a closed core has none: a placeholder keeps the
    // indices aligned).
    this.logprobs!.push(entry !== null && entry.token === token ? entry : { token, logprob: Number.NaN, top: [] })
  }

  /** Ends the turn: by its finish event (a Token it carried already pushed), by a close or a
   *  reclaim ('cancelled', usage counted here), by an engine failure ('failed'). */
  finish(ending: TurnEnding): void {
    if (this.finished) return
    this.finished = true
    const text = this.finalText()
    if (this.signal !== null) {
      this.signal.removeEventListener('abort', this.onAbort)
      this.signal = null
    }
    this.pinned = null
    this.resolveDone(this.result(ending, text))
    this.wake()
    this.link.turnFinished(this)
  }

  /** Turns on streaming text, replaying what arrived before anyone listened. Tokens are kept
   *  only up to a stop string, so a replay never finds one (a turn with `stop` strings streams
   *  from its start). */
  enableStream(): void {
    if (this.stream !== null) return
    const decode = (tokens: Int32Array): string => this.link.detokenizeQuietly(tokens)
    this.stream = {
      detokenizer: new StreamingDetokenizer(decode),
      stopper: this.stops === null ? null : new StopMatcher(this.stops),
      chunkTexts: [],
      text: '',
    }
    const arrived = this.count
    this.count = 0
    for (let i = 0; i < arrived; i++) {
      this.count++
      this.streamToken()
    }
    if (this.finished) this.flushStream()
  }

  private finalText(): string {
    if (this.stream !== null) {
      if (this.stoppedBy === null) this.flushStream()
      return this.stream.text
    }
    return this.count === 0 ? '' : this.link.detokenizeQuietly(this.tokens.subarray(0, this.count))
  }

  /**
   * The result the finish event describes. A stop string the facade found is the core's to
   * report (stopTurn); only when the turn had already ended in the core when the text showed the
   * stop string (its finish was under way) does the facade report the stop itself, since the text
   * it returns ends before that string.
   */
  private result(ending: TurnEnding, text: string): TurnResult {
    const stoppedHere = this.stoppedBy !== null && ending.reason !== 'stop'
    const stop: StopMatch | null = stoppedHere ? { kind: 'string', index: this.stoppedBy! } : ending.stop
    return {
      finishReason: stoppedHere ? 'stop' : ending.reason,
      errorCode: stoppedHere ? 'none' : ending.errorCode,
      usage: ending.usage ?? { promptTokens: this.promptTokens, generatedTokens: this.count, cachedPromptTokens: 0 },
      tokens: this.tokens.slice(0, this.count),
      text,
      stop,
      ...(this.logprobs === null ? {} : { logprobs: this.logprobs.slice(0, this.count) }),
    }
  }

  /** Produces the chunk text of the newest token. */
  private streamToken(): void {
    const stream = this.stream!
    let delta = stream.detokenizer.next(this.tokens, this.count)
    if (stream.stopper !== null) {
      const { text, stopIndex } = stream.stopper.push(delta)
      delta = text
      if (stopIndex !== null) this.hitStop(stopIndex)
    }
    stream.chunkTexts.push(delta)
    stream.text += delta
  }

  /** End of the turn: the text held back goes to the last chunk. */
  private flushStream(): void {
    const stream = this.stream!
    let rest = stream.detokenizer.flush(this.tokens, this.count)
    if (stream.stopper !== null) {
      const { text, stopIndex } = stream.stopper.push(rest)
      rest = stopIndex !== null ? text : text + stream.stopper.flush()
      if (stopIndex !== null) this.stoppedBy = stopIndex
    }
    if (rest.length === 0 || stream.chunkTexts.length === 0) return
    stream.chunkTexts[stream.chunkTexts.length - 1] += rest
    stream.text += rest
  }

  /** A stop string ended the text: the core ends the turn with reason stop and the string's
   *  index; its finishing event then resolves `done`. Tokens after this one are not recorded. */
  private hitStop(stopIndex: number): void {
    if (!this.finished) this.link.stopTurnQuietly(this.requestId, this.turnId, stopIndex)
    this.stoppedBy = stopIndex
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
 * Turns streaming text on. A chunk's text may grow after it was read when the turn's end flushes
 * held-back text into the last chunk: `heldBack()` is that growth.
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
    state.enableStream()
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

export class Turn implements AsyncIterable<TurnChunk> {
  /** Request-local, starts at 1, grows by 1. */
  readonly id: number
  readonly request: Request
  /** Never rejects: { finishReason, errorCode, usage, tokens, text, stop }. */
  readonly done: Promise<TurnResult>
  /** @internal */
  readonly _state: TurnState
  private readonly link: TurnLink

  private constructor(request: Request, state: TurnState, link: TurnLink) {
    this.id = state.turnId
    this.request = request
    this.done = state.done
    this._state = state
    this.link = link
  }

  /** @internal */
  static _create(request: Request, state: TurnState, link: TurnLink): Turn {
    return new Turn(request, state, link)
  }

  /** Cancels the turn if it is still queued or running; false otherwise. Never throws. */
  cancel(): boolean {
    return this._state.cancel()
  }

  /** The turn's whole text, once it finishes. Does not start the engine. */
  text(): Promise<string> {
    return this.done.then((result) => result.text)
  }

  /** @internal A cursor over this turn's chunks (the duplex delivery reads through one). */
  _cursor(): TurnCursor {
    return new TurnCursor(this._state)
  }

  /**
   * Streams the turn's chunks from its first token. Iterating starts the engine's driven loop
   * (`engine.start()`). Breaking out of the loop cancels the turn. Several iterators may run at
   * once; each sees every chunk. Generation is paced by the reader: while every iterator is
   * `STREAM_HOLD_EVENTS` (256) or more chunks behind, the turn generates nothing (it keeps its
   * place and its KV) until one reads again.
   */
  [Symbol.asyncIterator](): AsyncIterator<TurnChunk> {
    const cursor = new TurnCursor(this._state, true)
    this.link.ensureStarted()
    let closed = false
    return {
      next: async (): Promise<IteratorResult<TurnChunk>> => {
        for (;;) {
          if (closed) return { value: undefined, done: true }
          const chunk = cursor.read()
          if (chunk !== null) return { value: chunk, done: false }
          if (cursor.ended) {
            cursor.detach()
            return { value: undefined, done: true }
          }
          await cursor.wait()
        }
      },
      return: async (): Promise<IteratorResult<TurnChunk>> => {
        closed = true
        cursor.detach()
        this._state.cancel()
        return { value: undefined, done: true }
      },
    }
  }
}
