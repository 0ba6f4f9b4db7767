// Reads a GGUF file (llama.cpp's model format, versions 2 and 3, little-endian): the header, the
// metadata key/value pairs and the tensor table, then tensor data on demand, a slice at a time.
// Nothing beyond the header is held in memory. A file that ends early, or whose counts, lengths,
// types or tensor extents do not add up, is refused with MODEL_LOAD naming the file and what was
// being read. Every count and length is checked against the bytes left in the file and against
// GGUF_LIMITS before anything is sized by it, so a hostile header costs no memory.
//
//   magic "GGUF" | version u32 | tensor count u64 | kv count u64
//   kv:     key (u64 length + UTF-8) | value type u32 | value
//   tensor: name | n_dims u32 | dims u64 x n_dims (dims[0] varies fastest) | type u32 | offset u64
//   padding to `general.alignment` (default 32) | tensor data (each offset relative to here)

import { closeSync, fstatSync, openSync, readSync } from 'node:fs'
import { OrtexError } from '../../errors'
import { GGML_TYPES, ggmlTypeName } from './ggml-types'

export type GgufScalar = number | boolean | string
export type GgufValue = GgufScalar | GgufScalar[]

export interface GgufTensorInfo {
  name: string
  /** ggml order: dims[0] is the row length (contiguous), dims[1] the number of rows, ... */
  dims: number[]
  type: number
  /** Byte offset in the file (absolute). */
  offset: number
  elements: number
  bytes: number
}

export interface GgufFile {
  path: string
  version: number
  fileBytes: number
  alignment: number
  metadata: ReadonlyMap<string, GgufValue>
  tensors: readonly GgufTensorInfo[]
}

const MAGIC = 0x46554747 // "GGUF" read as a little-endian u32
const MAX_DIMS = 4
const WINDOW = 1 << 20

/**
 * What the reader accepts, far above any real model (a 262,144-token vocabulary with its scores,
 * types and merges is about 1M array items and 10 MiB of header). The header is what is held in
 * memory, so bounding it (and the items the arrays hold) bounds the reader's memory.
 */
export const GGUF_LIMITS = {
  /** The header: metadata and tensor table, everything before the tensor data. */
  headerBytes: 256 * 1024 * 1024,
  tensors: 65_536,
  metadataEntries: 65_536,
  /** Items of one metadata array. */
  arrayItems: 1 << 21,
  /** Items of all metadata arrays together. */
  metadataItems: 1 << 23,
  /** The GGUF specification's limit on a key. */
  keyBytes: 65_535,
  /** ggml's GGML_MAX_NAME (64) less the terminating NUL; llama.cpp refuses longer names. */
  tensorNameBytes: 63,
} as const

/** The fewest bytes a metadata entry (a 1-byte key, its type, a 1-byte value) and a tensor's
 *  entry (empty name, one dimension, type, offset) take: the counts in the header cannot exceed
 *  the bytes after it divided by these. */
const MIN_ENTRY_BYTES = 8 + 1 + 4 + 1
const MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

enum ValueType {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
}

function loadError(path: string, reason: string): OrtexError {
  return new OrtexError('MODEL_LOAD', `${path}: ${reason}`)
}

/** Sequential reads over a file through a 1 MiB window; every read is bounds-checked. */
class Cursor {
  private window = Buffer.alloc(0)
  private windowStart = 0
  pos = 0
  /** What is being read, for the error when the file ends too early. */
  context = 'the header'

  constructor(
    private readonly fd: number,
    readonly path: string,
    readonly fileBytes: number,
  ) {}

  /** Items read into metadata arrays so far (GGUF_LIMITS.metadataItems). */
  metadataItems = 0

  private take(n: number): Buffer {
    if (this.pos + n > this.fileBytes) {
      throw loadError(this.path, `the file is truncated: it ends at byte ${this.fileBytes} while reading ${this.context}`)
    }
    if (this.pos + n > GGUF_LIMITS.headerBytes) throw this.overHeaderLimit(`${n} bytes`)
    const end = this.windowStart + this.window.length
    if (this.pos < this.windowStart || this.pos + n > end) {
      const length = Math.min(Math.max(n, WINDOW), this.fileBytes - this.pos)
      this.window = Buffer.alloc(length)
      const got = readSync(this.fd, this.window, 0, length, this.pos)
      if (got !== length) throw loadError(this.path, `short read at byte ${this.pos} while reading ${this.context}`)
      this.windowStart = this.pos
    }
    const at = this.pos - this.windowStart
    this.pos += n
    return this.window.subarray(at, at + n)
  }

