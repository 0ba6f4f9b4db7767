// Reference generation on onnxruntime-node, straight on a model folder: no engine, no paging.
//
// - naiveGenerate / referenceGenerate: a plain single-request loop (batch 1, the previous step's
//   present fed back as past). Its greedy tokens are the ground truth that the engine's batched,
//   paged output must match token for token; the benchmark uses naiveGenerate as the "what
//   transformers.js-style code does" baseline.
// - forwardBatch: one model invocation over several rows with different past lengths, built with
//   the padding contract of docs/model-format.md (the one the engine's executor implements). The
//   tests use it to prove that batched rows equal each row alone.
// KV tensors are float32 or float16 (kept as their bits, Uint16Array), as the model declares;
// logits come back as Float32Array either way. A GroupQueryAttention layer with a windowed cache
// (sliding_window_cache = 1) gets a past exactly as wide as its window, as onnxruntime-genai gives
// it (the kernel then evicts in place): not the executor's way (docs/model-format.md), so the two
// check each other.

import ort from 'onnxruntime-node'
import type { InferenceSession, Tensor } from 'onnxruntime-node'
import onnxProto from 'onnx-proto'
import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { layerName, readModelConfig, type ModelConfig } from '../../ts/modelkit/genai-config'
import { F16_TO_F32 } from '../../ts/modelkit/gguf/dequantize'

/** A KV tensor's elements: float32 values or float16 bits. */
export type KvData = Float32Array | Uint16Array
export type KvType = 'float32' | 'float16'

/** Per layer, the sequence width of a windowed cache's past (sliding_window_cache = 1), read
 *  from the graph; 0 for an ordinary layer. */
function windowCacheWidths(modelFile: string, config: ModelConfig): number[] {
  const model = onnxProto.onnx.ModelProto.decode(readFileSync(modelFile))
  const widths = new Array<number>(config.numLayers).fill(0)
  for (const node of model.graph?.node ?? []) {
    if (node.opType !== 'GroupQueryAttention') continue
    const int = (name: string) => Number(node.attribute?.find((a) => a.name === name)?.i ?? 0)
    const layer = Array.from({ length: config.numLayers }, (_, l) => l).find((l) =>
      node.input?.includes(layerName(config.pastKeyNames, l)),
    )
    if (layer !== undefined && int('sliding_window_cache') === 1) widths[layer] = int('local_window_size')
  }
  return widths
}

/** float32 logits from a float32 or float16 tensor. */
export function floatData(t: Tensor): Float32Array {
  if (t.type === 'float32') return t.data as Float32Array
  const bits = t.data as Uint16Array
  const out = new Float32Array(bits.length)
  for (let i = 0; i < bits.length; i++) out[i] = F16_TO_F32[bits[i]!]!
  return out
}

export interface ReferenceLoadOptions {
  /** ONNX Runtime intra-op threads; default 1. */
  intraOpThreads?: number
  /** Intra-op threads spin between operators (and briefly after a run), as ortex's
   *  `intraOpSpinning`; default false. */
  intraOpSpinning?: boolean
}

export class ReferenceModel {
  private constructor(
    readonly config: ModelConfig,
    readonly session: InferenceSession,
    /** 'gqa' when the model takes no position_ids (GroupQueryAttention, rotary inside), else 'mha'. */
    readonly attention: 'mha' | 'gqa',
    /** The element type of past and present. */
    readonly kvType: KvType,
    /** Per layer: a windowed cache's past width, 0 for an ordinary layer. */
    readonly windowCaches: number[],
  ) {}

  static async load(modelDir: string, options: ReferenceLoadOptions = {}): Promise<ReferenceModel> {
    const config = readModelConfig(modelDir)
    const session = await ort.InferenceSession.create(join(modelDir, config.filename), {
      executionProviders: ['cpu'],
      intraOpNumThreads: options.intraOpThreads ?? 1,
      interOpNumThreads: 1,
      executionMode: 'sequential',
      graphOptimizationLevel: 'all',
      extra: {
        session: {
          intra_op: { allow_spinning: options.intraOpSpinning ? '1' : '0' },
          inter_op: { allow_spinning: '0' },
        },
      },
    })
    const past = session.inputMetadata.find((m) => m.name === layerName(config.pastKeyNames, 0))
    const kvType = past?.isTensor && past.type === 'float16' ? 'float16' : 'float32'
    const windowCaches = windowCacheWidths(join(modelDir, config.filename), config)
    return new ReferenceModel(config, session, config.positionIds ? 'mha' : 'gqa', kvType, windowCaches)
  }

