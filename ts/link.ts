// The narrow interfaces the handles talk to, so that none reaches through the Engine:
//
//   Request ──EngineLink──▶ the core handle, error conversion, wake-up, the turn registry
//   TurnState ─TurnLink───▶ cancel / hold in the core (quietly), the turn registry
//   duplex/ ──DuplexHost──▶ the session rules' factory, the engine's health and its end
//
// The Engine implements them (engine.ts); this file imports nothing of engine, request or
// turn-state, so those modules form no import circle.

import type { CoreEngine, CoreSessions } from './binding'
import type { SessionsOptionsInput } from './generated/boundary'
import type { EventErrorCode } from './types'

/** Why an engine stopped serving: an engine-level failure, or close(). */
export type EngineEndReason = 'engine_failure' | 'engine_closed'

/** What a turn's state needs from its engine. Every call is quiet: it never throws. */
export interface TurnLink {
  /** Cancels the turn in the core; false when it was no longer running there. */
  cancelTurnQuietly(requestId: number, turnId: number): boolean
  /** Holds (`held`) or releases the running turn in the core (pacing by its iterators); whether
   *  the turn is now held. Releasing wakes the driven loop. */
  holdTurnQuietly(requestId: number, turnId: number, held: boolean): boolean
  /** The turn ended: the engine stops routing to it (and closes a generate() request). */
  turnFinished(state: { readonly requestId: number }): void
  /** Iterating a turn starts the engine's driven loop. */
  ensureStarted(): void
}

/** What a Request needs from its engine. */
export interface EngineLink<State = unknown, Handle = unknown> extends TurnLink {
  readonly core: CoreEngine
  /** True once the engine is closed. */
  readonly closed: boolean
  /** Calls the core and converts what it throws into an OrtexError. */
  call<T>(fn: () => T): T
  /** ENGINE_CLOSED once closed. */
  checkOpen(): void
  /** ENGINE_CLOSED or ENGINE_UNHEALTHY: what beginning new work needs. */
  checkUsable(): void
  /** Text is tokenized (with the tokenizer's BOS where it `startsContext`: the request holds no
   *  tokens yet); token ids pass through; empty input is INVALID_ARGUMENT. */
  inputTokens(input: string | Int32Array, startsContext: boolean): Int32Array
  /** New work may be ready for the driven loop (a command, freed blocks). */
  wake(): void
  /** A turn began on `request`: the engine routes its events to `state` from now on. */
  turnBegun(state: State, request: Handle): void
}

/** What the duplex session layer needs from an engine. */
export interface DuplexHost {
  /** A session rules object (the core's session manager) for this engine. */
  createSessions(options: SessionsOptionsInput): CoreSessions
  /** ENGINE_CLOSED or ENGINE_UNHEALTHY. */
  checkUsable(): void
  /** ENGINE_CLOSED. */
  checkOpen(): void
  /** The engine-level failure's code, once the engine failed. */
  readonly failure: EventErrorCode | null
  /** Calls `listener` once when the engine fails or is closed (at once if it has); returns a
   *  function that removes it. */
  onEnd(listener: (reason: EngineEndReason) => void): () => void
  /** Closes the request with this id if the program still holds it. */
  closeRequest(requestId: number): void
}
