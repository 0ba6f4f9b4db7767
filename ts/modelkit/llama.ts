// The Llama-style decoder graph (both attention forms) and the list of its weights.
//
// Per layer: RMSNorm -> attention (rotary positions, grouped KV heads) -> residual -> RMSNorm ->
// SwiGLU MLP -> residual; then a final RMSNorm and an untied lm_head. Both forms use the very same
// weights and the same non-interleaved ("rotate half") rotary tables; only the attention core
// differs:
//   mha: plain ONNX operators (MatMul, Softmax, Where, ...) with position_ids, past concatenated
//        with the new keys/values (present = [past ; new] along the sequence axis);
//   gqa: com.microsoft.GroupQueryAttention with do_rotary=1 and cos/sin caches, seqlens_k and
//        total_sequence_length computed from attention_mask, no position_ids input, as
//        onnxruntime-genai's model builder emits for CPU.
// See docs/model-format.md for the input/output contract.

import { DataType, F, GraphBuilder, I, Is, type ExternalTensor } from './onnx-builder'

export type AttentionForm = 'mha' | 'gqa'

export interface LlamaDims {
  vocabSize: number
  hiddenSize: number
  intermediateSize: number
  numLayers: number
  numHeads: number
  numKvHeads: number
  headSize: number
  contextLength: number
  ropeTheta: number
  rmsNormEps: number
}

/** How a weight's values are produced. */
export type WeightInit =
  | { kind: 'uniform'; std: number }
  | { kind: 'norm'; jitter: number }
  | { kind: 'lm-head'; std: number; vocabSize: number }
  | { kind: 'rope-cos' }
  | { kind: 'rope-sin' }

export interface WeightSpec {
  name: string
  dims: number[]
  init: WeightInit
  /** Counted as a model parameter (the rotary tables are not). */
  parameter: boolean
}

/** Every initializer stored in the external data file, in file order. */
export function weightSpecs(d: LlamaDims): WeightSpec[] {
  const H = d.hiddenSize
  const q = d.numHeads * d.headSize
  const kv = d.numKvHeads * d.headSize
  const uniform = (std: number): WeightInit => ({ kind: 'uniform', std })
  // Scales chosen so that a random model is not degenerate: unit-RMS embeddings, attention
  // scores with a standard deviation of a few units (context matters), logits spread over a
  // range of about +-10 (greedy choices vary from prompt to prompt).
  const specs: WeightSpec[] = [
    { name: 'model.embed_tokens.weight', dims: [d.vocabSize, H], init: uniform(1), parameter: true },
  ]
  for (let l = 0; l < d.numLayers; l++) {
    const p = `model.layers.${l}`
    specs.push(
      { name: `${p}.input_layernorm.weight`, dims: [H], init: { kind: 'norm', jitter: 0.1 }, parameter: true },
      { name: `${p}.self_attn.q_proj.weight`, dims: [H, q], init: uniform(2 / Math.sqrt(H)), parameter: true },
      { name: `${p}.self_attn.k_proj.weight`, dims: [H, kv], init: uniform(2 / Math.sqrt(H)), parameter: true },
      { name: `${p}.self_attn.v_proj.weight`, dims: [H, kv], init: uniform(1 / Math.sqrt(H)), parameter: true },
      { name: `${p}.self_attn.o_proj.weight`, dims: [q, H], init: uniform(1 / Math.sqrt(q)), parameter: true },
      { name: `${p}.post_attention_layernorm.weight`, dims: [H], init: { kind: 'norm', jitter: 0.1 }, parameter: true },
      { name: `${p}.mlp.gate_proj.weight`, dims: [H, d.intermediateSize], init: uniform(1 / Math.sqrt(H)), parameter: true },
      { name: `${p}.mlp.up_proj.weight`, dims: [H, d.intermediateSize], init: uniform(1 / Math.sqrt(H)), parameter: true },
      {
        name: `${p}.mlp.down_proj.weight`,
        dims: [d.intermediateSize, H],
        init: uniform(1 / Math.sqrt(d.intermediateSize)),
        parameter: true,
      },
    )
  }
  specs.push(
    { name: 'model.norm.weight', dims: [H], init: { kind: 'norm', jitter: 0.1 }, parameter: true },
    {
      name: 'lm_head.weight',
      dims: [H, d.vocabSize],
      init: { kind: 'lm-head', std: 3 / Math.sqrt(H), vocabSize: d.vocabSize },
      parameter: true,
    },
    { name: 'cos_cache', dims: [d.contextLength, d.headSize / 2], init: { kind: 'rope-cos' }, parameter: false },
    { name: 'sin_cache', dims: [d.contextLength, d.headSize / 2], init: { kind: 'rope-sin' }, parameter: false },
  )
  return specs
}

