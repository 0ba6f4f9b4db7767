// The seeded whole-engine simulation, driven through the public facade.
//
// One seed builds one workload (workload.ts): an engine configuration (KV pressure, chunked
// prefill, static or dynamic batching, injected retryable / capacity / fatal faults) and a
// sequence of caller actions interleaved with `runSync` calls on buffers of random capacity:
// requests arrive, begin turns (fresh and continuations, greedy and sampled, with limits and stop
// sequences), prefill, get cancelled at random points, closed, or dropped for the garbage
// collector. Some runs are `run()` calls with actions taken before they return.
//
// A seed runs in two phases, as TigerBeetle's simulator does:
//
//   faults phase      the actions and runs, with faults injected at scheduled steps; then runs
//                     alone until the last scheduled fault is past and its events delivered
//   liveness phase    faults off, no more actions: every turn still running must end (and all
//                     pending work with it) within a bound derived from what is left to compute
//                     (checker.ts, livenessBound)
//
// then every request is closed (or, after a fatal fault, the engine refuses all but close()).
//
// A model of every request and turn (model.ts), updated in event order, is checked after every
// run (checker.ts):
//   - each begun turn finishes exactly once (unless its request was closed first);
//   - tokens per turn stay within their limits, and a turn never outlives a limit it reached;
//   - no event ever arrives for a closed request; turn ids grow by one per request;
//   - finish reasons match their cause (max-generated-tokens only at the limit, max-session-tokens
//     only when the request is full, cancelled only for turns we cancelled, eos only on the EOS
//     token, stop only after a stop sequence, failed only with an error code and a request that
//     cannot fit the pool);
//   - engine-level events only for faults that were injected, none once faults are off;
//   - the core's accounting invariants hold (`checkInvariants()`), retained events drain without
//     model work, and the engine's counters agree with the model;
//   - once everything is closed (and dropped handles are collected) every block is free;
//   - every turn's `done` settles exactly once, with the reason its finish event carried (or
//     'cancelled' for a request closed first), including turns whose finish was in a run() still
//     in flight when the caller acted.
import type { OrtexModule } from '../helpers/backends'
import { Checker, SimFailure, Trace, livenessBound } from './checker'
import { SimModel, remainingWork, runningTurn, shapeOf, type Engine, type EventBuffer, type SimSummary } from './model'
import { Prng } from './prng'
import { Actions, workloadFor, type Workload } from './workload'

export { SimFailure } from './checker'
export type { SimSummary } from './model'

export interface SimRunOptions {
  /** This seed may drop handles and call global.gc() (needs --expose-gc). */
  gc: boolean
  /** Lines of trace kept for a failure message. */
  traceLines?: number
}

export async function runSimSeed(mod: OrtexModule, backend: string, seed: number, runOptions: SimRunOptions): Promise<SimSummary> {
  const rng = new Prng(seed)
  const workload = workloadFor(rng)
  const trace = new Trace(seed, backend, runOptions.traceLines ?? 60)
  let sim: Simulation | null = null
  try {
    trace.log(`options ${JSON.stringify(workload.options)}; ${workload.iterations} iterations, faults before step ${workload.faultHorizonSteps}`)
    sim = new Simulation(mod, seed, rng, workload, trace, runOptions.gc)
    return await sim.run()
  } catch (error) {
    if (error instanceof SimFailure) throw error
    throw new SimFailure(seed, backend, `unexpected error: ${(error as Error)?.stack ?? String(error)}`, trace.tail)
  } finally {
    await sim?.dispose()
  }
}

/** One seed: the engine, the model, the checker and the actions, tied together by the runs. */
class Simulation {
  private readonly engine: Engine
  private readonly model: SimModel
  private readonly checker: Checker
  private readonly actions: Actions
  private readonly buffers: EventBuffer[]

  constructor(
    mod: OrtexModule,
    seed: number,
    private readonly rng: Prng,
    private readonly workload: Workload,
    private readonly trace: Trace,
    private readonly gc: boolean,
  ) {
    const options = workload.options
    this.engine = mod.Engine.simulated(options as any)
    this.model = new SimModel(seed, shapeOf(this.engine))
    this.checker = new Checker(mod, this.engine, this.model, trace, (options.faults ?? {}) as Record<string, any>)
    this.actions = new Actions(rng, this.engine, options, this.model, this.checker, trace, gc)
    this.buffers = [1, 2, 3, 5, 16, 256].map((capacity) => this.engine.createEventBuffer(capacity))
  }

  async run(): Promise<SimSummary> {
    await this.faultsPhase()
    if (!this.model.unhealthy) this.livenessPhase()
    if (this.model.unhealthy) await this.endUnhealthy()
    else await this.endHealthy()
    return this.model.summary
  }

