// Small random-weight GGUF files of every architecture the importer is taught, laid out as
// llama.cpp's converter (convert_hf_to_gguf.py) writes them and its loader (src/models/<arch>.cpp,
// load_arch_hparams / load_arch_tensors) reads them: the same tensor names, shapes (ggml order:
// dims[0] is the row length) and metadata keys, sized down. Each architecture's file exercises
// what sets it apart (see ARCH_NOTES), and each is written twice from the same seeded values: Q4_0
// (every 2-D and 3-D weight through llama.cpp's reference quantizer, as `llama-quantize --pure`
// would; norms, biases, rotary factors and the experts' router stay F32, as llama-quantize keeps
// them) and F32 (exact comparisons), whose weights are the Q4_0 blocks' values (archTensors).
//
// Vocabularies: make-model's 384-token byte-level BPE (tokenizer.ggml.model gpt2) with a
// pre-tokenizer near the family's own; gemma2 and gemma3 carry a SentencePiece vocabulary
// (tokenizer.ggml.model llama, no space prefix, BOS added) as real Gemma files do.
//
// Each architecture's seed and weight scales were chosen so that llama.cpp's greedy choices over
// STANDARD_PROMPTS are not near ties (test/model/llama-cpp-oracle.test.ts checks the margins):
// change a seed or a scale only with that test's margins in view.

import { writeFileSync } from 'node:fs'
import { dequantize } from '../../ts/modelkit/gguf/dequantize'
import { GgmlTypeId } from '../../ts/modelkit/gguf/ggml-types'
import { tinySentencePieceVocabulary, tinyVocabulary } from './gguf-models'
import { type GgufTensor, type MetaValue, TestRng, bool, f32, f32s, ggufBytes, i32s, quantizeQ4_0, str, strings, u32 } from './gguf-writer'

export const ARCHS = ['llama', 'qwen2', 'qwen3', 'gemma3', 'gemma2', 'phi3', 'smollm3', 'granite', 'olmo2', 'qwen3moe'] as const
export type ArchName = (typeof ARCHS)[number]
export type ArchFormat = 'F32' | 'Q4_0'

/** What each file carries that a plain llama file does not (and what llama.cpp does with it). */
export const ARCH_NOTES: Readonly<Record<ArchName, string>> = {
  llama: 'Llama 3 style: rope_freqs.weight (frequency factors), an untied output',
  qwen2: 'q/k/v biases, a tied embedding, rope base 1e6',
  qwen3: 'per-head RMSNorm of q and k before the rotary (attn_q_norm/attn_k_norm [head]); key_length 64 so q is wider than the hidden size; tied',
  gemma3:
    'embedding x sqrt(hidden); q/k norm; sandwich norms (post_attention_norm, post_ffw_norm); GELU-tanh gate; query scale 1/sqrt(key_length); ' +
    'sliding window 12 on layers 0-4 of 6 (the default 5:1 pattern; layer 5 global) with rope.freq_base_swa 10000 against rope.freq_base 1e6 ' +
    'and linear rope scaling (factor 8) on the global layer only; one KV head; tied; SentencePiece vocabulary',
  gemma2:
    'attention logit soft-capping 3 (these scores are a few units) and final logit soft-capping 30; sliding window 16 on the even layers (pattern 2); no rope.freq_base key ' +
    '(llama.cpp: 10000); embedding x sqrt(hidden); sandwich norms; tied (no output.weight: gemma2 always ties); SentencePiece vocabulary',
  phi3:
    'fused attn_qkv [hidden, hidden + 2 kv]; ffn_up holds gate then up [hidden, 2 x ff] (SwiGLU); LongRoPE rope_factors_long/short.weight ' +
    '[rotary / 2] with rope.scaling.attn_factor and rope.scaling.original_context_length 256 under context_length 1024 (llama.cpp takes the ' +
    'long factors when its context is over 256); partial rotary (rope.dimension_count 48 of head 64); an attention.sliding_window of 16 that ' +
    'llama.cpp ignores for phi3; untied',
  smollm3: 'no rotary on every fourth layer (layer 3 of 4): llama.cpp fixes the step at 4, and the converter writes no key for it; tied',
  granite: 'embedding_scale 6, residual_scale 0.5, attention.scale 0.25 (not 1/sqrt(head)) and logit_scale 2 (logits divided by it); tied',
  olmo2: 'no pre-norms: post_attention_norm and post_ffw_norm only; q/k RMSNorm over the whole projection ([hidden] and [kv heads x head]); MHA; untied',
  qwen3moe:
    'mixture of experts: ffn_gate_inp [hidden, 8] (router, kept F32), ffn_gate_exps/ffn_up_exps [hidden, 64, 8] and ffn_down_exps [64, hidden, 8], ' +
    'expert_count 8, expert_used_count 2, expert_feed_forward_length 64 (softmax over the experts, top 2, weights renormalized); q/k norm; untied',
}

