// Which tensors the imported folder's data file holds, and how each is made from the GGUF file:
//
//   embedding, norms, biases   float32, dequantized (q/k biases of llama put in head order; a
//                              fused qkv bias's range of elements)
//   linear, --weights fp32     float32 [in, out] for MatMul: dequantized rows, unpermuted,
//                              transposed (the whole tensor is held once, as float32)
//   linear, --weights int4     MatMulNBits qweight / scales / qzeros (+ mins), int4.ts: 4-bit
//                              blocks, the file's own for Q4_0/Q4_1/Q4_K, requantized from
//                              float ones; the 5-, 6- and 8-bit types (Q5_0, Q5_1, Q5_K, Q6_K,
//                              Q8_0: also a tied lm_head's embedding) as 8-bit blocks, exactly
//                              (int8.ts): qweight / scales (+ mins)
//   cos_cache<suffix>, sin_cache<suffix>
//                              [context, dims / 2] rotary tables from the metadata, one pair
//                              per table of the plan (the global one without a suffix)
// A linear weight may be a range of a fused tensor's rows (attn_qkv, Phi-3's ffn_up): rows are
// read from that range, so its blocks stay whole.
//
// Tensors are produced one at a time, in layout order, as chunks for the data file writer; at most
// one converted tensor is in memory.

import { DataType } from '../onnx-builder'
import type { LinearStorage } from '../decoder'
import type { TensorSpec } from '../weights'
import { planExperts } from './experts'
import { type ModelPlan, type RotaryPlan, type SourceTensor, inverseFrequencies, permutedRow } from './architecture'
import { dequantize } from './dequantize'
import { GgmlTypeId } from './ggml-types'
import { hasMinimums, mapsExactly, packInt4 } from './int4'
import { int8BlockSize, int8HasMinimums, mapsToInt8, packInt8 } from './int8'
import type { GgufData, GgufTensorInfo } from './reader'

/** How a source tensor was written: its values as float32, or as MatMulNBits blocks (its own or requantized). */
export type Mapping = 'dequantized' | 'exact' | 'requantized'

export interface PlannedTensor {
  specs: TensorSpec[]
  /** The GGUF tensor it comes from (none for the rotary tables) and how it is written. */
  source?: GgufTensorInfo
  mapping?: Mapping
  /** The bytes of each spec, in order: [spec index, chunk]. */
  chunks: (data: GgufData) => Iterable<[number, Uint8Array]>
}

const ROWS_PER_READ = 256

export function planTensors(plan: ModelPlan, storage: LinearStorage): PlannedTensor[] {
  const out: PlannedTensor[] = []
  const int4 = storage.kind === 'int4'
  for (const t of plan.tensors) {
    if (t.role === 'linear' && int4) out.push(blocksTensor(t.name.replace(/\.weight$/, ''), t))
    else if (t.role === 'linear') out.push(transposedTensor(t))
    else out.push(rowsTensor(t))
  }
  if (plan.tiedEmbeddings && int4) out.push(blocksTensor('lm_head', plan.tensors.find((t) => t.role === 'embedding')!))
  plan.experts?.layers.forEach((sources, l) => out.push(...planExperts(sources, `model.layers.${l}.mlp`, plan.experts!.dims, storage)))
  out.push(...rotaryTables(plan))
  return out
}

/**
 * A linear weight as MatMulNBits blocks: the file's own blocks, 4-bit ones as they are and 5-, 6-
 * and 8-bit ones as 8-bit blocks (exactly: the lm_head is where 4 bits cost the most, SmolLM2's
 * answers changed, and Q4_K_M files keep Q6_K and Q5_0 where they matter); float weights are
 * quantized to 4 bits.
 */
function blocksTensor(proj: string, t: SourceTensor): PlannedTensor {
  return mapsToInt8(t.source.type) ? int8Tensor(proj, t) : int4Tensor(proj, t)
}

/** The rows the weight has: its range of a fused tensor, or all of the source's (a bias's rows
 *  are its elements). */
function rowCount(t: SourceTensor): number {
  return t.rows?.count ?? (t.role === 'bias' ? t.source.elements : t.source.elements / t.source.dims[0]!)
}

/** Source row of output row r (a fused tensor's range; llama's permuted q/k rows, see architecture.ts). */
function sourceRow(t: SourceTensor, r: number): number {
  const first = t.rows?.first ?? 0
  return first + (t.unpermuteHeadSize === undefined ? r : permutedRow(r, t.unpermuteHeadSize))
}

/** Dequantized rows [first, first + count) of t, in output order, into out. */
function readRows(data: GgufData, t: SourceTensor, first: number, count: number, out: Float32Array): void {
  const K = t.source.dims[0]!
  if (t.unpermuteHeadSize === undefined) {
    dequantize(t.source.type, data.rows(t.source, sourceRow(t, first), count), count * K, out)
    return
  }
  for (let r = 0; r < count; r++) dequantize(t.source.type, data.rows(t.source, sourceRow(t, first + r), 1), K, out, r * K)
}

function asBytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
}

/** Embedding, norms, biases: the rows as they are (a bias is one row per element). */
function rowsTensor(t: SourceTensor): PlannedTensor {
  const rows = t.source.elements / t.source.dims[0]!
  const K = t.source.dims[0]!
  const isBias = t.role === 'bias'
  const dims = t.role === 'embedding' ? [rows, K] : [isBias ? rowCount(t) : t.source.elements]
  return {
    specs: [{ name: t.name, dims }],
    source: t.source,
    mapping: 'dequantized',
    *chunks(data) {
      if (isBias) {
        // A bias is one row of values: its range of a fused bias, in head order (like q/k rows).
        const values = new Float32Array(t.source.elements)
        dequantize(t.source.type, data.rows(t.source, 0, 1), t.source.elements, values)
        yield [0, asBytes(Float32Array.from({ length: rowCount(t) }, (_, i) => values[sourceRow(t, i)]!))]
        return
      }
      const step = Math.max(1, Math.floor(ROWS_PER_READ * 1024 / K))
      const buffer = new Float32Array(step * K)
      for (let first = 0; first < rows; first += step) {
        const count = Math.min(step, rows - first)
        readRows(data, t, first, count, buffer)
        yield [0, asBytes(buffer.subarray(0, count * K))]
      }
    },
  }
}