  async dispose(): Promise<void> {
    try {
      await this.engine.close()
    } catch {
      // The failure being reported matters more.
    }
    const gc = (globalThis as any).gc
    if (this.gc && typeof gc === 'function') {
      // Let queued FinalizationRegistry callbacks run while the engine is still referenced: in
      // Node 20 a FinalizationRegistry collected with a cleanup still queued stops every later
      // one in the process (contract/entry-points.test.ts, "collecting an engine with a queued
      // reclamation").
      for (let i = 0; i < 3; i++) {
        gc()
        await new Promise((resolve) => setTimeout(resolve, 1))
      }
    }
  }

  // ---- phases ------------------------------------------------------------------------------

  /**
   * The workload with its injected faults: random actions between runs, a quarter of the runs
   * run() calls with actions in flight; then runs alone until the last scheduled fault is past
   * and every event it may have caused is delivered.
   */
  private async faultsPhase(): Promise<void> {
    for (let i = 0; i < this.workload.iterations && !this.model.unhealthy; i++) {
      const actions = this.rng.int(0, 2)
      for (let a = 0; a < actions; a++) await this.actions.act()
      if (this.rng.chance(0.25)) await this.runInFlight()
      else this.runOnce()
    }
    this.runUntil(() => {
      const stats = this.engine.stats()
      return stats.steps >= this.workload.faultHorizonSteps && stats.retainedEvents === 0
    })
  }

  /** Runs on random buffers until `done()` or nothing is pending, failing if the engine stalls. */
  private runUntil(done: () => boolean): void {
    let runs = 0
    let idleRuns = 0
    while (!this.model.unhealthy && this.engine.hasPendingWork() && !done()) {
      if (++runs > 50_000) this.checker.fail('no progress: still pending work after 50000 runs')
      const steps = this.engine.stats().steps
      const events = this.model.summary.events
      this.runOnce()
      idleRuns = this.engine.stats().steps === steps && this.model.summary.events === events ? idleRuns + 1 : 0
      if (idleRuns >= 100) this.checker.fail(`stalled: hasPendingWork() stays true but ${idleRuns} runs in a row executed nothing and wrote no event`)
    }
  }

  /**
   * Faults off (every scheduled fault is past) and no more actions: every turn still running
   * must end, and all pending work with it, within the bound that livenessBound derives from
   * what is left to compute. The runs use the largest buffer, so no event waits for a run.
   */
  private livenessPhase(): void {
    const stats = this.engine.stats()
    this.checker.faultsOff(stats.steps)
    const work = remainingWork(this.model)
    const buffer = this.buffers[5]
    const bound = livenessBound(work, this.model.shape, stats.activeRequests, buffer.capacity)
    this.trace.log(`liveness from step ${stats.steps}: at most ${bound.runs} runs (${bound.why})`)
    let runs = 0
    while (this.engine.hasPendingWork()) {
      if (++runs > bound.runs) this.checker.fail(`liveness: ${this.stillRunning()} after ${bound.runs} runs with faults off (${bound.why})`)
      this.runOnce(buffer)
    }
    for (const model of this.model.open()) {
      const turn = runningTurn(model)
      if (turn) this.checker.fail(`r${model.id} t${turn.id} never finished`)
    }
    this.checker.check(this.engine.stats().retainedEvents === 0, `events retained with no pending work`)
  }

  /** The turns the model still sees running, for a liveness failure. */
  private stillRunning(): string {
    const turns = this.model.open().flatMap((m) => {
      const turn = runningTurn(m)
      return turn ? [`r${m.id} t${turn.id} (${turn.generated.length} generated)`] : []
    })
    return turns.length > 0 ? `${turns.join(', ')} still running` : 'work still pending'
  }

  // ---- runs --------------------------------------------------------------------------------

