// GGUF architecture -> the Llama graph of ts/modelkit/llama.ts: the model's sizes and options from
// the metadata, and which GGUF tensor becomes which weight of the graph.
//
//   llama  (SmolLM, TinyLlama, Llama 2/3, Mistral): llama.cpp's converter permutes the rows of
//          attn_q / attn_k within each head for its interleaved rotary (convert_hf_to_gguf.py's
//          LlamaModel.permute); the graph's rotary is "rotate half", so the rows are put back:
//          Hugging Face row h * D/2 + i of a head is GGUF row 2i + h (h = 0, 1; i < D/2).
//   qwen2  q/k/v carry biases; rows are not permuted (llama.cpp uses NEOX rotary for it).
//
// Both: no output.weight means the lm_head is the token embedding (tied); rope_freqs.weight
// (Llama 3.1+) divides each rotary frequency; rope.scaling.type "linear" divides positions.
// Anything else (another architecture, experts, partial rotary, YaRN) is refused by name.

import { OrtexError } from '../../errors'
import type { LlamaDims } from '../llama'
import { canDequantize } from './dequantize'
import { GgmlTypeId, ggmlTypeName } from './ggml-types'
import { type GgufFile, type GgufTensorInfo, Metadata } from './reader'

export const ARCHITECTURES = ['llama', 'qwen2'] as const
export const SUPPORTED_TYPES = Object.keys(GgmlTypeId)
export type Architecture = (typeof ARCHITECTURES)[number]

/** A line per architecture for `ortex import --help` and the docs: the models it covers and what
 *  it adds (an architecture without one is listed by name alone). */
export const ARCHITECTURE_NOTES: Partial<Record<Architecture, string>> = {
  llama: 'SmolLM, TinyLlama, Llama 2/3, Mistral',
  qwen2: 'Qwen2, Qwen2.5: biases on q, k and v',
}

/** What a graph weight is made from. */
export interface SourceTensor {
  /** The weight's name in the graph (Hugging Face naming, as llama.ts expects). */
  name: string
  source: GgufTensorInfo
  role: 'embedding' | 'norm' | 'linear' | 'bias'
  /** Rows to reorder within heads of this size (llama's permuted q/k), or undefined. */
  unpermuteHeadSize?: number
}

export interface RopeScaling {
  /** Positions are multiplied by this (1 / rope.scaling.factor for "linear"). */
  positionScale: number
  /** rope_freqs.weight: head_size / 2 float32 divisors of the frequencies (Llama 3.1+). */
  frequencyFactors: GgufTensorInfo | undefined
}

