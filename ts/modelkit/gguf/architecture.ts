// GGUF architecture -> the decoder graph of ts/modelkit/decoder.ts: the model's sizes and the
// architecture's features from the metadata (the table in architectures.ts), the rotary tables,
// and which GGUF tensor becomes which weight of the graph.
//
//   rows of q/k    llama.cpp's converter permutes the rows of attn_q / attn_k within each head
//                  for the architectures it rotates in `norm` mode (convert_hf_to_gguf.py's
//                  LlamaModel.permute); the graph's rotary is "rotate half", so the rows are put
//                  back: Hugging Face row h * D/2 + i of a head is GGUF row 2i + h (h = 0, 1).
//   fused tensors  attn_qkv (q, then k, then v rows) and Phi-3's ffn_up (gate rows, then up
//                  rows) are read as row ranges into the graph's separate projections: blocks run
//                  along a row, so a range of rows keeps them exactly.
//   biases         q/k/v (or qkv) biases where the file has them, as llama.cpp's
//                  create_tensor_qkv takes them for every architecture.
//   output         no output.weight means the lm_head is the token embedding (tied).
//   rotary         per table: base, position scale (rope.scaling.type linear), frequency
//                  divisors (rope_freqs.weight, Llama 3.1+; LongRoPE's factors, Phi-3) and the
//                  magnitude of cos and sin (LongRoPE's attention factor); sliding-window layers
//                  get their own table where their base or scaling differs.
// Anything else (another architecture, experts, YaRN, a tensor the architecture lacks) is refused
// by name.

import { OrtexError } from '../../errors'
import type { DecoderFeatures, LayerFeatures, DecoderDims, RotaryTable } from '../decoder'
import type { ExpertDims } from '../moe'
import { type ArchMetadata, ARCHITECTURES, type Architecture, type ArchitectureSpec, UNSUPPORTED_ARCHITECTURES, architectureSpec } from './architectures'
import { canDequantize } from './dequantize'
import { type ExpertSources, expertSources, expertTensorNames, readExpertDims } from './experts'
import { GgmlTypeId, ggmlTypeName } from './ggml-types'
import { type GgufFile, type GgufTensorInfo, Metadata } from './reader'

export { ARCHITECTURES, type Architecture } from './architectures'
export const SUPPORTED_TYPES = Object.keys(GgmlTypeId)

/** A line per architecture for `ortex import --help` and the docs: the models it covers and what
 *  it adds (the architecture table's notes). */
export const ARCHITECTURE_NOTES: Readonly<Record<Architecture, string>> = Object.fromEntries(
  ARCHITECTURES.map((a) => [a, architectureSpec(a).note]),
) as Record<Architecture, string>

/** What a graph weight is made from. */
export interface SourceTensor {
  /** The weight's name in the graph (Hugging Face naming, as decoder.ts expects). */
  name: string
  source: GgufTensorInfo
  role: 'embedding' | 'norm' | 'linear' | 'bias'
  /** Rows to reorder within heads of this size (llama's permuted q/k), or undefined. */
  unpermuteHeadSize?: number
  /** A range of the source's rows (a fused tensor's part); undefined: all of them. A bias's
   *  "rows" are its elements. */
  rows?: { first: number; count: number }
}

/** A rotary table and how its angles and values are computed (tensors.ts writes it). */
export interface RotaryPlan extends RotaryTable {
  /** rope.freq_base (or the local layers' base). */
  base: number
  /** Positions are multiplied by this (1 / rope.scaling.factor for "linear"). */
  positionScale: number
  /** dims / 2 float32 divisors of the frequencies: rope_freqs.weight (Llama 3.1+), or LongRoPE's
   *  long or short factors. */
  frequencyFactors: GgufTensorInfo | undefined
  /** cos and sin are multiplied by this (LongRoPE's attention factor); 1 otherwise. */
  magnitude: number
}

