// `ortex import`: a GGUF file -> an onnxruntime-genai model folder that Engine.load runs
// (docs/model-format.md, "Importing GGUF files"). The steps, each in its own module:
//
//   reader.ts        header, metadata, tensor table (checked against the file's size)
//   architecture.ts  the architecture (a row of architectures.ts) -> the decoder graph's sizes,
//                    features and weight names
//   tokenizer.ts     the vocabulary -> tokenizer.json, tokenizer_config.json, chat_template.jinja
//   tensors.ts       each weight, dequantized (fp32) or as MatMulNBits blocks (int4, int4.ts)
//   ../decoder.ts    the graph (GroupQueryAttention, as onnxruntime-genai's builder emits for CPU)
//
// Everything that can be refused is checked before anything is written (the header's counts and
// sizes, the architecture, the vocabulary and merges as the tokenizers crate checks them). The
// folder is then written into a staging folder inside outDir and moved into place at the end,
// genai_config.json last: a failed import leaves outDir as it was (and no outDir if it made it),
// never a folder that looks like a model and does not load.
//
//   outDir/.ortex-import-XXXXXX/   tokenizer files, model.onnx.data (streamed, one tensor at a
//                                  time), model.onnx, genai_config.json
//   outDir/                        <- the files renamed in: the old genai_config.json removed
//                                     first, the new one renamed last

import { mkdir, mkdtemp, rename, rm, writeFile } from 'node:fs/promises'
import { join, resolve } from 'node:path'
import { OrtexError } from '../../errors'
import { genaiConfig } from '../genai-config'
import { type KvType, buildDecoderGraph, type LinearStorage, type DecoderDims } from '../decoder'
import type { PagedKernel } from '../paged'
import { CONFIG_FILE, DATA_FILE, MODEL_FILE, type FileSize, fileSizes, writeConfigLast, writeModelFile } from '../model-folder'
import { DataFileWriter, layoutWeights, type WeightLayout } from '../weights'
import { type Architecture, type ModelPlan, planModel } from './architecture'
import { architectureSpec } from './architectures'
import { type ConversionJob, MAX_IMPORT_WORKERS, convertTensors, plannedTensors } from './convert'
import { GgmlTypeId, ggmlTypeName } from './ggml-types'
import { mapsToInt8 } from './int8'
import { GgufData, type GgufFile, readGguf } from './reader'
import type { Mapping, PlannedTensor } from './tensors'
import { type TokenizerConversion, convertTokenizer } from './tokenizer'

export { MAX_IMPORT_WORKERS } from './convert'

/** Bumped whenever the imported bytes for a given file change (2: float16 KV and an 8-bit Q8_0
 *  lm_head in int4 imports; 3: every 5-, 6- and 8-bit linear as exact 8-bit blocks in int4 imports). */
export const IMPORTER_VERSION = 3

export type WeightFormat = 'fp32' | 'int4'

/** The attention forms an import writes: GroupQueryAttention, or the paged form (paged.ts). */
export type ImportAttention = 'gqa' | 'paged'

/** The paged form's default block size: the builder's (paged_block_size 256). */
export const IMPORT_BLOCK_SIZE = 256

/**
 * MatMulNBits' accuracy_level in an int4 import: what its CPU kernel computes with. 4 quantizes
 * each activation row to int8 blocks and runs integer dot products (faster, as onnxruntime-genai's
 * builder sets for CPU int4); 0 multiplies float32 activations by the dequantized weights.
 */
export type AccuracyLevel = 0 | 4

/** The default: int8 activations, as onnxruntime-genai's builder sets for CPU int4. */
export const INT4_ACCURACY_LEVEL: AccuracyLevel = 4

