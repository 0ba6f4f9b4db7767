// The prefix-cache benchmark's workloads (bench/prefix-cache/main.ts runs them), each on one
// engine at a time so that engines with the cache on and off take turns in one process:
//
// - shared prefix: 16 requests 5 ms apart, one 384-token system prompt, a 32-token question each,
//   64 generated tokens (EOS ignored);
// - multi-turn: 8 conversations x 6 turns, each turn a new request carrying the whole conversation
//   so far (what a stateless chat API receives);
// - distinct prompts: the throughput benchmark's prompt lengths (no two share a prefix), at
//   concurrency 16 and at 1 (8 requests, the engines taking turns request by request, as the
//   throughput benchmark runs concurrency 1): the cache must not slow the common case.
//
// Every run draws its prompts from a stream no earlier run used, so each run meets a cold cache.

import { type RequestRecord, type RunSummary, summarize } from '../throughput/stats'
import { closedLoop } from '../throughput/throughput'

export interface CacheTurnResult {
  usage: { promptTokens: number; generatedTokens: number; cachedPromptTokens: number }
  tokens: Int32Array
}
export interface CacheTurn extends AsyncIterable<unknown> {
  done: Promise<CacheTurnResult>
}
export interface CacheEngine {
  generate(input: ArrayLike<number>, options: { maxGeneratedTokens: number; ignoreEos: boolean }): CacheTurn
  stats(): { prefixCacheHits: number; prefixCacheLookups: number }
}

export const SHARED = { requests: 16, staggerMs: 5, systemTokens: 384, questionTokens: 32, generatedTokens: 64 }
export const MULTI_TURN = { conversations: 8, turns: 6, systemTokens: 64, userTokens: 24, generatedTokens: 32 }
export const DISTINCT = { generatedTokens: 64, requestsAt1: 8 }

/** Prompt token ids: deterministic pseudo-random ids of the vocabulary, a stream per salt, so that
 *  no two questions or messages share a prefix by chance. */
export class PromptSource {
  private run = 0

  constructor(private readonly vocabSize: number) {}

  /** A salt no earlier run used: prompts that start with it meet a cold cache. */
  nextRun(): number {
    return ++this.run
  }

  /** `length` ids of stream `salt` from position `offset`. */
  slice(salt: number, offset: number, length: number): number[] {
    return Array.from({ length }, (_, i) => {
      let x = Math.imul(salt + 1, 0x9e3779b1) ^ Math.imul(offset + i + 1, 0x85ebca6b)
      x = Math.imul(x ^ (x >>> 16), 0x7feb352d)
      x = Math.imul(x ^ (x >>> 15), 0x846ca68b)
      return 3 + ((x ^ (x >>> 16)) >>> 0) % (this.vocabSize - 3)
    })
  }
}

/** Streams one request, pushing each token's time (from `now`) into `tokenMs`. */
async function streamed(engine: CacheEngine, prompt: number[], n: number, tokenMs: number[], now: () => number) {
  const turn = engine.generate(prompt, { maxGeneratedTokens: n, ignoreEos: true })
  for await (const _ of turn) tokenMs.push(now())
  return turn.done
}

export interface SharedPrefixRun extends RunSummary {
  cachedPromptTokens: number
}

/** The shared-prefix prompts of run `run`. */
export function sharedPrefixPrompts(source: PromptSource, run: number): number[][] {
  const system = source.slice(run, 0, SHARED.systemTokens)
  return Array.from({ length: SHARED.requests }, (_, i) => [...system, ...source.slice(run, 1_000 + i * 100, SHARED.questionTokens)])
}

export async function runSharedPrefix(engine: CacheEngine, prompts: number[][]): Promise<SharedPrefixRun> {
  // One request per client: request k arrives at k x staggerMs.
  let cachedPromptTokens = 0
  const records = await closedLoop(
    { prompts, staggerMs: SHARED.staggerMs, requestsByConcurrency: { [SHARED.requests]: SHARED.requests } },
    SHARED.requests,
    async (record, prompt, now) => {
      const result = await streamed(engine, prompt, SHARED.generatedTokens, record.tokenMs, now)
      cachedPromptTokens += result.usage.cachedPromptTokens
    },
  )
  return { ...summarize(records, SHARED.generatedTokens), cachedPromptTokens }
}

