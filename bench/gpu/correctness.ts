// Correctness on the GPU (issue 32, item 3): teacher-forced top-1 agreement of ortex on the provider
// under test with ortex on the CPU, on a float32 folder. The CPU engine writes a greedy reference
// per prompt; the engine under test then predicts, for every position k of it, the greedy next token
// after the prompt and the reference's first k tokens (one-token requests, run concurrently), so an
// early disagreement cannot derail the positions after it the way free-running comparison does:
//
//   prompt p, reference r0 r1 r2 ...      request k: p r0 .. r(k-1)  ->  one token, compared with rk
//
// agreement = matching positions / positions checked.

import type { BenchEngine } from '../throughput/throughput'

/** What a teacher-forced run found. */
export interface TeacherForcedResult {
  positions: number
  matches: number
  /** The first few disagreements, as [prompt index, position]. */
  mismatches: [number, number][]
  /** Set when the deadline stopped the run before every position was checked. */
  cut: boolean
}

const MISMATCHES_KEPT = 8
/** Requests in flight at once: enough to fill a batch, few enough that a cut stops soon. */
const CHUNK_REQUESTS = 64

/** One greedy request, EOS ignored: its generated ids. */
export async function greedyTokens(engine: BenchEngine, prompt: readonly number[], count: number): Promise<number[]> {
  const turn = engine.generate(prompt, { maxGeneratedTokens: count, ignoreEos: true })
  const tokens: number[] = []
  for await (const chunk of turn) tokens.push((chunk as { token: number }).token)
  await turn.done
  return tokens
}

/** The reference: each prompt's greedy continuation of `count` tokens (concurrently). */
export function greedyReference(engine: BenchEngine, prompts: readonly number[][], count: number): Promise<number[][]> {
  return Promise.all(prompts.map((prompt) => greedyTokens(engine, prompt, count)))
}

/** Teacher-forced top-1 agreement of `engine` with `reference` (one sequence per prompt). Stops
 *  between chunks once `deadlineMs` (performance.now()) has passed, returning what it checked. */
export async function teacherForcedAgreement(
  engine: BenchEngine,
  prompts: readonly number[][],
  reference: readonly number[][],
  deadlineMs: number | null = null,
): Promise<TeacherForcedResult> {
  const jobs = prompts.flatMap((prompt, p) => reference[p]!.map((expected, k) => ({ p, k, input: [...prompt, ...reference[p]!.slice(0, k)], expected })))
  const result: TeacherForcedResult = { positions: 0, matches: 0, mismatches: [], cut: false }
  for (let start = 0; start < jobs.length; start += CHUNK_REQUESTS) {
    if (deadlineMs !== null && performance.now() > deadlineMs) {
      result.cut = true
      break
    }
    const chunk = jobs.slice(start, start + CHUNK_REQUESTS)
    const predicted = await Promise.all(chunk.map((job) => greedyTokens(engine, job.input, 1)))
    chunk.forEach((job, i) => {
      result.positions++
      if (predicted[i]![0] === job.expected) result.matches++
      else if (result.mismatches.length < MISMATCHES_KEPT) result.mismatches.push([job.p, job.k])
    })
  }
  return result
}