export interface ImportOptions {
  /** The .gguf file. */
  file: string
  /** The folder to write (created if missing; our files in it are overwritten). */
  outDir: string
  /** Default fp32. */
  weights?: WeightFormat
  /**
   * The KV cache's element type (the logits stay float32). Default: fp16 with int4 weights (half
   * the memory a position, as llama.cpp's default cache), fp32 with fp32 weights (exact).
   */
  kv?: KvType
  /**
   * MatMulNBits' accuracy_level, int4 only: 4 (default) int8 activations, 0 float32 activations
   * (docs/model-format.md, "Faithfulness").
   */
  accuracyLevel?: AccuracyLevel
  /** Default gqa. */
  attention?: ImportAttention
  /** paged only: default cuda (com.microsoft.PagedAttention, needs dtype fp16). */
  pagedKernel?: PagedKernel
  /** paged only: positions a KV cache block; default IMPORT_BLOCK_SIZE. */
  blockSize?: number
  /**
   * The float weights' and the arithmetic's element type: fp32 (default) or fp16, as the
   * builder's `-p fp16 -e cuda` folders (KV and logits float16 too; MatMulNBits scales float16).
   */
  dtype?: KvType
  /**
   * The folder's context (its rotary tables' positions and the engine's maxLength): at most the
   * file's context_length, which is the default. It also picks LongRoPE's factors (the long ones
   * above the file's original context), as llama.cpp's context size does.
   */
  contextLength?: number
  /**
   * Threads that dequantize and requantize the tensors: default one per core; 1 converts on the
   * calling thread. The folder is the same byte for byte whatever the number.
   */
  workers?: number
  /** Bytes of model.onnx.data written so far. */
  onProgress?: (done: number, total: number, label: string) => void
}

export interface ImportSummary {
  outDir: string
  file: string
  architecture: Architecture
  name: string | undefined
  weights: WeightFormat
  kv: KvType
  dtype: KvType
  attention: ImportAttention
  /** The paged form's kernel and block size. */
  paged?: { kernel: PagedKernel; blockSize: number }
  /** MatMulNBits' accuracy_level (int4 imports); null for fp32 weights (no MatMulNBits). */
  accuracyLevel: AccuracyLevel | null
  parameters: number
  dims: DecoderDims
  tiedEmbeddings: boolean
  preTokenizer: string
  /** Source tensors by how they were written and their ggml type: { exact: { Q4_1: 210 }, ... }. */
  tensors: Record<Mapping, Record<string, number>>
  files: FileSize[]
  totalBytes: number
  elapsedMs: number
}

const TOKENIZER_FILES = ['tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'] as const
const CHAT_TEMPLATE_FILE = 'chat_template.jinja'
/** Every file an import may write, so that publishing can remove one that a previous import into
 *  the same folder left and this one does not write (a stale chat template would be used). */
const IMPORT_FILES = [MODEL_FILE, DATA_FILE, ...TOKENIZER_FILES, CHAT_TEMPLATE_FILE] as const

