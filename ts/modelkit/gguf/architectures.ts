// The architecture table: what each GGUF architecture switches on in the decoder graph
// (ts/modelkit/decoder.ts's DecoderFeatures), read as llama.cpp reads it (src/models/<arch>.cpp,
// load_arch_hparams and the graph builder). An architecture is a row here, not a copy of the graph.
//
//   rope     llama.cpp's rotary for the architecture: `norm` rotates pairs (2i, 2i + 1) of a head,
//            for which its converter permuted the rows of attn_q / attn_k (the importer puts them
//            back); `neox` rotates pairs (i, i + dims / 2), as the graph does, rows as stored.
//   norms    where the RMSNorms sit around attention and feed-forward (decoder.ts's decoderLayer).
//   windows  the sliding-window layers: the window's key (absent: no windows, unless a default),
//            llama.cpp's default pattern (of every `pattern` layers the last is global), and the
//            local layers' rotary base.

import type { DecoderFeatures } from '../decoder'

/** The metadata of one architecture: `${arch}.${key}` lookups with defaults. */
export interface ArchMetadata {
  has(key: string): boolean
  number(key: string, fallback?: number): number
  count(key: string, fallback?: number): number
  bool(key: string, fallback: boolean): boolean
  /** A number or an array of booleans (sliding_window_pattern can be either). */
  raw(key: string): unknown
}

/** The scalars an architecture sets from its metadata and sizes. */
export type ArchScalars = Pick<
  DecoderFeatures,
  'embeddingScale' | 'attentionScale' | 'attentionSoftcap' | 'residualScale' | 'logitScale' | 'finalSoftcap'
>

export interface SlidingWindows {
  /** The window when the file has no `attention.sliding_window` (undefined: no windows then). */
  defaultWindow?: number
  /** llama.cpp's default pattern: layer l is local unless l % pattern == pattern - 1. */
  defaultPattern: number
  /** The local layers' rotary base: `rope.freq_base_swa`, else this (undefined: the global base). */
  localBase?: number
  /** Whether the local layers keep the global rope scaling (Gemma 2) or none (Gemma 3, OLMo 3). */
  localScaling: boolean
}

export interface ArchitectureSpec {
  /** genai_config.json's model.type (onnxruntime-genai's name for the family). */
  modelType: string
  rope: 'norm' | 'neox'
  norms: NonNullable<DecoderFeatures['norms']>
  qkNorm?: DecoderFeatures['qkNorm']
  activation: NonNullable<DecoderFeatures['activation']>
  /** ffn_up holds the gate's rows, then the up projection's (Phi-3's gate_up_proj). */
  fusedGateUp?: boolean
  /** LongRoPE: rope_factors_long / rope_factors_short and the attention factor (Phi-3). */
  longRope?: boolean
  /** Every layer's feed-forward is a mixture of experts (moe.ts): renormalize the top k's
   *  probabilities or not, as llama.cpp's build_moe_ffn call for the architecture says. */
  experts?: { renormalize: boolean }
  scalars?: (m: ArchMetadata, sizes: { hidden: number; heads: number; headSize: number; layers: number }) => ArchScalars
  windows?: SlidingWindows
  /** Layers without rotary; undefined: none. */
  ropeless?: (layer: number, m: ArchMetadata) => boolean
  /** Metadata keys llama.cpp ignores for this architecture, and so does the import (docs say so). */
  ignored?: string[]
  /** One line for `ortex import --help` and the docs: the families and what is particular. */
  note: string
}

/** Gemma's attention scale: 1 / sqrt(head size), but hidden / heads for the 27B models (llama.cpp). */
const gemmaAttentionScale = (layers27b: number) => (_: ArchMetadata, s: { hidden: number; heads: number; headSize: number; layers: number }) =>
  1 / Math.sqrt(s.layers === layers27b ? s.hidden / s.heads : s.headSize)

