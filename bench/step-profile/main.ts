// The batch-16 decode step of ortex and of onnxruntime-genai's Generator, operator by operator,
// from ONNX Runtime's own profiles (docs/performance.md, "The batch-16 step against
// onnxruntime-genai's"). Both run the throughput benchmark's 16 prompts, all arriving at once,
// greedy, on the same folder with the same threads; ortex's session profiles through
// ORTEX_ORT_PROFILE, genai's through its session option enable_profiling. Only the model runs
// whose query is [16, 1, hidden] (decode steps of all 16 rows) are compared.
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/step-profile/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --outfile=bench/out/step-profile.mjs && node bench/out/step-profile.mjs --model DIR \
//     [--genai-model DIR] [--python EXE] [--threads N] [--tokens N] [--rounds N] [--no-genai] [--out DIR]
// The systems take turns (ortex first in even rounds); each operator's row is the median over
// every full step of every round.
// Profiling adds a little time to every operator, the same on both sides: compare shares, not
// the throughput benchmark's tokens per second.
import { mkdirSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { Engine } from 'ortex'

import { GenaiProcess, readPadTokenId } from '../throughput/genai'
import { makeWorkload } from '../throughput/throughput'
import { type StepProfile, formatProfiles, mergeProfiles, readProfile } from './trace'

const root = fileURLToPath(new URL('../../', import.meta.url))
const { values } = parseArgs({
  options: {
    model: { type: 'string' },
    'genai-model': { type: 'string' },
    python: { type: 'string', default: 'python3' },
    threads: { type: 'string', default: '2' },
    tokens: { type: 'string', default: '64' },
    rounds: { type: 'string', default: '3' },
    'no-genai': { type: 'boolean' },
    out: { type: 'string', default: join(root, 'bench', 'out', 'step-profile') },
  },
})
if (values.model === undefined) {
  process.stderr.write('step-profile: --model DIR is required\n')
  process.exit(2)
}
const modelDir = resolve(values.model)
const genaiModelDir = resolve(values['genai-model'] ?? modelDir)
const threads = Number(values.threads)
const tokens = Number(values.tokens)
const rounds = Number(values.rounds)
const outDir = resolve(values.out!)
const BATCH = 16
const progress = (line: string) => process.stderr.write(`step-profile: ${line}\n`)

/** The newest file in `dir` whose name starts with `prefix` (ONNX Runtime appends the date). */
function traceFile(dir: string, prefix: string): string {
  const names = readdirSync(dir).filter((n) => n.startsWith(prefix) && n.endsWith('.json')).sort()
  if (names.length === 0) throw new Error(`no profile ${prefix}*.json was written in ${dir}`)
  return join(dir, names[names.length - 1]!)
}

async function profileOrtex(round: number): Promise<{ profile: StepProfile; prompts: number[][] }> {
  process.env.ORTEX_ORT_PROFILE = join(outDir, `ortex-${round}`)
  const engine = await Engine.load(modelDir, { maxBatchSize: BATCH, intraOpThreads: threads, intraOpSpinning: true })
  delete process.env.ORTEX_ORT_PROFILE
  const w = makeWorkload(modelDir, false, threads, (text) => engine.tokenize(text), [BATCH], 0)
  const prompts = Array.from({ length: BATCH }, (_, i) => w.prompts[i % w.prompts.length]!)
  progress(`ortex: ${BATCH} prompts at once, ${tokens} tokens each`)
  const turns = prompts.map((p) => engine.generate(p, { maxGeneratedTokens: tokens, ignoreEos: true }))
  await Promise.all(turns.map((t) => t.done))
  await engine.close()
  return { profile: readProfile(traceFile(outDir, `ortex-${round}`), BATCH), prompts }
}

async function profileGenai(prompts: number[][], round: number): Promise<StepProfile> {
  const started = await GenaiProcess.start(
    { root, python: values.python!, onProgress: progress },
    {
      modelDir: genaiModelDir,
      prompts,
      generatedTokens: tokens,
      staggerMs: 0,
      intraOpThreads: threads,
      maxBatchSize: BATCH,
      padTokenId: readPadTokenId(genaiModelDir),
      profilePrefix: join(outDir, `genai-${round}`),
    },
  )
  if (typeof started === 'string') throw new Error(`onnxruntime-genai: ${started}`)
  progress(`onnxruntime-genai Generator: the ${BATCH} prompts left-padded into one batch, ${tokens} tokens each`)
  await started.closedLoop('generator', BATCH, BATCH)
  await started.closeAndWait()
  return readProfile(traceFile(outDir, `genai-${round}`), BATCH)
}

async function main(): Promise<void> {
  rmSync(outDir, { recursive: true, force: true })
  mkdirSync(outDir, { recursive: true })
  const ortex: StepProfile[] = []
  const genai: StepProfile[] = []
  let prompts: number[][] | null = null
  for (let round = 0; round < rounds; round++) {
    const runOrtex = async () => {
      const run = await profileOrtex(round)
      ortex.push(run.profile)
      prompts = run.prompts
    }
    const runGenai = async () => {
      if (values['no-genai'] !== true) genai.push(await profileGenai(prompts!, round))
    }
    progress(`round ${round + 1} of ${rounds}`)
    if (round % 2 === 0 || prompts === null) await runOrtex().then(runGenai)
    else await runGenai().then(runOrtex)
  }
  const profiles: [string, StepProfile][] = [['ortex', mergeProfiles(ortex)]]
  if (genai.length > 0) profiles.push(['genai', mergeProfiles(genai)])
  const table = formatProfiles(profiles)
  writeFileSync(join(outDir, 'summary.md'), `${table}\n`)
  process.stdout.write(`${table}\n\nprofiles and summary.md in ${outDir}\n`)
}

main().catch((error: unknown) => {
  process.stderr.write(`step-profile: ${error instanceof Error ? error.stack : String(error)}\n`)
  process.exit(1)
})
