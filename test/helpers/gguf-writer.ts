// A GGUF writer for tests (version 3, little-endian), and valid random blocks of every ggml type
// the importer reads, so the importer's tests make their own small files at test time.

import { setFloat16 } from '@petamoriken/float16'
import { truncateSync, writeFileSync } from 'node:fs'
import { GGML_TYPES, GgmlTypeId } from '../../ts/modelkit/gguf/ggml-types'

/** A typed metadata value (the format needs the type; a JS number alone is ambiguous). */
export type MetaValue =
  | { kind: 'u32' | 'i32' | 'f32' | 'u64'; value: number }
  | { kind: 'bool'; value: boolean }
  | { kind: 'string'; value: string }
  | { kind: 'array'; item: 'string'; values: string[] }
  | { kind: 'array'; item: 'i32' | 'f32'; values: number[] }
  /** Only an array's item type (a GGUF value type number) and count: its items are whatever bytes
   *  follow (a hostile file's claim, read from the zeros of a sparse file). */
  | { kind: 'declared-array'; item: number; count: number }
  /** Only a string's length: its bytes are whatever follows. */
  | { kind: 'declared-string'; bytes: number }
  /** An array of `count` u8 zeros. */
  | { kind: 'zeros'; count: number }

export const u32 = (value: number): MetaValue => ({ kind: 'u32', value })
export const f32 = (value: number): MetaValue => ({ kind: 'f32', value })
export const str = (value: string): MetaValue => ({ kind: 'string', value })
export const bool = (value: boolean): MetaValue => ({ kind: 'bool', value })
export const strings = (values: string[]): MetaValue => ({ kind: 'array', item: 'string', values })
export const i32s = (values: number[]): MetaValue => ({ kind: 'array', item: 'i32', values })
export const f32s = (values: number[]): MetaValue => ({ kind: 'array', item: 'f32', values })

export interface GgufTensor {
  name: string
  /** ggml order: dims[0] is the row length. */
  dims: number[]
  type: number
  data: Uint8Array
}

const TYPE_CODE = { u32: 4, i32: 5, f32: 6, bool: 7, string: 8, array: 9, u64: 10, 'declared-array': 9, 'declared-string': 8, zeros: 9 } as const

class Bytes {
  private chunks: Buffer[] = []
  length = 0
  push(b: Buffer | Uint8Array): void {
    const buf = Buffer.from(b.buffer, b.byteOffset, b.byteLength)
    this.chunks.push(buf)
    this.length += buf.length
  }
  u32(v: number): void {
    const b = Buffer.alloc(4)
    b.writeUInt32LE(v)
    this.push(b)
  }
  i32(v: number): void {
    const b = Buffer.alloc(4)
    b.writeInt32LE(v)
    this.push(b)
  }
  f32(v: number): void {
    const b = Buffer.alloc(4)
    b.writeFloatLE(v)
    this.push(b)
  }
  u64(v: number): void {
    const b = Buffer.alloc(8)
    b.writeBigUInt64LE(BigInt(v))
    this.push(b)
  }
  string(s: string): void {
    const b = Buffer.from(s, 'utf8')
    this.u64(b.length)
    this.push(b)
  }
  concat(): Buffer {
    return Buffer.concat(this.chunks)
  }
}

function writeValue(out: Bytes, v: MetaValue): void {
  out.u32(TYPE_CODE[v.kind])
  switch (v.kind) {
    case 'u32':
      return out.u32(v.value)
    case 'i32':
      return out.i32(v.value)
    case 'f32':
      return out.f32(v.value)
    case 'u64':
      return out.u64(v.value)
    case 'bool':
      return out.push(Buffer.from([v.value ? 1 : 0]))
    case 'string':
      return out.string(v.value)
    case 'declared-array':
      out.u32(v.item)
      return out.u64(v.count)
    case 'declared-string':
      return out.u64(v.bytes)
    case 'zeros':
      out.u32(0)
      out.u64(v.count)
      return out.push(new Uint8Array(v.count))
    case 'array':
      out.u32(TYPE_CODE[v.item])
      out.u64(v.values.length)
      for (const x of v.values) {
        if (v.item === 'string') out.string(x as string)
        else if (v.item === 'i32') out.i32(x as number)
        else out.f32(x as number)
      }
  }
}

/** A GGUF header: the metadata, then each tensor's name, shape, type and data offset (`bytes`
 *  long each, every one aligned). Returns the header and where each tensor's data starts, counted
 *  from the data section (which begins at the header's length rounded up to the alignment).
 *  `offsets` replaces the computed offsets (a hostile layout: overlaps, gaps, misalignment). */