  /** `n` zero KV elements of the model's type. */
  kvZeros(n: number): KvData {
    return this.kvType === 'float16' ? new Uint16Array(n) : new Float32Array(n)
  }

  kvTensor(data: KvData, dims: number[]): Tensor {
    return new ort.Tensor(this.kvType, data, dims)
  }

  /** Past tensors for a batch with nothing in them: of length 0, or a windowed cache's width. */
  emptyPast(batch: number): Record<string, Tensor> {
    const c = this.config
    const feeds: Record<string, Tensor> = {}
    for (let l = 0; l < c.numLayers; l++) {
      const dims = [batch, c.numKvHeads, this.windowCaches[l]!, c.headSize]
      const n = dims.reduce((a, b) => a * b, 1)
      feeds[layerName(c.pastKeyNames, l)] = this.kvTensor(this.kvZeros(n), dims)
      feeds[layerName(c.pastValueNames, l)] = this.kvTensor(this.kvZeros(n), dims)
    }
    return feeds
  }

  async run(feeds: Record<string, Tensor>): Promise<Record<string, Tensor>> {
    return this.session.run(feeds)
  }

  async release(): Promise<void> {
    await this.session.release()
  }
}

export interface GenerateOptions {
  greedy?: true
  /** Keep going after an EOS token (default false: stop after emitting it). */
  ignoreEos?: boolean
  /** Called with each new token as soon as it is known. */
  onToken?: (token: number, index: number) => void
  /** Chooses the next token from the last position's logits; default greedy (lowest id on ties). */
  pick?: (logits: Float32Array) => number
}

/** Index of the largest value; the lowest index wins ties. */
export function argmax(values: ArrayLike<number>, start = 0, end = values.length): number {
  let best = start
  let bestValue = values[start]!
  for (let i = start + 1; i < end; i++) {
    if (values[i]! > bestValue) {
      bestValue = values[i]!
      best = i
    }
  }
  return best - start
}

const i64 = (values: number[], dims: number[]) => new ort.Tensor('int64', BigInt64Array.from(values, BigInt), dims)

/**
 * The plain single-request loop: prefill the whole prompt in one run (batch 1, empty past), then
 * one run per new token with the previous present as past and an all-ones attention mask.
 */
export async function naiveGenerate(
  model: ReferenceModel,
  promptTokens: ArrayLike<number>,
  maxNewTokens: number,
  options: GenerateOptions = {},
): Promise<number[]> {
  const c = model.config
  const prompt = Array.from(promptTokens)
  if (prompt.length === 0) throw new Error('the prompt must have at least one token')
  if (prompt.length + maxNewTokens > c.contextLength) throw new Error('prompt + new tokens exceed the context length')
  const pick = options.pick ?? ((logits: Float32Array) => argmax(logits))
  const out: number[] = []
  let past = model.emptyPast(1)
  let pastLen = 0
  let input = prompt
  while (out.length < maxNewTokens) {
    const S = input.length
    const feeds: Record<string, Tensor> = { ...past }
    feeds[c.inputIds] = i64(input, [1, S])
    feeds[c.attentionMask] = i64(new Array(pastLen + S).fill(1), [1, pastLen + S])
    if (c.positionIds) feeds[c.positionIds] = i64(Array.from({ length: S }, (_, j) => pastLen + j), [1, S])
    const result = await model.run(feeds)
    const logits = floatData(result[c.logits]!)
    const V = c.vocabSize
    const token = pick(logits.subarray((S - 1) * V, S * V))
    for (const t of Object.values(past)) t.dispose()
    past = {}
    for (let l = 0; l < c.numLayers; l++) {
      past[layerName(c.pastKeyNames, l)] = result[layerName(c.presentKeyNames, l)]!
      past[layerName(c.pastValueNames, l)] = result[layerName(c.presentValueNames, l)]!
    }
    result[c.logits]!.dispose()
    pastLen += S
    out.push(token)
    options.onToken?.(token, out.length - 1)
    if (!options.ignoreEos && c.eosTokenIds.includes(token)) break
    input = [token]
  }
  for (const t of Object.values(past)) t.dispose()
  return out
}

