// The public handles: a Request, one sequence in the engine (its KV stays resident between
// turns), and a Turn, one generation on it (id, request, done, cancel(), text(), async iteration).
// They point at each other, so they live in one module; a turn's state (TurnState, TurnCursor)
// is turn-state.ts, which points at neither.
//
// The engine tracks requests only through WeakRefs (registry.ts); a Request the program drops
// without close() is collected, and a FinalizationRegistry tells the core (abandonRequest), which
// reclaims it at its next owner boundary. A Request holds its current Turn, and a Turn holds its
// Request, so a program may keep either. A Request talks to its engine only through its link
// (link.ts): the core handle, error conversion, wake-up and the turn registry.

import { OrtexError } from './errors'
import { type ChatTurnView, REQUEST_STATES, type TurnOptionsInput } from './generated/boundary'
import type { EngineLink, TurnLink } from './link'
import { TurnCursor, TurnState } from './turn-state'
import type { RequestState, TurnChunk, TurnOptions, TurnResult } from './types'
import * as opts from './options'
import * as v from './validate'

/** The FinalizationRegistry's held value: what the engine needs once the Request is gone. It
 *  must not point at the Request, or the Request could never be collected. */
export interface RequestRecord {
  readonly id: number
  closed: boolean
}

/** Begins a chat turn on request `requestId` in the core (a binding's beginChatTurn). */
export type ChatTurnBegin<T> = (requestId: number, options: TurnOptionsInput) => T

/** @internal The link a Request gets: its engine, seen through the registry's types. */
export type RequestLink = EngineLink<TurnState, Request>

export class Request {
  readonly id: number
  /** @internal */
  readonly _record: RequestRecord
  /** @internal The latest turn (finished or not). */
  _turn: Turn | null = null
  private readonly link: RequestLink
  private closedTokenCount = 0

  private constructor(link: RequestLink, id: number) {
    this.link = link
    this.id = id
    this._record = { id, closed: false }
  }

  /** @internal */
  static _create(link: RequestLink, id: number): Request {
    return new Request(link, id)
  }

  get state(): RequestState {
    if (this._record.closed || this.link.closed) return 'closed'
    return REQUEST_STATES[this.link.call(() => this.link.core.requestState(this.id))] ?? 'closed'
  }

  /** Every prompt and generated token of this request so far (kept after close). */
  get tokenCount(): number {
    if (this._record.closed || this.link.closed) return this.closedTokenCount
    return this.link.call(() => this.link.core.requestTokenCount(this.id))
  }

  /** The request's context: `tokens[start, end)` of every prompt, prefill and generated token,
   *  clamped to what it holds (addition). */
  tokens(start = 0, end = Number.MAX_SAFE_INTEGER): Int32Array {
    v.integer('start', start)
    v.integer('end', end, 0, Number.MAX_SAFE_INTEGER)
    this.checkOpen()
    const last = Math.min(end, 2 ** 32 - 1)
    return this.link.call(() => this.link.core.requestTokens(this.id, start, last))
  }

  /** Adds context without starting a turn; a later beginTurn continues after it. */
  prefill(input: string | ArrayLike<number>): void {
    const checked = v.input('input', input)
    this.checkOpen()
    const tokens = this.link.inputTokens(checked, this.tokenCount === 0)
    this.link.call(() => this.link.core.prefill(this.id, tokens))
    this.link.wake()
  }

  beginTurn(input: string | ArrayLike<number>, options?: TurnOptions): Turn {
    const checkedInput = v.input('input', input)
    const checked = opts.turnOptions('options', v.options('options', options, opts.TURN_KEYS))
    return this._begin(checkedInput, checked, false)
  }

  /** True only for this request's queued or active turn. */
  cancelTurn(turnId: number): boolean {
    v.integer('turnId', turnId)
    this.link.checkOpen()
    const cancelled = this.link.call(() => this.link.core.cancelTurn(this.id, turnId))
    if (cancelled) this.link.wake()
    return cancelled
  }

  /**
   * Drops this request's tokens past `tokenCount` and frees the KV blocks past them, so that a
   * later turn continues from the shorter context (an addition: a full-duplex client keeps only
   * what it played of a response). Only between turns: TURN_ACTIVE while a turn is queued or
   * running; RUN_IN_PROGRESS (retryable) while a step computing this request is in flight.
   */
  truncate(tokenCount: number): void {
    v.integer('tokenCount', tokenCount)
    this.link.checkUsable()
    this.checkOpen()
    this.link.call(() => this.link.core.truncate(this.id, tokenCount))
    // Freed blocks may let a request waiting for capacity run.
    this.link.wake()
  }