export interface ModelPlan {
  architecture: Architecture
  /** general.name, when the file has one. */
  name: string | undefined
  dims: DecoderDims
  attentionBias: boolean
  tiedEmbeddings: boolean
  /** The graph's switches (their `rotaries` are `rotaries` below). */
  features: DecoderFeatures
  rotaries: RotaryPlan[]
  tensors: SourceTensor[]
  /** A mixture-of-experts model's expert sizes and each layer's router and experts (experts.ts). */
  experts?: { dims: ExpertDims; layers: ExpertSources[] }
  /** Parameters of the model as the file stores them (the rotary factors excluded). */
  parameters: number
}

/**
 * Sane limits on the sizes the metadata declares, checked before anything is sized by them (the
 * tensor mappings have a row per layer, the rotary tables a row per position). Real models are
 * far below: Llama 3.1 405B has 126 layers, 128 heads of 128, a context of 131,072 and 128,256
 * tokens.
 */
export const MODEL_LIMITS = {
  /** llama.cpp's LLAMA_MAX_LAYERS. */
  layers: 512,
  /** 2^20 positions: a rotary table row each (Qwen2.5-1M's 1,010,000 fit). */
  contextLength: 1 << 20,
  heads: 1024,
  headSize: 1024,
  /** Rows of the token embedding (the vocabulary). */
  vocabSize: 1 << 21,
} as const

/** The fewest tensors a layer has (norms, q/k/v/o, gate/up/down; fused ones fewer: counted low). */
const TENSORS_PER_LAYER = 6

/** GroupQueryAttention's rotary (ONNX Runtime's CPU and CUDA kernels) wants heads, and rotated
 *  dims, in multiples of 16. */
const ROTARY_MULTIPLE = 16

function refuse(file: GgufFile, reason: string): never {
  throw new OrtexError('MODEL_LOAD', `${file.path}: ${reason}`)
}

/** A metadata count in [min, max] (max: the limit named in the refusal). */
function bounded(file: GgufFile, key: string, value: number, min: number, max: number, unit: string): number {
  if (value < min) refuse(file, `${key} is ${value}, fewer than ${min} ${unit}`)
  if (value > max) refuse(file, `${key} is ${value}: over the limit of ${max} ${unit} (a corrupt file?)`)
  return value
}

/** One architecture's keys (`${arch}.${key}`), typed, MODEL_LOAD naming the key when wrong. */
function archMetadata(file: GgufFile, m: Metadata, arch: string): ArchMetadata {
  const k = (key: string) => `${arch}.${key}`
  return {
    has: (key) => m.has(k(key)),
    number: (key, ...fallback: [number?]) => (fallback.length > 0 ? m.number(k(key), fallback[0]) : m.number(k(key))) as number,
    count: (key, ...fallback: [number?]) => (fallback.length > 0 ? m.count(k(key), fallback[0]) : m.count(k(key))) as number,
    bool: (key, fallback) => m.boolean(k(key), fallback),
    raw: (key) => file.metadata.get(k(key)),
  }
}

