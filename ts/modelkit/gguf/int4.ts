// GGUF weight rows -> com.microsoft.MatMulNBits 4-bit blocks of 32 (ONNX Runtime 1.30, CPU).
//
// MatMulNBits computes y = x W^T with W [N, K] stored as B uint8 [N, K/32, 16] (element k of a
// block in byte k/2, low nibble first), scales float32 [N, K/32] and zero points uint8
// [N, ceil(K/64)] (two 4-bit zero points a byte, low nibble first): w = (q - zero) * scale.
// A GGUF weight is rows of output features with blocks along the input, which is that layout:
//
//   Q4_0   d, 32 nibbles           w = (q - 8) * d                    exact: zero 8, scale d
//   Q4_1   d, m, 32 nibbles        w = q * d + m                      exact: zero 0, scale d, min m
//   Q4_K   8 sub-blocks of 32      w = q * (d sc) - (dmin mn)         exact: zero 0, scale d sc, min -dmin mn
//   other  (F32/F16/BF16, Q5_*, Q8_0, Q5_K, Q6_K): requantized from the dequantized values with
//          ONNX Runtime's blockwise quantizer (MlasQuantizeBlockwise, what onnxruntime-genai's
//          builder uses): range widened to include 0, scale = (max - min) / 15, zero = round(-min / scale).
//
// MatMulNBits has no per-block minimum, so for Q4_1 and Q4_K the minimums go to `mins`
// [K/32, N] and the graph adds (x's block sums) x mins (decoder.ts, int4Linear): the same sum
// ggml's own Q4_1 dot product forms. ONNX Runtime's float zero points would also represent them
// but take the kernel's slow unpacked path, which defeats the point of 4-bit weights.

import { dequantize, F16_TO_F32, scaleMinK4 } from './dequantize'
import { GgmlTypeId, ggmlTypeName } from './ggml-types'

export const INT4_BLOCK = 32

export interface Int4Weight {
  /** [N, K/32, 16] */
  qweight: Uint8Array
  /** [N, K/32] */
  scales: Float32Array
  /** [N, ceil(K/64)] */
  qzeros: Uint8Array
  /** [K/32, N], for the types whose blocks have a minimum (Q4_1, Q4_K). */
  mins: Float32Array | undefined
  /** Whether the blocks are the file's own (exact) or recomputed from dequantized values. */
  mapping: 'exact' | 'requantized'
}

const f = Math.fround

/** The types whose blocks carry a minimum (w = q * scale + min): they need the `mins` term. */
export function hasMinimums(type: number): boolean {
  return type === GgmlTypeId.Q4_1 || type === GgmlTypeId.Q4_K
}

/** The types whose 4-bit blocks MatMulNBits represents exactly. */
export function mapsExactly(type: number): boolean {
  return type === GgmlTypeId.Q4_0 || type === GgmlTypeId.Q4_1 || type === GgmlTypeId.Q4_K
}

/**
 * Packs an [N, K] weight given row by row (`row(n)` returns the GGUF bytes of output row n, in
 * the file's type). K must be a multiple of 32.
 */
export function packInt4(type: number, N: number, K: number, row: (n: number) => Uint8Array): Int4Weight {
  if (K % INT4_BLOCK !== 0) throw new Error(`MatMulNBits needs rows of a multiple of ${INT4_BLOCK} elements, got ${K}`)
  const blocks = K / INT4_BLOCK
  const zeroBytes = Math.ceil(blocks / 2)
  const out: Int4Weight = {
    qweight: new Uint8Array(N * blocks * 16),
    scales: new Float32Array(N * blocks),
    qzeros: new Uint8Array(N * zeroBytes),
    mins: hasMinimums(type) ? new Float32Array(blocks * N) : undefined,
    mapping: mapsExactly(type) ? 'exact' : 'requantized',
  }
  const values = new Float32Array(K)
  const block = new Uint8Array(INT4_BLOCK)
  for (let n = 0; n < N; n++) {
    const src = row(n)
    const sink: BlockSink = (b, q, scale, zero, min) => {
      const at = (n * blocks + b) * 16
      for (let i = 0; i < 16; i++) out.qweight[at + i] = q[2 * i]! | (q[2 * i + 1]! << 4)
      out.scales[n * blocks + b] = scale
      out.qzeros[n * zeroBytes + (b >> 1)]! |= zero << ((b & 1) * 4)
      if (out.mins) out.mins[b * N + n] = min
    }
    switch (type) {
      case GgmlTypeId.Q4_0:
        q4_0Blocks(src, blocks, block, sink)
        break
      case GgmlTypeId.Q4_1:
        q4_1Blocks(src, blocks, block, sink)
        break
      case GgmlTypeId.Q4_K:
        q4_kBlocks(src, blocks, block, sink)
        break
      default:
        dequantize(type, src, K, values)
        requantizeBlocks(values, blocks, block, sink)
    }
  }
  return out
}

