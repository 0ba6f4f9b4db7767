// Reads a GGUF file (llama.cpp's model format, versions 2 and 3, little-endian): the header, the
// metadata key/value pairs and the tensor table, then tensor data on demand, a slice at a time.
// Nothing beyond the header is held in memory. A file that ends early, or whose counts, lengths,
// types or tensor extents do not add up, is refused with MODEL_LOAD naming the file and what was
// being read.
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

  private take(n: number): Buffer {
    if (this.pos + n > this.fileBytes) {
      throw loadError(this.path, `the file is truncated: it ends at byte ${this.fileBytes} while reading ${this.context}`)
    }
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

  string(): string {
    const length = this.u64()
    if (length > this.remaining()) {
      throw loadError(this.path, `${this.context}: a string of ${length} bytes runs past the end of the file (truncated or corrupt)`)
    }
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

function readValue(c: Cursor): GgufValue {
  const type = c.u32()
  if (type !== ValueType.ARRAY) return readScalar(c, type)
  const itemType = c.u32()
  const count = c.u64()
  if (itemType === ValueType.ARRAY) throw loadError(c.path, `${c.context}: nested arrays are not supported`)
  if (count > c.remaining()) {
    throw loadError(c.path, `${c.context}: an array of ${count} items runs past the end of the file (truncated or corrupt)`)
  }
  const values: GgufScalar[] = new Array(count)
  for (let i = 0; i < count; i++) values[i] = readScalar(c, itemType)
  return values
}

function readMetadata(c: Cursor, count: number): Map<string, GgufValue> {
  const metadata = new Map<string, GgufValue>()
  for (let i = 0; i < count; i++) {
    c.context = `metadata entry ${i} of ${count}`
    const key = c.string()
    c.context = `metadata "${key}"`
    if (metadata.has(key)) throw loadError(c.path, `metadata "${key}" appears twice (a corrupt file?)`)
    metadata.set(key, readValue(c))
  }
  return metadata
}

function readTensorInfo(c: Cursor, index: number, count: number): Omit<GgufTensorInfo, 'offset'> & { relativeOffset: number } {
  c.context = `tensor info ${index} of ${count}`
  const name = c.string()
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
    if (tensorCount > c.remaining() || kvCount > c.remaining()) throw loadError(path, 'the header counts are not plausible (a corrupt file?)')
    const metadata = readMetadata(c, kvCount)
    const infos = Array.from({ length: tensorCount }, (_, i) => readTensorInfo(c, i, tensorCount))
    const alignment = metadata.get('general.alignment') ?? 32
    if (typeof alignment !== 'number' || alignment <= 0 || alignment % 8 !== 0) {
      throw loadError(path, `general.alignment must be a positive multiple of 8, got ${String(alignment)}`)
    }
    const dataStart = Math.ceil(c.pos / alignment) * alignment
    const tensors = infos.map(({ relativeOffset, ...t }) => ({ ...t, offset: dataStart + relativeOffset }))
    checkExtents(path, c.fileBytes, alignment, tensors)
    return { path, version, fileBytes: c.fileBytes, alignment, metadata, tensors }
  } finally {
    closeSync(fd)
  }
}

function checkExtents(path: string, fileBytes: number, alignment: number, tensors: GgufTensorInfo[]): void {
  const names = new Set<string>()
  for (const t of tensors) {
    if (names.has(t.name)) throw loadError(path, `tensor "${t.name}" appears twice (a corrupt file?)`)
    names.add(t.name)
    if (t.offset % alignment !== 0) throw loadError(path, `tensor "${t.name}" starts at byte ${t.offset}, not on a ${alignment}-byte boundary`)
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
