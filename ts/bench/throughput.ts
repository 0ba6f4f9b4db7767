// The throughput benchmark: aggregate tokens per second, time to first token and inter-token
// latency of ortex on a real model folder, side by side in one run with
//   (a) the naive per-request loop on onnxruntime-node (ts/model/reference.ts naiveGenerate: batch
//       1, present fed back as past), several of them interleaved on one session as a JavaScript
//       server would run them, and
//   (b) onnxruntime-genai's Python API over the same folder (bench/genai_throughput.py, its own
//       process: the Engine API with static batching, and the Generator API).
// Every system runs the same workload: the same prompts (token ids), greedy, EOS ignored, the same
// number of generated tokens per request, the same intra-op thread count, intra-op threads that spin
// during a run (onnxruntime-genai's default; ortex's `intraOpSpinning: true`, the naive loop's session
// the same). ortex with its default, blocking threads, runs at concurrency 1 as a fifth system.
//
// Workload at concurrency C: C clients; client k sends its first request at k * staggerMs and its
// next one as soon as the previous finishes (a closed loop), until the configuration's requests are
// done. Latencies are measured from each request's scheduled arrival, so a system that is busy
// when a request arrives pays for it. The configurations run interleaved (ortex, naive, genai at
// C = 1, then at C = 4, ...) so a change in the machine's load hits all systems alike.
//
// Used by bench/throughput.ts (the program) and `ortex bench` (ts/bench/command.ts); the engine
// class is passed in, so this module never loads a backend itself.

import { spawn } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { join } from 'node:path'

import type { ExecutorStats } from '../types'
import { type RequestRecord, type RunSummary, summarize } from './stats'

/** What the benchmark needs of an Engine (the package's, or the sources' under the CLI). */
export interface BenchTurn extends AsyncIterable<unknown> {
  done: Promise<{ finishReason: string; usage: { generatedTokens: number } }>
}
export interface BenchEngine {
  generate(input: ArrayLike<number>, options: { maxGeneratedTokens: number; ignoreEos: boolean }): BenchTurn
  tokenize(text: string): Int32Array
  executorStats(): ExecutorStats | null
  close(): Promise<void>
}
export interface BenchEngineClass {
  load(
    modelDir: string,
    options: {
      maxBatchSize: number
      intraOpThreads: number
      intraOpSpinning: boolean
      numBlocks: number
      blockSize: number
    },
  ): Promise<BenchEngine>
}

export interface ThroughputOptions {
  modelDir: string
  /** 32 tokens per request and fewer sequential requests at concurrency 1 (about a minute). */
  quick: boolean
  /** Times the whole interleaved sequence of configurations runs; goals take the median. */
  rounds: number
  Engine: BenchEngineClass
  /** The package root, where bench/genai_throughput.py lives. */
  root: string
  intraOpThreads: number
  /** Measure the naive onnxruntime-node loop (needs the onnxruntime-node package). */
  naive: boolean
  /** Measure onnxruntime-genai (needs python3; the script installs it into .cache/genai-venv). */
  genai: boolean
  python: string
  onProgress: (line: string) => void
}

export interface Workload {
  modelDir: string
  promptLengths: number[]
  prompts: number[][]
  generatedTokens: number
  concurrencies: number[]
  requestsByConcurrency: Record<string, number>
  staggerMs: number
  intraOpThreads: number
  /** Every system's intra-op threads spin during runs (ortex-blocking's excepted). */
  intraOpSpinning: boolean
  maxBatchSize: number
}

export type SystemName = 'ortex' | 'ortex-blocking' | 'naive' | 'genai-engine' | 'genai-generator'

export interface OrtexExecutorShare {
  steps: number
  invocations: number
  runMs: number
  gatherMs: number
  scatterMs: number
  executeMs: number
  /** Wall time per engine step (the run's wall time / steps: the engine had work throughout). */
  stepMs: number
  /** 100 x (wall - session runs) / wall. */
  outsideRunPct: number
}

/** One configuration's result in one round (round 0: the median over the rounds). */
export type Row =
  | ({ system: SystemName; concurrency: number; round: number; executor?: OrtexExecutorShare } & RunSummary)
  | { system: SystemName; concurrency: number; round: number; error: string }