export async function importGguf(options: ImportOptions): Promise<ImportSummary> {
  const started = Date.now()
  if (!options.file) throw new OrtexError('INVALID_ARGUMENT', 'file is required')
  if (!options.outDir) throw new OrtexError('INVALID_ARGUMENT', 'outDir is required')
  const { weights, kv, accuracyLevel, dtype, attention, paged, workers } = checkOptions(options)
  const file = readGguf(resolve(options.file))
  const plan = importPlan(file, options)
  if (plan.experts && dtype === 'fp16') {
    throw new OrtexError('INVALID_ARGUMENT', `${file.path}: a mixture-of-experts model imports with float32 arithmetic only (its experts' block has no float16 form yet): leave dtype fp32`)
  }
  const tokenizer = convertTokenizer(file, plan.dims.contextLength)
  if (tokenizer.size > plan.dims.vocabSize) {
    throw new OrtexError('MODEL_LOAD', `${file.path}: the vocabulary has ${tokenizer.size} tokens but the embedding only ${plan.dims.vocabSize} rows`)
  }
  const storage: LinearStorage = accuracyLevel === null ? { kind: 'fp32' } : { kind: 'int4', accuracyLevel }
  const planned = plannedTensors(plan, storage, dtype)
  const layout = layoutWeights(planned.flatMap((t) => t.specs), DATA_FILE)
  const outDir = resolve(options.outDir)
  const names = await staged(outDir, async (dir) => {
    const tokenizerFiles = await writeTokenizer(dir, tokenizer)
    const job: ConversionJob = { file: file.path, options: planOptions(options), storage, dtype }
    await writeData(file, join(dir, DATA_FILE), { planned, layout, job, workers }, options.onProgress)
    await writeGraph(dir, plan, { storage, kv, dtype, attention, paged }, layout, weights)
    await writeConfigLast(dir, importedConfig(plan, tokenizer, { dtype, attention, paged }))
    return [MODEL_FILE, DATA_FILE, ...tokenizerFiles]
  })
  const { files, totalBytes } = await fileSizes(outDir, [CONFIG_FILE, ...names])
  return {
    outDir,
    file: file.path,
    architecture: plan.architecture,
    name: plan.name,
    weights,
    kv,
    dtype,
    attention,
    ...(paged ? { paged } : {}),
    accuracyLevel,
    parameters: plan.parameters,
    dims: plan.dims,
    tiedEmbeddings: plan.tiedEmbeddings,
    preTokenizer: tokenizer.preTokenizer,
    tensors: tally(planned),
    files,
    totalBytes,
    elapsedMs: Date.now() - started,
  }
}

/**
 * The model an import of `file` writes, planned from the file and the import's options: what
 * importGguf and every conversion worker (convert-worker.ts, given the same options) plan from, so
 * that they agree tensor by tensor. An option that changes the plan is passed on here.
 */
export function importPlan(file: GgufFile, options: PlanOptions): ModelPlan {
  return planModel(file, options.contextLength === undefined ? {} : { contextLength: options.contextLength })
}

/** The import's options a conversion worker gets: all that can travel to a thread. */
export type PlanOptions = Omit<ImportOptions, 'onProgress'>

function planOptions(options: ImportOptions): PlanOptions {
  const { onProgress: _, ...rest } = options
  return rest
}

export interface CheckedOptions {
  weights: WeightFormat
  kv: KvType
  accuracyLevel: AccuracyLevel | null
  dtype: KvType
  attention: ImportAttention
  paged: { kernel: PagedKernel; blockSize: number } | undefined
  /** Absent: one per core where the worker script is built (convert.ts). */
  workers: number | undefined
  /** Absent: the file's context length. */
  contextLength: number | undefined
}

/** The options that shape an import, their defaults filled in and each checked (INVALID_ARGUMENT):
 *  what an import writes depends on these values and the file alone. */
export function checkOptions(options: Omit<ImportOptions, 'file' | 'outDir'>): CheckedOptions {
  const invalid = (message: string) => new OrtexError('INVALID_ARGUMENT', message)
  const weights = options.weights ?? 'fp32'
  if (weights !== 'fp32' && weights !== 'int4') throw invalid(`weights must be 'fp32' or 'int4', got ${JSON.stringify(weights)}`)
  const dtype = options.dtype ?? 'fp32'
  if (dtype !== 'fp32' && dtype !== 'fp16') throw invalid(`dtype must be 'fp32' or 'fp16', got ${JSON.stringify(dtype)}`)
  const kv = options.kv ?? (dtype === 'fp16' ? 'fp16' : defaultKv(weights))
  if (kv !== 'fp32' && kv !== 'fp16') throw invalid(`kv must be 'fp32' or 'fp16', got ${JSON.stringify(kv)}`)
  if (dtype === 'fp16' && kv !== 'fp16') throw invalid('float16 weights (dtype fp16) keep float16 KV')
  const attention = options.attention ?? 'gqa'
  if (attention !== 'gqa' && attention !== 'paged') throw invalid(`attention must be 'gqa' or 'paged', got ${JSON.stringify(attention)}`)
  if (options.contextLength !== undefined && !(Number.isInteger(options.contextLength) && options.contextLength >= 1)) {
    throw invalid(`contextLength must be a positive integer, got ${JSON.stringify(options.contextLength)}`)
  }
  const workers = options.workers
  if (workers !== undefined && (!Number.isInteger(workers) || workers < 1 || workers > MAX_IMPORT_WORKERS)) {
    throw invalid(`workers must be an integer in [1, ${MAX_IMPORT_WORKERS}], got ${JSON.stringify(workers)}`)
  }
  return { weights, kv, accuracyLevel: checkAccuracyLevel(weights, options.accuracyLevel), dtype, attention, paged: checkPaged(options, attention, dtype), workers, contextLength: options.contextLength }
}

