// Tiny GGUF models for the importer's tests: llama or qwen2 metadata, random weights in the
// ggml types asked for (per tensor), and a byte-level BPE vocabulary (make-model's, with its
// special tokens as CONTROL tokens plus two chat tokens). Rows are 256 wide so that every type,
// K-quants included, fits.

import { GgmlTypeId, type GgmlTypeName } from '../../ts/modelkit/gguf/ggml-types'
import { CORPUS } from '../../ts/modelkit/corpus'
import { trainBpe } from '../../ts/modelkit/tokenizer'
import { type GgufTensor, type MetaValue, TestRng, bool, f32, i32s, randomTensorData, str, strings, u32, writeGguf } from './gguf-writer'

export const TINY = { hidden: 256, heads: 4, kvHeads: 2, headSize: 64, intermediate: 512, layers: 2, context: 256 } as const

/** The linear tensors of a layer, in the order `types.layers[l]` lists their types. */
export const LINEARS = ['attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down'] as const

export interface TinyGgufOptions {
  architecture: 'llama' | 'qwen2'
  /** ggml types: the token embedding, the output (absent: tied), each layer's 7 linears. */
  types: { embedding: GgmlTypeName; output?: GgmlTypeName; layers: GgmlTypeName[][] }
  pre?: string
  seed?: number
  ropeTheta?: number
  /** rope_freqs.weight (Llama 3's frequency factors). */
  ropeFactors?: boolean
  /** rope.scaling.type "linear" with this factor. */
  linearRopeScaling?: number
  /** Multiplies the spread of attn_output and ffn_down and divides the embedding's (a tied model
   *  needs layers that outweigh the token's own embedding, or it repeats its input). Default 1. */
  residualScale?: number
  /** Extra or replaced metadata entries. */
  metadata?: Array<[string, MetaValue]>
  /** Extra tensors. */
  tensors?: GgufTensor[]
}

export const CHAT_TOKENS = ['<|im_start|>', '<|im_end|>'] as const

export function tinyVocabulary(): { tokens: string[]; types: number[]; merges: string[] } {
  const bpe = trainBpe(384 - CHAT_TOKENS.length)
  const tokens = [...bpe.vocab, ...CHAT_TOKENS]
  const types = tokens.map((_, id) => (id < 3 || id >= bpe.vocab.length ? 3 : 1))
  return { tokens, types, merges: bpe.merges.map(([a, b]) => `${a} ${b}`) }
}

export function tinyGgufMetadata(o: TinyGgufOptions): Array<[string, MetaValue]> {
  const a = o.architecture
  const vocab = tinyVocabulary()
  const entries: Array<[string, MetaValue]> = [
    ['general.architecture', str(a)],
    ['general.name', str(`tiny ${a}`)],
    [`${a}.block_count`, u32(TINY.layers)],
    [`${a}.context_length`, u32(TINY.context)],
    [`${a}.embedding_length`, u32(TINY.hidden)],
    [`${a}.feed_forward_length`, u32(TINY.intermediate)],
    [`${a}.attention.head_count`, u32(TINY.heads)],
    [`${a}.attention.head_count_kv`, u32(TINY.kvHeads)],
    [`${a}.rope.freq_base`, f32(o.ropeTheta ?? 10000)],
    [`${a}.attention.layer_norm_rms_epsilon`, f32(1e-6)],
    ['tokenizer.ggml.model', str('gpt2')],
    ['tokenizer.ggml.pre', str(o.pre ?? (a === 'qwen2' ? 'qwen2' : 'smollm'))],
    ['tokenizer.ggml.tokens', strings(vocab.tokens)],
    ['tokenizer.ggml.token_type', i32s(vocab.types)],
    ['tokenizer.ggml.merges', strings(vocab.merges)],
    ['tokenizer.ggml.bos_token_id', u32(1)],
    ['tokenizer.ggml.eos_token_id', u32(2)],
    ['tokenizer.ggml.padding_token_id', u32(0)],
    ['tokenizer.ggml.add_bos_token', bool(false)],
    ['tokenizer.chat_template', str("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")],
  ]
  if (o.linearRopeScaling !== undefined) {
    entries.push([`${a}.rope.scaling.type`, str('linear')], [`${a}.rope.scaling.factor`, f32(o.linearRopeScaling)])
  }
  for (const [key, value] of o.metadata ?? []) {
    const at = entries.findIndex(([k]) => k === key)
    if (at >= 0) entries[at] = [key, value]
    else entries.push([key, value])
  }
  return entries
}