export interface Goal {
  name: string
  /** The goal as the issue states it. */
  goal: string
  /** The median of the rounds' values. */
  value: number | null
  perRound: (number | null)[]
  unit: 'x' | '%'
  /** value / target: >= 1 meets a "at least" goal, <= 1 meets an "at most" goal. */
  ratio: number | null
  met: boolean | null
  detail: string
}

export interface ThroughputReport {
  createdAt: string
  quick: boolean
  machine: { cpus: number; cpuModel: string; loadAverageStart: number[]; loadAverageEnd: number[]; node: string }
  workload: Omit<Workload, 'prompts'>
  rounds: number
  /** Every configuration of every round (round 1, 2, ...). */
  rows: Row[]
  /** Per configuration, the median over the rounds of each number (round 0). */
  summary: Row[]
  naive: { ok: boolean; error?: string }
  genai: { ok: boolean; version?: string; onnxruntimeVersion?: string; error?: string }
  goals: Goal[]
  elapsedS: number
}

/** Prompt lengths, cycled by request index; every system gets the same prompts. */
const PROMPT_LENGTHS = [32, 48, 24, 64, 40, 56, 16, 72]
const STAGGER_MS = 5
/** Tokens generated per request. */
const FULL_TOKENS = 128
const QUICK_TOKENS = 32
const MAX_BATCH_SIZE = 16
const BLOCK_SIZE = 16
const PROMPT_TEXT =
  'The river starts as a thin line of water high in the hills. In the morning the air is cold and the ' +
  'grass is wet, and the water runs fast over the stones. By noon the sun has warmed the valley, and the ' +
  'river is wider and slower. Farmers walk along the bank to check their fields, and children throw small ' +
  'stones to see how far they can skip across the surface. A good kitchen is a quiet place before the day ' +
  'begins. The bread goes into the oven, the pots are washed, and the cook writes the list of what to buy. '

export function makeWorkload(modelDir: string, quick: boolean, intraOpThreads: number, tokenize: (text: string) => Int32Array): Workload {
  const text = PROMPT_TEXT.repeat(8)
  const ids = Array.from(tokenize(text))
  const longest = Math.max(...PROMPT_LENGTHS)
  if (ids.length < longest + PROMPT_LENGTHS.length * 7) throw new Error('the prompt text is too short for the tokenizer')
  // Different starting points, so no two prompts share a prefix.
  const prompts = PROMPT_LENGTHS.map((length, i) => ids.slice(i * 7, i * 7 + length))
  return {
    modelDir,
    promptLengths: PROMPT_LENGTHS,
    prompts,
    generatedTokens: quick ? QUICK_TOKENS : FULL_TOKENS,
    concurrencies: [1, 4, 16],
    requestsByConcurrency: quick ? { 1: 2, 4: 4, 16: 16 } : { 1: 4, 4: 4, 16: 16 },
    staggerMs: STAGGER_MS,
    intraOpThreads,
    intraOpSpinning: true,
    maxBatchSize: MAX_BATCH_SIZE,
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, Math.max(0, ms)))

/**
 * The closed loop: min(concurrency, requests) clients, client k first at k * staggerMs, each sending its
 * next request when the previous finished. `runOne` streams one request, pushing each token's time
 * (from `now`) into its record. Returns the records; the clock starts at 0 with the first arrival.
 */
async function closedLoop(
  w: Workload,
  concurrency: number,
  runOne: (record: RequestRecord, prompt: number[], now: () => number) => Promise<void>,
): Promise<RequestRecord[]> {
  const requests = w.requestsByConcurrency[concurrency]!
  const records: RequestRecord[] = []
  const t0 = performance.now()
  const now = () => performance.now() - t0
  const client = async (k: number): Promise<void> => {
    let arrivalMs = k * w.staggerMs
    await sleep(arrivalMs - now())
    for (let index = k; index < requests; index += concurrency) {
      const record: RequestRecord = { index, arrivalMs, tokenMs: [] }
      records.push(record)
      await runOne(record, w.prompts[index % w.prompts.length]!, now)
      arrivalMs = record.tokenMs[record.tokenMs.length - 1] ?? now()
    }
  }
  await Promise.all(Array.from({ length: Math.min(concurrency, requests) }, (_, k) => client(k)))
  return records.sort((a, b) => a.index - b.index)
}

