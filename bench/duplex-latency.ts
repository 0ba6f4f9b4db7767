// Full-duplex latency: how soon a response starts after the user's turn ends, and how soon a
// barge-in stops one, on the native build with the simulated model.
//
// The simulated executor costs nothing real; it only sums a virtual cost per step
// (stepCostUs + tokenCostUs x tokens in the step) into stats().virtualTimeUs. So this bench
// drives the engine itself, caller-driven, and after every transaction sleeps for that
// transaction's virtual cost: wall time then behaves as if a model took that long per step,
// and the facade's own overhead is included on top. Numbers are given three ways:
//   steps    engine transactions (exact, machine-independent)
//   virtual  the cost model's time for those steps (exact)
//   wall     measured milliseconds with the paced engine (includes timer granularity, ~1 ms)
//
// Duplex: the prompt is appended in 16-token chunks while the engine runs (streaming prefill);
// the user's speech is assumed slower than prefill, so the bench lets prefill catch up before
// the final chunk. Measured: final append -> first response token.
// Half duplex (baseline): the whole prompt is sent at the end, as one turn on a fresh request.
// Measured: begin -> first token.
// Barge-in: cancel() during a response. Measured: cancel -> response.done {cancelled} in the
// session's events, and the engine steps that still ran for the cancelled response.
//
// Build first (npm run build), then:
//   npx esbuild bench/duplex-latency.ts --platform=node --format=esm --outfile=bench/out/duplex-latency.mjs \
//     && node bench/out/duplex-latency.mjs [--quick]
// Prints a table and writes bench/out/duplex-latency.json.
import { mkdirSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { DuplexSessionManager, Engine } from 'ortex'

const quick = process.argv.includes('--quick')
/** A small model on a fast CPU: 15 ms per step plus 0.2 ms per token in the step. */
const STEP_COST_US = 15_000
const TOKEN_COST_US = 200
const CHUNK_TOKENS = 16
const PROMPT_LENGTHS = quick ? [64, 1024] : [16, 64, 128, 256, 512, 1024]
const REPEATS = quick ? 1 : 3
const GOAL_START_RATIO = 1.5

type Session = ReturnType<DuplexSessionManager['open']>

function makeEngine(): Engine {
  return Engine.simulated({ seed: 1, stepCostUs: STEP_COST_US, tokenCostUs: TOKEN_COST_US, maxLength: 4096 })
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms))
const immediate = () => new Promise<void>((r) => setImmediate(r))

/**
 * Runs the engine caller-driven, sleeping each transaction's virtual cost, until stopped. The
 * events of a transaction are routed when its run resolves, before the sleep; a measurement that
 * saw an event therefore waits for settled() so that the step's modelled cost counts as elapsed.
 */
class PacedDriver {
  private running = true
  private settledWaiters: (() => void)[] = []
  /** Called while a transaction is away on the thread pool (native), before its events exist. */
  whileInFlight: (() => void) | null = null
  readonly done: Promise<void>
  constructor(private readonly engine: Engine) {
    const buffer = engine.createEventBuffer(1024)
    this.done = (async () => {
      while (this.running) {
        if (!engine.hasPendingWork()) {
          this.settle()
          await immediate()
          continue
        }
        const before = engine.stats().virtualTimeUs
        const run = engine.run(buffer)
        if (this.whileInFlight !== null) {
          // The facade starts the run a few microtasks later; the commit comes back as a macrotask.
          for (let i = 0; i < 4; i++) await Promise.resolve()
          this.whileInFlight()
        }
        await run
        const costMs = (engine.stats().virtualTimeUs - before) / 1000
        if (costMs > 0) await sleep(costMs)
        this.settle()
        await immediate()
      }
      this.settle()
    })()
  }
  /** Resolves once the transaction whose events were just seen has "taken" its modelled time. */
  settled(): Promise<void> {
    return new Promise((resolve) => this.settledWaiters.push(resolve))
  }
  async stop(): Promise<void> {
    this.running = false
    await this.done
  }
  private settle(): void {
    const waiters = this.settledWaiters
    this.settledWaiters = []
    for (const wake of waiters) wake()
  }
}

interface Mark {
  wall: number
  steps: number
  virtualUs: number
}

function mark(engine: Engine): Mark {
  const stats = engine.stats()
  return { wall: performance.now(), steps: stats.steps, virtualUs: stats.virtualTimeUs }
}