/** Reads the architecture's metadata and maps every tensor of the file, or refuses. */
export function planModel(file: GgufFile, options: { contextLength?: number } = {}): ModelPlan {
  const m = new Metadata(file)
  const architecture = m.string('general.architecture')
  if (!(ARCHITECTURES as readonly string[]).includes(architecture)) {
    const missing = UNSUPPORTED_ARCHITECTURES[architecture]
    refuse(file, `the architecture "${architecture}" is not supported${missing ? `: the importer lacks ${missing}` : ''} (supported: ${ARCHITECTURES.join(', ')})`)
  }
  const arch = architecture as Architecture
  const spec = architectureSpec(arch)
  const am = archMetadata(file, m, arch)
  const expertCount = am.count('expert_count', 0)
  if (expertCount > 0 && !spec.experts) refuse(file, `${arch}.expert_count is ${expertCount}: mixture-of-experts ${arch} models are not supported`)
  if (am.has('attention.clamp_kqv')) refuse(file, `${arch}.attention.clamp_kqv is not supported (q/k/v clamping)`)
  const tensorsByName = new Map(file.tensors.map((t) => [t.name, t]))
  const dims = readDims(file, am, arch, tensorsByName, options.contextLength)
  const rotaryDims = readRotaryDims(file, am, arch, spec, dims)
  const tiedEmbeddings = !tensorsByName.has('output.weight')
  const attentionBias = tensorsByName.has('blk.0.attn_q.bias') || tensorsByName.has('blk.0.attn_qkv.bias')
  const { rotaries, layers } = rotaryAndWindows(file, am, arch, spec, dims, rotaryDims, tensorsByName)
  const experts = spec.experts ? planLayerExperts(file, arch, dims, tensorsByName) : undefined
  const tensors = mapTensors(file, arch, spec, dims, tensorsByName, { tiedEmbeddings, attentionBias, experts: experts !== undefined })
  const sizes = { hidden: dims.hiddenSize, heads: dims.numHeads, headSize: dims.headSize, layers: dims.numLayers }
  const features: DecoderFeatures = {
    ...(spec.scalars?.(am, sizes) ?? {}),
    norms: spec.norms,
    ...(spec.qkNorm ? { qkNorm: spec.qkNorm } : {}),
    activation: spec.activation,
    rotaries: rotaries.map(({ suffix, dims }) => ({ suffix, dims })),
    layers,
    ...(experts && spec.experts ? { experts: { dims: experts.dims, renormalize: spec.experts.renormalize } } : {}),
  }
  const expertParameters = experts?.layers.reduce((n, l) => n + l.router.elements + l.gate.elements + l.up.elements + l.down.elements, 0) ?? 0
  return {
    architecture: arch,
    name: m.string('general.name', undefined),
    dims,
    attentionBias,
    tiedEmbeddings,
    features,
    rotaries,
    tensors,
    ...(experts ? { experts } : {}),
    parameters: expertParameters + tensors.reduce((n, t) => n + (t.rows ? t.rows.count * (t.role === 'bias' ? 1 : t.source.dims[0]!) : t.source.elements), 0),
  }
}

/** Every layer's router and experts (a mixture-of-experts architecture), checked. */
function planLayerExperts(file: GgufFile, arch: Architecture, d: DecoderDims, tensors: Map<string, GgufTensorInfo>): NonNullable<ModelPlan['experts']> {
  const dims = readExpertDims(file, arch, d.hiddenSize)
  return { dims, layers: Array.from({ length: d.numLayers }, (_, l) => expertSources(file, tensors, l, dims)) }
}

