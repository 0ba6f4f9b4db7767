// ortex's side of the GPU benchmark (bench/gpu/): one engine per model folder on the execution
// provider asked for, the closed loop of bench/throughput at each concurrency (every request of a
// concurrency arriving at once), with the executor's counters around each run: steps, and the
// bytes it moved between host and device per step where its counters have them.

import type { ExecutorStats } from '../../ts/types'
import { summarize } from '../throughput/stats'
import { type BenchEngine, closedLoop, ortexRequest } from '../throughput/throughput'
import type { BusBytes, GpuRow } from './report'

/** The engine options the benchmark sets. */
export interface GpuEngineOptions {
  executionProvider: 'cpu' | 'cuda'
  maxBatchSize: number
  numBlocks: number
  blockSize: number
  maxScheduledTokens: number
  intraOpThreads?: number
}

export interface GpuEngineClass {
  load(modelDir: string, options: GpuEngineOptions): Promise<BenchEngine & { generate: BenchEngine['generate'] }>
}

/** What every system of one model runs: the same prompts (ids) and counts. */
export interface GpuWorkload {
  prompts: number[][]
  promptLengths: number[]
  generatedTokens: number
  concurrencies: number[]
  requestsByConcurrency: Record<string, number>
  padTokenId: number
  /** ortex's KV pool in blocks (onnxruntime-genai's paged Engine gets the same). */
  numBlocks: number
  blockSize: number
  threads: number
}

/** Bytes the executor moved per step between two snapshots (docs/api.md, `executorStats()`):
 *  host inputs sent (ids, lengths, block tables, logits indices), logits received, and KV copied
 *  between the host KV store and the model's tensors (0 on a paged folder: its pool never moves). */
export function busBytesPerStep(before: ExecutorStats, after: ExecutorStats): BusBytes {
  const steps = Math.max(1, after.steps - before.steps)
  const per = (key: 'hostInputBytes' | 'logitsBytes' | 'kvCopiedBytes'): number => (after[key] - before[key]) / steps
  return { hostInputs: per('hostInputBytes'), logits: per('logitsBytes'), kvCopied: per('kvCopiedBytes') }
}

/** Runs request 0 alone and returns its generated ids (the report compares the systems' greedy tokens). */
export async function firstTokens(engine: BenchEngine, w: GpuWorkload): Promise<number[]> {
  const turn = engine.generate(w.prompts[0]!, { maxGeneratedTokens: w.generatedTokens, ignoreEos: true })
  const tokens: number[] = []
  for await (const chunk of turn) tokens.push((chunk as { token: number }).token)
  await turn.done
  return tokens
}

/** One concurrency: every request arriving at once, clients sending their next when one ends. */
export async function runOrtexConcurrency(engine: BenchEngine, w: GpuWorkload, model: string, concurrency: number): Promise<GpuRow> {
  const n = w.generatedTokens
  const before = engine.executorStats()
  const records = await closedLoop({ prompts: w.prompts, staggerMs: 0, requestsByConcurrency: w.requestsByConcurrency }, concurrency, (record, prompt, now) =>
    ortexRequest(engine, prompt, n, () => record.tokenMs.push(now())),
  )
  const after = engine.executorStats()
  const row: GpuRow = { model, system: 'ortex', concurrency, ...summarize(records, n) }
  if (before !== null && after !== null) {
    row.steps = after.steps - before.steps
    row.busBytesPerStep = busBytesPerStep(before, after)
  }
  return row
}
