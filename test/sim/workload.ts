// The simulation's workload: a seed's engine options (KV pressure, chunked prefill, static or
// dynamic batching, injected faults scheduled within its faults phase) and the random caller
// actions between runs. Each action
// calls the facade, checks what the call returned against the model, and updates the model.
import type { Checker, Trace } from './checker'
import { runningTurn, type Engine, type Request, type RequestModel, type SimModel, type Turn } from './model'
import type { Prng } from './prng'

/** A seed's workload: its engine options and how long its faults phase lasts. */
export interface Workload {
  options: Record<string, unknown>
  /** Rounds of random actions and runs in the faults phase. */
  iterations: number
  /** Every injected fault is at a step below this one: from here on, faults are off. */
  faultHorizonSteps: number
}

/**
 * The engine options of a seed, and the iterations of its faults phase. Faults are engine options
 * and cannot be turned off mid-run, so a seed schedules its faults by step number instead of at a
 * rate: a rate becomes the steps among the first 2 x iterations that fail at that rate (each
 * iteration runs at most one step; the runs that follow the iterations keep meeting faults up
 * to the horizon), and the liveness phase starts past the last scheduled fault.
 */
export function workloadFor(rng: Prng): Workload {
  const options = engineOptionsFor(rng)
  const iterations = rng.int(20, 120)
  const corner = rng.chance(0.15)
  if (corner) Object.assign(options, cornerOptions(rng))
  const faults = corner ? cornerFaults(rng, 2 * iterations) : faultsFor(rng, 2 * iterations)
  if (faults !== null) options.faults = faults
  if (!corner && rng.chance(0.1)) options.maxRequests = rng.int(1, 4)
  return { options, iterations, faultHorizonSteps: faultHorizon(faults) }
}

/**
 * The corners where few things move at once (issue 30's leak): one token a step, a request
 * count at its limit (the actions keep up to 8 open), prefills never waiting, and faults at
 * high rates, a fatal one included.
 */
function cornerOptions(rng: Prng): Record<string, unknown> {
  const options: Record<string, unknown> = { maxScheduledTokens: rng.pick([1, 1, 2]), maxRequests: rng.int(1, 3), maxPrefillWaitSteps: 0 }
  if (rng.chance(0.5)) options.prefillChunkSize = rng.int(1, 4)
  return options
}

/** Capacity faults on up to half the steps, retryable ones, and a fatal one for half the seeds. */
function cornerFaults(rng: Prng, windowSteps: number): Faults {
  const faults: Faults = {
    retryableSteps: stepsAtRate(rng, rng.pick([0, 0.1]), windowSteps),
    capacitySteps: stepsAtRate(rng, rng.pick([0.2, 0.4, 0.5]), windowSteps),
  }
  if (rng.chance(0.5)) faults.fatalSteps = [rng.int(0, windowSteps)]
  return faults
}

/** KV pressure, scheduling, sampling model: everything but the faults and maxRequests. */
function engineOptionsFor(rng: Prng): Record<string, unknown> {
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
  if (rng.chance(0.15)) options.prefixCaching = false
  const vocabSize = rng.pick([8, 300, 32000])
  options.vocabSize = vocabSize
  if (rng.chance(0.5)) options.eosTokenId = rng.int(0, vocabSize - 1)
  options.eosProbability = rng.pick([0, 0, 0.05, 0.3])
  return options
}

type Faults = Record<string, number | number[]>

/** Retryable and capacity faults for a third of the seeds, fatal ones for one in twenty. */
function faultsFor(rng: Prng, windowSteps: number): Faults | null {
  let faults: Faults | null = null
  if (rng.chance(0.35)) {
    const retryableRate = rng.pick([0, 0.02, 0.1])
    const capacityRate = rng.pick([0, 0.02, 0.1])
    const retryableSteps = stepsAtRate(rng, retryableRate, windowSteps)
    const capacitySteps = stepsAtRate(rng, capacityRate, windowSteps)
    if (rng.chance(0.3)) retryableSteps.push(rng.int(0, 20))
    if (rng.chance(0.3)) capacitySteps.push(rng.int(0, 20))
    faults = { retryableSteps, capacitySteps }
  }
  if (rng.chance(0.05)) {
    faults ??= {}
    faults.fatalSteps = rng.chance(0.5) ? [rng.int(0, 150)] : stepsAtRate(rng, 0.005, windowSteps)
  }
  return faults
}