/** A linear weight for MatMul: GGUF [out rows][in] -> float32 [in, out]. */
function transposedTensor(t: SourceTensor): PlannedTensor {
  const N = rowCount(t)
  const K = t.source.dims[0]!
  return {
    specs: [{ name: t.name, dims: [K, N] }],
    source: t.source,
    mapping: 'dequantized',
    *chunks(data) {
      const out = new Float32Array(K * N)
      const rows = new Float32Array(ROWS_PER_READ * K)
      for (let first = 0; first < N; first += ROWS_PER_READ) {
        const count = Math.min(ROWS_PER_READ, N - first)
        readRows(data, t, first, count, rows)
        for (let r = 0; r < count; r++) {
          const n = first + r
          for (let k = 0; k < K; k++) out[k * N + n] = rows[r * K + k]!
        }
      }
      yield [0, asBytes(out)]
    },
  }
}

/** A linear weight for MatMulNBits, named `<proj>.qweight` etc. (decoder.ts's int4 storage). */
function int4Tensor(proj: string, t: SourceTensor): PlannedTensor {
  const N = rowCount(t)
  const K = t.source.dims[0]!
  if (K % 32 !== 0) throw new Error(`${t.source.name}: rows of ${K} elements cannot be 4-bit blocks of 32`)
  const blocks = K / 32
  const withMins = hasMinimums(t.source.type)
  const specs: TensorSpec[] = [
    { name: `${proj}.qweight`, dims: [N, blocks, 16], dataType: DataType.UINT8 },
    { name: `${proj}.scales`, dims: [N, blocks] },
    { name: `${proj}.qzeros`, dims: [N, Math.ceil(blocks / 2)], dataType: DataType.UINT8 },
  ]
  if (withMins) specs.push({ name: `${proj}.mins`, dims: [blocks, N] })
  return {
    specs,
    source: t.source,
    mapping: mapsExactly(t.source.type) ? 'exact' : 'requantized',
    *chunks(data) {
      const w = packInt4(t.source.type, N, K, (n) => data.rows(t.source, sourceRow(t, n), 1))
      yield [0, w.qweight]
      yield [1, asBytes(w.scales)]
      yield [2, w.qzeros]
      if (w.mins) yield [3, asBytes(w.mins)]
    },
  }
}

/** A 5-, 6- or 8-bit linear weight as 8-bit MatMulNBits blocks, `<proj>.qweight` [N, K/bs, bs],
 *  `<proj>.scales` (no zero points: 128) and `<proj>.mins` [K/bs, N] for the types with minimums. */
function int8Tensor(proj: string, t: SourceTensor): PlannedTensor {
  const N = rowCount(t)
  const K = t.source.dims[0]!
  const bs = int8BlockSize(t.source.type)
  if (K % bs !== 0) throw new Error(`${t.source.name}: rows of ${K} elements cannot be 8-bit blocks of ${bs}`)
  const blocks = K / bs
  const specs: TensorSpec[] = [
    { name: `${proj}.qweight`, dims: [N, blocks, bs], dataType: DataType.UINT8 },
    { name: `${proj}.scales`, dims: [N, blocks] },
  ]
  if (int8HasMinimums(t.source.type)) specs.push({ name: `${proj}.mins`, dims: [blocks, N] })
  return {
    specs,
    source: t.source,
    mapping: 'exact',
    *chunks(data) {
      const w = packInt8(t.source.type, N, K, (n) => data.rows(t.source, sourceRow(t, n), 1))
      yield [0, w.qweight]
      yield [1, asBytes(w.scales)]
      if (w.mins) yield [2, asBytes(w.mins)]
    },
  }
}

/** Positions of a rotary table computed at a time: a long context's table is never held whole. */
const POSITIONS_PER_CHUNK = 4096

/** Each table's cos/sin [context, dims / 2] of p * invFreq[i] (times its magnitude), in chunks of positions. */
function rotaryTables(plan: ModelPlan): PlannedTensor[] {
  return plan.rotaries.flatMap((table) => [
    rotaryTable(plan, table, `cos_cache${table.suffix}`, Math.cos),
    rotaryTable(plan, table, `sin_cache${table.suffix}`, Math.sin),
  ])
}

function rotaryTable(plan: ModelPlan, table: RotaryPlan, name: string, fn: (x: number) => number): PlannedTensor {
  const context = plan.dims.contextLength
  const half = table.dims / 2
  const factors = table.frequencyFactors
  return {
    specs: [{ name, dims: [context, half] }],
    *chunks(data) {
      const divisors = factors ? new Float32Array(data.rows(factors, 0, 1).buffer.slice(0)) : undefined
      const invFreq = inverseFrequencies(table, divisors)
      const values = new Float32Array(Math.min(POSITIONS_PER_CHUNK, context) * half)
      for (let first = 0; first < context; first += POSITIONS_PER_CHUNK) {
        const count = Math.min(POSITIONS_PER_CHUNK, context - first)
        for (let r = 0; r < count; r++) for (let i = 0; i < half; i++) values[r * half + i] = table.magnitude * fn((first + r) * invFreq[i]!)
        yield [0, asBytes(values.subarray(0, count * half))]
      }
    },
  }
}
