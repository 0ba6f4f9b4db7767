// The GPU benchmark (issue 32, item 5): ortex, Hugging Face transformers and onnxruntime-genai on the
// same model folders, the same prompts as token ids, greedy, EOS ignored, at concurrency 1, 16, 64
// and 256. bench/gpu/run.sh runs it (bench/gpu/README.md: on the H200 through the device kit, and
// the CPU dry run); the bundle is bench/out/gpu-bench.mjs:
//   npx esbuild bench/gpu/main.ts --bundle --platform=node --format=esm --external:ortex --external:onnxruntime-node --outfile=bench/out/gpu-bench.mjs
// Systems run one after another (ortex, then transformers, then onnxruntime-genai, per model), each
// in its own process but ortex, so each one's device memory is its own; every row is printed as it
// comes and the report so far is written after each phase, so a run cut short still says something.

import { spawnSync } from 'node:child_process'
import { mkdirSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { basename, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import { Engine } from 'ortex'

import { readPadTokenId } from '../throughput/genai'
import { PROMPT_TEXT } from '../throughput/throughput'
import { FOLDER_FORMS, type FolderForm, folderBlockSize, formFixesBlockSize, type ModelSource, prepareModel } from './models'
import { type GpuEngineClass, type GpuEngineOptions, type GpuWorkload, firstTokens, runOrtexConcurrency } from './ortex'
import { BLOCK_SIZE_CONCURRENCIES, CORRECTNESS_PROMPTS, CORRECTNESS_TOKENS, blockSizePhase, correctnessPhase } from './phases'
import { gpuMemoryProbe, runPythonPhase } from './python'
import { type GpuReport, type GpuRow, type GpuSystem, type ModelEntry, agreementOf, computeGoals, correctnessGoals, formatReport, goalModel } from './report'

const HELP = `Usage: bash bench/gpu/run.sh [--quick] [--provider cuda|cpu] [options]

ortex, transformers (static cache) and onnxruntime-genai on the same folders at concurrency 1, 16, 64
and 256: tokens/s, TTFT and ITL p50/p99, device memory, bytes moved per step, and issue 32's goals.

Options:
  --provider P     cuda (default) or cpu (the dry run: not GPU numbers)
  --quick          16 tokens per request, 2 requests at concurrency 1 (the CPU check)
  --form F         the folder form: ${FOLDER_FORMS.join(', ')} (default: paged-fp16 on cuda, gqa-fp32 on cpu;
                   a form the CLI cannot make falls back to gqa-fp32 with a note)
  --size S         the made model: bench (default; the goals are stated for it) or tiny
  --model DIR      an existing folder instead of a made one (named after its directory)
  --gguf FILE      also SmolLM2 (or another Llama GGUF), imported with 'ortex import' in the form
  --no-made        only the --model / --gguf folders
  --concurrency L  a comma-separated list (default 1,16,64,256)
  --tokens N       generated tokens per request (default 128; --quick 16)
  --budget-s S     seconds for the whole run (default 270 on cuda, none on cpu): each phase gets a
                   share and skips a concurrency it estimates will not fit
  --no-hf, --no-genai   leave a system out
  --block-sizes L  KV block sizes to compare at concurrency 1 and 64, on the first model (default
                   256,16 on cuda, none on cpu; 'none' for none): a paged folder is made per block
                   size (make-model --block-size), other forms take it as the engine's option
  --no-correctness leave out the teacher-forced agreement with the CPU (on the first model's
                   gqa fp32 folder: ${CORRECTNESS_PROMPTS} prompts x ${CORRECTNESS_TOKENS} tokens, --quick 16)
  --genai-mode M   engine (default: og.Engine, dynamic batching on a paged folder, else static) or
                   generator (og.Generator, batch-of-prompts)
  --hf-compile     let transformers compile its static-cache forward (minutes per batch shape)
  --threads N      intra-op threads on the cpu (default 2)
  --python EXE     the Python of transformers (default python3); --genai-python EXE for genai
  --out DIR        where gpu-bench.json, gpu-bench.md and the workloads go (default bench/out/gpu;
                   on the device $OUT, so that they come back)
  --models DIR     where the made and imported folders go (default bench/out/gpu-models; reused)
`

interface Args {
  provider: 'cpu' | 'cuda'
  quick: boolean
  form: FolderForm
  sources: ModelSource[]
  concurrencies: number[]
  tokens: number
  budgetS: number
  hf: boolean
  genai: boolean
  hfCompile: boolean
  blockSizes: number[]
  correctness: boolean
  genaiMode: 'engine' | 'generator'
  threads: number
  python: string
  genaiPython: string
  out: string
  modelsDir: string
}

class UsageError extends Error {}

function parse(argv: string[]): Args | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      provider: { type: 'string' },
      quick: { type: 'boolean' },
      form: { type: 'string' },
      size: { type: 'string' },
      model: { type: 'string' },
      gguf: { type: 'string' },
      'no-made': { type: 'boolean' },
      concurrency: { type: 'string' },
      tokens: { type: 'string' },
      'budget-s': { type: 'string' },
      'no-hf': { type: 'boolean' },
      'no-genai': { type: 'boolean' },
      'hf-compile': { type: 'boolean' },
      'block-sizes': { type: 'string' },
      'no-correctness': { type: 'boolean' },
      'genai-mode': { type: 'string' },
      threads: { type: 'string' },
      python: { type: 'string' },
      'genai-python': { type: 'string' },
      out: { type: 'string' },
      models: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  const provider = values.provider ?? 'cuda'
  if (provider !== 'cpu' && provider !== 'cuda') throw new UsageError(`--provider must be cpu or cuda, got ${provider}`)
  const form = (values.form ?? (provider === 'cuda' ? 'paged-fp16' : 'gqa-fp32')) as FolderForm
  if (!FOLDER_FORMS.includes(form)) throw new UsageError(`--form must be one of ${FOLDER_FORMS.join(', ')}`)
  const size = values.size ?? 'bench'
  if (size !== 'bench' && size !== 'tiny') throw new UsageError('--size must be bench or tiny')
  const integer = (name: string, value: string | undefined, fallback: number): number => {
    if (value === undefined) return fallback
    if (!/^\d+$/.test(value)) throw new UsageError(`--${name} must be a non-negative integer, got ${value}`)
    return Number(value)
  }
  const quick = values.quick === true
  const sources: ModelSource[] = []
  if (values['no-made'] !== true) sources.push({ name: size, kind: { make: size } })
  if (values.model !== undefined) sources.push({ name: basename(resolve(values.model)), kind: { folder: resolve(values.model) } })
  if (values.gguf !== undefined) sources.push({ name: 'smollm2', kind: { gguf: resolve(values.gguf) } })
  if (sources.length === 0) throw new UsageError('no model: leave out --no-made, or give --model or --gguf')
  const concurrencies = (values.concurrency ?? '1,16,64,256').split(',').map((c) => integer('concurrency', c.trim(), 1))
  if (concurrencies.some((c) => c < 1)) throw new UsageError('--concurrency values must be at least 1')
  const blockSizesText = values['block-sizes'] ?? (provider === 'cuda' ? '256,16' : 'none')
  const blockSizes = blockSizesText === 'none' ? [] : blockSizesText.split(',').map((b) => integer('block-sizes', b.trim(), 16))
  if (blockSizes.some((b) => b < 1)) throw new UsageError('--block-sizes values must be at least 1')
  const python = values.python ?? 'python3'
  const genaiMode = values['genai-mode'] ?? 'engine'
  if (genaiMode !== 'engine' && genaiMode !== 'generator') throw new UsageError('--genai-mode must be engine or generator')
  return {
    provider,
    quick,
    form,
    sources,
    concurrencies,
    tokens: integer('tokens', values.tokens, quick ? 16 : 128),
    budgetS: integer('budget-s', values['budget-s'], provider === 'cuda' ? 270 : 0),
    hf: values['no-hf'] !== true,
    genai: values['no-genai'] !== true,
    hfCompile: values['hf-compile'] === true,
    blockSizes,
    correctness: values['no-correctness'] !== true,
    genaiMode,
    threads: integer('threads', values.threads, 2),
    python,
    genaiPython: values['genai-python'] ?? python,
    out: resolve(values.out ?? join('bench', 'out', 'gpu')),
    modelsDir: resolve(values.models ?? join('bench', 'out', 'gpu-models')),
  }
}

/** Prompt lengths, cycled by request index (bench/throughput's, without its longest). */
const PROMPT_LENGTHS = [32, 48, 24, 64, 40, 56, 16, 72]
const BLOCK_SIZE = 16

function workloadFor(ids: number[], args: Args, padTokenId: number, blockSize: number): GpuWorkload {
  const prompts = PROMPT_LENGTHS.map((length, i) => ids.slice(i * 7, i * 7 + length))
  if (prompts.some((p, i) => p.length !== PROMPT_LENGTHS[i])) throw new Error('the prompt text is too short for the tokenizer')
  const requestsByConcurrency = Object.fromEntries(args.concurrencies.map((c) => [String(c), c === 1 ? (args.quick ? 2 : 4) : c]))
  const largest = Math.max(...args.concurrencies)
  const longest = Math.max(...PROMPT_LENGTHS) + args.tokens
  return {
    prompts,
    promptLengths: PROMPT_LENGTHS,
    generatedTokens: args.tokens,
    concurrencies: args.concurrencies,
    requestsByConcurrency,
    padTokenId,
    // every request of the largest concurrency resident at once, plus a block each of slack
    numBlocks: largest * (Math.ceil(longest / blockSize) + 1),
    blockSize,
    threads: args.threads,
  }
}

/** Budget weights: a system's phase (every concurrency) counts 1; the extra ortex phases on the
 *  first model are shorter (correctness: two loads and a few hundred tokens; block sizes: a load
 *  and two concurrencies per block size not already measured). */
const PHASE_WEIGHT = { system: 1, correctness: 0.4, blockSizes: 0.6 } as const

/** The deadline arithmetic: each phase gets its weight's share of what is left. */
class Budget {
  private readonly end: number | null
  constructor(
    seconds: number,
    private weightLeft: number,
  ) {
    this.end = seconds > 0 ? performance.now() + seconds * 1000 : null
  }
  /** Seconds for the next phase (0: no budget). */
  nextPhase(weight: number = PHASE_WEIGHT.system): number {
    if (this.end === null) return 0
    const share = Math.max(10, ((this.end - performance.now()) / 1000) * (weight / Math.max(weight, this.weightLeft)))
    this.weightLeft -= weight
    return share
  }
}

function progressWriter(): (line: string) => void {
  const started = performance.now()
  return (line) => process.stderr.write(`gpu-bench ${((performance.now() - started) / 1000).toFixed(0).padStart(4)}s  ${line}\n`)
}

function rowLine(row: GpuRow): string {
  if (row.error !== undefined) return `${row.model} ${row.system} c${row.concurrency}: ${row.error}`
  const p = (v: number | null | undefined, d = 1) => (v === null || v === undefined ? 'n/a' : v.toFixed(d))
  return (
    `${row.model} ${row.system} c${row.concurrency}: ${p(row.tokensPerSecond)} tokens/s, TTFT p50 ${p(row.ttftMs?.p50)} ms, ` +
    `ITL p50 ${p(row.itlMs?.p50, 2)} ms p99 ${p(row.itlMs?.p99, 2)} ms, GPU ${p(row.gpuMemoryMb, 0)} MiB`
  )
}

async function main(argv: string[]): Promise<void> {
  const args = parse(argv)
  if (args === 'help') {
    process.stdout.write(HELP)
    return
  }
  const started = performance.now()
  const root = fileURLToPath(new URL('../../', import.meta.url)) // bench/out/gpu-bench.mjs -> the repository
  const progress = progressWriter()
  const gpuMemory = args.provider === 'cuda' ? gpuMemoryProbe(args.python) : () => null
  mkdirSync(args.out, { recursive: true })
  const report: GpuReport = {
    createdAt: new Date().toISOString(),
    quick: args.quick,
    provider: args.provider,
    machine: { gpu: null, cpus: os.cpus().length, node: process.version },
    models: [],
    workload: { concurrencies: args.concurrencies, generatedTokens: args.tokens, promptLengths: PROMPT_LENGTHS, requestsByConcurrency: {} },
    systems: {},
    rows: [],
    agreement: [],
    correctness: [],
    blockSizes: [],
    goals: [],
    elapsedS: 0,
  }
  const save = () => {
    const on = goalModel(report.models)
    report.goals = [...computeGoals(report.rows, args.concurrencies, on), ...correctnessGoals(report, on)]
    report.elapsedS = (performance.now() - started) / 1000
    writeFileSync(join(args.out, 'gpu-bench.json'), `${JSON.stringify(report, null, 2)}\n`)
    writeFileSync(join(args.out, 'gpu-bench.md'), `${formatReport(report)}\n`)
  }
  const addRow = (row: GpuRow) => {
    report.rows.push(row)
    progress(rowLine(row))
  }
  if (args.provider === 'cpu') progress('CPU DRY RUN: the numbers check that the benchmark runs; they are not the GPU result')
  const phasesPerModel = 1 + (args.hf ? 1 : 0) + (args.genai ? 1 : 0)
  const extraWeight = (args.correctness ? PHASE_WEIGHT.correctness : 0) + (args.blockSizes.length > 0 ? PHASE_WEIGHT.blockSizes : 0)
  const budget = new Budget(args.budgetS, phasesPerModel * args.sources.length * PHASE_WEIGHT.system + extraWeight)
  const firsts = new Map<string, number[]>()
  for (const source of args.sources) {
    let model
    try {
      model = prepareModel(root, args.modelsDir, source, args.form, progress)
    } catch (error) {
      progress(`${source.name}: no folder: ${(error as Error).message}`)
      continue
    }
    report.models.push(model)
    report.systems[model.name] = {}
    const systems = report.systems[model.name]!
    const ortexShare = budget.nextPhase()
    const workload = await ortexPhase(model.name, model.dir, args, ortexShare, progress, gpuMemory, addRow, systems, firsts)
    report.workload.requestsByConcurrency = workload?.requestsByConcurrency ?? {}
    save()
    if (workload === null) continue
    if (source === args.sources[0]) {
      if (args.correctness) await correctness(root, source, model.name, workload, args, budget.nextPhase(PHASE_WEIGHT.correctness), progress, report, save)
      if (args.blockSizes.length > 0) await blockSizes(root, source, model, workload, args, budget.nextPhase(PHASE_WEIGHT.blockSizes), progress, report, save)
    }
    const workloadFile = join(args.out, `workload-${model.name}.json`)
    writeFileSync(workloadFile, JSON.stringify(workload))
    // The device has no network: a missing package must fail at once there, not make the scripts
    // create a virtual environment with pip (bench/genai_venv.py's marker says "already tried").
    const offline: NodeJS.ProcessEnv = args.provider === 'cuda' ? { ...process.env, ORTEX_BENCH_VENV_REEXEC: '1' } : process.env
    const python = (system: Exclude<GpuSystem, 'ortex'>, exe: string, script: string, extra: string[], env: NodeJS.ProcessEnv = offline) => {
      const share = budget.nextPhase()
      progress(`${model.name}: ${system}${share > 0 ? ` (${share.toFixed(0)} s of the budget)` : ''}`)
      return runPythonPhase({
        system,
        model: model.name,
        python: exe,
        script: join(root, 'bench', 'gpu', script),
        args: ['--workload', workloadFile, '--model', model.dir, ...extra, ...(share > 0 ? ['--budget-s', String(share)] : [])],
        env,
        concurrencies: args.concurrencies,
        killAfterS: share > 0 ? share + 60 : 24 * 3600,
        onProgress: progress,
        onRow: addRow,
        gpuMemoryMb: gpuMemory,
      })
    }
    if (args.hf) {
      const hf = await python('transformers', args.python, 'hf_bench.py', ['--device', args.provider, ...(args.hfCompile ? ['--compile'] : [])])
      systems.transformers = { ...(hf.info ?? {}), ...(hf.error ? { error: hf.error } : {}) }
      if (args.provider === 'cuda' && typeof hf.info?.gpu === 'string') report.machine.gpu = hf.info.gpu
      recordAgreement(report, model.name, 'transformers', firsts.get(model.name), hf.info)
      save()
    }
    if (args.genai) {
      // run.sh points GPU_BENCH_GENAI_PYTHONPATH at onnxruntime-genai-cuda and the onnxruntime shim
      const extraPath = process.env.GPU_BENCH_GENAI_PYTHONPATH
      const env = extraPath ? { ...offline, PYTHONPATH: [extraPath, process.env.PYTHONPATH].filter(Boolean).join(':') } : offline
      const genai = await python('genai', args.genaiPython, 'genai_bench.py', ['--provider', args.provider, '--mode', args.genaiMode], env)
      systems.genai = { ...(genai.info ?? {}), ...(genai.error ? { error: genai.error } : {}) }
      recordAgreement(report, model.name, 'genai', firsts.get(model.name), genai.info)
      save()
    }
  }
  save()
  process.stdout.write(`${formatReport(report)}\n\nwrote ${join(args.out, 'gpu-bench.json')} and gpu-bench.md (${report.elapsedS.toFixed(0)} s)\n`)
}

/** Issue 32 item 3 on the first model: its gqa fp32 folder (made, or the given folder as it is),
 *  the CPU's greedy reference and the provider's teacher-forced agreement with it. */
async function correctness(
  root: string,
  source: ModelSource,
  name: string,
  w: GpuWorkload,
  args: Args,
  shareS: number,
  progress: (line: string) => void,
  report: GpuReport,
  save: () => void,
): Promise<void> {
  const deadlineMs = shareS > 0 ? performance.now() + shareS * 1000 : null // making the folder counts too
  let folder
  try {
    folder = prepareModel(root, args.modelsDir, source, 'gqa-fp32', progress)
  } catch (error) {
    progress(`${name}: correctness: no fp32 folder: ${(error as Error).message}`)
    return
  }
  progress(`${name}: correctness${shareS > 0 ? ` (${shareS.toFixed(0)} s of the budget)` : ''}`)
  const entry = await correctnessPhase({
    Engine: Engine as unknown as GpuEngineClass,
    model: name,
    dir: folder.dir,
    form: folder.form,
    provider: args.provider,
    prompts: w.prompts.slice(0, CORRECTNESS_PROMPTS),
    referenceTokens: args.quick ? 16 : CORRECTNESS_TOKENS,
    // the reference runs on the CPU beside the GPU: on the device machine it may use every core
    cpuThreads: args.provider === 'cuda' ? os.cpus().length : args.threads,
    blockSize: folderBlockSize(folder.dir) ?? BLOCK_SIZE,
    deadlineMs,
    progress,
  })
  report.correctness.push(entry)
  const share = entry.positions > 0 ? ` (${((100 * entry.matches) / entry.positions).toFixed(1)}%)` : ''
  progress(`${name}: correctness: ${entry.error ?? `${entry.matches} of ${entry.positions} positions agree${share}${entry.cut ? ', cut at the budget' : ''}`}`)
  save()
}

/** Issue 32 item 1 on the first model: ortex's tokens/s per KV block size at concurrency 1 and 64. */
async function blockSizes(
  root: string,
  source: ModelSource,
  model: ModelEntry,
  w: GpuWorkload,
  args: Args,
  shareS: number,
  progress: (line: string) => void,
  report: GpuReport,
  save: () => void,
): Promise<void> {
  progress(`${model.name}: block sizes ${args.blockSizes.join(', ')}${shareS > 0 ? ` (${shareS.toFixed(0)} s of the budget)` : ''}`)
  const paged = formFixesBlockSize(model.form)
  await blockSizePhase({
    Engine: Engine as unknown as GpuEngineClass,
    model: model.name,
    folderFor: (blockSize) => {
      // the main run's folder where it has the block size already (a bench folder is 125-250 MB to write)
      if (!paged || folderBlockSize(model.dir) === blockSize) return model.dir
      const made = prepareModel(root, args.modelsDir, source, model.form as FolderForm, progress, blockSize)
      if (made.form !== model.form) throw new Error(`the ${model.form} form with block size ${blockSize} could not be made: ${made.note ?? ''}`)
      return made.dir
    },
    blockSizes: args.blockSizes,
    workload: w,
    baseOptions: engineOptions(args, Math.max(...BLOCK_SIZE_CONCURRENCIES), w.numBlocks, w.blockSize),
    deadlineMs: shareS > 0 ? performance.now() + shareS * 1000 : null,
    progress,
    onRow: (row) => {
      report.blockSizes.push(row)
      progress(`${row.model} block size ${row.blockSize} c${row.concurrency}: ${row.error ?? `${row.tokensPerSecond!.toFixed(1)} tokens/s`}`)
      save()
    },
  })
}

/** The engine options every ortex phase sets but for the pool. */
function engineOptions(args: Args, maxBatchSize: number, numBlocks: number, blockSize: number): GpuEngineOptions {
  return {
    executionProvider: args.provider,
    maxBatchSize,
    numBlocks,
    blockSize,
    maxScheduledTokens: args.provider === 'cuda' ? 2048 : 512,
    ...(args.provider === 'cpu' ? { intraOpThreads: args.threads } : {}),
  }
}

/** Greedy tokens of request 0 alone, as each Python side reports them in its info. */
function recordAgreement(report: GpuReport, model: string, system: GpuSystem, ours: number[] | undefined, info: Record<string, unknown> | null): void {
  const theirs = info?.firstTokens as number[] | undefined
  if (ours === undefined || theirs === undefined) return
  report.agreement.push({ model, system, ...agreementOf(ours, theirs) })
}

/** The workload when ortex could not load on the provider asked for, so that the other systems
 *  still run: the prompts come from the folder's tokenizer through a CPU engine, or where the
 *  folder cannot run on the CPU (a CUDA paged kernel), through Python's tokenizers library (the
 *  library ortex's tokenizer is); null if neither works. */
async function workloadWithoutOrtex(
  dir: string,
  args: Args,
  blockSize: number,
  options: GpuEngineOptions,
  progress: (line: string) => void,
): Promise<GpuWorkload | null> {
  const text = PROMPT_TEXT.repeat(8)
  const make = (ids: number[]) => workloadFor(ids, args, readPadTokenId(dir), blockSize)
  try {
    const cpu = await (Engine as unknown as GpuEngineClass).load(dir, { ...options, executionProvider: 'cpu', maxBatchSize: 1, numBlocks: 16 })
    try {
      return make(Array.from(cpu.tokenize(text)))
    } finally {
      await cpu.close()
    }
  } catch (error) {
    progress(`${dir}: not loadable on the CPU either (${(error as Error).message.slice(0, 120)}): prompts from Python's tokenizers`)
  }
  const code = 'import json, sys; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); print(json.dumps(t.encode(sys.argv[2], add_special_tokens=False).ids))'
  const r = spawnSync(args.python, ['-c', code, join(dir, 'tokenizer.json'), text], { encoding: 'utf8' })
  try {
    return make(JSON.parse(r.stdout) as number[])
  } catch {
    progress(`${dir}: no workload: Python's tokenizers failed too (${r.stderr.trim().split('\n').pop() ?? r.status})`)
    return null
  }
}

/** ortex on one folder: loads it, makes the workload from its tokenizer, runs every concurrency. */
async function ortexPhase(
  model: string,
  dir: string,
  args: Args,
  budgetS: number,
  progress: (line: string) => void,
  gpuMemory: () => number | null,
  addRow: (row: GpuRow) => void,
  systems: GpuReport['systems'][string],
  firsts: Map<string, number[]>,
): Promise<GpuWorkload | null> {
  const deadline = budgetS > 0 ? performance.now() + budgetS * 1000 : null
  const blockSize = folderBlockSize(dir) ?? BLOCK_SIZE
  const largest = Math.max(...args.concurrencies)
  const numBlocks = largest * (Math.ceil((Math.max(...PROMPT_LENGTHS) + args.tokens) / blockSize) + 1)
  const loadStarted = performance.now()
  progress(`${model}: loading ${dir} in ortex (${args.provider}, block size ${blockSize}, ${numBlocks} blocks)`)
  const options = engineOptions(args, largest, numBlocks, blockSize)
  let engine
  try {
    engine = await (Engine as unknown as GpuEngineClass).load(dir, options)
  } catch (error) {
    const why = (error as Error).message
    systems.ortex = { error: why }
    progress(`${model}: ortex could not load: ${why}`)
    for (const c of args.concurrencies) addRow({ model, system: 'ortex', concurrency: c, error: `load failed: ${why.slice(0, 160)}` })
    return workloadWithoutOrtex(dir, args, blockSize, options, progress)
  }
  try {
    const ids = Array.from(engine.tokenize(PROMPT_TEXT.repeat(8)))
    const w = workloadFor(ids, args, readPadTokenId(dir), blockSize)
    // A run still going 60 s past the phase's share is cut by closing the engine (its turns end
    // cancelled), so that a stuck or very slow device path cannot take the other systems' time.
    let cut = false
    const open = engine
    const watchdog = deadline === null ? null : setTimeout(() => ((cut = true), void open.close()), deadline - performance.now() + 60_000)
    const cutMessage = 'cut: still running 60 s past its share of the time budget'
    try {
      let first: number[]
      try {
        first = await firstTokens(engine, w) // also the warm-up
      } catch (error) {
        const why = cut ? `${cutMessage} (request 0 alone, the warm-up)` : (error as Error).message
        for (const c of args.concurrencies) addRow({ model, system: 'ortex', concurrency: c, error: why })
        return w
      }
      firsts.set(model, first)
      systems.ortex = { loadS: (performance.now() - loadStarted) / 1000, blockSize, numBlocks, gpuMemoryAfterLoadMb: gpuMemory(), firstTokens: first }
      let perRow: number | null = null
      for (const c of args.concurrencies) {
        const requests = w.requestsByConcurrency[String(c)]!
        const estimateS = perRow === null ? 0 : (requests * w.generatedTokens) / (perRow * Math.min(c, requests))
        if (cut || (deadline !== null && performance.now() + estimateS * 1000 > deadline)) {
          const why = cut ? 'not run: the engine was cut at the time budget' : `skipped: ${perRow === null ? "the phase's share of the time budget is spent" : `about ${estimateS.toFixed(0)} s, more than the time left`}`
          addRow({ model, system: 'ortex', concurrency: c, error: why })
          continue
        }
        try {
          const row = await runOrtexConcurrency(engine, w, model, c)
          row.gpuMemoryMb = gpuMemory()
          perRow = row.tokensPerSecond! / Math.min(c, requests)
          addRow(row)
        } catch (error) {
          addRow({ model, system: 'ortex', concurrency: c, error: cut ? cutMessage : (error as Error).message })
        }
      }
    } finally {
      if (watchdog !== null) clearTimeout(watchdog)
    }
    if (cut) return w
    const stats = engine.executorStats()
    if (stats !== null) systems.ortex.kvStoreBytes = stats.kvStoreBytes
    return w
  } finally {
    await engine.close()
  }
}

main(process.argv.slice(2)).catch((error: unknown) => {
  process.stderr.write(`gpu-bench: ${error instanceof Error ? error.message : String(error)}\n`)
  process.exit(error instanceof UsageError ? 2 : 1)
})
