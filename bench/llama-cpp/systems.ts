// The two runtimes behind one interface: a request of n greedy tokens from prompt ids, EOS
// ignored, a callback per token as it streams.
//
//   llama.cpp  node-llama-cpp's prebuilt CPU binary (getLlama with build 'never': never a build
//              from source, nothing downloaded) on the GGUF file: one context of 16 sequences, a
//              sequence per request, which node-llama-cpp batches with the others in flight.
//   ortex      Engine.load on ortex's import of the same file (the built package, 'ortex').
//
// Both are loaded with dynamic imports, so a process loads only what it runs (the memory children
// load one).

import { readFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'

import type { Engine } from 'ortex'
import type { Llama, LlamaContext, LlamaModel, Token } from 'node-llama-cpp'

import type { SystemId } from './files'

export interface RunningSystem {
  id: SystemId
  /** Streams one request: `n` greedy tokens after `prompt`, EOS ignored; `onToken` at each token. */
  request(prompt: number[], n: number, onToken: (token: number) => void): Promise<void>
  tokenize(text: string): number[]
  /** What the runtime is and how it was set up (versions, threads, KV cache). */
  info: Record<string, unknown>
  close(): Promise<void>
}

export interface LoadOptions {
  /** Threads for the runtime's compute (ONNX Runtime intra-op threads, llama.cpp threads). */
  threads: number
  /** Requests in flight at most (ortex's maxBatchSize, llama.cpp's sequences). */
  maxConcurrency: number
  /** Prompt + generated tokens of the longest request (the KV space per sequence). */
  longestTokens: number
}

// ---- llama.cpp ---------------------------------------------------------------------------------

/** node-llama-cpp's own package version (its package.json is not among its exports). */
function nodeLlamaCppVersion(): string {
  const entry = fileURLToPath(import.meta.resolve('node-llama-cpp'))
  const root = entry.slice(0, entry.lastIndexOf('/dist/'))
  return (JSON.parse(readFileSync(`${root}/package.json`, 'utf8')) as { version: string }).version
}

export async function loadLlamaCpp(gguf: string, o: LoadOptions): Promise<RunningSystem> {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  // maxThreads 0: no thread splitting across contexts, so `threads` is exactly what runs.
  const llama: Llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.warn, maxThreads: 0 })
  let model: LlamaModel | null = null
  try {
    model = await llama.loadModel({ modelPath: gguf })
    // contextSize is per sequence: node-llama-cpp allocates contextSize x sequences cells.
    const context = await model.createContext({
      sequences: o.maxConcurrency,
      contextSize: Math.ceil(o.longestTokens / 256) * 256,
      threads: o.threads,
      batchSize: 512,
    })
    return llamaSystem(llama, model, context)
  } catch (error) {
    await model?.dispose()
    await llama.dispose()
    throw error
  }
}

function llamaSystem(llama: Llama, model: LlamaModel, context: LlamaContext): RunningSystem {
  return {
    id: 'llama.cpp',
    async request(prompt, n, onToken) {
      const sequence = context.getSequence()
      try {
        let count = 0
        // temperature 0: greedy. yieldEogToken: an end-of-generation token is yielded and the
        // generation goes on (evaluate() otherwise ends there), so EOS is ignored; we break at n.
        for await (const token of sequence.evaluate(prompt as Token[], { temperature: 0, yieldEogToken: true })) {
          onToken(token)
          if (++count >= n) break
        }
      } finally {
        // Frees the sequence's cells and returns its slot; asynchronous (it takes the context's
        // lock), and the next getSequence() finds no slot unless it finished.
        await sequence.dispose()
      }
    },
    tokenize: (text) => model.tokenize(text).map(Number),
    info: {
      nodeLlamaCpp: nodeLlamaCppVersion(),
      llamaCppRelease: llama.llamaCppRelease,
      buildType: llama.buildType,
      gpu: llama.gpu,
      cpuMathCores: llama.cpuMathCores,
      threads: context.currentThreads,
      idealThreads: context.idealThreads,
      sequences: context.totalSequences,
      contextSizePerSequence: context.contextSize,
      batchSize: context.batchSize,
      flashAttention: context.flashAttention,
      kvCacheType: `${String(context.kvCacheKeyType)}/${String(context.kvCacheValueType)}`,
      mmap: model.useMmap,
      systemInfo: llama.systemInfo,
    },
    async close() {
      await context.dispose()
      await model.dispose()
      await llama.dispose()
    },
  }
}

// ---- ortex -------------------------------------------------------------------------------------

const BLOCK_SIZE = 16

export async function loadOrtex(id: Exclude<SystemId, 'llama.cpp'>, folder: string, o: LoadOptions): Promise<RunningSystem> {
  const { Engine } = await import('ortex')
  const engine: Engine = await Engine.load(folder, {
    maxBatchSize: o.maxConcurrency,
    intraOpThreads: o.threads,
    // Spinning intra-op threads, as the throughput benchmark runs ortex (llama.cpp's threads spin too).
    intraOpSpinning: true,
    // Every request of the largest configuration resident at once, plus a block of slack each.
    numBlocks: o.maxConcurrency * (Math.ceil(o.longestTokens / BLOCK_SIZE) + 1),
    blockSize: BLOCK_SIZE,
  })
  const stats = engine.executorStats()
  return {
    id,
    async request(prompt, n, onToken) {
      const turn = engine.generate(prompt, { maxGeneratedTokens: n, ignoreEos: true })
      for await (const chunk of turn) onToken(chunk.token)
      const result = await turn.done
      if (result.finishReason !== 'max-generated-tokens') throw new Error(`ortex: a turn ended with ${result.finishReason}`)
    },
    tokenize: (text) => Array.from(engine.tokenize(text)),
    info: {
      folder,
      intraOpThreads: o.threads,
      intraOpSpinning: true,
      maxBatchSize: o.maxConcurrency,
      kvPositionBytes: stats?.kvPositionBytes ?? null,
      hugePageBytes: stats?.hugePageBytes ?? null,
      weightChunkBytes: stats?.weightChunkBytes ?? null,
    },
    close: () => engine.close(),
  }
}

export function loadSystem(id: SystemId, source: { gguf: string; ortex: Partial<Record<SystemId, string>> }, o: LoadOptions): Promise<RunningSystem> {
  if (id === 'llama.cpp') return loadLlamaCpp(source.gguf, o)
  const folder = source.ortex[id]
  if (folder === undefined) throw new Error(`no ortex folder for ${id}`)
  return loadOrtex(id, folder, o)
}