  remaining(): number {
    return this.fileBytes - this.pos
  }

  /** Bytes the header may still take: the file's end or the header limit, whichever is first. */
  headerRemaining(): number {
    return Math.min(this.fileBytes, GGUF_LIMITS.headerBytes) - this.pos
  }

  overHeaderLimit(what: string): OrtexError {
    return loadError(this.path, `${this.context}: ${what} would take the header past ${GGUF_LIMITS.headerBytes} bytes, the limit (a corrupt file?)`)
  }

  /** Refuses `count` things of at least `minBytes` each that the rest of the header cannot hold. */
  checkFits(count: number, minBytes: number, what: string): void {
    if (count * minBytes <= this.headerRemaining()) return
    if (count * minBytes > this.remaining()) {
      throw loadError(this.path, `${this.context}: ${what} run past the end of the file (truncated or corrupt)`)
    }
    throw this.overHeaderLimit(what)
  }

  u8 = () => this.take(1).readUInt8(0)
  i8 = () => this.take(1).readInt8(0)
  u16 = () => this.take(2).readUInt16LE(0)
  i16 = () => this.take(2).readInt16LE(0)
  u32 = () => this.take(4).readUInt32LE(0)
  i32 = () => this.take(4).readInt32LE(0)
  f32 = () => this.take(4).readFloatLE(0)
  f64 = () => this.take(8).readDoubleLE(0)

  u64(): number {
    const v = this.take(8).readBigUInt64LE(0)
    if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw loadError(this.path, `${this.context}: the count ${v} is not plausible (a corrupt file?)`)
    return Number(v)
  }

  /** Signed 64-bit metadata values are informational: the nearest double is enough. */
  i64(): number {
    return Number(this.take(8).readBigInt64LE(0))
  }

  /** A length-prefixed UTF-8 string of at most `maxBytes` bytes (what the string is, for the error). */
  string(maxBytes = Infinity, what = 'a string'): string {
    const length = this.u64()
    if (length > maxBytes) throw loadError(this.path, `${this.context}: ${what} of ${length} bytes is over the limit of ${maxBytes}`)
    if (length > this.remaining()) {
      throw loadError(this.path, `${this.context}: ${what} of ${length} bytes runs past the end of the file (truncated or corrupt)`)
    }
    if (length > this.headerRemaining()) throw this.overHeaderLimit(`${what} of ${length} bytes`)
    return this.take(length).toString('utf8')
  }
}

function readScalar(c: Cursor, type: number): GgufScalar {
  switch (type) {
    case ValueType.U8:
      return c.u8()
    case ValueType.I8:
      return c.i8()
    case ValueType.U16:
      return c.u16()
    case ValueType.I16:
      return c.i16()
    case ValueType.U32:
      return c.u32()
    case ValueType.I32:
      return c.i32()
    case ValueType.F32:
      return c.f32()
    case ValueType.BOOL: {
      const b = c.u8()
      if (b > 1) throw loadError(c.path, `${c.context}: a boolean holds ${b} (a corrupt file?)`)
      return b === 1
    }
    case ValueType.STRING:
      return c.string()
    case ValueType.U64:
      return c.u64()
    case ValueType.I64:
      return c.i64()
    case ValueType.F64:
      return c.f64()
    default:
      throw loadError(c.path, `${c.context}: unknown value type ${type} (a corrupt file, or a newer GGUF version)`)
  }
}

/** Bytes an item of each scalar type takes at least (a string: its 8-byte length). */
const ITEM_BYTES: Readonly<Record<number, number>> = {
  [ValueType.U8]: 1,
  [ValueType.I8]: 1,
  [ValueType.BOOL]: 1,
  [ValueType.U16]: 2,
  [ValueType.I16]: 2,
  [ValueType.U32]: 4,
  [ValueType.I32]: 4,
  [ValueType.F32]: 4,
  [ValueType.STRING]: 8,
  [ValueType.U64]: 8,
  [ValueType.I64]: 8,
  [ValueType.F64]: 8,
}

