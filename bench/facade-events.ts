// Events per second through the TypeScript facade, with the simulated model at zero cost: the
// number measures the facade, the binding and the core's scheduling/event path, not a model.
//
// Matrix: backend (native, wasm) x concurrent requests (16, 256) x buffer capacity (1024 bulk,
// 1 paced). Every request runs one turn with ignoreEos and a large maxGeneratedTokens, so each
// transaction yields one event per request. After a warm-up, a fixed number of runSync calls is
// timed twice: "run+read" also reads every event through buffer.at(i) (what a consumer does);
// "run only" leaves the events unread (lazy decoding means they cost nothing until read).
//
// Build first (npm run build), then:
//   npx esbuild bench/facade-events.ts --platform=node --format=esm --outfile=bench/out/facade-events.mjs \
//     && node bench/out/facade-events.mjs [--quick]
// Prints a table and writes bench/out/facade-events.json. Goal: native bulk >= 1,000,000 events/s.
import { mkdirSync, writeFileSync } from 'node:fs'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import * as os from 'node:os'
import * as native from 'ortex'
import * as wasm from 'ortex/wasm'

const GOAL_EVENTS_PER_SECOND = 1_000_000
const quick = process.argv.includes('--quick')
/** Events measured per configuration (rounded to whole runs). */
const TARGET_EVENTS = quick ? 100_000 : 1_000_000
const WARMUP_EVENTS = quick ? 10_000 : 100_000
const REPEATS = quick ? 1 : 3

type Mod = typeof native
interface Row {
  backend: 'native' | 'wasm'
  concurrency: number
  capacity: number
  runs: number
  events: number
  seconds: number
  eventsPerSecond: number
  runOnlyEventsPerSecond: number
}

function setup(mod: Mod, concurrency: number, tokensPerRequest: number) {
  const blockSize = 16
  const maxLength = tokensPerRequest + 64
  const engine = mod.Engine.simulated({
    seed: 1,
    maxLength,
    maxBatchSize: concurrency,
    maxScheduledTokens: Math.max(512, concurrency * 8),
    blockSize,
    numBlocks: concurrency * Math.ceil(maxLength / blockSize),
  })
  const requests = []
  for (let i = 0; i < concurrency; i++) {
    const request = engine.createRequest()
    request.beginTurn([10 + (i % 200), 11, 12, 13], { ignoreEos: true, maxGeneratedTokens: tokensPerRequest })
    requests.push(request)
  }
  return { engine, requests }
}

/** Times `runs` runSync calls; returns [events, seconds]. */
function measure(engine: any, buffer: any, runs: number, read: boolean): [number, number] {
  let events = 0
  let sink = 0
  const start = process.hrtime.bigint()
  for (let i = 0; i < runs; i++) {
    const n = engine.runSync(buffer)
    events += n
    if (read) for (let e = 0; e < n; e++) sink += buffer.at(e).token
  }
  const seconds = Number(process.hrtime.bigint() - start) / 1e9
  if (sink === -1) console.log('unreachable')
  return [events, seconds]
}

function bench(name: 'native' | 'wasm', mod: Mod, concurrency: number, capacity: number): Row {
  // Runs needed: bulk yields `concurrency` events per run, capacity 1 yields one.
  const perRun = Math.min(capacity, concurrency)
  const runs = Math.ceil(TARGET_EVENTS / perRun)
  const warmupRuns = Math.ceil(WARMUP_EVENTS / perRun)
  // Each measured pass consumes runs * perRun / concurrency tokens per request.
  const passes = 2 * REPEATS + 1
  const tokensPerRequest = Math.ceil(((runs * passes + warmupRuns) * perRun) / concurrency) + 16
  const { engine } = setup(mod, concurrency, tokensPerRequest)
  const buffer = engine.createEventBuffer(capacity)
  measure(engine, buffer, warmupRuns, true)
  let best: [number, number] = [0, Infinity]
  let bestRunOnly: [number, number] = [0, Infinity]
  for (let r = 0; r < REPEATS; r++) {
    const a = measure(engine, buffer, runs, true)
    if (a[0] / a[1] > best[0] / best[1]) best = a
    const b = measure(engine, buffer, runs, false)
    if (b[0] / b[1] > bestRunOnly[0] / bestRunOnly[1]) bestRunOnly = b
  }
  if (best[0] !== runs * perRun) throw new Error(`${name} c=${concurrency} cap=${capacity}: expected ${runs * perRun} events, got ${best[0]}`)
  void engine.close()
  return {
    backend: name,
    concurrency,
    capacity,
    runs,
    events: best[0],
    seconds: best[1],
    eventsPerSecond: best[0] / best[1],
    runOnlyEventsPerSecond: bestRunOnly[0] / bestRunOnly[1],
  }
}

const rows: Row[] = []
for (const [name, mod] of [['native', native], ['wasm', wasm as unknown as Mod]] as const) {
  for (const concurrency of [16, 256]) {
    for (const capacity of [1024, 1]) rows.push(bench(name, mod, concurrency, capacity))
  }
}

const fmt = (n: number) => Math.round(n).toLocaleString('en-US')
console.log('backend  requests  capacity      events/s (run+read)   events/s (run only)')
for (const row of rows) {
  console.log(
    `${row.backend.padEnd(8)} ${String(row.concurrency).padStart(8)}  ${String(row.capacity).padStart(8)}  ${fmt(row.eventsPerSecond).padStart(21)}  ${fmt(row.runOnlyEventsPerSecond).padStart(20)}`,
  )
}
const nativeBulk = rows.filter((r) => r.backend === 'native' && r.capacity === 1024)
const worst = Math.min(...nativeBulk.map((r) => r.eventsPerSecond))
const ratio = worst / GOAL_EVENTS_PER_SECOND
console.log(`goal: native bulk >= ${fmt(GOAL_EVENTS_PER_SECOND)} events/s; slowest native bulk row ${fmt(worst)} = ${ratio.toFixed(2)}x the goal (${ratio >= 1 ? 'met' : 'NOT met'})`)

const here = dirname(fileURLToPath(import.meta.url))
const outDir = here.endsWith('out') ? here : resolve(here, 'out')
mkdirSync(outDir, { recursive: true })
const report = {
  benchmark: 'facade-events',
  date: new Date().toISOString(),
  quick,
  node: process.version,
  cpus: os.cpus().length,
  cpu: os.cpus()[0]?.model,
  goalEventsPerSecond: GOAL_EVENTS_PER_SECOND,
  nativeBulkGoalRatio: ratio,
  rows,
}
writeFileSync(resolve(outDir, 'facade-events.json'), JSON.stringify(report, null, 2) + '\n')
console.log(`wrote ${resolve(outDir, 'facade-events.json')}`)
