// The GGUF importer (ts/modelkit/gguf/) on small GGUF files written at test time
// (test/helpers/gguf-writer.ts): every tensor type the importer reads, both architectures, both
// weight formats. The imported graph is checked against an independent forward pass over the GGUF
// tensors with llama.cpp's semantics (test/reference/gguf-forward.ts), the engine against the plain
// onnxruntime-node loop over the same folder (test/reference/reference.ts), and the tokenizer
// against llama.cpp's tokenization of the GGUF vocabulary (test/reference/llama-vocab.ts).

import { spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import onnxProto from 'onnx-proto'
import { Engine } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { dequantize } from '../../ts/modelkit/gguf/dequantize'
import { GgmlTypeId, type GgmlTypeName } from '../../ts/modelkit/gguf/ggml-types'
import { importGguf, type ImportSummary } from '../../ts/modelkit/gguf/import'
import { int4Value, packInt4 } from '../../ts/modelkit/gguf/int4'
import { int8Value, packInt8 } from '../../ts/modelkit/gguf/int8'
import { ARCHITECTURES, MODEL_LIMITS } from '../../ts/modelkit/gguf/architecture'
import { GGUF_LIMITS, readGguf } from '../../ts/modelkit/gguf/reader'
import { SENTENCE_PIECE_LIMITS, SUPPORTED_PRE_TOKENIZERS } from '../../ts/modelkit/gguf/tokenizer'
import { CHAT_TOKENS, TINY, tinySentencePieceVocabulary, type TinyGgufOptions, tinyGgufMetadata, tinyGgufTensors, tinyVocabulary, writeTinyGguf } from '../helpers/gguf-models'
import { type MetaValue, TestRng, f32s, ggufBytes, ggufHeader, i32s, randomTensorData, str, strings, u32, writeSparse } from '../helpers/gguf-writer'
import { ggufLogits } from '../reference/gguf-forward'
import { LlamaCppBpe, LlamaCppSpm } from '../reference/llama-vocab'
import { PagedModel } from '../reference/paged'
import { ReferenceModel, argmax, emptyCache, forwardBatch, naiveGenerate } from '../reference/reference'

const { onnx } = onnxProto

/** Every type the importer reads, spread over the two layers' linears (plus embedding/output). */
const LLAMA: TinyGgufOptions = {
  architecture: 'llama',
  types: {
    embedding: 'Q8_0',
    output: 'Q6_K',
    layers: [
      ['F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0'],
      ['Q4_K', 'Q5_K', 'Q6_K', 'F32', 'Q4_0', 'Q4_K', 'Q4_1'],
    ],
  },
  pre: 'smollm',
  seed: 3,
  ropeTheta: 100000,
  ropeFactors: true,
}
/** qwen2: biases, a tied embedding, linear rope scaling, 4-bit types only (int4 maps them exactly). */
const QWEN2: TinyGgufOptions = {
  architecture: 'qwen2',
  types: {
    embedding: 'Q4_0',
    layers: [
      ['Q4_0', 'Q4_1', 'Q4_K', 'Q4_0', 'Q4_1', 'Q4_K', 'Q4_0'],
      ['Q4_K', 'Q4_0', 'Q4_1', 'Q4_K', 'Q4_0', 'Q4_1', 'Q4_K'],
    ],
  },
  seed: 5,
  linearRopeScaling: 2,
  residualScale: 8,
}

let root: string
const files = {} as Record<'llama' | 'qwen2', string>
const folders = {} as Record<'llama' | 'qwen2', Record<'fp32' | 'int4', string>>
const summaries = {} as Record<'llama' | 'qwen2', Record<'fp32' | 'int4', ImportSummary>>

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'ortex-gguf-'))
  for (const [key, options] of [['llama', LLAMA], ['qwen2', QWEN2]] as const) {
    files[key] = join(root, `${key}.gguf`)
    writeTinyGguf(files[key], options)
    folders[key] = { fp32: join(root, `${key}-fp32`), int4: join(root, `${key}-int4`) }
    summaries[key] = {
      fp32: await importGguf({ file: files[key], outDir: folders[key].fp32 }),
      int4: await importGguf({ file: files[key], outDir: folders[key].int4, weights: 'int4' }),
    }
  }
})

afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
})

const json = (dir: string, file: string) => JSON.parse(readFileSync(join(dir, file), 'utf8'))
const decodeModel = (dir: string) => onnx.ModelProto.decode(readFileSync(join(dir, 'model.onnx')))

async function expectModelLoadError(promise: Promise<unknown>, message: RegExp): Promise<void> {
  await expect(promise).rejects.toMatchObject({ name: 'OrtexError', code: 'MODEL_LOAD', message: expect.stringMatching(message) })
}

