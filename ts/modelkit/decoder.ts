// The decoder graph (both attention forms) and the list of its weights.
//
// Per layer: RMSNorm -> attention (rotary positions, grouped KV heads) -> residual -> RMSNorm ->
// gated MLP -> residual; then a final RMSNorm and the lm_head. Both forms use the very same
// weights and the same non-interleaved ("rotate half") rotary tables; only the attention core
// differs:
//   mha: plain ONNX operators (MatMul, Softmax, Where, ...) with position_ids, past concatenated
//        with the new keys/values (present = [past ; new] along the sequence axis);
//   gqa: com.microsoft.GroupQueryAttention with do_rotary=1 and cos/sin caches, seqlens_k and
//        total_sequence_length computed from attention_mask, no position_ids input, as
//        onnxruntime-genai's model builder emits for CPU.
// Options cover what imported models need (ts/modelkit/gguf/): q/k/v biases, an lm_head
// tied to the token embedding, and linear layers stored as com.microsoft.MatMulNBits 4-bit blocks
// (8-bit where the weights hold 8-bit ones: a Q8_0 lm_head);
// and the forms the executor must handle (docs/model-format.md, "Variants"): float16 past, present
// and logits (the weights and the arithmetic stay float32, casts at the edges), and sliding
// windows in GroupQueryAttention (a windowed cache as Gemma-2 folders have, or a window over a
// plain cache).
// The architectures of imported models switch parts of the layer on or off (`DecoderFeatures`, as
// llama.cpp's graph builders do per architecture): where the norms sit (before a sublayer, around
// it, after it), q/k norms, scales of the embedding, residual, attention and logits, soft-capping,
// the gate's activation, and per layer its rotary table (or none) and its sliding window.
// The defaults are the random model of `ortex make-model`, whose bytes must not change.
// See docs/model-format.md for the input/output contract.

import { DECODER_INPUTS, DECODER_OUTPUTS } from '../generated/folder-contract'
import { layerName } from './genai-config'
import { type ExpertDims, moeFeedForward } from './moe'
import { DataType, F, GraphBuilder, I, Is, S, type ExternalTensor } from './onnx-builder'
import {
  LOGITS_INDICES,
  type PagedGraph,
  type PagedKernel,
  type PagedLayer,
  type RotaryWeights,
  type PagedShared,
  cudaPagedAttention,
  declarePagedInputsOutputs,
  pagedShared,
  referencePagedAttention,
} from './paged'

export type AttentionForm = 'mha' | 'gqa' | 'paged'

