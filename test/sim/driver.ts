// The seeded whole-engine simulation, driven through the public facade.
//
// One seed builds one workload: an engine configuration (KV pressure, chunked prefill, static or
// dynamic batching, injected retryable / capacity / fatal faults) and a sequence of caller
// actions interleaved with `runSync` calls on buffers of random capacity: requests arrive,
// begin turns (fresh and continuations, greedy and sampled, with limits and stop sequences),
// prefill, get cancelled at random points, closed, or dropped for the garbage collector.
//
// A model of every request and turn, updated in event order, is checked after every run:
//   - each begun turn finishes exactly once (unless its request was closed first);
//   - tokens per turn stay within their limits, and a turn never outlives a limit it reached;
//   - no event ever arrives for a closed request; turn ids grow by one per request;
//   - finish reasons match their cause (max-generated-tokens only at the limit, max-session-tokens
//     only when the request is full, cancelled only for turns we cancelled, eos only on the EOS
//     token, stop only after a stop sequence, failed only with an error code and a request that
//     cannot fit the pool);
//   - the core's accounting invariants hold (`checkInvariants()`), retained events drain without
//     model work, and the engine's counters agree with the model;
//   - once everything is closed (and dropped handles are collected) every block is free;
//   - every turn's `done` settles exactly once, with the reason its finish event carried (or
//     'cancelled' for a request closed first), including turns whose finish was in a run() still
//     in flight when the caller acted: some runs are `run()` calls with actions taken before they
//     return.
import type { OrtexModule } from '../helpers/backends'
import { Prng } from './prng'

type Engine = ReturnType<OrtexModule['Engine']['simulated']>
type Request = ReturnType<Engine['createRequest']>
type Turn = ReturnType<Request['beginTurn']>
type EventBuffer = ReturnType<Engine['createEventBuffer']>

const TOKEN = 1
const TURN_FINISHED = 2
const CAPACITY_BLOCKED = 4
const FAILED = 8
const RETRYABLE = 16

export interface SimRunOptions {
  /** This seed may drop handles and call global.gc() (needs --expose-gc). */
  gc: boolean
  /** Lines of trace kept for a failure message. */
  traceLines?: number
}

export interface SimSummary {
  seed: number
  runs: number
  turnsBegun: number
  turnsFinished: number
  events: number
  engineEvents: number
  cancelled: number
  dropped: number
  fatal: boolean
}

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

interface TurnModel {
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

interface RequestModel {
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

interface EngineShape {
  vocabSize: number
  eosTokenIds: number[]
  maxLength: number
  blockSize: number
  numBlocks: number
  batching: string
}

/** Builds the engine options of a seed. */
export function engineOptionsFor(rng: Prng): Record<string, unknown> {
  const maxLength = rng.pick([16, 32, 64, 128])
  const blockSize = rng.pick([1, 2, 4, 8, 16])
  const maxBatchSize = rng.int(1, 6)
  const perRow = Math.ceil(maxLength / blockSize)
  const options: Record<string, unknown> = { seed: rng.int(0, 2 ** 31 - 1), maxLength, blockSize, maxBatchSize }
  switch (rng.weighted({ tiny: 1, tight: 3, ample: 3, default: 2 })) {
    case 'tiny':
      options.numBlocks = rng.int(1, Math.max(1, perRow >> 1))
      break
    case 'tight':
      options.numBlocks = rng.int(perRow, perRow * 2)
      break
    case 'ample':
      options.numBlocks = rng.int(perRow * 2, perRow * maxBatchSize + 1)
      break
  }
  options.maxScheduledTokens = rng.pick([1, 2, 8, 32, 512])
  if (rng.chance(0.3)) options.prefillChunkSize = rng.int(1, 16)
  const wait = rng.pick([undefined, 0, 2, 8])
  if (wait !== undefined) options.maxPrefillWaitSteps = wait
  if (rng.chance(0.2)) options.batching = 'static'
  const vocabSize = rng.pick([8, 300, 32000])
  options.vocabSize = vocabSize
  if (rng.chance(0.5)) options.eosTokenId = rng.int(0, vocabSize - 1)
  options.eosProbability = rng.pick([0, 0, 0.05, 0.3])
  if (rng.chance(0.35)) {
    const faults: Record<string, unknown> = {
      retryableRate: rng.pick([0, 0.02, 0.1]),
      capacityRate: rng.pick([0, 0.02, 0.1]),
      seed: rng.int(0, 1e9),
    }
    if (rng.chance(0.3)) faults.retryableSteps = [rng.int(0, 20)]
    if (rng.chance(0.3)) faults.capacitySteps = [rng.int(0, 20)]
    options.faults = faults
  }
  if (rng.chance(0.05)) {
    const faults = (options.faults ??= { seed: rng.int(0, 1e9) }) as Record<string, unknown>
    if (rng.chance(0.5)) faults.fatalSteps = [rng.int(0, 150)]
    else faults.fatalRate = 0.005
  }
  if (rng.chance(0.1)) options.maxRequests = rng.int(1, 4)
  return options
}

export async function runSimSeed(mod: OrtexModule, backend: string, seed: number, runOptions: SimRunOptions): Promise<SimSummary> {
  const sim = new Simulation(mod, backend, seed, runOptions)
  try {
    return await sim.run()
  } catch (error) {
    if (error instanceof SimFailure) throw error
    throw new SimFailure(seed, backend, `unexpected error: ${(error as Error)?.stack ?? String(error)}`, sim.trace)
  } finally {
    await sim.dispose()
  }
}

class Simulation {
  readonly trace: string[] = []
  private readonly rng: Prng
  private readonly options: Record<string, unknown>
  private engine!: Engine
  private shape!: EngineShape
  private buffers: EventBuffer[] = []
  private readonly models: RequestModel[] = []
  private readonly byRequest = new Map<Request, RequestModel>()
  private readonly byId = new Map<number, RequestModel>()
  private readonly summary: SimSummary
  private readonly traceLines: number
  private unhealthy = false
  /** A run() is in flight: its events are not routed yet, so the model is behind the core. */
  private inFlight = false
  /** Requests closed while a run() was in flight: that run may still carry their events. */
  private readonly closedInFlight = new Set<number>()
  private readonly turnModels: TurnModel[] = []

