// A mixture-of-experts layer's GGUF tensors -> the initializers of ts/modelkit/moe.ts.
//
// llama.cpp's converter stacks each layer's experts into one 3-D tensor per projection
// (convert_hf_to_gguf.py, Qwen2MoeModel: torch.stack of the experts' [F, H] weights), which ggml
// reads as rows of the input with the expert outermost:
//
//   blk.N.ffn_gate_inp.weight    [H, E]        E rows of H: the router
//   blk.N.ffn_gate_exps.weight   [H, F, E]     expert e's gate: rows e F .. e F + F - 1
//   blk.N.ffn_up_exps.weight     [H, F, E]     likewise
//   blk.N.ffn_down_exps.weight   [F, H, E]     expert e's down: rows e H .. e H + H - 1
//
// So an expert's projection is a run of whole rows, in the file's type, as a 2-D linear weight is:
//
//   router          float32 [H, E], dequantized and transposed (llama.cpp's quantizer keeps it F32)
//   fp32 experts    gate_up_proj.weight [H, 2F] (gate's columns, then up's), down_proj.weight [F, H]
//   int4 experts    MatMulNBits blocks per expert (int4.ts): Q4_0 / Q4_1 / Q4_K exactly, other
//                   types requantized; gate's rows then up's in one gate_up_proj (its mins, where
//                   either has them, zero for the other's rows)
//
// One expert is converted at a time.

import { OrtexError } from '../../errors'
import { type ExpertDims, type ExpertStorage, expertProjectionName, routerWeightName } from '../moe'
import { DataType } from '../onnx-builder'
import type { TensorSpec } from '../weights'
import { canDequantize, dequantize } from './dequantize'
import { ggmlTypeName } from './ggml-types'
import { type Int4Weight, hasMinimums, mapsExactly, packInt4 } from './int4'
import { type GgufData, type GgufFile, type GgufTensorInfo, Metadata } from './reader'
import type { PlannedTensor } from './tensors'

/** llama.cpp's LLAMA_MAX_EXPERTS. */
export const MAX_EXPERTS = 1024

export interface ExpertSources {
  router: GgufTensorInfo
  gate: GgufTensorInfo
  up: GgufTensorInfo
  down: GgufTensorInfo
}

/** The GGUF names of layer `layer`'s router and experts. */
export function expertTensorNames(layer: number): Record<keyof ExpertSources, string> {
  const b = `blk.${layer}`
  return { router: `${b}.ffn_gate_inp.weight`, gate: `${b}.ffn_gate_exps.weight`, up: `${b}.ffn_up_exps.weight`, down: `${b}.ffn_down_exps.weight` }
}

function refuse(file: GgufFile, reason: string): never {
  throw new OrtexError('MODEL_LOAD', `${file.path}: ${reason}`)
}

/**
 * The experts' sizes from `<arch>.expert_count`, `.expert_used_count` and
 * `.expert_feed_forward_length` (without it, llama.cpp takes feed_forward_length / expert_used_count),
 * or a refusal naming what is not supported.
 */
export function readExpertDims(file: GgufFile, arch: string, hiddenSize: number): ExpertDims {
  const m = new Metadata(file)
  const k = (key: string) => `${arch}.${key}`
  const numExperts = m.count(k('expert_count'))
  if (numExperts < 1 || numExperts > MAX_EXPERTS) refuse(file, `${k('expert_count')} is ${numExperts}: expected 1 to ${MAX_EXPERTS} experts`)
  const used = m.count(k('expert_used_count'))
  if (used < 1 || used > numExperts) refuse(file, `${k('expert_used_count')} is ${used}: expected 1 to ${numExperts} (the experts)`)
  const groups = m.count(k('expert_group_count'), 0) ?? 0
  if (groups > 1) refuse(file, `${k('expert_group_count')} is ${groups}: routing within groups of experts is not supported`)
  const given = m.count(k('expert_feed_forward_length'), undefined)
  const expertIntermediateSize = given ?? Math.floor(m.count(k('feed_forward_length')) / used)
  if (expertIntermediateSize < 1) refuse(file, `the experts' feed-forward length is ${expertIntermediateSize}`)
  return { hiddenSize, numExperts, numExpertsPerToken: used, expertIntermediateSize }
}