/**
 * Text prompts for the comparisons: with 24 to 32 generated tokens, every prompt runs past every
 * sliding window of these files (12 and 16 positions), and the last one's prompt alone is longer
 * than both, so prefill crosses them too.
 */
export const STANDARD_PROMPTS: readonly string[] = [
  'The river',
  'A good kitchen is a quiet place',
  'The library opens at nine',
  'Weather changes quickly near the sea. A bright morning can turn grey in an hour, and the wind brings rain from the west.',
]

/** Greedy tokens generated after each standard prompt. */
export const STANDARD_NEW_TOKENS = 32

/** The sizes of an architecture's file. */
export interface ArchShape {
  layers: number
  hidden: number
  heads: number
  kvHeads: number
  /** Per head, keys and values (attention.key_length where the converter writes it). */
  headSize: number
  /** Feed-forward width (per expert for qwen3moe). */
  ff: number
  /** The file's context_length. */
  context: number
}

/** How the random weights are drawn (uniform; each a standard deviation, or a multiple of 1/sqrt(inputs)). */
export interface ArchScales {
  /** token_embd's standard deviation. */
  embedding: number
  /** attn_q and attn_k, times 1/sqrt(inputs): sharper attention. */
  qk: number
  /** attn_output and ffn_down (the residual branches), times 1/sqrt(inputs). */
  residual: number
  /** The logits' standard deviation before any soft-capping or logit scale: output.weight's
   *  spread (untied), or output_norm's mean (tied: the logits are the embedding's rows). */
  logits: number
}

export interface ArchOptions {
  /** Replaces the architecture's seed. */
  seed?: number
  /** Replace some of the architecture's scales. */
  scales?: Partial<ArchScales>
  /** Extra or replaced metadata entries (general.file_type excepted). */
  metadata?: Array<[string, MetaValue]>
  /** phi3: LongRoPE factors and their metadata (default true). */
  longRope?: boolean
  /** phi3: rope.dimension_count (default 48 of the head's 64). */
  rotaryDims?: number
}

/** A tensor of an architecture's file and how its float32 values are made. */
export interface ArchTensor {
  name: string
  dims: number[]
  values: (rng: TestRng) => Float32Array
  /** Quantized in the Q4_0 file. */
  quantize: boolean
}

export interface ArchModel {
  arch: ArchName
  shape: ArchShape
  seed: number
  /** Vocabulary size (token_embd's rows). */
  vocab: number
  /** Sliding windows per layer (0: the layer attends to every position), as llama.cpp applies them. */
  windows: number[]
  /** The BOS id to put before a prompt (tokenizer.ggml.add_bos_token), or none. */
  bos: number | undefined
  metadata: Array<[string, MetaValue]>
  tensors: ArchTensor[]
}

interface ArchDefinition {
  shape: ArchShape
  seed: number
  scales: ArchScales
  vocabulary: { kind: 'bpe'; pre: string } | { kind: 'spm' }
  tied: boolean
  /** Metadata beyond the shape's keys and rms epsilon, in the converter's terms. */
  metadata: (a: ArchName, s: ArchShape, o: ArchOptions, vocab: number) => Array<[string, MetaValue]>
  /** One layer's tensors. */
  layer: (l: number, d: Draw) => ArchTensor[]
  /** Tensors outside the layers (rotary factors). */
  extra?: (d: Draw, o: ArchOptions) => ArchTensor[]
  /** Windows per layer as llama.cpp applies them. */
  windows?: (s: ArchShape) => number[]
  /** Keys the converter does not write for this architecture. */
  omit?: string[]
}

/** Tensor builders over one architecture's shape and scales. */
class Draw {
  constructor(
    readonly s: ArchShape,
    readonly scales: ArchScales,
  ) {}

  /** A weight [inputs, outputs] (or [inputs, outputs, experts]), uniform with std spread / sqrt(inputs). */
  linear(name: string, dims: number[], spread = 1): ArchTensor {
    return { name, dims, values: uniform(dims, spread / Math.sqrt(dims[0]!)), quantize: true }
  }

  /** A norm's weight: mean +- 10% (Gemma's converter stores 1 + w, so Gemma's are near 1 too). */
  norm(name: string, n: number, mean = 1): ArchTensor {
    return { name, dims: [n], values: uniform([n], (0.1 * mean) / Math.sqrt(3), mean), quantize: false }
  }

  bias(name: string, n: number): ArchTensor {
    return { name, dims: [n], values: uniform([n], 0.5), quantize: false }
  }

  fixed(name: string, values: number[]): ArchTensor {
    return { name, dims: [values.length], values: () => Float32Array.from(values), quantize: false }
  }

