// Where a model step's time goes outside ONNX Runtime, by the way the engine is run: one engine over
// the folder, greedy requests with `ignoreEos`, the four ways taking turns request by request
// (order rotated). Per step it reports the wall time outside the executor (the JavaScript thread's
// side: commit, routing, the hand-off to the step thread and back, the driven loop, the stream)
// and the executor's own time outside the session run (inputs, gather, scatter, logits). See
// docs/performance.md.
//
//   runSync   the JavaScript thread executes the step itself (blocking)
//   run       `await engine.run(buffer)`: the step thread executes it
//   driven    `await engine.generate(...).done`: the driven loop, nobody iterating
//   streamed  `for await (const chunk of engine.generate(...))`: what a server does
//
//   node bench/step-overhead.mjs .cache/models/bench-gqa [--rounds 8] [--tokens 128] [--threads 2]
//
// Prints the medians and writes bench/out/step-overhead.json.
import { Engine } from '../dist/index.mjs'
import { PROMPT, median, parseModelArgs, writeReport } from './model-bench.mjs'

const { dir, values } = parseModelArgs('step-overhead.mjs', { rounds: '8', tokens: '128', threads: '2' })
const rounds = Number(values.rounds)
const tokens = Number(values.tokens)
const engine = await Engine.load(dir, { intraOpThreads: Number(values.threads), intraOpSpinning: true })
const prompt = engine.tokenize(PROMPT)
const turnOptions = { maxGeneratedTokens: tokens, ignoreEos: true }

async function callerDriven(blocking) {
  await engine.stop()
  const request = engine.createRequest()
  request.beginTurn(prompt, turnOptions)
  const buffer = engine.createEventBuffer(64)
  if (blocking) while (engine.hasPendingWork()) engine.runSync(buffer)
  else while (engine.hasPendingWork()) await engine.run(buffer)
  request.close()
}

const WAYS = {
  runSync: () => callerDriven(true),
  run: () => callerDriven(false),
  driven: () => engine.generate(prompt, turnOptions).done,
  streamed: async () => {
    for await (const _chunk of engine.generate(prompt, turnOptions)) {
      // streamed, as a server would
    }
  },
}

/** One request: per step, microseconds of wall time, in the session run, outside the executor, and
 *  inside it outside the run. */
async function measure(way) {
  const before = engine.executorStats()
  const started = performance.now()
  await WAYS[way]()
  const wallUs = (performance.now() - started) * 1000
  const after = engine.executorStats()
  const steps = after.steps - before.steps
  const executeUs = after.executeUs - before.executeUs
  const runUs = after.runUs - before.runUs
  return {
    wallUs: wallUs / steps,
    runUs: runUs / steps,
    outsideExecutorUs: (wallUs - executeUs) / steps,
    executorOutsideRunUs: (executeUs - runUs) / steps,
  }
}

const ways = Object.keys(WAYS)
for (const way of ways) await measure(way) // warm-ups
const results = Object.fromEntries(ways.map((way) => [way, []]))
for (let round = 0; round < rounds; round++) {
  for (let k = 0; k < ways.length; k++) {
    const way = ways[(round + k) % ways.length]
    results[way].push(await measure(way))
  }
}
await engine.close()

const summary = Object.fromEntries(
  ways.map((way) => [
    way,
    Object.fromEntries(Object.keys(results[way][0]).map((key) => [key, median(results[way].map((r) => r[key]))])),
  ]),
)
for (const way of ways) {
  const s = summary[way]
  console.log(
    `${way.padEnd(9)} wall ${s.wallUs.toFixed(0).padStart(5)} us/step, session run ${s.runUs.toFixed(0).padStart(5)}, ` +
      `outside the executor ${s.outsideExecutorUs.toFixed(0).padStart(4)}, ` +
      `executor outside the run ${s.executorOutsideRunUs.toFixed(0).padStart(3)}`,
  )
}
writeReport('step-overhead.json', { model: dir, rounds, tokens, threads: Number(values.threads), summary, results })
