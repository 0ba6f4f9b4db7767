// The simulation's checks: every event is routed into the model (test/sim/model.ts) and checked
// against it, as are the runs, the engine's counters, the core's own invariants and, at the end,
// every turn's `done`. A failed check throws a SimFailure that carries the seed and the trace.
import type { OrtexModule } from '../helpers/backends'
import { runningTurn, type Engine, type EngineShape, type EventBuffer, type RemainingWork, type RequestModel, type SimModel, type TurnModel } from './model'

const TOKEN = 1
const TURN_FINISHED = 2
const CAPACITY_BLOCKED = 4
const FAILED = 8
const RETRYABLE = 16

type Stats = ReturnType<Engine['stats']>

export class SimFailure extends Error {
  constructor(
    readonly seed: number,
    readonly backend: string,
    readonly reason: string,
    readonly trace: string[],
  ) {
    super(`seed ${seed} (${backend}): ${reason}`)
  }
}

/** What the seed did, for a failure's message: the first lines and a window of the latest. */
export class Trace {
  /** The latest lines (the window; a failure message adds the head). */
  readonly tail: string[] = []
  private readonly head: string[] = []
  private logged = 0

  constructor(
    private readonly seed: number,
    private readonly backend: string,
    private readonly traceLines: number,
  ) {}

  log(line: string): void {
    this.logged++
    if (this.head.length < Math.min(40, this.traceLines)) {
      this.head.push(line)
      return
    }
    this.tail.push(line)
    if (this.tail.length > 4 * this.traceLines) this.tail.splice(0, this.tail.length - this.traceLines)
  }

  check(condition: boolean, message: string): asserts condition {
    if (!condition) this.fail(message)
  }

  fail(message: string): never {
    const tail = this.tail.slice(-this.traceLines)
    const skipped = this.logged - this.head.length - tail.length
    const lines = [...this.head, ...(skipped > 0 ? [`... ${skipped} lines ...`] : []), ...tail]
    throw new SimFailure(this.seed, this.backend, message, lines)
  }
}

export class Checker {
  /** The step from which no fault is injected (null while faults may still come). */
  private faultsOffAtStep: number | null = null

  constructor(
    private readonly mod: OrtexModule,
    private readonly engine: Engine,
    private readonly model: SimModel,
    private readonly trace: Trace,
    /** The engine options' `faults` ({} without). */
    private readonly faults: Record<string, any>,
  ) {}

  check(condition: boolean, message: string): asserts condition {
    this.trace.check(condition, message)
  }

  fail(message: string): never {
    return this.trace.fail(message)
  }

  // ---- calls -------------------------------------------------------------------------------

  /** `error` is an OrtexError with `code`, and the model allows the call to fail. */
  expectError(error: unknown, code: string, what: string, allowed: boolean): void {
    if (!(error instanceof this.mod.OrtexError)) this.fail(`${what} threw a non-OrtexError: ${(error as Error)?.stack ?? String(error)}`)
    // The step in flight may have failed fatally already (WebAssembly commits it before run()
    // returns); its Failed event is routed when the run is awaited.
    if (this.model.inFlight && (error as any).code === 'ENGINE_UNHEALTHY' && this.fatalFaultsInjected()) return
    if ((error as any).code !== code) this.fail(`${what} threw ${(error as any).code} (${(error as Error).message}), expected ${code}`)
    if (!allowed) this.fail(`${what} threw ${code} (${(error as Error).message}) where the model expects success`)
  }

  /** From `step` on no fault is injected: an engine-level event from then on is a failure. */
  faultsOff(step: number): void {
    this.faultsOffAtStep = step
  }

  fatalFaultsInjected(): boolean {
    return this.faults.fatalRate > 0 || this.faults.fatalSteps?.length > 0
  }

  checkInvariants(): void {
    try {
      ;(this.engine as any).checkInvariants()
    } catch (error) {
      this.fail(`checkInvariants: ${String((error as Error)?.message ?? error)}`)
    }
  }

  // ---- runs --------------------------------------------------------------------------------

  /** runSync's result is what the buffer holds, within its capacity. */
  checkRunCount(buffer: EventBuffer, count: number): void {
    this.check(count === buffer.count, `runSync returned ${count} but buffer.count is ${buffer.count}`)
    this.check(count >= 0 && count <= buffer.capacity, `runSync wrote ${count} events into a buffer of ${buffer.capacity}`)
  }

