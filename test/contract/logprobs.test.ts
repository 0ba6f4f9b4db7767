// Log-probabilities: each generated token's, with the best alternatives, delivered with the token
// when a turn asks (TurnOptions.logprobs) and absent otherwise. Run on both backends (setup.ts),
// and compared across them bit for bit.
import { describe, expect, it } from 'vitest'
import { ortex } from '../helpers/backends'
import { describeContract } from './setup'

/** The simulated model's candidate logits (crates/ortex-core/src/sim). */
const SIM_LOGITS = [4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5]
const LOG_TOTAL = Math.log(SIM_LOGITS.reduce((sum, l) => sum + Math.exp(l), 0))

describeContract(({ make }) => {
  describe('logprobs', () => {
    it('greedy tokens carry the best candidate: log-softmax of the raw logits, alternatives best first', async () => {
      const engine = make({ seed: 4 })
      const turn = engine.generate('logprobs please', { maxGeneratedTokens: 12, logprobs: 20 })
      const chunks = []
      for await (const chunk of turn) chunks.push(chunk)
      const result = await turn.done
      expect(result.logprobs).toHaveLength(12)
      chunks.forEach((chunk, i) => {
        const entry = chunk.logprob!
        expect(entry).toEqual(result.logprobs![i])
        expect(entry.token).toBe(chunk.token)
        // The simulated row is its 8 candidates: all of them are the alternatives.
        expect(entry.top).toHaveLength(8)
        expect(entry.top[0]!.token).toBe(chunk.token)
        expect(entry.logprob).toBe(entry.top[0]!.logprob)
        expect(entry.logprob).toBeCloseTo(4.0 - LOG_TOTAL, 12)
        entry.top.forEach((t, k) => expect(t.logprob).toBeCloseTo(SIM_LOGITS[k]! - LOG_TOTAL, 12))
        expect(entry.top.reduce((sum, t) => sum + Math.exp(t.logprob), 0)).toBeCloseTo(1, 12)
      })
    })

    it('sampled tokens: the entry is the sampled token, top holds the asked count', async () => {
      const engine = make({ seed: 4 })
      const result = await engine.generate('sample', { maxGeneratedTokens: 16, temperature: 1.5, seed: 8, logprobs: 3 }).done
      expect(result.logprobs!.map((e) => e.token)).toEqual(Array.from(result.tokens))
      for (const entry of result.logprobs!) {
        expect(entry.top).toHaveLength(3)
        expect(entry.top[0]!.logprob).toBeGreaterThanOrEqual(entry.top[1]!.logprob)
        expect(entry.logprob).toBeLessThanOrEqual(0)
        expect(entry.logprob).toBeGreaterThanOrEqual(SIM_LOGITS[7]! - LOG_TOTAL - 1e-12)
      }
      // Some sampled token was not the best: its logprob is below the top one.
      expect(result.logprobs!.some((e) => e.logprob < e.top[0]!.logprob)).toBe(true)
      const none = await engine.generate('plain', { maxGeneratedTokens: 4, logprobs: 0 }).done
      expect(none.logprobs!.every((e) => e.top.length === 0)).toBe(true)
    })

    it('absent unless asked, and validated', async () => {
      const engine = make()
      const turn = engine.generate('x', { maxGeneratedTokens: 3 })
      for await (const chunk of turn) expect('logprob' in chunk).toBe(false)
      expect('logprobs' in (await turn.done)).toBe(false)
      for (const bad of [21, -1, 1.5, '2']) {
        expect(() => engine.generate('x', { logprobs: bad as never })).toThrow(expect.objectContaining({ code: 'INVALID_ARGUMENT' }))
      }
    })
  })
})

describe('logprobs across targets', () => {
  it('native and wasm give the same numbers, bit for bit, also with penalties and sampling', async () => {
    const run = async (backend: 'native' | 'wasm') => {
      const engine = ortex(backend).Engine.simulated({ seed: 21, vocabSize: 500 })
      const options = { maxGeneratedTokens: 24, temperature: 0.9, topP: 0.8, seed: 5, repetitionPenalty: 1.3, logprobs: 5 }
      const result = await engine.generate('the same on both', options).done
      await engine.close()
      return result.logprobs!
    }
    const [native, wasm] = await Promise.all([run('native'), run('wasm')])
    expect(native).toHaveLength(24)
    expect(wasm).toEqual(native)
  })
})