export function countParameters(d: LlamaDims): number {
  return weightSpecs(d)
    .filter((s) => s.parameter)
    .reduce((n, s) => n + s.dims.reduce((a, b) => a * b, 1), 0)
}

export const INPUT_IDS = 'input_ids'
export const ATTENTION_MASK = 'attention_mask'
export const POSITION_IDS = 'position_ids'
export const LOGITS = 'logits'
export const pastKeyName = (l: number) => `past_key_values.${l}.key`
export const pastValueName = (l: number) => `past_key_values.${l}.value`
export const presentKeyName = (l: number) => `present.${l}.key`
export const presentValueName = (l: number) => `present.${l}.value`

/** Builds the decoder graph; `weights` maps each WeightSpec name to its place in the data file. */
export function buildLlamaGraph(
  d: LlamaDims,
  attention: AttentionForm,
  weights: ReadonlyMap<string, ExternalTensor>,
): GraphBuilder {
  if (d.numHeads % d.numKvHeads !== 0) throw new Error('num_heads must be a multiple of num_kv_heads')
  if (d.headSize % 2 !== 0) throw new Error('head_size must be even (rotary embedding)')
  const g = new GraphBuilder(`ortex-llama-${attention}`)
  const H = d.hiddenSize
  const D = d.headSize
  const nRep = d.numHeads / d.numKvHeads
  const w = (name: string): string => {
    const t = weights.get(name)
    if (!t) throw new Error(`missing weight ${name}`)
    return g.external(t)
  }

  // Inputs and outputs.
  g.input(INPUT_IDS, DataType.INT64, ['batch_size', 'sequence_length'])
  g.input(ATTENTION_MASK, DataType.INT64, ['batch_size', 'total_sequence_length'])
  if (attention === 'mha') g.input(POSITION_IDS, DataType.INT64, ['batch_size', 'sequence_length'])
  for (let l = 0; l < d.numLayers; l++) {
    g.input(pastKeyName(l), DataType.FLOAT, ['batch_size', d.numKvHeads, 'past_sequence_length', D])
    g.input(pastValueName(l), DataType.FLOAT, ['batch_size', d.numKvHeads, 'past_sequence_length', D])
  }
  g.output(LOGITS, DataType.FLOAT, ['batch_size', 'sequence_length', d.vocabSize])
  for (let l = 0; l < d.numLayers; l++) {
    g.output(presentKeyName(l), DataType.FLOAT, ['batch_size', d.numKvHeads, 'total_sequence_length', D])
    g.output(presentValueName(l), DataType.FLOAT, ['batch_size', d.numKvHeads, 'total_sequence_length', D])
  }

  const cosCache = w('cos_cache')
  const sinCache = w('sin_cache')

  // Shared subgraphs.
  let mha: { mask: string; cos: string; sin: string } | undefined
  let gqa: { seqlensK: string; totalSeqLen: string } | undefined
  if (attention === 'mha') {
    const b = '/model/attn_mask_reformat'
    // P = past length (from layer 0's past key), S = new tokens, T = attention_mask width (= P + S).
    const pastShape = g.op('Shape', [pastKeyName(0)], undefined, { name: `${b}/past_shape` })
    const P = g.op('Gather', [pastShape, g.int64([2], [])], { axis: I(0) }, { name: `${b}/past_len` })
    const idsShape = g.op('Shape', [INPUT_IDS], undefined, { name: `${b}/ids_shape` })
    const Sn = g.op('Gather', [idsShape, g.int64([1], [])], { axis: I(0) }, { name: `${b}/seq_len` })
    const maskShape = g.op('Shape', [ATTENTION_MASK], undefined, { name: `${b}/mask_shape` })
    const T = g.op('Gather', [maskShape, g.int64([1], [])], { axis: I(0) }, { name: `${b}/total_len` })
    const PS = g.op('Add', [P, Sn], undefined, { name: `${b}/past_plus_seq` })
    // causal[s, t] = t <= P + s   (key index t in [past ; new], query s at key index P + s)
    const qIdx = g.op('Range', [P, PS, g.int64([1], [])], undefined, { name: `${b}/query_index` })
    const qCol = g.op('Unsqueeze', [qIdx, g.int64([1])], undefined, { name: `${b}/query_index_col` })
    const kIdx = g.op('Range', [g.int64([0], []), T, g.int64([1], [])], undefined, { name: `${b}/key_index` })
    const causal = g.op('LessOrEqual', [kIdx, qCol], undefined, { name: `${b}/causal` }) // [S, T]
    const pad = g.op('Cast', [ATTENTION_MASK], { to: I(DataType.BOOL) }, { name: `${b}/mask_bool` })
    const pad4 = g.op('Unsqueeze', [pad, g.int64([1, 2])], undefined, { name: `${b}/mask_4d` }) // [B,1,1,T]
    const both = g.op('And', [causal, pad4], undefined, { name: `${b}/causal_and_mask` }) // [B,1,S,T]
    // Queries are grouped per KV head as [B, kv_heads, n_rep * S, D]: repeat the mask n_rep times.
    const mask = g.op('Tile', [both, g.int64([1, 1, nRep, 1])], undefined, { name: `${b}/mask_grouped` })
    // Rotary tables for these positions: [B, 1, S, D/2].
    const rb = '/model/rotary'
    const cosG = g.op('Gather', [cosCache, POSITION_IDS], { axis: I(0) }, { name: `${rb}/cos_gather` })
    const sinG = g.op('Gather', [sinCache, POSITION_IDS], { axis: I(0) }, { name: `${rb}/sin_gather` })
    const cos = g.op('Unsqueeze', [cosG, g.int64([1])], undefined, { name: `${rb}/cos` })
    const sin = g.op('Unsqueeze', [sinG, g.int64([1])], undefined, { name: `${rb}/sin` })
    mha = { mask, cos, sin }
  } else {
    const b = '/model/attn_mask_reformat/attn_mask_subgraph'
    const sum = g.op('ReduceSum', [ATTENTION_MASK, g.int64([1])], { keepdims: I(0) }, { name: `${b}/ReduceSum` })
    const sub = g.op('Sub', [sum, g.int64([1], [])], undefined, { name: `${b}/Sub` })
    const seqlensK = g.op('Cast', [sub], { to: I(DataType.INT32) }, { name: `${b}/Sub/Cast` })
    const shape = g.op('Shape', [ATTENTION_MASK], undefined, { name: `${b}/Shape` })
    const total = g.op('Gather', [shape, g.int64([1], [])], { axis: I(0) }, { name: `${b}/Gather` })
    const totalSeqLen = g.op('Cast', [total], { to: I(DataType.INT32) }, { name: `${b}/Gather/Cast` })
    gqa = { seqlensK, totalSeqLen }
  }

  const rmsNorm = (x: string, weight: string, base: string): string => {
    const sq = g.op('Pow', [x, g.float([2], [])], undefined, { name: `${base}/Pow` })
    const mean = g.op('ReduceMean', [sq, g.int64([-1])], { keepdims: I(1) }, { name: `${base}/ReduceMean` })
    const eps = g.op('Add', [mean, g.float([d.rmsNormEps], [])], undefined, { name: `${base}/Add` })
    const root = g.op('Sqrt', [eps], undefined, { name: `${base}/Sqrt` })
    const normed = g.op('Div', [x, root], undefined, { name: `${base}/Div` })
    return g.op('Mul', [normed, w(weight)], undefined, { name: `${base}/Mul` })
  }
  // [B, h, S, D] -> rotated, non-interleaved: [x1 cos - x2 sin ; x2 cos + x1 sin]
  const rotary = (x: string, base: string): string => {
    const half = D / 2
    const x1 = g.op('Slice', [x, g.int64([0]), g.int64([half]), g.int64([3])], undefined, { name: `${base}/x1` })
    const x2 = g.op('Slice', [x, g.int64([half]), g.int64([D]), g.int64([3])], undefined, { name: `${base}/x2` })
    const a = g.op('Mul', [x1, mha!.cos], undefined, { name: `${base}/x1_cos` })
    const bb = g.op('Mul', [x2, mha!.sin], undefined, { name: `${base}/x2_sin` })
    const c = g.op('Mul', [x2, mha!.cos], undefined, { name: `${base}/x2_cos` })
    const e = g.op('Mul', [x1, mha!.sin], undefined, { name: `${base}/x1_sin` })
    const lo = g.op('Sub', [a, bb], undefined, { name: `${base}/lo` })
    const hi = g.op('Add', [c, e], undefined, { name: `${base}/hi` })
    return g.op('Concat', [lo, hi], { axis: I(3) }, { name: `${base}/Concat` })
  }

  let x = g.op('Gather', [w('model.embed_tokens.weight'), INPUT_IDS], { axis: I(0) }, { name: '/model/embed_tokens/Gather' })
  const scale = 1 / Math.sqrt(D)
  for (let l = 0; l < d.numLayers; l++) {
    const p = `model.layers.${l}`
    const base = `/model/layers.${l}`
    const h = rmsNorm(x, `${p}.input_layernorm.weight`, `${base}/input_layernorm`)
    const q = g.op('MatMul', [h, w(`${p}.self_attn.q_proj.weight`)], undefined, { name: `${base}/attn/q_proj/MatMul` })
    const k = g.op('MatMul', [h, w(`${p}.self_attn.k_proj.weight`)], undefined, { name: `${base}/attn/k_proj/MatMul` })
    const v = g.op('MatMul', [h, w(`${p}.self_attn.v_proj.weight`)], undefined, { name: `${base}/attn/v_proj/MatMul` })
    let ctx: string
    if (attention === 'gqa') {
      ;[ctx] = g.node(
        'GroupQueryAttention',
        [q, k, v, pastKeyName(l), pastValueName(l), gqa!.seqlensK, gqa!.totalSeqLen, cosCache, sinCache],
        {
          name: `${base}/attn/GroupQueryAttention`,
          domain: 'com.microsoft',
          outputs: [`${base}/attn/GroupQueryAttention/output_0`, presentKeyName(l), presentValueName(l)],
          attrs: {
            num_heads: I(d.numHeads),
            kv_num_heads: I(d.numKvHeads),
            scale: F(scale),
            local_window_size: I(-1),
            softcap: F(0),
            do_rotary: I(1),
            rotary_interleaved: I(0),
          },
        },
      ) as [string]
    } else {
      const a = `${base}/attn`
      const heads = (t: string, n: number, tag: string): string => {
        const r = g.op('Reshape', [t, g.int64([0, 0, n, D])], undefined, { name: `${a}/${tag}/Reshape` })
        return g.op('Transpose', [r], { perm: Is([0, 2, 1, 3]) }, { name: `${a}/${tag}/Transpose` }) // [B,n,S,D]
      }
      const qr = rotary(heads(q, d.numHeads, 'q'), `${a}/q_rotary`)
      const kr = rotary(heads(k, d.numKvHeads, 'k'), `${a}/k_rotary`)
      const vh = heads(v, d.numKvHeads, 'v')
      const presentK = g.op('Concat', [pastKeyName(l), kr], { axis: I(2) }, { name: `${a}/present_key`, outputs: [presentKeyName(l)] })
      const presentV = g.op('Concat', [pastValueName(l), vh], { axis: I(2) }, { name: `${a}/present_value`, outputs: [presentValueName(l)] })
      // Group query heads by their KV head: [B, H, S, D] -> [B, kv_heads, n_rep * S, D]
      // (query head i uses KV head floor(i / n_rep), as in GroupQueryAttention).
      const qg = g.op('Reshape', [qr, g.int64([0, d.numKvHeads, -1, D])], undefined, { name: `${a}/q_grouped` })
      const kt = g.op('Transpose', [presentK], { perm: Is([0, 1, 3, 2]) }, { name: `${a}/k_transposed` })
      const scores = g.op('MatMul', [qg, kt], undefined, { name: `${a}/scores` })
      const scaled = g.op('Mul', [scores, g.float([scale], [])], undefined, { name: `${a}/scaled` })
      const masked = g.op('Where', [mha!.mask, scaled, g.float([-3.4028234663852886e38], [])], undefined, {
        name: `${a}/masked`,
      })
      const probs = g.op('Softmax', [masked], { axis: I(-1) }, { name: `${a}/Softmax` })
      const attn = g.op('MatMul', [probs, presentV], undefined, { name: `${a}/context` }) // [B,kv,n_rep*S,D]
      const ungroup = g.op('Reshape', [attn, g.int64([0, d.numHeads, -1, D])], undefined, { name: `${a}/ungroup` })
      const bshd = g.op('Transpose', [ungroup], { perm: Is([0, 2, 1, 3]) }, { name: `${a}/context/Transpose` })
      ctx = g.op('Reshape', [bshd, g.int64([0, 0, d.numHeads * D])], undefined, { name: `${a}/context/Reshape` })
    }
    const o = g.op('MatMul', [ctx, w(`${p}.self_attn.o_proj.weight`)], undefined, { name: `${base}/attn/o_proj/MatMul` })
    x = g.op('Add', [x, o], undefined, { name: `${base}/attn/residual` })
    const h2 = rmsNorm(x, `${p}.post_attention_layernorm.weight`, `${base}/post_attention_layernorm`)
    const gate = g.op('MatMul', [h2, w(`${p}.mlp.gate_proj.weight`)], undefined, { name: `${base}/mlp/gate_proj/MatMul` })
    const up = g.op('MatMul', [h2, w(`${p}.mlp.up_proj.weight`)], undefined, { name: `${base}/mlp/up_proj/MatMul` })
    const sig = g.op('Sigmoid', [gate], undefined, { name: `${base}/mlp/act/Sigmoid` })
    const silu = g.op('Mul', [gate, sig], undefined, { name: `${base}/mlp/act/Mul` })
    const prod = g.op('Mul', [silu, up], undefined, { name: `${base}/mlp/Mul` })
    const down = g.op('MatMul', [prod, w(`${p}.mlp.down_proj.weight`)], undefined, { name: `${base}/mlp/down_proj/MatMul` })
    x = g.op('Add', [x, down], undefined, { name: `${base}/mlp/residual` })
  }
  const final = rmsNorm(x, 'model.norm.weight', '/model/norm')
  g.op('MatMul', [final, w('lm_head.weight')], undefined, { name: '/lm_head/MatMul', outputs: [LOGITS] })
  return g
}