export interface ModelPlan {
  architecture: Architecture
  /** general.name, when the file has one. */
  name: string | undefined
  dims: LlamaDims
  attentionBias: boolean
  tiedEmbeddings: boolean
  rope: RopeScaling
  tensors: SourceTensor[]
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

/** The fewest tensors a layer has (norms, q/k/v/o, gate/up/down). */
const TENSORS_PER_LAYER = 9

function refuse(file: GgufFile, reason: string): never {
  throw new OrtexError('MODEL_LOAD', `${file.path}: ${reason}`)
}

/** A metadata count in [min, max] (max: the limit named in the refusal). */
function bounded(file: GgufFile, key: string, value: number, min: number, max: number, unit: string): number {
  if (value < min) refuse(file, `${key} is ${value}, fewer than ${min} ${unit}`)
  if (value > max) refuse(file, `${key} is ${value}: over the limit of ${max} ${unit} (a corrupt file?)`)
  return value
}

/** Reads the architecture's metadata and maps every tensor of the file, or refuses. */
export function planModel(file: GgufFile): ModelPlan {
  const m = new Metadata(file)
  const architecture = m.string('general.architecture')
  if (!(ARCHITECTURES as readonly string[]).includes(architecture)) {
    refuse(file, `the architecture "${architecture}" is not supported (supported: ${ARCHITECTURES.join(', ')})`)
  }
  const arch = architecture as Architecture
  const expertCount = m.count(`${arch}.expert_count`, 0) ?? 0
  if (expertCount > 0) refuse(file, `${arch}.expert_count is ${expertCount}: mixture-of-experts models are not supported`)
  const tensorsByName = new Map(file.tensors.map((t) => [t.name, t]))
  const dims = readDims(file, m, arch, tensorsByName)
  const tiedEmbeddings = !tensorsByName.has('output.weight')
  const attentionBias = arch === 'qwen2'
  const tensors = mapTensors(file, arch, dims, tensorsByName, { tiedEmbeddings, attentionBias })
  return {
    architecture: arch,
    name: m.string('general.name', undefined),
    dims,
    attentionBias,
    tiedEmbeddings,
    rope: ropeScaling(file, m, arch, dims, tensorsByName.get('rope_freqs.weight')),
    tensors,
    parameters: tensors.reduce((n, t) => n + t.source.elements, 0),
  }
}

function readDims(file: GgufFile, m: Metadata, arch: Architecture, tensors: Map<string, GgufTensorInfo>): LlamaDims {
  const k = (key: string) => `${arch}.${key}`
  const numLayers = bounded(file, k('block_count'), m.count(k('block_count')), 1, MODEL_LIMITS.layers, 'layers')
  if (numLayers * TENSORS_PER_LAYER > file.tensors.length) {
    refuse(file, `${k('block_count')} is ${numLayers}, but the file has ${file.tensors.length} tensors (a layer has at least ${TENSORS_PER_LAYER})`)
  }
  const contextLength = bounded(file, k('context_length'), m.count(k('context_length')), 1, MODEL_LIMITS.contextLength, 'positions')
  const hiddenSize = m.count(k('embedding_length'))
  const numHeads = bounded(file, k('attention.head_count'), m.count(k('attention.head_count')), 1, MODEL_LIMITS.heads, 'heads')
  const numKvHeads = bounded(file, k('attention.head_count_kv'), m.count(k('attention.head_count_kv'), numHeads) ?? numHeads, 1, numHeads, 'heads (the query heads)')
  const keyLength = m.count(k('attention.key_length'), undefined)
  const headSize = keyLength === undefined ? hiddenSize / numHeads : bounded(file, k('attention.key_length'), keyLength, 2, MODEL_LIMITS.headSize, 'elements')
  const valueLength = m.count(k('attention.value_length'), headSize) ?? headSize
  const ropeDims = m.count(k('rope.dimension_count'), headSize) ?? headSize
  if (!Number.isInteger(headSize) || headSize <= 0 || headSize % 2 !== 0) refuse(file, `the head size ${headSize} must be an even integer`)
  bounded(file, 'the head size', headSize, 2, MODEL_LIMITS.headSize, 'elements')
  if (valueLength !== headSize) refuse(file, `${k('attention.value_length')} ${valueLength} differs from the key length ${headSize}`)
  if (ropeDims !== headSize) refuse(file, `${k('rope.dimension_count')} is ${ropeDims}: partial rotary (fewer than ${headSize} dimensions) is not supported`)
  if (numHeads % numKvHeads !== 0) refuse(file, `${numHeads} heads are not a multiple of ${numKvHeads} KV heads`)
  const embedding = tensors.get('token_embd.weight') ?? refuse(file, 'the tensor "token_embd.weight" is missing')
  if (embedding.dims.length !== 2 || embedding.dims[0] !== hiddenSize) {
    refuse(file, `token_embd.weight has the shape [${embedding.dims}], expected [${hiddenSize}, vocabulary]`)
  }
  return {
    vocabSize: bounded(file, 'the vocabulary (token_embd.weight rows)', embedding.dims[1]!, 1, MODEL_LIMITS.vocabSize, 'tokens'),
    hiddenSize,
    intermediateSize: m.count(k('feed_forward_length')),
    numLayers,
    numHeads,
    numKvHeads,
    headSize,
    contextLength,
    ropeTheta: m.number(k('rope.freq_base'), 10000) ?? 10000,
    rmsNormEps: m.number(k('attention.layer_norm_rms_epsilon')),
  }
}

/** GGUF name, graph name, role, expected ggml dims [row length, rows] (1-D: [length]). */
type Mapping = [string, string, SourceTensor['role'], number[], number?]

function layerMappings(l: number, d: LlamaDims, arch: Architecture, attentionBias: boolean): Mapping[] {
  const H = d.hiddenSize
  const q = d.numHeads * d.headSize
  const kv = d.numKvHeads * d.headSize
  const permute = arch === 'llama' ? d.headSize : undefined
  const b = `blk.${l}`
  const p = `model.layers.${l}`
  const rows: Mapping[] = [
    [`${b}.attn_norm.weight`, `${p}.input_layernorm.weight`, 'norm', [H]],
    [`${b}.attn_q.weight`, `${p}.self_attn.q_proj.weight`, 'linear', [H, q], permute],
    [`${b}.attn_k.weight`, `${p}.self_attn.k_proj.weight`, 'linear', [H, kv], permute],
    [`${b}.attn_v.weight`, `${p}.self_attn.v_proj.weight`, 'linear', [H, kv]],
    [`${b}.attn_output.weight`, `${p}.self_attn.o_proj.weight`, 'linear', [q, H]],
    [`${b}.ffn_norm.weight`, `${p}.post_attention_layernorm.weight`, 'norm', [H]],
    [`${b}.ffn_gate.weight`, `${p}.mlp.gate_proj.weight`, 'linear', [H, d.intermediateSize]],
    [`${b}.ffn_up.weight`, `${p}.mlp.up_proj.weight`, 'linear', [H, d.intermediateSize]],
    [`${b}.ffn_down.weight`, `${p}.mlp.down_proj.weight`, 'linear', [d.intermediateSize, H]],
  ]
  if (attentionBias) {
    rows.push(
      [`${b}.attn_q.bias`, `${p}.self_attn.q_proj.bias`, 'bias', [q]],
      [`${b}.attn_k.bias`, `${p}.self_attn.k_proj.bias`, 'bias', [kv]],
      [`${b}.attn_v.bias`, `${p}.self_attn.v_proj.bias`, 'bias', [kv]],
    )
  }
  return rows
}

function mapTensors(
  file: GgufFile,
  arch: Architecture,
  d: LlamaDims,
  tensors: Map<string, GgufTensorInfo>,
  options: { tiedEmbeddings: boolean; attentionBias: boolean },
): SourceTensor[] {
  const mappings: Mapping[] = [['token_embd.weight', 'model.embed_tokens.weight', 'embedding', [d.hiddenSize, d.vocabSize]]]
  for (let l = 0; l < d.numLayers; l++) mappings.push(...layerMappings(l, d, arch, options.attentionBias))
  mappings.push(['output_norm.weight', 'model.norm.weight', 'norm', [d.hiddenSize]])
  if (!options.tiedEmbeddings) mappings.push(['output.weight', 'lm_head.weight', 'linear', [d.hiddenSize, d.vocabSize]])
  const used = new Set(['rope_freqs.weight'])
  const mapped = mappings.map(([ggufName, name, role, dims, unpermuteHeadSize]) => {
    const source = tensors.get(ggufName) ?? refuse(file, `the tensor "${ggufName}" is missing`)
    if (source.dims.join() !== dims.join()) refuse(file, `${ggufName} has the shape [${source.dims}], expected [${dims}]`)
    if (!canDequantize(source.type)) {
      refuse(file, `${ggufName} is ${ggmlTypeName(source.type)}, a tensor type the importer does not read (it reads ${SUPPORTED_TYPES.join(', ')})`)
    }
    used.add(ggufName)
    return { name, source, role, ...(unpermuteHeadSize === undefined ? {} : { unpermuteHeadSize }) }
  })
  const extra = file.tensors.find((t) => !used.has(t.name))
  if (extra) refuse(file, `the tensor "${extra.name}" is not part of a ${arch} model that this importer maps`)
  return mapped
}

function ropeScaling(
  file: GgufFile,
  m: Metadata,
  arch: Architecture,
  d: LlamaDims,
  frequencyFactors: GgufTensorInfo | undefined,
): RopeScaling {
  const scaling = m.string(`${arch}.rope.scaling.type`, 'none') ?? 'none'
  let positionScale = 1
  if (scaling === 'linear') {
    const factor = m.number(`${arch}.rope.scaling.factor`)
    if (!(factor > 0)) refuse(file, `${arch}.rope.scaling.factor must be positive, got ${factor}`)
    positionScale = 1 / factor
  } else if (scaling !== 'none') {
    refuse(file, `${arch}.rope.scaling.type "${scaling}" is not supported (none and linear are; Llama 3's rope_freqs too)`)
  } else if (m.has(`${arch}.rope.scale_linear`)) {
    positionScale = 1 / m.number(`${arch}.rope.scale_linear`)
  }
  const half = d.headSize / 2
  if (frequencyFactors && (frequencyFactors.type !== 0 || frequencyFactors.elements !== half)) {
    refuse(file, `rope_freqs.weight must be ${half} float32 values, got [${frequencyFactors.dims}] of type ${frequencyFactors.type}`)
  }
  return { positionScale, frequencyFactors }
}

/**
 * Per rotary frequency i < head_size / 2, the angle of position p is p * invFreq[i]: ggml's
 * theta = p * freq_scale * base^(-2i / D) / freq_factor[i].
 */
export function inverseFrequencies(d: LlamaDims, rope: RopeScaling, factors: Float32Array | undefined): Float64Array {
  return Float64Array.from({ length: d.headSize / 2 }, (_, i) => {
    const base = Math.pow(d.ropeTheta, (-2 * i) / d.headSize) * rope.positionScale
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
