// 16 concurrent streaming chat completions through the OpenAI-compatible HTTP server against the
// same workload in-process (engine.chat, streamed with for await), on one model folder and one
// engine. Rounds alternate which side goes first; each round's ratio is HTTP tokens/s over
// in-process tokens/s, and the report is their median (the goal: the server costs at most 5%).
// The HTTP client runs in a child process (bench/chat-server-client.mjs). Each side also reports
// this process's CPU time per generated token (process.cpuUsage: the JS thread and ONNX Runtime's
// threads together), which a shared, noisy machine disturbs less than wall time.
//
//   node bench/chat-server.mjs MODEL_DIR [--streams 16] [--tokens 64] [--rounds 5] [--threads 2]
//
// MODEL_DIR `simulated`: the simulated model at zero cost, where the model takes no time and the
// ratio is the server's whole per-token cost against the facade's (a worst case, not the goal).
import { fork } from 'node:child_process'
import { Engine, startServer } from '../dist/index.mjs'
import { median, parseModelArgs, writeReport } from './model-bench.mjs'

const { dir, values } = parseModelArgs('chat-server.mjs', { streams: '16', tokens: '64', rounds: '5', threads: '2' })
const streams = Number(values.streams)
const maxTokens = Number(values.tokens)
const rounds = Number(values.rounds)
const TOPICS = ['rivers', 'mountains', 'the sea', 'bread', 'trains', 'bees', 'glass', 'clocks', 'maps', 'salt', 'paper', 'bridges', 'wind', 'lamps', 'stone', 'ice']
const prompts = Array.from({ length: streams }, (_, i) => `Write a short paragraph about ${TOPICS[i % TOPICS.length]}.`)

const maxBatchSize = Math.max(16, streams)
const engine =
  dir === 'simulated'
    ? Engine.simulated({ seed: 1, maxBatchSize })
    : await Engine.load(dir, { intraOpThreads: Number(values.threads), maxBatchSize })
const server = await startServer(engine, { port: 0 })
const client = fork(new URL('./chat-server-client.mjs', import.meta.url))

function overHttp() {
  return new Promise((resolve) => {
    client.once('message', resolve)
    client.send({ url: server.url, model: server.modelName, prompts, maxTokens })
  })
}

async function inProcess() {
  const start = performance.now()
  const ttftMs = []
  const counts = await Promise.all(
    prompts.map(async (content) => {
      const begun = performance.now()
      const turn = engine.chat([{ role: 'user', content }], { maxGeneratedTokens: maxTokens })
      let first = true
      for await (const chunk of turn) {
        void chunk
        if (first) ttftMs.push(performance.now() - begun)
        first = false
      }
      return (await turn.done).usage.generatedTokens
    }),
  )
  return { seconds: (performance.now() - start) / 1000, tokens: counts.reduce((a, b) => a + b, 0), ttftMs }
}

await inProcess() // warm-up: both paths once
await overHttp()
const rows = []
for (let round = 0; round < rounds; round++) {
  const order = round % 2 === 0 ? ['in-process', 'http'] : ['http', 'in-process']
  const row = { round }
  for (const side of order) {
    const cpu = process.cpuUsage()
    row[side] = side === 'http' ? await overHttp() : await inProcess()
    const used = process.cpuUsage(cpu)
    row[side].cpuUsPerToken = (used.user + used.system) / row[side].tokens
  }
  row.ratio = row.http.tokens / row.http.seconds / (row['in-process'].tokens / row['in-process'].seconds)
  rows.push(row)
  const rate = (r) => (r.tokens / r.seconds).toFixed(1)
  console.log(
    `round ${round}: in-process ${rate(row['in-process'])} tok/s (${row['in-process'].tokens} tokens), ` +
      `http ${rate(row.http)} tok/s (${row.http.tokens} tokens), ratio ${row.ratio.toFixed(3)}; ` +
      `CPU per token ${row['in-process'].cpuUsPerToken.toFixed(0)} vs ${row.http.cpuUsPerToken.toFixed(0)} us`,
  )
}
const ratios = rows.map((r) => r.ratio)
const report = {
  model: dir,
  streams,
  maxTokens,
  rounds,
  threads: Number(values.threads),
  medianRatio: median(ratios),
  minRatio: Math.min(...ratios),
  maxRatio: Math.max(...ratios),
  medianInProcessTokensPerS: median(rows.map((r) => r['in-process'].tokens / r['in-process'].seconds)),
  medianHttpTokensPerS: median(rows.map((r) => r.http.tokens / r.http.seconds)),
  medianCpuRatio: median(rows.map((r) => r.http.cpuUsPerToken / r['in-process'].cpuUsPerToken)),
  rows,
}
console.log(
  `median http/in-process tokens/s: ${report.medianRatio.toFixed(3)} (range ${report.minRatio.toFixed(3)}..${report.maxRatio.toFixed(3)}); ` +
    `server cost ${((1 - report.medianRatio) * 100).toFixed(1)}% (goal: at most 5%); ` +
    `median CPU per token http/in-process: ${report.medianCpuRatio.toFixed(3)}`,
)
writeReport('chat-server.json', report)
client.kill()
await server.close()
await engine.close()