/** Layer `layer`'s router and expert tensors, their shapes and types checked, or a refusal. */
export function expertSources(file: GgufFile, tensors: ReadonlyMap<string, GgufTensorInfo>, layer: number, dims: ExpertDims): ExpertSources {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = dims
  const names = expertTensorNames(layer)
  const expected: Record<keyof ExpertSources, number[]> = { router: [H, E], gate: [H, F, E], up: [H, F, E], down: [F, H, E] }
  const find = (key: keyof ExpertSources): GgufTensorInfo => {
    const t = tensors.get(names[key]) ?? refuse(file, `the tensor "${names[key]}" is missing`)
    if (t.dims.join() !== expected[key].join()) refuse(file, `${t.name} has the shape [${t.dims}], expected [${expected[key]}]`)
    if (!canDequantize(t.type)) refuse(file, `${t.name} is ${ggmlTypeName(t.type)}, a tensor type the importer does not read`)
    return t
  }
  return { router: find('router'), gate: find('gate'), up: find('up'), down: find('down') }
}

/**
 * The data file's tensors for one layer's router and experts, named under `prefix` (e.g.
 * `model.layers.3.mlp`) as moe.ts expects them. The up tensor's rows are written with the gate's
 * (one gate_up_proj per expert), so its planned tensor has no specs of its own: it is there for
 * the import's tally of what each source tensor became.
 */
export function planExperts(sources: ExpertSources, prefix: string, dims: ExpertDims, storage: ExpertStorage): PlannedTensor[] {
  const router = routerTensor(sources.router, prefix, dims)
  if (storage.kind === 'fp32') {
    return [router, fp32GateUp(sources, prefix, dims), { specs: [], source: sources.up, mapping: 'dequantized', chunks: () => [] }, fp32Down(sources.down, prefix, dims)]
  }
  const { hiddenSize: H, expertIntermediateSize: F } = dims
  for (const [t, K] of [[sources.gate, H], [sources.up, H], [sources.down, F]] as const) {
    if (K % 32 !== 0) throw new Error(`${t.name}: rows of ${K} elements cannot be 4-bit blocks of 32`)
  }
  return [router, int4GateUp(sources, prefix, dims), { specs: [], source: sources.up, mapping: mappingOf(sources.up), chunks: () => [] }, int4Down(sources.down, prefix, dims)]
}

function mappingOf(t: GgufTensorInfo): 'exact' | 'requantized' {
  return mapsExactly(t.type) ? 'exact' : 'requantized'
}

function asBytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
}

/** Rows [first, first + count) of t, dequantized. */
function readRows(data: GgufData, t: GgufTensorInfo, first: number, count: number): Float32Array {
  const K = t.dims[0]!
  const out = new Float32Array(count * K)
  dequantize(t.type, data.rows(t, first, count), count * K, out)
  return out
}

/** rows [count, K] -> columns [K, count] placed at column `at` of a [K, width] matrix. */
function transposeInto(rows: Float32Array, count: number, K: number, out: Float32Array, width: number, at: number): void {
  for (let n = 0; n < count; n++) for (let k = 0; k < K; k++) out[k * width + at + n] = rows[n * K + k]!
}

function routerTensor(t: GgufTensorInfo, prefix: string, dims: ExpertDims): PlannedTensor {
  const { hiddenSize: H, numExperts: E } = dims
  return {
    specs: [{ name: routerWeightName(prefix), dims: [H, E] }],
    source: t,
    mapping: 'dequantized',
    *chunks(data) {
      const out = new Float32Array(H * E)
      transposeInto(readRows(data, t, 0, E), E, H, out, E, 0)
      yield [0, asBytes(out)]
    },
  }
}

function fp32GateUp(sources: ExpertSources, prefix: string, dims: ExpertDims): PlannedTensor {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = dims
  return {
    specs: Array.from({ length: E }, (_, e) => ({ name: `${expertProjectionName(prefix, e, 'gate_up_proj')}.weight`, dims: [H, 2 * F] })),
    source: sources.gate,
    mapping: 'dequantized',
    *chunks(data) {
      const out = new Float32Array(H * 2 * F)
      for (let e = 0; e < E; e++) {
        transposeInto(readRows(data, sources.gate, e * F, F), F, H, out, 2 * F, 0)
        transposeInto(readRows(data, sources.up, e * F, F), F, H, out, 2 * F, F)
        yield [e, asBytes(out)]
      }
    },
  }
}

