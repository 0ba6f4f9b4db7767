// Next-token log-probabilities at every position of a token sequence, from each system, chunk by
// chunk with the past carried between chunks (every position sees the whole text before it):
//
//   ortex folder  its model.onnx on onnxruntime-node (the ONNX Runtime library the engine runs),
//                 batch 1: chunk k's past is chunk k-1's present, in the folder's KV type, so a
//                 float16 folder's later chunks read the rounded keys and values the engine keeps
//   llama.cpp     node-llama-cpp's prebuilt CPU binary on the GGUF file: one sequence, each
//                 chunk's tokens evaluated with `generateNext.logits` (the raw logits of the whole
//                 vocabulary: the sampler is greedy, which reorders nothing and drops nothing).
//                 Slow: per position the addon sorts the vocabulary and hands it to JavaScript
//                 as an array of (token, logit) pairs that node-llama-cpp turns into a Map, some
//                 tens of milliseconds a position; there is no cheaper way to the full
//                 distribution in its API (`probabilities` takes the same path)
//
// Both are given the same ids (ortex's tokenization of the text), and hand each chunk's rows of
// logits, turned into log-probabilities in place, to `onChunk`.

import ort, { type Tensor } from 'onnxruntime-node'
import type { LlamaContextSequence, Token } from 'node-llama-cpp'

import { layerName } from '../../ts/modelkit/genai-config'
import { ReferenceModel, floatData } from '../../test/reference/reference'
import { logSoftmaxInPlace } from './metrics'

export interface EvaluateOptions {
  /** Tokens per model run. */
  chunk: number
  /** Intra-op threads (ONNX Runtime) or llama.cpp threads. */
  threads: number
}

/** Called once per chunk: log-probabilities of positions [start, start + n), n x vocab. */
export type OnChunk = (start: number, logProbs: Float32Array, vocab: number) => void

export interface EvaluateInfo {
  vocab: number
  seconds: number
  /** What the runtime was (versions, KV type). */
  runtime: Record<string, unknown>
}

export async function evaluateFolder(dir: string, tokens: number[], o: EvaluateOptions, onChunk: OnChunk): Promise<EvaluateInfo> {
  const model = await ReferenceModel.load(dir, { intraOpThreads: o.threads })
  const c = model.config
  const started = performance.now()
  let past = model.emptyPast(1)
  try {
    for (let start = 0; start < tokens.length; start += o.chunk) {
      const ids = tokens.slice(start, start + o.chunk)
      const feeds: Record<string, Tensor> = { ...past, ...chunkInputs(c.inputIds, c.attentionMask, ids, start) }
      const result = await model.run(feeds)
      const logits = floatData(result[c.logits]!)
      logSoftmaxInPlace(logits, c.vocabSize)
      onChunk(start, logits, c.vocabSize)
      result[c.logits]!.dispose()
      for (const t of Object.values(past)) t.dispose()
      past = {}
      for (let l = 0; l < c.numLayers; l++) {
        past[layerName(c.pastKeyNames, l)] = result[layerName(c.presentKeyNames, l)]!
        past[layerName(c.pastValueNames, l)] = result[layerName(c.presentValueNames, l)]!
      }
    }
    return { vocab: c.vocabSize, seconds: (performance.now() - started) / 1000, runtime: { onnxruntimeNode: ortVersion(), kv: model.kvType } }
  } finally {
    for (const t of Object.values(past)) t.dispose()
    await model.release()
  }
}

/** input_ids [1, S] and an all-ones attention_mask over the past and the chunk [1, start + S]. */
function chunkInputs(inputIds: string, attentionMask: string, ids: number[], start: number): Record<string, Tensor> {
  return {
    [inputIds]: new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, ids.length]),
    [attentionMask]: new ort.Tensor('int64', new BigInt64Array(start + ids.length).fill(1n), [1, start + ids.length]),
  }
}

const ortVersion = () => ort.env.versions.common

/** `vocab`: the folder's vocabulary size, which every row of llama.cpp's must cover. */
export async function evaluateLlamaCpp(gguf: string, tokens: number[], vocab: number, o: EvaluateOptions, onChunk: OnChunk): Promise<EvaluateInfo> {
  const { GgmlType, getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  // As bench/llama-cpp loads it: the prebuilt CPU binary, never a build; maxThreads 0: `threads` is what runs.
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.warn, maxThreads: 0 })
  try {
    const model = await llama.loadModel({ modelPath: gguf })
    try {
      const context = await model.createContext({ sequences: 1, contextSize: Math.ceil(tokens.length / 256) * 256 + 256, threads: o.threads, batchSize: o.chunk })
      try {
        const sequence = context.getSequence()
        const started = performance.now()
        for (let start = 0; start < tokens.length; start += o.chunk) {
          const ids = tokens.slice(start, start + o.chunk)
          const out = await sequence.controlledEvaluate(ids.map((id) => [id as Token, { generateNext: { logits: true } }]))
          onChunk(start, chunkRows(out, ids.length, vocab), vocab)
        }
        const seconds = (performance.now() - started) / 1000
        return {
          vocab,
          seconds,
          runtime: {
            llamaCppRelease: llama.llamaCppRelease,
            buildType: llama.buildType,
            kvCacheType: `${GgmlType[context.kvCacheKeyType]}/${GgmlType[context.kvCacheValueType]}`,
            flashAttention: context.flashAttention,
          },
        }
      } finally {
        await context.dispose()
      }
    } finally {
      await model.dispose()
    }
  } finally {
    await llama.dispose()
  }
}

type ControlledOutput = Awaited<ReturnType<LlamaContextSequence['controlledEvaluate']>>

/** A chunk's logits maps (token -> logit, every token of the vocabulary) as log-probability rows. */
function chunkRows(out: ControlledOutput, n: number, vocab: number): Float32Array {
  const rows = new Float32Array(n * vocab)
  for (let j = 0; j < n; j++) {
    const logits = out[j]?.next.logits
    if (logits === undefined || logits.size !== vocab) throw new Error(`llama.cpp gave ${logits?.size ?? 'no'} logits at position ${j} of a chunk, not the vocabulary's ${vocab}`)
    const row = rows.subarray(j * vocab, (j + 1) * vocab)
    for (const [token, logit] of logits) row[token] = logit
  }
  logSoftmaxInPlace(rows, vocab)
  return rows
}
