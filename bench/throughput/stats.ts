// Latency and throughput arithmetic for the throughput benchmark, shared by every system it
// measures (bench/genai_throughput.py computes the same on its side).

/** One request of a run: its scheduled arrival and the times its tokens arrived, in ms from the
 *  run's start. */
export interface RequestRecord {
  index: number
  arrivalMs: number
  tokenMs: number[]
}

export interface Percentiles {
  p50: number | null
  p99: number | null
}

export interface RunSummary {
  requests: number
  tokens: number
  wallMs: number
  tokensPerSecond: number
  /** First token minus scheduled arrival. */
  ttftMs: Percentiles
  /** Gaps between a request's successive tokens, pooled over all requests. */
  itlMs: Percentiles
  /** The process's resident memory over the run (batched runs only). */
  memory?: RunMemory
}

/** Resident memory (RSS, MiB) over one run: at its start and its peak (sampled as tokens come),
 *  and the live tokens (prompt + generated of the requests in flight) at the peak and at most. */
export interface RunMemory {
  rssStartMb: number
  rssPeakMb: number
  liveTokensAtPeak: number
  liveTokensMax: number
}

/** Nearest-rank percentile: the smallest value with at least p% of the values at or below it. */
export function percentile(values: readonly number[], p: number): number | null {
  if (values.length === 0) return null
  const sorted = [...values].sort((a, b) => a - b)
  const rank = Math.max(1, Math.ceil((sorted.length * p) / 100))
  return sorted[rank - 1]!
}

function percentiles(values: readonly number[]): Percentiles {
  return { p50: percentile(values, 50), p99: percentile(values, 99) }
}

/**
 * Throughput and latencies of a run whose clock started at 0 with the first arrival; the wall time
 * ends with the last token. Throws when a request generated another count than `tokensPerRequest`
 * (every system must generate the same number of tokens for the comparison to hold).
 */
export function summarize(records: readonly RequestRecord[], tokensPerRequest: number): RunSummary {
  const wrong = records.filter((r) => r.tokenMs.length !== tokensPerRequest).map((r) => r.index)
  if (wrong.length > 0) {
    throw new Error(`requests ${wrong.join(', ')} did not generate exactly ${tokensPerRequest} tokens`)
  }
  const tokens = records.reduce((sum, r) => sum + r.tokenMs.length, 0)
  const wallMs = Math.max(...records.map((r) => r.tokenMs[r.tokenMs.length - 1]!))
  const ttft = records.map((r) => r.tokenMs[0]! - r.arrivalMs)
  const itl: number[] = []
  for (const r of records) for (let i = 1; i < r.tokenMs.length; i++) itl.push(r.tokenMs[i]! - r.tokenMs[i - 1]!)
  return {
    requests: records.length,
    tokens,
    wallMs,
    tokensPerSecond: (tokens * 1000) / wallMs,
    ttftMs: percentiles(ttft),
    itlMs: percentiles(itl),
  }
}
