// GGUF Q8_0 rows -> com.microsoft.MatMulNBits 8-bit blocks of 32 (ONNX Runtime 1.30, CPU),
// exactly:
//
//   Q8_0   d, 32 int8 q            w = q * d            B uint8 [N, K/32, 32] = q + 128, scales d
//
// No zero points are written: MatMulNBits takes 128 for 8-bit blocks without them. The int4
// import keeps a Q8_0 lm_head so (SmolLM2's, tied to its Q8_0 embedding), as llama.cpp does,
// instead of requantizing it to 4 bits.

import { F16_TO_F32 } from './dequantize'
import { GgmlTypeId, ggmlTypeName } from './ggml-types'
import { INT4_BLOCK } from './int4'

/** Bytes of one Q8_0 block: the f16 scale and 32 int8 codes. */
const Q8_0_BLOCK_BYTES = 34
/** The zero point MatMulNBits assumes for 8-bit blocks without zero points. */
const ZERO_8BIT = 128

export interface Int8Weight {
  /** [N, K/32, 32] */
  qweight: Uint8Array
  /** [N, K/32] */
  scales: Float32Array
}

/** Packs a Q8_0 [N, K] weight given row by row (`row(n)`: the GGUF bytes of output row n). */
export function packQ8_0(type: number, N: number, K: number, row: (n: number) => Uint8Array): Int8Weight {
  if (type !== GgmlTypeId.Q8_0) throw new Error(`8-bit blocks are made from Q8_0 only, not ${ggmlTypeName(type)}`)
  if (K % INT4_BLOCK !== 0) throw new Error(`8-bit blocks need rows of a multiple of ${INT4_BLOCK} elements, got ${K}`)
  const blocks = K / INT4_BLOCK
  const out: Int8Weight = { qweight: new Uint8Array(N * K), scales: new Float32Array(N * blocks) }
  for (let n = 0; n < N; n++) {
    const src = row(n)
    for (let b = 0; b < blocks; b++) {
      const at = b * Q8_0_BLOCK_BYTES
      out.scales[n * blocks + b] = F16_TO_F32[src[at]! | (src[at + 1]! << 8)]!
      const to = (n * blocks + b) * INT4_BLOCK
      // An int8 code c is byte (c & 0xff); c + 128 is that byte with its top bit flipped.
      for (let i = 0; i < INT4_BLOCK; i++) out.qweight[to + i] = src[at + 2 + i]! ^ 0x80
    }
  }
  return out
}

/** The value MatMulNBits gives element k of row n: for tests and checks. */
export function int8Value(w: Int8Weight, K: number, n: number, k: number): number {
  const blocks = K / INT4_BLOCK
  return Math.fround((w.qweight[n * K + k]! - ZERO_8BIT) * w.scales[n * blocks + Math.floor(k / INT4_BLOCK)]!)
}