describe('the GGUF reader', () => {
  it('reads back what the writer wrote', () => {
    const file = readGguf(files.llama)
    expect(file.version).toBe(3)
    expect(file.metadata.get('general.architecture')).toBe('llama')
    expect(file.metadata.get('llama.embedding_length')).toBe(TINY.hidden)
    expect(file.metadata.get('tokenizer.ggml.tokens')).toEqual(tinyVocabulary().tokens)
    const q = file.tensors.find((t) => t.name === 'blk.0.attn_q.weight')!
    expect(q).toMatchObject({ dims: [TINY.hidden, TINY.heads * TINY.headSize], type: GgmlTypeId.F16, elements: 256 * 256, bytes: 256 * 256 * 2 })
    expect(q.offset % 32).toBe(0)
  })

  it('refuses a truncated file at any length with MODEL_LOAD, never another error', async () => {
    const bytes = readFileSync(files.qwen2)
    const cut = join(root, 'cut.gguf')
    const lengths = [0, 3, 4, 8, 20, 24, 100, 1000, 5000, 20_000, 40_000, bytes.length - 1]
    for (const length of lengths) {
      writeFileSync(cut, bytes.subarray(0, length))
      await expectModelLoadError(importGguf({ file: cut, outDir: join(root, 'cut') }), /cut\.gguf: (not a GGUF file|the file is truncated|the header's \w+ count \d+ is not plausible|.* runs? past the end of the file)/)
    }
    // Every length in the header region (metadata and tensor table) fails cleanly too.
    for (let length = 24; length < 16_000; length += 397) {
      writeFileSync(cut, bytes.subarray(0, length))
      expect(() => readGguf(cut), `length ${length}`).toThrow(expect.objectContaining({ code: 'MODEL_LOAD' }))
    }
  })

  it('refuses corrupt headers naming the problem', async () => {
    const bytes = readFileSync(files.qwen2)
    const bad = join(root, 'bad.gguf')
    const variant = (edit: (b: Buffer) => void, message: RegExp) => {
      const copy = Buffer.from(bytes)
      edit(copy)
      writeFileSync(bad, copy)
      expect(() => readGguf(bad)).toThrow(expect.objectContaining({ code: 'MODEL_LOAD', message: expect.stringMatching(message) }))
    }
    variant((b) => b.write('GGML', 0, 'latin1'), /not a GGUF file/)
    variant((b) => b.writeUInt32LE(1, 4), /GGUF version 1 is not supported/)
    variant((b) => b.writeUInt32LE(0x03000000, 4), /big-endian/)
    variant((b) => b.writeBigUInt64LE(1n << 40n, 8), /the header's tensor count 1099511627776 is not plausible: over the limit of 65536 tensors/)
    variant((b) => b.writeBigUInt64LE(1n << 40n, 24), /metadata entry 0 of \d+: a key of 1099511627776 bytes is over the limit of 65535/)
    // The first value's length (a string after the key "general.architecture" and its type).
    const firstValue = 24 + 8 + 'general.architecture'.length + 4
    variant((b) => b.writeBigUInt64LE(BigInt(b.length), firstValue), new RegExp(`metadata "general\\.architecture": a string of ${bytes.length} bytes runs past the end of the file`))
    // The first value's type (after the first key, "general.architecture") set to 99.
    variant((b) => b.writeUInt32LE(99, 24 + 8 + 'general.architecture'.length), /unknown value type 99/)
    await expectModelLoadError(importGguf({ file: join(root, 'missing.gguf'), outDir: join(root, 'x') }), /cannot open the file/)
  })
})

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..')
/** The child's peak resident memory, printed on exit (in KiB, as resourceUsage gives it). */
const PRINT_MAX_RSS = 'data:text/javascript,process.on("exit",()=>process.stderr.write(`maxrss ${process.resourceUsage().maxRSS}\\n`))'

/** `ortex import` in a child process: its status, stderr and peak resident memory. */
function importInChild(...args: string[]): { status: number | null; stderr: string; maxRssMiB: number } {
  const run = spawnSync(process.execPath, ['--import', PRINT_MAX_RSS, join(REPO, 'dist', 'cli.js'), 'import', ...args], { encoding: 'utf8', timeout: 60_000 })
  const rss = /maxrss (\d+)\n/.exec(run.stderr)
  return { status: run.status, stderr: run.stderr.replace(/maxrss \d+\n/, ''), maxRssMiB: rss ? Number(rss[1]) / 1024 : Infinity }
}

const escape = (s: string) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')

describe('hostile headers: every count and size is checked before anything is sized by it', () => {
  // Each of these cost gigabytes before the limits (block_count 0xFFFFFFFF: over 1 GiB in 3.5 s;
  // context_length 50,000,000: over 1 GiB in 18 s; 200M array items: 1.4 GiB, then "Invalid array
  // length"; context_length 2^31: "Invalid typed array length"). The command now refuses each
  // with one line naming the file, the field and the limit, in about the memory of Node itself.
  const tiny = (name: string, metadata: Array<[string, MetaValue]>) => {
    const path = join(root, name)
    writeFileSync(path, ggufBytes(tinyGgufMetadata({ ...LLAMA, metadata }), tinyGgufTensors(LLAMA)))
    return path
  }

  it('the command refuses them at once, in bounded memory', () => {
    const array = join(root, 'array-200m.gguf')
    writeSparse(array, ggufHeader([['general.junk', { kind: 'declared-array', item: 0, count: 200_000_000 }]], []).header, 256 * 1024 * 1024)
    const cases: Array<[string, RegExp]> = [
      [tiny('layers-4g.gguf', [['llama.block_count', u32(0xffffffff)]]), /llama\.block_count is 4294967295: over the limit of 512 layers/],
      [tiny('context-50m.gguf', [['llama.context_length', u32(50_000_000)]]), /llama\.context_length is 50000000: over the limit of 1048576 positions/],
      [tiny('context-2g.gguf', [['llama.context_length', u32(2 ** 31)]]), /llama\.context_length is 2147483648: over the limit of 1048576 positions/],
      [array, /metadata "general\.junk": an array of 200000000 items is over the limit of 2097152/],
    ]
    for (const [file, message] of cases) {
      const out = join(root, 'hostile-out')
      const run = importInChild(file, '--out', out)
      expect(run.status, run.stderr).toBe(1)
      expect(run.stderr).toMatch(new RegExp(`^ortex: MODEL_LOAD: ${escape(file)}: ${message.source}.*\n$`))
      expect(run.maxRssMiB, file).toBeLessThan(200) // Node and the CLI take about 60 MiB
      expect(existsSync(out)).toBe(false)
    }
  })

  it('the reader refuses counts, lengths and sizes past the file or the limits', () => {
    const header = (metadata: Array<[string, MetaValue]>, tensors: Parameters<typeof ggufHeader>[1] = []) => ggufHeader(metadata, tensors).header
    const refuses = (name: string, bytes: Uint8Array, fileBytes: number, message: RegExp) => {
      const path = join(root, name)
      writeSparse(path, bytes, fileBytes)
      expect(() => readGguf(path), name).toThrow(expect.objectContaining({ code: 'MODEL_LOAD', message: expect.stringMatching(message) }))
    }
    const MiB = 1024 * 1024
    const counts = Buffer.from(header([]))
    counts.writeBigUInt64LE(100_000n, 16) // metadata entries
    refuses('kv-count.gguf', counts, 64 * MiB, /the header's metadata count 100000 is not plausible: over the limit of 65536 metadata entries/)
    counts.writeBigUInt64LE(60_000n, 16)
    refuses('kv-fit.gguf', counts, MiB / 4, /the header's metadata count 60000 is not plausible: the \d+ bytes after the header cannot hold that many/)
    counts.writeBigUInt64LE(0n, 16)
    counts.writeBigUInt64LE(60_000n, 8) // tensors
    refuses('tensor-fit.gguf', counts, 1 * MiB, /the header's tensor count 60000 is not plausible: the \d+ bytes after the header cannot hold that many tensors/)
    const declared = (item: number, count: number): MetaValue => ({ kind: 'declared-array', item, count })
    refuses('array-fit.gguf', header([['a', declared(4, 1_000_000)]]), 1 * MiB, /metadata "a": an array of 1000000 items run past the end of the file/)
    refuses('array-type.gguf', header([['a', declared(13, 4)]]), 1 * MiB, /metadata "a": unknown array item type 13/)
    const arrays = Array.from({ length: 4 }, (_, i): [string, MetaValue] => [`a${i}`, { kind: 'zeros', count: GGUF_LIMITS.arrayItems }])
    refuses('items.gguf', header([...arrays, ['a4', declared(0, GGUF_LIMITS.arrayItems)]]), 16 * MiB, /metadata "a4": an array of 2097152 items takes the metadata's arrays past 8388608 items in all, the limit/)
    refuses('string.gguf', header([['s', { kind: 'declared-string', bytes: 300 * MiB }]]), 512 * MiB, /metadata "s": a string of 314572800 bytes would take the header past 268435456 bytes, the limit/)
    refuses('key.gguf', header([['k'.repeat(65_536), u32(1)]]), 1 * MiB, /metadata entry 0 of 1: a key of 65536 bytes is over the limit of 65535/)
    refuses('name.gguf', header([], [{ name: 'n'.repeat(64), dims: [4], type: 0, bytes: 16 }]), 1 * MiB, /tensor info 0 of 1: a tensor name of 64 bytes is over the limit of 63/)
    refuses('dims.gguf', header([], [{ name: 'x', dims: [2 ** 40, 2 ** 20], type: 0, bytes: 0 }]), 1 * MiB, /tensor "x" has the shape \[1099511627776,1048576\]/)
  })

  it('the importer refuses sizes past its limits before sizing anything by them', async () => {
    const cases: Array<[string, Array<[string, MetaValue]>, RegExp]> = [
      ['layers-0', [['llama.block_count', u32(0)]], /llama\.block_count is 0, fewer than 1 layers/],
      ['layers-more', [['llama.block_count', u32(40)]], /llama\.block_count is 40, but the file has \d+ tensors \(a layer has at least 6\)/],
      ['context-0', [['llama.context_length', u32(0)]], /llama\.context_length is 0, fewer than 1 positions/],
      ['heads', [['llama.attention.head_count', u32(1 << 20)]], /llama\.attention\.head_count is 1048576: over the limit of 1024 heads/],
      ['kv-heads', [['llama.attention.head_count_kv', u32(8)]], /llama\.attention\.head_count_kv is 8: over the limit of 4 heads \(the query heads\)/],
      ['key-length', [['llama.attention.key_length', u32(1 << 30)]], /llama\.attention\.key_length is 1073741824: over the limit of 1024 elements/],
    ]
    for (const [name, metadata, message] of cases) {
      await expectModelLoadError(importGguf({ file: tiny(`${name}.gguf`, metadata), outDir: join(root, name) }), message)
      expect(existsSync(join(root, name))).toBe(false)
    }
    // A vocabulary past the limit: the embedding's rows (a sparse file: only the header is written).
    const tensors = tinyGgufTensors(LLAMA).map((t) => ({ ...t, bytes: t.data.length }))
    const rows = MODEL_LIMITS.vocabSize + 32
    tensors[0] = { ...tensors[0]!, dims: [TINY.hidden, rows], bytes: (TINY.hidden / 32) * 34 * rows }
    const { header, dataBytes } = ggufHeader(tinyGgufMetadata(LLAMA), tensors)
    const path = join(root, 'vocab.gguf')
    writeSparse(path, header, Math.ceil(header.length / 32) * 32 + dataBytes)
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'vocab') }), /the vocabulary \(token_embd\.weight rows\) is 2097184: over the limit of 2097152 tokens/)
  })

  it('a long context is written in chunks of positions: the rotary tables are right across them', async () => {
    const context = 10_000 // over two chunks of 4096 positions
    const file = tiny('context-10k.gguf', [['llama.context_length', u32(context)]])
    const dir = join(root, 'context-10k')
    await importGguf({ file, outDir: dir, weights: 'int4' })
    const graph = decodeModel(dir).graph!
    const cos = graph.initializer!.find((t) => t.name === 'cos_cache')!
    expect(cos.dims!.map(Number)).toEqual([context, TINY.headSize / 2])
    const location = Object.fromEntries(cos.externalData!.map((e) => [e.key, e.value]))
    const data = readFileSync(join(dir, 'model.onnx.data'))
    const values = new Float32Array(data.buffer.slice(data.byteOffset + Number(location.offset), data.byteOffset + Number(location.offset) + Number(location.length)))
    const half = TINY.headSize / 2
    for (const p of [0, 1, 4095, 4096, 4097, 8191, 8192, context - 1]) {
      for (const i of [0, 5, half - 1]) {
        // rope_freqs.weight (LLAMA has it) divides each frequency; compare with tolerance for it
        expect(values[p * half + i], `position ${p}, frequency ${i}`).toBeCloseTo(Math.cos(p * inverseFrequency(file, i)), 4)
      }
    }
  })
})

/** Frequency i of the tiny llama file's rotary: theta^(-2i/D) / rope_freqs[i]. */
function inverseFrequency(file: string, i: number): number {
  const gguf = readGguf(file)
  const theta = gguf.metadata.get('llama.rope.freq_base') as number
  const factors = gguf.tensors.find((t) => t.name === 'rope_freqs.weight')!
  const bytes = readFileSync(file).subarray(factors.offset, factors.offset + factors.bytes)
  const factor = new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length))[i]!
  return Math.pow(Math.fround(theta), (-2 * i) / TINY.headSize) / factor
}

describe('the data section: tensors in table order, without overlaps or gaps, as llama.cpp requires', () => {
  const tensors = tinyGgufTensors(LLAMA)
  const natural = ggufHeader(tinyGgufMetadata(LLAMA), tensors.map((t) => ({ ...t, bytes: t.data.length }))).offsets
  const write = (name: string, offsets: number[], metadata = tinyGgufMetadata(LLAMA), alignment = 32) => {
    const path = join(root, name)
    writeFileSync(path, ggufBytes(metadata, tensors, alignment, offsets))
    return path
  }
  const names = tensors.map((t) => t.name.replace(/\./g, '\\.'))

  it('refuses overlapping, misaligned and scattered tensors, by the importer and the command', async () => {
    const moved = (i: number, to: number) => natural.map((o, j) => (j === i ? to : o))
    const cases: Array<[string, number[], RegExp]> = [
      ['overlap', moved(1, natural[0]!), new RegExp(`tensor "${names[1]}" starts at data offset 0, inside tensor "${names[0]}" \\(which ends at \\d+\\): tensors may not overlap`)],
      ['overlap-inside', moved(2, natural[1]! + 32), new RegExp(`tensor "${names[2]}" starts at data offset \\d+, inside tensor "${names[1]}"`)],
      ['misaligned', moved(3, natural[3]! + 4), new RegExp(`tensor "${names[3]}" starts at data offset \\d+, not on a 32-byte boundary`)],
      ['gap', moved(3, natural[3]! + 64), new RegExp(`tensor "${names[3]}" starts at data offset \\d+, but tensor "${names[2]}" ends at \\d+, padded to \\d+: GGUF tensors follow each other in table order without gaps`)],
      ['swapped', natural.map((o, j) => (j === 1 ? natural[2]! : j === 2 ? natural[1]! : o)), new RegExp(`tensor "${names[1]}" starts at data offset \\d+, but tensor "${names[0]}" ends`)],
    ]
    for (const [name, offsets, message] of cases) {
      const file = write(`layout-${name}.gguf`, offsets)
      await expectModelLoadError(importGguf({ file, outDir: join(root, `layout-${name}`) }), message)
      expect(existsSync(join(root, `layout-${name}`))).toBe(false)
    }
    const run = importInChild(write('layout-cli.gguf', moved(1, natural[0]!)), '--out', join(root, 'layout-cli'))
    expect(run.status).toBe(1)
    expect(run.stderr).toMatch(/^ortex: MODEL_LOAD: .*layout-cli\.gguf: tensor ".*" starts at data offset 0, inside tensor "token_embd\.weight" .*: tensors may not overlap\n$/)
    expect(existsSync(join(root, 'layout-cli'))).toBe(false)
  })

  it('refuses an alignment that is not a power of two', () => {
    const metadata: Array<[string, MetaValue]> = [...tinyGgufMetadata(LLAMA), ['general.alignment', u32(48)]]
    const { offsets } = ggufHeader(metadata, tensors.map((t) => ({ ...t, bytes: t.data.length })), 48)
    expect(() => readGguf(write('align-48.gguf', offsets, metadata, 48))).toThrow(/general\.alignment must be a power of two from 8 to 2\^30, got 48/)
    const aligned64: Array<[string, MetaValue]> = [...tinyGgufMetadata(LLAMA), ['general.alignment', u32(64)]]
    const at64 = ggufHeader(aligned64, tensors.map((t) => ({ ...t, bytes: t.data.length })), 64).offsets
    expect(readGguf(write('align-64.gguf', at64, aligned64, 64)).alignment).toBe(64) // another power of two reads
  })
})

describe('vocabularies the tokenizer could not load are refused before anything is written', () => {
  const vocab = tinyVocabulary()
  const write = (name: string, metadata: Array<[string, MetaValue]>) => {
    const path = join(root, `${name}.gguf`)
    writeFileSync(path, ggufBytes(tinyGgufMetadata({ ...LLAMA, metadata }), tinyGgufTensors(LLAMA)))
    return path
  }
  const duplicated = [...vocab.tokens]
  duplicated[100] = duplicated[1]! // "<s>" twice; token 100's own text is gone, and a merge names it
  const merged = vocab.tokens[100]! + vocab.tokens[101]!
  const cases: Array<[string, Array<[string, MetaValue]>, RegExp]> = [
    ['merge-missing', [['tokenizer.ggml.merges', strings([...vocab.merges, 'zzq qqz'])]], /tokenizer\.ggml\.merges\[\d+\] "zzq qqz" names "zzq", which is not in the vocabulary/],
    [
      'merge-result',
      [['tokenizer.ggml.merges', strings([...vocab.merges, `${vocab.tokens[100]} ${vocab.tokens[101]}`])]],
      new RegExp(`tokenizer\\.ggml\\.merges\\[\\d+\\] ".*" names ${escape(JSON.stringify(merged))}, which is not in the vocabulary`),
    ],
    ['duplicate', [['tokenizer.ggml.tokens', strings(duplicated)]], /tokenizer\.ggml\.tokens holds "<s>" twice, as tokens 1 and 100/],
  ]

  it('by importGguf: a rejected promise naming the problem, and no folder', async () => {
    expect(vocab.tokens.includes(merged)).toBe(false) // the merged token really is missing
    for (const [name, metadata, message] of cases) {
      const outDir = join(root, `vocab-${name}`)
      await expectModelLoadError(importGguf({ file: write(name, metadata), outDir }), message)
      expect(existsSync(outDir)).toBe(false)
    }
  })

  it('by the command: status 1 and one line naming the problem, and no folder', () => {
    for (const [name, metadata, message] of cases) {
      const outDir = join(root, `vocab-cli-${name}`)
      const run = importInChild(write(`cli-${name}`, metadata), '--out', outDir)
      expect(run.status, name).toBe(1)
      expect(run.stderr).toMatch(new RegExp(`^ortex: MODEL_LOAD: .*cli-${name}\\.gguf: ${message.source}.*\n$`))
      expect(existsSync(outDir)).toBe(false)
    }
  })

  it('a duplicated SentencePiece piece too', async () => {
    const spm = tinySentencePieceVocabulary()
    const tokens = [...spm.tokens]
    tokens[300] = tokens[299]!
    const metadata = tinyGgufMetadata({
      ...LLAMA,
      metadata: [
        ['tokenizer.ggml.model', str('llama')],
        ['tokenizer.ggml.tokens', strings(tokens)],
        ['tokenizer.ggml.token_type', i32s(spm.types)],
        ['tokenizer.ggml.scores', f32s(spm.scores)],
      ],
    }).filter(([key]) => key !== 'tokenizer.ggml.merges' && key !== 'tokenizer.ggml.pre')
    const file = join(root, 'spm-duplicate.gguf')
    writeFileSync(file, ggufBytes(metadata, tinyGgufTensors(LLAMA)))
    await expectModelLoadError(importGguf({ file, outDir: join(root, 'spm-duplicate') }), /tokenizer\.ggml\.tokens holds ".*" twice, as tokens 299 and 300/)
    // Pieces too long to derive merges from in bounded time are refused by name.
    const long = [...spm.tokens]
    long[300] = 'x'.repeat(Math.ceil(Math.sqrt(SENTENCE_PIECE_LIMITS.work)) + 1)
    const longMetadata = metadata.map(([key, value]): [string, MetaValue] => [key, key === 'tokenizer.ggml.tokens' ? strings(long) : value])
    writeFileSync(file, ggufBytes(longMetadata, tinyGgufTensors(LLAMA)))
    await expectModelLoadError(importGguf({ file, outDir: join(root, 'spm-long') }), /the SentencePiece pieces are too long to derive merges from: their squared lengths sum to \d+, over the limit of 268435456/)
  })
})

describe('a failed import leaves the folder as it was', () => {
  const failingProgress = () => {
    let calls = 0
    return () => {
      if (++calls === 3) throw new Error('disk full (simulated)')
    }
  }
  const leftovers = (dir: string) => readdirSync(dir).filter((f) => f.startsWith('.ortex-import-'))

  it('no folder when it made the folder', async () => {
    const outDir = join(root, 'failed-new', 'model')
    await expect(importGguf({ file: files.qwen2, outDir, onProgress: failingProgress() })).rejects.toThrow(/disk full/)
    expect(existsSync(join(root, 'failed-new'))).toBe(false)
  })

  it("a previous import's files, untouched and loadable, when the folder was there", async () => {
    const outDir = join(root, 'failed-over')
    await importGguf({ file: files.qwen2, outDir, weights: 'int4' })
    const before = Object.fromEntries(readdirSync(outDir).map((f) => [f, readFileSync(join(outDir, f)).length]))
    await expect(importGguf({ file: files.llama, outDir, onProgress: failingProgress() })).rejects.toThrow(/disk full/)
    expect(Object.fromEntries(readdirSync(outDir).map((f) => [f, readFileSync(join(outDir, f)).length]))).toEqual(before)
    expect(leftovers(outDir)).toEqual([])
    const engine = await Engine.load(outDir, { intraOpThreads: 1 })
    await engine.close()
  })

  it("a new import replaces the old one's files, a stale chat template included", async () => {
    const outDir = join(root, 'replaced')
    await importGguf({ file: files.qwen2, outDir })
    expect(existsSync(join(outDir, 'chat_template.jinja'))).toBe(true)
    const noTemplate = join(root, 'no-template.gguf')
    writeFileSync(noTemplate, ggufBytes(tinyGgufMetadata(LLAMA).filter(([k]) => k !== 'tokenizer.chat_template'), tinyGgufTensors(LLAMA)))
    const summary = await importGguf({ file: noTemplate, outDir })
    expect(readdirSync(outDir).sort()).toEqual(summary.files.map((f) => f.name).sort())
    expect(existsSync(join(outDir, 'chat_template.jinja'))).toBe(false)
    expect(json(outDir, 'genai_config.json').model.type).toBe('llama')
  })
})

describe('what the importer refuses, by name', () => {
  const write = (name: string, options: TinyGgufOptions) => {
    const path = join(root, name)
    writeFileSync(path, ggufBytes(tinyGgufMetadata(options), tinyGgufTensors(options)))
    return path
  }

  it('other architectures, experts, partial rotary, YaRN', async () => {
    const cases: Array<[string, TinyGgufOptions['metadata'], RegExp]> = [
      ['qwen35', [['general.architecture', str('qwen35')]], new RegExp(`the architecture "qwen35" is not supported: the importer lacks Qwen3\\.5's linear-attention \\(Gated DeltaNet\\) layers, .* \\(supported: ${ARCHITECTURES.join(', ')}\\)`)],
      ['jamba', [['general.architecture', str('jamba')]], new RegExp(`the architecture "jamba" is not supported \\(supported: ${ARCHITECTURES.join(', ')}\\)`)],
      ['moe', [['llama.expert_count', u32(8)]], /llama\.expert_count is 8: mixture-of-experts llama models are not supported/],
      ['partial', [['llama.rope.dimension_count', u32(32)]], /partial rotary/],
      ['yarn', [['llama.rope.scaling.type', str('yarn')]], /rope\.scaling\.type "yarn" is not supported/],
    ]
    for (const [name, metadata, message] of cases) {
      await expectModelLoadError(importGguf({ file: write(`${name}.gguf`, { ...LLAMA, metadata }), outDir: join(root, name) }), message)
    }
  })

  it('unknown or missing pre-tokenizers and tokenizer models', async () => {
    await expectModelLoadError(
      importGguf({ file: write('pre.gguf', { ...LLAMA, pre: 'jais-2' }), outDir: join(root, 'pre') }),
      /the pre-tokenizer "jais-2" is not supported \(supported: gpt-2, smollm/,
    )
    await expectModelLoadError(
      importGguf({ file: write('model.gguf', { ...LLAMA, metadata: [['tokenizer.ggml.model', str('bert')]] }), outDir: join(root, 'model') }),
      /the tokenizer model "bert" is not supported/,
    )
    const noPre = tinyGgufMetadata(LLAMA).filter(([k]) => k !== 'tokenizer.ggml.pre')
    const path = join(root, 'nopre.gguf')
    writeFileSync(path, ggufBytes(noPre, tinyGgufTensors(LLAMA)))
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'nopre') }), /tokenizer\.ggml\.pre" is missing: the pre-tokenizer is unknown, and it is not guessed/)
  })

  it('tensor types it does not read, unknown and missing tensors, wrong shapes', async () => {
    const tensors = tinyGgufTensors(LLAMA)
    const q2k = tensors.map((t) => (t.name === 'blk.1.ffn_up.weight' ? { ...t, type: 10, data: new Uint8Array((t.data.length / 144) * 84) } : t))
    const path = join(root, 'types.gguf')
    writeFileSync(path, ggufBytes(tinyGgufMetadata(LLAMA), q2k))
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'types') }), /blk\.1\.ffn_up\.weight is Q2_K, a tensor type the importer does not read/)
    const extra = [...tensors, { name: 'blk.0.attn_sinks', dims: [4], type: 0, data: new Uint8Array(16) }]
    writeFileSync(path, ggufBytes(tinyGgufMetadata(LLAMA), extra))
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'types') }), /the tensor "blk\.0\.attn_sinks" is not part of a llama model/)
    writeFileSync(path, ggufBytes(tinyGgufMetadata(LLAMA), tensors.filter((t) => t.name !== 'blk.1.ffn_norm.weight')))
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'types') }), /the tensor "blk\.1\.ffn_norm\.weight" is missing/)
    const wrongHeads = tinyGgufMetadata({ ...LLAMA, metadata: [['llama.attention.head_count_kv', u32(4)]] })
    writeFileSync(path, ggufBytes(wrongHeads, tensors))
    await expectModelLoadError(importGguf({ file: path, outDir: join(root, 'types') }), /blk\.0\.attn_k\.weight has the shape \[256,128\], expected \[256,256\]/)
  })
})

