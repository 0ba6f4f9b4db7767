// Runs a paged folder (docs/model-format.md, "The paged form") on onnxruntime-node, packing the
// inputs as the executor does: every row's new tokens on one axis, each layer's cache a pool of
// blocks that the caller owns (the present comes back and replaces it, as the executor's one
// buffer bound to both), block tables, cumulative and past lengths, attention_metadata and the
// packed indices whose logits are wanted. No engine: a test oracle and a check of the contract.

import ort from 'onnxruntime-node'
import type { InferenceSession, Tensor } from 'onnxruntime-node'
import { join } from 'node:path'
import { layerName, readModelConfig, type ModelConfig } from '../../ts/modelkit/genai-config'
import { floatData, type KvData, type KvType } from './reference'

export interface PagedRow {
  /** The row's blocks in order (block_table row). */
  blocks: number[]
  /** Positions already in the cache. */
  past: number
  /** New tokens (at least one). */
  tokens: number[]
}

export class PagedModel {
  private constructor(
    readonly config: ModelConfig,
    readonly session: InferenceSession,
    readonly blockSize: number,
    readonly kvType: KvType,
  ) {}

  static async load(dir: string): Promise<PagedModel> {
    const config = readModelConfig(dir)
    if (!config.paged) throw new Error(`${dir} is not a paged folder`)
    const session = await ort.InferenceSession.create(join(dir, config.filename), {
      executionProviders: ['cpu'],
      intraOpNumThreads: 1,
      interOpNumThreads: 1,
      executionMode: 'sequential',
      graphOptimizationLevel: 'all',
    })
    const past = session.inputMetadata.find((m) => m.name === layerName(config.pastKeyNames, 0))
    const kvType = past?.isTensor && past.type === 'float16' ? 'float16' : 'float32'
    return new PagedModel(config, session, config.paged.blockSize, kvType)
  }

  /** Elements of one block of one layer's key (or value) cache. */
  get blockElements(): number {
    return this.blockSize * this.config.numKvHeads * this.config.headSize
  }

  /** Every layer's key and value pool of `numBlocks` blocks, each element `fill` (float32) or
   *  its float16 bits. */
  pool(numBlocks: number, fill = 0): PagedPool {
    const n = numBlocks * this.blockElements
    const make = (): KvData => (this.kvType === 'float16' ? new Uint16Array(n).fill(fill) : new Float32Array(n).fill(fill))
    const layers = this.config.numLayers
    return { numBlocks, keys: Array.from({ length: layers }, make), values: Array.from({ length: layers }, make) }
  }

  /**
   * One invocation over `rows`; returns the logits of the packed positions `logitsIndices`
   * ([num_logits][vocab]) and writes the presents back into `pool`. `inPlace`: each present is
   * bound to its past's own tensor (one buffer, as the executor binds them), so the graph writes
   * the pool where it is; otherwise the presents come back as new arrays that replace the pool's.
   */
  async run(pool: PagedPool, rows: PagedRow[], logitsIndices: number[], options: { inPlace?: boolean } = {}): Promise<Float32Array[]> {
    const c = this.config
    const feeds: Record<string, Tensor> = { ...packedInputs(rows, logitsIndices, this.blockSize) }
    const fetches: Record<string, Tensor | null> = { [c.logits]: null }
    const dims = [pool.numBlocks, this.blockSize, c.numKvHeads, c.headSize]
    for (let l = 0; l < c.numLayers; l++) {
      for (const [past, present, data] of [
        [c.pastKeyNames, c.presentKeyNames, pool.keys[l]!],
        [c.pastValueNames, c.presentValueNames, pool.values[l]!],
      ] as const) {
        const tensor = new ort.Tensor(this.kvType, data, dims)
        feeds[layerName(past, l)] = tensor
        fetches[layerName(present, l)] = options.inPlace ? tensor : null
      }
    }
    const result = await this.session.run(feeds, fetches)
    // In place the pool's own arrays were written (onnxruntime-node hands back copies of them).
    for (let l = 0; l < c.numLayers && !options.inPlace; l++) {
      pool.keys[l] = result[layerName(c.presentKeyNames, l)]!.data as KvData
      pool.values[l] = result[layerName(c.presentValueNames, l)]!.data as KvData
    }
    const logits = floatData(result[c.logits]!)
    const V = c.vocabSize
    return logitsIndices.map((_, i) => logits.slice(i * V, (i + 1) * V))
  }

  async release(): Promise<void> {
    await this.session.release()
  }
}

export interface PagedPool {
  numBlocks: number
  keys: KvData[]
  values: KvData[]
}

const i32 = (values: number[], dims: number[]) => new ort.Tensor('int32', Int32Array.from(values), dims)

/** input_ids, block_table (unused entries 0), cumulative_sequence_lengths, past_sequence_lengths,
 *  attention_metadata (exact bounds for this one invocation: [max new tokens of a row, max past
 *  + new, the same as the largest's lower bound]), logits_indices. */
export function packedInputs(rows: PagedRow[], logitsIndices: number[], blockSize: number): Record<string, Tensor> {
  const width = Math.max(...rows.map((r) => r.blocks.length))
  for (const r of rows) {
    if (r.blocks.length * blockSize < r.past + r.tokens.length) throw new Error('a row has too few blocks for its positions')
  }
  const table = rows.flatMap((r) => [...r.blocks, ...new Array<number>(width - r.blocks.length).fill(0)])
  const cumulative = [0]
  for (const r of rows) cumulative.push(cumulative.at(-1)! + r.tokens.length)
  const totals = rows.map((r) => r.past + r.tokens.length)
  return {
    input_ids: new ort.Tensor('int64', BigInt64Array.from(rows.flatMap((r) => r.tokens), BigInt), [cumulative.at(-1)!]),
    block_table: i32(table, [rows.length, width]),
    cumulative_sequence_lengths: i32(cumulative, [rows.length + 1]),
    past_sequence_lengths: i32(rows.map((r) => r.past), [rows.length]),
    attention_metadata: i32([Math.max(...rows.map((r) => r.tokens.length)), Math.max(...totals), Math.max(...totals)], [3]),
    logits_indices: i32(logitsIndices, [logitsIndices.length]),
  }
}