  /** Idempotent, also after Engine.close(). A pending turn's `done` resolves 'cancelled'. */
  close(): void {
    if (this._record.closed) return
    if (this.link.closed) {
      this._closeForEngine()
      return
    }
    this.rememberTokenCount()
    // Closed first: finishing the turn may call back into close() (a generate() turn).
    this._record.closed = true
    this.endTurn()
    try {
      this.link.core.closeRequest(this.id)
    } catch {
      // Closing never fails for a request this engine made; nothing useful to report if it did.
    }
    // A closed request freed its blocks: a request waiting for capacity may fit now.
    this.link.wake()
  }

  // ---------------------------------------------------------------------------------------------
  // Internal
  // ---------------------------------------------------------------------------------------------

  /** @internal beginTurn after validation; `owned`: engine.generate closes the request when
   *  the turn finishes. */
  _begin(input: string | Int32Array, checked: opts.CheckedTurnOptions, owned: boolean): Turn {
    this.checkBeginnable()
    const tokens = this.link.inputTokens(input, this.tokenCount === 0)
    const turnId = this.link.call(() => this.link.core.beginTurn(this.id, tokens, checked.core))
    return this.begun({ turnId, promptTokens: tokens.length }, checked, owned)
  }

  /** @internal A chat turn: `begin` renders, tokenizes and begins it in the core in one call
   *  (CoreEngine.beginChatTurn for engine.chat, whose request is `owned`;
   *  beginConversationTurn for a conversation's send). */
  _beginChat(checked: opts.CheckedTurnOptions, begin: ChatTurnBegin<ChatTurnView>, owned = true): Turn {
    this.checkBeginnable()
    return this.begun(this.link.call(() => begin(this.id, checked.core)), checked, owned)
  }

  /** @internal The same, with the render off the JS thread (engine.chatAsync); rejects with what
   *  the binding threw, unconverted. */
  async _beginChatAsync(checked: opts.CheckedTurnOptions, begin: ChatTurnBegin<Promise<ChatTurnView>>): Promise<Turn> {
    this.checkBeginnable()
    const started = await begin(this.id, checked.core)
    // Closed while it rendered: ENGINE_CLOSED or REQUEST_CLOSED, not a late turn (the caller
    // closes the request, which ends the turn in the core).
    this.checkBeginnable()
    return this.begun(started, checked, true)
  }

  private checkBeginnable(): void {
    this.link.checkUsable()
    this.checkOpen()
    this.checkPreviousTurnEnded()
  }

  /** The facade's side of a turn the core began. */
  private begun(started: ChatTurnView, checked: opts.CheckedTurnOptions, owned: boolean): Turn {
    const ids = { requestId: this.id, turnId: started.turnId }
    const state = new TurnState(this.link, ids, started.promptTokens, owned ? this : null)
    if (checked.core.logprobs !== undefined) state.recordLogprobs()
    const turn = Turn._create(this, state, this.link)
    this._turn = turn
    this.link.turnBegun(state, this)
    if (checked.signal !== null) state.attachSignal(checked.signal)
    return turn
  }

  /** @internal The engine is closing: no core call (the core closes every request itself). */
  _closeForEngine(): void {
    if (this._record.closed) return
    this.rememberTokenCount()
    this._record.closed = true
    this.endTurn()
  }

  private rememberTokenCount(): void {
    try {
      this.closedTokenCount = this.link.core.requestTokenCount(this.id)
    } catch {
      // The count is informative only.
    }
  }

  private endTurn(): void {
    this._turn?._state.finish({ reason: 'cancelled', errorCode: 'none', usage: null, stop: null })
  }

  /**
   * Every turn ends exactly once. The core hands a turn's finishing event to a run() when that run
   * starts, and the facade routes it when the run returns; in between the core would accept a new
   * turn, whose state would take the old one's place before its finish arrived. So a new turn
   * waits until the previous one has ended here too (EVENTS_PENDING, as for a retained event).
   */
  private checkPreviousTurnEnded(): void {
    const previous = this._turn?._state
    if (previous === undefined || previous.finished) return
    const state = this.state
    if (state === 'queued' || state === 'active') return // the core refuses with TURN_ACTIVE
    throw new OrtexError(
      'EVENTS_PENDING',
      `request ${this.id}: the finishing event of turn ${previous.turnId} is in a run() that has not returned yet; await it first`,
    )
  }

  private checkOpen(): void {
    this.link.checkOpen()
    if (this._record.closed) throw new OrtexError('REQUEST_CLOSED', `request ${this.id} is closed`)
  }
}

/** One generation on a Request: a handle over its TurnState (turn-state.ts). */
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
