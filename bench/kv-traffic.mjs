// What a step moves between the host and the model, paged folder against past/present folder: the
// executor's counters (hostInputBytes, logitsBytes, kvCopiedBytes; docs/api.md) per step, for the
// same workload on two folders of the same weights, and whether their greedy tokens agree. On CUDA
// these bytes cross the bus; on the CPU they are copies (docs/performance.md, "The GPU path").
//
//   node dist/cli.js make-model --out bench/out/bench-paged --size bench --attention paged --paged-kernel reference --block-size 16
//   node dist/cli.js make-model --out bench/out/bench-gqa --size bench --attention gqa
//   node bench/kv-traffic.mjs bench/out/bench-paged bench/out/bench-gqa [--requests 16] [--tokens 32]
import { parseArgs } from 'node:util'
import { Engine } from '../dist/index.mjs'

const { positionals, values } = parseArgs({ allowPositionals: true, options: { requests: { type: 'string', default: '16' }, tokens: { type: 'string', default: '32' } } })
if (positionals.length !== 2) throw new Error('usage: node bench/kv-traffic.mjs PAGED_DIR OTHER_DIR [--requests N] [--tokens N]')
const PROMPT_LENGTHS = [32, 48, 24, 64, 40, 56, 16, 72]
const requests = Number(values.requests)
const prompts = Array.from({ length: requests }, (_, i) =>
  Array.from({ length: PROMPT_LENGTHS[i % PROMPT_LENGTHS.length] }, (_, j) => 259 + ((i * 31 + j * 7) % 2000)))

/** All requests at once; their greedy tokens and the executor's counters after. */
async function run(dir) {
  const engine = await Engine.load(dir, { executionProvider: 'cpu', blockSize: 16, intraOpThreads: 2 })
  try {
    const turns = prompts.map((p) => engine.generate(p, { maxGeneratedTokens: Number(values.tokens), ignoreEos: true }))
    const tokens = []
    for (const turn of turns) {
      const mine = []
      for await (const chunk of turn) mine.push(chunk.token)
      tokens.push(mine)
    }
    return { tokens, stats: engine.executorStats() }
  } finally {
    await engine.close()
  }
}

const results = []
for (const dir of positionals) {
  const { tokens, stats } = await run(dir)
  const per = (key) => Math.round(stats[key] / stats.steps)
  console.log(`${dir}: ${stats.steps} steps, ${stats.invocations} invocations; per step: host inputs ${per('hostInputBytes')} B, logits ${per('logitsBytes')} B, KV copied ${per('kvCopiedBytes')} B`)
  results.push(tokens.flat())
}
const same = results[0].filter((t, i) => t === results[1][i]).length
console.log(`greedy tokens equal: ${same} of ${results[0].length}`)
