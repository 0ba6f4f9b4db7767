// The larger model of the llama.cpp benchmark: a Llama-architecture GGUF with random weights,
// written twice from one pass over the same seeded values: as F32 and as Q4_0 (every 2-D tensor,
// the token embedding included, quantized with llama.cpp's reference quantizer, as
// `llama-quantize --pure` would; the norms stay F32, as llama.cpp keeps them). So the two files
// are one model up to quantization. The tokenizer metadata is SmolLM2's (copied from its GGUF
// file), so both runtimes read a real gpt2 BPE vocabulary and the prompts are real text.
//
// Cached under ${cacheRoot()}/llama-cpp-bench/random-KEY/ (KEY: the generator version and the
// dimensions) with a done marker written last, so a second run writes nothing.

import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'

import { type MetaValue, TestRng, bool, f32, i32s, str, strings, u32 } from '../../test/helpers/gguf-writer'
import { GgmlTypeId } from '../../ts/modelkit/gguf/ggml-types'
import { type GgufFile, readGguf } from '../../ts/modelkit/gguf/reader'
import { GgufStream, type TensorHeader, quantizeQ4_0 } from './gguf-stream'

/** Bumped whenever the files' bytes for the same dimensions change. */
const GENERATOR_VERSION = 1
const SEED = 22

/** About 231M parameters (SmolLM2-135M has 135M): 16 layers of width 1024, GQA 16/4 heads of 64,
 *  tied embeddings over SmolLM2's 49,152 tokens. */
export const RANDOM_DIMS = {
  hidden: 1024,
  layers: 16,
  heads: 16,
  kvHeads: 4,
  headSize: 64,
  intermediate: 2816,
  context: 2048,
  vocab: 49152,
} as const

export interface RandomModel {
  f32: string
  q4_0: string
  parameters: number
  /** Seconds this call spent writing the files (0: they came from the cache). */
  writtenS: number
}

/** A tensor of the model and how its values are drawn. */
interface RandomTensor extends TensorHeader {
  /** Uniform values of this standard deviation around `mean`. */
  std: number
  mean: number
  /** Quantized to Q4_0 in the Q4_0 file (the 2-D weights); the norms stay F32. */
  quantize: boolean
}

function modelTensors(): RandomTensor[] {
  const d = RANDOM_DIMS
  const q = d.heads * d.headSize
  const kv = d.kvHeads * d.headSize
  const linear = (name: string, inputs: number, outputs: number, spread = 1): RandomTensor => ({
    name,
    dims: [inputs, outputs],
    type: GgmlTypeId.Q4_0,
    std: spread / Math.sqrt(inputs),
    mean: 0,
    quantize: true,
  })
  const norm = (name: string): RandomTensor => ({ name, dims: [d.hidden], type: GgmlTypeId.F32, std: 0.1 / Math.sqrt(3), mean: 1, quantize: false })
  const out: RandomTensor[] = [{ name: 'token_embd.weight', dims: [d.hidden, d.vocab], type: GgmlTypeId.Q4_0, std: 1, mean: 0, quantize: true }]
  for (let l = 0; l < d.layers; l++) {
    out.push(
      norm(`blk.${l}.attn_norm.weight`),
      // Wider q and k: attention that is not uniform over the positions.
      linear(`blk.${l}.attn_q.weight`, d.hidden, q, 2),
      linear(`blk.${l}.attn_k.weight`, d.hidden, kv, 2),
      linear(`blk.${l}.attn_v.weight`, d.hidden, kv),
      linear(`blk.${l}.attn_output.weight`, q, d.hidden),
      norm(`blk.${l}.ffn_norm.weight`),
      linear(`blk.${l}.ffn_gate.weight`, d.hidden, d.intermediate),
      linear(`blk.${l}.ffn_up.weight`, d.hidden, d.intermediate),
      linear(`blk.${l}.ffn_down.weight`, d.intermediate, d.hidden),
    )
  }
  out.push(norm('output_norm.weight'))
  return out
}

export function randomParameters(): number {
  return modelTensors().reduce((sum, t) => sum + t.dims[0]! * (t.dims[1] ?? 1), 0)
}

/** The metadata types of the tokenizer keys llama.cpp's converter writes (the reader keeps values, not types). */
const TOKENIZER_KEYS: Readonly<Record<string, (v: unknown) => MetaValue>> = {
  'tokenizer.ggml.model': (v) => str(v as string),
  'tokenizer.ggml.pre': (v) => str(v as string),
  'tokenizer.ggml.tokens': (v) => strings(v as string[]),
  'tokenizer.ggml.token_type': (v) => i32s(v as number[]),
  'tokenizer.ggml.merges': (v) => strings(v as string[]),
  'tokenizer.ggml.bos_token_id': (v) => u32(v as number),
  'tokenizer.ggml.eos_token_id': (v) => u32(v as number),
  'tokenizer.ggml.unknown_token_id': (v) => u32(v as number),
  'tokenizer.ggml.padding_token_id': (v) => u32(v as number),
  'tokenizer.ggml.add_bos_token': (v) => bool(v as boolean),
  'tokenizer.ggml.add_space_prefix': (v) => bool(v as boolean),
  'tokenizer.chat_template': (v) => str(v as string),
}

/** SmolLM2's tokenizer.* entries, typed; a key this table does not know is refused, not guessed. */
export function tokenizerMetadata(source: GgufFile): Array<[string, MetaValue]> {
  const out: Array<[string, MetaValue]> = []
  for (const [key, value] of source.metadata) {
    if (!key.startsWith('tokenizer.')) continue
    const typed = TOKENIZER_KEYS[key]
    if (typed === undefined) throw new Error(`${source.path}: no metadata type known for ${key}`)
    out.push([key, typed(value)])
  }
  const tokens = source.metadata.get('tokenizer.ggml.tokens')
  if (!Array.isArray(tokens) || tokens.length !== RANDOM_DIMS.vocab) throw new Error(`${source.path}: expected ${RANDOM_DIMS.vocab} tokens`)
  return out
}

