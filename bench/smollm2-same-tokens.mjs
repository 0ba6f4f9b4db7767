// Whether ortex's import of SmolLM2 and onnxruntime-genai's own folder (bench/smollm2_genai.py) are
// the same model: greedy answers to a few chat prompts (the same ids on both sides, up to N tokens
// or EOS), ortex on one folder, onnxruntime-genai's Generator on the other, and where they first
// differ. Float32 folders should agree token for token; int4 ones were quantized differently (ortex
// maps the GGUF's Q4_1 blocks, the builder requantizes the dequantized weights), so they may part.
// EOS ends both: ortex's ignoreEos emits EOS and goes on, onnxruntime-genai's min_length masks it
// and takes the runner-up, so past an EOS the two would differ by construction.
//
//   node bench/smollm2-same-tokens.mjs ORTEX_DIR GENAI_DIR [--tokens 32] [--python EXE]
import { spawnSync } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { Engine } from '../dist/index.mjs'

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: { tokens: { type: 'string', default: '32' }, python: { type: 'string', default: 'python3' } },
})
if (positionals.length !== 2) {
  console.error('usage: node bench/smollm2-same-tokens.mjs ORTEX_DIR GENAI_DIR [--tokens N] [--python EXE]')
  process.exit(2)
}
const [ortexDir, genaiDir] = positionals
const n = Number(values.tokens)
const questions = ['What is the capital of France?', 'Write a haiku about the sea.', 'How do I reverse a list in Python?']

const engine = await Engine.load(ortexDir, { intraOpThreads: 2 })
const prompts = questions.map((q) => Array.from(engine.tokenize(`<|im_start|>user\n${q}<|im_end|>\n<|im_start|>assistant\n`)))
const ours = []
for (const prompt of prompts) {
  const done = await engine.generate(prompt, { maxGeneratedTokens: n }).done
  ours.push(Array.from(done.tokens))
}
await engine.close()

const script = `
import json, sys, numpy as np, onnxruntime_genai as og
spec = json.loads(sys.stdin.read())
model = og.Model(spec["dir"])
out = []
for p in spec["prompts"]:
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(p) + spec["n"])
    g = og.Generator(model, params)
    g.append_tokens(np.array([p], np.int32))
    toks = []
    while not g.is_done():
        g.generate_next_token()
        toks.append(int(g.get_next_tokens()[0]))
    out.append(toks)
print(json.dumps(out))
`
const child = spawnSync(values.python, ['-c', script], {
  input: JSON.stringify({ dir: genaiDir, prompts, n }),
  encoding: 'utf8',
  maxBuffer: 1 << 24,
})
if (child.status !== 0) {
  console.error(child.stderr)
  process.exit(1)
}
const theirs = JSON.parse(child.stdout.trim().split('\n').pop())
// Both end with the EOS when they stop on it; compared without it.
const eos = JSON.parse(readFileSync(join(ortexDir, 'genai_config.json'), 'utf8')).model.eos_token_id
const eosIds = new Set(Array.isArray(eos) ? eos : [eos])
for (const list of [...ours, ...theirs]) if (eosIds.has(list[list.length - 1])) list.pop()
let same = 0
questions.forEach((q, i) => {
  const a = ours[i]
  const b = theirs[i]
  let first = a.findIndex((t, k) => t !== b[k])
  if (first === -1 && a.length !== b.length) first = a.length
  if (first === -1) same++
  console.log(
    `${JSON.stringify(q)}: ${first === -1 ? `the same ${a.length} tokens` : `first difference at token ${first} (ortex ${a.length}, genai ${b.length} tokens)`}`,
  )
})
console.log(`${same} of ${questions.length} prompts: the same greedy tokens from ortex (${ortexDir}) and onnxruntime-genai (${genaiDir})`)
