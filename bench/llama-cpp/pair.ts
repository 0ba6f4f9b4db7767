// One GGUF file's pair, in one child process: llama.cpp on the file and ortex on its import(s),
// loaded side by side and taking turns, so that the machine's drift hits every system alike.
//
//   concurrency 1    the systems take turns request by request (turnOrder: each system runs in
//                    every position); each system's requests are laid end to end on its own clock
//   concurrency 4, 16  the systems take turns configuration by configuration, the first system
//                    alternating; staggered closed-loop arrivals (throughput.ts's closedLoop)
//
// Every sample (a request at concurrency 1, a whole run above) is bracketed by CPU readings and
// refused when other processes used more than a share of a core during it (cpu-load.ts).

import * as os from 'node:os'

import { type RequestRecord, type RunSummary, summarize } from '../throughput/stats'
import { CONCURRENCIES, type Workload, closedLoop, makeWorkload, promptText, turnOrder } from '../throughput/throughput'
import { type CpuShare, type LoadGuard, guarded, idleProcessCores } from './cpu-load'
import type { BenchFile, SystemId } from './files'
import { type LoadOptions, type RunningSystem, loadSystem } from './systems'

export interface RunSettings {
  quick: boolean
  threads: number
  rounds: number
  staggerMs: number
  concurrencies: number[]
  guard: Omit<LoadGuard, 'onProgress'>
}

export interface PairSpec {
  file: BenchFile
  systems: SystemId[]
  settings: RunSettings
  resultPath: string
}

/** One system's run of one configuration in one round. */
export interface Sample {
  system: SystemId
  concurrency: number
  round: number
  /** Absent when the sample was refused (see attempts) or failed (see error). */
  summary?: RunSummary
  refused: boolean
  error?: string
  /** Other processes' CPU during the accepted attempts (the largest), in cores. */
  othersCores: number | null
  /** This process's CPU over the accepted attempts' wall time, in cores. */
  processCores: number | null
  /** CPU the hypervisor gave to other guests during the accepted attempts (the largest), in cores. */
  stealCores: number | null
  /** Every attempt (at concurrency 1, of each request), refused ones included. */
  attempts: CpuShare[]
}

export interface TokenizerCheck {
  same: boolean
  tokens: number
  firstDifference?: number
  llamaCpp?: number[]
  ortex?: number[]
}

export interface PairResult {
  file: BenchFile
  systems: SystemId[]
  workload: Omit<Workload, 'prompts' | 'modelDir'>
  prompts: number[][]
  /** Per system, how it runs (versions, threads, KV cache). */
  info: Partial<Record<SystemId, Record<string, unknown>>>
  tokenizerCheck: TokenizerCheck
  /** Per system, its first greedy tokens after prompt 0 and how many of them match llama.cpp's. */
  agreement: Partial<Record<SystemId, { tokens: number[]; sameAsLlamaCpp: number }>>
  /** The process's own CPU while idle after the warm-up (the runtimes' threads between runs). */
  idle: CpuShare
  samples: Sample[]
  loadAverageStart: number[]
  loadAverageEnd: number[]
  elapsedS: number
}

/** Requests per configuration: the same for every system. */
const REQUESTS = { full: { 1: 4, 4: 8, 16: 16 }, quick: { 1: 2, 4: 4, 16: 16 } } as const
const MAX_CONCURRENCY = Math.max(...CONCURRENCIES)
/** Tokens per request (the throughput benchmark's counts). */
const GENERATED_TOKENS = { full: 128, quick: 32 } as const
/** The longest of the throughput benchmark's prompts (16-72 tokens): the KV space per sequence is sized for it. */
const LONGEST_PROMPT = 72
const AGREEMENT_TOKENS = 16
/** A pause before each sample: the previous system's spinning threads go to sleep. */
const SETTLE_MS = 50

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms))

export function loadOptions(s: RunSettings): LoadOptions {
  return { threads: s.threads, maxConcurrency: MAX_CONCURRENCY, longestTokens: LONGEST_PROMPT + generatedTokens(s) }
}

const generatedTokens = (s: RunSettings) => (s.quick ? GENERATED_TOKENS.quick : GENERATED_TOKENS.full)

/** The throughput benchmark's workload (its prompts, cut from ortex's tokens of its text), with this benchmark's request counts. */
export function benchWorkload(s: RunSettings, tokenize: (text: string) => number[]): Workload {
  const w = makeWorkload('', s.quick, s.threads, (text) => Int32Array.from(tokenize(text)), s.concurrencies, s.staggerMs)
  w.requestsByConcurrency = { ...(s.quick ? REQUESTS.quick : REQUESTS.full) }
  w.generatedTokens = generatedTokens(s)
  if (Math.max(...w.promptLengths) > LONGEST_PROMPT) throw new Error(`a prompt is longer than the ${LONGEST_PROMPT} tokens the KV space is sized for`)
  return w
}

