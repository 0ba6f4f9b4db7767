// Cross-target determinism: for the same seed, the native addon and the WebAssembly build produce
// the identical event trace. Each seed builds a scripted workload (several requests, greedy and
// sampled turns, continuations, a cancel, random buffer capacities, KV pressure, prompts sharing a
// prefix the prefix cache serves, and injected retryable faults on some seeds); every field of every event (with the request's index instead
// of its object), each run's return value and the engine's counters go into one SHA-256 digest.
//   CROSS_SEEDS=n npx vitest run test/cross-target     runs seeds 1..n (default 64)
import { createHash } from 'node:crypto'
import { describe, expect, it } from 'vitest'
import { ortex, type BackendName } from './helpers/backends'
import { Prng } from './sim/prng'

interface ScriptTurn {
  startRun: number
  input: string | number[]
  options: Record<string, unknown>
}
interface ScriptRequest {
  maxSessionTokens?: number
  turns: ScriptTurn[]
}
interface Script {
  options: Record<string, unknown>
  requests: ScriptRequest[]
  cancel: { request: number; atRun: number }
  capacities: number[]
}

function buildScript(seed: number): Script {
  const rng = new Prng(seed * 7919 + 17)
  const vocabSize = rng.pick([300, 1000, 32000])
  const blockSize = rng.pick([4, 8, 16])
  const maxBatchSize = rng.int(1, 6)
  const maxLength = 256
  const options: Record<string, unknown> = {
    seed: rng.int(0, 2 ** 31 - 1),
    vocabSize,
    maxLength,
    blockSize,
    maxBatchSize,
    maxScheduledTokens: rng.pick([16, 64, 512]),
    eosProbability: rng.pick([0, 0.05]),
  }
  if (rng.chance(0.4)) options.numBlocks = rng.int(Math.ceil(maxLength / blockSize), Math.ceil((2 * maxLength) / blockSize))
  if (rng.chance(0.3)) options.faults = { retryableRate: 0.05, capacityRate: 0.03, seed: rng.int(0, 1e6) }
  if (rng.chance(0.2)) options.batching = 'static'
  if (rng.chance(0.15)) options.prefixCaching = false
  // Token prompts start with the script's shared prefix half the time: the prefix cache serves it.
  const shared = rng.tokens(rng.int(8, 60), 3, vocabSize - 1)
  const requests: ScriptRequest[] = []
  const n = rng.int(3, 6)
  for (let r = 0; r < n; r++) {
    const turns: ScriptTurn[] = []
    const t = rng.int(1, 3)
    for (let i = 0; i < t; i++) {
      const length = rng.int(1, 30)
      const input = rng.chance(0.3)
        ? Array.from({ length }, () => String.fromCharCode(rng.int(97, 122))).join('')
        : [...(rng.chance(0.5) ? shared : []), ...rng.tokens(length, 3, vocabSize - 1)]
      const turnOptions: Record<string, unknown> = { maxGeneratedTokens: rng.int(1, 24) }
      if (rng.chance(0.6)) {
        // Sampled: non-round temperatures and top-p exercise the floating-point path.
        turnOptions.temperature = 0.2 + rng.next() * 1.3
        if (rng.chance(0.5)) turnOptions.topK = rng.int(1, 8)
        if (rng.chance(0.5)) turnOptions.topP = 0.3 + rng.next() * 0.7
        if (rng.chance(0.5)) turnOptions.seed = rng.int(0, 1e9)
      }
      if (rng.chance(0.2)) turnOptions.ignoreEos = true
      // Penalties and min-p: non-round values through the f64 -> f32 penalty path, greedy or sampled.
      if (rng.chance(0.3)) turnOptions.repetitionPenalty = 0.5 + rng.next() * 2
      if (rng.chance(0.3)) turnOptions.presencePenalty = -2 + rng.next() * 4
      if (rng.chance(0.3)) turnOptions.frequencyPenalty = -2 + rng.next() * 4
      if (rng.chance(0.3)) turnOptions.minP = rng.next() * 0.5
      turns.push({ startRun: rng.int(0, 40), input, options: turnOptions })
    }
    requests.push({ maxSessionTokens: rng.chance(0.3) ? rng.int(120, 256) : undefined, turns })
  }
  const capacities = Array.from({ length: 64 }, () => rng.pick([1, 2, 4, 1024]))
  return { options, requests, cancel: { request: rng.int(0, n - 1), atRun: rng.int(2, 25) }, capacities }
}