export function ggufHeader(
  metadata: Array<[string, MetaValue]>,
  tensors: { name: string; dims: number[]; type: number; bytes: number }[],
  alignment = 32,
  offsets?: number[],
): { header: Buffer; offsets: number[]; dataBytes: number } {
  const head = new Bytes()
  head.push(Buffer.from('GGUF', 'latin1'))
  head.u32(3)
  head.u64(tensors.length)
  head.u64(metadata.length)
  for (const [key, value] of metadata) {
    head.string(key)
    writeValue(head, value)
  }
  let offset = 0
  let dataBytes = 0
  const written: number[] = []
  tensors.forEach((t, i) => {
    head.string(t.name)
    head.u32(t.dims.length)
    for (const d of t.dims) head.u64(d)
    head.u32(t.type)
    const at = offsets?.[i] ?? offset
    written.push(at)
    head.u64(at)
    offset = Math.ceil((offset + t.bytes) / alignment) * alignment
    dataBytes = Math.max(dataBytes, Math.ceil((at + t.bytes) / alignment) * alignment)
  })
  return { header: head.concat(), offsets: written, dataBytes }
}

/** The bytes of a GGUF file with these metadata entries and tensors (in order; `offsets` as in ggufHeader). */
export function ggufBytes(metadata: Array<[string, MetaValue]>, tensors: GgufTensor[], alignment = 32, offsets?: number[]): Buffer {
  const { header, offsets: at, dataBytes } = ggufHeader(metadata, tensors.map((t) => ({ ...t, bytes: t.data.length })), alignment, offsets)
  const dataStart = Math.ceil(header.length / alignment) * alignment
  const file = Buffer.alloc(dataStart + dataBytes)
  header.copy(file)
  tensors.forEach((t, i) => file.set(t.data, dataStart + at[i]!))
  return file
}

export function writeGguf(path: string, metadata: Array<[string, MetaValue]>, tensors: GgufTensor[]): void {
  writeFileSync(path, ggufBytes(metadata, tensors))
}

/** A sparse file of `fileBytes` that starts with `header`: the rest reads as zeros and takes no disk. */
export function writeSparse(path: string, header: Uint8Array, fileBytes: number): void {
  writeFileSync(path, header)
  truncateSync(path, fileBytes)
}

/** A small deterministic generator (xorshift32) for test data. */
export class TestRng {
  private x: number
  constructor(seed: number) {
    this.x = (seed * 2654435761 + 0x9e3779b9) >>> 0 || 1
  }
  u32(): number {
    let x = this.x
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    this.x = x >>> 0
    return this.x
  }
  /** Uniform in [-1, 1). */
  signed(): number {
    return this.u32() / 2 ** 31 - 1
  }
  int(n: number): number {
    return this.u32() % n
  }
}

/** The 32-element types: the spread of their random codes, and the minimum that centres them. */
const SIMPLE_BLOCKS: Readonly<Record<number, { codeStd: number; minimum?: number }>> = {
  [GgmlTypeId.Q4_0]: { codeStd: 4.6 },
  [GgmlTypeId.Q4_1]: { codeStd: 4.6, minimum: 7.5 },
  [GgmlTypeId.Q5_0]: { codeStd: 9.2 },
  [GgmlTypeId.Q5_1]: { codeStd: 9.2, minimum: 15.5 },
  [GgmlTypeId.Q8_0]: { codeStd: 73 },
}

function f16Bytes(view: DataView, at: number, value: number): void {
  setFloat16(view, at, value, true)
}

/** Q4_K/Q5_K's 12 scale bytes for 6-bit sub-block scales sc[8] and minimums m[8] (quantize_row_q4_K_ref). */
function packScalesK4(sc: number[], m: number[]): Uint8Array {
  const out = new Uint8Array(12)
  for (let j = 0; j < 8; j++) {
    if (j < 4) {
      out[j] = sc[j]!
      out[j + 4] = m[j]!
    } else {
      out[j + 4] = (sc[j]! & 0xf) | ((m[j]! & 0xf) << 4)
      out[j - 4]! |= (sc[j]! >> 4) << 6
      out[j]! |= (m[j]! >> 4) << 6
    }
  }
  return out
}

/**
 * `elements` values of `type` with a standard deviation of about `std`: random codes under
 * chosen scales (the minimums centre the unsigned codes), valid blocks of every layout.
 */