function readDims(file: GgufFile, am: ArchMetadata, arch: Architecture, tensors: Map<string, GgufTensorInfo>, contextLimit: number | undefined): DecoderDims {
  const k = (key: string) => `${arch}.${key}`
  const numLayers = bounded(file, k('block_count'), am.count('block_count'), 1, MODEL_LIMITS.layers, 'layers')
  if (numLayers * TENSORS_PER_LAYER > file.tensors.length) {
    refuse(file, `${k('block_count')} is ${numLayers}, but the file has ${file.tensors.length} tensors (a layer has at least ${TENSORS_PER_LAYER})`)
  }
  const fileContext = bounded(file, k('context_length'), am.count('context_length'), 1, MODEL_LIMITS.contextLength, 'positions')
  const contextLength = contextLimit === undefined ? fileContext : Math.min(contextLimit, fileContext)
  const hiddenSize = am.count('embedding_length')
  const numHeads = bounded(file, k('attention.head_count'), am.count('attention.head_count'), 1, MODEL_LIMITS.heads, 'heads')
  const numKvHeads = bounded(file, k('attention.head_count_kv'), am.count('attention.head_count_kv', numHeads), 1, numHeads, 'heads (the query heads)')
  const keyLength = am.has('attention.key_length') ? am.count('attention.key_length') : undefined
  const headSize = keyLength === undefined ? hiddenSize / numHeads : bounded(file, k('attention.key_length'), keyLength, 2, MODEL_LIMITS.headSize, 'elements')
  const valueLength = am.count('attention.value_length', headSize)
  if (!Number.isInteger(headSize) || headSize <= 0 || headSize % 2 !== 0) refuse(file, `the head size ${headSize} must be an even integer`)
  bounded(file, 'the head size', headSize, 2, MODEL_LIMITS.headSize, 'elements')
  if (valueLength !== headSize) refuse(file, `${k('attention.value_length')} ${valueLength} differs from the key length ${headSize}`)
  if (numHeads % numKvHeads !== 0) refuse(file, `${numHeads} heads are not a multiple of ${numKvHeads} KV heads`)
  const embedding = tensors.get('token_embd.weight') ?? refuse(file, 'the tensor "token_embd.weight" is missing')
  if (embedding.dims.length !== 2 || embedding.dims[0] !== hiddenSize) {
    refuse(file, `token_embd.weight has the shape [${embedding.dims}], expected [${hiddenSize}, vocabulary]`)
  }
  return {
    vocabSize: bounded(file, 'the vocabulary (token_embd.weight rows)', embedding.dims[1]!, 1, MODEL_LIMITS.vocabSize, 'tokens'),
    hiddenSize,
    intermediateSize: am.count('feed_forward_length'),
    numLayers,
    numHeads,
    numKvHeads,
    headSize,
    contextLength,
    ropeTheta: am.number('rope.freq_base', 10000),
    rmsNormEps: am.number('attention.layer_norm_rms_epsilon'),
  }
}

/** How many leading elements of a head rotate (rope.dimension_count; partial rotary below the head size). */
function readRotaryDims(file: GgufFile, am: ArchMetadata, arch: Architecture, spec: ArchitectureSpec, d: DecoderDims): number {
  const key = `${arch}.rope.dimension_count`
  const dims = am.count('rope.dimension_count', d.headSize)
  if (dims > d.headSize || dims % 2 !== 0 || dims < 2) refuse(file, `${key} is ${dims}: not an even count of at most the head size ${d.headSize}`)
  if (dims !== d.headSize && spec.rope === 'norm') {
    refuse(file, `${key} is ${dims}: partial rotary (fewer than ${d.headSize} dimensions) with llama.cpp's interleaved rotary is not supported`)
  }
  if (d.headSize % ROTARY_MULTIPLE !== 0 || dims % ROTARY_MULTIPLE !== 0) {
    refuse(file, `heads of ${d.headSize} with ${dims} rotary dimensions: GroupQueryAttention's rotary needs both to be multiples of ${ROTARY_MULTIPLE}`)
  }
  return dims
}

/** The rope scaling of the global layers: linear (a position scale), or none. */
function positionScale(file: GgufFile, am: ArchMetadata, arch: Architecture): number {
  const m = new Metadata(file)
  const scaling = m.string(`${arch}.rope.scaling.type`, 'none') ?? 'none'
  if (scaling === 'linear') {
    const factor = am.number('rope.scaling.factor')
    if (!(factor > 0)) refuse(file, `${arch}.rope.scaling.factor must be positive, got ${factor}`)
    return 1 / factor
  }
  if (scaling !== 'none') refuse(file, `${arch}.rope.scaling.type "${scaling}" is not supported (none and linear are; Llama 3's rope_freqs and Phi-3's LongRoPE factors too)`)
  return am.has('rope.scale_linear') ? 1 / am.number('rope.scale_linear') : 1
}

/**
 * The rotary tables and each layer's table and window. Global layers: the file's base and
 * scaling, Llama 3's rope_freqs or Phi-3's LongRoPE factors (the long ones when the folder's
 * context exceeds rope.scaling.original_context_length, as llama.cpp picks them by its context),
 * times LongRoPE's attention factor. Sliding-window layers (llama.cpp's pattern): their own base,
 * and no scaling where the architecture says so; one table when they compute the same.
 */