function fp32Down(t: GgufTensorInfo, prefix: string, dims: ExpertDims): PlannedTensor {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = dims
  return {
    specs: Array.from({ length: E }, (_, e) => ({ name: `${expertProjectionName(prefix, e, 'down_proj')}.weight`, dims: [F, H] })),
    source: t,
    mapping: 'dequantized',
    *chunks(data) {
      const out = new Float32Array(F * H)
      for (let e = 0; e < E; e++) {
        transposeInto(readRows(data, t, e * H, H), H, F, out, H, 0)
        yield [e, asBytes(out)]
      }
    },
  }
}

/** MatMulNBits specs of an [N, K] projection: qweight, scales, qzeros, and mins where asked. */
function blockSpecs(name: string, N: number, K: number, withMins: boolean): TensorSpec[] {
  const blocks = K / 32
  const specs: TensorSpec[] = [
    { name: `${name}.qweight`, dims: [N, blocks, 16], dataType: DataType.UINT8 },
    { name: `${name}.scales`, dims: [N, blocks] },
    { name: `${name}.qzeros`, dims: [N, Math.ceil(blocks / 2)], dataType: DataType.UINT8 },
  ]
  if (withMins) specs.push({ name: `${name}.mins`, dims: [blocks, N] })
  return specs
}

/** Expert e's N rows of t (first row e N), as MatMulNBits blocks. */
function packExpert(data: GgufData, t: GgufTensorInfo, e: number, N: number): Int4Weight {
  const K = t.dims[0]!
  const bytes = data.rows(t, e * N, N)
  const rowBytes = bytes.length / N
  return packInt4(t.type, N, K, (n) => bytes.subarray(n * rowBytes, (n + 1) * rowBytes))
}

function int4GateUp(sources: ExpertSources, prefix: string, dims: ExpertDims): PlannedTensor {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = dims
  const withMins = hasMinimums(sources.gate.type) || hasMinimums(sources.up.type)
  const perExpert = withMins ? 4 : 3
  return {
    specs: Array.from({ length: E }, (_, e) => blockSpecs(expertProjectionName(prefix, e, 'gate_up_proj'), 2 * F, H, withMins)).flat(),
    source: sources.gate,
    mapping: mappingOf(sources.gate),
    *chunks(data) {
      const blocks = H / 32
      for (let e = 0; e < E; e++) {
        const gate = packExpert(data, sources.gate, e, F)
        const up = packExpert(data, sources.up, e, F)
        const at = e * perExpert
        yield [at, gate.qweight]
        yield [at, up.qweight]
        yield [at + 1, asBytes(gate.scales)]
        yield [at + 1, asBytes(up.scales)]
        yield [at + 2, gate.qzeros]
        yield [at + 2, up.qzeros]
        if (withMins) {
          // [blocks, 2F]: each block row holds gate's F minimums, then up's.
          const mins = new Float32Array(blocks * 2 * F)
          for (let b = 0; b < blocks; b++) {
            if (gate.mins) mins.set(gate.mins.subarray(b * F, (b + 1) * F), b * 2 * F)
            if (up.mins) mins.set(up.mins.subarray(b * F, (b + 1) * F), b * 2 * F + F)
          }
          yield [at + 3, asBytes(mins)]
        }
      }
    },
  }
}

function int4Down(t: GgufTensorInfo, prefix: string, dims: ExpertDims): PlannedTensor {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = dims
  const withMins = hasMinimums(t.type)
  return {
    specs: Array.from({ length: E }, (_, e) => blockSpecs(expertProjectionName(prefix, e, 'down_proj'), H, F, withMins)).flat(),
    source: t,
    mapping: mappingOf(t),
    *chunks(data) {
      for (let e = 0; e < E; e++) {
        const w = packExpert(data, t, e, H)
        const at = e * (withMins ? 4 : 3)
        yield [at, w.qweight]
        yield [at + 1, asBytes(w.scales)]
        yield [at + 2, w.qzeros]
        if (w.mins) yield [at + 3, asBytes(w.mins)]
      }
    },
  }
}