/** The paged form's kernel and block size (none for gqa, which takes neither). */
function checkPaged(options: Omit<ImportOptions, 'file' | 'outDir'>, attention: ImportAttention, dtype: KvType): CheckedOptions['paged'] {
  const invalid = (message: string) => new OrtexError('INVALID_ARGUMENT', message)
  if (attention !== 'paged') {
    if (options.pagedKernel !== undefined || options.blockSize !== undefined) throw invalid('a paged kernel or block size needs the paged attention form')
    return undefined
  }
  const kernel = options.pagedKernel ?? 'cuda'
  const blockSize = options.blockSize ?? IMPORT_BLOCK_SIZE
  if (kernel !== 'cuda' && kernel !== 'reference') throw invalid(`pagedKernel must be 'cuda' or 'reference', got ${JSON.stringify(kernel)}`)
  if (!Number.isInteger(blockSize) || blockSize < 1 || blockSize > 1 << 16) throw invalid(`blockSize must be an integer in [1, 65536], got ${JSON.stringify(blockSize)}`)
  // ONNX Runtime's PagedAttention runs on CUDA in float16 or bfloat16 only (base.py make_attention_init).
  if (kernel === 'cuda' && dtype !== 'fp16') throw invalid('the cuda paged kernel needs float16 (dtype fp16); the reference kernel runs float32')
  return { kernel, blockSize }
}

/** An int4 import's accuracy level (default 4); fp32 weights have no MatMulNBits to set it on. */
function checkAccuracyLevel(weights: WeightFormat, level: AccuracyLevel | undefined): AccuracyLevel | null {
  if (weights === 'fp32') {
    if (level !== undefined) throw new OrtexError('INVALID_ARGUMENT', 'accuracyLevel applies to int4 weights only (fp32 weights have no MatMulNBits)')
    return null
  }
  if (level === undefined) return INT4_ACCURACY_LEVEL
  if (level !== 0 && level !== 4) throw new OrtexError('INVALID_ARGUMENT', `accuracyLevel must be 0 or 4, got ${JSON.stringify(level)}`)
  return level
}

/** The KV type an import keeps unless told: float16 beside 4-bit weights, float32 beside float32 ones. */
const defaultKv = (weights: WeightFormat): KvType => (weights === 'int4' ? 'fp16' : 'fp32')

/**
 * Runs `write` on a fresh staging folder inside outDir (so the renames stay on one file system),
 * then moves what it wrote into outDir, genai_config.json last. On any failure the staging folder
 * is removed, and outDir too if this call created it.
 */
async function staged(outDir: string, write: (dir: string) => Promise<string[]>): Promise<string[]> {
  const created = await mkdir(outDir, { recursive: true })
  const staging = await mkdtemp(join(outDir, '.ortex-import-'))
  try {
    const names = await write(staging)
    await publish(staging, outDir, names)
    return names
  } catch (error) {
    if (created !== undefined) await rm(created, { recursive: true, force: true })
    throw error
  } finally {
    await rm(staging, { recursive: true, force: true })
  }
}

/** Moves the staged files into outDir: its genai_config.json (a previous import's) goes first, so
 *  the folder does not load while it holds a mix of files; the new one comes last. */
