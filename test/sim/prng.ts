// A small seeded generator for workloads (splitmix32 state, mulberry32 output). Tests must be
// reproducible from their seed alone, so nothing here reads a clock or Math.random.

export class Prng {
  private state: number

  constructor(seed: number) {
    // Spread small consecutive seeds over the whole state space.
    let s = (seed ^ 0x9e3779b9) >>> 0
    s = Math.imul(s ^ (s >>> 16), 0x85ebca6b) >>> 0
    s = Math.imul(s ^ (s >>> 13), 0xc2b2ae35) >>> 0
    this.state = (s ^ (s >>> 16)) >>> 0
  }

  /** A uniform 32-bit unsigned integer. */
  nextU32(): number {
    this.state = (this.state + 0x6d2b79f5) >>> 0
    let t = this.state
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return (t ^ (t >>> 14)) >>> 0
  }

  /** A uniform float in [0, 1). */
  next(): number {
    return this.nextU32() / 4294967296
  }

  /** A uniform integer in [lo, hi] (both inclusive). */
  int(lo: number, hi: number): number {
    if (hi < lo) return lo
    return lo + Math.floor(this.next() * (hi - lo + 1))
  }

  chance(p: number): boolean {
    return this.next() < p
  }

  pick<T>(items: readonly T[]): T {
    return items[Math.floor(this.next() * items.length)]
  }

  /** Picks a key of `weights` with probability proportional to its weight. */
  weighted<K extends string>(weights: Record<K, number>): K {
    const entries = Object.entries(weights) as [K, number][]
    const total = entries.reduce((sum, [, w]) => sum + w, 0)
    let x = this.next() * total
    for (const [key, w] of entries) {
      x -= w
      if (x < 0) return key
    }
    return entries[entries.length - 1][0]
  }

  /** `length` token ids in [lo, hi]. */
  tokens(length: number, lo: number, hi: number): number[] {
    const out = new Array<number>(length)
    for (let i = 0; i < length; i++) out[i] = this.int(lo, hi)
    return out
  }
}