  get q(): number {
    return this.s.heads * this.s.headSize
  }

  get kv(): number {
    return this.s.kvHeads * this.s.headSize
  }

  /** attn_q/k/v [+ biases] and attn_output. */
  attention(l: number, options: { bias?: boolean } = {}): ArchTensor[] {
    const { hidden } = this.s
    const out = [
      this.linear(`blk.${l}.attn_q.weight`, [hidden, this.q], this.scales.qk),
      this.linear(`blk.${l}.attn_k.weight`, [hidden, this.kv], this.scales.qk),
      this.linear(`blk.${l}.attn_v.weight`, [hidden, this.kv]),
      this.linear(`blk.${l}.attn_output.weight`, [this.q, hidden], this.scales.residual),
    ]
    if (options.bias) out.push(this.bias(`blk.${l}.attn_q.bias`, this.q), this.bias(`blk.${l}.attn_k.bias`, this.kv), this.bias(`blk.${l}.attn_v.bias`, this.kv))
    return out
  }

  /** ffn_gate, ffn_up, ffn_down. */
  gatedFfn(l: number): ArchTensor[] {
    const { hidden, ff } = this.s
    return [
      this.linear(`blk.${l}.ffn_gate.weight`, [hidden, ff]),
      this.linear(`blk.${l}.ffn_up.weight`, [hidden, ff]),
      this.linear(`blk.${l}.ffn_down.weight`, [ff, hidden], this.scales.residual),
    ]
  }

  /** Per-head q and k norms ([head]). */
  headNorms(l: number): ArchTensor[] {
    return [this.norm(`blk.${l}.attn_q_norm.weight`, this.s.headSize), this.norm(`blk.${l}.attn_k_norm.weight`, this.s.headSize)]
  }
}

/** `dims` uniform values of this standard deviation around `mean`. */
function uniform(dims: number[], std: number, mean = 0): (rng: TestRng) => Float32Array {
  return (rng) => {
    const out = new Float32Array(dims.reduce((a, b) => a * b, 1))
    const halfWidth = std * Math.sqrt(3)
    for (let i = 0; i < out.length; i++) out[i] = mean + halfWidth * rng.signed()
    return out
  }
}

const SHAPE: ArchShape = { layers: 2, hidden: 128, heads: 4, kvHeads: 2, headSize: 32, ff: 256, context: 256 }

/** The keys LlamaModel's converter adds (vocab_size, rope.dimension_count). */
const llamaKeys = (a: ArchName, s: ArchShape, vocab: number): Array<[string, MetaValue]> => [
  [`${a}.vocab_size`, u32(vocab)],
  [`${a}.rope.dimension_count`, u32(s.headSize)],
]

const keyLength = (a: ArchName, s: ArchShape): Array<[string, MetaValue]> => [
  [`${a}.attention.key_length`, u32(s.headSize)],
  [`${a}.attention.value_length`, u32(s.headSize)],
]

/** Gemma 3's sliding window and the loader's default pattern (5 local layers, then a global one). */
const GEMMA3_WINDOW = 12
const GEMMA2_WINDOW = 16
const PHI3_IGNORED_WINDOW = 16

