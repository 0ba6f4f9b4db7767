// Dequantization of ggml tensor data to float32, exactly as ggml defines it (ggml-quants.c's
// dequantize_row_*, which gguf-py's quants.py mirrors in numpy). Every step that ggml computes in
// float32 is rounded to float32 here (Math.fround): a product or a sum of two float32 values
// computed in float64 and then rounded is the correctly rounded float32 result, so the values are
// bit-identical to ggml's (test/model/gguf-dequantize.test.ts checks them against gguf-py).
//
// Block layouts (bytes, little-endian; d, m, dmin are float16):
//   Q4_0  d | qs[16]                      x = (nibble - 8) * d
//   Q4_1  d m | qs[16]                    x = nibble * d + m
//   Q5_0  d | qh[4] | qs[16]              x = (nibble | high bit << 4) - 16) * d
//   Q5_1  d m | qh[4] | qs[16]            x = (nibble | high bit << 4) * d + m
//   Q8_0  d | qs[32] (int8)               x = q * d
//   Q4_K  d dmin | scales[12] | qs[128]   8 sub-blocks of 32: x = (d * sc) * nibble - (dmin * mn)
//   Q5_K  d dmin | scales[12] | qh[32] | qs[128]
//   Q6_K  ql[128] | qh[64] | scales[16] (int8) | d     16 sub-blocks of 16: x = (d * sc) * (q - 32)
// In the 32-element types, element j < 16 takes the low nibble of qs[j], element j + 16 the high
// one. Q4_K/Q5_K/Q6_K interleave differently (see each function).

import { getFloat16 } from '@petamoriken/float16'
import { GGML_TYPES, GgmlTypeId, ggmlTypeName } from './ggml-types'

const f = Math.fround

/** float16 bits -> value, for all 65536 patterns (built once with @petamoriken/float16). */
export const F16_TO_F32: Float32Array = (() => {
  const table = new Float32Array(65536)
  const view = new DataView(new ArrayBuffer(2))
  for (let bits = 0; bits < 65536; bits++) {
    view.setUint16(0, bits, true)
    table[bits] = getFloat16(view, 0, true)
  }
  return table
})()

type BlockDecoder = (src: Uint8Array, at: number, out: Float32Array, o: number) => void

function f16(src: Uint8Array, at: number): number {
  return F16_TO_F32[src[at]! | (src[at + 1]! << 8)]!
}

function q4_0(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at)
  for (let j = 0; j < 16; j++) {
    const b = src[at + 2 + j]!
    out[o + j] = ((b & 0x0f) - 8) * d
    out[o + j + 16] = ((b >> 4) - 8) * d
  }
}

function q4_1(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at)
  const m = f16(src, at + 2)
  for (let j = 0; j < 16; j++) {
    const b = src[at + 4 + j]!
    out[o + j] = f((b & 0x0f) * d + m)
    out[o + j + 16] = f((b >> 4) * d + m)
  }
}

function readU32(src: Uint8Array, at: number): number {
  return (src[at]! | (src[at + 1]! << 8) | (src[at + 2]! << 16) | (src[at + 3]! << 24)) >>> 0
}

function q5_0(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at)
  const qh = readU32(src, at + 2)
  for (let j = 0; j < 16; j++) {
    const b = src[at + 6 + j]!
    const h0 = ((qh >>> j) << 4) & 0x10
    const h1 = (qh >>> (j + 12)) & 0x10
    out[o + j] = (((b & 0x0f) | h0) - 16) * d
    out[o + j + 16] = (((b >> 4) | h1) - 16) * d
  }
}

function q5_1(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at)
  const m = f16(src, at + 2)
  const qh = readU32(src, at + 4)
  for (let j = 0; j < 16; j++) {
    const b = src[at + 8 + j]!
    const h0 = ((qh >>> j) << 4) & 0x10
    const h1 = (qh >>> (j + 12)) & 0x10
    out[o + j] = f(((b & 0x0f) | h0) * d + m)
    out[o + j + 16] = f(((b >> 4) | h1) * d + m)
  }
}

function q8_0(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at)
  for (let j = 0; j < 32; j++) out[o + j] = ((src[at + 2 + j]! << 24) >> 24) * d
}

/** The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4). */
export function scaleMinK4(src: Uint8Array, scales: number, j: number): [number, number] {
  const q = (i: number) => src[scales + i]!
  if (j < 4) return [q(j) & 63, q(j + 4) & 63]
  return [(q(j + 4) & 0x0f) | ((q(j - 4) >> 6) << 4), (q(j + 4) >> 4) | ((q(j) >> 6) << 4)]
}

/** Group g of a Q4_K/Q5_K block: the scales and minimums of its sub-blocks 2g and 2g + 1. */
function groupScales(src: Uint8Array, at: number, g: number): [number, number, number, number] {
  const d = f16(src, at)
  const dmin = f16(src, at + 2)
  const [sc1, m1] = scaleMinK4(src, at + 4, 2 * g)
  const [sc2, m2] = scaleMinK4(src, at + 4, 2 * g + 1)
  return [f(d * sc1), f(dmin * m1), f(d * sc2), f(dmin * m2)]
}

