// The throughput benchmark: aggregate tokens per second, time to first token and inter-token
// latency of ortex on a real model folder, side by side in one run with
//   (a) the naive per-request loop on onnxruntime-node (test/reference/reference.ts naiveGenerate: batch
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
// when a request arrives pays for it. The configurations run interleaved so that a change in the
// machine's load hits all systems alike: at C = 1 the systems take turns request by request (one
// client's closed loop is its requests end to end, so each system's requests are laid end to end
// on its own clock), at C = 4 and 16 configuration by configuration. onnxruntime-genai runs in one
// Python process for the whole benchmark (loaded once, driven by commands).
//
// Used by bench/throughput/main.ts (the program, through command.ts); the engine
// class is passed in, so this module never loads a backend itself.

import * as os from 'node:os'

import type { ExecutorStats } from '../../ts/types'
import { GenaiProcess, readPadTokenId } from './genai'
import { type RequestRecord, type RunMemory, type RunSummary, summarize } from './stats'

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
  /** onnxruntime-genai's folder when it is not modelDir (one its own builder made from the same
   *  weights): its tokenizer must give ortex's ids for the prompt text, or genai is not measured. */
  genaiModelDir?: string
  /** 32 tokens per request and fewer requests at concurrency 1 (about half a minute). */
  quick: boolean
  /** Times the whole interleaved sequence of configurations runs; goals take the median. */
  rounds: number
  /** The concurrencies to measure, a subset of CONCURRENCIES (default all). */
  concurrencies?: number[]
  Engine: BenchEngineClass
  /** The package root, where bench/genai_throughput.py lives. */
  root: string
  intraOpThreads: number
  /** Milliseconds between the clients' first arrivals (0: all at once; default DEFAULT_STAGGER_MS). */
  staggerMs?: number
  /** Measure the naive onnxruntime-node loop (needs the onnxruntime-node package). */
  naive: boolean
  /** Measure onnxruntime-genai (needs python3; the script installs it into .cache/genai-venv). */
  genai: boolean
  python: string
  onProgress: (line: string) => void
}