/** Runs a script on one backend; returns its trace lines. */
async function traceOf(backend: BackendName, script: Script): Promise<string[]> {
  const mod = ortex(backend)
  const engine = mod.Engine.simulated(script.options as any)
  const lines: string[] = [`config ${JSON.stringify({ ...engine.config, backend: undefined })}`]
  try {
    const buffers = new Map<number, ReturnType<typeof engine.createEventBuffer>>()
    for (const capacity of new Set(script.capacities)) buffers.set(capacity, engine.createEventBuffer(capacity))
    const requests = script.requests.map((r) => engine.createRequest(r.maxSessionTokens ? { maxSessionTokens: r.maxSessionTokens } : undefined))
    const index = new Map(requests.map((r, i) => [r, i]))
    const nextTurn = requests.map(() => 0)
    const running: (ReturnType<(typeof requests)[0]['beginTurn']> | null)[] = requests.map(() => null)
    const tokens: number[][] = requests.map(() => [])
    for (let run = 0; run < 20_000; run++) {
      for (let i = 0; i < requests.length; i++) {
        const turn = script.requests[i].turns[nextTurn[i]]
        if (!running[i] && turn && run >= turn.startRun) {
          try {
            running[i] = requests[i].beginTurn(turn.input, turn.options as any)
            lines.push(`begin r${i} t${running[i]!.id} tokens=${requests[i].tokenCount}`)
          } catch (error) {
            lines.push(`begin r${i} refused ${(error as any).code}`)
          }
          nextTurn[i]++
        }
      }
      if (run === script.cancel.atRun && running[script.cancel.request]) {
        lines.push(`cancel r${script.cancel.request} -> ${running[script.cancel.request]!.cancel()}`)
      }
      const pendingTurns = script.requests.some((r, i) => nextTurn[i] < r.turns.length)
      if (!engine.hasPendingWork() && !pendingTurns) break
      const buffer = buffers.get(script.capacities[run % script.capacities.length])!
      const count = engine.runSync(buffer)
      lines.push(`run ${run} cap=${buffer.capacity} -> ${count}`)
      for (let e = 0; e < count; e++) {
        const ev = buffer.at(e)
        const r = ev.request === null ? -1 : index.get(ev.request)!
        const usage = ev.usage ? `${ev.usage.promptTokens},${ev.usage.generatedTokens},${ev.usage.cachedPromptTokens}` : '-'
        lines.push(`  ev r${r} f${ev.flags} t${ev.turnId} tok${ev.token} ${ev.finishReason} ${ev.errorCode} u${usage}`)
        if (ev.usage) cachedPromptTokensSeen += ev.usage.cachedPromptTokens
        if (r >= 0 && ev.flags & mod.EventFlags.Token) tokens[r].push(ev.token)
        if (r >= 0 && ev.flags & mod.EventFlags.TurnFinished) running[r] = null
      }
      const s = engine.stats()
      lines.push(
        `  stats ${s.steps} ${s.promptTokens} ${s.generatedTokens} ${s.freeBlocks}/${s.totalBlocks} ${s.retainedEvents} ${s.activeRequests} ${s.pendingTurns}` +
          ` cache ${s.cachedBlocks} ${s.prefixCacheLookups} ${s.prefixCacheHits}`,
      )
      lines.push(`  requests ${requests.map((q) => `${q.state}:${q.tokenCount}`).join(' ')}`)
    }
    requests.forEach((r, i) => lines.push(`text r${i} ${JSON.stringify(engine.detokenize(tokens[i]))}`))
  } finally {
    await engine.close()
  }
  return lines
}

function digest(lines: string[]): string {
  return createHash('sha256').update(lines.join('\n')).digest('hex')
}

/** Prompt tokens the prefix cache served, over every trace this file ran. */
let cachedPromptTokensSeen = 0

const count = Number(process.env.CROSS_SEEDS ?? 64)
const seeds = Array.from({ length: count }, (_, i) => i + 1)

describe('cross-target determinism (native vs wasm)', () => {
  it('the scripts exercise sampling, continuations, cancels and faults', () => {
    const scripts = seeds.map(buildScript)
    expect(scripts.some((s) => s.requests.some((r) => r.turns.length > 1))).toBe(true)
    expect(scripts.some((s) => s.options.faults)).toBe(true)
    expect(scripts.some((s) => s.requests.some((r) => r.turns.some((t) => t.options.temperature !== undefined && t.options.seed === undefined)))).toBe(true)
  })

  it.each(seeds)('seed %i gives the same trace on both backends', async (seed) => {
    const script = buildScript(seed)
    const native = await traceOf('native', script)
    const wasm = await traceOf('wasm', script)
    expect(native.some((l) => l.includes(' f1 ') || l.includes(' f3 '))).toBe(true)
    if (digest(native) !== digest(wasm)) {
      const first = native.findIndex((line, i) => line !== wasm[i])
      const at = first < 0 ? Math.min(native.length, wasm.length) : first
      const window = (lines: string[]) => lines.slice(Math.max(0, at - 8), at + 3).join('\n')
      expect.fail(
        `seed ${seed}: traces differ at line ${at} (native ${native.length} lines, wasm ${wasm.length})\n` +
          `native:\n${window(native)}\nwasm:\n${window(wasm)}\n` +
          `replay: CROSS_SEEDS=${seed} npx vitest run test/cross-target -t "seed ${seed} "`,
      )
    }
    // A trace that repeats itself on the same backend, too (no hidden nondeterminism).
    expect(digest(await traceOf('wasm', script))).toBe(digest(wasm))
  })

  it('the traces include prompt tokens served by the prefix cache', () => {
    expect(cachedPromptTokensSeen).toBeGreaterThan(0)
  })
})
