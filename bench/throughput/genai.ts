// onnxruntime-genai's side of the model benchmarks: bench/genai_throughput.py, run as a child
// process that loads the model once and answers JSON-line commands. Used by the throughput and the
// prefix-cache benchmarks.

import { type ChildProcessWithoutNullStreams, spawn } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'

import type { RunSummary } from './stats'
import type { GenaiLoadMemory, TokenizerCheck } from './throughput'

/** Where the script lives, the Python that runs it, and where its progress lines go. */
export interface GenaiSettings {
  root: string
  python: string
  onProgress: (line: string) => void
}

/** The workload as the script reads it (its docstring has the protocol). */
export interface GenaiSpec {
  modelDir: string
  prompts: number[][]
  generatedTokens: number
  staggerMs: number
  intraOpThreads: number
  maxBatchSize: number
  padTokenId: number
  /** The text the prompts were cut from and ortex's ids for it: the script checks its tokenizer. */
  promptText?: string
  promptIds?: number[]
  /** Where the Generator's session writes ONNX Runtime's profile (a file prefix), if at all. */
  profilePrefix?: string
}

export type GenaiMode = 'engine' | 'generator'
type GenaiReply = { ok: boolean; error?: string } & Record<string, unknown>

/**
 * bench/genai_throughput.py, started once per benchmark: it loads the model for both of its systems
 * and answers commands (JSON lines), so its runs interleave with ortex's without a model load each.
 * Its stderr lines go to progress; so do stdout lines that are not the protocol's (pip's, when it
 * first creates .cache/genai-venv).
 */
export class GenaiProcess {
  private readonly waiting: ((reply: GenaiReply) => void)[] = []
  private exited: string | null = null
  version: string | undefined
  onnxruntimeVersion: string | undefined
  memory: GenaiLoadMemory | undefined
  tokenizerCheck: TokenizerCheck | undefined

  private constructor(
    private readonly child: ChildProcessWithoutNullStreams,
    private readonly dir: string,
    onProgress: (line: string) => void,
  ) {
    createInterface({ input: child.stderr }).on('line', (line) => {
      if (line.trim() !== '') onProgress(line.replace(/^genai_throughput: /, 'genai: '))
    })
    createInterface({ input: child.stdout }).on('line', (line) => {
      const reply = parseReply(line)
      if (reply === null) {
        if (line.trim() !== '') onProgress(`genai: ${line}`)
        return
      }
      this.waiting.shift()?.({ ...reply })
    })
    const end = (why: string) => {
      this.exited ??= why
      for (const resolve of this.waiting.splice(0)) resolve({ ok: false, error: `onnxruntime-genai's process ${why}` })
    }
    // A write after the process died fails with EPIPE; its exit is reported by 'close' instead.
    child.stdin.on('error', () => {})
    child.on('error', (error) => end(`failed: ${error.message}`))
    child.on('close', (code, signal) => end(`exited (${signal ?? `status ${code}`})`))
  }

  /** Starts the script on `spec` (the workload, as bench/genai_throughput.py reads it) and waits
   *  until both systems are loaded; an error message if it cannot. */
  static async start(options: GenaiSettings, spec: GenaiSpec): Promise<GenaiProcess | string> {
    const script = join(options.root, 'bench', 'genai_throughput.py')
    if (!existsSync(script)) return `${script} is missing (it comes with the repository, not the npm package)`
    const dir = mkdtempSync(join(os.tmpdir(), 'ortex-bench-'))
    const specPath = join(dir, 'spec.json')
    writeFileSync(specPath, JSON.stringify(spec))
    const child = spawn(options.python, [script, '--spec', specPath], { stdio: ['pipe', 'pipe', 'pipe'] })
    const genai = new GenaiProcess(child, dir, options.onProgress)
    const ready = await genai.next()
    if (!ready.ok) {
      genai.close()
      return ready.error ?? 'failed to start'
    }
    genai.version = typeof ready.version === 'string' ? ready.version : undefined
    genai.onnxruntimeVersion = typeof ready.onnxruntimeVersion === 'string' ? ready.onnxruntimeVersion : undefined
    genai.memory = ready.memory as GenaiLoadMemory | undefined
    genai.tokenizerCheck = ready.tokenizerCheck as TokenizerCheck | undefined
    return genai
  }

  /** One request alone: its token times in ms from its start. */
  async request(mode: GenaiMode, index: number): Promise<number[]> {
    const reply = await this.send({ run: 'request', mode, index })
    return reply.tokenMs as number[]
  }

  /** The closed-loop workload at `concurrency`, summarized on the Python side. */
  async closedLoop(mode: GenaiMode, concurrency: number, requests: number): Promise<RunSummary> {
    const { ok: _ok, ...summary } = await this.send({ run: 'closed-loop', mode, concurrency, requests })
    return summary as unknown as RunSummary
  }

  close(): void {
    this.child.stdin.end()
    rmSync(this.dir, { recursive: true, force: true })
  }

  /** Closes the process and waits until it has exited (and so written what it writes at its end). */
  async closeAndWait(): Promise<void> {
    const exited = new Promise<void>((resolve) => {
      if (this.child.exitCode !== null || this.child.signalCode !== null) resolve()
      else this.child.once('close', () => resolve())
    })
    this.close()
    await exited
  }

  private async send(command: Record<string, unknown>): Promise<GenaiReply> {
    const reply = this.next()
    if (this.exited === null) this.child.stdin.write(`${JSON.stringify(command)}\n`)
    const result = await reply
    if (!result.ok) throw new Error(result.error ?? 'failed')
    return result
  }

  private next(): Promise<GenaiReply> {
    if (this.exited !== null) return Promise.resolve({ ok: false, error: `onnxruntime-genai's process ${this.exited}` })
    return new Promise((resolve) => this.waiting.push(resolve))
  }
}

function parseReply(line: string): GenaiReply | null {
  if (!line.startsWith('{')) return null
  try {
    const value = JSON.parse(line) as unknown
    return typeof value === 'object' && value !== null && typeof (value as GenaiReply).ok === 'boolean' ? (value as GenaiReply) : null
  } catch {
    return null
  }
}

/** The pad token onnxruntime-genai's Generator left-pads batches with. */
export function readPadTokenId(modelDir: string): number {
  const config = JSON.parse(readFileSync(join(modelDir, 'genai_config.json'), 'utf8')) as { model?: { pad_token_id?: number } }
  return config.model?.pad_token_id ?? 0
}