export interface MultiTurnRun {
  wallMs: number
  /** Per turn (1-based index - 1), summed over the conversations. */
  newTokens: number[]
  computedTokens: number[]
  /** computed / new over turns 2..6 (turn 1 has no history to reuse). */
  computedPerNew: number
  /** The largest computed / new of any one request after its first turn. */
  worstComputedPerNew: number
}

export async function runMultiTurn(engine: CacheEngine, source: PromptSource, run: number): Promise<MultiTurnRun> {
  const m = MULTI_TURN
  const system = source.slice(run, 0, m.systemTokens)
  const newTokens = new Array<number>(m.turns).fill(0)
  const computedTokens = new Array<number>(m.turns).fill(0)
  let worst = 0
  const t0 = performance.now()
  const conversation = async (c: number) => {
    let context = [...system]
    let previousLength = 0
    for (let turn = 0; turn < m.turns; turn++) {
      context.push(...source.slice(run, 1_000 + (c * m.turns + turn) * 100, m.userTokens))
      const turnHandle = engine.generate(context, { maxGeneratedTokens: m.generatedTokens, ignoreEos: true })
      const result = await turnHandle.done
      const fresh = context.length - previousLength
      const computed = result.usage.promptTokens - result.usage.cachedPromptTokens
      newTokens[turn]! += fresh
      computedTokens[turn]! += computed
      if (turn > 0) worst = Math.max(worst, computed / fresh)
      previousLength = context.length
      context = [...context, ...result.tokens]
    }
  }
  await Promise.all(Array.from({ length: m.conversations }, (_, c) => conversation(c)))
  const later = (xs: number[]) => xs.slice(1).reduce((a, b) => a + b, 0)
  return {
    wallMs: performance.now() - t0,
    newTokens,
    computedTokens,
    computedPerNew: later(computedTokens) / later(newTokens),
    worstComputedPerNew: worst,
  }
}

/** The throughput benchmark's prompt lengths, no two prompts sharing a prefix. */
export function distinctPrompts(source: PromptSource, run: number): number[][] {
  return [32, 48, 24, 64, 40, 56, 16, 72].map((length, i) => source.slice(run, 100_000 + i * 1_000, length))
}

/** At `concurrency`, a closed loop of `requests` (client k first at k x 5 ms, its next request
 *  when the previous finished). */
export async function runDistinct(engine: CacheEngine, prompts: number[][], concurrency: number, requests: number): Promise<RunSummary> {
  const records = await closedLoop(
    { prompts, staggerMs: SHARED.staggerMs, requestsByConcurrency: { [concurrency]: requests } },
    concurrency,
    async (record, prompt, now) => {
      await streamed(engine, prompt, DISTINCT.generatedTokens, record.tokenMs, now)
    },
  )
  return summarize(records, DISTINCT.generatedTokens)
}

/** Concurrency 1 as the throughput benchmark runs it: request i alone on each engine in turn
 *  (the first to go alternates), so that both see the same moments of the machine. */
export async function runDistinctInterleaved<K extends string>(engines: Record<K, CacheEngine>, prompts: number[][], requests: number): Promise<Record<K, RunSummary>> {
  const names = Object.keys(engines) as K[]
  const records = Object.fromEntries(names.map((name) => [name, [] as RequestRecord[]])) as Record<K, RequestRecord[]>
  for (let index = 0; index < requests; index++) {
    const order = index % 2 === 0 ? names : [...names].reverse()
    for (const name of order) {
      const t0 = performance.now()
      const record: RequestRecord = { index, arrivalMs: 0, tokenMs: [] }
      await streamed(engines[name], prompts[index % prompts.length]!, DISTINCT.generatedTokens, record.tokenMs, () => performance.now() - t0)
      records[name].push(record)
    }
  }
  return Object.fromEntries(names.map((name) => [name, summarizeSolo(records[name])])) as Record<K, RunSummary>
}

/** Requests run one after another, each timed from its own start: tokens/s over their summed time. */
function summarizeSolo(records: RequestRecord[]): RunSummary {
  const pooled = summarize(records, DISTINCT.generatedTokens)
  const wallMs = records.reduce((sum, r) => sum + r.tokenMs[r.tokenMs.length - 1]!, 0)
  return { ...pooled, wallMs, tokensPerSecond: (pooled.tokens * 1000) / wallMs }
}
