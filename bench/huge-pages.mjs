// What backing the model weights with transparent huge pages is worth (crates/ortex-ort/src/
// huge_pages.rs and weight_chunks.rs): two engines over the same folder in one process, one loaded
// without it, taking turns request by request (order alternating), each request a greedy streamed
// generation with `ignoreEos` (with --concurrency C, C of them at once). Paired ratios per
// request pair, medians reported. See docs/performance.md.
//
//   node dist/cli.js make-model --out .cache/models/bench-gqa --size bench --attention gqa
//   node bench/huge-pages.mjs .cache/models/bench-gqa [--off pages] [--pairs 16] [--tokens 128]
//     [--threads 2] [--concurrency 1]
//
// --off pages:  the baseline has no huge pages at all (ORTEX_HUGE_PAGES=0);
// --off chunks: the baseline keeps the collapse but not the 2 MiB-aligned weight chunks
//               (ORTEX_WEIGHT_CHUNKS=0), so only the aligned middles of glibc's blocks collapse.
// Prints the medians and writes bench/out/huge-pages-off-OFF-cC.json.
import { Engine } from '../dist/index.mjs'
import { PROMPT, median, mib, parseModelArgs, writeReport } from './model-bench.mjs'

const BASELINE_ENV = { pages: 'ORTEX_HUGE_PAGES', chunks: 'ORTEX_WEIGHT_CHUNKS' }
const { dir, values } = parseModelArgs('huge-pages.mjs', {
  off: 'pages',
  pairs: '16',
  tokens: '128',
  threads: '2',
  concurrency: '1',
})
const baselineEnv = BASELINE_ENV[values.off]
if (!baselineEnv) {
  console.error(`--off: one of ${Object.keys(BASELINE_ENV).join(', ')}`)
  process.exit(2)
}
const pairs = Number(values.pairs)
const tokens = Number(values.tokens)
const concurrency = Number(values.concurrency)
const options = { intraOpThreads: Number(values.threads), intraOpSpinning: true, maxBatchSize: Math.max(concurrency, 16) }

process.env[baselineEnv] = '0'
const baseline = await Engine.load(dir, options).finally(() => delete process.env[baselineEnv])
const huge = await Engine.load(dir, options)
const engines = { baseline, huge }
const prompt = huge.tokenize(PROMPT)

async function generate(engine) {
  for await (const _chunk of engine.generate(prompt, { maxGeneratedTokens: tokens, ignoreEos: true })) {
    // streamed, as a server would
  }
}

/** One request (or `concurrency` at once): wall ms per token and session-run ms per step. */
async function request(engine) {
  const before = engine.executorStats()
  const started = performance.now()
  await Promise.all(Array.from({ length: concurrency }, () => generate(engine)))
  const after = engine.executorStats()
  return {
    wallMsPerToken: (performance.now() - started) / (tokens * concurrency),
    runMsPerStep: (after.runUs - before.runUs) / 1000 / (after.steps - before.steps),
  }
}

await request(baseline) // warm-ups
await request(huge)
const results = { baseline: [], huge: [] }
for (let p = 0; p < pairs; p++) {
  for (const name of p % 2 === 0 ? ['baseline', 'huge'] : ['huge', 'baseline']) results[name].push(await request(engines[name]))
}
const ratio = (pick) => median(results.baseline.map((r, i) => pick(r) / pick(results.huge[i])))
const medians = (pick) => ({ baseline: median(results.baseline.map(pick)), huge: median(results.huge.map(pick)) })
const report = {
  model: dir,
  off: values.off,
  concurrency,
  pairs,
  tokens,
  hugePageBytes: { baseline: baseline.executorStats().hugePageBytes, huge: huge.executorStats().hugePageBytes },
  wallMsPerToken: medians((r) => r.wallMsPerToken),
  runMsPerStep: medians((r) => r.runMsPerStep),
  pairedRatioBaselineOverHuge: { wall: ratio((r) => r.wallMsPerToken), run: ratio((r) => r.runMsPerStep) },
}
const label = { baseline: `${values.off} off`, huge: 'default' }
for (const name of ['baseline', 'huge']) {
  console.log(
    `${label[name].padEnd(10)} ${mib(report.hugePageBytes[name]).padStart(4)} MiB on huge pages, ` +
      `${report.wallMsPerToken[name].toFixed(2)} ms/token wall, ${report.runMsPerStep[name].toFixed(2)} ms/step in the session run`,
  )
}
const paired = report.pairedRatioBaselineOverHuge
console.log(
  `paired (${label.baseline}) / default: wall ${paired.wall.toFixed(3)}, run ${paired.run.toFixed(3)} (${pairs} pairs, concurrency ${concurrency})`,
)
writeReport(`huge-pages-off-${values.off}-c${concurrency}.json`, report)
await baseline.close()
await huge.close()
