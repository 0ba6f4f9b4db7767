// float32 -> float16 bits, rounded to nearest even (what a Cast to float16 does), for the float16
// folders' weights and constants. Node 20 has no Float16Array.

const f32 = new Float32Array(1)
const u32 = new Uint32Array(f32.buffer)

/** The IEEE 754 half-precision bits nearest to `value` (ties to even; overflow to infinity). */
export function toHalfBits(value: number): number {
  f32[0] = value
  const x = u32[0]!
  const sign = (x >>> 16) & 0x8000
  const exponent = (x >>> 23) & 0xff
  const mantissa = x & 0x7fffff
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0) // inf, nan
  const e = exponent - 127 + 15
  if (e >= 0x1f) return sign | 0x7c00 // too large: infinity
  if (e <= 0) {
    // Subnormal half (or zero): shift the implicit-one mantissa right, round to nearest even.
    if (e < -10) return sign
    const m = mantissa | 0x800000
    const shift = 14 - e
    const half = m >>> shift
    const rest = m & ((1 << shift) - 1)
    const midpoint = 1 << (shift - 1)
    return sign | (half + (rest > midpoint || (rest === midpoint && (half & 1)) ? 1 : 0))
  }
  const half = (e << 10) | (mantissa >>> 13)
  const rest = mantissa & 0x1fff
  // A carry out of the mantissa correctly bumps the exponent (up to infinity).
  return sign | (half + (rest > 0x1000 || (rest === 0x1000 && (half & 1)) ? 1 : 0))
}

/** float32 values -> their float16 bits. */
export function toHalfArray(values: ArrayLike<number>, out = new Uint16Array(values.length)): Uint16Array {
  for (let i = 0; i < values.length; i++) out[i] = toHalfBits(values[i]!)
  return out
}