/** The steps below `windowSteps` that fail, each with chance `rate`. */
function stepsAtRate(rng: Prng, rate: number, windowSteps: number): number[] {
  const steps: number[] = []
  if (rate === 0) return steps
  for (let step = 0; step < windowSteps; step++) if (rng.chance(rate)) steps.push(step)
  return steps
}

/** The first step past every scheduled fault (0 without faults). */
function faultHorizon(faults: Faults | null): number {
  const steps = Object.values(faults ?? {}).flatMap((v) => (Array.isArray(v) ? v : []))
  return steps.length === 0 ? 0 : Math.max(...steps) + 1
}

export class Actions {
  private shared: number[] | undefined

  constructor(
    private readonly rng: Prng,
    private readonly engine: Engine,
    private readonly options: Record<string, unknown>,
    private readonly model: SimModel,
    private readonly checker: Checker,
    private readonly trace: Trace,
    /** The seed may drop handles and collect them (needs --expose-gc). */
    private readonly gc: boolean,
  ) {}

  /** One random action; a collection when it asks for one. */
  async act(): Promise<void> {
    if (this.actNow() === 'gc') {
      ;(globalThis as any).gc()
      await new Promise((resolve) => setImmediate(resolve))
      this.trace.log('gc')
    }
  }

  /** One random action, synchronously; 'gc' asks the caller to collect (not while in flight). */
  actNow(): 'gc' | void {
    const open = this.model.open()
    const idle = open.filter((m) => runningTurn(m) === null)
    const running = open.filter((m) => runningTurn(m) !== null)
    const closedHeld = this.model.requests.filter((m) => m.closed && m.request)
    // While a run() is in flight only synchronous calls are made (no collection, no drops).
    const sync = this.model.inFlight ? 0 : 1
    const weights = {
      create: open.length < 8 ? 2 : 0,
      begin: idle.length ? 4 : 0,
      beginBusy: running.length ? 0.3 : 0,
      prefill: open.length ? 0.8 : 0,
      cancel: running.length ? 1.2 : 0,
      staleCancel: open.length ? 0.3 : 0,
      close: open.length ? 0.8 : 0,
      closedCall: closedHeld.length > 0 ? 0.2 * sync : 0,
      drop: this.gc && open.length ? 0.3 * sync : 0,
      gc: this.gc ? 0.15 * sync : 0,
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
        return this.closedCall(this.rng.pick(closedHeld))
      case 'drop':
        return this.drop(this.rng.pick(open))
      case 'gc':
        return 'gc'
    }
  }

  /** Closes every open request (the end of a healthy run). */
  closeAll(): void {
    for (const model of this.model.open()) this.close(model)
  }

  private create(): void {
    const shape = this.model.shape
    const maxSessionTokens = this.rng.chance(0.3) ? this.rng.int(2, shape.maxLength) : undefined
    const maxRequests = this.options.maxRequests as number | undefined
    const before = this.engine.stats()
    const open = this.model.open().length
    // The core counts every request it still holds: open ones, dropped ones not yet reclaimed,
    // and (static batching) closed ones whose batch row is still taken.
    const closedPinned = shape.batching === 'static' ? this.model.requests.filter((m) => m.closed).length : 0
    let request: Request
    try {
      request = this.engine.createRequest(maxSessionTokens === undefined ? undefined : { maxSessionTokens })
    } catch (error) {
      // A request closed while a run() is in flight keeps its slot until that run's step returns.
      const pinnedInFlight = this.model.inFlight ? this.model.closedInFlight.size : 0
      const mayBeFull = maxRequests !== undefined && before.activeRequests + closedPinned + pinnedInFlight >= maxRequests
      this.checker.expectError(error, 'CAPACITY_EXHAUSTED', `createRequest with ${open} open (maxRequests ${maxRequests})`, mayBeFull)
      this.trace.log(`create -> CAPACITY_EXHAUSTED`)
      return
    }
    if (maxRequests !== undefined && open >= maxRequests) {
      this.checker.fail(`createRequest succeeded with ${open} requests open and maxRequests ${maxRequests}`)
    }
    this.checker.check(!this.model.hasId(request.id), `request id ${request.id} reused`)
    this.checker.check(request.state === 'created', `a new request is ${request.state}`)
    this.checker.check(request.tokenCount === 0, `a new request holds ${request.tokenCount} tokens`)
    this.model.addRequest(request, maxSessionTokens || shape.maxLength)
    this.trace.log(`create r${request.id} maxSessionTokens=${maxSessionTokens ?? '-'}`)
  }

