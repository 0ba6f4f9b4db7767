// Seeded simulation of many full-duplex sessions on one engine, with virtual time: random
// appends (some idempotent retries, some with stale fences), responses, barge-ins (some with
// truncation), detaches, resumes (some with the wrong generation), closes, expiries, engine
// runs with small event buffers and retryable faults, actions taken while a transaction is in
// flight (native: on the thread pool), and slow readers with small event buffers (so that
// responses feel backpressure). After every action: the engine's and the
// session manager's invariants. Throughout: no delta of a response follows the cancel that ended
// it, the fence moves only as the rules say, and every error is one the action may meet. At the
// end: every session ended exactly once, and every KV block is free again.
//
//   npx vitest run test/duplex/sim.test.ts                         seeds 1..150 on native and wasm
//   DUPLEX_SEEDS=2000 npx vitest run test/duplex/sim.test.ts       more seeds
//   DUPLEX_SEED=17 SIM_BACKEND=wasm npx vitest run test/duplex/sim.test.ts   replays one seed
import { describe, expect, it } from 'vitest'
import { type BackendName, ortex, selectedBackends } from '../helpers/backends'
import { macrotask } from '../helpers/util'
import { Prng } from '../sim/prng'
import { checkGrammar, type Engine, type Manager, type Mod, type Session } from './helpers'

const single = process.env.DUPLEX_SEED !== undefined ? Number(process.env.DUPLEX_SEED) : undefined
const count = Number(process.env.DUPLEX_SEEDS ?? 150)
if (single !== undefined && !Number.isInteger(single)) throw new Error(`DUPLEX_SEED must be an integer`)
const seeds = single !== undefined ? [single] : Array.from({ length: count }, (_, i) => i + 1)
const STEPS = Number(process.env.DUPLEX_STEPS ?? 250)

/** Errors an action may legitimately meet. */
const EXPECTED = new Set([
  'CAPACITY_EXHAUSTED',
  'SESSION_CLOSED',
  'FENCE_MISMATCH',
  'LEASE_GENERATION_MISMATCH',
  'OPERATION_REUSED',
  'TURN_ACTIVE',
  'EVENTS_PENDING',
  'INVALID_ARGUMENT',
])

class SimFailure extends Error {
  constructor(
    readonly seed: number,
    readonly reason: string,
    readonly trace: string[],
  ) {
    super(`seed ${seed}: ${reason}`)
  }
}

interface Tracked {
  session: Session
  events: any[]
  /** The read in progress (a reader that is slow on purpose, so that responses feel backpressure). */
  pending: Promise<void> | null
  finished: boolean
  iterator: AsyncIterator<any>
  /** Positions in the event stream at each advancing cancel, with the epoch it moved to. */
  cancelMarks: { at: number; epoch: number }[]
  lastFence: any
  operations: string[]
}

function replay(seed: number, backend: string): string {
  return `DUPLEX_SEED=${seed} SIM_BACKEND=${backend} npx vitest run test/duplex/sim.test.ts`
}

interface Summary {
  events: number
  deltas: number
  responses: number
  cancels: number
  expired: number
  closed: number
}

const WEIGHTS = {
  open: 4,
  append: 20,
  retry: 3,
  respond: 3,
  cancel: 5,
  detach: 3,
  resume: 3,
  close: 2,
  heartbeat: 2,
  tick: 6,
  expire: 4,
  run: 24,
  overlap: 6,
}
type Action = keyof typeof WEIGHTS
/** What an overlap may do while its run is in flight: any action but another run. */
const { run: _run, overlap: _overlap, ...NESTED } = WEIGHTS

const WORDS = ['hello', 'there', 'what', 'is', 'the', 'weather', 'like', 'today', 'tell', 'me', 'more']

async function runSeed(mod: Mod, seed: number): Promise<Summary> {
  const sim = new DuplexSim(mod, seed)
  for (let step = 0; step < STEPS; step++) await sim.step()
  await sim.windDown()
  const summary = sim.checkEnd()
  await sim.engine.close()
  return summary
}

/**
 * One seed's sessions: the workload (the engine and manager it configures, the random actions),
 * the tracking of every session's stream, and the checks. Every random draw happens in a fixed
 * order, so a seed replays the same way.
 */
class DuplexSim {
  readonly engine: Engine
  private readonly rng: Prng
  private readonly trace: string[] = []
  /** Virtual time in ms: the manager's `now`, moved only by 'tick'. */
  private clockMs = 0
  private readonly manager: Manager
  private readonly buffer: ReturnType<Engine['createEventBuffer']>
  /** How many events a reader takes per turn at most: 1 and 3 are slow readers. */
  private readonly readerPace: number
  private readonly all: Tracked[] = []
  private cancels = 0
  private expired = 0
  private opIds = 0