export const ARCHITECTURE_SPECS = {
  llama: {
    modelType: 'llama',
    rope: 'norm',
    norms: 'pre',
    activation: 'silu',
    ignored: ['attention.sliding_window'],
    note: 'Llama 2/3, SmolLM2, TinyLlama, Mistral: rope_freqs (Llama 3.1+), linear rope scaling; a sliding window in the file is ignored, as llama.cpp ignores it',
  },
  qwen2: {
    modelType: 'qwen2',
    rope: 'neox',
    norms: 'pre',
    activation: 'silu',
    note: 'Qwen2, Qwen2.5, DeepSeek-R1 distills: q/k/v biases',
  },
  qwen3: {
    modelType: 'qwen3',
    rope: 'neox',
    norms: 'pre',
    qkNorm: 'head',
    activation: 'silu',
    note: 'Qwen3 (dense): RMSNorm of each q/k head before the rotary',
  },
  qwen3moe: {
    modelType: 'qwen3_moe',
    rope: 'neox',
    norms: 'pre',
    qkNorm: 'head',
    activation: 'silu',
    // qwen3moe.cpp passes norm_w = true whatever the file says (the converter writes no norm_topk_prob).
    experts: { renormalize: true },
    note: 'Qwen3 mixture of experts (Qwen3-30B-A3B): each token routed to the top k of n experts, their weights renormalized',
  },
  gemma3: {
    modelType: 'gemma3_text',
    rope: 'neox',
    norms: 'sandwich',
    qkNorm: 'head',
    activation: 'gelu-tanh',
    scalars: (m, s) => ({
      embeddingScale: Math.sqrt(s.hidden),
      attentionScale: gemmaAttentionScale(62)(m, s),
      ...(m.number('final_logit_softcapping', 0) > 0 ? { finalSoftcap: m.number('final_logit_softcapping') } : {}),
    }),
    windows: { defaultPattern: 6, localBase: 10000, localScaling: false },
    note: 'Gemma 3 (text): embeddings times sqrt(hidden), q/k norms, norms before and after each sublayer, GELU-tanh gate, 5 sliding-window layers to 1 global with their own rotary base',
  },
  gemma2: {
    modelType: 'gemma2',
    rope: 'neox',
    norms: 'sandwich',
    activation: 'gelu-tanh',
    scalars: (m, s) => ({
      embeddingScale: Math.sqrt(s.hidden),
      attentionScale: gemmaAttentionScale(46)(m, s),
      attentionSoftcap: m.number('attn_logit_softcapping', 50),
      finalSoftcap: m.number('final_logit_softcapping', 30),
    }),
    windows: { defaultWindow: 4096, defaultPattern: 2, localScaling: true },
    note: 'Gemma 2: attention and final logit soft-capping, alternating sliding-window layers, norms before and after each sublayer, GELU-tanh gate',
  },
  phi3: {
    modelType: 'phi3',
    rope: 'neox',
    norms: 'pre',
    activation: 'silu',
    fusedGateUp: true,
    longRope: true,
    ignored: ['attention.sliding_window'],
    note: 'Phi-3, Phi-3.5, Phi-4-mini: fused qkv and gate/up, LongRoPE factors (long ones when the context exceeds the original), partial rotary; the sliding window is ignored, as llama.cpp disables it',
  },
  smollm3: {
    modelType: 'smollm3',
    rope: 'norm',
    norms: 'pre',
    activation: 'silu',
    // llama.cpp's n_no_rope_layer_step: every fourth layer has no rotary.
    ropeless: (l) => (l + 1) % 4 === 0,
    note: 'SmolLM3: no rotary in every fourth layer',
  },
  granite: {
    modelType: 'granite',
    rope: 'norm',
    norms: 'pre',
    activation: 'silu',
    scalars: (m) => ({
      ...(m.number('embedding_scale', 0) !== 0 ? { embeddingScale: m.number('embedding_scale') } : {}),
      ...(m.number('residual_scale', 0) !== 0 ? { residualScale: m.number('residual_scale') } : {}),
      ...(m.number('attention.scale', 0) !== 0 ? { attentionScale: m.number('attention.scale') } : {}),
      logitScale: 1 / m.number('logit_scale'),
    }),
    // rope.scaling.finetuned false: no rotary at all (llama.cpp's rope_pattern).
    ropeless: (_, m) => !m.bool('rope.scaling.finetuned', true),
    note: 'Granite 3.x: embedding, residual, attention and logit multipliers',
  },
  olmo2: {
    modelType: 'olmo2',
    rope: 'neox',
    norms: 'post',
    qkNorm: 'whole',
    activation: 'silu',
    windows: { defaultPattern: 4, localScaling: false },
    note: 'OLMo 2 (and OLMo 3): norms after each sublayer only, q/k norms over the whole projection, sliding-window layers where the file has a window',
  },
} as const satisfies Record<string, ArchitectureSpec>

export type Architecture = keyof typeof ARCHITECTURE_SPECS
export const ARCHITECTURES = Object.keys(ARCHITECTURE_SPECS) as Architecture[]

export function architectureSpec(arch: Architecture): ArchitectureSpec {
  return ARCHITECTURE_SPECS[arch]
}

/**
 * What the importer lacks for architectures people bring that it refuses, said with the refusal
 * (any other unknown architecture is refused by its name alone).
 */
export const UNSUPPORTED_ARCHITECTURES: Readonly<Record<string, string>> = {
  qwen35: "Qwen3.5's linear-attention (Gated DeltaNet) layers, which keep a recurrent state instead of a KV cache",
  qwen35moe: "Qwen3.5's linear-attention (Gated DeltaNet) layers and its experts",
  qwen3next: "Qwen3-Next's linear-attention (Gated DeltaNet) layers and its shared experts",
  qwen2moe: "Qwen2-MoE's shared expert beside the routed ones",
  qwen3vl: 'the vision tower and its deepstack inputs (the text-only Qwen3 files import as qwen3)',
  gemma3n: "Gemma 3n's per-layer embeddings, AltUp and LAuReL blocks",
  llama4: "Llama 4's chunked attention, no-rope layers with temperature tuning and its shared experts",
  deepseek2: "multi-head latent attention (MLA), which caches a compressed latent instead of keys and values",
  'gpt-oss': "gpt-oss's attention sinks, its clamped SwiGLU experts and YaRN rotary",
  phi2: 'LayerNorm with biases and the parallel attention and feed-forward of Phi-2',
  lfm2: "LFM2's short convolution layers, which keep a state instead of a KV cache",
  granitehybrid: "Granite 4's Mamba-2 layers, which keep a recurrent state instead of a KV cache",
  mistral3: "Mistral 3's vision tower (its text weights as a llama file import)",
}