function readValue(c: Cursor): GgufValue {
  const type = c.u32()
  if (type !== ValueType.ARRAY) return readScalar(c, type)
  const itemType = c.u32()
  const count = c.u64()
  if (itemType === ValueType.ARRAY) throw loadError(c.path, `${c.context}: nested arrays are not supported`)
  const itemBytes = ITEM_BYTES[itemType]
  if (itemBytes === undefined) throw loadError(c.path, `${c.context}: unknown array item type ${itemType} (a corrupt file, or a newer GGUF version)`)
  checkArrayCount(c, count, itemBytes)
  const values: GgufScalar[] = []
  for (let i = 0; i < count; i++) values.push(readScalar(c, itemType))
  return values
}

/** Before an array is read: its count against the limits and against the bytes left. */
function checkArrayCount(c: Cursor, count: number, itemBytes: number): void {
  if (count > GGUF_LIMITS.arrayItems) {
    throw loadError(c.path, `${c.context}: an array of ${count} items is over the limit of ${GGUF_LIMITS.arrayItems} (a corrupt file?)`)
  }
  if (c.metadataItems + count > GGUF_LIMITS.metadataItems) {
    throw loadError(
      c.path,
      `${c.context}: an array of ${count} items takes the metadata's arrays past ${GGUF_LIMITS.metadataItems} items in all, the limit (a corrupt file?)`,
    )
  }
  c.checkFits(count, itemBytes, `an array of ${count} items`)
  c.metadataItems += count
}

function readMetadata(c: Cursor, count: number): Map<string, GgufValue> {
  const metadata = new Map<string, GgufValue>()
  for (let i = 0; i < count; i++) {
    c.context = `metadata entry ${i} of ${count}`
    const key = c.string(GGUF_LIMITS.keyBytes, 'a key')
    if (key === '') throw loadError(c.path, `${c.context}: the key is empty (a corrupt file?)`)
    c.context = `metadata "${key}"`
    if (metadata.has(key)) throw loadError(c.path, `metadata "${key}" appears twice (a corrupt file?)`)
    metadata.set(key, readValue(c))
  }
  return metadata
}

function readTensorInfo(c: Cursor, index: number, count: number): Omit<GgufTensorInfo, 'offset'> & { relativeOffset: number } {
  c.context = `tensor info ${index} of ${count}`
  const name = c.string(GGUF_LIMITS.tensorNameBytes, 'a tensor name')
  c.context = `tensor info "${name}"`
  const nDims = c.u32()
  if (nDims < 1 || nDims > MAX_DIMS) throw loadError(c.path, `tensor "${name}" has ${nDims} dimensions (1 to ${MAX_DIMS} allowed)`)
  const dims = Array.from({ length: nDims }, () => c.u64())
  const type = c.u32()
  const relativeOffset = c.u64()
  const geometry = GGML_TYPES.get(type)
  if (!geometry) throw loadError(c.path, `tensor "${name}" has the unknown ggml type ${type}`)
  const elements = dims.reduce((a, b) => a * b, 1)
  if (!Number.isSafeInteger(elements) || elements <= 0) throw loadError(c.path, `tensor "${name}" has the shape [${dims}] (a corrupt file?)`)
  if (dims[0]! % geometry.blockSize !== 0) {
    throw loadError(c.path, `tensor "${name}": a row of ${dims[0]} elements is not whole ${geometry.name} blocks of ${geometry.blockSize}`)
  }
  return { name, dims, type, elements, bytes: (elements / geometry.blockSize) * geometry.typeSize, relativeOffset }
}

