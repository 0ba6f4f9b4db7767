// A Turn: one generation on a Request.
//
// Two objects make a turn:
// - TurnState (internal) collects the tokens its events carry, whoever runs the engine (the
//   driven loop or the caller's run/runSync), produces text, and resolves `done` exactly once,
//   never rejecting. The engine holds it by request id and routes events to it directly.
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
//                                  finish: done resolves, iterators end
//
// Text is produced lazily: a turn nobody iterates and without `stop` strings stores only token
// ids (no allocation per token beyond its growing Int32Array) and detokenizes once when it
// finishes. Iterating (or `stop`) switches on streaming detokenization, replaying what already
// arrived.

import type { Engine } from './engine'
import type { Request } from './request'
import { StopMatcher, StreamingDetokenizer } from './text'
import type { EventErrorCode, FinishReason, TurnChunk, TurnResult, TurnUsage } from './types'

/** Streaming state, present once someone iterates or the turn has `stop` strings. */
interface TextStream {
  detokenizer: StreamingDetokenizer
  stopper: StopMatcher | null
  /** chunkTexts[i]: the text token i completed. */
  chunkTexts: string[]
  /** All emitted text, for `done`. */
  text: string
}

/** @internal */
export class TurnState {
  readonly requestId: number
  readonly turnId: number
  readonly done: Promise<TurnResult>
  finished = false
  /** A stop string was found; the turn is being cancelled and reports 'stop'. */
  stopped = false
  /** The request this turn keeps alive: its own (generate) for the whole turn, or any request
   *  while the engine is driven. */
  pinned: Request | null = null
  /** engine.generate: the request is the engine's and is closed when the turn finishes. */
  readonly ownedRequest: Request | null
  tokens = new Int32Array(16)
  count = 0
  stream: TextStream | null = null
  private readonly engine: Engine
  private resolveDone!: (result: TurnResult) => void
  private readonly promptTokens: number
  private readonly stops: readonly string[] | null
  private waiters: (() => void)[] = []
  private signal: AbortSignal | null = null
  private readonly onAbort = (): void => {
    this.cancel()
  }

  constructor(
    engine: Engine,
    requestId: number,
    turnId: number,
    promptTokens: number,
    stops: readonly string[] | null,
    ownedRequest: Request | null,
  ) {
    this.engine = engine
    this.requestId = requestId
    this.turnId = turnId
    this.promptTokens = promptTokens
    this.stops = stops
    this.ownedRequest = ownedRequest
    this.pinned = ownedRequest
    this.done = new Promise<TurnResult>((resolve) => {
      this.resolveDone = resolve
    })
    if (stops !== null) this.enableStream()
  }