function rotaryAndWindows(
  file: GgufFile,
  am: ArchMetadata,
  arch: Architecture,
  spec: ArchitectureSpec,
  d: DecoderDims,
  dims: number,
  tensors: Map<string, GgufTensorInfo>,
): { rotaries: RotaryPlan[]; layers: LayerFeatures[] } {
  const scale = positionScale(file, am, arch)
  const global: RotaryPlan = { suffix: '', dims, base: d.ropeTheta, positionScale: scale, frequencyFactors: frequencyFactors(file, am, arch, spec, d, dims, tensors), magnitude: spec.longRope ? am.number('rope.scaling.attn_factor', 1) : 1 }
  const rotaries = [global]
  const windows = slidingWindows(file, am, arch, spec, d)
  const local: RotaryPlan = {
    ...global,
    suffix: '_local',
    base: am.number('rope.freq_base_swa', spec.windows?.localBase ?? d.ropeTheta),
    positionScale: spec.windows?.localScaling === false ? 1 : scale,
  }
  const localDiffers = local.base !== global.base || local.positionScale !== global.positionScale
  if (windows && localDiffers) rotaries.push(local)
  const ropeless = spec.ropeless
  const layers = Array.from({ length: d.numLayers }, (_, l): LayerFeatures => {
    const window = windows?.layers[l] ? windows.size : undefined
    const rotary = ropeless?.(l, am) ? null : window !== undefined && localDiffers ? 1 : 0
    return window === undefined ? { rotary } : { rotary, window }
  })
  return { rotaries, layers }
}

/** The divisors of the rotary frequencies, or none. */
function frequencyFactors(file: GgufFile, am: ArchMetadata, arch: Architecture, spec: ArchitectureSpec, d: DecoderDims, dims: number, tensors: Map<string, GgufTensorInfo>): GgufTensorInfo | undefined {
  const check = (t: GgufTensorInfo | undefined): GgufTensorInfo | undefined => {
    if (t && (t.type !== GgmlTypeId.F32 || t.elements !== dims / 2)) refuse(file, `${t.name} must be ${dims / 2} float32 values, got [${t.dims}] of type ${ggmlTypeName(t.type)}`)
    return t
  }
  const freqs = check(tensors.get('rope_freqs.weight'))
  if (!spec.longRope) return freqs
  const long = check(tensors.get('rope_factors_long.weight'))
  const short = check(tensors.get('rope_factors_short.weight'))
  if (!long && !short) return freqs
  if (!long || !short) refuse(file, 'a LongRoPE file needs both rope_factors_long.weight and rope_factors_short.weight')
  const original = am.count('rope.scaling.original_context_length', am.count('context_length'))
  return d.contextLength > original ? long : short
}

/** The window and which layers have it, as llama.cpp sets them; undefined: no windows. */
function slidingWindows(file: GgufFile, am: ArchMetadata, arch: Architecture, spec: ArchitectureSpec, d: DecoderDims): { size: number; layers: boolean[] } | undefined {
  if (!spec.windows) return undefined
  const size = am.count('attention.sliding_window', spec.windows.defaultWindow ?? 0)
  if (size <= 0) return undefined
  const pattern = am.raw('attention.sliding_window_pattern')
  if (Array.isArray(pattern)) {
    if (pattern.length !== d.numLayers || pattern.some((x) => typeof x !== 'boolean')) refuse(file, `${arch}.attention.sliding_window_pattern must be ${d.numLayers} booleans or a count`)
    return { size, layers: pattern as boolean[] }
  }
  const every = pattern === undefined ? spec.windows.defaultPattern : am.count('attention.sliding_window_pattern')
  // llama.cpp's set_swa_pattern: of every `every` layers the last is global; 0: all local.
  return { size, layers: Array.from({ length: d.numLayers }, (_, l) => every === 0 || l % every < every - 1) }
}

