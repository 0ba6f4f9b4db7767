// The simulation's model of the engine: every request and turn the driver made, updated by the
// actions (what the caller asked for) and by the events in the order they are delivered (what the
// core did). The checker compares the engine with it; nothing here calls the engine.
import type { OrtexModule } from '../helpers/backends'

export type Engine = ReturnType<OrtexModule['Engine']['simulated']>
export type Request = ReturnType<Engine['createRequest']>
export type Turn = ReturnType<Request['beginTurn']>
export type EventBuffer = ReturnType<Engine['createEventBuffer']>

export interface SimSummary {
  seed: number
  runs: number
  turnsBegun: number
  turnsFinished: number
  events: number
  engineEvents: number
  cancelled: number
  dropped: number
  /** Prompt tokens the prefix cache served (usage.cachedPromptTokens, summed). */
  cachedPromptTokens: number
  fatal: boolean
}

export interface TurnModel {
  id: number
  turn: Turn | null
  promptLength: number
  maxGeneratedTokens: number
  ignoreEos: boolean
  stopTokenIds: number[][]
  generated: number[]
  cancelRequested: boolean
  finished: boolean
  /** The reason its finish event carried, once routed. */
  eventReason: string | null
  requestId: number
  /** What `done` resolved with, and how many times the driver saw it settle. */
  doneReason: string | null
  doneSettled: number
  /** The request was closed before the turn finished. */
  closedEarly: boolean
}

export interface RequestModel {
  id: number
  request: Request | null
  maxSessionTokens: number
  /** Tokens of this request in event order (what the core holds once its events are delivered). */
  tokenCount: number
  /** Prefill accepted while our model still saw the turn running (its finish was retained). */
  deferredPrefill: number
  lastTurnId: number
  current: TurnModel | null
  turnsBegun: number
  closed: boolean
  dropped: boolean
  /** Accepted prefill calls, and prefill-only failures (Failed with turn 0) seen: each failure
   *  answers at least one prefill. (A failure is reported late when its event is retained, and a
   *  turn that fails unserviceable leaves its prefill's own target pending.) */
  prefillCalls: number
  prefillFailures: number
}

/** The engine's configuration as the model needs it (from `engine.config`). */
export interface EngineShape {
  vocabSize: number
  eosTokenIds: number[]
  maxLength: number
  blockSize: number
  numBlocks: number
  batching: string
  maxScheduledTokens: number
  prefillChunkSize: number
  prefixCaching: boolean
}

export function shapeOf(engine: Engine): EngineShape {
  const config = engine.config
  return {
    vocabSize: config.vocabSize,
    eosTokenIds: [...config.eosTokenIds],
    maxLength: config.maxLength,
    blockSize: config.blockSize,
    numBlocks: config.numBlocks,
    batching: config.batching,
    maxScheduledTokens: config.maxScheduledTokens,
    prefillChunkSize: config.prefillChunkSize,
    prefixCaching: config.prefixCaching,
  }
}

export class SimModel {
  readonly requests: RequestModel[] = []
  readonly turns: TurnModel[] = []
  readonly summary: SimSummary
  /** A fatal failure was delivered: the engine refuses everything but close(). */
  unhealthy = false
  /** A run() is in flight: its events are not routed yet, so the model is behind the core. */
  inFlight = false
  /** Requests closed while a run() was in flight: that run may still carry their events. */
  readonly closedInFlight = new Set<number>()
  private readonly byRequest = new Map<Request, RequestModel>()
  private readonly byId = new Map<number, RequestModel>()

  constructor(
    seed: number,
    readonly shape: EngineShape,
  ) {
    this.summary = { seed, runs: 0, turnsBegun: 0, turnsFinished: 0, events: 0, engineEvents: 0, cancelled: 0, dropped: 0, cachedPromptTokens: 0, fatal: false }
  }

  /** Requests neither closed nor dropped. */
  open(): RequestModel[] {
    return this.requests.filter((m) => !m.closed && !m.dropped)
  }

  hasId(id: number): boolean {
    return this.byId.has(id)
  }

  /** The model of an event's request: by its object, or by id once the object was dropped. */
  of(request: Request): RequestModel | undefined {
    return this.byRequest.get(request) ?? this.byId.get(request.id)
  }