  constructor(
    private readonly mod: OrtexModule,
    private readonly backend: string,
    private readonly seed: number,
    private readonly runOptions: SimRunOptions,
  ) {
    this.rng = new Prng(seed)
    this.options = engineOptionsFor(this.rng)
    this.traceLines = runOptions.traceLines ?? 60
    this.summary = { seed, runs: 0, turnsBegun: 0, turnsFinished: 0, events: 0, engineEvents: 0, cancelled: 0, dropped: 0, fatal: false }
  }

  async dispose(): Promise<void> {
    try {
      await this.engine?.close()
    } catch {
      // The failure being reported matters more.
    }
    const gc = (globalThis as any).gc
    if (this.runOptions.gc && this.engine && typeof gc === 'function') {
      // Let queued FinalizationRegistry callbacks run while the engine is still referenced: in
      // Node 20 a FinalizationRegistry collected with a cleanup still queued stops every later
      // one in the process (contract/entry-points.test.ts, "collecting an engine with a queued reclamation").
      for (let i = 0; i < 3; i++) {
        gc()
        await new Promise((resolve) => setTimeout(resolve, 1))
      }
    }
  }

  // ------------------------------------------------------------------------------------------
  // The workload
  // ------------------------------------------------------------------------------------------

  async run(): Promise<SimSummary> {
    this.log(`options ${JSON.stringify(this.options)}`)
    this.engine = this.mod.Engine.simulated(this.options as any)
    const config = this.engine.config
    this.shape = {
      vocabSize: config.vocabSize,
      eosTokenIds: [...config.eosTokenIds],
      maxLength: config.maxLength,
      blockSize: config.blockSize,
      numBlocks: config.numBlocks,
      batching: config.batching,
    }
    this.buffers = [1, 2, 3, 5, 16, 256].map((capacity) => this.engine.createEventBuffer(capacity))
    const iterations = this.rng.int(20, 120)
    for (let i = 0; i < iterations && !this.unhealthy; i++) {
      const actions = this.rng.int(0, 2)
      for (let a = 0; a < actions; a++) await this.act()
      if (this.rng.chance(0.25)) await this.runInFlight()
      else this.runOnce()
    }
    if (!this.unhealthy) this.drainAll()
    if (this.unhealthy) await this.checkUnhealthy()
    else await this.finish()
    return this.summary
  }

  private async act(): Promise<void> {
    if (this.actNow() === 'gc') {
      ;(globalThis as any).gc()
      await new Promise((resolve) => setImmediate(resolve))
      this.log('gc')
    }
  }

