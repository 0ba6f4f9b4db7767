// ortex's side of bench/model_coverage.py: greedy tokens of a model folder's prompts, three ways.
//
//   node bench/model-coverage-ortex.mjs SPEC.json
//
// SPEC: { "dir": model folder, "prompts": [[ids...], ...], "maxNew": n }. Prints one JSON line:
// { "ok": true, "alone": [[...]], "concurrent": [[...]], "chunked": [[...]], "kvPositionBytes": b }
// (alone: one request at a time; concurrent: every prompt at once, decodes batched; chunked: every
// prompt at once with maxScheduledTokens 4, so prompts prefill in chunks beside the decodes),
// or { "ok": false, "code", "error" } when the engine refuses the folder or fails.

import { readFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const { Engine } = require(join(dirname(fileURLToPath(import.meta.url)), '..', 'dist', 'index.js'))

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'))
const options = { maxGeneratedTokens: spec.maxNew, ignoreEos: true }

async function withEngine(engineOptions, f) {
  const engine = await Engine.load(spec.dir, { intraOpThreads: 2, ...engineOptions })
  try {
    return await f(engine)
  } finally {
    await engine.close()
  }
}

const tokens = async (turn) => Array.from((await turn.done).tokens)

try {
  const alone = []
  let kvPositionBytes = 0
  await withEngine({}, async (engine) => {
    for (const prompt of spec.prompts) alone.push(await tokens(engine.generate(prompt, options)))
    kvPositionBytes = engine.executorStats().kvPositionBytes
  })
  const all = (engine) => Promise.all(spec.prompts.map((prompt) => tokens(engine.generate(prompt, options))))
  const concurrent = await withEngine({}, all)
  const chunked = await withEngine({ maxScheduledTokens: 4 }, all)
  console.log(JSON.stringify({ ok: true, alone, concurrent, chunked, kvPositionBytes }))
} catch (error) {
  console.log(JSON.stringify({ ok: false, code: error.code ?? null, error: String(error.message ?? error) }))
}