  constructor(
    private readonly mod: Mod,
    private readonly seed: number,
  ) {
    this.rng = new Prng(seed)
    this.engine = this.createEngine()
    this.manager = this.createManager()
    this.buffer = this.engine.createEventBuffer(this.rng.pick([1, 4, 64]))
    this.readerPace = this.rng.pick([1, 3, 1_000])
  }

  // ---- the workload ------------------------------------------------------------------------

  private createEngine(): Engine {
    const rng = this.rng
    return this.mod.Engine.simulated({
      seed: this.seed,
      maxLength: rng.pick([128, 256, 512]),
      blockSize: rng.pick([4, 16]),
      maxScheduledTokens: rng.pick([16, 64, 512]),
      eosProbability: rng.pick([0, 0.05]),
      faults: { retryableRate: rng.pick([0, 0.05]), seed: this.seed },
    })
  }

  private createManager(): Manager {
    const rng = this.rng
    return new this.mod.DuplexSessionManager(this.engine, {
      now: () => this.clockMs,
      eventBufferCapacity: rng.pick([2, 8, 1024]),
      maxSessions: rng.int(2, 6),
      idleTtlMs: rng.pick([null, 2_000, 10_000]),
      disconnectGraceMs: rng.int(100, 2_000),
      completedAppendLimit: rng.int(1, 8),
    })
  }

  /** One random action, the invariants after it, then a turn for every reader. */
  async step(): Promise<void> {
    const action = this.rng.weighted(WEIGHTS) as Action
    if (action === 'overlap') await this.overlap()
    else this.perform(action)
    try {
      this.engine.checkInvariants()
      this.manager.checkInvariants()
    } catch (error: any) {
      this.fail(`invariant broken after ${action}: ${error?.message ?? error}`)
    }
    await macrotask()
    for (const t of this.all) await this.read(t, this.rng.int(0, this.readerPace))
  }

  /**
   * An action while a transaction is away (native: on the thread pool): the facade starts the
   * run a few microtasks after run(), and its commit comes back as a later macrotask, so the
   * nested action always meets the step in flight.
   */
  private async overlap(): Promise<void> {
    const run = this.engine.run(this.buffer)
    for (let i = 0; i < 4; i++) await Promise.resolve()
    const nested = this.rng.weighted(NESTED) as Action
    this.trace.push(`overlap: a run in flight during ${nested}`)
    this.perform(nested)
    await run
  }

  /** One action, synchronously (an engine run included), on a random live session. */
  private perform(action: Action): void {
    const sessions = this.live()
    const target = sessions.length > 0 ? this.rng.pick(sessions) : null
    switch (action) {
      case 'open':
        return this.open()
      case 'tick':
        return this.tick()
      case 'expire':
        return this.expire()
      case 'run':
        return this.runEngine()
    }
    if (target === null) return
    switch (action) {
      case 'append':
      case 'retry':
        return this.append(target, action === 'retry')
      case 'respond':
        return this.respond(target)
      case 'cancel':
        return this.cancel(target)
      case 'detach':
        return this.attempt(`detach ${short(target)}`, () => target.session.detach())
      case 'resume':
        return this.resume(target)
      case 'close':
        return this.attempt(`close ${short(target)}`, () => void target.session.close('sim_close'))
      case 'heartbeat':
        return this.attempt(`heartbeat ${short(target)}`, () => target.session.heartbeat())
    }
  }

  private open(): void {
    this.attempt('open', () => {
      const session = this.manager.open({
        respond: this.rng.chance(0.7) ? 'on-final' : 'manual',
        turn: { maxGeneratedTokens: this.rng.int(1, 24) },
      })
      this.track(session)
    })
  }

  /** An append; a retry reuses one of the session's operation ids. Some carry a stale fence. */
  private append(target: Tracked, retry: boolean): void {
    const rng = this.rng
    const final = rng.chance(0.3)
    const opId = retry && target.operations.length > 0 ? rng.pick(target.operations) : rng.chance(0.3) ? `op${++this.opIds}` : undefined
    const fence = rng.chance(0.2) ? target.lastFence : rng.chance(0.1) ? { ...target.lastFence, epoch: Math.max(0, target.lastFence.epoch - 1) } : undefined
    const input = rng.chance(0.2) ? rng.tokens(rng.int(1, 6), 3, 400) : this.text()
    this.attempt(`append ${short(target)} final=${final} op=${opId ?? '-'}`, () => {
      target.session.append(input, { final, operationId: opId, fence })
      if (opId !== undefined && !target.operations.includes(opId)) target.operations.push(opId)
    })
    this.checkFence(target, 'append')
  }

