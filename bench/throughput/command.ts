// The throughput benchmark's command line (bench/throughput/main.ts runs it): the benchmark
// on a model folder (throughput.ts), progress on stderr, the table and the goals on
// stdout, a JSON report and an SVG chart on disk. 

import { existsSync, mkdirSync, writeFileSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { parseArgs } from 'node:util'

import { formatTable, svgChart } from './report'
import { type BenchEngineClass, CONCURRENCIES, DEFAULT_STAGGER_MS, runThroughput } from './throughput'

export const DEFAULT_BENCH_MODEL = '.cache/models/bench-gqa'

export const BENCH_HELP = `Usage: node bench/out/throughput.mjs [--model DIR] [--quick] [options]   (npm run bench runs it)

Measures aggregate tokens per second, time to first token and inter-token latency (p50/p99) at
concurrency 1, 4 and 16 (staggered arrivals, greedy, EOS ignored, the same prompts and token counts
for every system) for ortex, a naive per-request loop on onnxruntime-node, and onnxruntime-genai's
Python API over the same model folder, and reports the ratios against ortex's goals. Every system's
intra-op threads spin between operators (onnxruntime-genai's default; ortex's intraOpSpinning);
ortex with its default blocking threads also runs at concurrency 1, where the systems take turns
request by request. Takes about 4-8 minutes on 2 cores (--quick: under a minute).

Options:
  --model DIR     the model folder (default: ${DEFAULT_BENCH_MODEL}, made with
                  'ortex make-model --size bench --attention gqa' when absent)
  --quick         32 tokens per request instead of 128, 2 requests per system at concurrency 1
                  instead of 8, one round
  --rounds N      run the interleaved configurations N times and report medians (default 2;
                  --quick: 1)
  --concurrency L the concurrencies to measure, a comma-separated subset of 1,4,16 (default all;
                  a goal whose concurrency is left out reports no value)
  --out DIR       where to write throughput.json (default: bench/out)
  --svg FILE      where to write the chart (default: OUT/throughput.svg)
  --threads N     ONNX Runtime intra-op threads for every system (default 2)
  --stagger-ms N  milliseconds between the first arrivals of the clients (default 5; 0: all at
                  once, onnxruntime-genai's padded batch then starts at once, its best case)
  --genai-model DIR  run onnxruntime-genai on this folder instead of --model's (one its own builder
                  made from the same weights: bench/smollm2_genai.py); refused unless its tokenizer
                  gives ortex's ids for the prompt text
  --no-naive      skip the naive onnxruntime-node loop (needs the onnxruntime-node package)
  --no-genai      skip onnxruntime-genai (needs python3; installs onnxruntime-genai 0.18 into
                  .cache/genai-venv with pip on first use, see bench/requirements.txt)
  --python EXE    the Python interpreter that runs bench/genai_throughput.py (default python3)
  -h, --help      show this help
`

export interface BenchCommandHooks {
  usageError: (message: string) => Error
  /** The engine class to measure. */
  Engine: BenchEngineClass
  /** The package root: bench/genai_throughput.py lives under it. */
  root: string
}

interface BenchArgs {
  model: string | undefined
  genaiModel: string | undefined
  quick: boolean
  out: string
  svg: string | undefined
  threads: number
  staggerMs: number
  rounds: number
  concurrencies: number[]
  naive: boolean
  genai: boolean
  python: string
}

function parseBench(argv: string[], hooks: BenchCommandHooks): BenchArgs | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      model: { type: 'string' },
      'genai-model': { type: 'string' },
      quick: { type: 'boolean' },
      out: { type: 'string' },
      svg: { type: 'string' },
      threads: { type: 'string' },
      'stagger-ms': { type: 'string' },
      rounds: { type: 'string' },
      concurrency: { type: 'string' },
      'no-naive': { type: 'boolean' },
      'no-genai': { type: 'boolean' },
      python: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  for (const name of ['model', 'genai-model', 'out', 'svg', 'python'] as const) {
    if (values[name] === '') throw hooks.usageError(`--${name} needs a value`)
  }
  const integer = (name: string, value: string | undefined, fallback: number, max: number, min = 1): number => {
    if (value === undefined) return fallback
    const n = Number(value)
    if (!/^\d+$/.test(value) || n < min || n > max) {
      throw hooks.usageError(`--${name} must be an integer in [${min}, ${max}], got ${JSON.stringify(value)}`)
    }
    return n
  }
  const quick = values.quick === true
  return {
    model: values.model,
    genaiModel: values['genai-model'],
    quick,
    out: values.out ?? join('bench', 'out'),
    svg: values.svg,
    threads: integer('threads', values.threads, 2, 256),
    staggerMs: integer('stagger-ms', values['stagger-ms'], DEFAULT_STAGGER_MS, 10_000, 0),
    rounds: integer('rounds', values.rounds, quick ? 1 : 2, 100),
    concurrencies: concurrencyList(values.concurrency, hooks),
    naive: values['no-naive'] !== true,
    genai: values['no-genai'] !== true,
    python: values.python ?? 'python3',
  }
}