// ---- ortex -------------------------------------------------------------------------------------

async function runOrtex(
  engine: BenchEngine,
  w: Workload,
  concurrency: number,
  round: number,
  system: 'ortex' | 'ortex-blocking' = 'ortex',
): Promise<Row> {
  const n = w.generatedTokens
  const before = engine.executorStats()
  const records = await closedLoop(w, concurrency, async (record, prompt, now) => {
    const turn = engine.generate(prompt, { maxGeneratedTokens: n, ignoreEos: true })
    for await (const _chunk of turn) record.tokenMs.push(now())
    const result = await turn.done
    if (result.finishReason !== 'max-generated-tokens') throw new Error(`ortex: a turn ended with ${result.finishReason}`)
  })
  const after = engine.executorStats()
  const summary = summarize(records, n)
  const row: Row = { system, concurrency, round, ...summary }
  if (before !== null && after !== null) row.executor = executorShare(before, after, summary.wallMs)
  return row
}

function executorShare(before: ExecutorStats, after: ExecutorStats, wallMs: number): OrtexExecutorShare {
  const ms = (key: 'runUs' | 'gatherUs' | 'scatterUs' | 'executeUs') => (after[key] - before[key]) / 1000
  const steps = after.steps - before.steps
  const runMs = ms('runUs')
  return {
    steps,
    invocations: after.invocations - before.invocations,
    runMs,
    gatherMs: ms('gatherUs'),
    scatterMs: ms('scatterUs'),
    executeMs: ms('executeUs'),
    stepMs: wallMs / Math.max(1, steps),
    outsideRunPct: (100 * (wallMs - runMs)) / wallMs,
  }
}

// ---- the naive loop ----------------------------------------------------------------------------

type Reference = typeof import('../model/reference')
type ReferenceModel = import('../model/reference').ReferenceModel

/**
 * Loads ts/model/reference.ts (and with it onnxruntime-node) on first use. It imports
 * onnxruntime-node's default export: Node's ESM loader gives a CommonJS package's module.exports
 * there, but the CommonJS build of the CLI (dist/cli.js) takes `default` from the package, which,
 * compiled TypeScript marked __esModule, has none. Under CommonJS the package gets a `default`
 * that is itself first. (An `import * as ort` in reference.ts would work under both.)
 */
async function loadReference(): Promise<Reference> {
  try {
    const ortModule = require('onnxruntime-node') as Record<string, unknown>
    if (ortModule.default === undefined) Object.defineProperty(ortModule, 'default', { value: ortModule })
  } catch {
    // ESM (bench/throughput.ts's bundle): no require, and the default import works as it is.
  }
  return import('../model/reference')
}

async function runNaive(ref: Reference, model: ReferenceModel, w: Workload, concurrency: number, round: number): Promise<Row> {
  const n = w.generatedTokens
  const records = await closedLoop(w, concurrency, async (record, prompt, now) => {
    await ref.naiveGenerate(model, prompt, n, { ignoreEos: true, onToken: () => record.tokenMs.push(now()) })
  })
  return { system: 'naive', concurrency, round, ...summarize(records, n) }
}

// ---- onnxruntime-genai -------------------------------------------------------------------------

interface GenaiResult {
  ok: boolean
  error?: string
  version?: string
  onnxruntimeVersion?: string
  runs?: Array<{ mode: 'engine' | 'generator'; concurrency: number; error?: string } & Partial<RunSummary>>
}

