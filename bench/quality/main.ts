// Faithfulness of ortex's imports of SmolLM2-135M-Instruct's Q4_1 file, and of llama.cpp on that
// file, measured as llama.cpp's users measure quantizations (`llama-perplexity --kl-divergence`):
// against the float32 import with a float32 KV cache, over a fixed text, per position the
// KL divergence of the next-token distribution (nats, the whole vocabulary), whether the most likely
// token agrees, and each system's perplexity of the text (issue 33).
//
// The text is bench/quality/text.md: safer-buffer 2.1.2's Porting-Buffer.md (MIT, notice in
// bench/quality/text.LICENSE), technical English with code, 2,030 tokens. Every system gets
// the same ids (ortex's tokenizer) in chunks of --chunk tokens, the past carried between chunks
// (evaluate.ts). The variants (variants.ts) are imported once into ~/.cache/ortex/quality/. Then
// each folder and llama.cpp answer three chat questions greedily (answers.ts).
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/quality/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --external:node-llama-cpp --external:yauzl \
//     --outfile=bench/out/quality.mjs && node bench/out/quality.mjs
// Prints the markdown table and the answers; writes OUT/quality.json. About 3-7 minutes on 2 shared
// cores, most of it llama.cpp's pass.

import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'

import { smolLM2Gguf } from '../../ts/modelkit/real-model'
import { type Answer, QUESTIONS, engineAnswers, llamaCppAnswers, promptIds } from './answers'
import { type EvaluateInfo, type EvaluateOptions, type OnChunk, evaluateFolder, evaluateLlamaCpp } from './evaluate'
import { Comparison, type QualitySummary, type Reference, referenceOf } from './metrics'
import { formatAnswers, formatTable, kl } from './report'
import { VARIANTS, type Variant, variantFolder } from './variants'

const HELP = `Usage: node bench/out/quality.mjs [options]

Mean and p99 KL divergence (nats) of the next-token distribution, top-1 agreement and perplexity
of SmolLM2-135M-Instruct's ortex imports (fp32/int4 weights, fp32/fp16 KV, int8/fp32 activations)
and of llama.cpp (node-llama-cpp) on the same Q4_1 file, against the fp32 import with fp32 KV, over
bench/quality/text.md; then each one's greedy answers to ${QUESTIONS.length} chat questions.

Options:
  --chunk N        tokens per model run, the past carried between runs (default 256)
  --threads N      threads per runtime (default 2)
  --answer-tokens N  greedy tokens per answer at most (default 30)
  --no-llama-cpp   skip llama.cpp
  --out DIR        where to write quality.json (default: bench/out)
  -h, --help       show this help
`

/** The repository: the bundle is bench/out/quality.mjs. */
const ROOT = fileURLToPath(new URL('../../', import.meta.url))
const TEXT = join(ROOT, 'bench', 'quality', 'text.md')

interface Args {
  evaluate: EvaluateOptions
  answerTokens: number
  llamaCpp: boolean
  out: string
}

class UsageError extends Error {}

function parse(argv: string[]): Args | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      chunk: { type: 'string' },
      threads: { type: 'string' },
      'answer-tokens': { type: 'string' },
      'no-llama-cpp': { type: 'boolean' },
      out: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  return {
    evaluate: { chunk: integer('chunk', values.chunk, 256, 1, 4096), threads: integer('threads', values.threads, 2, 1, 256) },
    answerTokens: integer('answer-tokens', values['answer-tokens'], 30, 1, 200),
    llamaCpp: values['no-llama-cpp'] !== true,
    out: values.out ?? join(ROOT, 'bench', 'out'),
  }
}

function integer(name: string, value: string | undefined, fallback: number, min: number, max: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!/^\d+$/.test(value) || n < min || n > max) throw new UsageError(`--${name} must be an integer in [${min}, ${max}], got ${JSON.stringify(value)}`)
  return n
}

const started = Date.now()
const progress = (line: string) => process.stderr.write(`quality ${((Date.now() - started) / 1000).toFixed(0).padStart(4)}s  ${line}\n`)

/** One row of the table: a system's numbers against the reference. */
export interface QualityRow {
  id: string
  label: string
  summary: QualitySummary
  evaluate: EvaluateInfo
  answers: Answer[]
}

export interface QualityReport {
  date: string
  command: string
  text: { file: string; characters: number; tokens: number; scoredPositions: number }
  chunk: number
  threads: number
  cpu: string
  rows: QualityRow[]
  elapsedS: number
}

/** The reference pass: its log-probabilities kept whole (positions x vocab float32), its own row. */
async function referencePass(dir: string, tokens: number[], o: EvaluateOptions): Promise<{ reference: Reference; summary: QualitySummary; info: EvaluateInfo }> {
  const positions = tokens.length - 1
  let all: Float32Array | null = null
  const own = new Comparison(null, tokens, positions)
  const info = await evaluateFolder(dir, tokens, o, (start, logProbs, vocab) => {
    all ??= new Float32Array(positions * vocab)
    const n = Math.min(logProbs.length / vocab, positions - start)
    all.set(logProbs.subarray(0, n * vocab), start * vocab)
    own.add(start, logProbs, vocab)
  })
  return { reference: referenceOf(all!, info.vocab), summary: own.summary(), info }
}