function modelMetadata(source: GgufFile, fileType: number): Array<[string, MetaValue]> {
  const d = RANDOM_DIMS
  return [
    ['general.architecture', str('llama')],
    ['general.name', str('ortex bench random llama')],
    ['general.file_type', u32(fileType)],
    ['general.quantization_version', u32(2)],
    ['llama.block_count', u32(d.layers)],
    ['llama.context_length', u32(d.context)],
    ['llama.embedding_length', u32(d.hidden)],
    ['llama.feed_forward_length', u32(d.intermediate)],
    ['llama.attention.head_count', u32(d.heads)],
    ['llama.attention.head_count_kv', u32(d.kvHeads)],
    ['llama.rope.freq_base', f32(100000)],
    ['llama.rope.dimension_count', u32(d.headSize)],
    ['llama.attention.layer_norm_rms_epsilon', f32(1e-5)],
    ['llama.vocab_size', u32(d.vocab)],
    ...tokenizerMetadata(source),
  ]
}

/** llama.cpp's general.file_type values (enum llama_ftype). */
const FILE_TYPE = { F32: 0, Q4_0: 2 } as const
/** Rows drawn at a time: a few MB of float32. */
const ROWS_PER_CHUNK = 512

/** Uniform values of t's mean and standard deviation, rows [first, first + count). */
function drawRows(t: RandomTensor, rng: TestRng, count: number): Float32Array {
  const values = new Float32Array(count * t.dims[0]!)
  const halfWidth = t.std * Math.sqrt(3)
  for (let i = 0; i < values.length; i++) values[i] = t.mean + halfWidth * rng.signed()
  return values
}

function asBytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
}

/** Both files in one pass: each tensor's values are drawn once (its own seed) and written twice. */
function writeBoth(source: GgufFile, f32Path: string, q4Path: string, onProgress: (line: string) => void): void {
  const tensors = modelTensors()
  const f32File = new GgufStream(f32Path, modelMetadata(source, FILE_TYPE.F32), tensors.map((t) => ({ ...t, type: GgmlTypeId.F32 })))
  const q4File = new GgufStream(q4Path, modelMetadata(source, FILE_TYPE.Q4_0), tensors)
  try {
    tensors.forEach((t, index) => {
      const rng = new TestRng(SEED * 1000 + index)
      const rows = t.dims[1] ?? 1
      for (let first = 0; first < rows; first += ROWS_PER_CHUNK) {
        const values = drawRows(t, rng, Math.min(ROWS_PER_CHUNK, rows - first))
        f32File.append(asBytes(values))
        q4File.append(t.quantize ? quantizeQ4_0(values) : asBytes(values))
      }
      f32File.next()
      q4File.next()
      if (index % 40 === 0) onProgress(`random model: tensor ${index + 1} of ${tensors.length} (${t.name})`)
    })
  } finally {
    f32File.close()
    q4File.close()
  }
}

interface DoneMarker {
  generatorVersion: number
  dims: typeof RANDOM_DIMS
  parameters: number
  files: Record<'f32' | 'q4_0', { name: string; bytes: number }>
}

/** The random model's two files, written on first use into `root` (a private folder renamed into place). */
export function randomModel(root: string, tokenizerSource: string, onProgress: (line: string) => void): RandomModel {
  const d = RANDOM_DIMS
  const key = `v${GENERATOR_VERSION}-s${SEED}-h${d.hidden}-l${d.layers}-a${d.heads}x${d.kvHeads}-f${d.intermediate}-c${d.context}`
  const dir = join(root, `random-${key}`)
  const marker = join(dir, 'done.json')
  const paths = (at: string) => ({ f32: join(at, 'random-llama.F32.gguf'), q4_0: join(at, 'random-llama.Q4_0.gguf') })
  const parameters = randomParameters()
  if (existsSync(marker)) {
    const done = JSON.parse(readFileSync(marker, 'utf8')) as DoneMarker
    const { f32: f, q4_0: q } = paths(dir)
    if (statSync(f).size === done.files.f32.bytes && statSync(q).size === done.files.q4_0.bytes) return { ...paths(dir), parameters, writtenS: 0 }
  }
  onProgress(`writing the random model (${(parameters / 1e6).toFixed(0)}M parameters, F32 and Q4_0) into ${dir}`)
  const started = performance.now()
  const tmp = `${dir}.tmp-${process.pid}`
  rmSync(tmp, { recursive: true, force: true })
  mkdirSync(tmp, { recursive: true })
  try {
    const files = paths(tmp)
    writeBoth(readGguf(tokenizerSource), files.f32, files.q4_0, onProgress)
    const done: DoneMarker = {
      generatorVersion: GENERATOR_VERSION,
      dims: d,
      parameters,
      files: {
        f32: { name: 'random-llama.F32.gguf', bytes: statSync(files.f32).size },
        q4_0: { name: 'random-llama.Q4_0.gguf', bytes: statSync(files.q4_0).size },
      },
    }
    writeFileSync(join(tmp, 'done.json'), `${JSON.stringify(done, null, 2)}\n`)
    rmSync(dir, { recursive: true, force: true })
    renameSync(tmp, dir)
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
  return { ...paths(dir), parameters, writtenS: (performance.now() - started) / 1000 }
}