describe('int4 packing (MatMulNBits blocks of 32)', () => {
  const N = 24
  const K = 512
  const rows = (type: GgmlTypeName, seed: number) => {
    const data = randomTensorData(GgmlTypeId[type], N * K, 0.05, new TestRng(seed))
    const rowBytes = data.length / N
    return { data, row: (n: number) => data.subarray(n * rowBytes, (n + 1) * rowBytes) }
  }

  for (const type of ['Q4_0', 'Q4_1', 'Q4_K'] as const) {
    it(`${type} blocks are kept exactly`, () => {
      const { data, row } = rows(type, 11)
      const w = packInt4(GgmlTypeId[type], N, K, row)
      expect(w.mapping).toBe('exact')
      expect(w.mins !== undefined).toBe(type !== 'Q4_0')
      const expected = new Float32Array(N * K)
      dequantize(GgmlTypeId[type], data, N * K, expected)
      let mismatches = 0
      for (let n = 0; n < N; n++) for (let k = 0; k < K; k++) if (int4Value(w, N, K, n, k) !== expected[n * K + k]) mismatches++
      expect(mismatches).toBe(0)
    })
  }

  for (const type of ['F32', 'F16', 'BF16', 'Q5_0', 'Q5_1', 'Q8_0', 'Q5_K', 'Q6_K'] as const) {
    it(`${type} is requantized within half a step per block`, () => {
      const { data, row } = rows(type, 12)
      const w = packInt4(GgmlTypeId[type], N, K, row)
      expect(w.mapping).toBe('requantized')
      expect(w.mins).toBeUndefined()
      const expected = new Float32Array(N * K)
      dequantize(GgmlTypeId[type], data, N * K, expected)
      for (let n = 0; n < N; n++) {
        for (let k = 0; k < K; k++) {
          const scale = w.scales[n * (K / 32) + Math.floor(k / 32)]!
          expect(Math.abs(int4Value(w, N, K, n, k) - expected[n * K + k]!)).toBeLessThanOrEqual(scale * 0.5 + 1e-6)
        }
      }
    })
  }

  it("ONNX Runtime's MatMulNBits kernel reads the packing as int4Value does", async () => {
    for (const type of ['Q4_0', 'Q4_1', 'Q6_K'] as const) {
      const { row } = rows(type, 13)
      const w = packInt4(GgmlTypeId[type], N, K, row)
      const dir = mkdtempSync(join(root, 'nbits-'))
      writeFileSync(join(dir, 'model.onnx'), matMulNBitsModel(w, N, K))
      const model = await (await import('onnxruntime-node')).default.InferenceSession.create(join(dir, 'model.onnx'))
      const ort = (await import('onnxruntime-node')).default
      const identity = new Float32Array(K * K)
      for (let k = 0; k < K; k++) identity[k * K + k] = 1
      const out = await model.run({ a: new ort.Tensor('float32', identity, [K, K]) })
      const y = out.y!.data as Float32Array // [K, N] = W^T
      let worst = 0
      for (let k = 0; k < K; k++) for (let n = 0; n < N; n++) worst = Math.max(worst, Math.abs(y[k * N + n]! - int4Value(w, N, K, n, k)))
      expect(worst).toBeLessThan(1e-6)
      await model.release()
    }
  })

  for (const [type, blockSize, minimums] of [['Q8_0', 32, false], ['Q5_0', 32, false], ['Q5_1', 32, true], ['Q5_K', 32, true], ['Q6_K', 16, false]] as const) {
    it(`${type} blocks are kept exactly as 8-bit blocks of ${blockSize}, and the kernel reads them so`, async () => {
      const { data, row } = rows(type, 14)
      const w = packInt8(GgmlTypeId[type], N, K, row)
      expect(w.blockSize).toBe(blockSize)
      expect(w.mins !== undefined).toBe(minimums)
      const expected = new Float32Array(N * K)
      dequantize(GgmlTypeId[type], data, N * K, expected)
      let mismatches = 0
      for (let n = 0; n < N; n++) for (let k = 0; k < K; k++) if (int8Value(w, N, K, n, k) !== expected[n * K + k]) mismatches++
      expect(mismatches).toBe(0)
      const dir = mkdtempSync(join(root, 'nbits8-'))
      writeFileSync(join(dir, 'model.onnx'), matMulNBitsModel(w, N, K))
      const ort = (await import('onnxruntime-node')).default
      const model = await ort.InferenceSession.create(join(dir, 'model.onnx'))
      const identity = new Float32Array(K * K)
      for (let k = 0; k < K; k++) identity[k * K + k] = 1
      const y = (await model.run({ a: new ort.Tensor('float32', identity, [K, K]) })).y!.data as Float32Array
      let worst = 0
      for (let k = 0; k < K; k++) for (let n = 0; n < N; n++) worst = Math.max(worst, Math.abs(y[k * N + n]! - int8Value(w, N, K, n, k)))
      expect(worst).toBeLessThan(1e-6)
      await model.release()
    })
  }

  it('other types are not 8-bit blocks', () => {
    expect(() => packInt8(GgmlTypeId.Q4_0, N, K, rows('Q4_0', 15).row)).toThrow(/8-bit blocks are not made from Q4_0/)
  })
})