// Q4_K: 4 groups of 64 elements; group g uses qs[32g .. 32g+32): low nibbles are sub-block 2g,
// high nibbles sub-block 2g + 1.
function q4_k(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const qs = at + 16
  for (let g = 0; g < 4; g++) {
    const [d1, min1, d2, min2] = groupScales(src, at, g)
    for (let l = 0; l < 32; l++) {
      const b = src[qs + 32 * g + l]!
      out[o + 64 * g + l] = f(d1 * (b & 0x0f) - min1)
      out[o + 64 * g + 32 + l] = f(d2 * (b >> 4) - min2)
    }
  }
}

// Q5_K: as Q4_K, plus a fifth bit from qh[l]: bit 2g for the low half of group g, 2g + 1 for
// the high half.
function q5_k(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const qh = at + 16
  const qs = at + 48
  for (let g = 0; g < 4; g++) {
    const [d1, min1, d2, min2] = groupScales(src, at, g)
    const u1 = 1 << (2 * g)
    const u2 = 2 << (2 * g)
    for (let l = 0; l < 32; l++) {
      const b = src[qs + 32 * g + l]!
      const h = src[qh + l]!
      out[o + 64 * g + l] = f(d1 * ((b & 0x0f) + (h & u1 ? 16 : 0)) - min1)
      out[o + 64 * g + 32 + l] = f(d2 * ((b >> 4) + (h & u2 ? 16 : 0)) - min2)
    }
  }
}

// Q6_K: two halves of 128 elements; half n uses ql[64n ..], qh[32n ..], scales[8n ..]. Element
// l + 32 i (i = 0..3, l = 0..31) of a half takes 4 low bits from ql (low nibble of ql[l] / ql[l+32]
// for i = 0 / 1, high nibble for i = 2 / 3) and 2 high bits from qh[l] >> 2i.
function q6_k(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  const d = f16(src, at + 208)
  for (let n = 0; n < 2; n++) {
    const ql = at + 64 * n
    const qh = at + 128 + 32 * n
    const sc = at + 192 + 8 * n
    for (let l = 0; l < 32; l++) {
      const is = l >> 4
      const h = src[qh + l]!
      const a = src[ql + l]!
      const b = src[ql + l + 32]!
      const q1 = ((a & 0x0f) | ((h & 3) << 4)) - 32
      const q2 = ((b & 0x0f) | (((h >> 2) & 3) << 4)) - 32
      const q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
      const q4 = ((b >> 4) | (((h >> 6) & 3) << 4)) - 32
      const s = (i: number) => f(d * ((src[sc + is + 2 * i]! << 24) >> 24))
      const base = o + 128 * n + l
      out[base] = f(s(0) * q1)
      out[base + 32] = f(s(1) * q2)
      out[base + 64] = f(s(2) * q3)
      out[base + 96] = f(s(3) * q4)
    }
  }
}

function f32(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  out[o] = new DataView(src.buffer, src.byteOffset + at, 4).getFloat32(0, true)
}

function f16Element(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  out[o] = f16(src, at)
}

function bf16(src: Uint8Array, at: number, out: Float32Array, o: number): void {
  BF16_SCRATCH[0] = (src[at]! | (src[at + 1]! << 8)) << 16
  out[o] = BF16_VIEW[0]!
}
const BF16_SCRATCH = new Int32Array(1)
const BF16_VIEW = new Float32Array(BF16_SCRATCH.buffer)

const DECODERS: ReadonlyMap<number, BlockDecoder> = new Map<number, BlockDecoder>([
  [GgmlTypeId.F32, f32],
  [GgmlTypeId.F16, f16Element],
  [GgmlTypeId.BF16, bf16],
  [GgmlTypeId.Q4_0, q4_0],
  [GgmlTypeId.Q4_1, q4_1],
  [GgmlTypeId.Q5_0, q5_0],
  [GgmlTypeId.Q5_1, q5_1],
  [GgmlTypeId.Q8_0, q8_0],
  [GgmlTypeId.Q4_K, q4_k],
  [GgmlTypeId.Q5_K, q5_k],
  [GgmlTypeId.Q6_K, q6_k],
])

/** Whether the importer can dequantize tensors of this type. */
export function canDequantize(type: number): boolean {
  return DECODERS.has(type)
}

/**
 * Dequantizes whole blocks: `src` holds `elements / blockSize` blocks of `type`; the values go to
 * `out[offset ..]`. F32 data is copied as is (NaN payloads included).
 */
export function dequantize(type: number, src: Uint8Array, elements: number, out: Float32Array, offset = 0): void {
  const decode = DECODERS.get(type)
  const geometry = GGML_TYPES.get(type)
  if (!decode || !geometry) throw new Error(`cannot dequantize ${ggmlTypeName(type)}`)
  const { blockSize, typeSize } = geometry
  if (elements % blockSize !== 0) throw new Error(`${elements} elements are not whole ${ggmlTypeName(type)} blocks`)
  const blocks = elements / blockSize
  if (src.length < blocks * typeSize) throw new Error(`${ggmlTypeName(type)}: ${src.length} bytes hold fewer than ${blocks} blocks`)
  if (type === GgmlTypeId.F32 && (src.byteOffset & 3) === 0) {
    out.set(new Float32Array(src.buffer, src.byteOffset, elements), offset)
    return
  }
  for (let b = 0; b < blocks; b++) decode(src, b * typeSize, out, offset + b * blockSize)
}