  private text(): string {
    let out = ''
    for (let i = this.rng.int(1, 4); i > 0; i--) out += `${this.rng.pick(WORDS)} `
    return out
  }

  private respond(target: Tracked): void {
    this.attempt(`respond ${short(target)}`, () => void target.session.respond({ maxGeneratedTokens: this.rng.int(1, 12) }))
    this.checkFence(target, 'respond')
  }

  /** A barge-in (some with the fence last seen, some truncating what was said). */
  private cancel(target: Tracked): void {
    const old = this.rng.chance(0.2)
    this.attempt(`cancel ${short(target)}${old ? ' (old fence)' : ''}`, () => {
      const before = target.session.fence.epoch
      const fence = target.session.cancel(old ? target.lastFence : undefined)
      if (fence.epoch > before) {
        this.cancels++
        target.cancelMarks.push({ at: streamPosition(target), epoch: fence.epoch })
      }
      if (this.rng.chance(0.3)) target.session.truncate(this.rng.int(0, 8))
    })
    this.checkFence(target, 'cancel')
  }

  /** A resume, some with the wrong lease generation. */
  private resume(target: Tracked): void {
    this.attempt(`resume ${short(target)}`, () => {
      const generation = target.session.leaseGeneration + (this.rng.chance(0.2) ? 1 : 0)
      const next = target.session.resume(generation)
      if (next !== generation + 1) this.fail(`resume(${generation}) returned ${next}`)
    })
  }

  private tick(): void {
    this.clockMs += this.rng.int(1, 1_500)
    this.trace.push(`tick -> ${this.clockMs}`)
  }

  private expire(): void {
    this.attempt('collectExpired', () => {
      const ended = this.manager.collectExpired()
      this.expired += ended.length
      for (const expiry of ended) this.trace.push(`  expired ${expiry.sessionId.slice(0, 6)} ${expiry.reason}`)
    })
  }

  private runEngine(): void {
    for (let i = this.rng.int(1, 4); i > 0; i--) {
      if (!this.engine.hasPendingWork()) break
      this.engine.runSync(this.buffer)
    }
    this.trace.push(`run (steps ${this.engine.stats().steps})`)
  }

  // ---- the sessions' streams ---------------------------------------------------------------

  private live(): Tracked[] {
    return this.all.filter((t) => t.session.state !== 'closed')
  }

  private track(session: Session): Tracked {
    const iterator = session.events()[Symbol.asyncIterator]()
    const tracked: Tracked = { session, events: [], pending: null, finished: false, iterator, cancelMarks: [], lastFence: session.fence, operations: [] }
    this.all.push(tracked)
    return tracked
  }

  /** Reads up to `max` events of `t` that are available now (or arrive within a macrotask). An
   *  event is recorded in the same microtask it is taken from the queue. */
  private async read(t: Tracked, max: number): Promise<void> {
    for (let i = 0; i < max && !t.finished; i++) {
      t.pending ??= t.iterator.next().then((next) => {
        t.pending = null
        if (next.done === true) t.finished = true
        else t.events.push(next.value)
      })
      const progressed = await Promise.race([t.pending.then(() => true), macrotask().then(() => false)])
      if (!progressed) return
    }
  }

  /**
   * Wind down: close what is left, drain the engine, let every stream end. close() must not
   * need a reader: its promise is awaited only after the streams were read to their end.
   */
  async windDown(): Promise<void> {
    const closing = this.live().map((t) => t.session.close('shutdown'))
    for (let i = 0; i < 10_000 && this.engine.hasPendingWork(); i++) {
      this.engine.runSync(this.buffer)
      if (i % 16 === 0) await macrotask()
    }
    for (const t of this.all) {
      for (let i = 0; i < 2_000 && !t.finished; i++) await this.read(t, 1_000)
      if (!t.finished) this.fail(`the events of ${short(t)} never ended`)
    }
    await Promise.all(closing)
  }

  // ---- the checks --------------------------------------------------------------------------

  /** Every error an action meets is one it may meet. */
  private attempt(what: string, fn: () => void): void {
    try {
      fn()
      this.trace.push(`${what}: ok`)
    } catch (error: any) {
      const code = error?.code
      this.trace.push(`${what}: ${code ?? error}`)
      if (!(error instanceof this.mod.OrtexError) || !EXPECTED.has(code)) this.fail(`${what} threw ${code ?? ''} ${error?.message ?? error}`)
    }
  }

