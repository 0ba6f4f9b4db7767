// llama.cpp as the oracle for GGUF semantics: node-llama-cpp's prebuilt CPU binary (getLlama with
// build 'never': never a build from source, nothing downloaded) on a GGUF file, set up for exact
// comparisons: no flash attention, float32 keys and values in the KV cache, one sequence.
//
//   greedy    the greedy continuation of prompt ids (temperature 0), EOS ignored or not
//   logits    teacher-forced: the raw logits over the whole vocabulary after every prefix of a
//             token sequence, in one evaluation (the sampler is greedy, which reorders nothing
//             and drops nothing; node-llama-cpp hands each row over as a Map)
//   margins   the top-1 minus top-2 logit at each generated step, from the teacher-forced
//             logits: where it is small, rounding (llama.cpp's float16 GELU table, a different
//             summation order) can flip a greedy choice, so equality there proves little
//
// One llama.cpp instance serves the process; a model is loaded once per file and options
// (LlamaCpp.load caches it) and kept until closeLlamaCpp().

import type { Llama, LlamaContext, LlamaContextSequence, LlamaModel, Token } from 'node-llama-cpp'

export interface LlamaCppLoadOptions {
  /** The context size (tokens); default the file's context_length. llama.cpp rounds it up to a
   *  multiple of 256, and it chooses some things by it (phi3's long or short rotary factors). */
  contextSize?: number
  /** llama.cpp's threads; default 1 (a tiny model gains nothing from more, and CI has two cores). */
  threads?: number
}

export interface GreedyOptions {
  /** Go on past an end-of-generation token (default true); otherwise stop after yielding it. */
  ignoreEos?: boolean
}

let llamaPromise: Promise<Llama> | undefined
const loaded = new Map<string, Promise<LlamaCpp>>()
/** node-llama-cpp's GgmlType enum (its names by value), once the module is loaded. */
let ggmlTypes: Record<number, string> = {}
/** llama.cpp's latest error lines and how many there have been, so that a failed load can say
 *  why (its exception says only "Failed to load model"). */
const errorLines: string[] = []
let errorCount = 0
/** A model load failed: node-llama-cpp keeps that model's hold on the Llama instance, whose
 *  dispose() then waits forever, so the instance is left to the process's exit. */
let loadFailed = false

async function theLlama(): Promise<Llama> {
  llamaPromise ??= (async () => {
    const { getLlama, GgmlType, LlamaLogLevel } = await import('node-llama-cpp')
    ggmlTypes = GgmlType as unknown as Record<number, string>
    const logger = (level: string, message: string) => {
      if (level !== LlamaLogLevel.error && level !== LlamaLogLevel.fatal) return
      errorLines.push(message.trim())
      errorCount++
      if (errorLines.length > 32) errorLines.shift()
    }
    // maxThreads 0: a context's `threads` is exactly what runs.
    return getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error, logger, maxThreads: 0, progressLogs: false })
  })()
  return llamaPromise
}

export class LlamaCpp {
  private constructor(
    readonly file: string,
    private readonly model: LlamaModel,
    private readonly context: LlamaContext,
    private readonly sequence: LlamaContextSequence,
    /** Rows of the output (the vocabulary, as token_embd's rows). */
    readonly vocabSize: number,
  ) {}

  /** The file loaded with these options: the same instance for the same file and options. */
  static load(file: string, options: LlamaCppLoadOptions = {}): Promise<LlamaCpp> {
    const key = JSON.stringify([file, options.contextSize ?? null, options.threads ?? 1])
    let model = loaded.get(key)
    if (model === undefined) {
      model = LlamaCpp.open(file, options)
      loaded.set(key, model)
      model.catch(() => loaded.delete(key))
    }
    return model
  }

  private static async open(file: string, options: LlamaCppLoadOptions): Promise<LlamaCpp> {
    const llama = await theLlama()
    const logged = errorCount
    let model: LlamaModel | undefined
    try {
      model = await llama.loadModel({ modelPath: file, gpuLayers: 0 })
      const context = await model.createContext({
        sequences: 1,
        contextSize: options.contextSize ?? model.trainContextSize,
        threads: options.threads ?? 1,
        flashAttention: false,
        experimentalKvCacheKeyType: 'F32',
        experimentalKvCacheValueType: 'F32',
        failedCreationRemedy: false,
      })
      const vocabSize = model.fileInfo.fullTensorInfo?.find((t) => t.name === 'token_embd.weight')?.dimensions[1]
      if (typeof vocabSize !== 'number' && typeof vocabSize !== 'bigint') throw new Error('no token_embd.weight tensor')
      return new LlamaCpp(file, model, context, context.getSequence(), Number(vocabSize))
    } catch (error) {
      loadFailed ||= model === undefined
      await model?.dispose()
      // llama.cpp's log lines reach JavaScript asynchronously, maybe after the rejection.
      for (let waited = 0; errorCount === logged && waited < 500; waited += 10) await new Promise((r) => setTimeout(r, 10))
      const since = errorLines.slice(Math.max(0, errorLines.length - (errorCount - logged)))
      const why = [error instanceof Error ? error.message : String(error), ...since].join('; ')
      throw new Error(`llama.cpp could not load ${file}: ${why}`, { cause: error })
    }
  }

  /** The context size llama.cpp settled on. */
  get contextSize(): number {
    return this.context.contextSize
  }

