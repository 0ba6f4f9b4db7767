// Generation is paced by the reader: a streamed turn whose iterator falls STREAM_HOLD_EVENTS (256)
// chunks behind is held in the core until the reader catches up (issue 30, item 5).
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { describeContract } from './setup'

const HOLD = 256
const LONG = { maxGeneratedTokens: 1500, ignoreEos: true }

/** Lets the driven loop run `ms` of macrotasks. */
const settle = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

describeContract(({ make }) => {
  describe('pacing by the reader', () => {
    for (const [name, sampling] of [
      ['greedy', {}],
      ['seeded sampling', { temperature: 1, topP: 0.9, seed: 77 }],
    ] as const) {
      it(`a streamed turn whose reader stops stops generating and resumes with the same tokens (${name})`, async () => {
        const options = { ...LONG, ...sampling }
        const reference = [...(await make({ seed: 5 }).generate('pace me', options).done).tokens]
        expect(reference).toHaveLength(LONG.maxGeneratedTokens)
        const engine = make({ seed: 5 })
        const request = engine.createRequest()
        const turn = request.beginTurn('pace me', options)
        const prompt = request.tokenCount
        const chunks = turn[Symbol.asyncIterator]()
        const tokens = [(await chunks.next()).value.token]
        const other = engine.createRequest().beginTurn('meanwhile', LONG)
        // The reader takes nothing more: the other turn runs to its end while this one waits.
        const otherResult = await other.done
        expect(otherResult.usage.generatedTokens).toBe(LONG.maxGeneratedTokens)
        const stalled = request.tokenCount - prompt
        expect(stalled).toBeGreaterThanOrEqual(HOLD)
        expect(stalled).toBeLessThan(HOLD + 8)
        await settle(50)
        expect(request.tokenCount - prompt).toBe(stalled)
        expect(request.state).toBe('active')
        for (let next = await chunks.next(); next.done !== true; next = await chunks.next()) tokens.push(next.value.token)
        expect(tokens).toEqual(reference)
        const result = await turn.done
        expect(result.finishReason).toBe('max-generated-tokens')
        expect([...result.tokens]).toEqual(reference)
      })
    }

    it('a turn awaited only through done is never held', async () => {
      const engine = make({ seed: 6 })
      engine.start()
      const turn = engine.createRequest().beginTurn('no reader', LONG)
      const result = await turn.done
      expect(result.usage.generatedTokens).toBe(LONG.maxGeneratedTokens)
    })

    it('one iterator that reads keeps the turn going while another stalls', async () => {
      const engine = make({ seed: 8 })
      const turn = engine.createRequest().beginTurn('two readers', LONG)
      const stalled = turn[Symbol.asyncIterator]()
      await stalled.next()
      let read = 0
      for await (const chunk of turn) {
        void chunk
        read++
      }
      expect(read).toBe(LONG.maxGeneratedTokens)
      expect((await turn.done).finishReason).toBe('max-generated-tokens')
    })

    it('cancelling or breaking out of a held turn ends it at once', async () => {
      const engine = make({ seed: 9 })
      const held = engine.createRequest().beginTurn('held', LONG)
      const chunks = held[Symbol.asyncIterator]()
      await chunks.next()
      const other = engine.createRequest().beginTurn('other', { maxGeneratedTokens: 2 * HOLD, ignoreEos: true })
      await other.done
      expect(held.request.state).toBe('active')
      await chunks.return!()
      const result = await held.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.usage.generatedTokens).toBeLessThan(HOLD + 8)
    })
  })
})
