// The quality benchmark's arithmetic (bench/quality/metrics.ts): KL divergence, top-1 agreement
// and perplexity over rows of logits, checked against values worked out by hand.

import { describe, expect, it } from 'vitest'

import { Comparison, klDivergence, logSoftmaxInPlace, quantile, referenceOf } from '../bench/quality/metrics'

const logProbs = (...rows: number[][]) => {
  const out = Float32Array.from(rows.flat())
  logSoftmaxInPlace(out, rows[0]!.length)
  return out
}

describe('quality metrics', () => {
  it('log-softmax rows sum to probability 1 and keep the logits\' differences', () => {
    const rows = logProbs([1000, 1001, 999], [0, 0, 0])
    expect(Math.exp(rows[0]!) + Math.exp(rows[1]!) + Math.exp(rows[2]!)).toBeCloseTo(1, 6)
    expect(rows[1]! - rows[0]!).toBeCloseTo(1, 4)
    expect(rows[3]).toBeCloseTo(-Math.log(3), 6)
  })

  it('KL(p || q) is 0 for the same row and the textbook value for two', () => {
    const p = logProbs([Math.log(0.5), Math.log(0.5)])
    const q = logProbs([Math.log(0.9), Math.log(0.1)])
    expect(klDivergence(p, p)).toBe(0)
    expect(klDivergence(p, q)).toBeCloseTo(0.5 * Math.log(0.5 / 0.9) + 0.5 * Math.log(0.5 / 0.1), 6)
  })

  it('a variant against a reference: mean and p99 KL, top-1 agreement, perplexity of the next tokens', () => {
    const tokens = [0, 1, 0] // position 0 predicts 1, position 1 predicts 0
    const reference = referenceOf(logProbs([0, 2], [2, 0]), 2)
    const variant = new Comparison(reference, tokens, 2)
    variant.add(0, logProbs([0, 2]), 2) // the same distribution
    variant.add(1, logProbs([0, 2]), 2) // its most likely token is the other one
    const s = variant.summary()
    const p = 1 / (1 + Math.exp(-2)) // the likelier token's probability
    expect(s.top1Agreement).toBe(0.5)
    expect(s.meanKl).toBeCloseTo((p * Math.log(p / (1 - p)) + (1 - p) * Math.log((1 - p) / p)) / 2, 5)
    expect(s.perplexity).toBeCloseTo(Math.exp((-Math.log(p) - Math.log(1 - p)) / 2), 5)
    expect(() => new Comparison(reference, tokens, 2).summary()).toThrow(/only 0 of 2 positions/)
    expect(() => new Comparison(reference, tokens, 2).add(1, logProbs([0, 2]), 2)).toThrow(/out of order/)
  })

  it('quantiles interpolate as numpy does', () => {
    expect(quantile([1, 2, 3, 4, 5], 0.99)).toBeCloseTo(4.96, 10)
    expect(quantile([7], 0.99)).toBe(7)
  })
})