/** A one-node model: y = MatMulNBits(a, B) (+ block sums of a times the minimums), float32
 *  compute; 8-bit blocks (no zero points) of `w.blockSize` (default 32) where `w` has no qzeros. */
function matMulNBitsModel(w: { qweight: Uint8Array; scales: Float32Array; qzeros?: Uint8Array; mins?: Float32Array; blockSize?: number }, N: number, K: number): Uint8Array {
  const blockSize = w.blockSize ?? 32
  const blocks = K / blockSize
  const bits = w.qzeros ? 4 : 8
  const init = (name: string, dataType: number, dims: number[], bytes: Uint8Array) => ({ name, dataType, dims, rawData: bytes })
  const f32Bytes = (a: Float32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)
  const attr = (name: string, i: number) => ({ name, type: onnx.AttributeProto.AttributeType.INT, i })
  const nodes: object[] = [
    {
      opType: 'MatMulNBits',
      domain: 'com.microsoft',
      input: w.qzeros ? ['a', 'B', 'scales', 'zeros'] : ['a', 'B', 'scales'],
      output: [w.mins ? 'product' : 'y'],
      attribute: [attr('K', K), attr('N', N), attr('bits', bits), attr('block_size', blockSize), attr('accuracy_level', 0)],
    },
  ]
  const initializers = [init('B', 2, [N, blocks, (blockSize * bits) / 8], w.qweight), init('scales', 1, [N, blocks], f32Bytes(w.scales))]
  if (w.qzeros) initializers.push(init('zeros', 2, [N, Math.ceil(blocks / 2)], w.qzeros))
  if (w.mins) {
    initializers.push(init('mins', 1, [blocks, N], f32Bytes(w.mins)), init('shape', 7, [3], new Uint8Array(new BigInt64Array([0n, BigInt(blocks), 32n]).buffer)))
    initializers.push(init('axes', 7, [1], new Uint8Array(new BigInt64Array([-1n]).buffer)))
    nodes.push(
      { opType: 'Reshape', input: ['a', 'shape'], output: ['blocks'] },
      { opType: 'ReduceSum', input: ['blocks', 'axes'], output: ['sums'], attribute: [attr('keepdims', 0)] },
      { opType: 'MatMul', input: ['sums', 'mins'], output: ['offsets'] },
      { opType: 'Add', input: ['product', 'offsets'], output: ['y'] },
    )
  }
  const info = (name: string, dims: number[]) => ({ name, type: { tensorType: { elemType: 1, shape: { dim: dims.map((d) => ({ dimValue: d })) } } } })
  return onnx.ModelProto.encode(
    onnx.ModelProto.create({
      irVersion: 10,
      opsetImport: [{ domain: '', version: 21 }, { domain: 'com.microsoft', version: 1 }],
      graph: { name: 'nbits', node: nodes, initializer: initializers, input: [info('a', [K, K])], output: [info('y', [K, N])] },
    }),
  ).finish()
}

