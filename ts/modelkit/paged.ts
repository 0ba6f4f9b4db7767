// The paged attention form of the Llama graph: onnxruntime-genai's builder with
// `use_paged_attention=true prune_lm_head=true` (docs/model-format.md, "The paged form").
//
// All rows' new tokens are packed on one axis (num_tokens); each layer's KV cache is a pool of
// blocks [num_blocks, block_size, kv_heads, head_size] that the executor binds as both past and
// present (one buffer: the graph writes the new positions into it); block_table says which blocks
// hold each row's positions. Two kernels compute the same attention:
//   cuda:      com.microsoft.PagedAttention, as the builder makes it (ONNX Runtime has it on CUDA
//              only; float16/bfloat16);
//   reference: standard ONNX operators that run on the CPU provider: ScatterND writes the new keys
//              and values at their slots, Gather reads each token's sequence through the block
//              table, then causal grouped-query attention. It exists so that everything around the
//              kernel (the folder contract, block tables, packing, in-place binding, pruned logits)
//              is tested on the CPU; it reads every row's whole table per token, so it is a test
//              kernel, not a fast one.
//
// Token j of row b (packed index cumulative_sequence_lengths[b] + j) is at position
// p = past_sequence_lengths[b] + j, stored in block block_table[b][p / block_size] at slot
// p % block_size:
//
//   packed tokens   | row 0: n_0 tokens | row 1: n_1 tokens | ...
//   cumulative      0                   n_0                 n_0 + n_1
//   positions       past_0 ... past_0 + n_0 - 1 | past_1 ...

import { DECODER_INPUTS } from '../generated/folder-contract'
import { DataType, type DataTypeCode, F, type GraphBuilder, I, Is } from './onnx-builder'

export type PagedKernel = 'cuda' | 'reference'

/** The builder's inputs of a paged graph beyond input_ids and the caches (base.py, input_names),
 *  as the folder contract names them. */
export const BLOCK_TABLE = DECODER_INPUTS.block_table
export const CUMULATIVE_SEQUENCE_LENGTHS = DECODER_INPUTS.cumulative_sequence_lengths
export const PAST_SEQUENCE_LENGTHS = DECODER_INPUTS.past_sequence_lengths
export const ATTENTION_METADATA = DECODER_INPUTS.attention_metadata
export const LOGITS_INDICES = DECODER_INPUTS.logits_indices

/** What the paged pieces need from the graph being built. */
export interface PagedGraph {
  g: GraphBuilder
  numHeads: number
  numKvHeads: number
  headSize: number
  blockSize: number
  /** The caches' element type (FLOAT or FLOAT16). */
  kvType: DataTypeCode
  /** The element type q, k and v arrive in (the arithmetic's: FLOAT, or FLOAT16 in a float16 folder). */
  computeType: DataTypeCode
}

/**
 * The graph inputs and outputs in the builder's order (base.py make_inputs_and_outputs walks
 * input_names: input_ids, every layer's past key, every past value, block_table,
 * cumulative_sequence_lengths, past_sequence_lengths, attention_metadata, logits_indices).
 */
export function declarePagedInputsOutputs(
  p: PagedGraph,
  numLayers: number,
  vocabSize: number,
  logitsType: DataTypeCode,
  names: { inputIds: string; logits: string; past: (l: number, kind: 'key' | 'value') => string; present: (l: number, kind: 'key' | 'value') => string },
): void {
  const { g } = p
  const cache = ['num_blocks', 'block_size', p.numKvHeads, p.headSize]
  g.input(names.inputIds, DataType.INT64, ['num_tokens'])
  for (const kind of ['key', 'value'] as const) {
    for (let l = 0; l < numLayers; l++) g.input(names.past(l, kind), p.kvType, cache)
  }
  g.input(BLOCK_TABLE, DataType.INT32, ['batch_size', 'max_num_blocks'])
  g.input(CUMULATIVE_SEQUENCE_LENGTHS, DataType.INT32, ['batch_size + 1'])
  g.input(PAST_SEQUENCE_LENGTHS, DataType.INT32, ['batch_size'])
  // [max_query_len_bound, max_kv_len_bound, max_kv_len_lower_bound] in CPU memory (base.py
  // make_paged_attention; the op's schema in ONNX Runtime 1.31): upper bounds on any row's new
  // tokens and on past + new, and a lower bound on the largest past + new, 0 = unknown. The CUDA
  // kernel sizes its launch from them instead of reading the lengths back from the device; an
  // upper bound too small breaks the contract (attention work is skipped).
  g.input(ATTENTION_METADATA, DataType.INT32, [3])
  g.input(LOGITS_INDICES, DataType.INT32, ['num_logits'])
  g.output(names.logits, logitsType, ['num_logits', vocabSize])
  for (const kind of ['key', 'value'] as const) {
    for (let l = 0; l < numLayers; l++) g.output(names.present(l, kind), p.kvType, cache)
  }
}