/** Loads `modelDir`, runs naiveGenerate greedily, releases the session. */
export async function referenceGenerate(
  modelDir: string,
  promptTokens: ArrayLike<number>,
  maxNewTokens: number,
  options: GenerateOptions & ReferenceLoadOptions = {},
): Promise<number[]> {
  const model = await ReferenceModel.load(modelDir, options)
  try {
    return await naiveGenerate(model, promptTokens, maxNewTokens, options)
  } finally {
    await model.release()
  }
}

/** One sequence's KV cache, per layer [num_kv_heads, length, head_size] (contiguous), in the
 *  model's KV type. */
export interface KvCache {
  length: number
  keys: KvData[]
  values: KvData[]
}

export function emptyCache(model: ReferenceModel): KvCache {
  const layers = model.config.numLayers
  return {
    length: 0,
    keys: Array.from({ length: layers }, () => model.kvZeros(0)),
    values: Array.from({ length: layers }, () => model.kvZeros(0)),
  }
}

export interface BatchRow {
  cache: KvCache
  /** New tokens of this row (at least one). */
  tokens: number[]
}

export interface BatchRowResult {
  /** Logits of each new token, [tokens.length][vocab]. */
  logits: Float32Array[]
  /** The row's cache extended with the new tokens' keys and values. */
  cache: KvCache
}

/**
 * Runs several rows in one invocation with the padding contract of docs/model-format.md:
 * P = longest past, S = most new tokens; past right-padded to P with zeros; new tokens
 * right-padded to S with pad_token_id; attention_mask [B, P + S] = 1 on the row's past
 * [0, past) and on its new tokens [P, P + n), 0 elsewhere; position_ids = past + j.
 * New keys/values are read back from present at P + j ('mha': present = [past ; new]) or at
 * past + j ('gqa': GroupQueryAttention writes each row at its own past length). A windowed cache's
 * past is max(window, P + S) wide (so the kernel evicts nothing and the layout is the same).
 */
export async function forwardBatch(model: ReferenceModel, rows: BatchRow[]): Promise<BatchRowResult[]> {
  const shape = batchShape(model, rows)
  const feeds = { ...inputFeeds(model.config, rows, shape), ...pastFeeds(model, rows, shape) }
  const result = await model.run(feeds)
  const out = rows.map((r, b) => rowResult(model, result, r, b, shape))
  for (const t of Object.values(result)) t.dispose()
  return out
}

/** B rows, P = longest past, S = most new tokens, T = P + S (the attention mask's width). */
interface BatchShape {
  B: number
  P: number
  S: number
  T: number
}

function batchShape(model: ReferenceModel, rows: BatchRow[]): BatchShape {
  const B = rows.length
  if (B === 0) throw new Error('forwardBatch needs at least one row')
  const P = Math.max(...rows.map((r) => r.cache.length))
  const S = Math.max(...rows.map((r) => r.tokens.length))
  if (model.attention === 'gqa' && S > 1 && P > 0 && B > 1) {
    throw new Error('GroupQueryAttention: rows with past context and more than one new token must run as batch 1')
  }
  if (model.windowCaches.some((w) => w > 0) && S > 1 && B > 1) {
    throw new Error('GroupQueryAttention with a windowed cache: rows with more than one new token must run as batch 1')
  }
  if (rows.some((r) => r.tokens.length === 0)) throw new Error('every row needs at least one new token')
  return { B, P, S, T: P + S }
}

/**
 * input_ids [B, S] right-padded with pad_token_id; attention_mask [B, T], 1 on the row's past
 * and on its n new tokens:
 *
 *   row b:  1 ... 1   0 ... 0 | 1 ... 1   0 ... 0
 *           its past  padding | its new   padding
 *           |<------- P ----->|<------- S ------>|
 *
 * position_ids [B, S] = past + j (only for models that take them).
 */
