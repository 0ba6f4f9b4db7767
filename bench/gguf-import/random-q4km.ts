// The import benchmark's model: a Llama-architecture GGUF file of Llama-3.2-1B's shape (hidden
// 2048, 16 layers, 32 query and 8 KV heads of 64, feed-forward 8192, tied embeddings) over
// SmolLM2's 49,152-token vocabulary: 1.07B parameters, with random blocks in llama.cpp's Q4_K_M
// layout (src/llama-quant.cpp, llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M):
//
//   token_embd (tied: the output's type)                 Q6_K
//   attn_v, ffn_down of layers where use_more_bits(i, n)  Q6_K   (i < n/8, i >= 7n/8, (i - n/8) % 3 == 2)
//   every other 2-D weight                                Q4_K
//   norms                                                 F32
//
// The blocks are valid random ones (test/helpers/gguf-writer.ts's randomTensorData): what costs an
// import is the types and the shapes, not the values. Written once into
// ${cacheRoot()}/gguf-import-bench/ under a name that carries the generator's version, through a
// private name renamed into place.

import { existsSync, mkdirSync, renameSync, rmSync } from 'node:fs'
import { join } from 'node:path'

import { type MetaValue, TestRng, f32, randomTensorData, str, u32 } from '../../test/helpers/gguf-writer'
import { GGML_TYPES, GgmlTypeId } from '../../ts/modelkit/gguf/ggml-types'
import { readGguf } from '../../ts/modelkit/gguf/reader'
import { tokenizerMetadata } from '../llama-cpp/random-gguf'
import { GgufStream, type TensorHeader } from '../llama-cpp/gguf-stream'

/** Bumped whenever the file's bytes change. */
const GENERATOR_VERSION = 1
const SEED = 1

export const Q4KM_DIMS = { hidden: 2048, layers: 16, heads: 32, kvHeads: 8, headSize: 64, intermediate: 8192, context: 4096, vocab: 49152 } as const

/** llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps at 6 bits. */
const useMoreBits = (i: number, n: number) => i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2

interface RandomTensor extends TensorHeader {
  std: number
}

export function q4kmTensors(): RandomTensor[] {
  const d = Q4KM_DIMS
  const q = d.heads * d.headSize
  const kv = d.kvHeads * d.headSize
  const weight = (name: string, inputs: number, outputs: number, type: number): RandomTensor => ({ name, dims: [inputs, outputs], type, std: 1 / Math.sqrt(inputs) })
  const norm = (name: string): RandomTensor => ({ name, dims: [d.hidden], type: GgmlTypeId.F32, std: 0.1 })
  const out: RandomTensor[] = [{ name: 'token_embd.weight', dims: [d.hidden, d.vocab], type: GgmlTypeId.Q6_K, std: 1 }]
  for (let l = 0; l < d.layers; l++) {
    const more = useMoreBits(l, d.layers) ? GgmlTypeId.Q6_K : GgmlTypeId.Q4_K
    out.push(
      norm(`blk.${l}.attn_norm.weight`),
      weight(`blk.${l}.attn_q.weight`, d.hidden, q, GgmlTypeId.Q4_K),
      weight(`blk.${l}.attn_k.weight`, d.hidden, kv, GgmlTypeId.Q4_K),
      weight(`blk.${l}.attn_v.weight`, d.hidden, kv, more),
      weight(`blk.${l}.attn_output.weight`, q, d.hidden, GgmlTypeId.Q4_K),
      norm(`blk.${l}.ffn_norm.weight`),
      weight(`blk.${l}.ffn_gate.weight`, d.hidden, d.intermediate, GgmlTypeId.Q4_K),
      weight(`blk.${l}.ffn_up.weight`, d.hidden, d.intermediate, GgmlTypeId.Q4_K),
      weight(`blk.${l}.ffn_down.weight`, d.intermediate, d.hidden, more),
    )
  }
  out.push(norm('output_norm.weight'))
  return out
}

export const q4kmParameters = () => q4kmTensors().reduce((n, t) => n + t.dims.reduce((a, b) => a * b, 1), 0)

function metadata(tokenizerSource: string): Array<[string, MetaValue]> {
  const d = Q4KM_DIMS
  return [
    ['general.architecture', str('llama')],
    ['general.name', str('ortex bench random llama 1B')],
    // llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M.
    ['general.file_type', u32(15)],
    ['general.quantization_version', u32(2)],
    ['llama.block_count', u32(d.layers)],
    ['llama.context_length', u32(d.context)],
    ['llama.embedding_length', u32(d.hidden)],
    ['llama.feed_forward_length', u32(d.intermediate)],
    ['llama.attention.head_count', u32(d.heads)],
    ['llama.attention.head_count_kv', u32(d.kvHeads)],
    ['llama.rope.freq_base', f32(500000)],
    ['llama.rope.dimension_count', u32(d.headSize)],
    ['llama.attention.layer_norm_rms_epsilon', f32(1e-5)],
    ['llama.vocab_size', u32(d.vocab)],
    ...tokenizerMetadata(readGguf(tokenizerSource)),
  ]
}

/** Rows of random blocks drawn at a time: a few MB. */
const ROWS_PER_CHUNK = 256

/** The file, written on first use (about a minute); `tokenizerSource` is SmolLM2's GGUF file. */
export function randomQ4KM(root: string, tokenizerSource: string, progress: (line: string) => void): string {
  const d = Q4KM_DIMS
  const file = join(root, `random-llama-1b-v${GENERATOR_VERSION}-h${d.hidden}-l${d.layers}-f${d.intermediate}.Q4_K_M.gguf`)
  if (existsSync(file)) return file
  mkdirSync(root, { recursive: true })
  progress(`writing the random 1B Q4_K_M model (${(q4kmParameters() / 1e9).toFixed(2)}B parameters) to ${file}`)
  const tmp = `${file}.tmp-${process.pid}`
  const tensors = q4kmTensors()
  const stream = new GgufStream(tmp, metadata(tokenizerSource), tensors)
  try {
    tensors.forEach((t, index) => {
      const rng = new TestRng(SEED * 1000 + index)
      const rows = t.dims[1] ?? 1
      const perRow = t.dims[0]!
      if (perRow % GGML_TYPES.get(t.type)!.blockSize !== 0) throw new Error(`${t.name}: rows of ${perRow} are not whole blocks`)
      for (let first = 0; first < rows; first += ROWS_PER_CHUNK) stream.append(randomTensorData(t.type, Math.min(ROWS_PER_CHUNK, rows - first) * perRow, t.std, rng))
      stream.next()
    })
    stream.close()
    renameSync(tmp, file)
  } finally {
    rmSync(tmp, { force: true })
  }
  return file
}
