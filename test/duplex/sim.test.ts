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
import { checkGrammar, type Mod, type Session } from './helpers'

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

async function runSeed(mod: Mod, seed: number): Promise<Summary> {
  const rng = new Prng(seed)
  const trace: string[] = []
  const fail = (reason: string): never => {
    throw new SimFailure(seed, reason, trace.slice(-60))
  }
  let clock = 0
  const engine = mod.Engine.simulated({
    seed,
    maxLength: rng.pick([128, 256, 512]),
    blockSize: rng.pick([4, 16]),
    maxScheduledTokens: rng.pick([16, 64, 512]),
    eosProbability: rng.pick([0, 0.05]),
    faults: { retryableRate: rng.pick([0, 0.05]), seed },
  })
  const manager = new mod.DuplexSessionManager(engine, {
    now: () => clock,
    eventBufferCapacity: rng.pick([2, 8, 1024]),
    maxSessions: rng.int(2, 6),
    idleTtlMs: rng.pick([null, 2_000, 10_000]),
    disconnectGraceMs: rng.int(100, 2_000),
    completedAppendLimit: rng.int(1, 8),
  })
  const buffer = engine.createEventBuffer(rng.pick([1, 4, 64]))
  const all: Tracked[] = []
  const live = () => all.filter((t) => t.session.state !== 'closed')
  let cancels = 0
  let expired = 0
  let closed = 0
  let opIds = 0

  const track = (session: Session): Tracked => {
    const iterator = session.events()[Symbol.asyncIterator]()
    const tracked: Tracked = { session, events: [], pending: null, finished: false, iterator, cancelMarks: [], lastFence: session.fence, operations: [] }
    all.push(tracked)
    return tracked
  }
  /** Reads up to `max` events of `t` that are available now (or arrive within a macrotask). An
   *  event is recorded in the same microtask it is taken from the queue. */
  const read = async (t: Tracked, max: number) => {
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
  const readerPace = rng.pick([1, 3, 1_000])
  const streamPosition = (t: Tracked) => t.events.length + (t.session as any)._eventQueue.size

  const checkFence = (t: Tracked, action: string) => {
    if (t.session.state === 'closed') return
    const before = t.lastFence
    const after = t.session.fence
    if (after.epoch !== before.epoch && action !== 'cancel') fail(`${action} changed the epoch of ${t.session.id}`)
    if (after.epoch < before.epoch) fail(`the epoch of ${t.session.id} went back`)
    if (after.epoch === before.epoch && (after.turnId < before.turnId || after.responseSeq < before.responseSeq)) {
      fail(`${action} moved the fence of ${t.session.id} back within an epoch`)
    }
    t.lastFence = after
  }

  const attempt = (what: string, fn: () => void) => {
    try {
      fn()
      trace.push(`${what}: ok`)
    } catch (error: any) {
      const code = error?.code
      trace.push(`${what}: ${code ?? error}`)
      if (!(error instanceof mod.OrtexError) || !EXPECTED.has(code)) fail(`${what} threw ${code ?? ''} ${error?.message ?? error}`)
    }
  }

  const text = () => {
    const words = ['hello', 'there', 'what', 'is', 'the', 'weather', 'like', 'today', 'tell', 'me', 'more']
    let out = ''
    for (let i = rng.int(1, 4); i > 0; i--) out += `${rng.pick(words)} `
    return out
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
  const { run: _run, overlap: _overlap, ...NESTED } = WEIGHTS

  /** One action, synchronously (an engine run included). */
  const perform = (action: Action): void => {
    const sessions = live()
    const target = sessions.length > 0 ? rng.pick(sessions) : null
    switch (action) {
      case 'open':
        attempt('open', () => {
          const session = manager.open({
            respond: rng.chance(0.7) ? 'on-final' : 'manual',
            turn: { maxGeneratedTokens: rng.int(1, 24) },
          })
          track(session)
        })
        break
      case 'append':
      case 'retry': {
        if (target === null) break
        const final = rng.chance(0.3)
        const opId = action === 'retry' && target.operations.length > 0 ? rng.pick(target.operations) : rng.chance(0.3) ? `op${++opIds}` : undefined
        const fence = rng.chance(0.2) ? target.lastFence : rng.chance(0.1) ? { ...target.lastFence, epoch: Math.max(0, target.lastFence.epoch - 1) } : undefined
        const input = rng.chance(0.2) ? rng.tokens(rng.int(1, 6), 3, 400) : text()
        attempt(`append ${target.session.id.slice(0, 6)} final=${final} op=${opId ?? '-'}`, () => {
          target.session.append(input, { final, operationId: opId, fence })
          if (opId !== undefined && !target.operations.includes(opId)) target.operations.push(opId)
        })
        checkFence(target, 'append')
        break
      }
      case 'respond':
        if (target === null) break
        attempt(`respond ${target.session.id.slice(0, 6)}`, () => void target.session.respond({ maxGeneratedTokens: rng.int(1, 12) }))
        checkFence(target, 'respond')
        break
      case 'cancel': {
        if (target === null) break
        const old = rng.chance(0.2)
        attempt(`cancel ${target.session.id.slice(0, 6)}${old ? ' (old fence)' : ''}`, () => {
          const before = target.session.fence.epoch
          const fence = target.session.cancel(old ? target.lastFence : undefined)
          if (fence.epoch > before) {
            cancels++
            target.cancelMarks.push({ at: streamPosition(target), epoch: fence.epoch })
          }
          if (rng.chance(0.3)) target.session.truncate(rng.int(0, 8))
        })
        checkFence(target, 'cancel')
        break
      }
      case 'detach':
        if (target === null) break
        attempt(`detach ${target.session.id.slice(0, 6)}`, () => target.session.detach())
        break
      case 'resume':
        if (target === null) break
        attempt(`resume ${target.session.id.slice(0, 6)}`, () => {
          const generation = target.session.leaseGeneration + (rng.chance(0.2) ? 1 : 0)
          const next = target.session.resume(generation)
          if (next !== generation + 1) fail(`resume(${generation}) returned ${next}`)
        })
        break
      case 'close':
        if (target === null) break
        attempt(`close ${target.session.id.slice(0, 6)}`, () => void target.session.close('sim_close'))
        break
      case 'heartbeat':
        if (target === null) break
        attempt(`heartbeat ${target.session.id.slice(0, 6)}`, () => target.session.heartbeat())
        break
      case 'tick':
        clock += rng.int(1, 1_500)
        trace.push(`tick -> ${clock}`)
        break
      case 'expire':
        attempt('collectExpired', () => {
          const ended = manager.collectExpired()
          expired += ended.length
          for (const expiry of ended) trace.push(`  expired ${expiry.sessionId.slice(0, 6)} ${expiry.reason}`)
        })
        break
      case 'run':
        for (let i = rng.int(1, 4); i > 0; i--) {
          if (!engine.hasPendingWork()) break
          engine.runSync(buffer)
        }
        trace.push(`run (steps ${engine.stats().steps})`)
        break
    }
  }

  for (let step = 0; step < STEPS; step++) {
    const action = rng.weighted(WEIGHTS) as Action
    if (action === 'overlap') {
      // An action while a transaction is away (native: on the thread pool): the facade starts
      // the run a few microtasks after run(), and its commit comes back as a later macrotask, so
      // the nested action always meets the step in flight.
      const run = engine.run(buffer)
      for (let i = 0; i < 4; i++) await Promise.resolve()
      const nested = rng.weighted(NESTED) as Action
      trace.push(`overlap: a run in flight during ${nested}`)
      perform(nested)
      await run
    } else {
      perform(action)
    }
    try {
      engine.checkInvariants()
      manager.checkInvariants()
    } catch (error: any) {
      fail(`invariant broken after ${action}: ${error?.message ?? error}`)
    }
    await macrotask()
    for (const t of all) await read(t, rng.int(0, readerPace))
  }

  // Wind down: close what is left, drain the engine, let every stream end. close() must not need
  // a reader: its promise is awaited only after the streams were read to their end.
  const closing = live().map((t) => t.session.close('shutdown'))
  for (let i = 0; i < 10_000 && engine.hasPendingWork(); i++) {
    engine.runSync(buffer)
    if (i % 16 === 0) await macrotask()
  }
  for (const t of all) {
    for (let i = 0; i < 2_000 && !t.finished; i++) await read(t, 1_000)
    if (!t.finished) fail(`the events of ${t.session.id.slice(0, 6)} never ended`)
  }
  await Promise.all(closing)
  engine.checkInvariants()
  const stats = engine.stats()
  if (stats.activeRequests !== 0) fail(`${stats.activeRequests} requests still open`)
  if (stats.freeBlocks !== stats.totalBlocks) fail(`KV leaked: ${stats.totalBlocks - stats.freeBlocks} blocks held`)
  if (manager.size !== 0) fail(`${manager.size} sessions hold a slot`)

  let events = 0
  let deltas = 0
  let responses = 0
  for (const t of all) {
    events += t.events.length
    deltas += t.events.filter((e) => e.type === 'response.delta').length
    responses += t.events.filter((e) => e.type === 'response.done').length
    try {
      checkGrammar(t.events)
    } catch (error: any) {
      fail(`session ${t.session.id.slice(0, 6)}: ${error.message}`)
    }
    const terminals = t.events.filter((e) => e.type === 'session.closed' || e.type === 'session.expired')
    if (terminals.length !== 1) fail(`session ${t.session.id.slice(0, 6)} ended ${terminals.length} times`)
    if (terminals[0].type === 'session.closed') closed++
    for (const mark of t.cancelMarks) {
      const late = t.events.slice(mark.at).find((e) => e.type === 'response.delta' && e.fence.epoch < mark.epoch)
      if (late !== undefined) fail(`session ${t.session.id.slice(0, 6)}: a delta of epoch ${late.fence.epoch} after the cancel to ${mark.epoch}`)
    }
  }
  await engine.close()
  return { events, deltas, responses, cancels, expired, closed }
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