function since(engine: Engine, from: Mark): { steps: number; virtualMs: number; wallMs: number } {
  const now = mark(engine)
  return { steps: now.steps - from.steps, virtualMs: (now.virtualUs - from.virtualUs) / 1000, wallMs: now.wall - from.wall }
}

/** The first event of `session` that matches, read from its stream. */
async function firstEvent(iterator: AsyncIterator<any>, match: (e: any) => boolean): Promise<any> {
  for (;;) {
    const next = await iterator.next()
    if (next.done) throw new Error('session ended')
    if (match(next.value)) return next.value
  }
}

async function idle(engine: Engine): Promise<void> {
  while (engine.hasPendingWork()) await immediate()
}

function prompt(length: number): number[] {
  return Array.from({ length }, (_, i) => 300 + ((i * 7919) % 20_000))
}

interface StartRow {
  promptTokens: number
  duplex: { steps: number; virtualMs: number; wallMs: number }
  halfDuplex: { steps: number; virtualMs: number; wallMs: number }
}

async function duplexStart(length: number): Promise<StartRow['duplex']> {
  const engine = makeEngine()
  const driver = new PacedDriver(engine)
  const manager = new DuplexSessionManager(engine)
  const session: Session = manager.open({ turn: { maxGeneratedTokens: 4 } })
  const events = session.events()[Symbol.asyncIterator]()
  const tokens = prompt(length)
  const body = tokens.slice(0, Math.max(0, length - CHUNK_TOKENS))
  for (let i = 0; i < body.length; i += CHUNK_TOKENS) {
    session.append(body.slice(i, i + CHUNK_TOKENS))
    await idle(engine)
  }
  // The prefill step's modelled time must be over too: the user's speech is slower than prefill.
  await driver.settled()
  const from = mark(engine)
  session.append(tokens.slice(body.length), { final: true })
  await firstEvent(events, (e) => e.type === 'response.delta')
  await driver.settled()
  const result = since(engine, from)
  await session.close()
  await driver.stop()
  await engine.close()
  return result
}

async function halfDuplexStart(length: number): Promise<StartRow['halfDuplex']> {
  const engine = makeEngine()
  const driver = new PacedDriver(engine)
  const request = engine.createRequest()
  const from = mark(engine)
  const turn = request.beginTurn(prompt(length), { maxGeneratedTokens: 4 })
  const state = (turn as any)._state
  while (state.count === 0 && !state.finished) await immediate()
  await driver.settled()
  const result = since(engine, from)
  await turn.done
  request.close()
  await driver.stop()
  await engine.close()
  return result
}

/** One decode step's cost in the model: a row of one token. */
function decodeStepMs(): number {
  return (STEP_COST_US + TOKEN_COST_US) / 1000
}

interface BargeRow {
  mode: string
  cancelToDoneMs: number
  stepsAfterCancel: number
  wallUntilIdleMs: number
  generatedAfterCancel: number
}

async function bargeIn(mode: 'between steps' | 'step in flight' | 'driven'): Promise<BargeRow> {
  const paced = mode !== 'driven'
  const engine = paced ? makeEngine() : Engine.simulated({ seed: 1, maxLength: 4096 })
  const driver = paced ? new PacedDriver(engine) : null
  if (!paced) engine.start()
  const manager = new DuplexSessionManager(engine)
  const session: Session = manager.open({ turn: { maxGeneratedTokens: 2000 } })
  const events = session.events()[Symbol.asyncIterator]()
  session.append(prompt(64), { final: true })
  for (let i = 0; i < 10; i++) await firstEvent(events, (e) => e.type === 'response.delta')
  const generatedBefore = engine.stats().generatedTokens
  let from = mark(engine)
  const cancel = () => {
    from = mark(engine)
    session.cancel()
  }
  if (mode === 'step in flight') {
    // Cancel while the next decode step is executing: it completes, and its token is dropped.
    await new Promise<void>((resolve) => {
      driver!.whileInFlight = () => {
        driver!.whileInFlight = null
        cancel()
        resolve()
      }
    })
  } else {
    cancel()
  }
  const done = await firstEvent(events, (e) => e.type === 'response.done')
  const cancelToDoneMs = performance.now() - from.wall
  if (done.status !== 'cancelled') throw new Error(`expected a cancelled response, got ${done.status}`)
  await idle(engine)
  const after = since(engine, from)
  const row: BargeRow = {
    mode,
    cancelToDoneMs,
    stepsAfterCancel: after.steps,
    wallUntilIdleMs: after.wallMs,
    generatedAfterCancel: engine.stats().generatedTokens - generatedBefore,
  }
  await session.close()
  if (driver !== null) await driver.stop()
  else await engine.stop()
  await engine.close()
  return row
}