describe('imported folders', () => {
  it('hold the onnxruntime-genai files, the chat template and a builder-form graph', () => {
    for (const arch of ['llama', 'qwen2'] as const) {
      for (const weights of ['fp32', 'int4'] as const) {
        const dir = folders[arch][weights]
        const s = summaries[arch][weights]
        expect(s.files.map((f) => f.name).sort()).toEqual(
          ['chat_template.jinja', 'genai_config.json', 'model.onnx', 'model.onnx.data', 'special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json'].sort(),
        )
        const config = json(dir, 'genai_config.json')
        expect(config.model).toMatchObject({ type: arch, vocab_size: 384, context_length: TINY.context, bos_token_id: 1, eos_token_id: 2, pad_token_id: 0 })
        expect(config.model.decoder).toMatchObject({ head_size: 64, hidden_size: 256, num_attention_heads: 4, num_key_value_heads: 2, num_hidden_layers: 2 })
        expect(config.model.decoder.inputs.position_ids).toBeUndefined()
        expect(config.search.past_present_share_buffer).toBe(true)
        expect(readFileSync(join(dir, 'chat_template.jinja'), 'utf8')).toContain("<|im_start|>{{ m['role'] }}")
        expect(json(dir, 'tokenizer_config.json')).toMatchObject({ bos_token: '<s>', eos_token: '</s>', add_bos_token: false })
        const graph = decodeModel(dir).graph!
        const ops = graph.node!.map((n) => n.opType)
        expect(ops.filter((o) => o === 'GroupQueryAttention').length).toBe(TINY.layers)
        expect(graph.input!.map((i) => i.name)).not.toContain('position_ids')
        const meta = Object.fromEntries(decodeModel(dir).metadataProps!.map((p) => [p.key, p.value]))
        expect(meta).toMatchObject({ 'ortex.attention': 'gqa', 'ortex.source': 'gguf', 'ortex.architecture': arch, 'ortex.weights': weights })
        expect(ops.filter((o) => o === 'MatMulNBits').length).toBe(weights === 'int4' ? 7 * TINY.layers + 1 : 0)
      }
    }
    // qwen2: q/k/v biases, a tied lm_head (fp32: the embedding transposed in the graph).
    const qwen = decodeModel(folders.qwen2.fp32).graph!
    expect(qwen.node!.filter((n) => n.name!.endsWith('/BiasAdd')).length).toBe(3 * TINY.layers)
    expect(qwen.node!.find((n) => n.name === '/lm_head/Transpose')).toBeDefined()
    expect(summaries.qwen2.fp32.tiedEmbeddings).toBe(true)
    expect(summaries.llama.fp32.tiedEmbeddings).toBe(false)
  })

  it('say what they kept exactly, requantized and dequantized', () => {
    expect(summaries.llama.fp32.tensors.exact).toEqual({})
    // 4-bit blocks as they are, the 5-, 6- and 8-bit ones as 8-bit blocks; float weights requantized.
    expect(summaries.llama.int4.tensors.exact).toEqual({ Q4_0: 2, Q4_1: 2, Q4_K: 2, Q5_0: 1, Q5_1: 1, Q8_0: 1, Q5_K: 1, Q6_K: 2 })
    expect(summaries.llama.int4.tensors.requantized).toEqual({ F16: 1, BF16: 1, F32: 1 })
    expect(summaries.qwen2.int4.tensors.exact).toEqual({ Q4_0: 6, Q4_1: 4, Q4_K: 5 }) // the tied lm_head is the Q4_0 embedding
    expect(summaries.qwen2.int4.tensors.requantized).toEqual({})
    const parameters = (TINY.hidden * 384 * 2 + TINY.layers * (2 * TINY.hidden + 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512) + TINY.hidden)
    expect(summaries.llama.fp32.parameters).toBe(parameters)
    expect(summaries.qwen2.fp32.parameters).toBe(parameters - TINY.hidden * 384 + TINY.layers * (256 + 128 + 128))
  })

  const PROMPT = [5, 300, 17, 42, 99, 123, 7, 250, 64, 381]

  async function folderLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
    const model = await ReferenceModel.load(dir)
    try {
      const [row] = await forwardBatch(model, [{ cache: emptyCache(model), tokens }])
      return row!.logits
    } finally {
      await model.release()
    }
  }

  /** The largest difference, the largest logit, and the RMS of the differences over the RMS of the logits. */
  function worstError(got: Float32Array[], want: Float64Array[]): { worst: number; scale: number; relativeRms: number } {
    let worst = 0
    let scale = 0
    let diff2 = 0
    let want2 = 0
    want.forEach((w, s) =>
      w.forEach((v, i) => {
        const d = got[s]![i]! - v
        worst = Math.max(worst, Math.abs(d))
        scale = Math.max(scale, Math.abs(v))
        diff2 += d * d
        want2 += v * v
      }),
    )
    return { worst, scale, relativeRms: Math.sqrt(diff2 / want2) }
  }

  for (const arch of ['llama', 'qwen2'] as const) {
    it(`${arch} fp32: the graph computes what llama.cpp computes from the GGUF tensors`, async () => {
      const want = ggufLogits(files[arch], PROMPT)
      const got = await folderLogits(folders[arch].fp32, PROMPT)
      const { worst, scale } = worstError(got, want)
      expect(scale).toBeGreaterThan(1) // logits that say something
      expect(worst).toBeLessThan(2e-4 * scale)
    })

    it(`${arch} int4: close to the float32 logits`, async () => {
      const fp32 = await folderLogits(folders[arch].fp32, PROMPT)
      const int4 = await folderLogits(folders[arch].int4, PROMPT)
      const { relativeRms } = worstError(int4, fp32.map((l) => Float64Array.from(l)))
      // qwen2 is all exactly-mapped 4-bit blocks: only MatMulNBits' int8 activations differ (2.4%
      // here). llama requantizes eight types, each to within half a 4-bit step (13.7% here); a
      // wrong packing or layout gives errors as large as the logits themselves.
      expect(relativeRms).toBeLessThan(arch === 'qwen2' ? 0.05 : 0.25)
    })
  }

  it('int4 with accuracy level 0 (float32 activations): exactly kept blocks give the float32 import\'s logits', async () => {
    // qwen2's linears are all exactly kept 4-bit blocks, so with float32 KV on both sides only the
    // activations' int8 rounding (level 4, the default) separates its int4 logits from its fp32
    // ones; at level 0 what is left is the order of float32 sums.
    const dirs = { level0: join(root, 'qwen2-int4-level0'), level4: join(root, 'qwen2-int4-level4') }
    const level0 = await importGguf({ file: files.qwen2, outDir: dirs.level0, weights: 'int4', kv: 'fp32', accuracyLevel: 0 })
    const level4 = await importGguf({ file: files.qwen2, outDir: dirs.level4, weights: 'int4', kv: 'fp32' })
    expect([level0.accuracyLevel, level4.accuracyLevel, summaries.qwen2.fp32.accuracyLevel]).toEqual([0, 4, null])
    const levels = (d: string) => decodeModel(d).graph!.node!.filter((n) => n.opType === 'MatMulNBits').map((n) => Number(n.attribute!.find((a) => a.name === 'accuracy_level')!.i))
    expect(new Set(levels(dirs.level0))).toEqual(new Set([0]))
    expect(new Set(levels(dirs.level4))).toEqual(new Set([4]))
    const fp32 = (await folderLogits(folders.qwen2.fp32, PROMPT)).map((l) => Float64Array.from(l))
    const error0 = worstError(await folderLogits(dirs.level0, PROMPT), fp32)
    const error4 = worstError(await folderLogits(dirs.level4, PROMPT), fp32)
    expect(error0.relativeRms).toBeLessThan(1e-5) // 2e-6 here
    expect(error4.relativeRms).toBeGreaterThan(1e-3) // 2% here: the check can tell the two apart
    await expect(importGguf({ file: files.qwen2, outDir: join(root, 'bad-level'), weights: 'int4', accuracyLevel: 2 as never })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    await expect(importGguf({ file: files.qwen2, outDir: join(root, 'bad-level'), accuracyLevel: 4 })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringMatching(/int4 weights only/) })
  })

  for (const arch of ['llama', 'qwen2'] as const) {
    for (const weights of ['fp32', 'int4'] as const) {
      it(`${arch} ${weights}: the engine's greedy tokens equal the plain onnxruntime-node loop, alone and batched`, async () => {
        const dir = folders[arch][weights]
        const reference = await ReferenceModel.load(dir)
        const prompts = [PROMPT, [3, 4, 5], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [383]]
        const expected: number[][] = []
        for (const p of prompts) expected.push(await naiveGenerate(reference, p, 12, { ignoreEos: true }))
        await reference.release()
        const engine = await Engine.load(dir, { intraOpThreads: 1 })
        try {
          const turns = prompts.map((p) => engine.generate(p, { maxGeneratedTokens: 12, ignoreEos: true }))
          const got = await Promise.all(turns.map(async (t) => Array.from((await t.done).tokens)))
          expect(got).toEqual(expected)
          expect(new Set(expected.flat()).size).toBeGreaterThan(4) // not a degenerate model
        } finally {
          await engine.close()
        }
      })
    }
  }

  /** Every position's logits of `tokens` from a paged folder: two runs (the second with past), blocks out of order. */
  async function pagedFolderLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
    const paged = await PagedModel.load(dir)
    try {
      const pool = paged.pool(8)
      const blocks = [5, 2, 7, 0]
      const head = tokens.slice(0, 6)
      const tail = tokens.slice(6)
      const first = await paged.run(pool, [{ blocks, past: 0, tokens: head }], head.map((_, i) => i))
      return [...first, ...(await paged.run(pool, [{ blocks, past: head.length, tokens: tail }], tail.map((_, i) => i)))]
    } finally {
      await paged.release()
    }
  }

  describe('the GPU forms: --dtype fp16 and --attention paged', () => {
    const dir = (name: string) => join(root, `gpu-${name}`)
    const toF64 = (logits: Float32Array[]) => logits.map((l) => Float64Array.from(l))

    // qwen2 fp32: biases and a tied lm_head; llama int4 (float32 activations, accuracy level 0, so
    // that int8 rounding does not amplify float differences): MatMulNBits over [num_tokens, K]
    // activations with block sums for the Q4_1/Q4_K minimums, and float32 or float16 KV (casts
    // around the scatter and the gather).
    const CASES = [
      { arch: 'qwen2', weights: 'fp32', kv: 'fp32', within: 1e-5 }, // 6e-7 here
      { arch: 'llama', weights: 'int4', kv: 'fp32', within: 1e-5 },
      // GroupQueryAttention rounds q and its output to float16 too; the reference kernel only the cache.
      { arch: 'llama', weights: 'int4', kv: 'fp16', within: 2e-3 }, // 5e-4 here
    ] as const
    for (const { arch, weights, kv, within } of CASES) {
      it(`${arch} ${weights} ${kv} KV: the paged reference import gives the gqa import's logits`, async () => {
        const options = { file: files[arch], weights, kv, ...(weights === 'int4' ? { accuracyLevel: 0 as const } : {}) }
        const name = `${arch}-${weights}-${kv}`
        await importGguf({ ...options, outDir: dir(`${name}-gqa`) })
        const summary = await importGguf({ ...options, outDir: dir(`${name}-paged`), attention: 'paged', pagedKernel: 'reference', blockSize: 4 })
        expect(summary.paged).toEqual({ kernel: 'reference', blockSize: 4 })
        const got = await pagedFolderLogits(dir(`${name}-paged`), PROMPT)
        const want = await folderLogits(dir(`${name}-gqa`), PROMPT)
        expect(got.map((l) => argmax(l))).toEqual(want.map((l) => argmax(l)))
        expect(worstError(got, toF64(want)).relativeRms).toBeLessThan(within)
      })
    }

    it('float16 imports stay close to the float32 ones (fp32 and int4 weights; MatMulNBits scales in float16)', async () => {
      for (const weights of ['fp32', 'int4'] as const) {
        // int4 at accuracy level 0 on both sides, as above.
        const level = weights === 'int4' ? { accuracyLevel: 0 as const } : {}
        const summary = await importGguf({ file: files.qwen2, outDir: dir(`qwen2-${weights}-fp16`), weights, dtype: 'fp16', ...level })
        expect([summary.dtype, summary.kv]).toEqual(['fp16', 'fp16'])
        const graph = decodeModel(dir(`qwen2-${weights}-fp16`)).graph!
        const types = new Set(graph.initializer!.filter((t) => t.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL).map((t) => t.dataType))
        expect(types).toEqual(weights === 'fp32' ? new Set([10]) : new Set([10, 2])) // float16 (and uint8 blocks)
        expect(graph.output!.find((o) => o.name === 'logits')!.type!.tensorType!.elemType).toBe(10)
        await importGguf({ file: files.qwen2, outDir: dir(`qwen2-${weights}-fp32`), weights, kv: 'fp32', ...level })
        const got = await folderLogits(dir(`qwen2-${weights}-fp16`), PROMPT)
        const want = await folderLogits(dir(`qwen2-${weights}-fp32`), PROMPT)
        expect(got.map((l) => argmax(l))).toEqual(want.map((l) => argmax(l)))
        expect(worstError(got, toF64(want)).relativeRms).toBeLessThan(5e-3) // 1e-3 (fp32 weights), 2e-3 (int4) here
      }
      await expect(importGguf({ file: files.qwen2, outDir: dir('bad'), dtype: 'fp16', kv: 'fp32' })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringMatching(/keep float16 KV/) })
      await expect(importGguf({ file: files.qwen2, outDir: dir('bad'), attention: 'paged' })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringMatching(/needs float16/) })
      await expect(importGguf({ file: files.qwen2, outDir: dir('bad'), blockSize: 16 })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringMatching(/needs the paged attention form/) })
    })

    it('float16 int4 imports pack q/k/v blocks of one type into one MatMulNBits (minimums and zero points), and agree', async () => {
      // Layer 0's q/k/v are Q4_1 blocks (minimums), layer 1's Q4_0 (zero points); qwen2's mix types
      // within a layer, so they stay three MatMulNBits.
      const file = join(root, 'uniform.gguf')
      writeTinyGguf(file, { ...LLAMA, types: { ...LLAMA.types, layers: [Array(7).fill('Q4_1'), Array(7).fill('Q4_0')] } })
      const options = { file, weights: 'int4', accuracyLevel: 0 } as const
      await importGguf({ ...options, outDir: dir('uniform-fp16'), dtype: 'fp16' })
      await importGguf({ ...options, outDir: dir('uniform-fp32'), kv: 'fp32' })
      const nodes = decodeModel(dir('uniform-fp16')).graph!.node!
      for (const l of [0, 1]) {
        const packed = nodes.find((n) => n.name === `/model/layers.${l}/attn/qkv_proj/MatMulNBits`)!
        expect(Number(packed.attribute!.find((a) => a.name === 'N')!.i)).toBe(TINY.heads * TINY.headSize + 2 * TINY.kvHeads * TINY.headSize)
        expect(nodes.some((n) => n.name === `/model/layers.${l}/attn/q_proj/MatMulNBits`)).toBe(false)
      }
      expect(nodes.some((n) => n.name === '/model/layers.0/attn/qkv_proj/mins/MatMul')).toBe(true)
      expect(decodeModel(dir('qwen2-int4-fp16')).graph!.node!.some((n) => n.name!.includes('qkv_proj'))).toBe(false)
      const got = await folderLogits(dir('uniform-fp16'), PROMPT)
      const want = await folderLogits(dir('uniform-fp32'), PROMPT)
      expect(got.map((l) => argmax(l))).toEqual(want.map((l) => argmax(l)))
      expect(worstError(got, toF64(want)).relativeRms).toBeLessThan(5e-3) // 1.5e-3 here
    })

    it('the cuda paged import: a PagedAttention per layer, the CUDA provider, deterministic bytes', async () => {
      const options = { file: files.qwen2, weights: 'int4', dtype: 'fp16', attention: 'paged' } as const
      const a = await importGguf({ ...options, outDir: dir('cuda-a') })
      await importGguf({ ...options, outDir: dir('cuda-b') })
      expect(a.paged).toEqual({ kernel: 'cuda', blockSize: 256 })
      for (const file of readdirSync(dir('cuda-a'))) expect(readFileSync(join(dir('cuda-b'), file)).equals(readFileSync(join(dir('cuda-a'), file))), file).toBe(true)
      const graph = decodeModel(dir('cuda-a')).graph!
      expect(graph.node!.filter((n) => n.opType === 'PagedAttention' && n.domain === 'com.microsoft')).toHaveLength(TINY.layers)
      expect(graph.node!.filter((n) => n.opType === 'GroupQueryAttention')).toHaveLength(0)
      const config = json(dir('cuda-a'), 'genai_config.json')
      expect(config.model.decoder.session_options.provider_options).toEqual([{ cuda: { enable_cuda_graph: '0' } }])
      expect(config.engine.dynamic_batching.block_size).toBe(256)
      const meta = Object.fromEntries(decodeModel(dir('cuda-a')).metadataProps!.map((p) => [p.key, p.value]))
      expect(meta).toMatchObject({ 'ortex.attention': 'paged', 'ortex.paged_kernel': 'cuda', 'ortex.block_size': '256', 'ortex.dtype': 'fp16' })
    })
  })

  it('keep an lm_head tied to a Q8_0 embedding at 8 bits (int4), with float16 KV unless told', async () => {
    const file = join(root, 'tied-q8.gguf')
    writeTinyGguf(file, { ...LLAMA, types: { embedding: 'Q8_0', layers: LLAMA.types.layers } })
    const dirs = { fp32: join(root, 'tied-q8-fp32'), int4: join(root, 'tied-q8-int4'), kv32: join(root, 'tied-q8-int4-kv32') }
    const fp32 = await importGguf({ file, outDir: dirs.fp32 })
    const int4 = await importGguf({ file, outDir: dirs.int4, weights: 'int4' })
    const kv32 = await importGguf({ file, outDir: dirs.kv32, weights: 'int4', kv: 'fp32' })
    expect([fp32.kv, int4.kv, kv32.kv]).toEqual(['fp32', 'fp16', 'fp32'])
    // The layers' exact blocks, and the lm_head's Q8_0 blocks (the second Q8_0) beside a layer's.
    expect(int4.tensors.exact).toEqual({ Q4_0: 2, Q4_1: 2, Q4_K: 2, Q5_0: 1, Q5_1: 1, Q5_K: 1, Q6_K: 1, Q8_0: 2 })
    const graph = decodeModel(dirs.int4).graph!
    const lmHead = graph.node!.find((n) => n.name === '/lm_head/MatMulNBits')!
    expect(Number(lmHead.attribute!.find((a) => a.name === 'bits')!.i)).toBe(8)
    expect(lmHead.input!.slice(1)).toEqual(['lm_head.qweight', 'lm_head.scales']) // no zero points: 128
    const elem = (name: string) => (graph.input!.find((i) => i.name === name) ?? graph.output!.find((o) => o.name === name))!.type!.tensorType!.elemType
    expect([elem('past_key_values.0.key'), elem('present.0.value'), elem('logits')]).toEqual([10, 10, 1]) // float16 KV, float32 logits
    await expect(importGguf({ file, outDir: join(root, 'bad-kv'), kv: 'fp8' as never })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    // Close to the float32 import, and the engine equals the plain loop on the float16 cache.
    const { relativeRms } = worstError(await folderLogits(dirs.int4, PROMPT), (await folderLogits(dirs.fp32, PROMPT)).map((l) => Float64Array.from(l)))
    expect(relativeRms).toBeLessThan(0.25)
    const reference = await ReferenceModel.load(dirs.int4)
    const prompts = [PROMPT, [3, 4, 5], [200, 201, 202, 203, 204, 205]]
    const expected: number[][] = []
    for (const p of prompts) expected.push(await naiveGenerate(reference, p, 12, { ignoreEos: true }))
    await reference.release()
    const engine = await Engine.load(dirs.int4, { intraOpThreads: 1 })
    try {
      const got = await Promise.all(prompts.map(async (p) => Array.from((await engine.generate(p, { maxGeneratedTokens: 12, ignoreEos: true }).done).tokens)))
      expect(got).toEqual(expected)
      expect(engine.config.kvPositionBytes).toBe(TINY.layers * 2 * TINY.kvHeads * TINY.headSize * 2) // float16
    } finally {
      await engine.close()
    }
  })
})