  /**
   * A runSync's steps: retained events drain without a step (unless dropped requests may still be
   * reclaimed), one run executes at most one step, and one transaction writes at most one event
   * per request.
   */
  checkRunSteps(buffer: EventBuffer, count: number, before: Stats, after: Stats, droppedAlive: number, events: any[]): void {
    if (droppedAlive === 0 && before.retainedEvents > 0) {
      this.check(after.steps === before.steps, `a run with ${before.retainedEvents} retained events executed a step`)
      this.check(count === Math.min(buffer.capacity, before.retainedEvents), `drained ${count} of ${before.retainedEvents} retained events into ${buffer.capacity}`)
    }
    if (after.steps > before.steps) {
      this.check(after.steps === before.steps + 1, `one run executed ${after.steps - before.steps} steps`)
      const ids = events.filter((e) => e.request !== null).map((e) => e.request!.id)
      this.check(new Set(ids).size === ids.length, `one transaction wrote two events for one request: ${ids}`)
    }
  }

  /** After a run's events are routed: the core's invariants and its counters against the model. */
  afterRun(stats: Stats): void {
    this.checkInvariants()
    if (!this.model.unhealthy) this.checkCounters(stats)
  }

  private checkCounters(stats: Stats): void {
    const open = this.model.open()
    this.check(stats.freeBlocks >= 0 && stats.freeBlocks <= stats.totalBlocks, `freeBlocks ${stats.freeBlocks} of ${stats.totalBlocks}`)
    if (stats.retainedEvents !== 0 || stats.activeRequests !== open.length) return
    const running = open.filter((m) => runningTurn(m) !== null)
    this.check(stats.pendingTurns === running.length, `pendingTurns ${stats.pendingTurns}, the model runs ${running.length}`)
    for (const model of open) {
      const request = model.request!
      this.check(request.tokenCount === model.tokenCount, `r${model.id} holds ${request.tokenCount} tokens, the model expects ${model.tokenCount}`)
      const turn = model.current
      const expected = !turn ? 'created' : turn.finished ? 'turn-complete' : turn.generated.length === 0 ? 'queued' : 'active'
      this.check(request.state === expected, `r${model.id} is ${request.state}, the model expects ${expected}`)
    }
  }

  // ---- events ------------------------------------------------------------------------------

  /** Routes one event into the model, checking it against what the model allows. */
  onEvent(event: any): void {
    this.model.summary.events++
    const usage = event.usage ? `${event.usage.promptTokens}/${event.usage.generatedTokens}/${event.usage.cachedPromptTokens}` : '-'
    this.trace.log(`  ev r${event.request?.id ?? 0} t${event.turnId} f${event.flags} tok=${event.token} ${event.finishReason} ${event.errorCode} u=${usage}`)
    if (event.request === null) return this.onEngineEvent(event)
    const model = this.routedModel(event)
    if (model === null) return
    const flags = event.flags as number
    if (flags === CAPACITY_BLOCKED) return this.onCapacityBlocked(model, event)
    if (flags === FAILED) return this.onPrefillFailure(model, event)
    this.check((flags & ~(TOKEN | TURN_FINISHED | FAILED)) === 0 && (flags & (TOKEN | TURN_FINISHED)) !== 0, `unexpected flags ${flags}`)
    const turn = model.current
    if (!turn || turn.finished) this.fail(`event for r${model.id} turn ${event.turnId} with no running turn`)
    this.check(event.turnId === turn.id, `event for turn ${event.turnId}, r${model.id} runs turn ${turn.id}`)
    if (flags & TOKEN) this.onToken(model, turn, event.token)
    const natural = flags & TOKEN ? this.model.naturalReason(model, turn, event.token) : null
    if (!(flags & TURN_FINISHED)) {
      this.check(event.finishReason === 'none' && event.errorCode === 'none' && event.usage === null, `a token event carries finish data`)
      if (natural) this.fail(`r${model.id} t${turn.id} reached ${natural} but did not finish`)
      return
    }
    this.onFinish(model, turn, event, natural, usage)
  }

  /** The model of an event's request, or null where the event is legal but not the model's. */
  private routedModel(event: any): RequestModel | null {
    const model = this.model.of(event.request)
    if (!model) this.fail(`event for unknown request ${event.request.id}`)
    if (model.closed && this.model.closedInFlight.has(model.id)) return null // written before the close
    if (model.closed) this.fail(`event for closed request r${model.id}`)
    if (model.dropped) return null // a dropped request may still emit until it is reclaimed
    this.check(event.request === model.request, `event.request is not the Request object of r${model.id}`)
    return model
  }