  /** What the context runs with, for a test to check and a report to print. */
  get setup(): { flashAttention: boolean | 'auto'; kvCache: string; contextSize: number } {
    const kv = `${ggmlTypes[this.context.kvCacheKeyType]}/${ggmlTypes[this.context.kvCacheValueType]}`
    return { flashAttention: this.context.flashAttention, kvCache: kv, contextSize: this.contextSize }
  }

  get bos(): number | undefined {
    return this.model.tokens.bos ?? undefined
  }

  get eos(): number | undefined {
    return this.model.tokens.eos ?? undefined
  }

  isEndOfGeneration(token: number): boolean {
    return this.model.isEogToken(token as Token)
  }

  /** llama.cpp's tokenization of `text`, special-token text kept as text unless `special`; no BOS. */
  tokenize(text: string, options: { special?: boolean } = {}): number[] {
    return this.model.tokenize(text, options.special ?? false).map(Number)
  }

  detokenize(ids: readonly number[]): string {
    return this.model.detokenize(ids as Token[])
  }

  /** `n` greedy tokens after `prompt`, from an empty cache. */
  async greedy(prompt: readonly number[], n: number, options: GreedyOptions = {}): Promise<number[]> {
    this.checkIds(prompt, n)
    await this.sequence.clearHistory()
    const out: number[] = []
    // yieldEogToken: an end-of-generation token comes out (evaluate() otherwise ends there), so
    // whether it ends the run is decided here.
    for await (const token of this.sequence.evaluate(prompt as Token[], { temperature: 0, yieldEogToken: true })) {
      out.push(token)
      if (out.length >= n || (options.ignoreEos === false && this.isEndOfGeneration(token))) break
    }
    return out
  }

  /** Teacher-forced logits: row j is the raw logits of the token after ids[0..j], for every j. */
  async logits(ids: readonly number[]): Promise<Float32Array[]> {
    this.checkIds(ids, 0)
    await this.sequence.clearHistory()
    const out = await this.sequence.controlledEvaluate(ids.map((id) => [id as Token, { generateNext: { logits: true } }]))
    return ids.map((_, j) => {
      const logits = out[j]?.next.logits
      if (logits === undefined || logits.size !== this.vocabSize) {
        throw new Error(`${this.file}: llama.cpp gave ${logits?.size ?? 'no'} logits at position ${j}, not the vocabulary's ${this.vocabSize}`)
      }
      const row = new Float32Array(this.vocabSize)
      for (const [token, logit] of logits) row[token] = logit
      return row
    })
  }

  private checkIds(ids: readonly number[], more: number): void {
    if (ids.length === 0) throw new Error('at least one token is needed')
    if (ids.length + more > this.contextSize) throw new Error(`${ids.length} + ${more} tokens do not fit llama.cpp's context of ${this.contextSize}`)
    const bad = ids.find((id) => !Number.isInteger(id) || id < 0 || id >= this.vocabSize)
    if (bad !== undefined) throw new Error(`token ${bad} is outside the vocabulary of ${this.vocabSize}`)
  }

  async close(): Promise<void> {
    for (const [key, value] of loaded) if ((await value.catch(() => undefined)) === this) loaded.delete(key)
    await this.sequence.dispose()
    await this.context.dispose()
    await this.model.dispose()
  }
}

/** Closes every loaded model and the llama.cpp instance (afterAll); after a failed load, the
 *  models only (see loadFailed). */
export async function closeLlamaCpp(): Promise<void> {
  const models = await Promise.allSettled(loaded.values())
  loaded.clear()
  for (const m of models) if (m.status === 'fulfilled') await m.value.close()
  const llama = llamaPromise
  llamaPromise = undefined
  if (llama && !loadFailed) await (await llama).dispose()
}

/** The largest and the second-largest value of a row, and the index of the largest (the lowest on ties). */
export function topTwo(row: ArrayLike<number>): { top: number; first: number; second: number } {
  let top = 0
  let first = -Infinity
  let second = -Infinity
  for (let i = 0; i < row.length; i++) {
    const v = row[i]!
    if (v > first) {
      second = first
      first = v
      top = i
    } else if (v > second) second = v
  }
  return { top, first, second }
}

export interface GreedyRun {
  prompt: number[]
  tokens: number[]
  /** Per generated token: its logit minus the runner-up's (teacher-forced). */
  margins: number[]
  /** Positions where the teacher-forced top-1 is not the generated token (rounding between the
   *  step-by-step and the one-batch evaluation; empty unless a margin is about zero). */
  disagreements: number[]
}

/**
 * llama.cpp's greedy run of `n` tokens after `prompt`, with the margin of every choice: the
 * teacher-forced logits of prompt + tokens, at the positions that chose the generated tokens.
 */
export async function greedyMargins(model: LlamaCpp, prompt: readonly number[], n: number, options: GreedyOptions = {}): Promise<GreedyRun> {
  const tokens = await model.greedy(prompt, n, options)
  const rows = await model.logits([...prompt, ...tokens].slice(0, prompt.length + tokens.length - 1))
  const margins: number[] = []
  const disagreements: number[] = []
  tokens.forEach((token, i) => {
    const { top, first, second } = topTwo(rows[prompt.length - 1 + i]!)
    margins.push(first - second)
    if (top !== token) disagreements.push(i)
  })
  return { prompt: [...prompt], tokens, margins, disagreements }
}
