// `ortex generate`: streams several concurrent generations to the terminal, then reports tokens
// per second per request and in total.

import { setMaxListeners } from 'node:events'
import { parseArgs } from 'node:util'

import type { Engine } from '../engine'
import type { Turn, TurnResult } from '../exports'
import type { ChatMessage } from '../types'
import { ENGINE_FLAGS, type EngineChoice, ggufFlagsHelp, UsageError, engineChoice, integerFlag, numberFlag, openEngine } from './args'

export const GENERATE_HELP = `Usage: ortex generate (--model DIR|FILE.gguf | --simulated) [options]

Streams concurrent generations to the terminal, then prints tokens per second per request and in
total.

Options:
  --model DIR|FILE     an ONNX model folder (genai_config.json, model.onnx, tokenizer.json), or
                       a GGUF file: imported into the cache on its first use (progress on
                       stderr) and that import reused after
  --simulated          the deterministic simulated model instead of a model folder
  --prompt TEXT        a prompt; repeat for several (requests cycle through them)
  --chat               each prompt is a user message, rendered with the model's chat template
                       (the folder's; the simulated model's: ChatML); its end-of-turn token ends
                       the reply
  --system TEXT        with --chat: a system message before each prompt (default: none, so the
                       template's own default, if it has one)
  --max-tokens N       tokens to generate per request (default 64)
  --concurrency K      requests running at once (default: the number of prompts, at least 1)
  --seed N             the simulated model's seed (default 0)
  --temperature T      sample with temperature T (default: greedy)
  --backend NAME       'native' (default) or 'wasm' (simulated model only)
  --kv-cache-bytes N   most bytes the model's KV pool may reserve (default: a quarter of the
                       machine's memory); the load line on stderr says what it reserves
${ggufFlagsHelp(23)}  -h, --help           show this help
`

interface GenerateArgs {
  engine: EngineChoice
  prompts: string[]
  maxTokens: number
  concurrency: number
  temperature: number | undefined
  chat: boolean
  system: string | undefined
}

function parseGenerate(argv: string[]): GenerateArgs | 'help' {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      ...ENGINE_FLAGS,
      prompt: { type: 'string', multiple: true },
      'max-tokens': { type: 'string' },
      concurrency: { type: 'string' },
      temperature: { type: 'string' },
      chat: { type: 'boolean' },
      system: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) return 'help'
  const engine = engineChoice(values)
  if (values.system !== undefined && values.chat !== true) throw new UsageError('--system needs --chat')
  const prompts = values.prompt ?? []
  return {
    engine,
    prompts: prompts.length > 0 ? prompts : ['Once upon a time'],
    maxTokens: integerFlag('max-tokens', values['max-tokens'], 64, 1, 2 ** 31 - 1),
    concurrency: integerFlag('concurrency', values.concurrency, Math.max(1, prompts.length), 1, 4096),
    temperature: numberFlag('temperature', values.temperature),
    chat: values.chat === true,
    system: values.system,
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

function chatMessages(system: string | undefined, prompt: string): ChatMessage[] {
  const user: ChatMessage = { role: 'user', content: prompt }
  return system === undefined ? [user] : [{ role: 'system', content: system }, user]
}

/** Starts the jobs, one generate() each; Ctrl-C aborts them (twice exits at once). */
function startJobs(engine: Engine, args: GenerateArgs, signal: AbortSignal): Job[] {
  const width = String(args.concurrency).length
  const jobs: Job[] = []
  for (let i = 0; i < args.concurrency; i++) {
    const prompt = args.prompts[i % args.prompts.length]!
    const options = { maxGeneratedTokens: args.maxTokens, temperature: args.temperature, signal }
    const turn = args.chat ? engine.chat(chatMessages(args.system, prompt), options) : engine.generate(prompt, options)
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
  return jobs
}

async function generate(args: GenerateArgs): Promise<void> {
  const maxBatchSize = Math.min(256, Math.max(16, args.concurrency))
  const engine = await openEngine(args.engine, { maxBatchSize })
  const abort = new AbortController()
  setMaxListeners(args.concurrency + 8, abort.signal) // one listener per turn is expected here
  const onSigint = (): void => {
    if (abort.signal.aborted) process.exit(130)
    abort.abort()
  }
  process.on('SIGINT', onSigint)
  const startedAt = performance.now()
  const jobs = startJobs(engine, args, abort.signal)
  const view = new View(jobs)
  await Promise.all(jobs.map((job) => consume(job, view)))
  view.close()
  const wallMs = performance.now() - startedAt
  process.off('SIGINT', onSigint)
  await engine.close()
  report(jobs, wallMs, engine.backend)
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

/** `ortex generate ...` */
export async function runGenerateCommand(argv: string[]): Promise<void> {
  const args = parseGenerate(argv)
  if (args === 'help') {
    process.stdout.write(GENERATE_HELP)
    return
  }
  await generate(args)
}