export async function runPair(spec: PairSpec, progress: (line: string) => void): Promise<PairResult> {
  const started = performance.now()
  const loadAverageStart = os.loadavg()
  const s = spec.settings
  const systems: RunningSystem[] = []
  try {
    for (const id of spec.systems) {
      progress(`${spec.file.id}: loading ${id}`)
      systems.push(await loadSystem(id, spec.file, loadOptions(s)))
    }
    const ortex = systems.find((x) => x.id !== 'llama.cpp')!
    const w = benchWorkload(s, (text) => ortex.tokenize(text))
    const tokenizerCheck = checkTokenizer(systems)
    progress(
      tokenizerCheck.same
        ? `${spec.file.id}: llama.cpp's tokenizer gives ortex's ${tokenizerCheck.tokens} ids for the prompt text`
        : `${spec.file.id}: llama.cpp's tokenizer differs from ortex's at token ${tokenizerCheck.firstDifference} (both run ortex's ids)`,
    )
    const agreement = await warmUp(systems, w)
    const idle = await idleProcessCores(1000)
    const samples = await runRounds(spec, systems, w, progress)
    const { prompts, modelDir: _dir, ...workload } = w
    return {
      file: spec.file,
      systems: spec.systems,
      workload,
      prompts,
      info: Object.fromEntries(systems.map((x) => [x.id, x.info])),
      tokenizerCheck,
      agreement,
      idle,
      samples,
      loadAverageStart,
      loadAverageEnd: os.loadavg(),
      elapsedS: (performance.now() - started) / 1000,
    }
  } finally {
    for (const x of systems) await x.close()
  }
}

/** llama.cpp's ids for the prompt text against ortex's (both read the file's tokenizer). */
function checkTokenizer(systems: RunningSystem[]): TokenizerCheck {
  const text = promptText()
  const llama = systems.find((x) => x.id === 'llama.cpp')!.tokenize(text)
  const ortex = systems.find((x) => x.id !== 'llama.cpp')!.tokenize(text)
  const length = Math.max(llama.length, ortex.length)
  const first = Array.from({ length }, (_, i) => i).find((i) => llama[i] !== ortex[i])
  if (first === undefined) return { same: true, tokens: ortex.length }
  const around = (ids: number[]) => ids.slice(Math.max(0, first - 2), first + 6)
  return { same: false, tokens: ortex.length, firstDifference: first, llamaCpp: around(llama), ortex: around(ortex) }
}

/** One request per system (the first runs allocate), whose greedy tokens are compared with llama.cpp's. */
async function warmUp(systems: RunningSystem[], w: Workload): Promise<PairResult['agreement']> {
  const tokens: Partial<Record<SystemId, number[]>> = {}
  for (const x of systems) {
    const out: number[] = []
    await x.request(w.prompts[0]!, AGREEMENT_TOKENS, (token) => out.push(token))
    tokens[x.id] = out
  }
  const reference = tokens['llama.cpp']!
  const same = (ids: number[]) => {
    const i = ids.findIndex((id, k) => id !== reference[k])
    return i < 0 ? ids.length : i
  }
  return Object.fromEntries(systems.map((x) => [x.id, { tokens: tokens[x.id]!, sameAsLlamaCpp: same(tokens[x.id]!) }]))
}

async function runRounds(spec: PairSpec, systems: RunningSystem[], w: Workload, progress: (line: string) => void): Promise<Sample[]> {
  const samples: Sample[] = []
  const guard: LoadGuard = { ...spec.settings.guard, onProgress: progress }
  const rounds = spec.settings.rounds
  let slot = 0
  for (let round = 1; round <= rounds; round++) {
    for (const c of w.concurrencies) {
      const where = `${spec.file.id}${rounds > 1 ? ` round ${round}/${rounds}` : ''} concurrency ${c}`
      progress(`${where}: ${w.requestsByConcurrency[c]} requests x ${w.generatedTokens} tokens per system`)
      const got =
        c === 1
          ? await soloTurns(systems, w, round, guard, where)
          : await batchedTurns(systems, w, c, round, slot++, guard, where)
      for (const sample of got) {
        progress(`  ${where} ${sample.system}: ${describeSample(sample)}`)
        samples.push(sample)
      }
    }
  }
  return samples
}

function describeSample(s: Sample): string {
  if (s.error !== undefined) return `failed: ${s.error}`
  if (s.summary === undefined) return 'refused (other processes were busy)'
  return `${s.summary.tokensPerSecond.toFixed(1)} tokens/s (others ${(100 * s.othersCores!).toFixed(0)}% of a core, process ${s.processCores!.toFixed(2)} cores)`
}

