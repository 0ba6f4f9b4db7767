#!/usr/bin/env node
// The `ortex` command line. For now: `ortex generate`, which streams several concurrent
// generations to the terminal and reports tokens per second. Arguments are parsed with
// node:util's parseArgs; every error ends the process with a non-zero status and one line on
// stderr.

import { setMaxListeners } from 'node:events'
import { readdirSync, readFileSync, statSync } from 'node:fs'
import path from 'node:path'
import { parseArgs } from 'node:util'

import { fromPackageRoot } from './backend'
import { runMakeModelCommand } from './make-model-command'
import { Engine as NativeEngine } from './index'
import { runServeCommand } from './server/server'
import type { Turn, TurnResult } from './shared'
import { OrtexError } from './shared'
import { Engine as WasmEngine } from './wasm'

const USAGE_ERROR = 2
const RUNTIME_ERROR = 1

const MAIN_HELP = `ortex: an LLM inference engine for Node.js

Usage:
  ortex generate (--model DIR | --simulated) [--prompt TEXT]... [--max-tokens N] [--concurrency K]
  ortex serve    (--model DIR | --simulated) [--port N] [--max-sessions N]
  ortex make-model --out DIR [--size tiny|bench] [--attention mha|gqa] [--seed N]
  ortex bench    [--model DIR] [--quick]
  ortex <command> --help

Commands:
  generate   stream generations from a model (or the simulated model) and report tokens per second
  serve      serve full-duplex sessions over WebSocket (docs/duplex-protocol.md)
  make-model write a deterministic random-weight model folder (docs/model-format.md)
  bench      tokens per second on a model folder against a naive loop and onnxruntime-genai

Options:
  -h, --help     show this help
  -v, --version  show the version
`

const GENERATE_HELP = `Usage: ortex generate (--model DIR | --simulated) [options]

Streams concurrent generations to the terminal, then prints tokens per second per request and in
total.

Options:
  --model DIR          an ONNX model folder (genai_config.json, model.onnx, tokenizer.json)
  --simulated          the deterministic simulated model instead of a model folder
  --prompt TEXT        a prompt; repeat for several (requests cycle through them)
  --max-tokens N       tokens to generate per request (default 64)
  --concurrency K      requests running at once (default: the number of prompts, at least 1)
  --seed N             the simulated model's seed (default 0)
  --temperature T      sample with temperature T (default: greedy)
  --backend NAME       'native' (default) or 'wasm' (simulated model only)
  -h, --help           show this help
`

class UsageError extends Error {}

function fail(message: string, status: number): never {
  process.stderr.write(`ortex: ${message.replace(/\s*\n\s*/g, ' ')}\n`)
  process.exit(status)
}

function integerFlag(name: string, value: string | undefined, fallback: number, min: number, max: number): number {
  if (value === undefined) return fallback
  if (!/^\d+$/.test(value)) throw new UsageError(`--${name} must be an integer, got ${JSON.stringify(value)}`)
  const n = Number(value)
  if (!Number.isSafeInteger(n) || n < min || n > max) {
    throw new UsageError(`--${name} must be in [${min}, ${max}], got ${value}`)
  }
  return n
}

function numberFlag(name: string, value: string | undefined): number | undefined {
  if (value === undefined) return undefined
  const n = Number(value)
  if (value.trim() === '' || !Number.isFinite(n) || n < 0) {
    throw new UsageError(`--${name} must be a number >= 0, got ${JSON.stringify(value)}`)
  }
  return n
}

interface GenerateArgs {
  model: string | undefined
  prompts: string[]
  maxTokens: number
  concurrency: number
  seed: number
  temperature: number | undefined
  backend: 'native' | 'wasm'
}

function parseGenerate(argv: string[]): GenerateArgs | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      model: { type: 'string' },
      simulated: { type: 'boolean' },
      prompt: { type: 'string', multiple: true },
      'max-tokens': { type: 'string' },
      concurrency: { type: 'string' },
      seed: { type: 'string' },
      temperature: { type: 'string' },
      backend: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  if (values.model !== undefined && values.simulated) throw new UsageError('give either --model or --simulated, not both')
  if (values.model === undefined && !values.simulated) throw new UsageError('give --model DIR or --simulated')
  if (values.model === '') throw new UsageError('--model needs a folder')
  const backend = values.backend ?? 'native'
  if (backend !== 'native' && backend !== 'wasm') {
    throw new UsageError(`--backend must be 'native' or 'wasm', got ${JSON.stringify(backend)}`)
  }
  const prompts = values.prompt ?? []
  return {
    model: values.model,
    prompts: prompts.length > 0 ? prompts : ['Once upon a time'],
    maxTokens: integerFlag('max-tokens', values['max-tokens'], 64, 1, 2 ** 31 - 1),
    concurrency: integerFlag('concurrency', values.concurrency, Math.max(1, prompts.length), 1, 4096),
    seed: integerFlag('seed', values.seed, 0, 0, Number.MAX_SAFE_INTEGER),
    temperature: numberFlag('temperature', values.temperature),
    backend,
  }
}

