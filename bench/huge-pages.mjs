// What backing the model weights with transparent huge pages is worth (crates/ortex-ort/src/
// huge_pages.rs): two engines over the same folder in one process, one loaded with
// ORTEX_HUGE_PAGES=0, taking turns request by request (order alternating), each request a greedy
// streamed generation with `ignoreEos`. Paired ratios per request pair, medians reported. See
// docs/performance.md.
//
//   node dist/cli.js make-model --out .cache/models/bench-gqa --size bench --attention gqa
//   node bench/huge-pages.mjs .cache/models/bench-gqa [--pairs 16] [--tokens 128] [--threads 2]
//
// Prints the medians and writes bench/out/huge-pages.json.
import { mkdirSync, writeFileSync } from 'node:fs'
import { Engine } from '../dist/index.mjs'
import { PROMPT, median, parseModelArgs } from './model-bench.mjs'

const { dir, values } = parseModelArgs('huge-pages.mjs', { pairs: '16', tokens: '128', threads: '2' })
const pairs = Number(values.pairs)
const tokens = Number(values.tokens)
const options = { intraOpThreads: Number(values.threads), intraOpSpinning: true }

process.env.ORTEX_HUGE_PAGES = '0'
const small = await Engine.load(dir, options).finally(() => delete process.env.ORTEX_HUGE_PAGES)
const huge = await Engine.load(dir, options)
const engines = { '4k': small, huge }
const prompt = huge.tokenize(PROMPT)

/** One request: wall ms per token and session-run ms per step. */
async function request(engine) {
  const before = engine.executorStats()
  const started = performance.now()
  for await (const _chunk of engine.generate(prompt, { maxGeneratedTokens: tokens, ignoreEos: true })) {
    // streamed, as a server would
  }
  const after = engine.executorStats()
  return {
    wallMsPerToken: (performance.now() - started) / tokens,
    runMsPerStep: (after.runUs - before.runUs) / 1000 / (after.steps - before.steps),
  }
}

await request(small) // warm-ups
await request(huge)
const results = { '4k': [], huge: [] }
for (let p = 0; p < pairs; p++) {
  for (const name of p % 2 === 0 ? ['4k', 'huge'] : ['huge', '4k']) results[name].push(await request(engines[name]))
}
const ratio = (pick) => median(results['4k'].map((r, i) => pick(r) / pick(results.huge[i])))
const report = {
  model: dir,
  pairs,
  tokens,
  hugePageBytes: huge.executorStats().hugePageBytes,
  wallMsPerToken: { '4k': median(results['4k'].map((r) => r.wallMsPerToken)), huge: median(results.huge.map((r) => r.wallMsPerToken)) },
  runMsPerStep: { '4k': median(results['4k'].map((r) => r.runMsPerStep)), huge: median(results.huge.map((r) => r.runMsPerStep)) },
  pairedRatio4kOverHuge: { wall: ratio((r) => r.wallMsPerToken), run: ratio((r) => r.runMsPerStep) },
}
console.log(`huge pages: ${(report.hugePageBytes / 2 ** 20).toFixed(0)} MiB of the model collapsed at load`)
for (const name of ['4k', 'huge']) {
  console.log(`${name.padEnd(5)} ${report.wallMsPerToken[name].toFixed(2)} ms/token wall, ${report.runMsPerStep[name].toFixed(2)} ms/step in the session run`)
}
console.log(`paired 4k/huge: wall ${report.pairedRatio4kOverHuge.wall.toFixed(3)}, run ${report.pairedRatio4kOverHuge.run.toFixed(3)} (${pairs} pairs)`)
mkdirSync('bench/out', { recursive: true })
writeFileSync('bench/out/huge-pages.json', `${JSON.stringify(report, null, 2)}\n`)
await small.close()
await huge.close()