function inputFeeds(c: ModelConfig, rows: BatchRow[], { B, P, S, T }: BatchShape): Record<string, Tensor> {
  const ids = new Array<number>(B * S).fill(c.padTokenId)
  const mask = new Array<number>(B * T).fill(0)
  const pos = new Array<number>(B * S).fill(0)
  rows.forEach((r, b) => {
    for (let i = 0; i < r.cache.length; i++) mask[b * T + i] = 1
    r.tokens.forEach((t, j) => {
      ids[b * S + j] = t
      mask[b * T + P + j] = 1
      pos[b * S + j] = r.cache.length + j
    })
  })
  const feeds: Record<string, Tensor> = {
    [c.inputIds]: i64(ids, [B, S]),
    [c.attentionMask]: i64(mask, [B, T]),
  }
  if (c.positionIds) feeds[c.positionIds] = i64(pos, [B, S])
  return feeds
}

/** Every layer's past keys and values [B, KH, width, D], each row's cache right-padded with
 *  zeros; width is P, or max(window, T) for a windowed cache. */
function pastFeeds(model: ReferenceModel, rows: BatchRow[], { B, P, T }: BatchShape): Record<string, Tensor> {
  const c = model.config
  const { numKvHeads: KH, headSize: D } = c
  const feeds: Record<string, Tensor> = {}
  for (let l = 0; l < c.numLayers; l++) {
    const width = model.windowCaches[l]! > 0 ? Math.max(model.windowCaches[l]!, T) : P
    for (const [template, pick] of [
      [c.pastKeyNames, (r: BatchRow) => r.cache.keys[l]!],
      [c.pastValueNames, (r: BatchRow) => r.cache.values[l]!],
    ] as const) {
      const data = model.kvZeros(B * KH * width * D)
      rows.forEach((r, b) => {
        const src = pick(r)
        const len = r.cache.length
        for (let h = 0; h < KH; h++) {
          data.set(src.subarray(h * len * D, (h + 1) * len * D) as never, ((b * KH + h) * width) * D)
        }
      })
      feeds[layerName(template, l)] = model.kvTensor(data, [B, KH, width, D])
    }
  }
  return feeds
}

/** Row b's logits per new token, and its cache extended with the new keys and values. */
function rowResult(model: ReferenceModel, result: Record<string, Tensor>, r: BatchRow, b: number, { P, S }: BatchShape): BatchRowResult {
  const c = model.config
  const V = c.vocabSize
  const n = r.tokens.length
  const past = r.cache.length
  // Where the new keys and values stand in present: 'mha' appends them to the padded past
  // (present = [past ; new]), 'gqa' (GroupQueryAttention) writes each row at its own past length.
  const at = model.attention === 'mha' ? P : past
  const extend = (old: KvData, present: Tensor) => extendCache(model, old, present, { b, past, n, at })
  const logits = floatData(result[c.logits]!)
  return {
    logits: Array.from({ length: n }, (_, j) => logits.slice((b * S + j) * V, (b * S + j + 1) * V)),
    cache: {
      length: past + n,
      keys: r.cache.keys.map((k, l) => extend(k, result[layerName(c.presentKeyNames, l)]!)),
      values: r.cache.values.map((v, l) => extend(v, result[layerName(c.presentValueNames, l)]!)),
    },
  }
}

/** One layer's cache of row b (`past` tokens) followed by its `n` new entries from present at `at`. */
function extendCache(
  model: ReferenceModel,
  old: KvData,
  presentTensor: Tensor,
  { b, past, n, at }: { b: number; past: number; n: number; at: number },
): KvData {
  const { numKvHeads: KH, headSize: D } = model.config
  const present = presentTensor.data as KvData
  const width = presentTensor.dims[2]! // P + S for both forms; a windowed cache's width
  const next = model.kvZeros(KH * (past + n) * D)
  for (let h = 0; h < KH; h++) {
    next.set(old.subarray(h * past * D, (h + 1) * past * D) as never, h * (past + n) * D)
    const from = ((b * KH + h) * width + at) * D
    next.set(present.subarray(from, from + n * D) as never, (h * (past + n) + past) * D)
  }
  return next
}
