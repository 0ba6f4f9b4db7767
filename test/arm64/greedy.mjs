// Greedy generation from a model folder: node greedy.mjs MODEL_DIR. Prints the tokens, the text
// and the ONNX Runtime library this process mapped, as one JSON line, so that two machines (x64,
// arm64 under emulation) can be compared on the same folder.
import { createRequire } from 'node:module'
import { Engine } from 'ortex'

const { mapped } = createRequire(import.meta.url)('./report.cjs')
const engine = await Engine.load(process.argv[2], { intraOpThreads: 1 })
const result = await engine.generate('The river starts', { maxGeneratedTokens: 24, ignoreEos: true }).done
await engine.close()
console.log(
  JSON.stringify({
    arch: process.arch,
    generated: result.usage.generatedTokens,
    tokens: Array.from(result.tokens),
    text: result.text,
    ort: mapped((f) => f.includes('libonnxruntime')),
  }),
)