  private onCapacityBlocked(model: RequestModel, event: any): void {
    this.check(event.errorCode === 'capacity-deferred', `CapacityBlocked event with ${event.errorCode}`)
    const turnId = runningTurn(model)?.id ?? 0
    this.check(event.turnId === turnId || (event.turnId === 0 && model.prefillCalls > 0), `CapacityBlocked for turn ${event.turnId}, expected ${turnId}`)
  }

  /** A prefill without a turn that can never fit the pool. */
  private onPrefillFailure(model: RequestModel, event: any): void {
    this.check(event.turnId === 0 && event.errorCode === 'request-unserviceable', `a bare Failed event: turn ${event.turnId}, ${event.errorCode}`)
    model.prefillFailures++
    this.check(model.prefillFailures <= model.prefillCalls, `prefill failure ${model.prefillFailures} of r${model.id} after ${model.prefillCalls} prefill(s)`)
    this.checkUnserviceable(model)
  }

  private onToken(model: RequestModel, turn: TurnModel, token: number): void {
    this.check(Number.isInteger(token) && token >= 0 && token < this.model.shape.vocabSize, `token ${token} outside the vocabulary`)
    turn.generated.push(token)
    model.tokenCount++
    this.check(model.tokenCount <= model.maxSessionTokens, `r${model.id} holds ${model.tokenCount} tokens, over its limit ${model.maxSessionTokens}`)
    if (turn.maxGeneratedTokens > 0) {
      this.check(turn.generated.length <= turn.maxGeneratedTokens, `turn generated ${turn.generated.length} of at most ${turn.maxGeneratedTokens}`)
    }
  }

  /** The turn's one finish event: its usage, and a reason that matches its cause. */
  private onFinish(model: RequestModel, turn: TurnModel, event: any, natural: string | null, usage: string): void {
    const flags = event.flags as number
    turn.finished = true
    this.model.summary.turnsFinished++
    const reason = event.finishReason as string
    turn.eventReason = reason
    this.check(event.usage !== null, `a finish event without usage`)
    this.check(
      event.usage.promptTokens === turn.promptLength && event.usage.generatedTokens === turn.generated.length,
      `usage ${usage}, expected ${turn.promptLength}/${turn.generated.length}/c`,
    )
    // The prefix cache serves whole blocks of the prompt, never its last token (its logits are
    // needed), and nothing when it is off.
    const cached = event.usage.cachedPromptTokens as number
    const cachedLimit = this.model.shape.prefixCaching ? Math.max(0, turn.promptLength - 1) : 0
    this.check(cached >= 0 && cached <= cachedLimit, `usage ${usage}: ${cached} cached prompt tokens, at most ${cachedLimit}`)
    this.model.summary.cachedPromptTokens += cached
    if (reason === 'cancelled') {
      this.check(turn.cancelRequested, `r${model.id} t${turn.id} finished cancelled but was not cancelled`)
      this.check(natural === null, `a cancelled finish merged into a token that reached ${natural}`)
      this.check(event.errorCode === 'none' && !(flags & FAILED), `a cancelled finish with ${event.errorCode}`)
    } else if (reason === 'failed') {
      this.check(!!(flags & FAILED) && event.errorCode === 'request-unserviceable', `failed finish with flags ${flags} and ${event.errorCode}`)
      this.check(!(flags & TOKEN), `a failed finish carries a token`)
      this.check(!turn.cancelRequested, `r${model.id} t${turn.id} was cancelled but finished failed`)
      this.checkUnserviceable(model)
    } else {
      this.check(!turn.cancelRequested, `r${model.id} t${turn.id} was cancelled but finished ${reason}`)
      this.check(event.errorCode === 'none' && !(flags & FAILED), `finish ${reason} with ${event.errorCode}`)
      this.check(natural === reason, `r${model.id} t${turn.id} finished ${reason} but its last token gives ${natural}`)
    }
    model.tokenCount += model.deferredPrefill
    model.deferredPrefill = 0
  }

  /** Only a request whose context needs more blocks than the pool has may fail unserviceable. */
  private checkUnserviceable(model: RequestModel): void {
    const { blockSize, numBlocks } = this.model.shape
    const blocks = Math.ceil(model.tokenCount / blockSize)
    this.check(blocks > numBlocks, `r${model.id} failed unserviceable holding ${model.tokenCount} tokens (${blocks} blocks of ${numBlocks})`)
  }