async function publish(staging: string, outDir: string, names: string[]): Promise<void> {
  await rm(join(outDir, CONFIG_FILE), { force: true })
  for (const name of IMPORT_FILES) if (!names.includes(name)) await rm(join(outDir, name), { force: true })
  for (const name of names) await rename(join(staging, name), join(outDir, name))
  await rename(join(staging, CONFIG_FILE), join(outDir, CONFIG_FILE))
}

/** The tokenizer files and the chat template; returns the names written. */
async function writeTokenizer(outDir: string, tokenizer: TokenizerConversion): Promise<string[]> {
  await writeFile(join(outDir, 'tokenizer.json'), tokenizer.tokenizerJson)
  await writeFile(join(outDir, 'tokenizer_config.json'), tokenizer.tokenizerConfigJson)
  await writeFile(join(outDir, 'special_tokens_map.json'), tokenizer.specialTokensMapJson)
  if (tokenizer.chatTemplate === undefined) return [...TOKENIZER_FILES]
  await writeFile(join(outDir, CHAT_TEMPLATE_FILE), tokenizer.chatTemplate)
  return [...TOKENIZER_FILES, CHAT_TEMPLATE_FILE]
}

async function writeGraph(
  outDir: string,
  plan: ModelPlan,
  o: { storage: LinearStorage } & Pick<CheckedOptions, 'kv' | 'dtype' | 'attention' | 'paged'>,
  layout: WeightLayout,
  weights: WeightFormat,
): Promise<void> {
  // float32 models keep float32 logits; float16 ones give float16 logits, as the builder's.
  const options = {
    attention: o.attention,
    features: plan.features,
    attentionBias: plan.attentionBias,
    tiedEmbeddings: plan.tiedEmbeddings,
    linear: o.storage,
    kv: o.kv,
    logits: o.dtype,
    ...(o.dtype === 'fp16' ? { dtype: o.dtype } : {}),
    ...(o.paged ? { paged: o.paged } : {}),
  } as const
  await writeModelFile(outDir, buildDecoderGraph(plan.dims, options, layout.tensors), { name: 'ortex import', version: String(IMPORTER_VERSION) }, {
    'ortex.attention': o.attention,
    'ortex.source': 'gguf',
    'ortex.architecture': plan.architecture,
    'ortex.weights': weights,
    'ortex.kv': o.kv,
    'ortex.parameters': String(plan.parameters),
    'ortex.importer_version': String(IMPORTER_VERSION),
    // Only the new forms carry these, so that the existing imports' bytes stay as they were.
    ...(o.dtype === 'fp32' ? {} : { 'ortex.dtype': o.dtype }),
    ...(o.paged ? { 'ortex.paged_kernel': o.paged.kernel, 'ortex.block_size': String(o.paged.blockSize) } : {}),
  })
}

function importedConfig(plan: ModelPlan, tokenizer: TokenizerConversion, o: Pick<CheckedOptions, 'dtype' | 'attention' | 'paged'>): object {
  const eos = tokenizer.eosTokenIds
  return genaiConfig({
    dims: plan.dims,
    attention: o.attention,
    filename: MODEL_FILE,
    modelType: architectureSpec(plan.architecture).modelType,
    ...slidingWindow(plan, o.attention),
    bosTokenId: tokenizer.bosTokenId ?? eos[0]!,
    eosTokenId: eos.length === 1 ? eos[0]! : eos,
    padTokenId: tokenizer.padTokenId,
    ...(o.paged ? { blockSize: o.paged.blockSize } : {}),
    // As make-model: float16 folders are the builder's CUDA ones, but for the CPU reference kernel.
    provider: o.dtype === 'fp16' && o.paged?.kernel !== 'reference' ? 'cuda' : 'cpu',
  })
}

/**
 * genai_config's sliding_window where the graph has GroupQueryAttention windows (one size, its
 * layers), as onnxruntime-genai's builder writes it; the executor checks that the two agree.
 * PagedAttention and the paged reference kernel keep their windows in the graph only (the
 * executor reads a config window for GroupQueryAttention layers alone).
 */
