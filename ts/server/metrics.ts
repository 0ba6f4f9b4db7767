// GET /metrics: the server's and the engine's counters in Prometheus' text format, through
// prom-client. Each server has its own registry (several servers in one process do not mix).
//
//   ortex_http_requests_total{route,status}    every API request, by route and status
//   ortex_prompt_tokens_total / ortex_generation_tokens_total   tokens in and out (completions)
//   ortex_time_to_first_token_seconds          request received -> first token
//   ortex_inter_token_latency_seconds          between two tokens of one turn
//   ortex_requests_running / _waiting          completions generating / not at their first token
//   ortex_kv_blocks_total / _used / _cached    the engine's KV pool, read at scrape time

import { Counter, Gauge, Histogram, Registry } from 'prom-client'

import type { Engine } from '../engine'

/** Seconds; from 1 ms (a simulated token) to a minute (a long prompt on a CPU). */
const TTFT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
const INTER_TOKEN_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]

export class ServerMetrics {
  readonly registry = new Registry()
  readonly requests: Counter<'route' | 'status'>
  readonly promptTokens: Counter
  readonly generationTokens: Counter
  readonly timeToFirstToken: Histogram
  readonly interToken: Histogram
  private running = 0
  private waiting = 0

  constructor(engine: Engine) {
    const registers = [this.registry]
    this.requests = new Counter({
      name: 'ortex_http_requests_total',
      help: 'HTTP API requests, by route and status code.',
      labelNames: ['route', 'status'],
      registers,
    })
    this.promptTokens = new Counter({ name: 'ortex_prompt_tokens_total', help: 'Prompt tokens prefilled for completions.', registers })
    this.generationTokens = new Counter({ name: 'ortex_generation_tokens_total', help: 'Tokens generated for completions.', registers })
    this.timeToFirstToken = new Histogram({
      name: 'ortex_time_to_first_token_seconds',
      help: 'From receiving a completion request to its first token.',
      buckets: TTFT_BUCKETS_S,
      registers,
    })
    this.interToken = new Histogram({
      name: 'ortex_inter_token_latency_seconds',
      help: 'Between two consecutive tokens of one completion.',
      buckets: INTER_TOKEN_BUCKETS_S,
      registers,
    })
    const self = this
    new Gauge({
      name: 'ortex_requests_running',
      help: 'Completions that have produced their first token and are generating.',
      registers,
      collect() {
        this.set(self.running)
      },
    })
    new Gauge({
      name: 'ortex_requests_waiting',
      help: 'Completions accepted and not yet at their first token.',
      registers,
      collect() {
        this.set(self.waiting)
      },
    })
    const kvGauge = (name: string, help: string, read: (stats: KvStats) => number): void => {
      new Gauge({
        name,
        help,
        registers,
        collect() {
          const stats = kvStats(engine)
          if (stats !== null) this.set(read(stats))
        },
      })
    }
    kvGauge('ortex_kv_blocks_total', 'KV blocks in the engine pool.', (s) => s.total)
    kvGauge('ortex_kv_blocks_used', 'KV blocks held by requests (not counting blocks only the prefix cache holds).', (s) => s.used)
    kvGauge('ortex_kv_blocks_cached', 'KV blocks the prefix cache holds.', (s) => s.cached)
  }

  /** A completion was accepted; returns its tracker. */
  track(receivedAtMs: number): CompletionTracker {
    this.waiting++
    return new CompletionTracker(this, receivedAtMs)
  }

  /** @internal */
  _firstToken(): void {
    this.waiting--
    this.running++
  }

  /** @internal */
  _ended(hadToken: boolean): void {
    if (hadToken) this.running--
    else this.waiting--
  }

  text(): Promise<string> {
    return this.registry.metrics()
  }

  get contentType(): string {
    return this.registry.contentType
  }
}

interface KvStats {
  total: number
  used: number
  cached: number
}

function kvStats(engine: Engine): KvStats | null {
  try {
    const stats = engine.stats() as ReturnType<Engine['stats']> & { cachedBlocks?: number }
    return { total: stats.totalBlocks, used: stats.totalBlocks - stats.freeBlocks, cached: stats.cachedBlocks ?? 0 }
  } catch {
    return null // a closed engine has no stats; the gauges keep their last values
  }
}

/** One completion's timings. */
export class CompletionTracker {
  private lastTokenAtMs: number | null = null
  private ended = false

  constructor(
    private readonly metrics: ServerMetrics,
    private readonly receivedAtMs: number,
  ) {}

  token(nowMs: number): void {
    if (this.ended) return
    if (this.lastTokenAtMs === null) {
      this.metrics.timeToFirstToken.observe((nowMs - this.receivedAtMs) / 1000)
      this.metrics._firstToken()
    } else {
      this.metrics.interToken.observe((nowMs - this.lastTokenAtMs) / 1000)
    }
    this.lastTokenAtMs = nowMs
  }

  end(promptTokens: number, generatedTokens: number): void {
    if (this.ended) return
    this.ended = true
    this.metrics._ended(this.lastTokenAtMs !== null)
    this.metrics.promptTokens.inc(promptTokens)
    this.metrics.generationTokens.inc(generatedTokens)
  }
}