interface Job {
  tag: string
  turn: Turn
  text: string
  startedAt: number
  firstTokenAt: number | null
  result: TurnResult | null
  finishedAt: number
}

/** Live view on a terminal: one line per request, redrawn; elsewhere one line per request when it
 *  finishes. */
class View {
  private readonly live: boolean
  private drawn = 0
  private timer: NodeJS.Timeout | null = null

  constructor(private readonly jobs: Job[]) {
    const rows = process.stdout.rows ?? 0
    this.live = process.stdout.isTTY === true && jobs.length <= Math.max(0, rows - 4)
    if (this.live) {
      this.timer = setInterval(() => this.draw(), 50)
      this.timer.unref()
    }
  }

  finished(job: Job): void {
    if (!this.live) process.stdout.write(`${job.tag} ${oneLine(job.text)}\n`)
  }

  close(): void {
    if (this.timer !== null) clearInterval(this.timer)
    if (this.live) this.draw()
  }

  private draw(): void {
    const width = Math.max(20, (process.stdout.columns ?? 80) - 1)
    let out = this.drawn > 0 ? `\x1b[${this.drawn}F` : ''
    for (const job of this.jobs) {
      const head = `${job.tag}${job.result === null ? ' ' : '*'} `
      const text = oneLine(job.text)
      const room = width - head.length
      const shown = text.length > room ? `…${text.slice(text.length - room + 1)}` : text
      out += `\x1b[2K${head}${shown}\n`
    }
    this.drawn = this.jobs.length
    process.stdout.write(out)
  }
}

function oneLine(text: string): string {
  return text.replace(/[\r\n\t]+/g, ' ')
}

async function consume(job: Job, view: View): Promise<void> {
  for await (const chunk of job.turn) {
    if (job.firstTokenAt === null) job.firstTokenAt = performance.now()
    job.text += chunk.text
  }
  job.result = await job.turn.done
  job.finishedAt = performance.now()
  view.finished(job)
}

async function generate(args: GenerateArgs): Promise<void> {
  const EngineClass = args.backend === 'wasm' ? WasmEngine : NativeEngine
  const maxBatchSize = Math.min(256, Math.max(16, args.concurrency))
  const engine =
    args.model !== undefined
      ? await withLoadProgress(args.model, EngineClass.load(args.model, { maxBatchSize }))
      : EngineClass.simulated({ seed: args.seed, maxBatchSize })
  const abort = new AbortController()
  setMaxListeners(args.concurrency + 8, abort.signal) // one listener per turn is expected here
  const onSigint = (): void => {
    if (abort.signal.aborted) process.exit(130)
    abort.abort()
  }
  process.on('SIGINT', onSigint)
  const width = String(args.concurrency).length
  const startedAt = performance.now()
  const jobs: Job[] = []
  for (let i = 0; i < args.concurrency; i++) {
    const turn = engine.generate(args.prompts[i % args.prompts.length]!, {
      maxGeneratedTokens: args.maxTokens,
      temperature: args.temperature,
      signal: abort.signal,
    })
    jobs.push({
      tag: `[r${String(i + 1).padStart(width, '0')}]`,
      turn,
      text: '',
      startedAt: performance.now(),
      firstTokenAt: null,
      result: null,
      finishedAt: 0,
    })
  }
  const view = new View(jobs)
  await Promise.all(jobs.map((job) => consume(job, view)))
  view.close()
  const wallMs = performance.now() - startedAt
  process.off('SIGINT', onSigint)
  await engine.close()
  report(jobs, wallMs, engine.backend)
}

/** On a terminal, a line on stderr while a model loads (a large one takes seconds): the folder's
 *  size and the time so far, cleared when it is done. Elsewhere nothing. */