  /** Engine-level events: only the faults that were injected, each with its code. */
  private onEngineEvent(event: any): void {
    const faults = this.faults
    this.model.summary.engineEvents++
    if (this.faultsOffAtStep !== null) this.fail(`engine-level event (flags ${event.flags}) with faults off since step ${this.faultsOffAtStep}`)
    this.check(event.turnId === 0 && event.usage === null && event.finishReason === 'none', `engine-level event with turn/usage/finish data`)
    if (event.flags === RETRYABLE) {
      this.check(event.errorCode === 'retryable-execution', `Retryable event with ${event.errorCode}`)
      this.check(faults.retryableRate > 0 || faults.retryableSteps?.length > 0, `a retryable fault without injected faults`)
    } else if (event.flags === CAPACITY_BLOCKED) {
      this.check(event.errorCode === 'execution-capacity-exceeded', `engine CapacityBlocked with ${event.errorCode}`)
      this.check(faults.capacityRate > 0 || faults.capacitySteps?.length > 0, `a capacity fault without injected faults`)
    } else if (event.flags === FAILED) {
      this.check(event.errorCode === 'engine-execution-failure', `engine Failed with ${event.errorCode}`)
      this.check(this.fatalFaultsInjected(), `a fatal failure without injected faults`)
      this.model.unhealthy = true
      this.model.summary.fatal = true
    } else {
      this.fail(`engine-level event with flags ${event.flags}`)
    }
  }

  // ---- the end -----------------------------------------------------------------------------

  /** Every turn whose Turn the driver still holds settled `done` exactly once, as it ended. */
  async checkDones(): Promise<void> {
    await new Promise((resolve) => setImmediate(resolve))
    for (const turn of this.model.turns) {
      if (turn.turn === null) continue // dropped: its done is the collector's business
      const what = `turn ${turn.id} (finish event ${turn.eventReason ?? 'none'}${turn.closedEarly ? ', closed first' : ''})`
      this.check(turn.doneSettled === 1, `${what}: done settled ${turn.doneSettled} times`)
      if (turn.eventReason !== null) this.check(turn.doneReason === turn.eventReason, `${what}: done says ${turn.doneReason}`)
      else if (this.model.unhealthy) this.check(turn.doneReason === 'failed' || turn.doneReason === 'cancelled', `${what}: done says ${turn.doneReason}`)
      else this.check(turn.doneReason === 'cancelled', `${what}: done says ${turn.doneReason}`)
    }
  }
}

/** How many runs the liveness phase may take, and how that number was derived. */
export interface LivenessBound {
  runs: number
  why: string
}

/**
 * The runs within which every turn still running must end once faults are off, from what is
 * left to compute (remainingWork: each request's context and the rest of its generation budget,
 * T tokens in all):
 *
 *   runs <= 1 + (T + recompute) x ceil(activeRequests / bufferCapacity)
 *
 * - With faults off every step computes at least one token (the token budget is at least 1, and
 *   a step that finds the pool full preempts for the oldest blocked request and runs it), so
 *   without KV pressure T steps suffice: nothing is computed twice.
 * - Under KV pressure (the requests' final contexts need more blocks than the pool has) a
 *   preempted request computes its context again. Each preemption makes room for one block of
 *   an older request, so there are at most about as many as the blocks the requests still gain
 *   (P = sum of ceil(tokens / blockSize), plus one per request), each recomputing at most the
 *   longest context C: recompute = P x C. (Not a proof: a request computed again gains its
 *   blocks again. Over 20,000 seeds the phase used at most a tenth of this allowance.)
 * - One transaction writes at most one event per request, so with a buffer that holds an event
 *   per request no event waits for a later run, and each run is a step; the 1 is the run that
 *   sees nothing is pending.
 */
export function livenessBound(work: RemainingWork[], shape: EngineShape, activeRequests: number, bufferCapacity: number): LivenessBound {
  const tokensOf = (w: RemainingWork) => w.contextTokens + w.generatedTokens
  const blocksOf = (w: RemainingWork) => Math.ceil(tokensOf(w) / shape.blockSize)
  const tokens = sum(work.map(tokensOf))
  const blocks = sum(work.map(blocksOf))
  const pressure = blocks > shape.numBlocks
  const preemptions = pressure ? blocks + work.length : 0
  const longest = Math.max(0, ...work.map(tokensOf))
  const runsPerStep = Math.ceil(Math.max(1, activeRequests) / bufferCapacity)
  const runs = 1 + (tokens + preemptions * longest) * runsPerStep
  const recompute = pressure ? ` + ${preemptions} preemptions x ${longest} tokens recomputed (${blocks} blocks needed of ${shape.numBlocks})` : ''
  return { runs, why: `${work.length} requests with ${tokens} tokens to compute${recompute}` }
}

function sum(values: number[]): number {
  return values.reduce((total, v) => total + v, 0)
}