export interface DecoderDims {
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
export function weightSpecs(d: DecoderDims): WeightSpec[] {
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

export function countParameters(d: DecoderDims): number {
  return weightSpecs(d)
    .filter((s) => s.parameter)
    .reduce((n, s) => n + s.dims.reduce((a, b) => a * b, 1), 0)
}

// The graph's inputs and outputs are named as ortex reads them (the folder contract, generated
// from ortex-ort's config).
export const INPUT_IDS = DECODER_INPUTS.input_ids
export const ATTENTION_MASK = DECODER_INPUTS.attention_mask
export const POSITION_IDS = DECODER_INPUTS.position_ids
export const LOGITS = DECODER_OUTPUTS.logits
export const pastKeyName = (l: number) => layerName(DECODER_INPUTS.past_key_names, l)
export const pastValueName = (l: number) => layerName(DECODER_INPUTS.past_value_names, l)
export const presentKeyName = (l: number) => layerName(DECODER_OUTPUTS.present_key_names, l)
export const presentValueName = (l: number) => layerName(DECODER_OUTPUTS.present_value_names, l)

/** How the linear layers (q/k/v/o, gate/up/down, lm_head) store their weights. */
export type LinearStorage =
  /** `<proj>.weight` float32 [in, out], one MatMul. */
  | { kind: 'fp32' }
  /**
   * com.microsoft.MatMulNBits with 4-bit blocks of 32 along the input: `<proj>.qweight` uint8
   * [out, in/32, 16], `<proj>.scales` float32 [out, in/32], `<proj>.qzeros` uint8 [out, ceil(in/64)]
   * (two 4-bit zero points a byte, low nibble first). Where `<proj>.mins` float32 [in/32, out] is
   * present, each block's value is q * scale + min: the graph adds the input's 32-element block
   * sums times the minimums (what ggml does for Q4_1 and Q4_K), with zero points 0. A
   * `<proj>.qweight` of [out, in/32, 32] holds 8-bit blocks (no qzeros: zero point 128).
   */
  | { kind: 'int4'; accuracyLevel: number }

/** The element type of past, present and logits. */
export type KvType = 'fp32' | 'fp16'

/**
 * A sliding window in the gqa form: every query attends to itself and the `size - 1` positions
 * before it. `cache`: the even layers' GroupQueryAttention has `local_window_size = size` and
 * `sliding_window_cache = 1` (its past is a buffer of a capacity of its own, named
 * `past_sliding_length`), as onnxruntime-genai's builder makes Gemma-2; `graph`: every layer has
 * `local_window_size = size` over a plain cache; `none`: the graph has no window (genai_config
 * carries it, as the builder makes Mistral).
 */
export interface GraphWindow {
  size: number
  form: 'cache' | 'graph' | 'none'
}

/**
 * A rotary table: `cos_cache<suffix>` / `sin_cache<suffix>` [context, dims / 2] weights. `dims`
 * (even, at most the head size) is how many leading elements of each head rotate (the rest pass
 * through: partial rotary); pairs are (i, i + dims / 2), rotate half.
 */
export interface RotaryTable {
  suffix: string
  dims: number
}

/** One layer's attention as its architecture makes it. */
export interface LayerFeatures {
  /** Index into `DecoderFeatures.rotaries`, or null: no rotary in this layer (NoPE). */
  rotary: number | null
  /** Each query attends to itself and the `window - 1` positions before it; undefined: all. */
  window?: number
}

/** What an architecture switches on in the decoder (absent: Llama's). */
export interface DecoderFeatures {
  /** Multiplies the token embeddings (Gemma: sqrt(hidden); Granite: its embedding scale). */
  embeddingScale?: number
  /**
   * Where each sublayer's RMSNorms sit: before it (`pre`: Llama; `input_layernorm`,
   * `post_attention_layernorm`), before and after it (`sandwich`: Gemma 2 and 3; plus
   * `post_attn_norm`, `post_mlp_norm`), or after it only (`post`: OLMo 2; `post_attn_norm`,
   * `post_mlp_norm`).
   */
  norms?: 'pre' | 'sandwich' | 'post'
  /** RMSNorm of q and k before the rotary (`self_attn.q_norm`, `k_norm`): per head (Qwen 3, Gemma 3) or over all heads at once (OLMo 2). */
  qkNorm?: 'head' | 'whole'
  /** The scale of q·k; default 1 / sqrt(head size). */
  attentionScale?: number
  /** cap · tanh(score / cap) on the attention scores (Gemma 2); default none. */
  attentionSoftcap?: number
  /** Multiplies each sublayer's output before its residual add (Granite). */
  residualScale?: number
  /** The feed-forward gate's activation: SiLU (default) or GELU with the tanh approximation (Gemma). */
  activation?: 'silu' | 'gelu-tanh'
  /** Multiplies the logits (Granite: 1 / its logit scale). */
  logitScale?: number
  /** cap · tanh(logit / cap) on the logits (Gemma 2). */
  finalSoftcap?: number
  /** The rotary tables; default one of the whole head (`cos_cache`, `sin_cache`). */
  rotaries?: RotaryTable[]
  /** Per layer; default every layer on rotary table 0 without a window. */
  layers?: LayerFeatures[]
  /** Every layer's feed-forward is a mixture of experts (moe.ts, `model.layers.{l}.mlp` weights). */
  experts?: { dims: ExpertDims; renormalize: boolean }
}

/** The default rotary table: the whole head, named as make-model and the builder name it. */
export const defaultRotaries = (d: DecoderDims): RotaryTable[] => [{ suffix: '', dims: d.headSize }]

export interface DecoderGraphOptions {
  attention: AttentionForm
  /** The architecture's switches; default none (Llama). gqa and paged only where any is set. */
  features?: DecoderFeatures
  /** q, k and v projections add `<proj>.bias` (qwen2). Default false. */
  attentionBias?: boolean
  /** The lm_head is the token embedding (float32: transposed in the graph). Default false. */
  tiedEmbeddings?: boolean
  /** Default fp32. */
  linear?: LinearStorage
  /** Past and present (and the logits, unless `logits` says otherwise); default fp32. */
  kv?: KvType
  /** The logits' element type; default `kv`'s. */
  logits?: KvType
  /**
   * The weights' and the arithmetic's element type; default fp32. fp16 (gqa and paged): every
   * float weight is float16 in the data file and the graph computes in float16, RMSNorm as
   * SimplifiedLayerNormalization with float32 statistics (stash_type 1), as onnxruntime-genai's
   * builder makes `-p fp16` folders; past and present must then be fp16.
   */
  dtype?: KvType
  /** gqa only; default none. */
  window?: GraphWindow
  /** paged only (required there): the attention kernel and the cache's block size (paged.ts). */
  paged?: { kernel: PagedKernel; blockSize: number }
  /**
   * mha only. `'square'`: the causal mask is an S x S triangle expanded over the whole key range,
   * as onnxruntime-genai's builder makes it for its MultiHeadAttention folders (CPU float16): it
   * holds for a prompt without past or a single new token, and a chunk after a past fails inside
   * the graph (Expand: "invalid expand shape"). Default `'full'`.
   */
  causalMask?: 'full' | 'square'
}

/** The layers a window applies to: every other layer from 0 for a windowed cache, else all. */
export function windowedLayers(numLayers: number, window: GraphWindow | undefined): number[] {
  if (!window || window.form === 'none') return []
  return Array.from({ length: numLayers }, (_, l) => l).filter((l) => window.form === 'graph' || l % 2 === 0)
}

/** What every part of the graph needs: the builder, the model's sizes, the options, the weights. */
interface GraphContext {
  g: GraphBuilder
  d: DecoderDims
  options: Required<Omit<DecoderGraphOptions, 'window' | 'causalMask' | 'logits' | 'paged' | 'dtype' | 'features'>> &
    Pick<DecoderGraphOptions, 'window' | 'causalMask' | 'paged'>
  /** The architecture's switches, defaults filled in. */
  f: ResolvedFeatures
  /** The element type of the weights and the arithmetic. */
  computeType: ElementType
  /** The element type of past and present. */
  kvType: ElementType
  /** The element type of the logits. */
  logitsType: ElementType
  /** The initializer of a weight, added to the graph on first use. */
  w: (name: string) => string
  has: (name: string) => boolean
  /** The dims of a weight. */
  weightDims: (name: string) => number[]
  /** Inputs whose 32-element block sums are already computed (int4 weights with minimums). */
  blockSums: Set<string>
}

type ElementType = typeof DataType.FLOAT | typeof DataType.FLOAT16

const elementType = (t: KvType): ElementType => (t === 'fp16' ? DataType.FLOAT16 : DataType.FLOAT)

type OptionalFeature = 'attentionSoftcap' | 'residualScale' | 'logitScale' | 'finalSoftcap' | 'embeddingScale' | 'qkNorm' | 'experts'
type ResolvedFeatures = Required<Omit<DecoderFeatures, OptionalFeature>> & Pick<DecoderFeatures, OptionalFeature>

/** The features with their defaults, checked against the sizes. */
function resolveFeatures(d: DecoderDims, f: DecoderFeatures): ResolvedFeatures {
  const rotaries = f.rotaries ?? defaultRotaries(d)
  const layers: LayerFeatures[] = f.layers ?? Array.from({ length: d.numLayers }, () => ({ rotary: 0 }))
  if (layers.length !== d.numLayers) throw new Error(`features give ${layers.length} layers, the model has ${d.numLayers}`)
  for (const t of rotaries) if (t.dims % 2 !== 0 || t.dims < 2 || t.dims > d.headSize) throw new Error(`a rotary table of ${t.dims} dims does not fit heads of ${d.headSize}`)
  for (const layer of layers) {
    if (layer.rotary !== null && rotaries[layer.rotary] === undefined) throw new Error(`no rotary table ${layer.rotary}`)
    if (layer.window !== undefined && !(Number.isInteger(layer.window) && layer.window > 0)) throw new Error(`a window must be a positive integer, got ${layer.window}`)
  }
  return { ...f, norms: f.norms ?? 'pre', activation: f.activation ?? 'silu', attentionScale: f.attentionScale ?? 1 / Math.sqrt(d.headSize), rotaries, layers }
}

/** Whether the features differ from Llama's (which the mha form and the fused float16 layers assume). */
function hasFeatures(d: DecoderDims, f: DecoderFeatures | undefined): boolean {
  if (!f) return false
  const plainLayers = f.layers === undefined || f.layers.every((l) => l.rotary === 0 && l.window === undefined)
  const plainRotary = f.rotaries === undefined || (f.rotaries.length === 1 && f.rotaries[0]!.dims === d.headSize && f.rotaries[0]!.suffix === '')
  const { layers, rotaries, ...scalars } = f
  const plainScalars = Object.entries(scalars).every(([key, value]) =>
    value === undefined || (key === 'norms' && value === 'pre') || (key === 'activation' && value === 'silu') || (key === 'attentionScale' && value === 1 / Math.sqrt(d.headSize)))
  return !(plainLayers && plainRotary && plainScalars)
}

/** The tensors that rotary, masking and attention share across layers. */
interface SharedInputs {
  /** The rotary tables' weights, in DecoderFeatures.rotaries order. */
  tables: RotaryWeights[]
  mha?: { mask: string; cos: string; sin: string }
  /** gqa: the rotary tables in the KV type (GroupQueryAttention takes every float input in one type). */
  gqa?: { seqlensK: string; totalSeqLen: string; tables: RotaryWeights[] }
  paged?: { graph: PagedGraph; tensors: PagedShared }
}

/** Builds the decoder graph; `weights` maps each weight name to its place in the data file. */
export function buildDecoderGraph(
  d: DecoderDims,
  attentionOrOptions: AttentionForm | DecoderGraphOptions,
  weights: ReadonlyMap<string, ExternalTensor>,
): GraphBuilder {
  if (d.numHeads % d.numKvHeads !== 0) throw new Error('num_heads must be a multiple of num_kv_heads')
  if (d.headSize % 2 !== 0) throw new Error('head_size must be even (rotary embedding)')
  const { logits, dtype, features, ...given } = typeof attentionOrOptions === 'string' ? { attention: attentionOrOptions } : attentionOrOptions
  const options: GraphContext['options'] = {
    attentionBias: false,
    tiedEmbeddings: false,
    linear: { kind: 'fp32' },
    kv: 'fp32',
    ...given,
  }
  if (options.window && options.attention !== 'gqa') throw new Error('a sliding window needs the gqa attention form')
  if (options.causalMask === 'square' && options.attention !== 'mha') throw new Error('a square causal mask needs the mha form')
  if ((options.attention === 'paged') !== (options.paged !== undefined)) throw new Error('the paged form needs its kernel and block size (and only it)')
  if (dtype === 'fp16' && (options.attention === 'mha' || options.kv !== 'fp16')) throw new Error('float16 weights need the gqa or paged form and float16 KV')
  const featured = hasFeatures(d, features)
  if (featured && options.attention === 'mha') throw new Error("an architecture's features need the gqa or paged form")
  if (featured && options.window) throw new Error('a graph window and per-layer windows (features) exclude each other')
  const g = new GraphBuilder(`ortex-llama-${options.attention}`)
  const added = new Set<string>()
  const w = (name: string): string => {
    const t = weights.get(name)
    if (!t) throw new Error(`missing weight ${name}`)
    if (!added.has(name)) g.external(t)
    added.add(name)
    return name
  }
  const ctx: GraphContext = {
    g,
    d,
    options,
    f: resolveFeatures(d, features ?? {}),
    computeType: elementType(dtype ?? 'fp32'),
    kvType: elementType(options.kv),
    logitsType: elementType(logits ?? options.kv),
    w,
    has: (name) => weights.has(name),
    weightDims: (name) => weights.get(name)?.dims ?? [],
    blockSums: new Set(),
  }

  const paged = options.attention === 'paged' ? pagedGraph(ctx) : undefined
  if (paged) declarePaged(ctx, paged)
  else declareInputsOutputs(ctx)
  const shared: SharedInputs = { tables: ctx.f.rotaries.map((t) => ({ cosCache: w(`cos_cache${t.suffix}`), sinCache: w(`sin_cache${t.suffix}`) })) }
  if (options.attention === 'mha') shared.mha = mhaMaskAndRotary(ctx, shared)
  else if (options.attention === 'gqa') shared.gqa = gqaSequenceLengths(ctx, shared)
  else {
    const windows = ctx.f.layers.flatMap((l) => (l.window === undefined ? [] : [l.window]))
    shared.paged = { graph: paged!, tensors: pagedShared(paged!, options.paged!.kernel, INPUT_IDS, shared.tables, windows) }
  }

  const embedded = embed(ctx)
  const fused = ctx.computeType === DataType.FLOAT16 && ctx.f.norms === 'pre' && ctx.f.residualScale === undefined
  lmHead(ctx, fused ? fusedLayers(ctx, shared, embedded) : layers(ctx, shared, embedded))
  return g
}

/** The token embeddings, scaled where the architecture says. */
function embed(ctx: GraphContext): string {
  const { g, w, f } = ctx
  const embedded = g.op('Gather', [w('model.embed_tokens.weight'), INPUT_IDS], { axis: I(0) }, { name: '/model/embed_tokens/Gather' })
  if (f.embeddingScale === undefined) return embedded
  return g.op('Mul', [embedded, constant(ctx, f.embeddingScale)], undefined, { name: '/model/embed_tokens/Mul' })
}

/** A scalar constant in the compute type. */
function constant({ g, computeType }: GraphContext, value: number): string {
  return computeType === DataType.FLOAT ? g.float([value], []) : g.half([value], [])
}

/** Every decoder layer and the final norm, the residual stream added where it is made. */
function layers(ctx: GraphContext, shared: SharedInputs, embedded: string): string {
  let x = embedded
  for (let l = 0; l < ctx.d.numLayers; l++) x = decoderLayer(ctx, shared, x, l)
  return rmsNorm(ctx, x, 'model.norm.weight', '/model/norm')
}

/**
 * The float16 folders' layers as the builder makes them: each residual add fused into the next
 * norm, com.microsoft.SkipSimplifiedLayerNormalization(residual, delta, weight) -> (normed, sum),
 * so a layer hands on (residual, delta) and the first norm is a plain one:
 *
 *   embedded -> SLN -> attn -> o ─┐
 *       └──── residual ─────── SkipSLN -> mlp -> down ─┐
 *                                  └─ sum ──────────── SkipSLN (next layer's input norm) ...
 */
function fusedLayers(ctx: GraphContext, shared: SharedInputs, embedded: string): string {
  const { g, d, w } = ctx
  let residual = embedded
  let h = rmsNorm(ctx, embedded, 'model.layers.0.input_layernorm.weight', '/model/layers.0/input_layernorm')
  const skipNorm = (delta: string, skip: string, weight: string, base: string, sum = true): [string, string] => {
    const outputs = [`${base}/output_0`, '', '', ...(sum ? [`${base}/output_3`] : [])]
    const [normed, , , added] = g.node('SkipSimplifiedLayerNormalization', [skip, delta, w(weight)], {
      name: base,
      domain: 'com.microsoft',
      outputs,
      attrs: { epsilon: F(d.rmsNormEps) },
    })
    return [normed!, added ?? '']
  }
  for (let l = 0; l < d.numLayers; l++) {
    const p = `model.layers.${l}`
    const base = `/model/layers.${l}`
    let o = linear(ctx, attention(ctx, shared, h, l), `${p}.self_attn.o_proj`, `${base}/attn/o_proj`)
    if (shared.paged && l === d.numLayers - 1) {
      // As the builder's make_selected_hidden_rows: both of the norm's inputs, the wanted rows only.
      const select = (x: string, tag: string) => g.op('Gather', [x, LOGITS_INDICES], { axis: I(0) }, { name: `/model/selected_rows/${tag}/Gather` })
      residual = select(residual, 'root_input')
      o = select(o, 'skip_input')
    }
    const [h2, sum] = skipNorm(o, residual, `${p}.post_attention_layernorm.weight`, `${base}/post_attention_layernorm/SkipLayerNorm`)
    const down = mlp(ctx, h2, l)
    const last = l === d.numLayers - 1
    const next = last ? ['model.norm.weight', '/model/norm/SkipLayerNorm'] : [`model.layers.${l + 1}.input_layernorm.weight`, `/model/layers.${l + 1}/input_layernorm/SkipLayerNorm`]
    ;[h, residual] = skipNorm(down, sum, next[0]!, next[1]!, !last)
  }
  return h
}

/** The paged kernels' view of the graph (float32 arithmetic; caches of the KV type). */
function pagedGraph({ g, d, options, kvType, computeType }: GraphContext): PagedGraph {
  const { blockSize } = options.paged!
  if (!Number.isInteger(blockSize) || blockSize < 1) throw new Error(`block size must be a positive integer, got ${blockSize}`)
  return { g, numHeads: d.numHeads, numKvHeads: d.numKvHeads, headSize: d.headSize, blockSize, kvType, computeType }
}

function declarePaged({ d, logitsType }: GraphContext, p: PagedGraph): void {
  declarePagedInputsOutputs(p, d.numLayers, d.vocabSize, logitsType, {
    inputIds: INPUT_IDS,
    logits: LOGITS,
    past: (l, kind) => (kind === 'key' ? pastKeyName(l) : pastValueName(l)),
    present: (l, kind) => (kind === 'key' ? presentKeyName(l) : presentValueName(l)),
  })
}

/**
 * The geometry of a block weight `<proj>.qweight` [N, K / block_size, block_size * bits / 8] of a
 * projection whose input is K wide: 4-bit blocks of 32, or 8-bit blocks of 32 or 16.
 */
function blockGeometry(ctx: GraphContext, proj: string): { N: number; K: number; bits: number; blockSize: number } {
  const [N = 0, blocks = 0, blob = 0] = ctx.weightDims(`${proj}.qweight`)
  const K = inputSize(ctx, proj)
  const blockSize = K / blocks
  const bits = (blob * 8) / blockSize
  const known = (bits === 4 && blockSize === 32) || (bits === 8 && (blockSize === 32 || blockSize === 16))
  if (!known) throw new Error(`${proj}.qweight: ${blocks} blocks of ${blob} bytes over ${K} inputs are neither 4-bit blocks of 32 nor 8-bit blocks of 32 or 16`)
  return { N, K, bits, blockSize }
}

/** The input width of a projection (its weight's K). */
function inputSize({ d }: GraphContext, proj: string): number {
  if (proj.endsWith('.o_proj')) return d.numHeads * d.headSize
  if (proj.endsWith('.down_proj')) return d.intermediateSize
  return d.hiddenSize
}

function declareInputsOutputs({ g, d, options, kvType, logitsType }: GraphContext): void {
  const D = d.headSize
  g.input(INPUT_IDS, DataType.INT64, ['batch_size', 'sequence_length'])
  g.input(ATTENTION_MASK, DataType.INT64, ['batch_size', 'total_sequence_length'])
  if (options.attention === 'mha') g.input(POSITION_IDS, DataType.INT64, ['batch_size', 'sequence_length'])
  // A windowed cache's past is a buffer of its own capacity (the builder names it so).
  const cached = new Set(options.window?.form === 'cache' ? windowedLayers(d.numLayers, options.window) : [])
  const past = (l: number) => (cached.has(l) ? 'past_sliding_length' : 'past_sequence_length')
  const present = (l: number) => (cached.has(l) ? 'present_sliding_length' : 'total_sequence_length')
  for (let l = 0; l < d.numLayers; l++) {
    g.input(pastKeyName(l), kvType, ['batch_size', d.numKvHeads, past(l), D])
    g.input(pastValueName(l), kvType, ['batch_size', d.numKvHeads, past(l), D])
  }
  g.output(LOGITS, logitsType, ['batch_size', 'sequence_length', d.vocabSize])
  for (let l = 0; l < d.numLayers; l++) {
    g.output(presentKeyName(l), kvType, ['batch_size', d.numKvHeads, present(l), D])
    g.output(presentValueName(l), kvType, ['batch_size', d.numKvHeads, present(l), D])
  }
}

/** mha: the causal-and-padding mask grouped per KV head, and the rotary tables at position_ids. */
function mhaMaskAndRotary({ g, d, options }: GraphContext, shared: SharedInputs): NonNullable<SharedInputs['mha']> {
  const nRep = d.numHeads / d.numKvHeads
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
  const causal =
    options.causalMask === 'square'
      ? squareCausal(g, Sn, T, qCol, b)
      : g.op('LessOrEqual', [kIdx, qCol], undefined, { name: `${b}/causal` }) // [S, T]
  const pad = g.op('Cast', [ATTENTION_MASK], { to: I(DataType.BOOL) }, { name: `${b}/mask_bool` })
  const pad4 = g.op('Unsqueeze', [pad, g.int64([1, 2])], undefined, { name: `${b}/mask_4d` }) // [B,1,1,T]
  const both = g.op('And', [causal, pad4], undefined, { name: `${b}/causal_and_mask` }) // [B,1,S,T]
  // Queries are grouped per KV head as [B, kv_heads, n_rep * S, D]: repeat the mask n_rep times.
  const mask = g.op('Tile', [both, g.int64([1, 1, nRep, 1])], undefined, { name: `${b}/mask_grouped` })
  // Rotary tables for these positions: [B, 1, S, D/2].
  const rb = '/model/rotary'
  const cosG = g.op('Gather', [shared.tables[0]!.cosCache, POSITION_IDS], { axis: I(0) }, { name: `${rb}/cos_gather` })
  const sinG = g.op('Gather', [shared.tables[0]!.sinCache, POSITION_IDS], { axis: I(0) }, { name: `${rb}/sin_gather` })
  const cos = g.op('Unsqueeze', [cosG, g.int64([1])], undefined, { name: `${rb}/cos` })
  const sin = g.op('Unsqueeze', [sinG, g.int64([1])], undefined, { name: `${rb}/sin` })
  return { mask, cos, sin }
}

/** The builder's causal mask: the S x S triangle, expanded to [S, T] (valid only when T = S or
 *  S = 1; otherwise Expand fails, as in the builder's graphs). */
function squareCausal(g: GraphBuilder, Sn: string, T: string, qCol: string, b: string): string {
  const sIdx = g.op('Range', [g.int64([0], []), Sn, g.int64([1], [])], undefined, { name: `${b}/square/key_index` })
  const qRel = g.op('Sub', [qCol, g.op('ReduceMin', [qCol], { keepdims: I(1) }, { name: `${b}/square/first_query` })], undefined, {
    name: `${b}/square/query_index`,
  })
  const triangle = g.op('LessOrEqual', [sIdx, qRel], undefined, { name: `${b}/square/triangle` }) // [S, S]
  const shape = g.op('Concat', [g.op('Unsqueeze', [Sn, g.int64([0])], undefined, { name: `${b}/square/rows` }), g.op('Unsqueeze', [T, g.int64([0])], undefined, { name: `${b}/square/cols` })], { axis: I(0) }, { name: `${b}/square/shape` })
  return g.op('Expand', [triangle, shape], undefined, { name: `${b}/square/causal` }) // [S, T]
}

/** gqa: seqlens_k and total_sequence_length from attention_mask, as the builder computes them;
 *  the rotary tables in the KV type (GroupQueryAttention takes every float input in one type). */
function gqaSequenceLengths({ g, kvType, computeType }: GraphContext, shared: SharedInputs): NonNullable<SharedInputs['gqa']> {
  const b = '/model/attn_mask_reformat/attn_mask_subgraph'
  const sum = g.op('ReduceSum', [ATTENTION_MASK, g.int64([1])], { keepdims: I(0) }, { name: `${b}/ReduceSum` })
  const sub = g.op('Sub', [sum, g.int64([1], [])], undefined, { name: `${b}/Sub` })
  const seqlensK = g.op('Cast', [sub], { to: I(DataType.INT32) }, { name: `${b}/Sub/Cast` })
  const shape = g.op('Shape', [ATTENTION_MASK], undefined, { name: `${b}/Shape` })
  const total = g.op('Gather', [shape, g.int64([1], [])], { axis: I(0) }, { name: `${b}/Gather` })
  const totalSeqLen = g.op('Cast', [total], { to: I(DataType.INT32) }, { name: `${b}/Gather/Cast` })
  if (kvType === computeType) return { seqlensK, totalSeqLen, tables: shared.tables }
  const to = { to: I(kvType) }
  const tables = shared.tables.map((t, i) => {
    const rb = i === 0 ? '/model/rotary' : `/model/rotary_${i}`
    const cosCache = g.op('Cast', [t.cosCache], to, { name: `${rb}/cos_cache/Cast` })
    const sinCache = g.op('Cast', [t.sinCache], to, { name: `${rb}/sin_cache/Cast` })
    return { cosCache, sinCache }
  })
  return { seqlensK, totalSeqLen, tables }
}

/**
 * One layer. Its norms sit where the architecture puts them:
 *
 *   pre       x + o(attn(norm(x)))                 then  x + mlp(norm(x))
 *   sandwich  x + post_norm(o(attn(norm(x))))      then  x + post_norm(mlp(norm(x)))
 *   post      x + post_norm(o(attn(x)))            then  x + post_norm(mlp(x))
 *
 * each sublayer's output times the residual scale, where there is one, before its add.
 */
function decoderLayer(ctx: GraphContext, shared: SharedInputs, x: string, l: number): string {
  const { g, f } = ctx
  const p = `model.layers.${l}`
  const base = `/model/layers.${l}`
  const h = f.norms === 'post' ? x : rmsNorm(ctx, x, `${p}.input_layernorm.weight`, `${base}/input_layernorm`)
  const attn = attention(ctx, shared, h, l)
  let o = linear(ctx, attn, `${p}.self_attn.o_proj`, `${base}/attn/o_proj`)
  if (f.norms !== 'pre') o = rmsNorm(ctx, o, `${p}.post_attn_norm.weight`, `${base}/post_attn_norm`)
  o = residualScaled(ctx, o, `${base}/attn`)
  x = g.op('Add', [x, o], undefined, { name: `${base}/attn/residual` })
  // paged: past the last attention every row only feeds the lm_head, so only the rows whose
  // logits are wanted go on (the builder's prune_lm_head, base.py make_layer).
  if (shared.paged && l === ctx.d.numLayers - 1) {
    x = g.op('Gather', [x, LOGITS_INDICES], { axis: I(0) }, { name: '/model/selected_rows/Gather' })
  }
  const h2 = f.norms === 'post' ? x : rmsNorm(ctx, x, `${p}.post_attention_layernorm.weight`, `${base}/post_attention_layernorm`)
  let down = mlp(ctx, h2, l)
  if (f.norms !== 'pre') down = rmsNorm(ctx, down, `${p}.post_mlp_norm.weight`, `${base}/post_mlp_norm`)
  down = residualScaled(ctx, down, `${base}/mlp`)
  return g.op('Add', [x, down], undefined, { name: `${base}/mlp/residual` })
}

/** A sublayer's output times the architecture's residual scale (Granite), or as it is. */
function residualScaled(ctx: GraphContext, x: string, base: string): string {
  if (ctx.f.residualScale === undefined) return x
  return ctx.g.op('Mul', [x, constant(ctx, ctx.f.residualScale)], undefined, { name: `${base}/residual_scale/Mul` })
}

function rmsNorm({ g, d, w, computeType }: GraphContext, x: string, weight: string, base: string): string {
  if (computeType !== DataType.FLOAT) {
    // float16: x^2 overflows past |x| = 256 (real models' residual streams get there), so the
    // statistics are float32 inside the operator, as the builder's float16 folders do it.
    const attrs = { axis: I(-1), epsilon: F(d.rmsNormEps), stash_type: I(1) }
    return g.op('SimplifiedLayerNormalization', [x, w(weight)], attrs, { name: `${base}/SimplifiedLayerNormalization` })
  }
  const sq = g.op('Pow', [x, g.float([2], [])], undefined, { name: `${base}/Pow` })
  const mean = g.op('ReduceMean', [sq, g.int64([-1])], { keepdims: I(1) }, { name: `${base}/ReduceMean` })
  const eps = g.op('Add', [mean, g.float([d.rmsNormEps], [])], undefined, { name: `${base}/Add` })
  const root = g.op('Sqrt', [eps], undefined, { name: `${base}/Sqrt` })
  const normed = g.op('Div', [x, root], undefined, { name: `${base}/Div` })
  return g.op('Mul', [normed, w(weight)], undefined, { name: `${base}/Mul` })
}

/**
 * RMSNorm of a q or k projection [.., heads * D] before the rotary: over each head's D elements
 * (`head`, weight [D]) or over the whole projection (`whole`, weight [heads * D]).
 */
function qkNorm(ctx: GraphContext, x: string, heads: number, weight: string, base: string): string {
  if (ctx.f.qkNorm === 'whole') return rmsNorm(ctx, x, weight, base)
  const D = ctx.d.headSize
  const paged = ctx.options.attention === 'paged'
  const split = ctx.g.op('Reshape', [x, ctx.g.int64(paged ? [0, heads, D] : [0, 0, heads, D])], undefined, { name: `${base}/heads/Reshape` })
  const normed = rmsNorm(ctx, split, weight, base)
  return ctx.g.op('Reshape', [normed, ctx.g.int64(paged ? [0, heads * D] : [0, 0, heads * D])], undefined, { name: `${base}/Reshape` })
}

/** q/k/v projections and the attention core of layer `l`; returns the context [B, S, H * D]. */
function attention(ctx: GraphContext, shared: SharedInputs, h: string, l: number): string {
  const p = `model.layers.${l}.self_attn`
  const base = `/model/layers.${l}/attn`
  const bias = ctx.options.attentionBias
  // The CUDA folders take q, k and v from one MatMul, as the builder packs them (the kernels take
  // a packed query with key and value left empty): one GEMM launch a layer instead of three.
  const packed = packsQkv(ctx) ? packedQkvLinear(ctx, h, l) : undefined
  if (packed !== undefined) {
    return ctx.options.attention === 'paged' ? pagedCore(ctx, shared, packed, '', '', l) : gqaCore(ctx, shared, packed, '', '', l)
  }
  let q = linear(ctx, h, `${p}.q_proj`, `${base}/q_proj`, bias)
  let k = linear(ctx, h, `${p}.k_proj`, `${base}/k_proj`, bias)
  const v = linear(ctx, h, `${p}.v_proj`, `${base}/v_proj`, bias)
  if (ctx.f.qkNorm) {
    q = qkNorm(ctx, q, ctx.d.numHeads, `${p}.q_norm.weight`, `${base}/q_norm`)
    k = qkNorm(ctx, k, ctx.d.numKvHeads, `${p}.k_norm.weight`, `${base}/k_norm`)
  }
  if (ctx.options.attention === 'paged') return pagedCore(ctx, shared, q, k, v, l)
  return ctx.options.attention === 'gqa' ? gqaCore(ctx, shared, q, k, v, l) : mhaCore(ctx, shared, q, k, v, l)
}

/** Float16 folders for CUDA (gqa, and paged with the cuda kernel) pack q/k/v; the float32 folders
 *  and the reference kernel keep three MatMuls (their bytes and graphs stay as they were). */
function packsQkv({ computeType, options, f }: GraphContext): boolean {
  if (computeType !== DataType.FLOAT16 || f.qkNorm) return false
  return options.attention === 'gqa' || options.paged?.kernel === 'cuda'
}

/**
 * h [.., in] -> [.., q + 2 kv] through q/k/v weights concatenated along the output in the graph
 * (`/model/layers.{l}/attn/qkv_proj/MatMul`, the builder's name). The Concats have only
 * initializer inputs, so ONNX Runtime folds them into one packed weight when it loads the
 * session; the data file keeps q, k and v apart (the same weights as the unpacked folders).
 * int4 blocks concatenate along N (qweight, scales, zero points; minimums along their N axis);
 * undefined where the three are not stored alike (different block types), as the builder packs
 * only projections of one type.
 */
function packedQkvLinear(ctx: GraphContext, h: string, l: number): string | undefined {
  const { g, w } = ctx
  const p = `model.layers.${l}.self_attn`
  const base = `/model/layers.${l}/attn/qkv_proj`
  const projs = ['q_proj', 'k_proj', 'v_proj'].map((name) => `${p}.${name}`)
  const concat = (suffix: string, axis: number) =>
    g.op('Concat', projs.map((proj) => w(`${proj}.${suffix}`)), { axis: I(axis) }, { name: `${base}/${suffix}/Concat` })
  let y: string
  if (ctx.options.linear.kind === 'fp32') {
    y = g.op('MatMul', [h, concat('weight', 1)], undefined, { name: `${base}/MatMul` })
  } else {
    const geometry = projs.map((proj) => blockGeometry(ctx, proj))
    const kinds = projs.map((proj, i) => [geometry[i]!.bits, geometry[i]!.blockSize, ctx.has(`${proj}.qzeros`), ctx.has(`${proj}.mins`)].join())
    if (new Set(kinds).size !== 1) return undefined
    const N = geometry.reduce((n, x) => n + x.N, 0)
    const { K, bits, blockSize } = geometry[0]!
    const attrs = { K: I(K), N: I(N), bits: I(bits), block_size: I(blockSize), accuracy_level: I((ctx.options.linear as { accuracyLevel: number }).accuracyLevel) }
    const zeros = ctx.has(`${projs[0]}.qzeros`) ? [concat('qzeros', 0)] : []
    y = g.op('MatMulNBits', [h, concat('qweight', 0), concat('scales', 0), ...zeros], attrs, { name: `${base}/MatMulNBits`, domain: 'com.microsoft' })
    if (ctx.has(`${projs[0]}.mins`)) {
      const offsets = g.op('MatMul', [blockSums(ctx, h, K), concat('mins', 1)], undefined, { name: `${base}/mins/MatMul` })
      y = g.op('Add', [y, offsets], undefined, { name: `${base}/mins/Add` })
    }
  }
  if (!ctx.options.attentionBias) return y
  return g.op('Add', [y, concat('bias', 0)], undefined, { name: `${base}/Add` })
}

function pagedCore(ctx: GraphContext, shared: SharedInputs, q: string, k: string, v: string, l: number): string {
  const { graph, tensors } = shared.paged!
  const cache = { pastKey: pastKeyName(l), pastValue: pastValueName(l), presentKey: presentKeyName(l), presentValue: presentValueName(l) }
  const base = `/model/layers.${l}/attn`
  const kernel = ctx.options.paged!.kernel === 'cuda' ? cudaPagedAttention : referencePagedAttention
  return kernel(graph, tensors, q, k, v, cache, base, layerAttention(ctx, l))
}

/** Layer l's attention as the kernels take it: rotary table and dims (or none), window, scale, soft-cap. */
function layerAttention({ f }: GraphContext, l: number): PagedLayer {
  const layer = f.layers[l]!
  return {
    rotary: layer.rotary === null ? null : { table: layer.rotary, dims: f.rotaries[layer.rotary]!.dims },
    window: layer.window,
    scale: f.attentionScale,
    softcap: f.attentionSoftcap ?? 0,
  }
}

function gqaCore(ctx: GraphContext, shared: SharedInputs, q: string, k: string, v: string, l: number): string {
  const { g, d, kvType, computeType, options } = ctx
  const base = `/model/layers.${l}/attn`
  const { seqlensK, totalSeqLen, tables } = shared.gqa!
  const half = kvType !== computeType
  const toKv = (x: string, tag: string) => (half ? g.op('Cast', [x], { to: I(kvType) }, { name: `${base}/${tag}/Cast` }) : x)
  // A graph window (make-model's variants) or the architecture's window of this layer.
  const graphWindow = windowedLayers(d.numLayers, options.window).includes(l) ? options.window!.size : undefined
  const layer = layerAttention(ctx, l)
  const window = graphWindow ?? layer.window
  const attrs: Record<string, ReturnType<typeof I>> = {
    num_heads: I(d.numHeads),
    kv_num_heads: I(d.numKvHeads),
    scale: F(layer.scale),
    local_window_size: I(window ?? -1),
    softcap: F(layer.softcap),
    do_rotary: I(layer.rotary ? 1 : 0),
    rotary_interleaved: I(0),
  }
  if (graphWindow !== undefined && options.window!.form === 'cache') attrs.sliding_window_cache = I(1)
  const rotary = layer.rotary ? [tables[layer.rotary.table]!.cosCache, tables[layer.rotary.table]!.sinCache] : []
  const [out] = g.node(
    'GroupQueryAttention',
    [toKv(q, 'q'), toKv(k, 'k'), toKv(v, 'v'), pastKeyName(l), pastValueName(l), seqlensK, totalSeqLen, ...rotary],
    {
      name: `${base}/GroupQueryAttention`,
      domain: 'com.microsoft',
      outputs: [`${base}/GroupQueryAttention/output_0`, presentKeyName(l), presentValueName(l)],
      attrs,
    },
  ) as [string]
  return half ? g.op('Cast', [out], { to: I(computeType) }, { name: `${base}/GroupQueryAttention/Cast` }) : out
}

function mhaCore(ctx: GraphContext, shared: SharedInputs, q: string, k: string, v: string, l: number): string {
  const { g, d } = ctx
  const D = d.headSize
  const a = `/model/layers.${l}/attn`
  const { mask } = shared.mha!
  const heads = (t: string, n: number, tag: string): string => {
    const r = g.op('Reshape', [t, g.int64([0, 0, n, D])], undefined, { name: `${a}/${tag}/Reshape` })
    return g.op('Transpose', [r], { perm: Is([0, 2, 1, 3]) }, { name: `${a}/${tag}/Transpose` }) // [B,n,S,D]
  }
  const qr = rotary(ctx, shared, heads(q, d.numHeads, 'q'), `${a}/q_rotary`)
  const kr = rotary(ctx, shared, heads(k, d.numKvHeads, 'k'), `${a}/k_rotary`)
  const vh = heads(v, d.numKvHeads, 'v')
  // float16 KV: the new keys and values are stored rounded, and the attention reads them back.
  const half = ctx.kvType !== DataType.FLOAT
  const cast = (x: string, to: number, tag: string) => (half ? g.op('Cast', [x], { to: I(to) }, { name: `${a}/${tag}` }) : x)
  const storedK = g.op('Concat', [pastKeyName(l), cast(kr, ctx.kvType, 'k_rotary/Cast')], { axis: I(2) }, { name: `${a}/present_key`, outputs: [presentKeyName(l)] })
  const storedV = g.op('Concat', [pastValueName(l), cast(vh, ctx.kvType, 'v/Cast')], { axis: I(2) }, { name: `${a}/present_value`, outputs: [presentValueName(l)] })
  const presentK = cast(storedK, DataType.FLOAT, 'present_key/Cast')
  const presentV = cast(storedV, DataType.FLOAT, 'present_value/Cast')
  // Group query heads by their KV head: [B, H, S, D] -> [B, kv_heads, n_rep * S, D]
  // (query head i uses KV head floor(i / n_rep), as in GroupQueryAttention).
  const qg = g.op('Reshape', [qr, g.int64([0, d.numKvHeads, -1, D])], undefined, { name: `${a}/q_grouped` })
  const kt = g.op('Transpose', [presentK], { perm: Is([0, 1, 3, 2]) }, { name: `${a}/k_transposed` })
  const scores = g.op('MatMul', [qg, kt], undefined, { name: `${a}/scores` })
  const scaled = g.op('Mul', [scores, g.float([1 / Math.sqrt(D)], [])], undefined, { name: `${a}/scaled` })
  const masked = g.op('Where', [mask, scaled, g.float([-3.4028234663852886e38], [])], undefined, { name: `${a}/masked` })
  const probs = g.op('Softmax', [masked], { axis: I(-1) }, { name: `${a}/Softmax` })
  const attn = g.op('MatMul', [probs, presentV], undefined, { name: `${a}/context` }) // [B,kv,n_rep*S,D]
  const ungroup = g.op('Reshape', [attn, g.int64([0, d.numHeads, -1, D])], undefined, { name: `${a}/ungroup` })
  const bshd = g.op('Transpose', [ungroup], { perm: Is([0, 2, 1, 3]) }, { name: `${a}/context/Transpose` })
  return g.op('Reshape', [bshd, g.int64([0, 0, d.numHeads * D])], undefined, { name: `${a}/context/Reshape` })
}

/** [B, h, S, D] -> rotated, non-interleaved: [x1 cos - x2 sin ; x2 cos + x1 sin] */
function rotary({ g, d }: GraphContext, shared: SharedInputs, x: string, base: string): string {
  const { cos, sin } = shared.mha!
  const D = d.headSize
  const half = D / 2
  const x1 = g.op('Slice', [x, g.int64([0]), g.int64([half]), g.int64([3])], undefined, { name: `${base}/x1` })
  const x2 = g.op('Slice', [x, g.int64([half]), g.int64([D]), g.int64([3])], undefined, { name: `${base}/x2` })
  const a = g.op('Mul', [x1, cos], undefined, { name: `${base}/x1_cos` })
  const b = g.op('Mul', [x2, sin], undefined, { name: `${base}/x2_sin` })
  const c = g.op('Mul', [x2, cos], undefined, { name: `${base}/x2_cos` })
  const e = g.op('Mul', [x1, sin], undefined, { name: `${base}/x1_sin` })
  const lo = g.op('Sub', [a, b], undefined, { name: `${base}/lo` })
  const hi = g.op('Add', [c, e], undefined, { name: `${base}/hi` })
  return g.op('Concat', [lo, hi], { axis: I(3) }, { name: `${base}/Concat` })
}

/** The gated MLP: down(act(gate(h)) * up(h)), act SiLU (SwiGLU) or GELU-tanh (GeGLU); or the
 *  architecture's mixture of experts. */
function mlp(ctx: GraphContext, h: string, l: number): string {
  const { g } = ctx
  const p = `model.layers.${l}.mlp`
  const base = `/model/layers.${l}/mlp`
  if (ctx.f.experts) {
    const { dims, renormalize } = ctx.f.experts
    return moeFeedForward(ctx, h, { weights: p, nodes: base, dims, renormalize, storage: ctx.options.linear })
  }
  const gate = linear(ctx, h, `${p}.gate_proj`, `${base}/gate_proj`)
  const up = linear(ctx, h, `${p}.up_proj`, `${base}/up_proj`)
  const prod = g.op('Mul', [activation(ctx, gate, `${base}/act`), up], undefined, { name: `${base}/Mul` })
  return linear(ctx, prod, `${p}.down_proj`, `${base}/down_proj`)
}

function activation({ g, f }: GraphContext, x: string, base: string): string {
  if (f.activation === 'gelu-tanh') return g.op('Gelu', [x], { approximate: S('tanh') }, { name: `${base}/Gelu` })
  const sig = g.op('Sigmoid', [x], undefined, { name: `${base}/Sigmoid` })
  return g.op('Mul', [x, sig], undefined, { name: `${base}/Mul` })
}

function lmHead(ctx: GraphContext, x: string): void {
  const { g, options, w, f } = ctx
  // Logits of another type than the arithmetic's (float16 logits of a float32 model): cast at the end.
  const half = ctx.logitsType !== ctx.computeType
  const scaled = f.logitScale !== undefined || f.finalSoftcap !== undefined
  const out = half ? '/lm_head/output_float' : LOGITS
  const product = scaled ? '/lm_head/output_0' : out
  if (options.linear.kind === 'fp32' && options.tiedEmbeddings) {
    const t = g.op('Transpose', [w('model.embed_tokens.weight')], { perm: Is([1, 0]) }, { name: '/lm_head/Transpose' })
    g.op('MatMul', [x, t], undefined, { name: '/lm_head/MatMul', outputs: [product] })
  } else {
    linear(ctx, x, 'lm_head', '/lm_head', false, product)
  }
  if (scaled) logitTransform(ctx, product, out)
  if (half) g.op('Cast', [out], { to: I(ctx.logitsType) }, { name: '/lm_head/Cast', outputs: [LOGITS] })
}

/** The architecture's logit scale (Granite) and soft-cap (Gemma 2), in that order, into `out`. */
function logitTransform(ctx: GraphContext, logits: string, out: string): void {
  const { g, f } = ctx
  const steps: Array<(x: string, output?: string) => string> = []
  if (f.logitScale !== undefined) steps.push((x, o) => g.op('Mul', [x, constant(ctx, f.logitScale!)], undefined, { name: '/lm_head/scale/Mul', ...(o ? { outputs: [o] } : {}) }))
  if (f.finalSoftcap !== undefined) {
    const cap = f.finalSoftcap
    steps.push((x, o) => {
      const over = g.op('Mul', [x, constant(ctx, 1 / cap)], undefined, { name: '/lm_head/softcap/Div' })
      const tanh = g.op('Tanh', [over], undefined, { name: '/lm_head/softcap/Tanh' })
      return g.op('Mul', [tanh, constant(ctx, cap)], undefined, { name: '/lm_head/softcap/Mul', ...(o ? { outputs: [o] } : {}) })
    })
  }
  steps.reduce((x, step, i) => step(x, i === steps.length - 1 ? out : undefined), logits)
}

/** x [.., in] -> [.., out] through the projection `proj` (a weight name prefix), plus its bias. */
function linear(ctx: GraphContext, x: string, proj: string, base: string, bias = false, output?: string): string {
  const { g, w } = ctx
  const outputs = output !== undefined && !bias ? { outputs: [output] } : {}
  const y =
    ctx.options.linear.kind === 'fp32'
      ? g.op('MatMul', [x, w(`${proj}.weight`)], undefined, { name: `${base}/MatMul`, ...outputs })
      : int4Linear(ctx, x, proj, base, ctx.options.linear.accuracyLevel, outputs)
  if (!bias) return y
  return g.op('Add', [y, w(`${proj}.bias`)], undefined, { name: `${base}/BiasAdd`, ...(output ? { outputs: [output] } : {}) })
}

function int4Linear(
  ctx: GraphContext,
  x: string,
  proj: string,
  base: string,
  accuracyLevel: number,
  outputs: { outputs?: string[] },
): string {
  const { g, w } = ctx
  const { N, K, bits, blockSize } = blockGeometry(ctx, proj)
  const hasMins = ctx.has(`${proj}.mins`)
  if (hasMins && blockSize !== 32) throw new Error(`${proj}: minimums need blocks of 32`)
  const attrs = { K: I(K), N: I(N), bits: I(bits), block_size: I(blockSize), accuracy_level: I(accuracyLevel) }
  // 8-bit blocks have no zero points: MatMulNBits takes 128.
  const zeros = ctx.has(`${proj}.qzeros`) ? [w(`${proj}.qzeros`)] : []
  const inputs = [x, w(`${proj}.qweight`), w(`${proj}.scales`), ...zeros]
  if (!hasMins) return g.op('MatMulNBits', inputs, attrs, { name: `${base}/MatMulNBits`, domain: 'com.microsoft', ...outputs })
  const product = g.op('MatMulNBits', inputs, attrs, { name: `${base}/MatMulNBits`, domain: 'com.microsoft' })
  const sums = blockSums(ctx, x, K)
  const offsets = g.op('MatMul', [sums, w(`${proj}.mins`)], undefined, { name: `${base}/mins/MatMul` })
  return g.op('Add', [product, offsets], undefined, { name: `${base}/mins/Add`, ...outputs })
}

/** Sums of the 32-element blocks of x along its last axis: [.., K] -> [.., K / 32] (shared). */
function blockSums(ctx: GraphContext, x: string, K: number): string {
  const { g } = ctx
  const name = `${x}/block_sums`
  if (ctx.blockSums.has(name)) return name
  ctx.blockSums.add(name)
  // The paged form's activations are [num_tokens, K], the others' [batch, sequence, K].
  const shape = ctx.options.attention === 'paged' ? [0, K / 32, 32] : [0, 0, K / 32, 32]
  const blocks = g.op('Reshape', [x, g.int64(shape)], undefined, { name: `${x}/block_sums/Reshape` })
  return g.op('ReduceSum', [blocks, g.int64([-1])], { keepdims: I(0) }, { name: `${x}/block_sums/ReduceSum`, outputs: [name] })
}