async function withLoadProgress<T>(modelDir: string, loading: Promise<T>): Promise<T> {
  if (process.stderr.isTTY !== true) return loading
  const startedAt = performance.now()
  const size = folderBytes(modelDir)
  const frames = ['|', '/', '-', '\\']
  let frame = 0
  const draw = (): void => {
    const seconds = ((performance.now() - startedAt) / 1000).toFixed(1)
    const mb = size > 0 ? ` (${(size / 1e6).toFixed(1)} MB)` : ''
    process.stderr.write(`\r\x1b[2Kloading ${modelDir}${mb} ${frames[frame++ % frames.length]} ${seconds} s`)
  }
  draw()
  const timer = setInterval(draw, 100)
  try {
    return await loading
  } finally {
    clearInterval(timer)
    process.stderr.write('\r\x1b[2K')
  }
}

function folderBytes(dir: string): number {
  try {
    return readdirSync(dir, { withFileTypes: true })
      .filter((entry) => entry.isFile())
      .reduce((sum, entry) => sum + statSync(path.join(dir, entry.name)).size, 0)
  } catch {
    return 0
  }
}

function report(jobs: Job[], wallMs: number, backend: string): void {
  let total = 0
  const lines: string[] = ['']
  for (const job of jobs) {
    const result = job.result!
    const tokens = result.usage.generatedTokens
    total += tokens
    const ms = job.finishedAt - job.startedAt
    const ttft = job.firstTokenAt === null ? '-' : `${(job.firstTokenAt - job.startedAt).toFixed(1)} ms`
    lines.push(
      `${job.tag} ${tokens} tokens in ${ms.toFixed(1)} ms: ${rate(tokens, ms)} tok/s ` +
        `(first token ${ttft}, ${result.finishReason})`,
    )
  }
  lines.push(`total: ${total} tokens from ${jobs.length} requests in ${wallMs.toFixed(1)} ms: ${rate(total, wallMs)} tok/s (${backend})`)
  process.stdout.write(`${lines.join('\n')}\n`)
}

function rate(tokens: number, ms: number): string {
  return ms > 0 ? ((tokens * 1000) / ms).toFixed(1) : '-'
}

function version(): string {
  try {
    return (JSON.parse(readFileSync(fromPackageRoot('package.json'), 'utf8')) as { version: string }).version
  } catch {
    return 'unknown'
  }
}

/** The command being run, for the hint after an argument error. */
let currentCommand: string | undefined

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv
  currentCommand = command
  if (command === undefined || command === '-h' || command === '--help' || command === 'help') {
    process.stdout.write(MAIN_HELP)
    return
  }
  if (command === '-v' || command === '--version') {
    process.stdout.write(`${version()}\n`)
    return
  }
  if (command === 'generate') {
    const args = parseGenerate(rest)
    if (args === 'help') {
      process.stdout.write(GENERATE_HELP)
      return
    }
    await generate(args)
    return
  }
  if (command === 'serve') {
    await runServeCommand(rest, { native: NativeEngine, wasm: WasmEngine, usageError: (m) => new UsageError(m) })
    return
  }
  if (command === 'make-model') {
    await runMakeModelCommand(rest, { usageError: (m) => new UsageError(m) })
    return
  }
  if (command === 'bench') {
    // The benchmark (and the reference loop it imports) loads only when the command runs.
    const { runBenchCommand } = await import('./bench/command')
    await runBenchCommand(rest, { Engine: NativeEngine, root: fromPackageRoot('.'), usageError: (m) => new UsageError(m) })
    return
  }
  throw new UsageError(`unknown command ${JSON.stringify(command)}; see ortex --help`)
}

process.stdout.on('error', (error: NodeJS.ErrnoException) => {
  if (error.code === 'EPIPE') process.exit(0)
})

main(process.argv.slice(2)).then(
  () => {
    process.exitCode = 0
  },
  (error: unknown) => {
    if (error instanceof UsageError) fail(error.message, USAGE_ERROR)
    if ((error as { code?: string })?.code?.startsWith?.('ERR_PARSE_ARGS') === true) {
      const help = currentCommand === undefined ? 'ortex --help' : `ortex ${currentCommand} --help`
      fail(`${(error as Error).message.replace(/\.?\s*$/, '')}; see ${help}`, USAGE_ERROR)
    }
    if (error instanceof OrtexError) fail(`${error.code}: ${error.message}`, RUNTIME_ERROR)
    fail(error instanceof Error ? error.message : String(error), RUNTIME_ERROR)
  },
)