/** A rotary table's cos and sin [context, dims / 2] weights, in the compute type. */
export interface RotaryWeights {
  cosCache: string
  sinCache: string
}

/** What every layer's kernel shares: the rotary tables in the kernel's type, and for the
 *  reference kernel each token's position, cache slot and causal (and windowed) masks. */
export interface PagedShared {
  tables: RotaryWeights[]
  reference?: {
    /** Per table: [T, 1, dims/2] rotary tables at each token's position. */
    rotary: Array<{ cos: string; sin: string }>
    /** [T, 2] int64: (block, slot) where each new token's key and value go. */
    slots: string
    /** [T, max_num_blocks] int64: the blocks of each token's row. */
    tokenBlocks: string
    /** [T, 1, 1, L] bool, L = max_num_blocks * block_size, by window (0: none): key position <=
     *  the token's, and within the window of it. */
    masks: Map<number, string>
  }
}

/** One layer's attention: its rotary table (index into PagedShared.tables) and how many leading
 *  elements of a head rotate, or none; its window; the score scale and soft-cap (0: none). */
export interface PagedLayer {
  rotary: { table: number; dims: number } | null
  window: number | undefined
  scale: number
  softcap: number
}

/** The tensors the layers share; `tables` are the [context, dims/2] rotary tables in the compute
 *  type; `windows` the sliding windows some layer attends over (the reference kernel's masks). */
export function pagedShared(p: PagedGraph, kernel: PagedKernel, inputIds: string, tables: RotaryWeights[], windows: number[] = []): PagedShared {
  const shared: PagedShared = { tables }
  if (kernel === 'reference') shared.reference = referenceShared(p, inputIds, tables, windows)
  return shared
}