const DEFINITIONS: Readonly<Record<ArchName, ArchDefinition>> = {
  llama: {
    shape: SHAPE,
    seed: 234,
    scales: { embedding: 1, qk: 1, residual: 1, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'llama-bpe' },
    tied: false,
    metadata: (a, s, _, vocab) => [[`${a}.rope.freq_base`, f32(500000)], ...llamaKeys(a, s, vocab)],
    layer: (l, d) => [d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden), ...d.attention(l), d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden), ...d.gatedFfn(l)],
    extra: (d) => [d.fixed('rope_freqs.weight', Array.from({ length: d.s.headSize / 2 }, (_, i) => 1 + (i * 7) / d.s.headSize))],
  },
  qwen2: {
    shape: SHAPE,
    seed: 277,
    scales: { embedding: 0.125, qk: 2, residual: 8, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'qwen2' },
    tied: true,
    metadata: (a) => [[`${a}.rope.freq_base`, f32(1000000)]],
    layer: (l, d) => [d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden), ...d.attention(l, { bias: true }), d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden), ...d.gatedFfn(l)],
  },
  qwen3: {
    shape: { ...SHAPE, headSize: 64 },
    seed: 70,
    scales: { embedding: 0.125, qk: 2, residual: 8, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'qwen2' },
    tied: true,
    metadata: (a, s) => [[`${a}.rope.freq_base`, f32(1000000)], ...keyLength(a, s)],
    layer: (l, d) => [d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden), ...d.attention(l), ...d.headNorms(l), d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden), ...d.gatedFfn(l)],
  },
  gemma3: {
    shape: { ...SHAPE, layers: 6, kvHeads: 1, headSize: 64 },
    seed: 298,
    scales: { embedding: 0.01, qk: 2, residual: 1, logits: 8 },
    vocabulary: { kind: 'spm' },
    tied: true,
    metadata: (a, s) => [
      [`${a}.rope.freq_base`, f32(1000000)],
      [`${a}.rope.freq_base_swa`, f32(10000)],
      [`${a}.rope.scaling.type`, str('linear')],
      [`${a}.rope.scaling.factor`, f32(8)],
      [`${a}.attention.sliding_window`, u32(GEMMA3_WINDOW)],
      ...keyLength(a, s),
    ],
    layer: (l, d) => [
      d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden),
      ...d.attention(l),
      ...d.headNorms(l),
      d.norm(`blk.${l}.post_attention_norm.weight`, d.s.hidden),
      d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden),
      ...d.gatedFfn(l),
      d.norm(`blk.${l}.post_ffw_norm.weight`, d.s.hidden),
    ],
    windows: (s) => Array.from({ length: s.layers }, (_, l) => (l % 6 < 5 ? GEMMA3_WINDOW : 0)),
  },
  gemma2: {
    shape: { ...SHAPE, layers: 4, headSize: 64 },
    seed: 1043,
    scales: { embedding: 0.01, qk: 1, residual: 1, logits: 8 },
    vocabulary: { kind: 'spm' },
    tied: true,
    metadata: (a, s) => [
      [`${a}.attn_logit_softcapping`, f32(3)],
      [`${a}.final_logit_softcapping`, f32(30)],
      [`${a}.attention.sliding_window`, u32(GEMMA2_WINDOW)],
      ...keyLength(a, s),
    ],
    layer: (l, d) => [
      d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden),
      ...d.attention(l),
      d.norm(`blk.${l}.post_attention_norm.weight`, d.s.hidden),
      d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden),
      ...d.gatedFfn(l),
      d.norm(`blk.${l}.post_ffw_norm.weight`, d.s.hidden),
    ],
    windows: (s) => Array.from({ length: s.layers }, (_, l) => (l % 2 === 0 ? GEMMA2_WINDOW : 0)),
    omit: ['rope.freq_base'],
  },
  phi3: {
    // Heads of 64 rotated over 48 (partial): GroupQueryAttention rotates multiples of 16, as
    // Phi-3.5 (96 of 96) and Phi-4-mini (96 of 128) are.
    shape: { ...SHAPE, heads: 2, kvHeads: 1, headSize: 64, context: 1024 },
    seed: 37,
    scales: { embedding: 1, qk: 1, residual: 1, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'gpt-2' },
    tied: false,
    metadata: (a, s, o) => {
      const longRope = o.longRope ?? true
      const entries: Array<[string, MetaValue]> = [
        [`${a}.rope.freq_base`, f32(10000)],
        [`${a}.rope.dimension_count`, u32(o.rotaryDims ?? PHI3_ROTARY)],
        [`${a}.rope.scaling.original_context_length`, u32(PHI3_ORIGINAL_CONTEXT)],
        [`${a}.attention.sliding_window`, u32(PHI3_IGNORED_WINDOW)],
      ]
      // The converter's LongRoPE attention factor: sqrt(1 + ln(scale) / ln(original)).
      const scale = s.context / PHI3_ORIGINAL_CONTEXT
      if (longRope) entries.push([`${a}.rope.scaling.attn_factor`, f32(Math.sqrt(1 + Math.log(scale) / Math.log(PHI3_ORIGINAL_CONTEXT)))])
      return entries
    },
    layer: (l, d) => {
      const { hidden, ff } = d.s
      return [
        d.norm(`blk.${l}.attn_norm.weight`, hidden),
        phi3Qkv(l, d),
        d.linear(`blk.${l}.attn_output.weight`, [d.q, hidden], d.scales.residual),
        d.norm(`blk.${l}.ffn_norm.weight`, hidden),
        d.linear(`blk.${l}.ffn_up.weight`, [hidden, 2 * ff]),
        d.linear(`blk.${l}.ffn_down.weight`, [ff, hidden], d.scales.residual),
      ]
    },
    extra: (d, o) => {
      if (!(o.longRope ?? true)) return []
      const half = (o.rotaryDims ?? PHI3_ROTARY) / 2
      // Long factors grow towards the low frequencies (as Phi's do); short ones stay near 1.
      return [
        d.fixed('rope_factors_long.weight', Array.from({ length: half }, (_, i) => 1 + (7 * i) / (half - 1))),
        d.fixed('rope_factors_short.weight', Array.from({ length: half }, (_, i) => 1 + (0.5 * i) / (half - 1))),
      ]
    },
  },
  smollm3: {
    shape: { ...SHAPE, layers: 4 },
    seed: 225,
    scales: { embedding: 0.125, qk: 1, residual: 8, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'llama-bpe' },
    tied: true,
    metadata: (a, s, _, vocab) => [[`${a}.rope.freq_base`, f32(100000)], ...llamaKeys(a, s, vocab)],
    layer: (l, d) => [d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden), ...d.attention(l), d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden), ...d.gatedFfn(l)],
  },
  granite: {
    shape: SHAPE,
    seed: 56,
    scales: { embedding: 0.05, qk: 2, residual: 4, logits: 16 },
    vocabulary: { kind: 'bpe', pre: 'starcoder' },
    tied: true,
    metadata: (a, s, _, vocab) => [
      [`${a}.rope.freq_base`, f32(10000)],
      ...llamaKeys(a, s, vocab),
      [`${a}.attention.scale`, f32(0.25)],
      [`${a}.embedding_scale`, f32(6)],
      [`${a}.residual_scale`, f32(0.5)],
      [`${a}.logit_scale`, f32(2)],
    ],
    layer: (l, d) => [d.norm(`blk.${l}.attn_norm.weight`, d.s.hidden), ...d.attention(l), d.norm(`blk.${l}.ffn_norm.weight`, d.s.hidden), ...d.gatedFfn(l)],
  },
  olmo2: {
    shape: { ...SHAPE, kvHeads: 4 },
    seed: 239,
    scales: { embedding: 1, qk: 2, residual: 1, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'llama-bpe' },
    tied: false,
    metadata: (a) => [[`${a}.rope.freq_base`, f32(500000)]],
    layer: (l, d) => [
      ...d.attention(l),
      d.norm(`blk.${l}.attn_q_norm.weight`, d.q),
      d.norm(`blk.${l}.attn_k_norm.weight`, d.kv),
      d.norm(`blk.${l}.post_attention_norm.weight`, d.s.hidden),
      ...d.gatedFfn(l),
      d.norm(`blk.${l}.post_ffw_norm.weight`, d.s.hidden),
    ],
  },
  qwen3moe: {
    shape: { ...SHAPE, headSize: 64, ff: 64 },
    seed: 16,
    scales: { embedding: 1, qk: 2, residual: 1, logits: 8 },
    vocabulary: { kind: 'bpe', pre: 'qwen2' },
    tied: false,
    metadata: (a, s) => [
      [`${a}.rope.freq_base`, f32(1000000)],
      ...keyLength(a, s),
      [`${a}.expert_count`, u32(QWEN3MOE_EXPERTS)],
      [`${a}.expert_used_count`, u32(QWEN3MOE_USED)],
      [`${a}.expert_feed_forward_length`, u32(s.ff)],
    ],
    layer: (l, d) => {
      const { hidden, ff } = d.s
      const E = QWEN3MOE_EXPERTS
      return [
        d.norm(`blk.${l}.attn_norm.weight`, hidden),
        ...d.attention(l),
        ...d.headNorms(l),
        d.norm(`blk.${l}.ffn_norm.weight`, hidden),
        // The router stays F32 in the Q4_0 file: llama-quantize never quantizes ffn_gate_inp.
        { ...d.linear(`blk.${l}.ffn_gate_inp.weight`, [hidden, E], 4), quantize: false },
        d.linear(`blk.${l}.ffn_gate_exps.weight`, [hidden, ff, E]),
        d.linear(`blk.${l}.ffn_up_exps.weight`, [hidden, ff, E]),
        d.linear(`blk.${l}.ffn_down_exps.weight`, [ff, hidden, E], d.scales.residual),
      ]
    },
  },
}