export interface Workload {
  modelDir: string
  /** onnxruntime-genai's folder, when not modelDir. */
  genaiModelDir?: string
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

/** ortex's process (RSS, MiB): before the first engine loaded, after it (the number to compare),
 *  and after its second engine (blocking threads) and the naive loop's session loaded too. */
export interface OrtexLoadMemory {
  rssBeforeLoadMb: number
  rssAfterLoadMb: number
  rssAfterAllLoadsMb: number
  /** The executor's KV bytes per live token (all layers, keys and values). */
  kvPositionBytes: number | null
}

/** onnxruntime-genai's process (VmRSS, MiB): before its Engine's model loaded, after it, and after
 *  the Generator's model (a second og.Model) and the warm-ups. */
export interface GenaiLoadMemory {
  rssBeforeLoadMb: number
  rssAfterLoadMb: number
  rssAfterAllLoadsMb: number
}

/** Whether onnxruntime-genai's tokenizer gives ortex's ids for the prompt text. */
export interface TokenizerCheck {
  same: boolean
  tokens: number
  firstDifference?: number
  genai?: number[]
  ortex?: number[]
}

export interface OrtexWeights {
  system: 'ortex' | 'ortex-blocking'
  hugePageBytes: number
  weightChunkBytes: number
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
  genai: { ok: boolean; version?: string; onnxruntimeVersion?: string; error?: string; tokenizerCheck?: TokenizerCheck }
  /** Resident memory after the loads, per process (the runs' own are on their rows). */
  memory?: { ortex: OrtexLoadMemory; genai?: GenaiLoadMemory }
  /** Per ortex engine, how much of the model's weights went on huge pages and into weight chunks
   *  (they move the concurrency-1 numbers by a few percent: docs/performance.md). */
  ortexWeights: OrtexWeights[]
  goals: Goal[]
  elapsedS: number
}

/** Prompt lengths, cycled by request index; every system gets the same prompts. */
const PROMPT_LENGTHS = [32, 48, 24, 64, 40, 56, 16, 72]
export const DEFAULT_STAGGER_MS = 5
/** Tokens generated per request. */
const FULL_TOKENS = 128
const QUICK_TOKENS = 32
const MAX_BATCH_SIZE = 16
const BLOCK_SIZE = 16
export const PROMPT_TEXT =
  'The river starts as a thin line of water high in the hills. In the morning the air is cold and the ' +
  'grass is wet, and the water runs fast over the stones. By noon the sun has warmed the valley, and the ' +
  'river is wider and slower. Farmers walk along the bank to check their fields, and children throw small ' +
  'stones to see how far they can skip across the surface. A good kitchen is a quiet place before the day ' +
  'begins. The bread goes into the oven, the pots are washed, and the cook writes the list of what to buy. '

/** The text every prompt is cut from (as token ids). */
export function promptText(): string {
  return PROMPT_TEXT.repeat(8)
}

/** The concurrencies the benchmark measures (its goals are at 1 and 16). */
export const CONCURRENCIES: readonly number[] = [1, 4, 16]

export function makeWorkload(
  modelDir: string,
  quick: boolean,
  intraOpThreads: number,
  tokenize: (text: string) => Int32Array,
  concurrencies: readonly number[] = CONCURRENCIES,
  staggerMs = DEFAULT_STAGGER_MS,
): Workload {
  const text = promptText()
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
    concurrencies: [...concurrencies],
    requestsByConcurrency: quick ? { 1: 2, 4: 4, 16: 16 } : { 1: 8, 4: 4, 16: 16 },
    staggerMs,
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
export async function closedLoop(
  w: Pick<Workload, 'prompts' | 'staggerMs' | 'requestsByConcurrency'>,
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
): Promise<Row> {
  const n = w.generatedTokens
  const before = engine.executorStats()
  const memory = new MemoryProbe()
  let live = 0
  const records = await closedLoop(w, concurrency, async (record, prompt, now) => {
    live += prompt.length
    try {
      await ortexRequest(engine, prompt, n, () => {
        record.tokenMs.push(now())
        memory.sample(++live)
      })
    } finally {
      live -= prompt.length + record.tokenMs.length
    }
  })
  const after = engine.executorStats()
  const summary = summarize(records, n)
  const row: Row = { system: 'ortex', concurrency, round, ...summary, memory: memory.report() }
  if (before !== null && after !== null) row.executor = executorShare(before, after, summary.wallMs)
  return row
}

/** This process's resident set in MiB. */
export function rssMb(): number {
  return process.memoryUsage.rss() / 2 ** 20
}

/** Resident memory over one run, sampled every SAMPLE_EVERY tokens (a sample reads /proc). */
class MemoryProbe {
  private static readonly SAMPLE_EVERY = 4
  private readonly start = rssMb()
  private peak = this.start
  private liveAtPeak = 0
  private liveMax = 0
  private tokens = 0

  sample(live: number): void {
    this.liveMax = Math.max(this.liveMax, live)
    if (this.tokens++ % MemoryProbe.SAMPLE_EVERY !== 0) return
    const rss = rssMb()
    if (rss >= this.peak) {
      this.peak = rss
      this.liveAtPeak = live
    }
  }

  report(): RunMemory {
    return { rssStartMb: this.start, rssPeakMb: this.peak, liveTokensAtPeak: this.liveAtPeak, liveTokensMax: this.liveMax }
  }
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

type Reference = typeof import('../../test/reference/reference')
type ReferenceModel = import('../../test/reference/reference').ReferenceModel

/**
 * Loads test/reference/reference.ts (and with it onnxruntime-node) on first use. It imports
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
    // ESM (bench/throughput/main.ts's bundle): no require, and the default import works as it is.
  }
  return import('../../test/reference/reference')
}

async function runNaive(ref: Reference, model: ReferenceModel, w: Workload, concurrency: number, round: number): Promise<Row> {
  const n = w.generatedTokens
  const records = await closedLoop(w, concurrency, async (record, prompt, now) => {
    await ref.naiveGenerate(model, prompt, n, { ignoreEos: true, onToken: () => record.tokenMs.push(now()) })
  })
  return { system: 'naive', concurrency, round, ...summarize(records, n) }
}

// ---- concurrency 1, interleaved ----------------------------------------------------------------

/** A system at concurrency 1: runs request `index` alone, returning its token times from its start. */
export interface SoloSystem {
  system: SystemName
  one(index: number): Promise<number[]>
  /** Executor timings around the whole block (ortex only). */
  stats?: () => ExecutorStats | null
}

/**
 * Concurrency 1 with the systems taking turns request by request (turnOrder), so that the
 * machine's drift, which moves the same system's rate by 10-30% within minutes here, hits every
 * system alike. Each system's requests are then laid end to end on
 * its own clock, exactly as a closed loop of one client would have run them: its tokens/s is all
 * tokens over the sum of its requests' times.
 */
export async function runInterleavedSolo(systems: SoloSystem[], w: Workload, round: number): Promise<Row[]> {
  const n = w.generatedTokens
  const requests = w.requestsByConcurrency[1]!
  const records = systems.map((): RequestRecord[] => [])
  const clocks = systems.map(() => 0)
  const errors: (string | null)[] = systems.map(() => null)
  const before = systems.map((s) => s.stats?.() ?? null)
  for (let index = 0; index < requests; index++) {
    for (let k = 0; k < systems.length; k++) {
      const i = turnOrder(index, k, systems.length)
      if (errors[i] !== null) continue
      try {
        const tokenMs = await systems[i]!.one(index)
        const arrivalMs = clocks[i]!
        records[i]!.push({ index, arrivalMs, tokenMs: tokenMs.map((t) => arrivalMs + t) })
        clocks[i] = arrivalMs + (tokenMs[tokenMs.length - 1] ?? 0)
      } catch (error) {
        errors[i] = (error as Error).message
      }
    }
  }
  return systems.map((s, i): Row => {
    const { system } = s
    if (errors[i] !== null) return { system, concurrency: 1, round, error: errors[i]! }
    try {
      const summary = summarize(records[i]!, n)
      const row: Row = { system, concurrency: 1, round, ...summary }
      const after = s.stats?.() ?? null
      if (before[i] !== null && after !== null) row.executor = executorShare(before[i]!, after, summary.wallMs)
      return row
    } catch (error) {
      return { system, concurrency: 1, round, error: (error as Error).message }
    }
  })
}

/**
 * The k-th system to run request `index`: the systems in an order rotated by the index, reversed
 * in every other pass over all rotations, so that each system runs in every position and after
 * different systems (what ran just before can still hold the cores for a moment).
 */
export function turnOrder(index: number, k: number, systems: number): number {
  const rotated = (index + k) % systems
  return Math.floor(index / systems) % 2 === 0 ? rotated : systems - 1 - rotated
}

/** One ortex request, streamed (as a server would consume it); `onToken` runs at each chunk. */
/** One greedy request on ortex, EOS ignored: `onToken` at each streamed token. */
export async function ortexRequest(engine: BenchEngine, prompt: number[], n: number, onToken: () => void): Promise<void> {
  const turn = engine.generate(prompt, { maxGeneratedTokens: n, ignoreEos: true })
  for await (const _chunk of turn) onToken()
  const result = await turn.done
  if (result.finishReason !== 'max-generated-tokens') throw new Error(`ortex: a turn ended with ${result.finishReason}`)
}

/** A request run alone: its token times in ms from its start. */
async function timed(run: (onToken: () => void) => Promise<unknown>): Promise<number[]> {
  const tokenMs: number[] = []
  const t0 = performance.now()
  await run(() => tokenMs.push(performance.now() - t0))
  return tokenMs
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
    const withMemory = ok.filter((r) => r.memory !== undefined)
    if (withMemory.length > 0) {
      // The round whose run reached the highest resident memory (the first touches the KV pages).
      row.memory = withMemory.reduce((a, b) => (b.memory!.rssPeakMb > a.memory!.rssPeakMb ? b : a)).memory
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
  const rssBeforeLoadMb = rssMb()
  const { engine, blocking, w, rssAfterLoadMb } = await loadOrtex(options)
  const ortexWeights = [weightsOf('ortex', engine), weightsOf('ortex-blocking', blocking)].flatMap((x) => x ?? [])
  const { naive, loop } = await loadNaiveLoop(options, w)
  const memory: ThroughputReport['memory'] = {
    ortex: {
      rssBeforeLoadMb,
      rssAfterLoadMb,
      rssAfterAllLoadsMb: rssMb(),
      kvPositionBytes: engine.executorStats()?.kvPositionBytes ?? null,
    },
  }
  const genai: ThroughputReport['genai'] = options.genai ? { ok: true } : { ok: false, error: 'skipped (--no-genai)' }
  let genaiProcess: GenaiProcess | null = null
  let rows: Row[] = []
  try {
    if (options.genai) genaiProcess = await startGenai(options, w, genai, engine)
    if (genaiProcess !== null && genaiProcess.memory !== undefined) memory.genai = genaiProcess.memory
    const systems: Systems = { w, engine, blocking, loop, genai: genaiProcess }
    await warmUp(systems)
    rows = await runRounds(options, systems)
  } finally {
    genaiProcess?.close()
    await engine.close()
    await blocking.close()
    if (loop !== null) await loop.model.release()
  }
  const { prompts: _prompts, ...workload } = w
  return {
    createdAt: new Date().toISOString(),
    quick: options.quick,
    machine: machineOf(loadAverageStart),
    workload,
    rounds: options.rounds,
    rows,
    summary: summarizeRounds(rows),
    naive,
    genai,
    memory,
    ortexWeights,
    goals: goals(rows, options.rounds),
    elapsedS: (performance.now() - started) / 1000,
  }
}

/** The naive loop's module and session, when both loaded. */
interface NaiveLoop {
  ref: Reference
  model: ReferenceModel
}

/** Everything one benchmark measures, loaded once: the systems that could not start are null. */
interface Systems {
  w: Workload
  /** ortex with spinning intra-op threads, and with its default, blocking ones. */
  engine: BenchEngine
  blocking: BenchEngine
  loop: NaiveLoop | null
  genai: GenaiProcess | null
}

/** ortex's two engines and the workload (its prompts come from ortex's tokenizer). */
async function loadOrtex(
  options: ThroughputOptions,
): Promise<{ engine: BenchEngine; blocking: BenchEngine; w: Workload; rssAfterLoadMb: number }> {
  options.onProgress(`loading ${options.modelDir} in ortex`)
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
  const rssAfterLoadMb = rssMb()
  try {
    const w = makeWorkload(options.modelDir, options.quick, options.intraOpThreads, (text) => engine.tokenize(text), options.concurrencies, options.staggerMs)
    if (options.genaiModelDir !== undefined) w.genaiModelDir = options.genaiModelDir
    return { engine, blocking: await load(false), w, rssAfterLoadMb }
  } catch (error) {
    await engine.close()
    throw error
  }
}

/** The naive loop on onnxruntime-node; where it cannot start, the report says why. */
async function loadNaiveLoop(options: ThroughputOptions, w: Workload): Promise<{ naive: ThroughputReport['naive']; loop: NaiveLoop | null }> {
  if (!options.naive) return { naive: { ok: false, error: 'skipped (--no-naive)' }, loop: null }
  try {
    const ref = await loadReference()
    const model = await ref.ReferenceModel.load(options.modelDir, {
      intraOpThreads: w.intraOpThreads,
      intraOpSpinning: w.intraOpSpinning,
    })
    return { naive: { ok: true }, loop: { ref, model } }
  } catch (error) {
    const naive = { ok: false, error: `the naive loop could not start (it needs onnxruntime-node): ${(error as Error).message}` }
    options.onProgress(naive.error)
    return { naive, loop: null }
  }
}

/** onnxruntime-genai's process, or null with the reason in `genai`. */
async function startGenai(
  options: ThroughputOptions,
  w: Workload,
  genai: ThroughputReport['genai'],
  engine: BenchEngine,
): Promise<GenaiProcess | null> {
  const modelDir = w.genaiModelDir ?? w.modelDir
  options.onProgress(`starting onnxruntime-genai (Python): loading ${modelDir} for its Engine and Generator`)
  const text = promptText()
  const started = await GenaiProcess.start(options, {
    ...w,
    modelDir,
    padTokenId: readPadTokenId(modelDir),
    promptText: text,
    promptIds: Array.from(engine.tokenize(text)),
  })
  const refuse = (why: string): null => {
    genai.ok = false
    genai.error = why
    options.onProgress(`onnxruntime-genai: ${why}`)
    return null
  }
  if (typeof started === 'string') return refuse(started)
  genai.tokenizerCheck = started.tokenizerCheck
  const check = started.tokenizerCheck
  if (check === undefined || !check.same) {
    started.close()
    return refuse(
      check === undefined
        ? 'its process did not check the tokenizer'
        : `not compared: its tokenizer (${modelDir}) gives other ids than ortex's for the prompt text ` +
            `(first difference at token ${check.firstDifference}: genai ${JSON.stringify(check.genai)}, ortex ${JSON.stringify(check.ortex)})`,
    )
  }
  options.onProgress(`onnxruntime-genai: its tokenizer gives ortex's ${check.tokens} ids for the prompt text`)
  genai.version = started.version
  genai.onnxruntimeVersion = started.onnxruntimeVersion
  return started
}

/** The first runs of a session allocate: one short request on each system in this process. */
async function warmUp({ w, engine, blocking, loop }: Systems): Promise<void> {
  const prompt = w.prompts[0]!.slice(0, 8)
  for (const e of [engine, blocking]) await drain(e.generate(prompt, { maxGeneratedTokens: 8, ignoreEos: true }))
  if (loop !== null) await loop.ref.naiveGenerate(loop.model, prompt, 8, { ignoreEos: true })
}

/** Every round: each concurrency in turn, concurrency 1 interleaved, the others system by system. */
async function runRounds(options: ThroughputOptions, systems: Systems): Promise<Row[]> {
  const log = new RoundLog(options, systems)
  const solo = soloSystems(systems)
  for (let round = 1; round <= options.rounds; round++) {
    for (const c of systems.w.concurrencies) {
      if (c === 1) {
        log.configuration(round, `${solo.map((s) => s.system).join(', ')} taking turns request by request`, c)
        for (const row of await runInterleavedSolo(solo, systems.w, round)) log.add(row)
      } else {
        await runBatched(systems, c, round, log)
      }
    }
  }
  return log.rows
}

/** The rows of a benchmark as they come, each configuration and result told to progress. */
class RoundLog {
  readonly rows: Row[] = []
  private done = 0
  private readonly total: number

  constructor(
    private readonly options: ThroughputOptions,
    private readonly systems: Systems,
  ) {
    // A configuration at concurrency 1 runs every system at once; above, one per system.
    const batched = 1 + (systems.loop !== null ? 1 : 0) + (systems.genai !== null ? 1 : 0)
    this.total = systems.w.concurrencies.reduce((sum, c) => sum + (c === 1 ? 1 : batched), 0) * options.rounds
  }

  configuration(round: number, what: string, c: number): void {
    const w = this.systems.w
    this.options.onProgress(
      `[${++this.done}/${this.total}] ${this.options.rounds > 1 ? `round ${round}: ` : ''}${what}, concurrency ${c}: ` +
        `${w.requestsByConcurrency[c]} requests x ${w.generatedTokens} tokens`,
    )
  }

  add(row: Row): void {
    this.rows.push(row)
    if ('error' in row) this.options.onProgress(`  ${row.system}: failed: ${row.error}`)
    else this.options.onProgress(`  ${row.system}: ${row.tokensPerSecond.toFixed(1)} tokens/s`)
  }
}

/** Each system as concurrency 1 runs it: one request alone, timed token by token. */
function soloSystems({ w, engine, blocking, loop, genai }: Systems): SoloSystem[] {
  const n = w.generatedTokens
  const prompt = (index: number) => w.prompts[index % w.prompts.length]!
  const solo: SoloSystem[] = [
    { system: 'ortex', one: (i) => timed((onToken) => ortexRequest(engine, prompt(i), n, onToken)), stats: () => engine.executorStats() },
    {
      system: 'ortex-blocking',
      one: (i) => timed((onToken) => ortexRequest(blocking, prompt(i), n, onToken)),
      stats: () => blocking.executorStats(),
    },
  ]
  if (loop !== null) {
    solo.push({
      system: 'naive',
      one: (i) => timed((onToken) => loop.ref.naiveGenerate(loop.model, prompt(i), n, { ignoreEos: true, onToken })),
    })
  }
  if (genai !== null) {
    solo.push({ system: 'genai-engine', one: (i) => genai.request('engine', i) })
    solo.push({ system: 'genai-generator', one: (i) => genai.request('generator', i) })
  }
  return solo
}

/** Concurrency `c` (above 1): ortex, the naive loop, then onnxruntime-genai's two systems. */
async function runBatched({ w, engine, loop, genai }: Systems, c: number, round: number, log: RoundLog): Promise<void> {
  log.configuration(round, 'ortex', c)
  log.add(await runOrtex(engine, w, c, round).catch((e: Error) => errorRow('ortex', c, round, e)))
  if (loop !== null) {
    log.configuration(round, 'naive loop (onnxruntime-node)', c)
    log.add(await runNaive(loop.ref, loop.model, w, c, round).catch((e: Error) => errorRow('naive', c, round, e)))
  }
  if (genai !== null) {
    log.configuration(round, 'onnxruntime-genai (Python): Engine, then Generator', c)
    for (const [mode, system] of [['engine', 'genai-engine'], ['generator', 'genai-generator']] as const) {
      const requests = w.requestsByConcurrency[c]!
      log.add(
        await genai
          .closedLoop(mode, c, requests)
          .then((summary): Row => ({ system, concurrency: c, round, ...summary }))
          .catch((e: Error) => errorRow(system, c, round, e)),
      )
    }
  }
}

function machineOf(loadAverageStart: number[]): ThroughputReport['machine'] {
  return {
    cpus: os.cpus().length,
    cpuModel: os.cpus()[0]?.model ?? 'unknown',
    loadAverageStart,
    loadAverageEnd: os.loadavg(),
    node: process.version,
  }
}

/** What the engine's load put on huge pages and into weight chunks (null without a model). */
function weightsOf(system: OrtexWeights['system'], engine: BenchEngine): OrtexWeights | null {
  const stats = engine.executorStats()
  return stats === null ? null : { system, hugePageBytes: stats.hugePageBytes, weightChunkBytes: stats.weightChunkBytes }
}

async function drain(turn: BenchTurn): Promise<void> {
  for await (const _chunk of turn);
  await turn.done
}

function errorRow(system: SystemName, concurrency: number, round: number, error: Error): Row {
  return { system, concurrency, round, error: error.message }
}