  /** One random action, synchronously; 'gc' asks the caller to collect (not while in flight). */
  private actNow(): 'gc' | void {
    const open = this.openModels()
    const idle = open.filter((m) => !m.current || m.current.finished)
    const running = open.filter((m) => m.current && !m.current.finished)
    // While a run() is in flight only synchronous calls are made (no collection, no drops).
    const sync = this.inFlight ? 0 : 1
    const weights = {
      create: open.length < 8 ? 2 : 0,
      begin: idle.length ? 4 : 0,
      beginBusy: running.length ? 0.3 : 0,
      prefill: open.length ? 0.8 : 0,
      cancel: running.length ? 1.2 : 0,
      staleCancel: open.length ? 0.3 : 0,
      close: open.length ? 0.8 : 0,
      closedCall: this.models.some((m) => m.closed && m.request) ? 0.2 * sync : 0,
      drop: this.runOptions.gc && open.length ? 0.3 * sync : 0,
      gc: this.runOptions.gc ? 0.15 * sync : 0,
    }
    if (Object.values(weights).every((w) => w === 0)) return
    switch (this.rng.weighted(weights)) {
      case 'create':
        return this.create()
      case 'begin':
        return this.begin(this.rng.pick(idle))
      case 'beginBusy':
        return this.begin(this.rng.pick(running))
      case 'prefill':
        return this.prefill(this.rng.pick(open))
      case 'cancel':
        return this.cancel(this.rng.pick(running))
      case 'staleCancel':
        return this.staleCancel(this.rng.pick(open))
      case 'close':
        return this.close(this.rng.pick(open))
      case 'closedCall':
        return this.closedCall(this.rng.pick(this.models.filter((m) => m.closed && m.request)))
      case 'drop':
        return this.drop(this.rng.pick(open))
      case 'gc':
        return 'gc'
    }
  }