const PHI3_ROTARY = 48
export const PHI3_ORIGINAL_CONTEXT = 256
const QWEN3MOE_EXPERTS = 8
const QWEN3MOE_USED = 2
/** The dense feed-forward width Qwen3-MoE's converter writes beside the experts' (the loader reads the experts'). */
const QWEN3MOE_DENSE_FF = 256

/** phi3's fused q, k, v rows: [hidden, hidden + 2 x kv], q and k with the wider spread. */
function phi3Qkv(l: number, d: Draw): ArchTensor {
  const { hidden } = d.s
  const rows = [
    { n: d.q, spread: d.scales.qk },
    { n: d.kv, spread: d.scales.qk },
    { n: d.kv, spread: 1 },
  ]
  const total = rows.reduce((a, r) => a + r.n, 0)
  return {
    name: `blk.${l}.attn_qkv.weight`,
    dims: [hidden, total],
    values: (rng) => {
      const out = new Float32Array(hidden * total)
      let at = 0
      for (const r of rows) {
        out.set(uniform([hidden, r.n], r.spread / Math.sqrt(hidden))(rng), at)
        at += hidden * r.n
      }
      return out
    },
    quantize: true,
  }
}

interface Vocabulary {
  entries: Array<[string, MetaValue]>
  size: number
  bos: number | undefined
}

const CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

function bpeVocabulary(pre: string): Vocabulary {
  const v = tinyVocabulary()
  return {
    size: v.tokens.length,
    bos: undefined,
    entries: [
      ['tokenizer.ggml.model', str('gpt2')],
      ['tokenizer.ggml.pre', str(pre)],
      ['tokenizer.ggml.tokens', strings(v.tokens)],
      ['tokenizer.ggml.token_type', i32s(v.types)],
      ['tokenizer.ggml.merges', strings(v.merges)],
      ['tokenizer.ggml.bos_token_id', u32(1)],
      ['tokenizer.ggml.eos_token_id', u32(2)],
      ['tokenizer.ggml.padding_token_id', u32(0)],
      ['tokenizer.ggml.add_bos_token', bool(false)],
      ['tokenizer.chat_template', str(CHAT_TEMPLATE)],
    ],
  }
}

/** Gemma's form: SentencePiece (tokenizer.ggml.model llama), no space prefix, BOS added. */
function spmVocabulary(): Vocabulary {
  const v = tinySentencePieceVocabulary()
  return {
    size: v.tokens.length,
    bos: 1,
    entries: [
      ['tokenizer.ggml.model', str('llama')],
      ['tokenizer.ggml.pre', str('default')],
      ['tokenizer.ggml.tokens', strings(v.tokens)],
      ['tokenizer.ggml.scores', f32s(v.scores)],
      ['tokenizer.ggml.token_type', i32s(v.types)],
      ['tokenizer.ggml.bos_token_id', u32(1)],
      ['tokenizer.ggml.eos_token_id', u32(2)],
      ['tokenizer.ggml.unknown_token_id', u32(0)],
      ['tokenizer.ggml.padding_token_id', u32(0)],
      ['tokenizer.ggml.add_bos_token', bool(true)],
      ['tokenizer.ggml.add_eos_token', bool(false)],
      ['tokenizer.ggml.add_space_prefix', bool(false)],
    ],
  }
}

/** An architecture's model: metadata (without general.file_type) and tensors, from its definition and `o`. */
export function archModel(arch: ArchName, o: ArchOptions = {}): ArchModel {
  const def = DEFINITIONS[arch]
  const s = def.shape
  const scales = { ...def.scales, ...o.scales }
  const d = new Draw(s, scales)
  const vocabulary = def.vocabulary.kind === 'spm' ? spmVocabulary() : bpeVocabulary(def.vocabulary.pre)
  const V = vocabulary.size
  const a = arch
  const ff = arch === 'qwen3moe' ? QWEN3MOE_DENSE_FF : s.ff
  const base: Array<[string, MetaValue]> = [
    ['general.architecture', str(a)],
    // Not the architecture's name: llama.cpp sets per-token attributes by the model's name
    // ("phi3" in it breaks a vocabulary without Phi's special tokens).
    ['general.name', str(`ortex tiny ${a === 'phi3' ? 'phi' : a}`)],
    ['general.quantization_version', u32(2)],
    [`${a}.block_count`, u32(s.layers)],
    [`${a}.context_length`, u32(s.context)],
    [`${a}.embedding_length`, u32(s.hidden)],
    [`${a}.feed_forward_length`, u32(ff)],
    [`${a}.attention.head_count`, u32(s.heads)],
    [`${a}.attention.head_count_kv`, u32(s.kvHeads)],
    [`${a}.attention.layer_norm_rms_epsilon`, f32(1e-6)],
    ...def.metadata(a, s, o, V),
  ]
  const omitted = new Set((def.omit ?? []).map((k) => `${a}.${k}`))
  const metadata = [...base.filter(([k]) => !omitted.has(k)), ...vocabulary.entries]
  for (const [key, value] of o.metadata ?? []) {
    const at = metadata.findIndex(([k]) => k === key)
    if (at >= 0) metadata[at] = [key, value]
    else metadata.push([key, value])
  }
  const tensors: ArchTensor[] = [{ name: 'token_embd.weight', dims: [s.hidden, V], values: uniform([s.hidden, V], scales.embedding), quantize: true }]
  tensors.push(...(def.extra?.(d, o) ?? []))
  for (let l = 0; l < s.layers; l++) tensors.push(...def.layer(l, d))
  // The final norm's output has an RMS near its weight, so a logit's spread is about
  // sqrt(hidden) x (the output rows' spread) x (the norm's weight).
  const rootH = Math.sqrt(s.hidden)
  tensors.push(d.norm('output_norm.weight', s.hidden, def.tied ? scales.logits / (rootH * scales.embedding) : 1))
  if (!def.tied) tensors.push({ name: 'output.weight', dims: [s.hidden, V], values: uniform([s.hidden, V], scales.logits / rootH), quantize: true })
  return {
    arch,
    shape: s,
    seed: o.seed ?? def.seed,
    vocab: V,
    windows: def.windows?.(s) ?? new Array<number>(s.layers).fill(0),
    bos: vocabulary.bos,
    metadata,
    tensors,
  }
}

