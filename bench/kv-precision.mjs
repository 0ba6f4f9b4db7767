// A float16 KV cache against its float32 twin: the KV memory each live token takes in the engine's
// paged store, and tokens per second, on two folders with the same weights (make-model's `--kv`).
// The runs alternate folder by folder (the order flips each pair), so a busy machine slows both.
//
//   node dist/cli.js make-model --out .cache/models/bench-gqa --size bench --attention gqa
//   node dist/cli.js make-model --out .cache/models/bench-gqa-fp16 --size bench --attention gqa --kv fp16
//   node bench/kv-precision.mjs .cache/models/bench-gqa --twin .cache/models/bench-gqa-fp16 \
//     [--concurrency 1,8] [--tokens 64] [--pairs 3] [--threads 2]
//
// Prints one line per (concurrency, folder) with the medians, and the fp16/fp32 ratios; writes
// bench/out/kv-precision.json. Recorded in docs/performance.md ("Float16 KV").
import { Engine } from '../dist/index.mjs'
import { PROMPT, median, parseModelArgs, writeReport } from './model-bench.mjs'

const { dir, values } = parseModelArgs('kv-precision.mjs', {
  twin: '',
  concurrency: '1,8',
  tokens: '64',
  pairs: '3',
  threads: '2',
})
if (!values.twin) {
  console.error('usage: give the float16 twin folder with --twin DIR')
  process.exit(2)
}
const folders = { fp32: dir, fp16: values.twin }

/** One closed batch of `concurrency` greedy generations; tokens/s and the executor's numbers. */
async function once(folder, concurrency, tokens, threads) {
  const engine = await Engine.load(folder, { intraOpThreads: threads, maxBatchSize: Math.max(16, concurrency) })
  try {
    const prompt = engine.tokenize(PROMPT)
    const started = performance.now()
    const turns = Array.from({ length: concurrency }, () => engine.generate(prompt, { maxGeneratedTokens: tokens, ignoreEos: true }))
    await Promise.all(turns.map((t) => t.done))
    const wallMs = performance.now() - started
    const stats = engine.executorStats()
    return {
      tokensPerSecond: (concurrency * tokens) / (wallMs / 1000),
      runUsPerStep: stats.runUs / stats.steps,
      kvPositionBytes: stats.kvPositionBytes,
      kvStoreBytes: stats.kvStoreBytes,
    }
  } finally {
    await engine.close()
  }
}

const threads = Number(values.threads)
const tokens = Number(values.tokens)
const report = { folders, tokens, threads, rows: [] }
for (const concurrency of values.concurrency.split(',').map(Number)) {
  const runs = { fp32: [], fp16: [] }
  for (let pair = 0; pair < Number(values.pairs); pair++) {
    const order = pair % 2 === 0 ? ['fp32', 'fp16'] : ['fp16', 'fp32']
    for (const kind of order) runs[kind].push(await once(folders[kind], concurrency, tokens, threads))
  }
  const summary = {}
  for (const kind of ['fp32', 'fp16']) {
    const r = runs[kind]
    summary[kind] = {
      tokensPerSecond: median(r.map((x) => x.tokensPerSecond)),
      runUsPerStep: median(r.map((x) => x.runUsPerStep)),
      kvPositionBytes: r[0].kvPositionBytes,
      kvStoreBytes: r[0].kvStoreBytes,
    }
    const s = summary[kind]
    console.log(
      `concurrency ${concurrency} ${kind}: ${s.tokensPerSecond.toFixed(1)} tok/s, session run ${(s.runUsPerStep / 1000).toFixed(2)} ms/step, ` +
        `KV ${s.kvPositionBytes} B per live token (${(s.kvStoreBytes / 2 ** 20).toFixed(0)} MiB store)`,
    )
  }
  const ratio = {
    tokensPerSecond: summary.fp16.tokensPerSecond / summary.fp32.tokensPerSecond,
    kvPositionBytes: summary.fp16.kvPositionBytes / summary.fp32.kvPositionBytes,
  }
  console.log(`concurrency ${concurrency} fp16/fp32: tokens/s x${ratio.tokensPerSecond.toFixed(2)}, KV per token x${ratio.kvPositionBytes.toFixed(2)}`)
  report.rows.push({ concurrency, ...summary, ratio, runs })
}
writeReport('kv-precision.json', report)
