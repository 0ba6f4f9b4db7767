// ortex's two extra phases of the GPU benchmark (bench/gpu/), each on the goal model and within its
// share of the time budget: correctness (issue 32, item 3: teacher-forced top-1 agreement on the
// provider against the CPU, on a float32 folder) and the KV block size (item 1: tokens/s at block
// sizes 256 and 16, at concurrency 1 and 64). A phase past its share stops between requests and
// keeps what it has; one still running 60 s past it is cut by closing its engine.

import { greedyReference, teacherForcedAgreement } from './correctness'
import { type GpuEngineClass, type GpuEngineOptions, type GpuWorkload, firstTokens, runOrtexConcurrency } from './ortex'
import type { BlockSizeRow, CorrectnessEntry } from './report'

/** Prompts of the reference (the workload's first ones) and greedy tokens per prompt. */
export const CORRECTNESS_PROMPTS = 2
export const CORRECTNESS_TOKENS = 64
/** The concurrencies the block sizes are compared at (issue 32: 1 and 64 fit the budget). */
export const BLOCK_SIZE_CONCURRENCIES = [1, 64] as const

const CUT_AFTER_MS = 60_000

/** Runs `body` with an engine that is closed (ending its turns) if still running 60 s past
 *  `deadlineMs`; `body` can ask whether that happened (a turn it awaits then fails). */
async function withWatchdog<T>(
  engine: { close(): Promise<void> },
  deadlineMs: number | null,
  body: (wasCut: () => boolean) => Promise<T>,
): Promise<{ value: T | null; cut: boolean; error?: Error }> {
  let cut = false
  const timer = deadlineMs === null ? null : setTimeout(() => ((cut = true), void engine.close()), Math.max(0, deadlineMs - performance.now()) + CUT_AFTER_MS)
  try {
    return { value: await body(() => cut), cut }
  } catch (error) {
    return { value: null, cut, error: error as Error }
  } finally {
    if (timer !== null) clearTimeout(timer)
  }
}

export interface CorrectnessInput {
  Engine: GpuEngineClass
  model: string
  /** The float32 folder and its form. */
  dir: string
  form: string
  provider: 'cpu' | 'cuda'
  prompts: number[][]
  referenceTokens: number
  /** The CPU engine's intra-op threads. */
  cpuThreads: number
  blockSize: number
  deadlineMs: number | null
  progress: (line: string) => void
}

/** The CPU engine's greedy reference, then the provider's engine teacher-forced on it (on a CPU
 *  dry run both engines are the CPU's: the machinery is checked, the agreement is 100%). */
export async function correctnessPhase(input: CorrectnessInput): Promise<CorrectnessEntry> {
  const { Engine, prompts, referenceTokens: count, blockSize } = input
  const entry: CorrectnessEntry = {
    model: input.model,
    dir: input.dir,
    form: input.form,
    provider: input.provider,
    prompts: prompts.length,
    referenceTokens: count,
    positions: 0,
    matches: 0,
    mismatches: [],
    cut: false,
  }
  const longest = Math.max(...prompts.map((p) => p.length)) + count
  const concurrent = Math.min(64, prompts.length * count)
  const options = (provider: 'cpu' | 'cuda', maxBatchSize: number): GpuEngineOptions => ({
    executionProvider: provider,
    maxBatchSize,
    numBlocks: maxBatchSize * (Math.ceil(longest / blockSize) + 1),
    blockSize,
    maxScheduledTokens: 2048,
    ...(provider === 'cpu' ? { intraOpThreads: input.cpuThreads } : {}),
  })
  let reference: number[][]
  try {
    input.progress(`${input.model}: correctness: the CPU's greedy reference (${prompts.length} prompts x ${count} tokens) on ${input.dir}`)
    const cpu = await Engine.load(input.dir, options('cpu', prompts.length))
    const run = await withWatchdog(cpu, input.deadlineMs, () => greedyReference(cpu, prompts, count))
    await cpu.close()
    if (run.value === null) throw run.cut ? new Error('cut: the CPU reference ran 60 s past its share of the time budget') : run.error
    reference = run.value
  } catch (error) {
    return { ...entry, error: `the CPU reference failed: ${(error as Error).message}` }
  }
  try {
    input.progress(`${input.model}: correctness: ${input.provider} teacher-forced on ${prompts.length * count} positions`)
    const engine = await Engine.load(input.dir, options(input.provider, concurrent))
    const run = await withWatchdog(engine, input.deadlineMs, () => teacherForcedAgreement(engine, prompts, reference, input.deadlineMs))
    await engine.close()
    if (run.value === null) throw run.cut ? new Error('cut: ran 60 s past its share of the time budget') : run.error
    return { ...entry, ...run.value }
  } catch (error) {
    return { ...entry, error: `${input.provider} failed: ${(error as Error).message}` }
  }
}