/** llama.cpp's general.file_type values (enum llama_ftype). */
const FILE_TYPE: Readonly<Record<ArchFormat, number>> = { F32: 0, Q4_0: 2 }

/** A tensor's own seed: the model's and its name's (FNV-1a), so that adding or dropping a tensor
 *  changes no other tensor's values. */
function tensorSeed(seed: number, name: string): number {
  let hash = 0x811c9dc5
  for (let i = 0; i < name.length; i++) hash = Math.imul(hash ^ name.charCodeAt(i), 0x01000193) >>> 0
  // Below 2^21: TestRng multiplies the seed by a 32-bit constant and must stay exact in a double.
  return ((hash ^ Math.imul(seed, 0x9e3779b1)) >>> 0) % 0x200000
}

/**
 * The GGUF file's tensors in `format`, each from its own seeded generator. The weights that the
 * Q4_0 file quantizes hold, in the F32 file, the values of those Q4_0 blocks: the two files are one
 * model, and differ only in how the arithmetic runs (llama.cpp quantizes activations to 8 bits
 * against Q4_0 weights; an int4 import with float activations matches the F32 file exactly).
 */
export function archTensors(model: ArchModel, format: ArchFormat): GgufTensor[] {
  return model.tensors.map((t) => {
    const values = t.values(new TestRng(tensorSeed(model.seed, t.name)))
    if (!t.quantize) return { name: t.name, dims: t.dims, type: GgmlTypeId.F32, data: new Uint8Array(values.buffer) }
    const blocks = quantizeQ4_0(values)
    if (format === 'Q4_0') return { name: t.name, dims: t.dims, type: GgmlTypeId.Q4_0, data: blocks }
    dequantize(GgmlTypeId.Q4_0, blocks, values.length, values)
    return { name: t.name, dims: t.dims, type: GgmlTypeId.F32, data: new Uint8Array(values.buffer) }
  })
}

export function archGgufBytes(model: ArchModel, format: ArchFormat): Buffer {
  return ggufBytes([...model.metadata, ['general.file_type', u32(FILE_TYPE[format])]], archTensors(model, format))
}

/** Writes a model (an architecture's, or one with a feature taken away) in `format`. */
export function writeArchModel(path: string, model: ArchModel, format: ArchFormat): void {
  writeFileSync(path, archGgufBytes(model, format))
}

/** Writes `arch`'s file in `format` to `path`; returns the model it holds. */
export function writeArchGguf(path: string, arch: ArchName, format: ArchFormat, o: ArchOptions = {}): ArchModel {
  const model = archModel(arch, o)
  writeArchModel(path, model, format)
  return model
}

// ---- features, taken away one at a time -----------------------------------------------------
//
// A file exercises a feature only if the feature changes what the model does. Each entry below
// is the architecture's model with one feature taken away (by metadata llama.cpp reads, or by
// tensors it can do without), everything else the same: llama.cpp's greedy tokens over the
// standard prompts must differ from the file's own (test/model/llama-cpp-oracle.test.ts), so an
// importer that misses the feature cannot give llama.cpp's tokens by luck. Left out: what no
// greedy token can show (granite's logit_scale and gemma2's final soft-cap leave every argmax
// where it was: only logits compared as values show them), and what no file llama.cpp loads can
// go without (the q/k norms of qwen3, gemma3, olmo2 and qwen3moe, which rescale every score).

export interface ArchFeature {
  feature: string
  /** The model without the feature. */
  without: (o: ArchOptions) => ArchModel
  /** llama.cpp's context size for the run without it (phi3 chooses its rotary factors by it). */
  contextSize?: number
}

/** The model with these metadata entries replaced, added or (undefined) removed. */
export function withMetadata(m: ArchModel, entries: Array<[string, MetaValue | undefined]>): ArchModel {
  let metadata = [...m.metadata]
  for (const [key, value] of entries) {
    metadata = metadata.filter(([k]) => k !== key)
    if (value !== undefined) metadata.push([key, value])
  }
  return { ...m, metadata }
}

/** The model without the tensors whose names match. */
export function withoutTensors(m: ArchModel, pattern: RegExp): ArchModel {
  return { ...m, tensors: m.tensors.filter((t) => !pattern.test(t.name)) }
}

/** The model with the values of the tensors whose names match multiplied by `factor`. */
export function withScaledTensors(m: ArchModel, pattern: RegExp, factor: number): ArchModel {
  const scaled = (t: ArchTensor): ArchTensor => ({ ...t, values: (rng) => t.values(rng).map((v) => v * factor) })
  return { ...m, tensors: m.tensors.map((t) => (pattern.test(t.name) ? scaled(t) : t)) }
}