export function tinyGgufTensors(o: TinyGgufOptions): GgufTensor[] {
  const rng = new TestRng(o.seed ?? 1)
  const H = TINY.hidden
  const V = tinyVocabulary().tokens.length
  const q = TINY.heads * TINY.headSize
  const kv = TINY.kvHeads * TINY.headSize
  const tensor = (name: string, dims: number[], type: GgmlTypeName, std: number): GgufTensor => ({
    name,
    dims,
    type: GgmlTypeId[type],
    data: randomTensorData(GgmlTypeId[type], dims.reduce((x, y) => x * y, 1), std, rng),
  })
  const norm = (name: string, n: number): GgufTensor => ({
    name,
    dims: [n],
    type: GgmlTypeId.F32,
    data: new Uint8Array(Float32Array.from({ length: n }, () => 1 + 0.1 * rng.signed()).buffer),
  })
  const shapes: Record<(typeof LINEARS)[number], number[]> = {
    attn_q: [H, q],
    attn_k: [H, kv],
    attn_v: [H, kv],
    attn_output: [q, H],
    ffn_gate: [H, TINY.intermediate],
    ffn_up: [H, TINY.intermediate],
    ffn_down: [TINY.intermediate, H],
  }
  const out: GgufTensor[] = [tensor('token_embd.weight', [H, V], o.types.embedding, 1 / (o.residualScale ?? 1))]
  for (let l = 0; l < TINY.layers; l++) {
    out.push(norm(`blk.${l}.attn_norm.weight`, H))
    LINEARS.forEach((name, i) => {
      const dims = shapes[name]
      const spread = name === 'attn_q' || name === 'attn_k' ? 2 : name === 'attn_output' || name === 'ffn_down' ? (o.residualScale ?? 1) : 1
      out.push(tensor(`blk.${l}.${name}.weight`, dims, o.types.layers[l]![i]!, spread / Math.sqrt(dims[0]!)))
    })
    out.push(norm(`blk.${l}.ffn_norm.weight`, H))
    if (o.architecture === 'qwen2') {
      out.push(tensor(`blk.${l}.attn_q.bias`, [q], 'F32', 0.5), tensor(`blk.${l}.attn_k.bias`, [kv], 'F32', 0.5), tensor(`blk.${l}.attn_v.bias`, [kv], 'F32', 0.5))
    }
  }
  out.push(norm('output_norm.weight', H))
  if (o.types.output) out.push(tensor('output.weight', [H, V], o.types.output, 3 / Math.sqrt(H)))
  if (o.ropeFactors) {
    out.push({
      name: 'rope_freqs.weight',
      dims: [TINY.headSize / 2],
      type: GgmlTypeId.F32,
      data: new Uint8Array(Float32Array.from({ length: TINY.headSize / 2 }, (_, i) => 1 + (i * 7) / TINY.headSize).buffer),
    })
  }
  out.push(...(o.tensors ?? []))
  return out
}

export function writeTinyGguf(path: string, o: TinyGgufOptions): void {
  writeGguf(path, tinyGgufMetadata(o), tinyGgufTensors(o))
}


/**
 * A SentencePiece vocabulary in llama's GGUF form: <unk>, <s>, </s>, the 256 <0xXX> byte tokens,
 * then pieces of make-model's text ("▁" for spaces): its characters, word prefixes and a few
 * endings, with deterministic scores. At most 384 tokens (the tiny models' embedding rows).
 */
export function tinySentencePieceVocabulary(): { tokens: string[]; types: number[]; scores: number[] } {
  const tokens = ['<unk>', '<s>', '</s>']
  const types = [2, 3, 3]
  for (let b = 0; b < 256; b++) {
    tokens.push(`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`)
    types.push(6)
  }
  const words = CORPUS.split(/\s+/).filter(Boolean).map((w) => `▁${w}`)
  const pieces = new Set<string>()
  for (const w of words) for (const ch of w) pieces.add(ch)
  const endings = ['ing', 'ed', 'er', 'the', 'an', 'in', 'on']
  for (const e of endings) for (let n = 2; n <= e.length; n++) pieces.add(e.slice(0, n))
  const frequency = new Map<string, number>()
  for (const w of words) for (let n = 2; n <= Math.min(w.length, 6); n++) frequency.set(w.slice(0, n), (frequency.get(w.slice(0, n)) ?? 0) + 1)
  const prefixes = [...frequency].sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1)).map(([p]) => p)
  for (const p of prefixes) {
    if (pieces.size + tokens.length >= 384) break
    // Only prefixes whose own prefix is a piece are reachable by merges.
    if (pieces.has(p.slice(0, -1)) || p.length === 2) pieces.add(p)
  }
  const rng = new TestRng(17)
  for (const p of pieces) {
    tokens.push(p)
    types.push(1)
  }
  const scores = tokens.map((t, id) => (types[id] === 1 ? -(Array.from(t).length === 1 ? 1000 : 10) * (1 + rng.int(1000) / 1000) : 0))
  return { tokens, types, scores }
}