async function variantPass(run: (onChunk: OnChunk) => Promise<EvaluateInfo>, reference: Reference, tokens: number[]): Promise<{ summary: QualitySummary; info: EvaluateInfo }> {
  const comparison = new Comparison(reference, tokens, tokens.length - 1)
  const info = await run((start, logProbs, vocab) => {
    if (vocab !== reference.vocab) throw new Error(`a vocabulary of ${vocab} tokens against the reference's ${reference.vocab}`)
    comparison.add(start, logProbs, vocab)
  })
  return { summary: comparison.summary(), info }
}

const describe = (s: QualitySummary) =>
  `mean KL ${kl(s.meanKl)}, p99 KL ${kl(s.p99Kl)}, top-1 ${(100 * s.top1Agreement).toFixed(2)}%, perplexity ${s.perplexity.toFixed(3)}`

async function main(args: Args): Promise<void> {
  const gguf = await smolLM2Gguf()
  const folders = new Map<Variant, string>()
  for (const v of VARIANTS) folders.set(v, await variantFolder(gguf, v, progress))
  const text = readFileSync(TEXT, 'utf8')
  const [referenceVariant, ...others] = VARIANTS
  const referenceDir = folders.get(referenceVariant!)!
  const { Engine } = await import('ortex')
  const tokenizer = await Engine.load(referenceDir, { intraOpThreads: 1 })
  const tokens = Array.from(tokenizer.tokenize(text))
  await tokenizer.close()
  progress(`${TEXT}: ${text.length} characters, ${tokens.length} tokens, ${tokens.length - 1} positions scored, chunks of ${args.evaluate.chunk}`)

  const prompts = await promptIds(referenceDir)
  const rows: QualityRow[] = []
  const ref = await referencePass(referenceDir, tokens, args.evaluate)
  progress(`${referenceVariant!.id}: ${describe(ref.summary)} (${ref.info.seconds.toFixed(1)} s)`)
  rows.push({ id: referenceVariant!.id, label: referenceVariant!.label, summary: ref.summary, evaluate: ref.info, answers: await engineAnswers(referenceDir, prompts, args.answerTokens, args.evaluate.threads) })
  for (const v of others) {
    const dir = folders.get(v)!
    const got = await variantPass((onChunk) => evaluateFolder(dir, tokens, args.evaluate, onChunk), ref.reference, tokens)
    progress(`${v.id}: ${describe(got.summary)} (${got.info.seconds.toFixed(1)} s)`)
    rows.push({ id: v.id, label: v.label, summary: got.summary, evaluate: got.info, answers: await engineAnswers(dir, prompts, args.answerTokens, args.evaluate.threads) })
  }
  if (args.llamaCpp) {
    const got = await variantPass((onChunk) => evaluateLlamaCpp(gguf, tokens, ref.reference.vocab, args.evaluate, onChunk), ref.reference, tokens)
    progress(`llama.cpp: ${describe(got.summary)} (${got.info.seconds.toFixed(1)} s)`)
    const label = `llama.cpp on the Q4_1 file (${String(got.info.runtime.kvCacheType)} KV)`
    rows.push({ id: 'llama.cpp', label, summary: got.summary, evaluate: got.info, answers: await llamaCppAnswers(gguf, prompts, args.answerTokens, args.evaluate.threads) })
  }

  const report: QualityReport = {
    date: new Date().toISOString(),
    command: `node bench/out/quality.mjs ${process.argv.slice(2).join(' ')}`.trim(),
    text: { file: 'bench/quality/text.md', characters: text.length, tokens: tokens.length, scoredPositions: tokens.length - 1 },
    chunk: args.evaluate.chunk,
    threads: args.evaluate.threads,
    cpu: os.cpus()[0]?.model ?? 'unknown',
    rows,
    elapsedS: (Date.now() - started) / 1000,
  }
  process.stdout.write(`${formatTable(report)}\n\n${formatAnswers(report)}\n`)
  mkdirSync(args.out, { recursive: true })
  writeFileSync(join(args.out, 'quality.json'), `${JSON.stringify(report, null, 2)}\n`)
  progress(`wrote ${join(args.out, 'quality.json')}`)
}

try {
  const args = parse(process.argv.slice(2))
  if (args === 'help') process.stdout.write(HELP)
  else await main(args)
} catch (error) {
  if (error instanceof UsageError || (error as NodeJS.ErrnoException).code?.startsWith('ERR_PARSE_ARGS')) {
    process.stderr.write(`quality: ${(error as Error).message}\n`)
    process.exit(2)
  }
  throw error
}
