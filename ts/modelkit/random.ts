// Seeded pseudo-random numbers for the model generator: the same seed gives the same weights on
// every machine. Integer-only arithmetic (Math.imul, shifts), no Math.random, no transcendental
// functions, so the streams are bit-exact across platforms and Node versions.

/** splitmix32: a 32-bit mixing step, used to spread seeds. */
export function mix32(x: number): number {
  x = (x + 0x9e3779b9) | 0
  x = Math.imul(x ^ (x >>> 16), 0x85ebca6b)
  x = Math.imul(x ^ (x >>> 13), 0xc2b2ae35)
  return (x ^ (x >>> 16)) >>> 0
}

/** FNV-1a over a string's UTF-16 code units. */
export function hashString(s: string): number {
  let h = 0x811c9dc5
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i)
    h = Math.imul(h, 0x01000193)
  }
  return h >>> 0
}

/** xoshiro128**: fast, 128-bit state, good statistical quality for weight initialisation. */
export class Xoshiro128 {
  private a: number
  private b: number
  private c: number
  private d: number

  constructor(seed: number, stream = 0) {
    let s = mix32((seed >>> 0) ^ mix32(stream >>> 0))
    this.a = s = mix32(s)
    this.b = s = mix32(s)
    this.c = s = mix32(s)
    this.d = mix32(s)
    if ((this.a | this.b | this.c | this.d) === 0) this.d = 1
  }

  /** The next 32-bit unsigned integer. */
  nextU32(): number {
    const result = Math.imul(rotl(Math.imul(this.b, 5), 7), 9)
    const t = this.b << 9
    this.c ^= this.a
    this.d ^= this.b
    this.b ^= this.c
    this.a ^= this.d
    this.c ^= t
    this.d = rotl(this.d, 11)
    return result >>> 0
  }

  /** Uniform in [-1, 1), 24 bits of resolution (exactly representable in float32). */
  nextSigned(): number {
    return ((this.nextU32() >>> 8) - 0x800000) / 0x800000
  }
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k))
}

/** The stream a named tensor draws from: independent of generation order. */
export function tensorStream(seed: number, name: string): Xoshiro128 {
  return new Xoshiro128(seed, hashString(name))
}