describe('the tokenizer', () => {
  const CORPUS = [
    'The river starts as a thin line of water high in the hills.',
    "  spaces,\ttabs\nand newlines\n\n don't vanish; they're kept ",
    'Numbers: 1, 22, 333, 4444, 65536 and 3.14159; dates 2026-12-01.',
    'Ünïcödé — 日本語のテキスト ✓ 🦀 Ελληνικά Кириллица عربى',
    `${CHAT_TOKENS[0]}user\nHello there!${CHAT_TOKENS[1]}\n${CHAT_TOKENS[0]}assistant\n`,
    '<s>inside</s> <pad>CamelCase HTTPServer iPhone 12Monkeys',
    "I'M SHOUTING, you'LL see. It's fine",
  ]

  it(`gives llama.cpp's ids for every pre-tokenizer it writes (${SUPPORTED_PRE_TOKENIZERS.length})`, async () => {
    const vocab = tinyVocabulary()
    for (const pre of SUPPORTED_PRE_TOKENIZERS) {
      const options = { ...QWEN2, pre }
      const file = join(root, `pre-${pre}.gguf`)
      writeTinyGguf(file, options)
      const dir = join(root, `pre-${pre}`)
      await importGguf({ file, outDir: dir, weights: 'int4' })
      const oracle = new LlamaCppBpe({ ...vocab, pre })
      const engine = await Engine.load(dir, { intraOpThreads: 1 })
      try {
        for (const text of CORPUS) expect(Array.from(engine.tokenize(text)), `${pre}: ${JSON.stringify(text)}`).toEqual(oracle.encode(text))
        // Decoding gives the text back (special tokens are skipped by the engine's decoder).
        expect(engine.detokenize(engine.tokenize(CORPUS[3]!))).toBe(CORPUS[3])
      } finally {
        await engine.close()
      }
    }
  })

  it("SentencePiece vocabularies (tokenizer.ggml.model llama) give llama.cpp's ids", async () => {
    const spm = tinySentencePieceVocabulary()
    const metadata = tinyGgufMetadata({
      ...LLAMA,
      metadata: [
        ['tokenizer.ggml.model', str('llama')],
        ['tokenizer.ggml.tokens', strings(spm.tokens)],
        ['tokenizer.ggml.token_type', i32s(spm.types)],
        ['tokenizer.ggml.scores', f32s(spm.scores)],
        ['tokenizer.ggml.unknown_token_id', u32(0)],
      ],
    }).filter(([key]) => key !== 'tokenizer.ggml.merges' && key !== 'tokenizer.ggml.pre')
    const file = join(root, 'spm.gguf')
    writeFileSync(file, ggufBytes(metadata, tinyGgufTensors(LLAMA)))
    const dir = join(root, 'spm')
    const summary = await importGguf({ file, outDir: dir, weights: 'int4' })
    expect(summary.preTokenizer).toBe('sentencepiece')
    const scores = Float32Array.from(spm.scores) // as the file stores them
    const oracle = new LlamaCppSpm({ ...spm, scores: Array.from(scores), addSpacePrefix: true })
    const engine = await Engine.load(dir, { intraOpThreads: 1 })
    try {
      for (const text of [...CORPUS, 'The river starts as a thin line of water', 'hello world', ' the  kitchen ', '日本語 ✓ café <s>x</s> y']) {
        expect(Array.from(engine.tokenize(text)), JSON.stringify(text)).toEqual(oracle.encode(text))
      }
      const text = 'The garden needs water every evening during the summer.'
      expect(engine.detokenize(engine.tokenize(text))).toBe(text)
      const [space, ...bytes] = oracle.encode('日本')
      expect(spm.tokens[space!]).toBe('▁')
      expect(bytes.map((id) => spm.tokens[id])).toEqual(['<0xE6>', '<0x97>', '<0xA5>', '<0xE6>', '<0x9C>', '<0xAC>']) // byte fallback
    } finally {
      await engine.close()
    }
  })

  it('the oracle itself splits as llama.cpp does on known cases', () => {
    const vocab = tinyVocabulary()
    const oracle = (pre: string) => new LlamaCppBpe({ ...vocab, pre })
    // smollm splits digits one by one, llama-bpe in threes, qwen2 one by one, gpt-2 keeps the run.
    expect(oracle('smollm').split('a 12345 b')).toEqual(['a', ' ', '1', '2', '3', '4', '5', ' b'])
    expect(oracle('llama-bpe').split('a 12345 b')).toEqual(['a', ' ', '123', '45', ' b'])
    expect(oracle('qwen2').split('a 12345 b')).toEqual(['a', ' ', '1', '2', '3', '4', '5', ' b'])
    expect(oracle('gpt-2').split('a 12345 b')).toEqual(['a', ' 12345', ' b'])
    expect(oracle('llama-bpe').split("I'LL go\n\n  now")).toEqual(['I', "'LL", ' go', '\n\n', ' ', ' now'])
    expect(oracle('gpt-2').encode('<|im_start|>x')).toEqual([vocab.tokens.indexOf('<|im_start|>'), vocab.tokens.indexOf('x')])
  })
})