  addRequest(request: Request, maxSessionTokens: number): RequestModel {
    const model: RequestModel = {
      id: request.id,
      request,
      maxSessionTokens,
      tokenCount: 0,
      deferredPrefill: 0,
      lastTurnId: 0,
      current: null,
      turnsBegun: 0,
      closed: false,
      dropped: false,
      prefillCalls: 0,
      prefillFailures: 0,
    }
    this.requests.push(model)
    this.byRequest.set(request, model)
    this.byId.set(request.id, model)
    return model
  }

  /** A turn the core accepted, with `length` new input tokens. */
  addTurn(model: RequestModel, turn: Turn, length: number, options: Record<string, unknown>): TurnModel {
    model.lastTurnId = turn.id
    model.tokenCount += length
    model.turnsBegun++
    this.summary.turnsBegun++
    const turnModel: TurnModel = {
      id: turn.id,
      turn,
      promptLength: length,
      maxGeneratedTokens: (options.maxGeneratedTokens as number | undefined) ?? 0,
      ignoreEos: options.ignoreEos === true,
      stopTokenIds: (options.stopTokenIds as number[][] | undefined) ?? [],
      generated: [],
      cancelRequested: false,
      finished: false,
      eventReason: null,
      requestId: model.id,
      doneReason: null,
      doneSettled: 0,
      closedEarly: false,
    }
    // Held by the promise callback, not by the Turn: a dropped handle can still be collected.
    void turn.done.then((result) => {
      turnModel.doneSettled++
      turnModel.doneReason = result.finishReason
    })
    this.turns.push(turnModel)
    model.current = turnModel
    return turnModel
  }

  markClosed(model: RequestModel): void {
    model.closed = true
    if (model.current && !model.current.finished) model.current.closedEarly = true
    if (this.inFlight) this.closedInFlight.add(model.id)
  }

  /** Forgets the request's handles (and every Turn of it: a Turn holds its Request). */
  drop(model: RequestModel): void {
    this.byRequest.delete(model.request!)
    model.request = null
    for (const turn of this.turns) if (turn.requestId === model.id) turn.turn = null
    model.dropped = true
    this.summary.dropped++
  }

  /** Why the turn must end after its latest token, in the core's order, or null. */
  naturalReason(model: RequestModel, turn: TurnModel, token: number): string | null {
    if (!turn.ignoreEos && this.shape.eosTokenIds.includes(token)) return 'eos'
    const generated = turn.generated
    for (const stop of turn.stopTokenIds) {
      if (stop.length <= generated.length && stop.every((t, i) => generated[generated.length - stop.length + i] === t)) return 'stop'
    }
    if (turn.maxGeneratedTokens > 0 && generated.length >= turn.maxGeneratedTokens) return 'max-generated-tokens'
    if (model.tokenCount >= model.maxSessionTokens) return 'max-session-tokens'
    return null
  }
}

/** The request's turn, if it has one the model has not seen finish. */
export function runningTurn(model: RequestModel): TurnModel | null {
  return model.current !== null && !model.current.finished ? model.current : null
}

/** What the core may still compute for a request: its context (again, if its KV was preempted)
 *  and the tokens its running turn may still generate. */
export interface RemainingWork {
  contextTokens: number
  generatedTokens: number
}

/**
 * At most what the core may still compute, per request it holds. An open request may have all
 * of its context to compute (input of a turn cancelled before it ran, a prefill, or KV that was
 * preempted), and a running turn the rest of its generation budget; a dropped request not yet
 * reclaimed, up to its whole session. Closed requests compute nothing.
 */
export function remainingWork(model: SimModel): RemainingWork[] {
  const work: RemainingWork[] = []
  for (const m of model.requests) {
    if (m.dropped) work.push({ contextTokens: m.maxSessionTokens, generatedTokens: 0 })
    else if (!m.closed) work.push({ contextTokens: m.tokenCount + m.deferredPrefill, generatedTokens: generationLeft(m) })
  }
  return work
}

/** The tokens a request's running turn may still generate (0 without one). */
function generationLeft(m: RequestModel): number {
  const turn = runningTurn(m)
  if (turn === null) return 0
  const sessionLeft = Math.max(0, m.maxSessionTokens - m.tokenCount)
  return turn.maxGeneratedTokens > 0 ? Math.min(turn.maxGeneratedTokens - turn.generated.length, sessionLeft) : sessionLeft
}