/** `--concurrency 1,16`: a non-empty subset of the measured concurrencies, in their order. */
export function concurrencyList(value: string | undefined, hooks: Pick<BenchCommandHooks, 'usageError'>): number[] {
  if (value === undefined) return [...CONCURRENCIES]
  const picked = value.split(',').map((part) => part.trim())
  const unknown = picked.filter((part) => !CONCURRENCIES.some((c) => String(c) === part))
  if (picked.length === 0 || unknown.length > 0) {
    throw hooks.usageError(`--concurrency must list some of ${CONCURRENCIES.join(',')}, got ${JSON.stringify(value)}`)
  }
  return CONCURRENCIES.filter((c) => picked.includes(String(c)))
}

function progressWriter(): (line: string) => void {
  const started = performance.now()
  return (line) => {
    const seconds = ((performance.now() - started) / 1000).toFixed(0).padStart(4)
    process.stderr.write(`bench ${seconds}s  ${line}\n`)
  }
}

/** The default model folder, made when absent. */
export async function ensureBenchModel(dir: string, progress: (line: string) => void): Promise<void> {
  if (existsSync(join(dir, 'genai_config.json'))) return
  progress(`making the bench model in ${dir} (ortex make-model --size bench --attention gqa)`)
  const { makeModel } = await import('../../ts/modelkit/make-model')
  const summary = await makeModel({ outDir: dir, size: 'bench', attention: 'gqa' })
  progress(`made ${summary.parameters.toLocaleString('en-US')} parameters in ${(summary.elapsedMs / 1000).toFixed(1)} s`)
}

export async function runBenchCommand(argv: string[], hooks: BenchCommandHooks): Promise<void> {
  const args = parseBench(argv, hooks)
  if (args === 'help') {
    process.stdout.write(BENCH_HELP)
    return
  }
  const progress = progressWriter()
  const modelDir = resolve(args.model ?? DEFAULT_BENCH_MODEL)
  if (args.model === undefined) await ensureBenchModel(modelDir, progress)
  else if (!existsSync(join(modelDir, 'genai_config.json'))) {
    throw hooks.usageError(`--model ${args.model}: no genai_config.json there (make one with ortex make-model)`)
  }
  const genaiModelDir = args.genaiModel === undefined ? undefined : resolve(args.genaiModel)
  if (genaiModelDir !== undefined && !existsSync(join(genaiModelDir, 'genai_config.json'))) {
    throw hooks.usageError(`--genai-model ${args.genaiModel}: no genai_config.json there`)
  }
  const report = await runThroughput({
    modelDir,
    ...(genaiModelDir !== undefined ? { genaiModelDir } : {}),
    quick: args.quick,
    rounds: args.rounds,
    concurrencies: args.concurrencies,
    Engine: hooks.Engine,
    root: hooks.root,
    intraOpThreads: args.threads,
    staggerMs: args.staggerMs,
    naive: args.naive,
    genai: args.genai,
    python: args.python,
    onProgress: progress,
  })
  const jsonPath = resolve(args.out, 'throughput.json')
  const svgPath = resolve(args.svg ?? join(args.out, 'throughput.svg'))
  mkdirSync(dirname(jsonPath), { recursive: true })
  writeFileSync(jsonPath, `${JSON.stringify(report, null, 2)}\n`)
  mkdirSync(dirname(svgPath), { recursive: true })
  writeFileSync(svgPath, svgChart(report))
  process.stdout.write(`${formatTable(report)}\n\nwrote ${jsonPath} and ${svgPath} (${report.elapsedS.toFixed(0)} s)\n`)
}
