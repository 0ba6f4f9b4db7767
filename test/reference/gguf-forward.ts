// An independent forward pass over a GGUF file, with llama.cpp's semantics and none of the
// importer's mapping: the weights as the file stores them (llama's q/k rows still permuted),
// llama.cpp's rotary (llama: "normal" mode, pairs (2i, 2i+1) of each head; qwen2: NEOX mode, pairs
// (i, i + D/2)), the output weight or the tied token embedding, float64 arithmetic. The importer's
// tests compare the logits of an imported folder (ONNX Runtime) with these; only the dequantizer
// is shared, and test/model/gguf-dequantize.test.ts checks it against gguf-py.

import { dequantize } from '../../ts/modelkit/gguf/dequantize'
import { GgufData, Metadata, readGguf } from '../../ts/modelkit/gguf/reader'

export function ggufLogits(path: string, tokens: number[]): Float64Array[] {
  const file = readGguf(path)
  const m = new Metadata(file)
  const arch = m.string('general.architecture')
  const data = new GgufData(file)
  const tensor = (name: string): Float64Array | undefined => {
    const t = file.tensors.find((x) => x.name === name)
    if (!t) return undefined
    const out = new Float32Array(t.elements)
    dequantize(t.type, data.rows(t, 0, t.elements / t.dims[0]!), t.elements, out)
    return Float64Array.from(out)
  }
  const need = (name: string) => tensor(name) ?? fail(name)
  const H = m.count(`${arch}.embedding_length`)
  const heads = m.count(`${arch}.attention.head_count`)
  const kvHeads = m.count(`${arch}.attention.head_count_kv`)
  const D = H / heads
  const layers = m.count(`${arch}.block_count`)
  const eps = m.number(`${arch}.attention.layer_norm_rms_epsilon`)
  const theta = m.number(`${arch}.rope.freq_base`)
  const linear = m.string(`${arch}.rope.scaling.type`, 'none') === 'linear' ? 1 / m.number(`${arch}.rope.scaling.factor`) : 1
  const factors = tensor('rope_freqs.weight')
  const embedding = need('token_embd.weight')
  const output = tensor('output.weight') ?? embedding
  const V = embedding.length / H
  const S = tokens.length

  // x[s] = embedding row of token s
  let x: Float64Array[] = tokens.map((t) => embedding.slice(t * H, (t + 1) * H))
  for (let l = 0; l < layers; l++) {
    const w = (name: string) => need(`blk.${l}.${name}`)
    const bias = (name: string) => tensor(`blk.${l}.${name}`)
    const h = x.map((row) => rmsNorm(row, w('attn_norm.weight'), eps))
    const q = h.map((row) => matVec(w('attn_q.weight'), row, bias('attn_q.bias')))
    const k = h.map((row) => matVec(w('attn_k.weight'), row, bias('attn_k.bias')))
    const v = h.map((row) => matVec(w('attn_v.weight'), row, bias('attn_v.bias')))
    for (let s = 0; s < S; s++) {
      rope(q[s]!, heads, D, s, theta, linear, factors, arch === 'qwen2')
      rope(k[s]!, kvHeads, D, s, theta, linear, factors, arch === 'qwen2')
    }
    const attn = q.map((qs, s) => attention(qs, k, v, s, heads, kvHeads, D))
    const o = attn.map((row) => matVec(w('attn_output.weight'), row))
    x = x.map((row, s) => add(row, o[s]!))
    const h2 = x.map((row) => rmsNorm(row, w('ffn_norm.weight'), eps))
    const mlp = h2.map((row) => {
      const gate = matVec(w('ffn_gate.weight'), row)
      const up = matVec(w('ffn_up.weight'), row)
      return matVec(w('ffn_down.weight'), gate.map((g, i) => (g / (1 + Math.exp(-g))) * up[i]!))
    })
    x = x.map((row, s) => add(row, mlp[s]!))
  }
  const norm = need('output_norm.weight')
  data.close()
  return x.map((row) => matVec(output, rmsNorm(row, norm, eps)).slice(0, V))
}

function fail(name: string): never {
  throw new Error(`the GGUF file has no ${name}`)
}

/** y = W x (+ b) with W stored as ggml rows: W[n] is the row of output n (length x.length). */
function matVec(w: Float64Array, x: Float64Array, b?: Float64Array): Float64Array {
  const K = x.length
  const N = w.length / K
  const y = new Float64Array(N)
  for (let n = 0; n < N; n++) {
    let sum = b ? b[n]! : 0
    for (let k = 0; k < K; k++) sum += w[n * K + k]! * x[k]!
    y[n] = sum
  }
  return y
}

function add(a: Float64Array, b: Float64Array): Float64Array {
  return a.map((v, i) => v + b[i]!)
}

function rmsNorm(x: Float64Array, w: Float64Array, eps: number): Float64Array {
  let mean = 0
  for (const v of x) mean += v * v
  const scale = 1 / Math.sqrt(mean / x.length + eps)
  return x.map((v, i) => v * scale * w[i]!)
}

/** In place, per head: llama.cpp's rotary (normal: pairs (2i, 2i+1); neox: pairs (i, i + D/2)). */
function rope(x: Float64Array, heads: number, D: number, pos: number, theta: number, scale: number, factors: Float64Array | undefined, neox: boolean): void {
  for (let h = 0; h < heads; h++) {
    for (let i = 0; i < D / 2; i++) {
      const angle = (pos * scale * Math.pow(theta, (-2 * i) / D)) / (factors ? factors[i]! : 1)
      const a = h * D + (neox ? i : 2 * i)
      const b = h * D + (neox ? i + D / 2 : 2 * i + 1)
      const x0 = x[a]!
      const x1 = x[b]!
      x[a] = x0 * Math.cos(angle) - x1 * Math.sin(angle)
      x[b] = x0 * Math.sin(angle) + x1 * Math.cos(angle)
    }
  }
}

/** Causal attention of query position s over keys 0..s; query head i uses KV head i / (heads / kvHeads). */
function attention(q: Float64Array, k: Float64Array[], v: Float64Array[], s: number, heads: number, kvHeads: number, D: number): Float64Array {
  const out = new Float64Array(heads * D)
  for (let h = 0; h < heads; h++) {
    const g = Math.floor(h / (heads / kvHeads))
    const scores = Array.from({ length: s + 1 }, (_, t) => {
      let dot = 0
      for (let d = 0; d < D; d++) dot += q[h * D + d]! * k[t]![g * D + d]!
      return dot / Math.sqrt(D)
    })
    const max = Math.max(...scores)
    const e = scores.map((z) => Math.exp(z - max))
    const total = e.reduce((a, b) => a + b, 0)
    for (let t = 0; t <= s; t++) for (let d = 0; d < D; d++) out[h * D + d]! += (e[t]! / total) * v[t]![g * D + d]!
  }
  return out
}