/** Runs bench/genai_throughput.py on one concurrency; its stderr lines go to `onLine`. */
async function runGenai(options: ThroughputOptions, w: Workload, padTokenId: number, concurrency: number): Promise<GenaiResult> {
  const script = join(options.root, 'bench', 'genai_throughput.py')
  if (!existsSync(script)) {
    return { ok: false, error: `${script} is missing (it comes with the repository, not the npm package)` }
  }
  const dir = mkdtempSync(join(os.tmpdir(), 'ortex-bench-'))
  const specPath = join(dir, 'spec.json')
  const outPath = join(dir, 'result.json')
  writeFileSync(
    specPath,
    JSON.stringify({ ...w, concurrencies: [concurrency], padTokenId, modes: ['engine', 'generator'] }),
  )
  try {
    const status = await new Promise<number | string>((resolve) => {
      const child = spawn(options.python, [script, '--spec', specPath, '--out', outPath], {
        stdio: ['ignore', 'ignore', 'pipe'],
      })
      let pending = ''
      child.stderr.setEncoding('utf8')
      child.stderr.on('data', (data: string) => {
        pending += data
        const lines = pending.split('\n')
        pending = lines.pop()!
        for (const line of lines) if (line.trim() !== '') options.onProgress(line.replace(/^genai_throughput: /, 'genai: '))
      })
      child.on('error', (error) => resolve(error.message))
      child.on('close', (code) => resolve(code ?? -1))
    })
    try {
      return JSON.parse(readFileSync(outPath, 'utf8')) as GenaiResult
    } catch {
      return { ok: false, error: `${options.python} ${script} gave no result (${typeof status === 'number' ? `exit status ${status}` : status})` }
    }
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}

// ---- goals -------------------------------------------------------------------------------------

function tps(rows: Row[], system: SystemName, concurrency: number): number | null {
  const row = rows.find((r) => r.system === system && r.concurrency === concurrency)
  return row !== undefined && !('error' in row) ? row.tokensPerSecond : null
}

interface GoalValue {
  name: string
  goal: string
  value: number | null
  unit: 'x' | '%'
  target: number
  atMost: boolean
  detail: string
}

/** The goals' values in one round's rows. */
function goalValues(rows: Row[]): GoalValue[] {
  const ortex1 = tps(rows, 'ortex', 1)
  const genaiBest = [tps(rows, 'genai-engine', 1), tps(rows, 'genai-generator', 1)].filter((x): x is number => x !== null)
  const ortex16 = tps(rows, 'ortex', 16)
  const naive16 = tps(rows, 'naive', 16)
  const row16 = rows.find((r) => r.system === 'ortex' && r.concurrency === 16)
  return [
    {
      name: 'vs onnxruntime-genai, concurrency 1',
      goal: 'ortex >= 1.0x onnxruntime-genai at concurrency 1',
      value: ortex1 !== null && genaiBest.length > 0 ? ortex1 / Math.max(...genaiBest) : null,
      unit: 'x',
      target: 1,
      atMost: false,
      detail: 'ortex tokens/s over the faster of onnxruntime-genai Engine and Generator, same round',
    },
    {
      name: 'vs naive loop, concurrency 16',
      goal: 'ortex >= 5x the naive loop at concurrency 16',
      value: ortex16 !== null && naive16 !== null ? ortex16 / naive16 : null,
      unit: 'x',
      target: 5,
      atMost: false,
      detail: 'ortex tokens/s over the naive onnxruntime-node loop, same round',
    },
    {
      name: 'outside session runs, concurrency 16',
      goal: 'engine time outside session runs <= 10% of step time at concurrency 16',
      value: row16 !== undefined && !('error' in row16) && row16.executor !== undefined ? row16.executor.outsideRunPct : null,
      unit: '%',
      target: 10,
      atMost: true,
      detail: '100 x (wall - executorStats.runUs) / wall over the concurrency-16 run (the engine had work throughout)',
    },
  ]
}

/** The goals over all rounds: each round's value, and their median against the target. */
export function goals(rows: Row[], rounds: number): Goal[] {
  const perRound = Array.from({ length: rounds }, (_, i) => goalValues(rows.filter((r) => r.round === i + 1)))
  return perRound[0]!.map((first, g) => {
    const values = perRound.map((round) => round[g]!.value)
    const value = median(values.filter((v): v is number => v !== null))
    return {
      name: first.name,
      goal: first.goal,
      value,
      perRound: values,
      unit: first.unit,
      ratio: value === null ? null : value / first.target,
      met: value === null ? null : first.atMost ? value <= first.target : value >= first.target,
      detail: first.detail,
    }
  })
}

/** The middle value (the mean of the two middle values for an even count); null when empty. */
export function median(values: readonly number[]): number | null {
  if (values.length === 0) return null
  const s = [...values].sort((a, b) => a - b)
  const mid = s.length >> 1
  return s.length % 2 === 1 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2
}

/** Per (system, concurrency), the median over the rounds of every number (round 0). */
export function summarizeRounds(rows: Row[]): Row[] {
  const out: Row[] = []
  const keys = [...new Set(rows.map((r) => `${r.system} ${r.concurrency}`))]
  for (const key of keys) {
    const group = rows.filter((r) => `${r.system} ${r.concurrency}` === key)
    const ok = group.filter((r): r is Exclude<Row, { error: string }> => !('error' in r))
    const { system, concurrency } = group[0]!
    if (ok.length === 0) {
      out.push({ system, concurrency, round: 0, error: (group[0] as { error: string }).error })
      continue
    }
    const m = (pick: (r: (typeof ok)[number]) => number | null | undefined) =>
      median(ok.map(pick).filter((v): v is number => typeof v === 'number'))
    const row: Row = {
      system,
      concurrency,
      round: 0,
      requests: ok[0]!.requests,
      tokens: ok[0]!.tokens,
      wallMs: m((r) => r.wallMs)!,
      tokensPerSecond: m((r) => r.tokensPerSecond)!,
      ttftMs: { p50: m((r) => r.ttftMs.p50), p99: m((r) => r.ttftMs.p99) },
      itlMs: { p50: m((r) => r.itlMs.p50), p99: m((r) => r.itlMs.p99) },
    }
    if (ok.every((r) => r.executor !== undefined)) {
      const e = (k: keyof OrtexExecutorShare) => m((r) => r.executor![k])!
      row.executor = {
        steps: e('steps'),
        invocations: e('invocations'),
        runMs: e('runMs'),
        gatherMs: e('gatherMs'),
        scatterMs: e('scatterMs'),
        executeMs: e('executeMs'),
        stepMs: e('stepMs'),
        outsideRunPct: e('outsideRunPct'),
      }
    }
    out.push(row)
  }
  return out
}

// ---- the run -----------------------------------------------------------------------------------

export async function runThroughput(options: ThroughputOptions): Promise<ThroughputReport> {
  const started = performance.now()
  const loadAverageStart = os.loadavg()
  const progress = options.onProgress
  const rows: Row[] = []
  progress(`loading ${options.modelDir} in ortex`)
  const longest = Math.max(...PROMPT_LENGTHS) + (options.quick ? QUICK_TOKENS : FULL_TOKENS)
  const load = (intraOpSpinning: boolean) =>
    options.Engine.load(options.modelDir, {
      maxBatchSize: MAX_BATCH_SIZE,
      intraOpThreads: options.intraOpThreads,
      intraOpSpinning,
      // Every request of the largest configuration resident at once, plus slack.
      numBlocks: MAX_BATCH_SIZE * (Math.ceil(longest / BLOCK_SIZE) + 1),
      blockSize: BLOCK_SIZE,
    })
  const engine = await load(true)
  let blocking: BenchEngine | null = null
  let w: Workload
  try {
    w = makeWorkload(options.modelDir, options.quick, options.intraOpThreads, (text) => engine.tokenize(text))
    blocking = await load(false)
  } catch (error) {
    await engine.close()
    throw error
  }
  const naive = { ok: options.naive } as ThroughputReport['naive']
  let ref: Reference | null = null
  let refModel: ReferenceModel | null = null
  if (options.naive) {
    try {
      ref = await loadReference()
      refModel = await ref.ReferenceModel.load(options.modelDir, {
        intraOpThreads: w.intraOpThreads,
        intraOpSpinning: w.intraOpSpinning,
      })
    } catch (error) {
      naive.ok = false
      naive.error = `the naive loop could not start (it needs onnxruntime-node): ${(error as Error).message}`
      progress(naive.error)
    }
  } else {
    naive.error = 'skipped (--no-naive)'
  }
  const genai: ThroughputReport['genai'] = options.genai ? { ok: true } : { ok: false, error: 'skipped (--no-genai)' }
  const padTokenId = readPadTokenId(options.modelDir)
  try {
    // Warm-ups: the first runs of a session allocate.
    for (const e of [engine, blocking]) {
      await drain(e.generate(w.prompts[0]!.slice(0, 8), { maxGeneratedTokens: 8, ignoreEos: true }))
    }
    if (ref !== null && refModel !== null) await ref.naiveGenerate(refModel, w.prompts[0]!.slice(0, 8), 8, { ignoreEos: true })
    const systems = 1 + (ref !== null ? 1 : 0) + (genai.ok ? 1 : 0)
    const total = (systems * w.concurrencies.length + 1) * options.rounds
    let done = 0
    const step = (round: number, what: string, c: number) =>
      progress(
        `[${++done}/${total}] ${options.rounds > 1 ? `round ${round}: ` : ''}${what}, concurrency ${c}: ` +
          `${w.requestsByConcurrency[c]} requests x ${w.generatedTokens} tokens`,
      )
    const add = (row: Row) => {
      rows.push(row)
      if ('error' in row) progress(`  ${row.system}: failed: ${row.error}`)
      else progress(`  ${row.system}: ${row.tokensPerSecond.toFixed(1)} tokens/s`)
    }
    for (let round = 1; round <= options.rounds; round++) {
      for (const c of w.concurrencies) {
        step(round, 'ortex', c)
        add(await runOrtex(engine, w, c, round).catch((e: Error) => errorRow('ortex', c, round, e)))
        if (c === 1) {
          step(round, 'ortex, threads blocking (the default)', c)
          add(await runOrtex(blocking, w, c, round, 'ortex-blocking').catch((e: Error) => errorRow('ortex-blocking', c, round, e)))
        }
        if (ref !== null && refModel !== null) {
          step(round, 'naive loop (onnxruntime-node)', c)
          add(await runNaive(ref, refModel, w, c, round).catch((e: Error) => errorRow('naive', c, round, e)))
        }
        if (genai.ok) {
          step(round, 'onnxruntime-genai (Python)', c)
          const result = await runGenai(options, w, padTokenId, c)
          if (!result.ok) {
            genai.ok = false
            genai.error = result.error ?? 'failed'
            progress(`onnxruntime-genai: ${genai.error}`)
            continue
          }
          genai.version = result.version
          genai.onnxruntimeVersion = result.onnxruntimeVersion
          for (const run of result.runs ?? []) {
            const system: SystemName = run.mode === 'engine' ? 'genai-engine' : 'genai-generator'
            const { mode: _mode, concurrency, error, ...summary } = run
            add(error !== undefined ? { system, concurrency, round, error } : { system, concurrency, round, ...(summary as RunSummary) })
          }
        }
      }
    }
  } finally {
    await engine.close()
    await blocking.close()
    if (refModel !== null) await refModel.release()
  }
  const { prompts: _prompts, ...workload } = w
  return {
    createdAt: new Date().toISOString(),
    quick: options.quick,
    machine: {
      cpus: os.cpus().length,
      cpuModel: os.cpus()[0]?.model ?? 'unknown',
      loadAverageStart,
      loadAverageEnd: os.loadavg(),
      node: process.version,
    },
    workload,
    rounds: options.rounds,
    rows,
    summary: summarizeRounds(rows),
    naive,
    genai,
    goals: goals(rows, options.rounds),
    elapsedS: (performance.now() - started) / 1000,
  }
}

async function drain(turn: BenchTurn): Promise<void> {
  for await (const _chunk of turn);
  await turn.done
}

function errorRow(system: SystemName, concurrency: number, round: number, error: Error): Row {
  return { system, concurrency, round, error: error.message }
}

function readPadTokenId(modelDir: string): number {
  const config = JSON.parse(readFileSync(join(modelDir, 'genai_config.json'), 'utf8')) as { model?: { pad_token_id?: number } }
  return config.model?.pad_token_id ?? 0
}