export function randomTensorData(type: number, elements: number, std: number, rng: TestRng): Uint8Array {
  const geometry = GGML_TYPES.get(type)!
  const blocks = elements / geometry.blockSize
  const out = new Uint8Array(blocks * geometry.typeSize)
  const view = new DataView(out.buffer)
  for (let b = 0; b < blocks; b++) {
    const at = b * geometry.typeSize
    for (let i = 0; i < geometry.typeSize; i++) out[at + i] = rng.int(256)
    const jitter = 0.75 + 0.5 * Math.abs(rng.signed())
    switch (type) {
      case GgmlTypeId.F32:
        view.setFloat32(at, rng.signed() * std * Math.sqrt(3), true)
        break
      case GgmlTypeId.F16:
        f16Bytes(view, at, rng.signed() * std * Math.sqrt(3))
        break
      case GgmlTypeId.BF16: {
        const bits = new Uint32Array(new Float32Array([rng.signed() * std * Math.sqrt(3)]).buffer)[0]!
        view.setUint16(at, (bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16, true)
        break
      }
      case GgmlTypeId.Q4_0:
      case GgmlTypeId.Q4_1:
      case GgmlTypeId.Q5_0:
      case GgmlTypeId.Q5_1:
      case GgmlTypeId.Q8_0: {
        // d first; the types with a minimum put it right after d, at minus half the code range.
        const { codeStd, minimum } = SIMPLE_BLOCKS[type]!
        const d = (std / codeStd) * jitter
        f16Bytes(view, at, d)
        if (minimum !== undefined) f16Bytes(view, at + 2, -minimum * d)
        break
      }
      case GgmlTypeId.Q4_K:
      case GgmlTypeId.Q5_K: {
        const half = type === GgmlTypeId.Q4_K ? 7.5 : 15.5
        const sc = Array.from({ length: 8 }, () => 1 + rng.int(type === GgmlTypeId.Q4_K ? 8 : 4))
        const m = sc.map((s) => Math.min(63, Math.round(half * s)))
        const d = std / (half * 1.15 * 4)
        f16Bytes(view, at, d * jitter)
        f16Bytes(view, at + 2, d * jitter)
        out.set(packScalesK4(sc, m), at + 4)
        break
      }
      case GgmlTypeId.Q6_K: {
        for (let i = 0; i < 16; i++) out[at + 192 + i] = ((1 + rng.int(8)) * (rng.int(2) ? 1 : -1)) & 0xff
        f16Bytes(view, at + 208, (std / (18.5 * 4.5)) * jitter)
        break
      }
      default:
        throw new Error(`no random data for type ${type}`)
    }
  }
  return out
}

// llama.cpp's reference Q4_0 quantizer (ggml-quants.c), so that a Q4_0 file is its F32 twin's model
// quantized the way llama-quantize would.

export const Q4_0_BLOCK = 32
const Q4_0_BYTES = GGML_TYPES.get(GgmlTypeId.Q4_0)!.typeSize

const f = Math.fround

/**
 * quantize_row_q4_0_ref: per block of 32, d = (the value of largest magnitude, signed) / -8,
 * q = min(15, trunc(x / d + 8.5)) with x / d as x * (1 / d) in float32, element j in the low
 * nibble of byte j and element j + 16 in its high nibble, d stored as float16.
 */
export function quantizeQ4_0(values: Float32Array): Uint8Array {
  if (values.length % Q4_0_BLOCK !== 0) throw new Error(`Q4_0 needs whole blocks of ${Q4_0_BLOCK} values, got ${values.length}`)
  const blocks = values.length / Q4_0_BLOCK
  const out = new Uint8Array(blocks * Q4_0_BYTES)
  const view = new DataView(out.buffer)
  for (let b = 0; b < blocks; b++) {
    const x = b * Q4_0_BLOCK
    let amax = 0
    let max = 0
    for (let j = 0; j < Q4_0_BLOCK; j++) {
      const v = values[x + j]!
      if (amax < Math.abs(v)) {
        amax = Math.abs(v)
        max = v
      }
    }
    const d = f(max / -8)
    const id = d !== 0 ? f(1 / d) : 0
    const at = b * Q4_0_BYTES
    setFloat16(view, at, d, true)
    for (let j = 0; j < Q4_0_BLOCK / 2; j++) {
      // x * id + 8.5 is at least 0.5 (|x * id| <= 8), so the C cast's truncation is a floor.
      const q0 = Math.min(15, Math.trunc(f(f(values[x + j]! * id) + 8.5)))
      const q1 = Math.min(15, Math.trunc(f(f(values[x + j + Q4_0_BLOCK / 2]! * id) + 8.5)))
      out[at + 2 + j] = q0 | (q1 << 4)
    }
  }
  return out
}
