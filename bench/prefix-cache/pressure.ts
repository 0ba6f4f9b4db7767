// Prefix caching under KV pressure (issue 30 item 16): many requests at once on a KV pool far
// smaller than their sum, on the simulated model (no model work, so the time is the engine's own:
// scheduling, admission, the prefix cache), the cache on and off on two engines taking turns in
// one process. The cache must not slow this case: wall time on / off at most 1.02, the median
// over the rounds. Two prompt sets: every prompt distinct (the cache cannot help) and every
// prompt behind one shared system prompt (it can).
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/prefix-cache/pressure.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --outfile=bench/out/prefix-cache-pressure.mjs \
//     && node bench/out/prefix-cache-pressure.mjs [--rounds N] [--requests N]
// Prints the table and the goal, writes bench/out/prefix-cache-pressure.json.
import { mkdirSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { Engine } from 'ortex'

import { median } from '../throughput/throughput'
import { PromptSource } from './workloads'

const root = fileURLToPath(new URL('../../', import.meta.url)) // bench/out/*.mjs -> the repository

const { values } = parseArgs({
  options: {
    rounds: { type: 'string', default: '7' },
    requests: { type: 'string', default: '1000' },
  },
})
const rounds = Number(values.rounds)

/** 1,000 requests of 64 prompt tokens and 16 generated need 5,000 blocks of 16; the pool has 64. */
export const PRESSURE = {
  requests: Number(values.requests),
  systemTokens: 48,
  questionTokens: 16,
  generatedTokens: 16,
  blockSize: 16,
  numBlocks: 64,
  maxBatchSize: 16,
  vocabSize: 32_000,
}

type Mode = 'on' | 'off'
type PromptSet = 'distinct' | 'shared'

interface PressureRun {
  wallMs: number
  steps: number
  prefixCacheLookups: number
  prefixCacheHits: number
  cachedPromptTokens: number
}

/** Prompts of run `run`: each a distinct stream, or one system prompt and a distinct question. */
function prompts(source: PromptSource, set: PromptSet, run: number): number[][] {
  const p = PRESSURE
  const system = source.slice(run, 0, p.systemTokens)
  return Array.from({ length: p.requests }, (_, i) => {
    const question = source.slice(run, 1_000 + i * 100, p.questionTokens)
    return set === 'shared' ? [...system, ...question] : [...source.slice(run, 500_000 + i * 100, p.systemTokens), ...question]
  })
}

/** Every request begun at once, then runs until nothing is pending. */
async function runPressure(prefixCaching: boolean, inputs: number[][]): Promise<PressureRun> {
  const p = PRESSURE
  const engine = Engine.simulated({
    seed: 1,
    vocabSize: p.vocabSize,
    blockSize: p.blockSize,
    numBlocks: p.numBlocks,
    maxBatchSize: p.maxBatchSize,
    maxRequests: p.requests,
    prefixCaching,
  })
  const buffer = engine.createEventBuffer(p.requests)
  const t0 = performance.now()
  const requests = inputs.map(() => engine.createRequest())
  const turns = requests.map((request, i) => request.beginTurn(inputs[i]!, { maxGeneratedTokens: p.generatedTokens, ignoreEos: true }))
  while (engine.hasPendingWork()) engine.runSync(buffer)
  const wallMs = performance.now() - t0
  const results = await Promise.all(turns.map((turn) => turn.done))
  const cachedPromptTokens = results.reduce((sum, r) => sum + r.usage.cachedPromptTokens, 0)
  for (const request of requests) request.close()
  const stats = engine.stats()
  await engine.close()
  return { wallMs, steps: stats.steps, prefixCacheLookups: stats.prefixCacheLookups, prefixCacheHits: stats.prefixCacheHits, cachedPromptTokens }
}

async function main(): Promise<void> {
  const source = new PromptSource(PRESSURE.vocabSize)
  const results: Record<PromptSet, Record<Mode, PressureRun[]>> = { distinct: { on: [], off: [] }, shared: { on: [], off: [] } }
  // A first round of each, not counted: the first engines of a process allocate.
  for (const set of ['distinct', 'shared'] as const) for (const on of [true, false]) await runPressure(on, prompts(source, set, source.nextRun()).slice(0, 100))
  for (let round = 1; round <= rounds; round++) {
    const order: Mode[] = round % 2 === 1 ? ['on', 'off'] : ['off', 'on']
    for (const set of ['distinct', 'shared'] as const) {
      const inputs = prompts(source, set, source.nextRun())
      for (const mode of order) {
        const run = await runPressure(mode === 'on', inputs)
        results[set][mode].push(run)
        process.stderr.write(`round ${round}/${rounds} ${set} cache ${mode}: ${run.wallMs.toFixed(0)} ms, ${run.steps} steps, ${run.prefixCacheLookups} lookups, ${run.prefixCacheHits} hits\n`)
      }
    }
  }
  report(results)
}

function report(results: Record<PromptSet, Record<Mode, PressureRun[]>>): void {
  const p = PRESSURE
  const m = (runs: PressureRun[], key: keyof PressureRun) => median(runs.map((r) => r[key]))!
  const lines = [
    `prefix caching under KV pressure: ${p.requests} requests at once, ${p.systemTokens + p.questionTokens}-token prompts, ${p.generatedTokens} tokens each,`,
    `  ${p.numBlocks} blocks of ${p.blockSize} (the requests need ${Math.ceil(p.requests * (p.systemTokens + p.questionTokens + p.generatedTokens) / p.blockSize)}), maxBatchSize ${p.maxBatchSize}; medians of ${rounds} rounds`,
    '  prompts   cache  wall ms   steps  lookups   hits  cached prompt tokens',
  ]
  const goals: { name: string; value: number; goal: number; met: boolean }[] = []
  for (const set of ['distinct', 'shared'] as const) {
    for (const mode of ['on', 'off'] as const) {
      const runs = results[set][mode]
      lines.push(
        `  ${set.padEnd(8)}  ${mode.padEnd(5)}  ${m(runs, 'wallMs').toFixed(0).padStart(7)}  ${m(runs, 'steps').toFixed(0).padStart(6)}  ${m(runs, 'prefixCacheLookups').toFixed(0).padStart(7)}  ${m(runs, 'prefixCacheHits').toFixed(0).padStart(5)}  ${m(runs, 'cachedPromptTokens').toFixed(0).padStart(20)}`,
      )
    }
    const ratio = m(results[set].on, 'wallMs') / m(results[set].off, 'wallMs')
    goals.push({ name: `${set} prompts: wall time, cache on / off`, value: ratio, goal: 1.02, met: ratio <= 1.02 })
  }
  lines.push('goals:')
  for (const g of goals) lines.push(`  ${g.name.padEnd(44)} ${g.value.toFixed(3)}  (goal <= ${g.goal}: ${g.met ? 'met' : 'NOT met'})`)
  const out = join(root, 'bench', 'out')
  mkdirSync(out, { recursive: true })
  const jsonPath = join(out, 'prefix-cache-pressure.json')
  writeFileSync(jsonPath, `${JSON.stringify({ pressure: p, rounds, goals, results }, null, 2)}\n`)
  process.stdout.write(`${lines.join('\n')}\nwrote ${jsonPath}\n`)
}

main().catch((error: unknown) => {
  process.stderr.write(`prefix-cache-pressure: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`)
  process.exit(1)
})