/** Each packed token's row, position, cache slot and masks (reference kernel). */
function referenceShared(p: PagedGraph, inputIds: string, tables: RotaryWeights[], windows: number[]): NonNullable<PagedShared['reference']> {
  const { g, blockSize } = p
  const b = '/model/paged'
  const i64 = (x: string, tag: string) => g.op('Cast', [x], { to: I(DataType.INT64) }, { name: `${b}/${tag}/Cast` })
  const cumulative = i64(CUMULATIVE_SEQUENCE_LENGTHS, 'cumulative')
  const past = i64(PAST_SEQUENCE_LENGTHS, 'past')
  const table = i64(BLOCK_TABLE, 'block_table')
  const T = g.op('Gather', [g.op('Shape', [inputIds], undefined, { name: `${b}/ids_shape` }), g.int64([0], [])], { axis: I(0) }, { name: `${b}/num_tokens` })
  const token = g.op('Range', [g.int64([0], []), T, g.int64([1], [])], undefined, { name: `${b}/token_index` }) // [T]
  // row[i] = how many rows end at or before token i (a row with no new tokens ends where it starts).
  const ends = g.op('Slice', [cumulative, g.int64([1]), g.int64([2 ** 62])], undefined, { name: `${b}/row_ends` }) // [B]
  const tokenCol = g.op('Unsqueeze', [token, g.int64([1])], undefined, { name: `${b}/token_col` }) // [T, 1]
  const endsRow = g.op('Unsqueeze', [ends, g.int64([0])], undefined, { name: `${b}/row_ends_row` }) // [1, B]
  const ended = g.op('Cast', [g.op('GreaterOrEqual', [tokenCol, endsRow], undefined, { name: `${b}/ended` })], { to: I(DataType.INT64) }, { name: `${b}/ended/Cast` })
  const row = g.op('ReduceSum', [ended, g.int64([1])], { keepdims: I(0) }, { name: `${b}/row` }) // [T]
  // position = past[row] + (i - cumulative[row])
  const start = g.op('Gather', [cumulative, row], { axis: I(0) }, { name: `${b}/row_start` })
  const offset = g.op('Sub', [token, start], undefined, { name: `${b}/offset_in_row` })
  const position = g.op('Add', [g.op('Gather', [past, row], { axis: I(0) }, { name: `${b}/row_past` }), offset], undefined, { name: `${b}/position` }) // [T]
  // The slot: (block_table[row][position / block_size], position % block_size).
  const tokenBlocks = g.op('Gather', [table, row], { axis: I(0) }, { name: `${b}/token_blocks` }) // [T, MB]
  const column = g.op('Div', [position, g.int64([blockSize], [])], undefined, { name: `${b}/block_column` })
  const columnCol = g.op('Unsqueeze', [column, g.int64([1])], undefined, { name: `${b}/block_column_col` })
  const block = g.op('GatherElements', [tokenBlocks, columnCol], { axis: I(1) }, { name: `${b}/block` }) // [T, 1]
  const slotInBlock = g.op('Mod', [position, g.int64([blockSize], [])], undefined, { name: `${b}/slot_in_block` })
  const slotCol = g.op('Unsqueeze', [slotInBlock, g.int64([1])], undefined, { name: `${b}/slot_in_block_col` })
  const slots = g.op('Concat', [block, slotCol], { axis: I(1) }, { name: `${b}/slots` }) // [T, 2]
  // Keys are read as each row's blocks laid end to end: key index t is position t.
  const tableShape = g.op('Shape', [BLOCK_TABLE], undefined, { name: `${b}/block_table_shape` })
  const maxBlocks = g.op('Gather', [tableShape, g.int64([1], [])], { axis: I(0) }, { name: `${b}/max_num_blocks` })
  const L = g.op('Mul', [maxBlocks, g.int64([blockSize], [])], undefined, { name: `${b}/max_positions` })
  const key = g.op('Range', [g.int64([0], []), L, g.int64([1], [])], undefined, { name: `${b}/key_position` }) // [L]
  const positionCol = g.op('Unsqueeze', [position, g.int64([1])], undefined, { name: `${b}/position_col` })
  const keyRow = g.op('Unsqueeze', [key, g.int64([0])], undefined, { name: `${b}/key_row` })
  const causal = g.op('LessOrEqual', [keyRow, positionCol], undefined, { name: `${b}/causal` }) // [T, L]
  const masks = new Map([[0, g.op('Unsqueeze', [causal, g.int64([1, 2])], undefined, { name: `${b}/mask` })]]) // [T, 1, 1, L]
  for (const window of new Set(windows)) {
    // A window W: the key is within W - 1 positions before the token (p - key < W).
    const w = `${b}/window_${window}`
    const first = g.op('Sub', [positionCol, g.int64([window - 1], [])], undefined, { name: `${w}/first_key` })
    const inWindow = g.op('GreaterOrEqual', [keyRow, first], undefined, { name: `${w}/in_window` })
    const both = g.op('And', [causal, inWindow], undefined, { name: `${w}/causal_and_window` })
    masks.set(window, g.op('Unsqueeze', [both, g.int64([1, 2])], undefined, { name: `${w}/mask` }))
  }
  const rotary = tables.map((t, i) => {
    const rb = i === 0 ? '/model/rotary' : `/model/rotary_${i}`
    const cos = g.op('Unsqueeze', [g.op('Gather', [t.cosCache, position], { axis: I(0) }, { name: `${rb}/cos_gather` }), g.int64([1])], undefined, { name: `${rb}/cos` })
    const sin = g.op('Unsqueeze', [g.op('Gather', [t.sinCache, position], { axis: I(0) }, { name: `${rb}/sin_gather` }), g.int64([1])], undefined, { name: `${rb}/sin` })
    return { cos, sin }
  })
  return { rotary, slots, tokenBlocks, masks }
}

/** The cache names of one layer. */
export interface LayerCache {
  pastKey: string
  pastValue: string
  presentKey: string
  presentValue: string
}