function slidingWindow(plan: ModelPlan, attention: ImportAttention): { slidingWindow?: { windowSize: number; layers: number[] } } {
  const windowed = plan.features.layers?.flatMap((layer, l) => (layer.window === undefined ? [] : [[l, layer.window] as const])) ?? []
  if (windowed.length === 0 || attention !== 'gqa') return {}
  const sizes = new Set(windowed.map(([, w]) => w))
  if (sizes.size !== 1) return {}
  return { slidingWindow: { windowSize: windowed[0]![1], layers: windowed.map(([l]) => l) } }
}

/** Streams every planned tensor, in layout order, from the GGUF file to the data file, converted
 *  by `workers` threads (convert.ts). */
async function writeData(
  file: GgufFile,
  path: string,
  o: { planned: PlannedTensor[]; layout: WeightLayout; job: ConversionJob; workers: number | undefined },
  onProgress: ImportOptions['onProgress'],
): Promise<void> {
  const data = new GgufData(file)
  const out = await DataFileWriter.create(path, o.layout, onProgress)
  try {
    for await (const [t, parts] of convertTensors(o.job, data, o.planned, o.layout, o.workers)) {
      for (const [index, chunk] of parts) await out.append(o.layout.tensors.get(t.specs[index]!.name)!, chunk)
    }
    await out.finish()
  } catch (error) {
    await out.close().catch(() => {})
    throw error
  } finally {
    data.close()
  }
}

function tally(planned: PlannedTensor[]): ImportSummary['tensors'] {
  const out: ImportSummary['tensors'] = { dequantized: {}, exact: {}, requantized: {} }
  for (const t of planned) {
    if (!t.source || !t.mapping) continue
    const type = ggmlTypeName(t.source.type)
    out[t.mapping][type] = (out[t.mapping][type] ?? 0) + 1
  }
  return out
}

/**
 * The one-line summary: architecture, parameters, weights written, what was kept exactly or
 * requantized, int4's activations, the KV type, time. E.g. "out/smollm2: llama "SmolLM2",
 * 134,515,008 parameters, int4 weights (blocks kept exactly: Q4_1 x210, Q8_0 x1; float32: F32 x61),
 * int8 activations, float16 KV, 140.3 MB in 4.8 s".
 */
export function describeImport(s: ImportSummary): string {
  const list = (counts: Record<string, number>) =>
    Object.entries(counts)
      .map(([type, n]) => `${type} x${n}`)
      .join(', ')
  const parts: string[] = []
  const exact = Object.keys(s.tensors.exact)
  const wide = exact.filter((type) => mapsToInt8(GgmlTypeId[type as keyof typeof GgmlTypeId]))
  if (exact.length > 0) parts.push(`blocks kept exactly: ${list(s.tensors.exact)}${wide.length > 0 ? ` (${wide.join(', ')} as 8-bit blocks)` : ''}`)
  if (Object.keys(s.tensors.requantized).length > 0) parts.push(`requantized to 4 bits: ${list(s.tensors.requantized)}`)
  if (Object.keys(s.tensors.dequantized).length > 0) parts.push(`${s.dtype === 'fp16' ? 'float16' : 'float32'}: ${list(s.tensors.dequantized)}`)
  const name = s.name === undefined ? '' : ` "${s.name}"`
  const activations = s.accuracyLevel === null ? '' : `${s.accuracyLevel === 4 ? 'int8' : 'float32'} activations, `
  const form = s.paged ? `paged attention (${s.paged.kernel} kernel, blocks of ${s.paged.blockSize}), ` : ''
  const weights = s.dtype === 'fp16' && s.weights === 'fp32' ? 'fp16' : s.weights
  return (
    `${s.outDir}: ${s.architecture}${name}, ${s.parameters.toLocaleString('en-US')} parameters, ${weights} weights ` +
    `(${parts.join('; ')}), ${activations}${form}${s.kv === 'fp32' ? 'float32' : 'float16'} KV, ${(s.totalBytes / 1e6).toFixed(1)} MB in ${(s.elapsedMs / 1000).toFixed(1)} s`
  )
}
