// GGUF rows of the 5-, 6- and 8-bit types -> com.microsoft.MatMulNBits 8-bit blocks (ONNX
// Runtime 1.30, CPU), exactly: each ggml block's integer codes become bytes code + 128 (no zero
// points are written: MatMulNBits takes 128 for 8-bit blocks without them), its scales the
// blocks' scales, and where the type has minimums they go to `mins` as for Q4_1 (int4.ts):
//
//   Q8_0   d, 32 int8 q                 w = q * d                      blocks of 32
//   Q5_0   d, 32 5-bit q                w = (q - 16) * d               blocks of 32
//   Q5_1   d, m, 32 5-bit q             w = q * d + m                  blocks of 32, mins m
//   Q5_K   8 sub-blocks of 32           w = q * (d sc) - (dmin mn)     blocks of 32, mins -dmin mn
//   Q6_K   16 sub-blocks of 16          w = (q - 32) * (d sc)          blocks of 16
//
// The int4 import keeps these tensors so rather than requantizing them to 4 bits (llama.cpp's
// Q4_K_M files hold Q6_K and Q5_0 tensors where 4 bits cost the most, and a tied Q8_0 lm_head),
// so that its weights are the file's own.

import { F16_TO_F32, scaleMinK4 } from './dequantize'
import { GGML_TYPES, GgmlTypeId, ggmlTypeName } from './ggml-types'

/** The zero point MatMulNBits assumes for 8-bit blocks without zero points. */
const ZERO_8BIT = 128

const f = Math.fround

export interface Int8Weight {
  /** MatMulNBits' block size: 32, or 16 (Q6_K's sub-blocks). */
  blockSize: number
  /** [N, K/blockSize, blockSize] */
  qweight: Uint8Array
  /** [N, K/blockSize] */
  scales: Float32Array
  /** [K/blockSize, N], for the types whose blocks have a minimum (Q5_1, Q5_K). */
  mins: Float32Array | undefined
}

/**
 * One ggml block, decoded to its integer codes (one per element, in element order) and each
 * sub-block's scale and minimum (value = code * scale + min).
 */
type CodeDecoder = (src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array, mins: Float32Array) => void

function f16(src: Uint8Array, at: number): number {
  return F16_TO_F32[src[at]! | (src[at + 1]! << 8)]!
}

function readU32(src: Uint8Array, at: number): number {
  return (src[at]! | (src[at + 1]! << 8) | (src[at + 2]! << 16) | (src[at + 3]! << 24)) >>> 0
}

function q8_0(src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array): void {
  scales[0] = f16(src, at)
  for (let j = 0; j < 32; j++) codes[j] = (src[at + 2 + j]! << 24) >> 24
}

/** The 32 five-bit codes of a Q5_0/Q5_1 block whose qh starts at `qh` and qs at `qs`. */
function fiveBitCodes(src: Uint8Array, qh: number, qs: number, codes: Int8Array, offset: number): void {
  const high = readU32(src, qh)
  for (let j = 0; j < 16; j++) {
    const b = src[qs + j]!
    codes[j] = ((b & 0x0f) | (((high >>> j) << 4) & 0x10)) - offset
    codes[j + 16] = ((b >> 4) | ((high >>> (j + 12)) & 0x10)) - offset
  }
}

function q5_0(src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array): void {
  scales[0] = f16(src, at)
  fiveBitCodes(src, at + 2, at + 6, codes, 16)
}

function q5_1(src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array, mins: Float32Array): void {
  scales[0] = f16(src, at)
  mins[0] = f16(src, at + 2)
  fiveBitCodes(src, at + 4, at + 8, codes, 0)
}

// Q5_K: 4 groups of 64 elements; sub-block 2g is the low nibbles of qs[32g ..], 2g + 1 the high
// ones; the fifth bit of element l of sub-block s is bit s of qh[l] (dequantize.ts, q5_k).
function q5_k(src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array, mins: Float32Array): void {
  const d = f16(src, at)
  const dmin = f16(src, at + 2)
  const qh = at + 16
  const qs = at + 48
  for (let s = 0; s < 8; s++) {
    const [sc, mn] = scaleMinK4(src, at + 4, s)
    scales[s] = f(d * sc)
    mins[s] = -f(dmin * mn)
  }
  for (let g = 0; g < 4; g++) {
    for (let l = 0; l < 32; l++) {
      const b = src[qs + 32 * g + l]!
      const h = src[qh + l]!
      codes[64 * g + l] = (b & 0x0f) + (h & (1 << (2 * g)) ? 16 : 0)
      codes[64 * g + 32 + l] = (b >> 4) + (h & (2 << (2 * g)) ? 16 : 0)
    }
  }
}