/** Receives block b's 32 codes (0..15, element order), its scale, zero point and minimum. */
type BlockSink = (b: number, q: Uint8Array, scale: number, zero: number, min: number) => void

function f16(src: Uint8Array, at: number): number {
  return F16_TO_F32[src[at]! | (src[at + 1]! << 8)]!
}

/** The 32 nibbles of a Q4_0 / Q4_1 block in element order: qs[j] low for j, high for j + 16. */
function splitNibbles(src: Uint8Array, qs: number, q: Uint8Array): void {
  for (let j = 0; j < 16; j++) {
    q[j] = src[qs + j]! & 0x0f
    q[j + 16] = src[qs + j]! >> 4
  }
}

function q4_0Blocks(src: Uint8Array, blocks: number, q: Uint8Array, sink: BlockSink): void {
  for (let b = 0; b < blocks; b++) {
    const at = b * 18
    splitNibbles(src, at + 2, q)
    sink(b, q, f16(src, at), 8, 0)
  }
}

function q4_1Blocks(src: Uint8Array, blocks: number, q: Uint8Array, sink: BlockSink): void {
  for (let b = 0; b < blocks; b++) {
    const at = b * 20
    splitNibbles(src, at + 4, q)
    sink(b, q, f16(src, at), 0, f16(src, at + 2))
  }
}

// A Q4_K super-block holds sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles) of qs[32g ..].
function q4_kBlocks(src: Uint8Array, blocks: number, q: Uint8Array, sink: BlockSink): void {
  if (blocks % 8 !== 0) throw new Error(`${ggmlTypeName(GgmlTypeId.Q4_K)} rows are whole super-blocks of 256`)
  for (let sb = 0; sb < blocks / 8; sb++) {
    const at = sb * 144
    const d = f16(src, at)
    const dmin = f16(src, at + 2)
    for (let j = 0; j < 8; j++) {
      const [sc, mn] = scaleMinK4(src, at + 4, j)
      const qs = at + 16 + 32 * (j >> 1)
      const shift = (j & 1) * 4
      for (let l = 0; l < 32; l++) q[l] = (src[qs + l]! >> shift) & 0x0f
      sink(sb * 8 + j, q, f(d * sc), 0, -f(dmin * mn))
    }
  }
}

/** ONNX Runtime's blockwise asymmetric 4-bit quantization of float32 values (see the header). */
function requantizeBlocks(values: Float32Array, blocks: number, q: Uint8Array, sink: BlockSink): void {
  for (let b = 0; b < blocks; b++) {
    const at = b * INT4_BLOCK
    let min = 0
    let max = 0
    for (let i = 0; i < INT4_BLOCK; i++) {
      const v = values[at + i]!
      if (v < min) min = v
      if (v > max) max = v
    }
    const scale = f((max - min) / 15)
    const zero = scale === 0 ? 0 : clamp(Math.round(f(-min / scale)), 0, 15)
    const inverse = scale === 0 ? 0 : f(1 / scale)
    for (let i = 0; i < INT4_BLOCK; i++) q[i] = clamp(Math.round(f(f(values[at + i]! * inverse) + zero)), 0, 15)
    sink(b, q, scale, zero, 0)
  }
}

function clamp(x: number, lo: number, hi: number): number {
  return x < lo ? lo : x > hi ? hi : x
}

/** The value MatMulNBits (plus the minimum term) gives element k of row n: for tests and checks. */
export function int4Value(w: Int4Weight, N: number, K: number, n: number, k: number): number {
  const blocks = K / INT4_BLOCK
  const b = Math.floor(k / INT4_BLOCK)
  const e = k % INT4_BLOCK
  const byte = w.qweight[(n * blocks + b) * 16 + (e >> 1)]!
  const code = e & 1 ? byte >> 4 : byte & 0x0f
  const zeroByte = w.qzeros[n * Math.ceil(blocks / 2) + (b >> 1)]!
  const zero = b & 1 ? zeroByte >> 4 : zeroByte & 0x0f
  const scaled = f((code - zero) * w.scales[n * blocks + b]!)
  return w.mins ? f(scaled + w.mins[b * N + n]!) : scaled
}
