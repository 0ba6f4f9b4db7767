// The numbers llama.cpp's `llama-perplexity --kl-divergence` reports for a quantization, computed
// here from full next-token distributions: per position, KL(reference || variant) in nats over the
// whole vocabulary, whether the two most likely tokens agree, and each side's negative log
// likelihood of the token that actually comes next (perplexity = exp of its mean).
//
// Distributions arrive as rows of raw logits; logSoftmaxInPlace turns a row into log-probabilities
// (max-shifted, sums in float64), which is what the reference keeps and what KL reads.

/** Rows of `vocab` logits -> log-probabilities, in place. */
export function logSoftmaxInPlace(rows: Float32Array, vocab: number): void {
  for (let start = 0; start < rows.length; start += vocab) {
    const row = rows.subarray(start, start + vocab)
    let max = -Infinity
    for (let i = 0; i < vocab; i++) if (row[i]! > max) max = row[i]!
    let sum = 0
    for (let i = 0; i < vocab; i++) sum += Math.exp(row[i]! - max)
    const logZ = max + Math.log(sum)
    for (let i = 0; i < vocab; i++) row[i] = row[i]! - logZ
  }
}

/** Index of the largest value; the lowest index wins ties. */
export function argmax(row: Float32Array): number {
  let best = 0
  for (let i = 1; i < row.length; i++) if (row[i]! > row[best]!) best = i
  return best
}

/** KL(p || q) in nats of two log-probability rows (terms where p underflows to 0 contribute 0). */
export function klDivergence(logP: Float32Array, logQ: Float32Array): number {
  let kl = 0
  for (let i = 0; i < logP.length; i++) {
    const p = Math.exp(logP[i]!)
    if (p > 0) kl += p * (logP[i]! - logQ[i]!)
  }
  // A sum of float32 log-probabilities can come out a hair below 0 for identical distributions.
  return Math.max(0, kl)
}

/** What a variant's rows are compared with: the reference's log-probabilities and top tokens. */
export interface Reference {
  vocab: number
  /** Scored positions x vocab log-probabilities. */
  logProbs: Float32Array
  top1: Int32Array
}

/** Per-position records of one variant against the reference, filled chunk by chunk. */
export class Comparison {
  readonly kl: Float64Array
  readonly sameTop1: Uint8Array
  readonly nll: Float64Array
  private filled = 0

  constructor(
    private readonly reference: Reference | null,
    /** The text's token ids: position i predicts tokens[i + 1]. */
    private readonly tokens: ArrayLike<number>,
    readonly positions: number,
  ) {
    this.kl = new Float64Array(positions)
    this.sameTop1 = new Uint8Array(positions)
    this.nll = new Float64Array(positions)
  }

  /** Log-probability rows for positions [start, start + rows / vocab), in order; rows past the scored ones are ignored. */
  add(start: number, logProbs: Float32Array, vocab: number): void {
    if (start !== this.filled) throw new Error(`positions arrive out of order: ${start}, expected ${this.filled}`)
    const n = Math.min(logProbs.length / vocab, this.positions - start)
    for (let j = 0; j < n; j++) {
      const at = start + j
      const row = logProbs.subarray(j * vocab, (j + 1) * vocab)
      this.nll[at] = -row[this.tokens[at + 1]!]!
      if (this.reference === null) {
        this.sameTop1[at] = 1
        continue
      }
      const ref = this.reference.logProbs.subarray(at * vocab, (at + 1) * vocab)
      this.kl[at] = klDivergence(ref, row)
      this.sameTop1[at] = argmax(row) === this.reference.top1[at] ? 1 : 0
    }
    this.filled = start + n
  }

  get complete(): boolean {
    return this.filled === this.positions
  }

  summary(): QualitySummary {
    if (!this.complete) throw new Error(`only ${this.filled} of ${this.positions} positions were scored`)
    const sorted = Float64Array.from(this.kl).sort()
    const mean = (xs: ArrayLike<number>) => {
      let s = 0
      for (let i = 0; i < xs.length; i++) s += xs[i]!
      return s / xs.length
    }
    return {
      positions: this.positions,
      meanKl: mean(this.kl),
      p99Kl: quantile(sorted, 0.99),
      maxKl: sorted[sorted.length - 1]!,
      top1Agreement: mean(this.sameTop1),
      perplexity: Math.exp(mean(this.nll)),
    }
  }
}

export interface QualitySummary {
  positions: number
  /** Nats, mean over positions. */
  meanKl: number
  p99Kl: number
  maxKl: number
  /** Fraction of positions whose most likely token is the reference's. */
  top1Agreement: number
  /** exp(mean negative log likelihood of the next token of the text). */
  perplexity: number
}

/** The q-quantile of ascending values, linearly interpolated (numpy's default). */
export function quantile(sorted: ArrayLike<number>, q: number): number {
  const at = q * (sorted.length - 1)
  const lo = Math.floor(at)
  const hi = Math.min(lo + 1, sorted.length - 1)
  return sorted[lo]! + (at - lo) * (sorted[hi]! - sorted[lo]!)
}

/** The reference's own comparison gives what the variants are compared with. */
export function referenceOf(logProbs: Float32Array, vocab: number): Reference {
  const positions = logProbs.length / vocab
  const top1 = new Int32Array(positions)
  for (let at = 0; at < positions; at++) top1[at] = argmax(logProbs.subarray(at * vocab, (at + 1) * vocab))
  return { vocab, logProbs, top1 }
}