function median<T>(items: T[], key: (t: T) => number): T {
  return [...items].sort((a, b) => key(a) - key(b))[Math.floor(items.length / 2)]!
}

async function main(): Promise<void> {
  const rows: StartRow[] = []
  for (const length of PROMPT_LENGTHS) {
    const duplex: StartRow['duplex'][] = []
    const half: StartRow['halfDuplex'][] = []
    for (let r = 0; r < REPEATS; r++) {
      duplex.push(await duplexStart(length))
      half.push(await halfDuplexStart(length))
    }
    rows.push({ promptTokens: length, duplex: median(duplex, (d) => d.wallMs), halfDuplex: median(half, (d) => d.wallMs) })
  }
  const step = decodeStepMs()
  console.log(`decode step (cost model): ${step.toFixed(2)} ms = ${STEP_COST_US} us/step + ${TOKEN_COST_US} us/token`)
  console.log('')
  console.log('final append -> first token     | duplex (streamed prefill)          | half duplex (whole prompt at the end)')
  console.log('prompt tokens                   | steps  virtual ms  wall ms  x step | steps  virtual ms  wall ms  x step')
  for (const row of rows) {
    const d = row.duplex
    const h = row.halfDuplex
    console.log(
      `${String(row.promptTokens).padStart(13)}                   | ${String(d.steps).padStart(5)} ${d.virtualMs.toFixed(1).padStart(11)} ${d.wallMs.toFixed(1).padStart(8)} ${(d.virtualMs / step).toFixed(2).padStart(7)} | ` +
        `${String(h.steps).padStart(5)} ${h.virtualMs.toFixed(1).padStart(11)} ${h.wallMs.toFixed(1).padStart(8)} ${(h.virtualMs / step).toFixed(2).padStart(7)}`,
    )
  }
  const worst = Math.max(...rows.map((r) => r.duplex.virtualMs / step))
  const spread = Math.max(...rows.map((r) => r.duplex.virtualMs)) - Math.min(...rows.map((r) => r.duplex.virtualMs))
  console.log('')
  console.log(
    `duplex response start: at most ${worst.toFixed(2)} decode steps (goal <= ${GOAL_START_RATIO}); ` +
      `spread over prompt lengths ${spread.toFixed(2)} virtual ms`,
  )

  const barge: BargeRow[] = []
  for (const mode of ['between steps', 'step in flight', 'driven'] as const) {
    const runs: BargeRow[] = []
    for (let r = 0; r < REPEATS; r++) runs.push(await bargeIn(mode))
    barge.push(median(runs, (b) => b.cancelToDoneMs))
  }
  console.log('')
  console.log('barge-in (cancel during a response)')
  console.log('cancel lands               | cancel -> done event ms | steps after cancel | wall until idle ms | tokens generated after cancel')
  for (const b of barge) {
    const name = b.mode === 'driven' ? 'driven engine, zero cost' : `${b.mode} (paced)`
    console.log(
      `${name.padEnd(26)} | ${b.cancelToDoneMs.toFixed(3).padStart(23)} | ${String(b.stepsAfterCancel).padStart(18)} | ${b.wallUntilIdleMs.toFixed(2).padStart(18)} | ${String(b.generatedAfterCancel).padStart(5)}`,
    )
  }

  const report = {
    bench: 'duplex-latency',
    date: new Date().toISOString(),
    machine: { cpus: os.cpus().length, model: os.cpus()[0]?.model ?? 'unknown', node: process.version },
    costModel: { stepCostUs: STEP_COST_US, tokenCostUs: TOKEN_COST_US, decodeStepMs: step },
    chunkTokens: CHUNK_TOKENS,
    repeats: REPEATS,
    start: rows,
    goal: { maxStartInDecodeSteps: GOAL_START_RATIO, worstStartInDecodeSteps: worst },
    bargeIn: barge,
  }
  const out = resolve(dirname(fileURLToPath(import.meta.url)), 'duplex-latency.json')
  mkdirSync(dirname(out), { recursive: true })
  writeFileSync(out, `${JSON.stringify(report, null, 2)}\n`)
  console.log(`\nreport: ${out}`)
}

await main()