/**
 * com.microsoft.PagedAttention as base.py make_paged_attention makes it: inputs query, key,
 * value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table, cos_cache,
 * sin_cache, then the optional slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale,
 * v_scale left empty and attention_metadata (input 16); attributes from
 * get_attention_op_attributes (num_heads, kv_num_heads, scale, local_window_size, softcap,
 * do_rotary: the builder fuses rotary into the op on CUDA, is_fused_rope_supported,
 * rotary_interleaved 0). q, k and v are [num_tokens, heads * head_size]; output the same for q.
 * A layer without rotary passes no tables (do_rotary 0); a partial rotary's tables are narrower
 * than half a head, as GroupQueryAttention takes them.
 */
export function cudaPagedAttention(p: PagedGraph, shared: PagedShared, q: string, k: string, v: string, cache: LayerCache, base: string, layer: PagedLayer): string {
  const tables = layer.rotary ? shared.tables[layer.rotary.table]! : { cosCache: '', sinCache: '' }
  const [out] = p.g.node(
    'PagedAttention',
    [
      q,
      k,
      v,
      cache.pastKey,
      cache.pastValue,
      CUMULATIVE_SEQUENCE_LENGTHS,
      PAST_SEQUENCE_LENGTHS,
      BLOCK_TABLE,
      tables.cosCache,
      tables.sinCache,
      '',
      '',
      '',
      '',
      '',
      '',
      ATTENTION_METADATA,
    ],
    {
      name: `${base}/PagedAttention`,
      domain: 'com.microsoft',
      outputs: [`${base}/PagedAttention/output_0`, cache.presentKey, cache.presentValue],
      attrs: {
        num_heads: I(p.numHeads),
        kv_num_heads: I(p.numKvHeads),
        scale: F(layer.scale),
        local_window_size: I(layer.window ?? -1),
        softcap: F(layer.softcap),
        do_rotary: I(layer.rotary ? 1 : 0),
        rotary_interleaved: I(0),
      },
    },
  ) as [string]
  return out
}

/**
 * The reference kernel: the same inputs and outputs as cudaPagedAttention, from standard ONNX
 * operators. Rotary (non-interleaved, over the table's leading dims) on q and k at each token's
 * position; the new keys and values scattered into the cache at their slots (present = past with
 * those slots replaced); then per token its row's blocks gathered end to end [T, L, kv_heads, D],
 * scores scaled (and soft-capped), masked to positions at or before the token's (and within its
 * window), softmax, times the values. Query head h reads KV head floor(h / n_rep), as in
 * GroupQueryAttention.
 */