/** The same tensors and settings read as another architecture (its keys renamed). */
export function asArchitecture(m: ArchModel, arch: ArchName): ArchModel {
  const metadata = m.metadata.map(([k, v]): [string, MetaValue] =>
    k === 'general.architecture' ? [k, str(arch)] : k.startsWith(`${m.arch}.`) ? [`${arch}.${k.slice(m.arch.length + 1)}`, v] : [k, v],
  )
  return { ...m, arch, metadata }
}

/** A window longer than any context here: sliding-window layers that attend to everything. */
const NO_WINDOW = u32(1 << 20)

/** Gemma's embedding scale taken away: the embedding divided by sqrt(hidden) and, as it is tied,
 *  the final norm multiplied by it, so the logits are the file's up to a uniform scale. */
function withoutEmbeddingScale(m: ArchModel): ArchModel {
  const root = Math.sqrt(m.shape.hidden)
  return withScaledTensors(withScaledTensors(m, /^token_embd\.weight$/, 1 / root), /^output_norm\.weight$/, root)
}

export const ARCH_FEATURES: Readonly<Record<ArchName, ArchFeature[]>> = {
  llama: [{ feature: 'rope_freqs.weight (rotary frequency factors)', without: (o) => withoutTensors(archModel('llama', o), /^rope_freqs\./) }],
  qwen2: [
    { feature: 'q/k/v biases', without: (o) => withoutTensors(archModel('qwen2', o), /\.bias$/) },
    { feature: 'rope.freq_base', without: (o) => withMetadata(archModel('qwen2', o), [['qwen2.rope.freq_base', undefined]]) },
  ],
  qwen3: [{ feature: 'rope.freq_base', without: (o) => withMetadata(archModel('qwen3', o), [['qwen3.rope.freq_base', undefined]]) }],
  gemma3: [
    { feature: 'the sliding window', without: (o) => withMetadata(archModel('gemma3', o), [['gemma3.attention.sliding_window', NO_WINDOW]]) },
    { feature: 'rope.freq_base_swa (the local layers\' base)', without: (o) => withMetadata(archModel('gemma3', o), [['gemma3.rope.freq_base_swa', f32(1000000)]]) },
    {
      feature: 'linear rope scaling (global layers only)',
      without: (o) => withMetadata(archModel('gemma3', o), [['gemma3.rope.scaling.type', undefined], ['gemma3.rope.scaling.factor', undefined]]),
    },
    { feature: 'the embedding scale sqrt(hidden)', without: (o) => withoutEmbeddingScale(archModel('gemma3', o)) },
  ],
  gemma2: [
    { feature: 'the sliding window', without: (o) => withMetadata(archModel('gemma2', o), [['gemma2.attention.sliding_window', NO_WINDOW]]) },
    { feature: 'attention logit soft-capping', without: (o) => withMetadata(archModel('gemma2', o), [['gemma2.attn_logit_softcapping', f32(1e9)]]) },
    { feature: 'the embedding scale sqrt(hidden)', without: (o) => withoutEmbeddingScale(archModel('gemma2', o)) },
  ],
  phi3: [
    { feature: 'the long rotary factors (short ones at a context of 256)', without: (o) => archModel('phi3', o), contextSize: PHI3_ORIGINAL_CONTEXT },
    { feature: 'rope.scaling.attn_factor', without: (o) => withMetadata(archModel('phi3', o), [['phi3.rope.scaling.attn_factor', undefined]]) },
    { feature: 'partial rotary (48 of 64)', without: (o) => archModel('phi3', { ...o, rotaryDims: 64 }) },
  ],
  smollm3: [{ feature: 'no rotary on layer 3 (as llama: rotary everywhere)', without: (o) => asArchitecture(archModel('smollm3', o), 'llama') }],
  granite: [
    { feature: 'attention.scale', without: (o) => withMetadata(archModel('granite', o), [['granite.attention.scale', undefined]]) },
    { feature: 'embedding_scale', without: (o) => withMetadata(archModel('granite', o), [['granite.embedding_scale', undefined]]) },
    { feature: 'residual_scale', without: (o) => withMetadata(archModel('granite', o), [['granite.residual_scale', undefined]]) },
  ],
  olmo2: [{ feature: 'rope.freq_base', without: (o) => withMetadata(archModel('olmo2', o), [['olmo2.rope.freq_base', undefined]]) }],
  qwen3moe: [{ feature: 'top-2 routing (top-1 instead)', without: (o) => withMetadata(archModel('qwen3moe', o), [['qwen3moe.expert_used_count', u32(1)]]) }],
}