export interface BlockSizeInput {
  Engine: GpuEngineClass
  model: string
  /** The folder per block size (a paged folder fixes its own; other forms share one folder). */
  folderFor: (blockSize: number) => string
  blockSizes: number[]
  workload: GpuWorkload
  baseOptions: GpuEngineOptions
  deadlineMs: number | null
  progress: (line: string) => void
  onRow: (row: BlockSizeRow) => void
}

/** ortex's tokens/s at each block size and BLOCK_SIZE_CONCURRENCIES, every block size in an engine
 *  of the same shape (the main run's, sized for its largest concurrency, would not compare evenly);
 *  a concurrency that would not fit the share left is skipped (the row says so). */
export async function blockSizePhase(input: BlockSizeInput): Promise<void> {
  const { workload: w, deadlineMs } = input
  const concurrencies = [...BLOCK_SIZE_CONCURRENCIES]
  const requestsByConcurrency = Object.fromEntries(concurrencies.map((c) => [String(c), c === 1 ? (w.requestsByConcurrency['1'] ?? 4) : c]))
  const longest = Math.max(...w.promptLengths) + w.generatedTokens
  let perRequestRate: number | null = null
  for (const blockSize of input.blockSizes) {
    const row = (concurrency: number, rest: Partial<BlockSizeRow>) => input.onRow({ model: input.model, blockSize, concurrency, ...rest })
    const overBudget = () => deadlineMs !== null && performance.now() > deadlineMs
    if (overBudget()) {
      for (const c of concurrencies) row(c, { error: "skipped: the phase's share of the time budget is spent" })
      continue
    }
    const numBlocks = Math.max(...concurrencies) * (Math.ceil(longest / blockSize) + 1)
    const sized: GpuWorkload = { ...w, concurrencies, requestsByConcurrency, blockSize, numBlocks }
    let engine
    try {
      const dir = input.folderFor(blockSize)
      input.progress(`${input.model}: block size ${blockSize}: loading ${dir} (${numBlocks} blocks)`)
      engine = await input.Engine.load(dir, { ...input.baseOptions, maxBatchSize: Math.max(...concurrencies), numBlocks, blockSize })
    } catch (error) {
      for (const c of concurrencies) row(c, { error: `load failed: ${(error as Error).message.slice(0, 160)}` })
      continue
    }
    const open = engine
    const cutMessage = 'cut: 60 s past its share of the time budget'
    await withWatchdog(open, deadlineMs, async (wasCut) => {
      await firstTokens(open, sized) // the warm-up
      for (const c of concurrencies) {
        const requests = requestsByConcurrency[String(c)]!
        const estimateS = perRequestRate === null ? 0 : (requests * w.generatedTokens) / (perRequestRate * Math.min(c, requests))
        if (wasCut() || (deadlineMs !== null && performance.now() + estimateS * 1000 > deadlineMs)) {
          row(c, { error: wasCut() ? cutMessage : `skipped: about ${estimateS.toFixed(0)} s, more than the time left` })
          continue
        }
        try {
          const measured = await runOrtexConcurrency(open, sized, input.model, c)
          perRequestRate = measured.tokensPerSecond! / Math.min(c, requests)
          row(c, { tokensPerSecond: measured.tokensPerSecond! })
        } catch (error) {
          row(c, { error: wasCut() ? cutMessage : (error as Error).message.slice(0, 160) })
        }
      }
    }).then((run) => {
      if (run.error !== undefined) for (const c of concurrencies) row(c, { error: run.cut ? cutMessage : run.error.message.slice(0, 160) })
    })
    await open.close()
  }
}