/** Reads the header, metadata and tensor table of `path`; checks every tensor lies inside the file. */
export function readGguf(path: string): GgufFile {
  let fd: number
  try {
    fd = openSync(path, 'r')
  } catch (e) {
    throw loadError(path, `cannot open the file: ${(e as Error).message}`)
  }
  try {
    const c = new Cursor(fd, path, fstatSync(fd).size)
    if (c.fileBytes < 4 || c.u32() !== MAGIC) throw loadError(path, 'not a GGUF file (the first bytes are not "GGUF")')
    const version = c.u32()
    if (version === 1) throw loadError(path, 'GGUF version 1 is not supported (convert the file with a current llama.cpp)')
    if (version !== 2 && version !== 3) {
      const hint = (version & 0xffff) === 0 ? ' (a big-endian file? only little-endian files are supported)' : ''
      throw loadError(path, `unsupported GGUF version ${version}${hint}`)
    }
    const tensorCount = c.u64()
    const kvCount = c.u64()
    checkHeaderCount(c, 'metadata', kvCount, GGUF_LIMITS.metadataEntries, kvCount * MIN_ENTRY_BYTES)
    checkHeaderCount(c, 'tensor', tensorCount, GGUF_LIMITS.tensors, kvCount * MIN_ENTRY_BYTES + tensorCount * MIN_TENSOR_INFO_BYTES)
    const metadata = readMetadata(c, kvCount)
    const infos: ReturnType<typeof readTensorInfo>[] = []
    for (let i = 0; i < tensorCount; i++) infos.push(readTensorInfo(c, i, tensorCount))
    const alignment = readAlignment(path, metadata)
    const dataStart = Math.ceil(c.pos / alignment) * alignment
    checkLayout(path, alignment, infos)
    const tensors = infos.map(({ relativeOffset, ...t }) => ({ ...t, offset: dataStart + relativeOffset }))
    checkExtents(path, c.fileBytes, tensors)
    return { path, version, fileBytes: c.fileBytes, alignment, metadata, tensors }
  } finally {
    closeSync(fd)
  }
}

/** The header's tensor or metadata count, against its limit and the bytes its entries need. */
function checkHeaderCount(c: Cursor, what: 'tensor' | 'metadata', count: number, limit: number, neededBytes: number): void {
  const entries = what === 'tensor' ? 'tensors' : 'metadata entries'
  if (count > limit) throw loadError(c.path, `the header's ${what} count ${count} is not plausible: over the limit of ${limit} ${entries} (a corrupt file?)`)
  if (neededBytes > c.remaining()) {
    throw loadError(c.path, `the header's ${what} count ${count} is not plausible: the ${c.remaining()} bytes after the header cannot hold that many ${entries} (truncated or corrupt)`)
  }
}

/** general.alignment: a power of two (llama.cpp refuses any other), at least 8. */
function readAlignment(path: string, metadata: ReadonlyMap<string, GgufValue>): number {
  const alignment = metadata.get('general.alignment') ?? 32
  if (typeof alignment !== 'number' || !Number.isSafeInteger(alignment) || alignment < 8 || (alignment & (alignment - 1)) !== 0 || alignment > 2 ** 30) {
    throw loadError(path, `general.alignment must be a power of two from 8 to 2^30, got ${String(alignment)}`)
  }
  return alignment
}

/**
 * The data section as llama.cpp's gguf.cpp requires it: the tensors follow each other in table
 * order, each starting where the previous one's bytes, padded to the alignment, end. So no tensor
 * overlaps another, none is misaligned, and there are no gaps.
 *
 *   data section:  | t0 bytes | pad | t1 bytes | pad | t2 ...
 *                  0          expected offset of t1 = align(t0.bytes)
 */
function checkLayout(path: string, alignment: number, infos: readonly { name: string; bytes: number; relativeOffset: number }[]): void {
  const names = new Set<string>()
  let expected = 0
  let previous: { name: string; end: number } | undefined
  for (const t of infos) {
    if (names.has(t.name)) throw loadError(path, `tensor "${t.name}" appears twice (a corrupt file?)`)
    names.add(t.name)
    const at = t.relativeOffset
    if (at % alignment !== 0) throw loadError(path, `tensor "${t.name}" starts at data offset ${at}, not on a ${alignment}-byte boundary`)
    if (previous && at < previous.end) {
      throw loadError(path, `tensor "${t.name}" starts at data offset ${at}, inside tensor "${previous.name}" (which ends at ${previous.end}): tensors may not overlap`)
    }
    if (at !== expected) {
      const after = previous ? `tensor "${previous.name}" ends at ${previous.end}, padded to ${expected}` : 'the data section starts at 0'
      throw loadError(path, `tensor "${t.name}" starts at data offset ${at}, but ${after}: GGUF tensors follow each other in table order without gaps (llama.cpp refuses this file too)`)
    }
    previous = { name: t.name, end: at + t.bytes }
    expected = Math.ceil(previous.end / alignment) * alignment
  }
}

