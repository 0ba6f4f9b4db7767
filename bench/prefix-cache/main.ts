// Prefix caching on a real model: the shared-prefix, multi-turn and distinct-prompt workloads
// (workloads.ts) on two engines over one folder, the prefix cache on and off, taking turns in one
// process, and onnxruntime-genai's Engine and Generator on the shared-prefix workload
// (bench/genai_throughput.py). Goals are ratios of medians over the rounds.
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/prefix-cache/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --outfile=bench/out/prefix-cache.mjs \
//     && node bench/out/prefix-cache.mjs [--model DIR] [--rounds N] [--threads N] [--no-genai] [--quick]
// The default model is .cache/models/bench-gqa (made when absent). Prints the table and the
// goals, writes bench/out/prefix-cache.json and a chart (docs/prefix-cache.svg; --quick:
// bench/out/prefix-cache.svg); with --model DIR, bench/out/prefix-cache-<folder name>.json/.svg.
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import { loadavg } from 'node:os'
import { basename, dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { Engine } from 'ortex'

import { ensureBenchModel } from '../throughput/command'
import { GenaiProcess, readPadTokenId } from '../throughput/genai'
import type { RunSummary } from '../throughput/stats'
import { median } from '../throughput/throughput'
import { svgChart } from './chart'
import {
  type CacheEngine,
  DISTINCT,
  distinctPrompts,
  type MultiTurnRun,
  PromptSource,
  runDistinct,
  runDistinctInterleaved,
  runMultiTurn,
  runSharedPrefix,
  SHARED,
  type SharedPrefixRun,
  sharedPrefixPrompts,
} from './workloads'

const root = fileURLToPath(new URL('../../', import.meta.url)) // bench/out/prefix-cache.mjs -> the repository

const { values } = parseArgs({
  options: {
    model: { type: 'string' },
    rounds: { type: 'string', default: '3' },
    threads: { type: 'string', default: '2' },
    'no-genai': { type: 'boolean' },
    python: { type: 'string', default: 'python3' },
    quick: { type: 'boolean' },
  },
})
const rounds = values.quick ? 1 : Number(values.rounds)
const threads = Number(values.threads)
const modelDir = resolve(values.model ?? join(root, '.cache/models/bench-gqa'))

const started = performance.now()
const progress = (line: string) => process.stderr.write(`prefix-cache ${((performance.now() - started) / 1000).toFixed(0).padStart(4)}s  ${line}\n`)

type Mode = 'on' | 'off'
interface Results {
  shared: Record<Mode, SharedPrefixRun[]>
  genai: Record<'genai-engine' | 'genai-generator', RunSummary[]>
  multiTurn: Record<Mode, MultiTurnRun[]>
  distinct16: Record<Mode, RunSummary[]>
  distinct1: Record<Mode, RunSummary[]>
}

async function main(): Promise<void> {
  if (values.model === undefined) await ensureBenchModel(modelDir, progress)
  else if (!existsSync(join(modelDir, 'genai_config.json'))) throw new Error(`--model ${values.model}: no genai_config.json there`)
  const load = (prefixCaching: boolean) =>
    Engine.load(modelDir, { maxBatchSize: 16, intraOpThreads: threads, intraOpSpinning: true, prefixCaching })
  const vocabSize = await load(false).then(async (engine) => {
    const size = engine.config.vocabSize
    await engine.close()
    return size
  })
  const source = new PromptSource(vocabSize)
  const genai = values['no-genai'] ? null : await startGenai(source)
  const results: Results = {
    shared: { on: [], off: [] },
    genai: { 'genai-engine': [], 'genai-generator': [] },
    multiTurn: { on: [], off: [] },
    distinct16: { on: [], off: [] },
    distinct1: { on: [], off: [] },
  }
  const loadStart = loadavg()
  try {
    for (let round = 1; round <= rounds; round++) {
      // Fresh engines every round, loaded in alternating order: the engine loaded second read about
      // 1% faster than an identical first one (weights' placement), which must not favour one mode.
      const order: Mode[] = round % 2 === 1 ? ['on', 'off'] : ['off', 'on']
      progress(`round ${round}: loading ${modelDir} twice (cache ${order.join(', then ')}), ${threads} intra-op threads`)
      const engines = {} as Record<Mode, Awaited<ReturnType<typeof load>>>
      for (const mode of order) engines[mode] = await load(mode === 'on')
      try {
        await warmUp(engines, source)
        await runRound(round, engines, source, genai, results)
      } finally {
        await Promise.all([engines.on.close(), engines.off.close()])
      }
    }
  } finally {
    genai?.close()
  }
  report(results, loadStart)
}

async function startGenai(source: PromptSource): Promise<GenaiProcess | null> {
  progress('starting onnxruntime-genai (Python): loading the model for its Engine and Generator')
  const started = await GenaiProcess.start(
    { root, python: values.python!, onProgress: progress },
    {
      modelDir,
      prompts: sharedPrefixPrompts(source, 0),
      generatedTokens: SHARED.generatedTokens,
      staggerMs: SHARED.staggerMs,
      intraOpThreads: threads,
      maxBatchSize: 16,
      padTokenId: readPadTokenId(modelDir),
    },
  )
  if (typeof started === 'string') {
    progress(`onnxruntime-genai: ${started}`)
    return null
  }
  return started
}

/** The first runs of a session allocate: a short run of each workload shape on each engine. */
async function warmUp(engines: Record<Mode, CacheEngine>, source: PromptSource): Promise<void> {
  for (const engine of Object.values(engines)) {
    const prompts = sharedPrefixPrompts(source, source.nextRun()).slice(0, 4)
    await Promise.all(prompts.map((p) => engine.generate(p, { maxGeneratedTokens: 4, ignoreEos: true }).done))
  }
}

/** One round: every workload, the engines taking turns (the first to go alternates by round). */
async function runRound(round: number, engines: Record<Mode, CacheEngine>, source: PromptSource, genai: GenaiProcess | null, results: Results) {
  const order: Mode[] = round % 2 === 1 ? ['on', 'off'] : ['off', 'on']
  const tag = `round ${round}/${rounds}`
  for (const mode of order) {
    const run = await runSharedPrefix(engines[mode], sharedPrefixPrompts(source, source.nextRun()))
    results.shared[mode].push(run)
    progress(`${tag} shared prefix, cache ${mode}: TTFT p50 ${run.ttftMs.p50!.toFixed(0)} ms, ${run.tokensPerSecond.toFixed(1)} tokens/s, ${run.cachedPromptTokens} cached prompt tokens`)
  }
  if (genai !== null) {
    for (const mode of ['engine', 'generator'] as const) {
      const run = await genai.closedLoop(mode, SHARED.requests, SHARED.requests)
      results.genai[`genai-${mode}`].push(run)
      progress(`${tag} shared prefix, onnxruntime-genai ${mode}: TTFT p50 ${run.ttftMs.p50!.toFixed(0)} ms, ${run.tokensPerSecond.toFixed(1)} tokens/s`)
    }
  }
  for (const mode of order) {
    const run = await runMultiTurn(engines[mode], source, source.nextRun())
    results.multiTurn[mode].push(run)
    progress(`${tag} multi-turn, cache ${mode}: ${(run.wallMs / 1000).toFixed(2)} s, computed/new prompt tokens ${run.computedPerNew.toFixed(2)}`)
  }
  for (const mode of order) {
    const run = await runDistinct(engines[mode], distinctPrompts(source, source.nextRun()), 16, 16)
    results.distinct16[mode].push(run)
    progress(`${tag} distinct prompts at concurrency 16, cache ${mode}: ${run.tokensPerSecond.toFixed(1)} tokens/s`)
  }
  const solo = await runDistinctInterleaved(engines, distinctPrompts(source, source.nextRun()), DISTINCT.requestsAt1)
  for (const mode of order) {
    results.distinct1[mode].push(solo[mode])
    progress(`${tag} distinct prompts at concurrency 1, cache ${mode} (taking turns request by request): ${solo[mode].tokensPerSecond.toFixed(1)} tokens/s`)
  }
}

interface Goal {
  name: string
  value: number | null
  goal: number
  /** 'min': the value must be at least the goal; 'max': at most. */
  kind: 'min' | 'max'
}

function goalsOf(results: Results): Goal[] {
  const m = (xs: number[]) => median(xs)
  const ttft = (runs: RunSummary[]) => m(runs.map((r) => r.ttftMs.p50!))
  const tps = (runs: RunSummary[]) => m(runs.map((r) => r.tokensPerSecond))
  const ratio = (a: number | null, b: number | null) => (a === null || b === null || b === 0 ? null : a / b)
  const genaiBest = Math.max(tps(results.genai['genai-engine']) ?? 0, tps(results.genai['genai-generator']) ?? 0) || null
  return [
    { name: 'shared prefix: TTFT p50, cache off / on', value: ratio(ttft(results.shared.off), ttft(results.shared.on)), goal: 4, kind: 'min' },
    { name: 'shared prefix: tokens/s, cache on / off', value: ratio(tps(results.shared.on), tps(results.shared.off)), goal: 1.5, kind: 'min' },
    { name: 'shared prefix: tokens/s, cache on / onnxruntime-genai (best)', value: ratio(tps(results.shared.on), genaiBest), goal: 2, kind: 'min' },
    { name: 'multi-turn: computed / new prompt tokens (turns 2-6)', value: m(results.multiTurn.on.map((r) => r.computedPerNew)), goal: 1.2, kind: 'max' },
    {
      name: 'multi-turn: total time, cache off / on',
      value: ratio(m(results.multiTurn.off.map((r) => r.wallMs)), m(results.multiTurn.on.map((r) => r.wallMs))),
      goal: 2,
      kind: 'min',
    },
    { name: 'distinct prompts c16: tokens/s, cache on / off', value: ratio(tps(results.distinct16.on), tps(results.distinct16.off)), goal: 0.98, kind: 'min' },
    { name: 'distinct prompts c1: tokens/s, cache on / off', value: ratio(tps(results.distinct1.on), tps(results.distinct1.off)), goal: 0.98, kind: 'min' },
  ]
}

function report(results: Results, loadStart: number[]): void {
  const goals = goalsOf(results)
  const fmt = (v: number | null | undefined, digits = 1) => (v === null || v === undefined ? '-' : v.toFixed(digits))
  const lines: string[] = ['shared prefix (16 requests 5 ms apart, 384-token system prompt, 32-token questions, 64 tokens):']
  lines.push('  system            TTFT p50 ms  TTFT p99 ms  tokens/s  (medians of the rounds)')
  const sharedRow = (name: string, runs: RunSummary[]) =>
    `  ${name.padEnd(16)}  ${fmt(median(runs.map((r) => r.ttftMs.p50!)), 0).padStart(11)}  ${fmt(median(runs.map((r) => r.ttftMs.p99!)), 0).padStart(11)}  ${fmt(median(runs.map((r) => r.tokensPerSecond))).padStart(8)}`
  lines.push(sharedRow('ortex cache on', results.shared.on), sharedRow('ortex cache off', results.shared.off))
  for (const name of ['genai-engine', 'genai-generator'] as const) if (results.genai[name].length > 0) lines.push(sharedRow(name, results.genai[name]))
  lines.push('multi-turn (8 conversations x 6 turns, each turn resent whole):')
  for (const mode of ['on', 'off'] as const) {
    const runs = results.multiTurn[mode]
    lines.push(
      `  cache ${mode.padEnd(3)}  total ${fmt(median(runs.map((r) => r.wallMs / 1000)), 2)} s  computed/new prompt tokens ${fmt(median(runs.map((r) => r.computedPerNew)), 2)}` +
        ` (worst request ${fmt(Math.max(...runs.map((r) => r.worstComputedPerNew)), 2)})`,
    )
  }
  lines.push('distinct prompts (the throughput benchmark\'s lengths, 64 tokens): tokens/s')
  for (const key of ['distinct16', 'distinct1'] as const) {
    lines.push(`  concurrency ${key === 'distinct16' ? 16 : 1}: cache on ${fmt(median(results[key].on.map((r) => r.tokensPerSecond)))}, off ${fmt(median(results[key].off.map((r) => r.tokensPerSecond)))}`)
  }
  lines.push('goals:')
  for (const g of goals) {
    const met = g.value === null ? 'no value' : (g.kind === 'min' ? g.value >= g.goal : g.value <= g.goal) ? 'met' : 'NOT met'
    lines.push(`  ${g.name.padEnd(62)} ${fmt(g.value, 2).padStart(6)}  (goal ${g.kind === 'min' ? '>=' : '<='} ${g.goal}: ${met})`)
  }
  const loadEnd = loadavg()
  lines.push(`load average at start ${loadStart.map((v) => v.toFixed(2)).join(' ')}, at end ${loadEnd.map((v) => v.toFixed(2)).join(' ')}; ${rounds} rounds, ${((performance.now() - started) / 1000).toFixed(0)} s`)
  const out = join(root, 'bench', 'out')
  mkdirSync(out, { recursive: true })
  const model = JSON.parse(readFileSync(join(modelDir, 'genai_config.json'), 'utf8')).model?.type ?? '?'
  // The bench model's full run is the documented one; other folders and quick runs stay in bench/out.
  const name = values.model === undefined ? 'prefix-cache' : `prefix-cache-${basename(modelDir)}`
  const jsonPath = join(out, `${name}.json`)
  writeFileSync(jsonPath, `${JSON.stringify({ modelDir, model, threads, rounds, loadStart, loadEnd, goals, results }, null, 2)}\n`)
  const svgPath = values.quick || values.model !== undefined ? join(out, `${name}.svg`) : join(root, 'docs', 'prefix-cache.svg')
  mkdirSync(dirname(svgPath), { recursive: true })
  writeFileSync(svgPath, svgChart(goals))
  process.stdout.write(`${lines.join('\n')}\nwrote ${jsonPath} and ${svgPath}\n`)
}

main().catch((error: unknown) => {
  process.stderr.write(`prefix-cache: ${error instanceof Error ? (error.stack ?? error.message) : String(error)}\n`)
  process.exit(1)
})
