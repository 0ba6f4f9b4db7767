// A small command around the reference loop, for bench/check_genai.py and manual checks:
//
//   npx esbuild test/reference/cli.ts --bundle --platform=node --format=esm \
//     --external:onnxruntime-node --outfile=.cache/reference-cli.mjs
//   node .cache/reference-cli.mjs MODEL_DIR [--tokens 1,2,3] [--text "..."] [--max-new 16] [--ignore-eos]
//
// Prints one JSON object: { tokens, prompt, encoded?, decoded? } where `tokens` are the greedy
// tokens of naiveGenerate for the prompt (--tokens, else the encoding of --text), `encoded` the
// JS tokenizer's encoding of --text, and `decoded` the JS decoding of the generated tokens.

import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { referenceGenerate } from './reference'
import { ByteLevelBpe } from '../../ts/modelkit/tokenizer'

async function main(argv: string[]): Promise<void> {
  const dir = argv[0]
  if (!dir || dir.startsWith('--')) throw new Error('usage: reference-cli MODEL_DIR [--tokens 1,2,3] [--text T] [--max-new N] [--ignore-eos]')
  let tokens: number[] | undefined
  let text: string | undefined
  let maxNew = 16
  let ignoreEos = false
  for (let i = 1; i < argv.length; i++) {
    const a = argv[i]
    if (a === '--tokens') tokens = argv[++i]!.split(',').filter(Boolean).map(Number)
    else if (a === '--text') text = argv[++i]
    else if (a === '--max-new') maxNew = Number(argv[++i])
    else if (a === '--ignore-eos') ignoreEos = true
    else throw new Error(`unknown argument ${a}`)
  }
  const tok = new ByteLevelBpe(readFileSync(join(dir, 'tokenizer.json'), 'utf8'))
  const encoded = text !== undefined ? tok.encode(text) : undefined
  const prompt = tokens ?? encoded
  if (!prompt || prompt.length === 0) throw new Error('give --tokens or a non-empty --text')
  const out = await referenceGenerate(dir, prompt, maxNew, { ignoreEos })
  process.stdout.write(JSON.stringify({ prompt, tokens: out, encoded, decoded: tok.decode(out) }) + '\n')
}

main(process.argv.slice(2)).catch((e: unknown) => {
  process.stderr.write(`reference-cli: ${(e as Error).message}\n`)
  process.exit(1)
})