describe('ortex import (the command)', () => {
  const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..')
  const ortex = (...args: string[]) => spawnSync(process.execPath, [join(repo, 'dist', 'cli.js'), 'import', ...args], { encoding: 'utf8', timeout: 60_000 })

  it('writes the folder and prints one summary line', () => {
    const out = join(root, 'cli')
    const run = ortex(files.llama, '--out', out, '--weights', 'int4')
    expect(run.status, run.stderr).toBe(0)
    const lines = run.stdout.trim().split('\n')
    expect(lines).toHaveLength(1)
    expect(lines[0]).toMatch(
      new RegExp(`^${out.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}: llama "tiny llama", [\\d,]+ parameters, int4 weights \\(blocks kept exactly: .*Q4_1 x2.*Q6_K x2.* \\(Q5_0, Q5_1, Q8_0, Q5_K, Q6_K as 8-bit blocks\\); requantized to 4 bits: .*BF16 x1.*; float32: .*\\), int8 activations, float16 KV, [\\d.]+ MB in [\\d.]+ s$`),
    )
    expect(json(out, 'genai_config.json').model.type).toBe('llama')
    const level0 = ortex(files.llama, '--out', join(root, 'cli-level0'), '--weights', 'int4', '--accuracy-level', '0', '--kv', 'fp32')
    expect(level0.status, level0.stderr).toBe(0)
    expect(level0.stdout).toMatch(/\), float32 activations, float32 KV, /)
    const fp32 = ortex(files.llama, '--out', join(root, 'cli-fp32'))
    expect(fp32.status, fp32.stderr).toBe(0)
    expect(fp32.stdout).toMatch(/fp32 weights \(float32: [^)]*\), float32 KV, /) // no activations: no MatMulNBits
  })

  it('fails with one line and status 1 for a bad file, 2 for a wrong invocation', () => {
    const cut = join(root, 'cli-cut.gguf')
    writeFileSync(cut, readFileSync(files.llama).subarray(0, 30_000))
    const truncated = ortex(cut, '--out', join(root, 'cli-cut'))
    expect(truncated.status).toBe(1)
    expect(truncated.stderr).toMatch(/^ortex: MODEL_LOAD: .*cli-cut\.gguf: the file is truncated: tensor ".*" \(.*\) ends at byte \d+, past the end of the file at 30000\n$/)
    expect(ortex('--out', join(root, 'x')).status).toBe(2)
    expect(ortex(files.llama).stderr).toMatch(/give --out DIR/)
    expect(ortex(files.llama, '--out', join(root, 'x'), '--weights', 'int8').stderr).toMatch(/--weights must be 'fp32' or 'int4', got "int8"/)
    const badLevel = ortex(files.llama, '--out', join(root, 'x'), '--weights', 'int4', '--accuracy-level', '1')
    expect([badLevel.status, badLevel.stderr]).toEqual([2, expect.stringMatching(/--accuracy-level must be '0' or '4', got "1"/)])
    const fp32Level = ortex(files.llama, '--out', join(root, 'x'), '--accuracy-level', '4')
    expect([fp32Level.status, fp32Level.stderr]).toEqual([2, expect.stringMatching(/--accuracy-level applies to --weights int4 only/)])
    expect(ortex('--help').stdout).toMatch(/^Usage: ortex import <file\.gguf> --out DIR/)
    expect(ortex('--help').stdout).toMatch(/--accuracy-level N +int4 only/)
  })
})