  /** Never throws. */
  cancel(): boolean {
    if (this.finished || this.stopped) return false
    return this.engine._cancelTurnQuietly(this.requestId, this.turnId)
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

  /** A Token event of this turn. */
  pushToken(token: number): void {
    if (this.finished || this.stopped) return
    if (this.count === this.tokens.length) {
      const grown = new Int32Array(this.tokens.length * 2)
      grown.set(this.tokens)
      this.tokens = grown
    }
    this.tokens[this.count++] = token
    if (this.stream !== null) this.streamToken()
    this.wake()
  }

  /** Ends the turn: by its finish event (a Token it carried already pushed), by a close or a
   *  reclaim ('cancelled', usage counted here), by an engine failure ('failed'). */
  finish(reason: FinishReason, errorCode: EventErrorCode, usage: TurnUsage | null): void {
    if (this.finished) return
    this.finished = true
    let text: string
    if (this.stream !== null) {
      if (!this.stopped) this.flushStream()
      text = this.stream.text
    } else {
      text = this.count === 0 ? '' : this.engine._detokenizeQuietly(this.tokens.subarray(0, this.count))
    }
    if (this.signal !== null) {
      this.signal.removeEventListener('abort', this.onAbort)
      this.signal = null
    }
    const result: TurnResult = {
      finishReason: this.stopped ? 'stop' : reason,
      errorCode: this.stopped ? 'none' : errorCode,
      usage: usage ?? { promptTokens: this.promptTokens, generatedTokens: this.count, cachedPromptTokens: 0 },
      tokens: this.tokens.slice(0, this.count),
      text,
    }
    this.pinned = null
    this.resolveDone(result)
    this.wake()
    this.engine._turnFinished(this)
  }

  /** Turns on streaming text, replaying what arrived before anyone listened. Tokens are kept
   *  only up to a stop string, so a replay never finds one (a turn with `stop` strings streams
   *  from its start). */
  enableStream(): void {
    if (this.stream !== null) return
    const decode = (tokens: Int32Array): string => this.engine._detokenizeQuietly(tokens)
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

  /** Produces the chunk text of the newest token. */
  private streamToken(): void {
    const stream = this.stream!
    let delta = stream.detokenizer.next(this.tokens, this.count)
    if (stream.stopper !== null) {
      const { text, stopped } = stream.stopper.push(delta)
      delta = text
      if (stopped) this.hitStop()
    }
    stream.chunkTexts.push(delta)
    stream.text += delta
  }

  /** End of the turn: the text held back goes to the last chunk. */
  private flushStream(): void {
    const stream = this.stream!
    let rest = stream.detokenizer.flush(this.tokens, this.count)
    if (stream.stopper !== null) {
      const { text, stopped } = stream.stopper.push(rest)
      rest = stopped ? text : text + stream.stopper.flush()
      if (stopped) this.stopped = true
    }
    if (rest.length === 0 || stream.chunkTexts.length === 0) return
    stream.chunkTexts[stream.chunkTexts.length - 1] += rest
    stream.text += rest
  }

  /** A stop string ended the text: cancel the turn in the core; its finishing event then
   *  resolves `done` with 'stop'. Tokens after this one are not recorded. */
  private hitStop(): void {
    if (!this.finished) this.engine._cancelTurnQuietly(this.requestId, this.turnId)
    this.stopped = true
  }

  private wake(): void {
    const waiters = this.waiters
    if (waiters.length === 0) return
    this.waiters = []
    for (const resolve of waiters) resolve()
  }
}

export class Turn implements AsyncIterable<TurnChunk> {
  /** Request-local, starts at 1, grows by 1. */
  readonly id: number
  readonly request: Request
  /** Never rejects: { finishReason, errorCode, usage, tokens, text }. */
  readonly done: Promise<TurnResult>
  /** @internal */
  readonly _state: TurnState

  private constructor(request: Request, state: TurnState) {
    this.id = state.turnId
    this.request = request
    this.done = state.done
    this._state = state
  }

  /** @internal */
  static _create(request: Request, state: TurnState): Turn {
    return new Turn(request, state)
  }

  /** Cancels the turn if it is still queued or running; false otherwise. Never throws. */
  cancel(): boolean {
    return this._state.cancel()
  }

  /** The turn's whole text, once it finishes. Does not start the engine. */
  text(): Promise<string> {
    return this.done.then((result) => result.text)
  }

  /**
   * Streams the turn's chunks from its first token. Iterating starts the engine's driven loop
   * (`engine.start()`). Breaking out of the loop cancels the turn. Several iterators may run at
   * once; each sees every chunk.
   */
  [Symbol.asyncIterator](): AsyncIterator<TurnChunk> {
    const state = this._state
    state.enableStream()
    this.request._engine._ensureStarted()
    let cursor = 0
    let closed = false
    return {
      next: async (): Promise<IteratorResult<TurnChunk>> => {
        for (;;) {
          if (closed) return { value: undefined, done: true }
          if (cursor < state.count) {
            const i = cursor++
            return { value: { token: state.tokens[i]!, text: state.stream!.chunkTexts[i]! }, done: false }
          }
          if (state.finished || state.stopped) return { value: undefined, done: true }
          await state.wait()
        }
      },
      return: async (): Promise<IteratorResult<TurnChunk>> => {
        closed = true
        state.cancel()
        return { value: undefined, done: true }
      },
    }
  }
}