// Q6_K: two halves of 128 elements (dequantize.ts, q6_k); element l + 32i of half n has the
// scale of sub-block 8n + l / 16 + 2i.
function q6_k(src: Uint8Array, at: number, codes: Int8Array, scales: Float32Array): void {
  const d = f16(src, at + 208)
  for (let s = 0; s < 16; s++) scales[s] = f(d * ((src[at + 192 + s]! << 24) >> 24))
  for (let n = 0; n < 2; n++) {
    const ql = at + 64 * n
    const qh = at + 128 + 32 * n
    for (let l = 0; l < 32; l++) {
      const h = src[qh + l]!
      const a = src[ql + l]!
      const b = src[ql + l + 32]!
      const base = 128 * n + l
      codes[base] = ((a & 0x0f) | ((h & 3) << 4)) - 32
      codes[base + 32] = ((b & 0x0f) | (((h >> 2) & 3) << 4)) - 32
      codes[base + 64] = ((a >> 4) | (((h >> 4) & 3) << 4)) - 32
      codes[base + 96] = ((b >> 4) | (((h >> 6) & 3) << 4)) - 32
    }
  }
}

/** Each type's decoder and the MatMulNBits block size its sub-blocks give. */
const DECODERS: ReadonlyMap<number, { decode: CodeDecoder; blockSize: number; minimums: boolean }> = new Map([
  [GgmlTypeId.Q8_0, { decode: q8_0, blockSize: 32, minimums: false }],
  [GgmlTypeId.Q5_0, { decode: q5_0, blockSize: 32, minimums: false }],
  [GgmlTypeId.Q5_1, { decode: q5_1 as CodeDecoder, blockSize: 32, minimums: true }],
  [GgmlTypeId.Q5_K, { decode: q5_k as CodeDecoder, blockSize: 32, minimums: true }],
  [GgmlTypeId.Q6_K, { decode: q6_k, blockSize: 16, minimums: false }],
])

/** Whether the type's blocks are kept exactly as 8-bit blocks. */
export function mapsToInt8(type: number): boolean {
  return DECODERS.has(type)
}

/** MatMulNBits' block size for a type kept as 8-bit blocks. */
export function int8BlockSize(type: number): number {
  const d = DECODERS.get(type)
  if (!d) throw new Error(`${ggmlTypeName(type)} is not kept as 8-bit blocks`)
  return d.blockSize
}

/** Whether the type's 8-bit blocks have minimums (a `mins` tensor). */
export function int8HasMinimums(type: number): boolean {
  return DECODERS.get(type)?.minimums ?? false
}

/** Packs an [N, K] weight given row by row (`row(n)`: the GGUF bytes of output row n). */
export function packInt8(type: number, N: number, K: number, row: (n: number) => Uint8Array): Int8Weight {
  const d = DECODERS.get(type)
  const geometry = GGML_TYPES.get(type)
  if (!d || !geometry) throw new Error(`8-bit blocks are not made from ${ggmlTypeName(type)}`)
  if (K % geometry.blockSize !== 0) throw new Error(`rows of ${K} elements are not whole ${ggmlTypeName(type)} blocks`)
  const bs = d.blockSize
  const blocks = K / bs
  const perSource = geometry.blockSize / bs
  const out: Int8Weight = {
    blockSize: bs,
    qweight: new Uint8Array(N * K),
    scales: new Float32Array(N * blocks),
    mins: d.minimums ? new Float32Array(N * blocks) : undefined,
  }
  const codes = new Int8Array(geometry.blockSize)
  const scales = new Float32Array(perSource)
  const mins = new Float32Array(perSource)
  for (let n = 0; n < N; n++) {
    const src = row(n)
    for (let b = 0; b < K / geometry.blockSize; b++) {
      d.decode(src, b * geometry.typeSize, codes, scales, mins)
      const to = n * K + b * geometry.blockSize
      for (let i = 0; i < geometry.blockSize; i++) out.qweight[to + i] = codes[i]! + ZERO_8BIT
      for (let s = 0; s < perSource; s++) {
        const block = b * perSource + s
        out.scales[n * blocks + block] = scales[s]!
        if (out.mins) out.mins[block * N + n] = mins[s]!
      }
    }
  }
  return out
}

/** The value MatMulNBits (with the mins term) gives element k of row n: for tests and checks. */
export function int8Value(w: Int8Weight, N: number, K: number, n: number, k: number): number {
  const blocks = K / w.blockSize
  const block = Math.floor(k / w.blockSize)
  const product = f((w.qweight[n * K + k]! - ZERO_8BIT) * w.scales[n * blocks + block]!)
  return w.mins ? f(product + w.mins[block * N + n]!) : product
}