export function referencePagedAttention(p: PagedGraph, shared: PagedShared, q: string, k: string, v: string, cache: LayerCache, base: string, layer: PagedLayer): string {
  const { g, numHeads: H, numKvHeads: KH, headSize: D } = p
  const ref = shared.reference!
  const nRep = H / KH
  const heads = (t: string, n: number, tag: string) => g.op('Reshape', [t, g.int64([0, n, D])], undefined, { name: `${base}/${tag}/Reshape` })
  const rotate = (x: string, tag: string) => (layer.rotary ? rotary(p, ref.rotary[layer.rotary.table]!, layer.rotary.dims, x, `${base}/${tag}`) : x)
  const qr = rotate(heads(q, H, 'q'), 'q_rotary') // [T, H, D]
  const kr = rotate(heads(k, KH, 'k'), 'k_rotary') // [T, KH, D]
  const vh = heads(v, KH, 'v')
  const toCache = (x: string, tag: string) =>
    p.kvType === p.computeType ? x : g.op('Cast', [x], { to: I(p.kvType) }, { name: `${base}/${tag}/Cast` })
  const fromCache = (x: string, tag: string) =>
    p.kvType === p.computeType ? x : g.op('Cast', [x], { to: I(p.computeType) }, { name: `${base}/${tag}/Cast` })
  g.op('ScatterND', [cache.pastKey, ref.slots, toCache(kr, 'k_rotary')], undefined, { name: `${base}/key_cache/ScatterND`, outputs: [cache.presentKey] })
  g.op('ScatterND', [cache.pastValue, ref.slots, toCache(vh, 'v')], undefined, { name: `${base}/value_cache/ScatterND`, outputs: [cache.presentValue] })
  // [num_blocks, BS, KH, D] -> each token's row: [T, MB, BS, KH, D] -> [T, L, KH, D]
  const rowOf = (c: string, tag: string) => {
    const blocks = g.op('Gather', [c, ref.tokenBlocks], { axis: I(0) }, { name: `${base}/${tag}/Gather` })
    const flat = g.op('Reshape', [blocks, g.int64([0, -1, KH, D])], undefined, { name: `${base}/${tag}/Reshape` })
    return fromCache(flat, tag)
  }
  const keys = g.op('Transpose', [rowOf(cache.presentKey, 'row_keys')], { perm: Is([0, 2, 3, 1]) }, { name: `${base}/row_keys/Transpose` }) // [T, KH, D, L]
  const values = g.op('Transpose', [rowOf(cache.presentValue, 'row_values')], { perm: Is([0, 2, 1, 3]) }, { name: `${base}/row_values/Transpose` }) // [T, KH, L, D]
  const grouped = g.op('Reshape', [qr, g.int64([0, KH, nRep, D])], undefined, { name: `${base}/q_grouped` }) // [T, KH, nRep, D]
  const scores = g.op('MatMul', [grouped, keys], undefined, { name: `${base}/scores` }) // [T, KH, nRep, L]
  let scaled = g.op('Mul', [scores, scalar(p, layer.scale)], undefined, { name: `${base}/scaled` })
  if (layer.softcap > 0) {
    const over = g.op('Mul', [scaled, scalar(p, 1 / layer.softcap)], undefined, { name: `${base}/softcap/Div` })
    const tanh = g.op('Tanh', [over], undefined, { name: `${base}/softcap/Tanh` })
    scaled = g.op('Mul', [tanh, scalar(p, layer.softcap)], undefined, { name: `${base}/softcap/Mul` })
  }
  const lowest = p.computeType === DataType.FLOAT ? -3.4028234663852886e38 : -65504
  const masked = g.op('Where', [ref.masks.get(layer.window ?? 0)!, scaled, scalar(p, lowest)], undefined, { name: `${base}/masked` })
  const probs = g.op('Softmax', [masked], { axis: I(-1) }, { name: `${base}/Softmax` })
  const context = g.op('MatMul', [probs, values], undefined, { name: `${base}/context` }) // [T, KH, nRep, D]
  return g.op('Reshape', [context, g.int64([0, H * D])], undefined, { name: `${base}/context/Reshape` })
}

/** A scalar constant in the compute type. */
function scalar(p: PagedGraph, value: number): string {
  return p.computeType === DataType.FLOAT ? p.g.float([value], []) : p.g.half([value], [])
}

/**
 * [T, h, D] -> rotated, non-interleaved over the leading `dims` elements of each head:
 * [x1 cos - x2 sin ; x2 cos + x1 sin ; the rest as it is] with [T, 1, dims/2] tables.
 */
function rotary(p: PagedGraph, tables: { cos: string; sin: string }, dims: number, x: string, base: string): string {
  const { g, headSize: D } = p
  const half = dims / 2
  const x1 = g.op('Slice', [x, g.int64([0]), g.int64([half]), g.int64([2])], undefined, { name: `${base}/x1` })
  const x2 = g.op('Slice', [x, g.int64([half]), g.int64([dims]), g.int64([2])], undefined, { name: `${base}/x2` })
  const a = g.op('Mul', [x1, tables.cos], undefined, { name: `${base}/x1_cos` })
  const b = g.op('Mul', [x2, tables.sin], undefined, { name: `${base}/x2_sin` })
  const c = g.op('Mul', [x2, tables.cos], undefined, { name: `${base}/x2_cos` })
  const e = g.op('Mul', [x1, tables.sin], undefined, { name: `${base}/x1_sin` })
  const lo = g.op('Sub', [a, b], undefined, { name: `${base}/lo` })
  const hi = g.op('Add', [c, e], undefined, { name: `${base}/hi` })
  if (dims === D) return g.op('Concat', [lo, hi], { axis: I(2) }, { name: `${base}/Concat` })
  const rest = g.op('Slice', [x, g.int64([dims]), g.int64([D]), g.int64([2])], undefined, { name: `${base}/pass` })
  return g.op('Concat', [lo, hi, rest], { axis: I(2) }, { name: `${base}/Concat` })
}