/** GGUF name, graph name, role, expected ggml dims [row length, rows] (1-D: [length]), and how to read it. */
interface Mapping {
  gguf: string
  name: string
  role: SourceTensor['role']
  dims: number[]
  unpermute?: number
  rows?: { first: number; count: number }
}

function layerMappings(l: number, d: DecoderDims, spec: ArchitectureSpec, tensors: Map<string, GgufTensorInfo>, attentionBias: boolean, experts: boolean): Mapping[] {
  const H = d.hiddenSize
  const q = d.numHeads * d.headSize
  const kv = d.numKvHeads * d.headSize
  const ff = d.intermediateSize
  const permute = spec.rope === 'norm' ? d.headSize : undefined
  const b = `blk.${l}`
  const p = `model.layers.${l}`
  const rows: Mapping[] = []
  const add = (gguf: string, name: string, role: SourceTensor['role'], dims: number[], extra: Partial<Mapping> = {}) => rows.push({ gguf, name, role, dims, ...extra })
  if (spec.norms !== 'post') add(`${b}.attn_norm.weight`, `${p}.input_layernorm.weight`, 'norm', [H])
  const fusedQkv = tensors.has(`${b}.attn_qkv.weight`)
  const parts: Array<[string, number, number, number | undefined]> = [
    ['q', 0, q, permute],
    ['k', q, kv, permute],
    ['v', q + kv, kv, undefined],
  ]
  for (const [x, first, count, unpermute] of parts) {
    const u = unpermute === undefined ? {} : { unpermute }
    if (fusedQkv) add(`${b}.attn_qkv.weight`, `${p}.self_attn.${x}_proj.weight`, 'linear', [H, q + 2 * kv], { ...u, rows: { first, count } })
    else add(`${b}.attn_${x}.weight`, `${p}.self_attn.${x}_proj.weight`, 'linear', [H, count], u)
  }
  if (spec.qkNorm === 'head') {
    add(`${b}.attn_q_norm.weight`, `${p}.self_attn.q_norm.weight`, 'norm', [d.headSize])
    add(`${b}.attn_k_norm.weight`, `${p}.self_attn.k_norm.weight`, 'norm', [d.headSize])
  } else if (spec.qkNorm === 'whole') {
    add(`${b}.attn_q_norm.weight`, `${p}.self_attn.q_norm.weight`, 'norm', [q])
    add(`${b}.attn_k_norm.weight`, `${p}.self_attn.k_norm.weight`, 'norm', [kv])
  }
  add(`${b}.attn_output.weight`, `${p}.self_attn.o_proj.weight`, 'linear', [q, H])
  if (spec.norms !== 'pre') add(`${b}.post_attention_norm.weight`, `${p}.post_attn_norm.weight`, 'norm', [H])
  if (spec.norms !== 'post') add(`${b}.ffn_norm.weight`, `${p}.post_attention_layernorm.weight`, 'norm', [H])
  if (experts) {
    // The router and experts are planned apart (experts.ts).
  } else if (spec.fusedGateUp) {
    add(`${b}.ffn_up.weight`, `${p}.mlp.gate_proj.weight`, 'linear', [H, 2 * ff], { rows: { first: 0, count: ff } })
    add(`${b}.ffn_up.weight`, `${p}.mlp.up_proj.weight`, 'linear', [H, 2 * ff], { rows: { first: ff, count: ff } })
  } else {
    add(`${b}.ffn_gate.weight`, `${p}.mlp.gate_proj.weight`, 'linear', [H, ff])
    add(`${b}.ffn_up.weight`, `${p}.mlp.up_proj.weight`, 'linear', [H, ff])
  }
  if (!experts) add(`${b}.ffn_down.weight`, `${p}.mlp.down_proj.weight`, 'linear', [ff, H])
  if (spec.norms !== 'pre') add(`${b}.post_ffw_norm.weight`, `${p}.post_mlp_norm.weight`, 'norm', [H])
  // Biases last in the layer: the data files of the imports before other architectures kept this order.
  if (attentionBias) {
    for (const [x, first, count, unpermute] of parts) {
      const u = unpermute === undefined ? {} : { unpermute }
      if (fusedQkv) add(`${b}.attn_qkv.bias`, `${p}.self_attn.${x}_proj.bias`, 'bias', [q + 2 * kv], { ...u, rows: { first, count } })
      else add(`${b}.attn_${x}.bias`, `${p}.self_attn.${x}_proj.bias`, 'bias', [count], u)
    }
  }
  return rows
}