function checkExtents(path: string, fileBytes: number, tensors: GgufTensorInfo[]): void {
  for (const t of tensors) {
    if (t.offset + t.bytes > fileBytes) {
      throw loadError(
        path,
        `the file is truncated: tensor "${t.name}" (${ggmlTypeName(t.type)}, ${t.bytes} bytes) ends at byte ` +
          `${t.offset + t.bytes}, past the end of the file at ${fileBytes}`,
      )
    }
  }
}

/** Reads tensor data: rows of one tensor at a time, into a fresh buffer. */
export class GgufData {
  private readonly fd: number

  constructor(readonly file: GgufFile) {
    try {
      this.fd = openSync(file.path, 'r')
    } catch (e) {
      throw loadError(file.path, `cannot open the file: ${(e as Error).message}`)
    }
  }

  /** Bytes of rows [first, first + count) of `t` (a row is dims[0] elements). */
  rows(t: GgufTensorInfo, first: number, count: number): Uint8Array {
    const rowBytes = t.bytes / (t.elements / t.dims[0]!)
    const start = t.offset + first * rowBytes
    const length = count * rowBytes
    if (first < 0 || start + length > t.offset + t.bytes) throw new Error(`rows [${first}, ${first + count}) are outside tensor ${t.name}`)
    const out = new Uint8Array(length)
    let done = 0
    while (done < length) {
      const got = readSync(this.fd, out, done, length - done, start + done)
      if (got === 0) throw loadError(this.file.path, `the file ended while reading tensor "${t.name}" (was it truncated while importing?)`)
      done += got
    }
    return out
  }

  close(): void {
    closeSync(this.fd)
  }
}

/** Typed access to metadata with MODEL_LOAD errors naming the key. */
export class Metadata {
  constructor(private readonly file: GgufFile) {}

  has(key: string): boolean {
    return this.file.metadata.has(key)
  }

  private fail(key: string, want: string, got: unknown): never {
    throw loadError(this.file.path, `metadata "${key}" must be ${want}, got ${JSON.stringify(got)}`)
  }

  string(key: string): string
  string(key: string, fallback: string | undefined): string | undefined
  string(key: string, ...fallback: [string?]): string | undefined {
    const v = this.file.metadata.get(key)
    if (v === undefined) return fallback.length > 0 ? fallback[0] : this.fail(key, 'present (a string)', undefined)
    return typeof v === 'string' ? v : this.fail(key, 'a string', v)
  }

  number(key: string): number
  number(key: string, fallback: number | undefined): number | undefined
  number(key: string, ...fallback: [number?]): number | undefined {
    const v = this.file.metadata.get(key)
    if (v === undefined) return fallback.length > 0 ? fallback[0] : this.fail(key, 'present (a number)', undefined)
    return typeof v === 'number' && Number.isFinite(v) ? v : this.fail(key, 'a number', v)
  }

  count(key: string): number
  count(key: string, fallback: number | undefined): number | undefined
  count(key: string, ...fallback: [number?]): number | undefined {
    const v = fallback.length > 0 ? this.number(key, fallback[0]) : this.number(key)
    if (v === undefined) return undefined
    return Number.isInteger(v) && v >= 0 ? v : this.fail(key, 'a non-negative integer', v)
  }

  boolean(key: string, fallback: boolean): boolean {
    const v = this.file.metadata.get(key)
    if (v === undefined) return fallback
    return typeof v === 'boolean' ? v : this.fail(key, 'a boolean', v)
  }

  strings(key: string): string[] | undefined {
    const v = this.file.metadata.get(key)
    if (v === undefined) return undefined
    if (!Array.isArray(v) || v.some((x) => typeof x !== 'string')) this.fail(key, 'an array of strings', typeof v)
    return v as string[]
  }

  numbers(key: string): number[] | undefined {
    const v = this.file.metadata.get(key)
    if (v === undefined) return undefined
    if (!Array.isArray(v) || v.some((x) => typeof x !== 'number')) this.fail(key, 'an array of numbers', typeof v)
    return v as number[]
  }
}