  /** New input for a request with `room` tokens left: sometimes text, sometimes too long. */
  private input(room: number): { input: string | number[]; length: number } {
    const vocabSize = this.model.shape.vocabSize
    const oversize = this.rng.chance(0.08)
    const length = oversize ? Math.max(room, 1) + this.rng.int(0, 2) : this.rng.int(1, Math.max(1, Math.min(room - 1, 40)))
    if (vocabSize >= 259 && this.rng.chance(0.2)) {
      let text = ''
      for (let i = 0; i < length; i++) text += String.fromCharCode(this.rng.int(32, 126))
      return { input: text, length }
    }
    // Some inputs start with the seed's shared prefix, for the prefix cache to serve.
    const shared = this.rng.chance(0.4) ? this.sharedPrefix.slice(0, length - 1) : []
    return { input: [...shared, ...this.rng.tokens(length - shared.length, 0, vocabSize - 1)], length }
  }

  /** Tokens many inputs start with (drawn once per seed). */
  private get sharedPrefix(): number[] {
    this.shared ??= this.rng.tokens(this.rng.int(4, 48), 0, this.model.shape.vocabSize - 1)
    return this.shared
  }

  /** Limits, sampling and stop sequences of a turn. */
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
      options.stopTokenIds = Array.from({ length: count }, () => rng.tokens(rng.int(1, 2), 0, Math.min(this.model.shape.vocabSize, 12) - 1))
    }
    return options
  }

  /** beginTurn, on an idle request or (to be refused) on one whose turn still runs. */
  private begin(model: RequestModel): void {
    const request = model.request!
    const coreCount = request.tokenCount
    const { input, length } = this.input(model.maxSessionTokens - coreCount)
    const options = this.turnOptions()
    const retained = this.engine.stats().retainedEvents
    const running = runningTurn(model) !== null
    let turn: Turn
    try {
      turn = request.beginTurn(input, options as any)
    } catch (error) {
      this.expectBeginRefused(error, model, running, retained, coreCount, length)
      this.trace.log(`begin r${model.id} len=${length} -> ${(error as any)?.code}`)
      return
    }
    if (running) this.checker.fail(`beginTurn on r${model.id} succeeded while turn ${model.current!.id} had not finished`)
    if (coreCount + length >= model.maxSessionTokens) this.checker.fail(`beginTurn of ${length} tokens accepted on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`)
    this.checker.check(coreCount === model.tokenCount, `r${model.id} holds ${coreCount} tokens, the model expects ${model.tokenCount}`)
    this.checker.check(turn.id === model.lastTurnId + 1, `r${model.id} turn id ${turn.id} after ${model.lastTurnId}`)
    this.checker.check(turn.request === request, `turn.request is not its request`)
    this.checker.check(request.tokenCount === coreCount + length, `tokenCount ${request.tokenCount} after a ${length}-token input on ${coreCount}`)
    this.model.addTurn(model, turn, length, options)
    this.trace.log(`begin r${model.id} t${turn.id} len=${length} ${JSON.stringify(options)}`)
  }

  /** A refused beginTurn: TURN_ACTIVE or EVENTS_PENDING on a running turn, else a full request. */
  private expectBeginRefused(error: unknown, model: RequestModel, running: boolean, retained: number, coreCount: number, length: number): void {
    const code = (error as any)?.code
    if (running) {
      const pendingAllowed = retained > 0 || this.model.inFlight
      this.checker.expectError(error, code === 'EVENTS_PENDING' ? 'EVENTS_PENDING' : 'TURN_ACTIVE', `beginTurn on r${model.id} with a running turn`, code !== 'EVENTS_PENDING' || pendingAllowed)
    } else if (code === 'EVENTS_PENDING') {
      this.checker.expectError(error, 'EVENTS_PENDING', `beginTurn on idle r${model.id}`, retained > 0)
    } else {
      this.checker.expectError(error, 'INVALID_ARGUMENT', `beginTurn of ${length} tokens on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`, coreCount + length >= model.maxSessionTokens)
    }
  }

  private prefill(model: RequestModel): void {
    const request = model.request!
    const coreCount = request.tokenCount
    const { input, length } = this.input(model.maxSessionTokens - coreCount)
    const running = runningTurn(model) !== null
    const retained = this.engine.stats().retainedEvents
    try {
      request.prefill(input)
    } catch (error) {
      if ((error as any)?.code === 'TURN_ACTIVE') this.checker.expectError(error, 'TURN_ACTIVE', `prefill on r${model.id}`, running)
      else this.checker.expectError(error, 'INVALID_ARGUMENT', `prefill of ${length} on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`, coreCount + length >= model.maxSessionTokens)
      this.trace.log(`prefill r${model.id} len=${length} -> ${(error as any)?.code}`)
      return
    }
    if (coreCount + length >= model.maxSessionTokens) this.checker.fail(`prefill of ${length} accepted on r${model.id} holding ${coreCount}/${model.maxSessionTokens}`)
    if (running) {
      // Legal only when the core already finished the turn and holds back its finish event (or
      // handed it to the run in flight).
      this.checker.check(retained > 0 || this.model.inFlight, `prefill accepted on r${model.id} while its turn ${model.current!.id} runs and nothing is retained`)
      model.deferredPrefill += length
    } else {
      this.checker.check(coreCount === model.tokenCount, `r${model.id} holds ${coreCount} tokens, the model expects ${model.tokenCount}`)
      model.tokenCount += length
    }
    model.prefillCalls++
    this.trace.log(`prefill r${model.id} len=${length}`)
  }

  private cancel(model: RequestModel): void {
    const turn = model.current!
    const retained = this.engine.stats().retainedEvents
    const viaTurn = turn.turn !== null && this.rng.chance(0.5)
    const result = viaTurn ? turn.turn!.cancel() : model.request!.cancelTurn(turn.id)
    this.trace.log(`cancel r${model.id} t${turn.id} via ${viaTurn ? 'turn' : 'request'} -> ${result}`)
    if (result) {
      this.checker.check(!turn.cancelRequested, `cancel of r${model.id} t${turn.id} returned true twice`)
      turn.cancelRequested = true
      this.model.summary.cancelled++
    } else if (!turn.cancelRequested) {
      this.checker.check(retained > 0 || this.model.inFlight, `cancel of running r${model.id} t${turn.id} returned false with nothing retained`)
    }
  }

  /** cancelTurn with an id that is not the running turn's: always false. */
  private staleCancel(model: RequestModel): void {
    const id = this.rng.chance(0.5) && model.lastTurnId > 1 ? this.rng.int(1, model.lastTurnId - 1) : model.lastTurnId + this.rng.int(1, 3)
    const result = model.request!.cancelTurn(id)
    this.trace.log(`stale cancel r${model.id} t${id} -> ${result}`)
    this.checker.check(result === false, `cancelTurn(${id}) on r${model.id} (last turn ${model.lastTurnId}) returned true`)
  }

  private close(model: RequestModel): void {
    model.request!.close()
    if (this.rng.chance(0.2)) model.request!.close()
    this.model.markClosed(model)
    this.checker.check(model.request!.state === 'closed', `r${model.id} is ${model.request!.state} after close()`)
    this.trace.log(`close r${model.id}`)
  }

  /** beginTurn or prefill on a closed request: always REQUEST_CLOSED. */
  private closedCall(model: RequestModel): void {
    const request = model.request!
    try {
      if (this.rng.chance(0.5)) request.beginTurn([0])
      else request.prefill([0])
    } catch (error) {
      this.checker.expectError(error, 'REQUEST_CLOSED', `a call on closed r${model.id}`, true)
      return
    }
    this.checker.fail(`a call on closed r${model.id} succeeded`)
  }

  /** Lets go of every handle of the request, for the collector. */
  private drop(model: RequestModel): void {
    this.model.drop(model)
    this.trace.log(`drop r${model.id}`)
  }
}