/** The tensors besides the layers' that an architecture may carry (read elsewhere, or not at all). */
const GLOBAL_EXTRAS = ['rope_freqs.weight', 'rope_factors_long.weight', 'rope_factors_short.weight']

function mapTensors(
  file: GgufFile,
  arch: Architecture,
  spec: ArchitectureSpec,
  d: DecoderDims,
  tensors: Map<string, GgufTensorInfo>,
  options: { tiedEmbeddings: boolean; attentionBias: boolean; experts: boolean },
): SourceTensor[] {
  const mappings: Mapping[] = [{ gguf: 'token_embd.weight', name: 'model.embed_tokens.weight', role: 'embedding', dims: [d.hiddenSize, d.vocabSize] }]
  for (let l = 0; l < d.numLayers; l++) mappings.push(...layerMappings(l, d, spec, tensors, options.attentionBias, options.experts))
  mappings.push({ gguf: 'output_norm.weight', name: 'model.norm.weight', role: 'norm', dims: [d.hiddenSize] })
  if (!options.tiedEmbeddings) mappings.push({ gguf: 'output.weight', name: 'lm_head.weight', role: 'linear', dims: [d.hiddenSize, d.vocabSize] })
  const used = new Set(GLOBAL_EXTRAS.filter((name) => name === 'rope_freqs.weight' || spec.longRope))
  if (options.experts) for (let l = 0; l < d.numLayers; l++) for (const name of Object.values(expertTensorNames(l))) used.add(name)
  const mapped = mappings.map(({ gguf, name, role, dims, unpermute, rows }) => {
    const source = tensors.get(gguf) ?? refuse(file, `the tensor "${gguf}" is missing`)
    if (source.dims.join() !== dims.join()) refuse(file, `${gguf} has the shape [${source.dims}], expected [${dims}]`)
    if (!canDequantize(source.type)) {
      refuse(file, `${gguf} is ${ggmlTypeName(source.type)}, a tensor type the importer does not read (it reads ${SUPPORTED_TYPES.join(', ')})`)
    }
    used.add(gguf)
    return { name, source, role, ...(unpermute === undefined ? {} : { unpermuteHeadSize: unpermute }), ...(rows === undefined ? {} : { rows }) }
  })
  const extra = file.tensors.find((t) => !used.has(t.name))
  if (extra) refuse(file, `the tensor "${extra.name}" is not part of a ${arch} model that this importer maps`)
  return mapped
}

/**
 * Per rotary frequency i < dims / 2, the angle of position p is p * invFreq[i]: ggml's
 * theta = p * freq_scale * base^(-2i / dims) / freq_factor[i].
 */
export function inverseFrequencies(table: RotaryPlan, factors: Float32Array | undefined): Float64Array {
  return Float64Array.from({ length: table.dims / 2 }, (_, i) => {
    const base = Math.pow(table.base, (-2 * i) / table.dims) * table.positionScale
    return factors ? base / factors[i]! : base
  })
}

/** The GGUF row that holds Hugging Face row `row` of a permuted q/k weight (see the header). */
export function permutedRow(row: number, headSize: number): number {
  const head = Math.floor(row / headSize)
  const within = row % headSize
  const half = headSize / 2
  const h = Math.floor(within / half)
  const i = within % half
  return head * headSize + 2 * i + h
}