  private create(): void {
    const maxSessionTokens = this.rng.chance(0.3) ? this.rng.int(2, this.shape.maxLength) : undefined
    const maxRequests = this.options.maxRequests as number | undefined
    const before = this.engine.stats()
    const open = this.openModels().length
    // The core counts every request it still holds: open ones, dropped ones not yet reclaimed,
    // and (static batching) closed ones whose batch row is still taken.
    const closedPinned = this.shape.batching === 'static' ? this.models.filter((m) => m.closed).length : 0
    let request: Request
    try {
      request = this.engine.createRequest(maxSessionTokens === undefined ? undefined : { maxSessionTokens })
    } catch (error) {
      // A request closed while a run() is in flight keeps its slot until that run's step returns.
      const pinnedInFlight = this.inFlight ? this.closedInFlight.size : 0
      const mayBeFull = maxRequests !== undefined && before.activeRequests + closedPinned + pinnedInFlight >= maxRequests
      this.expectError(error, 'CAPACITY_EXHAUSTED', `createRequest with ${open} open (maxRequests ${maxRequests})`, mayBeFull)
      this.log(`create -> CAPACITY_EXHAUSTED`)
      return
    }
    if (maxRequests !== undefined && open >= maxRequests) {
      this.fail(`createRequest succeeded with ${open} requests open and maxRequests ${maxRequests}`)
    }
    const model: RequestModel = {
      id: request.id,
      request,
      maxSessionTokens: maxSessionTokens || this.shape.maxLength,
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
    this.check(!this.byId.has(request.id), `request id ${request.id} reused`)
    this.check(request.state === 'created', `a new request is ${request.state}`)
    this.check(request.tokenCount === 0, `a new request holds ${request.tokenCount} tokens`)
    this.models.push(model)
    this.byRequest.set(request, model)
    this.byId.set(request.id, model)
    this.log(`create r${request.id} maxSessionTokens=${maxSessionTokens ?? '-'}`)
  }

  private input(room: number): { input: string | number[]; length: number } {
    const oversize = this.rng.chance(0.08)
    const length = oversize ? Math.max(room, 1) + this.rng.int(0, 2) : this.rng.int(1, Math.max(1, Math.min(room - 1, 40)))
    if (this.shape.vocabSize >= 259 && this.rng.chance(0.2)) {
      let text = ''
      for (let i = 0; i < length; i++) text += String.fromCharCode(this.rng.int(32, 126))
      return { input: text, length }
    }
    return { input: this.rng.tokens(length, 0, this.shape.vocabSize - 1), length }
  }

  private turnOptions(): Record<string, unknown> {
    const rng = this.rng
    const options: Record<string, unknown> = {}
    switch (rng.weighted({ none: 1, small: 4, mid: 2 })) {
      case 'small':
        options.maxGeneratedTokens = rng.int(1, 4)
        break
      case 'mid':
        options.maxGeneratedTokens = rng.int(5, 40)
        break
    }
    if (rng.chance(0.5)) {
      options.temperature = rng.pick([0.3, 0.7, 1, 1.5])
      const topK = rng.pick([undefined, 0, 1, 2, 5])
      if (topK !== undefined) options.topK = topK
      const topP = rng.pick([undefined, 0.3, 0.8, 1])
      if (topP !== undefined) options.topP = topP
      if (rng.chance(0.5)) options.seed = rng.int(0, 1e6)
    }
    if (rng.chance(0.15)) options.ignoreEos = true
    if (rng.chance(0.25)) {
      const count = rng.int(1, 2)
      options.stopTokenIds = Array.from({ length: count }, () => rng.tokens(rng.int(1, 2), 0, Math.min(this.shape.vocabSize, 12) - 1))
    }
    return options
  }

  private begin(model: RequestModel): void {
    const request = model.request!
    const coreCount = request.tokenCount
    const { input, length } = this.input(model.maxSessionTokens - coreCount)
    const options = this.turnOptions()
    const retained = this.engine.stats().retainedEvents
    const running = model.current !== null && !model.current.finished
    let turn: Turn
    try {
      turn = request.beginTurn(input, options as any)
    } catch (error) {
      const code = (error as any)?.code
      if (running) {
        const pendingAllowed = retained > 0 || this.inFlight
        this.expectError(error, code === 'EVENTS_PENDING' ? 'EVENTS_PENDING' : 'TURN_ACTIVE', `beginTurn on r${model.id} with a running turn`, code !== 'EVENTS_PENDING' || pendingAllowed)
      } else if (code === 'EVENTS_PENDING') {
        this.expectError(error, 'EVENTS_PENDING', `beginTurn on idle r${model.id}`, retained > 0)
      } else {
        this.expectError(error, 'INVALID_ARGUMENT', `beginTurn of ${length} tokens on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`, coreCount + length >= model.maxSessionTokens)
      }
      this.log(`begin r${model.id} len=${length} -> ${code}`)
      return
    }
    if (running) this.fail(`beginTurn on r${model.id} succeeded while turn ${model.current!.id} had not finished`)
    if (coreCount + length >= model.maxSessionTokens) this.fail(`beginTurn of ${length} tokens accepted on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`)
    this.check(coreCount === model.tokenCount, `r${model.id} holds ${coreCount} tokens, the model expects ${model.tokenCount}`)
    this.check(turn.id === model.lastTurnId + 1, `r${model.id} turn id ${turn.id} after ${model.lastTurnId}`)
    this.check(turn.request === request, `turn.request is not its request`)
    this.check(request.tokenCount === coreCount + length, `tokenCount ${request.tokenCount} after a ${length}-token input on ${coreCount}`)
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
    this.turnModels.push(turnModel)
    model.current = turnModel
    this.log(`begin r${model.id} t${turn.id} len=${length} ${JSON.stringify(options)}`)
  }

  private prefill(model: RequestModel): void {
    const request = model.request!
    const coreCount = request.tokenCount
    const { input, length } = this.input(model.maxSessionTokens - coreCount)
    const running = model.current !== null && !model.current.finished
    const retained = this.engine.stats().retainedEvents
    try {
      request.prefill(input)
    } catch (error) {
      if ((error as any)?.code === 'TURN_ACTIVE') this.expectError(error, 'TURN_ACTIVE', `prefill on r${model.id}`, running)
      else this.expectError(error, 'INVALID_ARGUMENT', `prefill of ${length} on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`, coreCount + length >= model.maxSessionTokens)
      this.log(`prefill r${model.id} len=${length} -> ${(error as any)?.code}`)
      return
    }
    if (coreCount + length >= model.maxSessionTokens) this.fail(`prefill of ${length} accepted on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`)
    if (running) {
      // Legal only when the core already finished the turn and holds back its finish event (or
      // handed it to the run in flight).
      this.check(retained > 0 || this.inFlight, `prefill accepted on r${model.id} while its turn ${model.current!.id} runs and nothing is retained`)
      model.deferredPrefill += length
    } else {
      this.check(coreCount === model.tokenCount, `r${model.id} holds ${coreCount} tokens, the model expects ${model.tokenCount}`)
      model.tokenCount += length
    }
    model.prefillCalls++
    this.log(`prefill r${model.id} len=${length}`)
  }

  private cancel(model: RequestModel): void {
    const turn = model.current!
    const retained = this.engine.stats().retainedEvents
    const viaTurn = turn.turn !== null && this.rng.chance(0.5)
    const result = viaTurn ? turn.turn!.cancel() : model.request!.cancelTurn(turn.id)
    this.log(`cancel r${model.id} t${turn.id} via ${viaTurn ? 'turn' : 'request'} -> ${result}`)
    if (result) {
      this.check(!turn.cancelRequested, `cancel of r${model.id} t${turn.id} returned true twice`)
      turn.cancelRequested = true
      this.summary.cancelled++
    } else if (!turn.cancelRequested) {
      this.check(retained > 0 || this.inFlight, `cancel of running r${model.id} t${turn.id} returned false with nothing retained`)
    }
  }

  private staleCancel(model: RequestModel): void {
    const id = this.rng.chance(0.5) && model.lastTurnId > 1 ? this.rng.int(1, model.lastTurnId - 1) : model.lastTurnId + this.rng.int(1, 3)
    const result = model.request!.cancelTurn(id)
    this.log(`stale cancel r${model.id} t${id} -> ${result}`)
    this.check(result === false, `cancelTurn(${id}) on r${model.id} (last turn ${model.lastTurnId}) returned true`)
  }

  private close(model: RequestModel): void {
    model.request!.close()
    if (this.rng.chance(0.2)) model.request!.close()
    model.closed = true
    if (model.current && !model.current.finished) model.current.closedEarly = true
    if (this.inFlight) this.closedInFlight.add(model.id)
    this.check(model.request!.state === 'closed', `r${model.id} is ${model.request!.state} after close()`)
    this.log(`close r${model.id}`)
  }

  private closedCall(model: RequestModel): void {
    const request = model.request!
    try {
      if (this.rng.chance(0.5)) request.beginTurn([0])
      else request.prefill([0])
    } catch (error) {
      this.expectError(error, 'REQUEST_CLOSED', `a call on closed r${model.id}`, true)
      return
    }
    this.fail(`a call on closed r${model.id} succeeded`)
  }

  private drop(model: RequestModel): void {
    this.byRequest.delete(model.request!)
    model.request = null
    // Every Turn of the request goes too (a Turn holds its Request).
    for (const turn of this.turnModels) if (turn.requestId === model.id) turn.turn = null
    model.dropped = true
    this.summary.dropped++
    this.log(`drop r${model.id}`)
  }

  // ------------------------------------------------------------------------------------------
  // Runs and events
  // ------------------------------------------------------------------------------------------

  private runOnce(): void {
    const buffer = this.rng.pick(this.buffers)
    const before = this.engine.stats()
    const droppedAlive = before.activeRequests - this.openModels().length
    let count: number
    try {
      count = this.engine.runSync(buffer)
    } catch (error) {
      this.fail(`runSync threw ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.summary.runs++
    this.check(count === buffer.count, `runSync returned ${count} but buffer.count is ${buffer.count}`)
    this.check(count >= 0 && count <= buffer.capacity, `runSync wrote ${count} events into a buffer of ${buffer.capacity}`)
    const after = this.engine.stats()
    const events = []
    for (let i = 0; i < count; i++) events.push(buffer.at(i))
    this.log(`run cap=${buffer.capacity} -> ${count} (steps ${before.steps}->${after.steps}, retained ${before.retainedEvents}->${after.retainedEvents})`)

    if (droppedAlive === 0 && before.retainedEvents > 0) {
      this.check(after.steps === before.steps, `a run with ${before.retainedEvents} retained events executed a step`)
      this.check(count === Math.min(buffer.capacity, before.retainedEvents), `drained ${count} of ${before.retainedEvents} retained events into ${buffer.capacity}`)
    }
    if (after.steps > before.steps) {
      this.check(after.steps === before.steps + 1, `one run executed ${after.steps - before.steps} steps`)
      const ids = events.filter((e) => e.request !== null).map((e) => e.request!.id)
      this.check(new Set(ids).size === ids.length, `one transaction wrote two events for one request: ${ids}`)
    }
    for (const event of events) this.onEvent(event)
    this.checkInvariants()
    if (!this.unhealthy) this.checkCounters(after)
  }

  /**
   * A run() with actions taken before it returns (issue 15's lost turn: a finish handed out by
   * the core at the start of a run is routed only when it returns). The native addon plans now
   * and executes off the thread; WebAssembly executes and commits now and routes later.
   */
  private async runInFlight(): Promise<void> {
    const buffer = this.rng.pick(this.buffers)
    this.inFlight = true
    let pending: Promise<number>
    try {
      pending = this.engine.run(buffer)
    } catch (error) {
      this.fail(`run threw ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.log(`run() cap=${buffer.capacity} started`)
    // Synchronously, as a caller does right after `const p = engine.run(buffer)`: nothing routes
    // the run's events before it is awaited.
    const actions = this.rng.int(0, 3)
    for (let a = 0; a < actions; a++) this.actNow()
    let count: number
    try {
      count = await pending
    } catch (error) {
      this.fail(`run rejected ${(error as any)?.code ?? ''} ${String(error)}`)
    }
    this.inFlight = false
    this.summary.runs++
    this.check(count === buffer.count && count <= buffer.capacity, `run() resolved ${count}, buffer.count ${buffer.count} of ${buffer.capacity}`)
    this.log(`run() cap=${buffer.capacity} -> ${count}`)
    const events = []
    for (let i = 0; i < count; i++) events.push(buffer.at(i))
    for (const event of events) this.onEvent(event)
    this.closedInFlight.clear()
    this.checkInvariants()
    if (!this.unhealthy) this.checkCounters(this.engine.stats())
  }

  private onEvent(event: any): void {
    this.summary.events++
    const usage = event.usage ? `${event.usage.promptTokens}/${event.usage.generatedTokens}/${event.usage.cachedPromptTokens}` : '-'
    this.log(`  ev r${event.request?.id ?? 0} t${event.turnId} f${event.flags} tok=${event.token} ${event.finishReason} ${event.errorCode} u=${usage}`)
    if (event.request === null) return this.onEngineEvent(event)
    const model = this.byRequest.get(event.request) ?? this.byId.get(event.request.id)
    if (!model) this.fail(`event for unknown request ${event.request.id}`)
    if (model.closed && this.closedInFlight.has(model.id)) return // written before the close
    if (model.closed) this.fail(`event for closed request r${model.id}`)
    if (model.dropped) return // a dropped request may still emit until it is reclaimed
    this.check(event.request === model.request, `event.request is not the Request object of r${model.id}`)
    const flags = event.flags as number

    if (flags === CAPACITY_BLOCKED) {
      this.check(event.errorCode === 'capacity-deferred', `CapacityBlocked event with ${event.errorCode}`)
      const turnId = model.current && !model.current.finished ? model.current.id : 0
      this.check(event.turnId === turnId || (event.turnId === 0 && model.prefillCalls > 0), `CapacityBlocked for turn ${event.turnId}, expected ${turnId}`)
      return
    }
    if (flags === FAILED) {
      // A prefill without a turn that can never fit the pool.
      this.check(event.turnId === 0 && event.errorCode === 'request-unserviceable', `a bare Failed event: turn ${event.turnId}, ${event.errorCode}`)
      model.prefillFailures++
      this.check(model.prefillFailures <= model.prefillCalls, `prefill failure ${model.prefillFailures} of r${model.id} after ${model.prefillCalls} prefill(s)`)
      this.checkUnserviceable(model)
      return
    }
    this.check((flags & ~(TOKEN | TURN_FINISHED | FAILED)) === 0 && (flags & (TOKEN | TURN_FINISHED)) !== 0, `unexpected flags ${flags}`)
    const turn = model.current
    if (!turn || turn.finished) this.fail(`event for r${model.id} turn ${event.turnId} with no running turn`)
    this.check(event.turnId === turn.id, `event for turn ${event.turnId}, r${model.id} runs turn ${turn.id}`)

    if (flags & TOKEN) {
      const token = event.token as number
      this.check(Number.isInteger(token) && token >= 0 && token < this.shape.vocabSize, `token ${token} outside the vocabulary`)
      turn.generated.push(token)
      model.tokenCount++
      this.check(model.tokenCount <= model.maxSessionTokens, `r${model.id} holds ${model.tokenCount} tokens, over its limit ${model.maxSessionTokens}`)
      if (turn.maxGeneratedTokens > 0) {
        this.check(turn.generated.length <= turn.maxGeneratedTokens, `turn generated ${turn.generated.length} of at most ${turn.maxGeneratedTokens}`)
      }
    }
    const natural = flags & TOKEN ? this.naturalReason(model, turn, event.token) : null
    if (!(flags & TURN_FINISHED)) {
      this.check(event.finishReason === 'none' && event.errorCode === 'none' && event.usage === null, `a token event carries finish data`)
      if (natural) this.fail(`r${model.id} t${turn.id} reached ${natural} but did not finish`)
      return
    }

    // The turn's one finish event.
    turn.finished = true
    this.summary.turnsFinished++
    const reason = event.finishReason as string
    turn.eventReason = reason
    this.check(event.usage !== null, `a finish event without usage`)
    this.check(
      event.usage.promptTokens === turn.promptLength && event.usage.generatedTokens === turn.generated.length && event.usage.cachedPromptTokens === 0,
      `usage ${usage}, expected ${turn.promptLength}/${turn.generated.length}/0`,
    )
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

  /** Why the turn must end after its latest token, in the core's order, or null. */
  private naturalReason(model: RequestModel, turn: TurnModel, token: number): string | null {
    if (!turn.ignoreEos && this.shape.eosTokenIds.includes(token)) return 'eos'
    const generated = turn.generated
    for (const stop of turn.stopTokenIds) {
      if (stop.length <= generated.length && stop.every((t, i) => generated[generated.length - stop.length + i] === t)) return 'stop'
    }
    if (turn.maxGeneratedTokens > 0 && generated.length >= turn.maxGeneratedTokens) return 'max-generated-tokens'
    if (model.tokenCount >= model.maxSessionTokens) return 'max-session-tokens'
    return null
  }

  private checkUnserviceable(model: RequestModel): void {
    const blocks = Math.ceil(model.tokenCount / this.shape.blockSize)
    this.check(blocks > this.shape.numBlocks, `r${model.id} failed unserviceable holding ${model.tokenCount} tokens (${blocks} blocks of ${this.shape.numBlocks})`)
  }

  private onEngineEvent(event: any): void {
    this.summary.engineEvents++
    const faults = (this.options.faults ?? {}) as Record<string, any>
    this.check(event.turnId === 0 && event.usage === null && event.finishReason === 'none', `engine-level event with turn/usage/finish data`)
    if (event.flags === RETRYABLE) {
      this.check(event.errorCode === 'retryable-execution', `Retryable event with ${event.errorCode}`)
      this.check(faults.retryableRate > 0 || faults.retryableSteps?.length > 0, `a retryable fault without injected faults`)
    } else if (event.flags === CAPACITY_BLOCKED) {
      this.check(event.errorCode === 'execution-capacity-exceeded', `engine CapacityBlocked with ${event.errorCode}`)
      this.check(faults.capacityRate > 0 || faults.capacitySteps?.length > 0, `a capacity fault without injected faults`)
    } else if (event.flags === FAILED) {
      this.check(event.errorCode === 'engine-execution-failure', `engine Failed with ${event.errorCode}`)
      this.check(faults.fatalRate > 0 || faults.fatalSteps?.length > 0, `a fatal failure without injected faults`)
      this.unhealthy = true
      this.summary.fatal = true
    } else {
      this.fail(`engine-level event with flags ${event.flags}`)
    }
  }

  private checkCounters(stats: ReturnType<Engine['stats']>): void {
    const open = this.openModels()
    this.check(stats.freeBlocks >= 0 && stats.freeBlocks <= stats.totalBlocks, `freeBlocks ${stats.freeBlocks} of ${stats.totalBlocks}`)
    if (stats.retainedEvents !== 0 || stats.activeRequests !== open.length) return
    const running = open.filter((m) => m.current && !m.current.finished)
    this.check(stats.pendingTurns === running.length, `pendingTurns ${stats.pendingTurns}, the model runs ${running.length}`)
    for (const model of open) {
      const request = model.request!
      this.check(request.tokenCount === model.tokenCount, `r${model.id} holds ${request.tokenCount} tokens, the model expects ${model.tokenCount}`)
      const turn = model.current
      const expected = !turn ? 'created' : turn.finished ? 'turn-complete' : turn.generated.length === 0 ? 'queued' : 'active'
      this.check(request.state === expected, `r${model.id} is ${request.state}, the model expects ${expected}`)
    }
  }

  private checkInvariants(): void {
    try {
      ;(this.engine as any).checkInvariants()
    } catch (error) {
      this.fail(`checkInvariants: ${String((error as Error)?.message ?? error)}`)
    }
  }

  // ------------------------------------------------------------------------------------------
  // Endings
  // ------------------------------------------------------------------------------------------

  private drainAll(): void {
    let runs = 0
    let idleRuns = 0
    while (!this.unhealthy && this.engine.hasPendingWork()) {
      if (++runs > 50_000) this.fail('no progress: still pending work after 50000 runs')
      const steps = this.engine.stats().steps
      const events = this.summary.events
      this.runOnce()
      idleRuns = this.engine.stats().steps === steps && this.summary.events === events ? idleRuns + 1 : 0
      if (idleRuns >= 100) this.fail(`stalled: hasPendingWork() stays true but ${idleRuns} runs in a row executed nothing and wrote no event`)
    }
    if (this.unhealthy) return
    for (const model of this.openModels()) {
      if (model.current && !model.current.finished) this.fail(`r${model.id} t${model.current.id} never finished`)
    }
    this.check(this.engine.stats().retainedEvents === 0, `events retained with no pending work`)
  }

  /** Every turn whose Turn the driver still holds settled `done` exactly once, as it ended. */
  private async checkDones(): Promise<void> {
    await new Promise((resolve) => setImmediate(resolve))
    for (const turn of this.turnModels) {
      if (turn.turn === null) continue // dropped: its done is the collector's business
      const what = `turn ${turn.id} (finish event ${turn.eventReason ?? 'none'}${turn.closedEarly ? ', closed first' : ''})`
      this.check(turn.doneSettled === 1, `${what}: done settled ${turn.doneSettled} times`)
      if (turn.eventReason !== null) this.check(turn.doneReason === turn.eventReason, `${what}: done says ${turn.doneReason}`)
      else if (this.unhealthy) this.check(turn.doneReason === 'failed' || turn.doneReason === 'cancelled', `${what}: done says ${turn.doneReason}`)
      else this.check(turn.doneReason === 'cancelled', `${what}: done says ${turn.doneReason}`)
    }
  }

  private async finish(): Promise<void> {
    for (const model of this.openModels()) this.close(model)
    const gc = (globalThis as any).gc
    if (this.engine.stats().activeRequests > 0) {
      if (!this.runOptions.gc || typeof gc !== 'function') this.fail(`${this.engine.stats().activeRequests} requests alive after closing all`)
      for (let i = 0; i < 40 && this.engine.stats().activeRequests > 0; i++) {
        gc()
        await new Promise((resolve) => setTimeout(resolve, 1))
        this.engine.hasPendingWork()
      }
      this.check(this.engine.stats().activeRequests === 0, `dropped requests were not reclaimed after GC`)
    }
    if (this.shape.batching === 'static') {
      // Closed rows of the last static batch are released when the batch is recycled.
      this.check(this.engine.runSync(this.buffers[5]) === 0, `a run after closing everything wrote events`)
    }
    const stats = this.engine.stats()
    this.check(stats.freeBlocks === stats.totalBlocks, `${stats.totalBlocks - stats.freeBlocks} blocks still held once everything is closed`)
    this.check(stats.pendingTurns === 0 && stats.retainedEvents === 0, `pending turns or events after closing everything`)
    this.check(!this.engine.hasPendingWork(), `pending work after closing everything`)
    this.checkInvariants()
    await this.engine.close()
    await this.engine.close()
    for (const model of this.models) model.request?.close()
    try {
      this.engine.createRequest()
      this.fail('createRequest worked on a closed engine')
    } catch (error) {
      this.expectError(error, 'ENGINE_CLOSED', 'createRequest on a closed engine', true)
    }
    await this.checkDones()
  }

  private async checkUnhealthy(): Promise<void> {
    const buffer = this.buffers[5]
    try {
      this.engine.runSync(buffer)
      this.fail('runSync worked on an unhealthy engine')
    } catch (error) {
      this.expectError(error, 'ENGINE_UNHEALTHY', 'runSync after a fatal failure', true)
    }
    try {
      this.engine.createRequest()
      this.fail('createRequest worked on an unhealthy engine')
    } catch (error) {
      this.expectError(error, 'ENGINE_UNHEALTHY', 'createRequest after a fatal failure', true)
    }
    this.checkInvariants()
    for (const model of this.openModels()) model.request!.close()
    await this.engine.close()
    await this.checkDones()
  }

  // ------------------------------------------------------------------------------------------
  // Plumbing
  // ------------------------------------------------------------------------------------------

  private fatalFaultsInjected(): boolean {
    const faults = (this.options.faults ?? {}) as Record<string, any>
    return faults.fatalRate > 0 || faults.fatalSteps?.length > 0
  }

  private openModels(): RequestModel[] {
    return this.models.filter((m) => !m.closed && !m.dropped)
  }

  private expectError(error: unknown, code: string, what: string, allowed: boolean): void {
    if (!(error instanceof this.mod.OrtexError)) this.fail(`${what} threw a non-OrtexError: ${(error as Error)?.stack ?? String(error)}`)
    // The step in flight may have failed fatally already (WebAssembly commits it before run()
    // returns); its Failed event is routed when the run is awaited.
    if (this.inFlight && (error as any).code === 'ENGINE_UNHEALTHY' && this.fatalFaultsInjected()) return
    if ((error as any).code !== code) this.fail(`${what} threw ${(error as any).code} (${(error as Error).message}), expected ${code}`)
    if (!allowed) this.fail(`${what} threw ${code} (${(error as Error).message}) where the model expects success`)
  }

  private check(condition: boolean, message: string): asserts condition {
    if (!condition) this.fail(message)
  }

  private fail(message: string): never {
    const tail = this.trace.slice(-this.traceLines)
    const skipped = this.logged - this.head.length - tail.length
    const lines = [...this.head, ...(skipped > 0 ? [`... ${skipped} lines ...`] : []), ...tail]
    throw new SimFailure(this.seed, this.backend, message, lines)
  }

  /** The first lines (configuration, first actions) and a window of the latest ones. */
  private readonly head: string[] = []
  private logged = 0

  private log(line: string): void {
    this.logged++
    if (this.head.length < Math.min(40, this.traceLines)) {
      this.head.push(line)
      return
    }
    this.trace.push(line)
    if (this.trace.length > 4 * this.traceLines) this.trace.splice(0, this.trace.length - this.traceLines)
  }
}
