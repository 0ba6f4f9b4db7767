// Text-streamed throughput through the facade, as a user's server drives it: 64 concurrent turns
// on the simulated model at zero model cost, each consumed as text with `for await`, on the native
// addon and on WebAssembly, with the event loop's utilization; and the OpenAI server at
// concurrency 64 (streamed chat completions over HTTP, SSE parsed by the client). The number
// measures the facade, the bindings and the core's output path, not a model: issue 29's baseline
// (its goal: 10x native, 4x wasm, as ratios of these numbers in one run).
//
// Build first (npm run build), then:
//   npx esbuild bench/turn-stream.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --outfile=bench/out/turn-stream.mjs && node bench/out/turn-stream.mjs
import { performance } from 'node:perf_hooks'
import * as native from 'ortex'
import * as wasm from 'ortex/wasm'

const CONCURRENCY = 64
const TOKENS_PER_TURN = 2_000
const ROUNDS = 3
/** Issue 29's measurement (tokens/s) and its goal as a multiple of it. */
const ISSUE_BASELINE = { native: 103_000, wasm: 137_000 } as const
const GOAL = { native: 10, wasm: 4 } as const

type Engine = ReturnType<typeof native.Engine.simulated>

interface Sample {
  tokensPerSecond: number
  eventLoopUtilization: number
}

function simulated(mod: typeof native | typeof wasm): Engine {
  return mod.Engine.simulated({ seed: 1, maxBatchSize: CONCURRENCY, eosProbability: 0 }) as Engine
}

/** One round: CONCURRENCY turns of TOKENS_PER_TURN tokens, each read as text with `for await`. */
async function streamRound(engine: Engine): Promise<Sample> {
  const startedAt = performance.now()
  const elu = performance.eventLoopUtilization()
  let tokens = 0
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async (_, i) => {
      const turn = engine.generate(`prompt ${i}`, { maxGeneratedTokens: TOKENS_PER_TURN, ignoreEos: true })
      let text = ''
      for await (const chunk of turn) text += chunk.text
      const { usage } = await turn.done // awaited first: `tokens += await ...` would lose updates
      tokens += usage.generatedTokens
      if (text.length === 0) throw new Error('a turn streamed no text')
    }),
  )
  const seconds = (performance.now() - startedAt) / 1000
  return { tokensPerSecond: tokens / seconds, eventLoopUtilization: performance.eventLoopUtilization(elu).utilization }
}

/** One round against the OpenAI server: CONCURRENCY streamed chat completions. */
async function serverRound(url: string, model: string): Promise<Sample> {
  const startedAt = performance.now()
  const elu = performance.eventLoopUtilization()
  let tokens = 0
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async (_, i) => {
      const response = await fetch(`${url}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model, stream: true, max_tokens: TOKENS_PER_TURN / 4, messages: [{ role: 'user', content: `hi ${i}` }] }),
      })
      const body = await response.text()
      tokens += body.split('\n').filter((line) => line.startsWith('data: {') && line.includes('"content"')).length
    }),
  )
  const seconds = (performance.now() - startedAt) / 1000
  return { tokensPerSecond: tokens / seconds, eventLoopUtilization: performance.eventLoopUtilization(elu).utilization }
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.floor(sorted.length / 2)]!
}

function row(name: string, samples: Sample[]): string {
  const rate = median(samples.map((s) => s.tokensPerSecond))
  const elu = median(samples.map((s) => s.eventLoopUtilization))
  const each = samples.map((s) => Math.round(s.tokensPerSecond).toLocaleString('en-US')).join(', ')
  return `| ${name} | ${Math.round(rate).toLocaleString('en-US')} | ${(elu * 100).toFixed(0)}% | ${each} |`
}

async function main(): Promise<void> {
  const engines = { native: simulated(native), wasm: simulated(wasm) }
  const samples: Record<string, Sample[]> = { native: [], wasm: [], server: [] }
  await streamRound(engines.native) // warm-up
  await streamRound(engines.wasm)
  for (let round = 0; round < ROUNDS; round++) {
    samples.native!.push(await streamRound(engines.native))
    samples.wasm!.push(await streamRound(engines.wasm))
  }
  await Promise.all([engines.native.close(), engines.wasm.close()])

  const served = simulated(native)
  const server = await native.startServer(served, { port: 0 })
  await serverRound(server.url, server.modelName) // warm-up
  for (let round = 0; round < ROUNDS; round++) samples.server!.push(await serverRound(server.url, server.modelName))
  await server.close()
  await served.close()

  console.log(`${CONCURRENCY} concurrent turns, simulated model, medians of ${ROUNDS} rounds\n`)
  console.log('| path | tokens/s | event loop busy | rounds |')
  console.log('|---|---:|---:|---|')
  console.log(row('native, `for await` text', samples.native!))
  console.log(row('wasm, `for await` text', samples.wasm!))
  console.log(row('OpenAI server (native), streamed over HTTP', samples.server!))
  console.log("\nagainst issue 29's baseline (native 103k, wasm 137k tokens/s):")
  for (const path of ['native', 'wasm'] as const) {
    const ratio = median(samples[path]!.map((s) => s.tokensPerSecond)) / ISSUE_BASELINE[path]
    console.log(`  ${path}: ${ratio.toFixed(1)}x (goal ${GOAL[path]}x: ${ratio >= GOAL[path] ? 'met' : 'not met'})`)
  }
}

await main()