  private runOnce(buffer: EventBuffer = this.rng.pick(this.buffers)): void {
    const before = this.engine.stats()
    const droppedAlive = before.activeRequests - this.model.open().length
    let count: number
    try {
      count = this.engine.runSync(buffer)
    } catch (error) {
      this.checker.fail(`runSync threw ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.model.summary.runs++
    this.checker.checkRunCount(buffer, count)
    const after = this.engine.stats()
    const events = readBuffer(buffer, count)
    this.trace.log(`run cap=${buffer.capacity} -> ${count} (steps ${before.steps}->${after.steps}, retained ${before.retainedEvents}->${after.retainedEvents})`)
    this.checker.checkRunSteps(buffer, count, before, after, droppedAlive, events)
    for (const event of events) this.checker.onEvent(event)
    this.checker.afterRun(after)
  }

  /**
   * A run() with actions taken before it returns (issue 15's lost turn: a finish handed out by
   * the core at the start of a run is routed only when it returns). The native addon plans now
   * and executes off the thread; WebAssembly executes and commits now and routes later.
   */
  private async runInFlight(): Promise<void> {
    const buffer = this.rng.pick(this.buffers)
    this.model.inFlight = true
    let pending: Promise<number>
    try {
      pending = this.engine.run(buffer)
    } catch (error) {
      this.checker.fail(`run threw ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.trace.log(`run() cap=${buffer.capacity} started`)
    // Synchronously, as a caller does right after `const p = engine.run(buffer)`: nothing routes
    // the run's events before it is awaited.
    const actions = this.rng.int(0, 3)
    for (let a = 0; a < actions; a++) this.actions.actNow()
    let count: number
    try {
      count = await pending
    } catch (error) {
      this.checker.fail(`run rejected ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.model.inFlight = false
    this.model.summary.runs++
    this.checker.check(count === buffer.count && count <= buffer.capacity, `run() resolved ${count}, buffer.count ${buffer.count} of ${buffer.capacity}`)
    this.trace.log(`run() cap=${buffer.capacity} -> ${count}`)
    for (const event of readBuffer(buffer, count)) this.checker.onEvent(event)
    this.model.closedInFlight.clear()
    this.checker.afterRun(this.engine.stats())
  }

  // ---- endings -----------------------------------------------------------------------------

  /** Close everything: every block comes back, the engine closes, every `done` settled. */
  private async endHealthy(): Promise<void> {
    this.actions.closeAll()
    await this.collectDropped()
    if (this.model.shape.batching === 'static') {
      // Closed rows of the last static batch are released when the batch is recycled.
      this.checker.check(this.engine.runSync(this.buffers[5]) === 0, `a run after closing everything wrote events`)
    }
    this.checkNothingHeld()
    this.checker.check(this.engine.stats().retainedEvents === 0, `events retained after closing everything`)
    this.checker.check(!this.engine.hasPendingWork(), `pending work after closing everything`)
    this.checker.checkInvariants()
    await this.engine.close()
    await this.engine.close()
    for (const model of this.model.requests) model.request?.close()
    try {
      this.engine.createRequest()
      this.checker.fail('createRequest worked on a closed engine')
    } catch (error) {
      this.checker.expectError(error, 'ENGINE_CLOSED', 'createRequest on a closed engine', true)
    }
    await this.checker.checkDones()
  }

  /** Requests the driver dropped must be reclaimed once collected. */
  private async collectDropped(): Promise<void> {
    const gc = (globalThis as any).gc
    if (this.engine.stats().activeRequests === 0) return
    if (!this.gc || typeof gc !== 'function') this.checker.fail(`${this.engine.stats().activeRequests} requests alive after closing all`)
    for (let i = 0; i < 40 && this.engine.stats().activeRequests > 0; i++) {
      gc()
      await new Promise((resolve) => setTimeout(resolve, 1))
      this.engine.hasPendingWork()
    }
    this.checker.check(this.engine.stats().activeRequests === 0, `dropped requests were not reclaimed after GC`)
  }

  /** After a fatal failure: runs and new requests are refused; close() still works. */
  private async endUnhealthy(): Promise<void> {
    const buffer = this.buffers[5]
    try {
      this.engine.runSync(buffer)
      this.checker.fail('runSync worked on an unhealthy engine')
    } catch (error) {
      this.checker.expectError(error, 'ENGINE_UNHEALTHY', 'runSync after a fatal failure', true)
    }
    try {
      this.engine.createRequest()
      this.checker.fail('createRequest worked on an unhealthy engine')
    } catch (error) {
      this.checker.expectError(error, 'ENGINE_UNHEALTHY', 'createRequest after a fatal failure', true)
    }
    this.checker.checkInvariants()
    for (const model of this.model.open()) model.request!.close()
    // An engine that runs no more steps still gives back what its closed and dropped requests
    // held: a program keeps an unhealthy engine around (to read its stats) as long as it likes.
    await this.collectDropped()
    this.checkNothingHeld()
    await this.engine.close()
    await this.checker.checkDones()
  }

  /** Once every request is closed (and the dropped ones collected), nothing is held. */
  private checkNothingHeld(): void {
    const stats = this.engine.stats()
    const held = `activeRequests ${stats.activeRequests}, pendingTurns ${stats.pendingTurns}, ${stats.totalBlocks - stats.freeBlocks} of ${stats.totalBlocks} blocks held`
    this.checker.check(stats.activeRequests === 0 && stats.pendingTurns === 0 && stats.freeBlocks === stats.totalBlocks, `after closing everything: ${held}`)
  }
}

/** The `count` events a run wrote. */
function readBuffer(buffer: EventBuffer, count: number): any[] {
  const events = []
  for (let i = 0; i < count; i++) events.push(buffer.at(i))
  return events
}