/** A sample's record from its accepted CPU shares (null: refused). */
function sampleOf(system: SystemId, concurrency: number, round: number, accepted: CpuShare[] | null, attempts: CpuShare[], summary?: RunSummary): Sample {
  if (accepted === null || summary === undefined) return { system, concurrency, round, refused: true, othersCores: null, processCores: null, stealCores: null, attempts }
  const wallMs = accepted.reduce((sum, a) => sum + a.wallMs, 0)
  return {
    system,
    concurrency,
    round,
    summary,
    refused: false,
    othersCores: Math.max(...accepted.map((a) => a.othersCores)),
    processCores: accepted.reduce((sum, a) => sum + a.processCores * a.wallMs, 0) / wallMs,
    stealCores: Math.max(...accepted.map((a) => a.stealCores)),
    attempts,
  }
}

const failed = (system: SystemId, concurrency: number, round: number, error: unknown, attempts: CpuShare[] = []): Sample => ({
  system,
  concurrency,
  round,
  refused: false,
  error: error instanceof Error ? error.message : String(error),
  othersCores: null,
  processCores: null,
  stealCores: null,
  attempts,
})

/** Concurrency 1: request by request, the systems in turnOrder; each request its own guarded sample. */
async function soloTurns(systems: RunningSystem[], w: Workload, round: number, guard: LoadGuard, where: string): Promise<Sample[]> {
  const n = w.generatedTokens
  const requests = w.requestsByConcurrency[1]!
  const state = systems.map(() => ({ records: [] as RequestRecord[], clockMs: 0, attempts: [] as CpuShare[], accepted: [] as CpuShare[], refused: false, error: null as unknown }))
  for (let index = 0; index < requests; index++) {
    for (let k = 0; k < systems.length; k++) {
      const i = turnOrder((round - 1) * requests + index, k, systems.length)
      const x = systems[i]!
      const st = state[i]!
      if (st.refused || st.error !== null) continue
      await sleep(SETTLE_MS)
      try {
        const prompt = w.prompts[index % w.prompts.length]!
        const got = await guarded(`${where} ${x.id} request ${index + 1}`, guard, () => timedRequest(x, prompt, n))
        st.attempts.push(...got.attempts)
        if (got.result === null) st.refused = true
        else {
          st.accepted.push(got.attempts[got.attempts.length - 1]!)
          st.records.push({ index, arrivalMs: st.clockMs, tokenMs: got.result.map((t) => st.clockMs + t) })
          st.clockMs += got.result[got.result.length - 1] ?? 0
        }
      } catch (error) {
        st.error = error
      }
    }
  }
  return systems.map((x, i) => {
    const st = state[i]!
    if (st.error !== null) return failed(x.id, 1, round, st.error, st.attempts)
    if (st.refused) return sampleOf(x.id, 1, round, null, st.attempts)
    try {
      return sampleOf(x.id, 1, round, st.accepted, st.attempts, summarize(st.records, n))
    } catch (error) {
      return failed(x.id, 1, round, error, st.attempts)
    }
  })
}

/** A request alone: its token times in ms from its start. */
async function timedRequest(x: RunningSystem, prompt: number[], n: number): Promise<number[]> {
  const tokenMs: number[] = []
  const t0 = performance.now()
  await x.request(prompt, n, () => tokenMs.push(performance.now() - t0))
  return tokenMs
}

/** Concurrency above 1: each system's whole closed loop is one guarded sample, the first system alternating. */
async function batchedTurns(systems: RunningSystem[], w: Workload, c: number, round: number, slot: number, guard: LoadGuard, where: string): Promise<Sample[]> {
  const out: Sample[] = []
  for (let k = 0; k < systems.length; k++) {
    const x = systems[turnOrder(slot, k, systems.length)]!
    await sleep(SETTLE_MS)
    try {
      const got = await guarded(`${where} ${x.id}`, guard, () => batchedRun(x, w, c))
      const accepted = got.result === null ? null : [got.attempts[got.attempts.length - 1]!]
      out.push(sampleOf(x.id, c, round, accepted, got.attempts, got.result ?? undefined))
    } catch (error) {
      out.push(failed(x.id, c, round, error))
    }
  }
  // The table lists systems in the pair's order, whoever ran first.
  return systems.map((x) => out.find((s) => s.system === x.id)!)
}

/** The staggered closed loop at concurrency `c`, summarized. */
export async function batchedRun(x: RunningSystem, w: Workload, c: number): Promise<RunSummary> {
  const n = w.generatedTokens
  const records = await closedLoop(w, c, async (record, prompt, now) => {
    await x.request(prompt, n, () => record.tokenMs.push(now()))
  })
  return summarize(records, n)
}