  /** Only a cancel moves the epoch, forward; within an epoch the fence never goes back. */
  private checkFence(t: Tracked, action: string): void {
    if (t.session.state === 'closed') return
    const before = t.lastFence
    const after = t.session.fence
    if (after.epoch !== before.epoch && action !== 'cancel') this.fail(`${action} changed the epoch of ${t.session.id}`)
    if (after.epoch < before.epoch) this.fail(`the epoch of ${t.session.id} went back`)
    if (after.epoch === before.epoch && (after.turnId < before.turnId || after.responseSeq < before.responseSeq)) {
      this.fail(`${action} moved the fence of ${t.session.id} back within an epoch`)
    }
    t.lastFence = after
  }

  /** Once everything is closed: nothing is held, every stream is well formed and ended once. */
  checkEnd(): Summary {
    this.checkReleased()
    let closed = 0
    for (const t of this.all) {
      if (this.checkStream(t) === 'session.closed') closed++
    }
    const events = this.all.flatMap((t) => t.events)
    return {
      events: events.length,
      deltas: events.filter((e) => e.type === 'response.delta').length,
      responses: events.filter((e) => e.type === 'response.done').length,
      cancels: this.cancels,
      expired: this.expired,
      closed,
    }
  }

  private checkReleased(): void {
    this.engine.checkInvariants()
    const stats = this.engine.stats()
    if (stats.activeRequests !== 0) this.fail(`${stats.activeRequests} requests still open`)
    if (stats.freeBlocks !== stats.totalBlocks) this.fail(`KV leaked: ${stats.totalBlocks - stats.freeBlocks} blocks held`)
    if (this.manager.size !== 0) this.fail(`${this.manager.size} sessions hold a slot`)
  }

  /** The stream's grammar, its one terminal event (returned), and no delta after its cancel. */
  private checkStream(t: Tracked): string {
    try {
      checkGrammar(t.events)
    } catch (error: any) {
      this.fail(`session ${short(t)}: ${error.message}`)
    }
    const terminals = t.events.filter((e) => e.type === 'session.closed' || e.type === 'session.expired')
    if (terminals.length !== 1) this.fail(`session ${short(t)} ended ${terminals.length} times`)
    for (const mark of t.cancelMarks) {
      const late = t.events.slice(mark.at).find((e) => e.type === 'response.delta' && e.fence.epoch < mark.epoch)
      if (late !== undefined) this.fail(`session ${short(t)}: a delta of epoch ${late.fence.epoch} after the cancel to ${mark.epoch}`)
    }
    return terminals[0].type
  }

  private fail(reason: string): never {
    throw new SimFailure(this.seed, reason, this.trace.slice(-60))
  }
}

/** A session's name in the trace. */
function short(t: Tracked): string {
  return t.session.id.slice(0, 6)
}

/** Where the next event of `t` will stand in its stream (read or still queued). */
function streamPosition(t: Tracked): number {
  return t.events.length + (t.session as any)._eventQueue.size
}

describe.each(selectedBackends())('duplex simulation (%s)', (backend: BackendName) => {
  const mod = ortex(backend)
  it(`seeds ${seeds[0]}..${seeds[seeds.length - 1]}`, async () => {
    const failures: SimFailure[] = []
    const totals: Summary = { events: 0, deltas: 0, responses: 0, cancels: 0, expired: 0, closed: 0 }
    for (const seed of seeds) {
      try {
        const summary = await runSeed(mod, seed)
        for (const key of Object.keys(totals) as (keyof Summary)[]) totals[key] += summary[key]
      } catch (error) {
        if (!(error instanceof SimFailure)) {
          failures.push(new SimFailure(seed, `crashed: ${(error as Error)?.stack ?? error}`, []))
          continue
        }
        failures.push(error)
      }
    }
    if (failures.length > 0) {
      const lines = [
        `${failures.length} of ${seeds.length} seeds failed on ${backend}:`,
        ...failures.slice(0, 10).map((f) => `  seed ${f.seed}: ${f.reason}\n    replay: ${replay(f.seed, backend)}`),
        `trace of seed ${failures[0]!.seed} (last ${failures[0]!.trace.length} actions):`,
        ...failures[0]!.trace.map((line) => `  ${line}`),
      ]
      expect.fail(lines.join('\n'))
    }
    if (single === undefined) {
      console.log(`[duplex sim ${backend}] ${seeds.length} seeds: ${JSON.stringify(totals)}`)
      expect(totals.cancels).toBeGreaterThan(0)
      expect(totals.expired).toBeGreaterThan(0)
      expect(totals.deltas).toBeGreaterThan(totals.responses)
    }
  }, 600_000)
})
