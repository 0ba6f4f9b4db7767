// A turn's text is the core's (crates/ortex-core/src/output.rs, issue 29 item 1): each event carries
// its text delta, a character split across tokens comes whole with the token that completes it,
// a stop string ends the turn in the run that produced it with the text cut before it, and
// logprobs carry their token text. Run on both backends (setup.ts), and compared across them.
import { describe, expect, it } from 'vitest'
import { ortex } from '../helpers/backends'
import { FLAGS, drain, step, tokensOf, type EventCopy } from '../helpers/util'
import { describeContract } from './setup'

/** The simulated vocabulary of bytes only (ids 3 + byte): every token is one UTF-8 byte. */
const BYTES_ONLY = { seed: 3, vocabSize: 259, eosProbability: 0 }
const isAscii = (b: number) => b < 0x80
const isLead2 = (b: number) => b >= 0xc2 && b <= 0xdf
const isContinuation = (b: number) => b >= 0x80 && b <= 0xbf

describeContract(({ make }) => {
  describe('text', () => {
    it('a character split across byte tokens comes whole with the token that completes it', async () => {
      const engine = make(BYTES_ONLY)
      const turn = engine.generate('bytes', { maxGeneratedTokens: 2000, ignoreEos: true })
      const chunks: { token: number; text: string }[] = []
      for await (const chunk of turn) chunks.push(chunk)
      const result = await turn.done
      expect(chunks.map((c) => c.text).join('')).toBe(result.text)
      expect(result.text).toBe(engine.detokenize(result.tokens))
      const bytes = chunks.map((c) => c.token - 3)
      let split = 0
      for (let i = 1; i + 1 < bytes.length; i++) {
        if (!isAscii(bytes[i - 1]!) || !isLead2(bytes[i]!) || !isContinuation(bytes[i + 1]!)) continue
        split++
        expect(chunks[i]!.text).toBe('') // held back: it ends in an incomplete character
        expect(chunks[i + 1]!.text).toBe(Buffer.from([bytes[i]!, bytes[i + 1]!]).toString('utf8'))
      }
      expect(split).toBeGreaterThan(0)
    })

    it('events carry the text delta; a run decodes one string for all of them', () => {
      const engine = make({ seed: 5, eosProbability: 0 })
      const buffer = engine.createEventBuffer(16)
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn('one', { maxGeneratedTokens: 6 })
      b.beginTurn('two', { maxGeneratedTokens: 6 })
      const events = drain(engine, buffer)
      for (const request of [a, b]) {
        const mine = events.filter((e) => e.request === request)
        expect(mine.map((e) => e.text).join('')).toBe(engine.detokenize(tokensOf(events, request)))
        expect(mine.filter((e) => e.flags & FLAGS.Token).every((e) => e.text.length > 0)).toBe(true)
      }
    })

    it('a stop string spanning tokens finishes the turn in the run that made it, its text cut before it', () => {
      const free = make({ seed: 6, eosProbability: 0 })
      const reference = free.createRequest()
      reference.beginTurn('stop text', { maxGeneratedTokens: 12 })
      const freeEvents = drain(free, free.createEventBuffer(16))
      const whole = freeEvents.map((e) => e.text).join('')
      // Word tokens read " " + 4 letters: the last two letters of the second token and the
      // first two characters of the third span a token boundary.
      const boundary = freeEvents[0]!.text.length + freeEvents[1]!.text.length
      const stop = whole.slice(boundary - 2, boundary + 2)
      const at = whole.indexOf(stop)
      const engine = make({ seed: 6, eosProbability: 0 })
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      const turn = request.beginTurn('stop text', { maxGeneratedTokens: 12, stop: ['absent', stop] })
      const runs: EventCopy[][] = []
      while (engine.hasPendingWork()) runs.push(step(engine, buffer))
      const last = runs.at(-1)!
      expect(last).toHaveLength(1)
      expect(last[0]).toMatchObject({ flags: FLAGS.Token | FLAGS.TurnFinished, finishReason: 'stop' })
      const tokens = tokensOf(runs.flat(), request)
      // Ends with the token whose text completed the stop string: no token after it.
      let length = 0
      const completing = freeEvents.findIndex((e) => (length += e.text.length) >= at + stop.length)
      expect(tokens).toEqual(tokensOf(freeEvents, reference).slice(0, completing + 1))
      expect(runs.flat().map((e) => e.text).join('')).toBe(whole.slice(0, at))
      return turn.done.then((result) => {
        expect(result.text).toBe(whole.slice(0, at))
        expect(result.stop).toEqual({ kind: 'string', index: 1 })
        expect(result.usage.generatedTokens).toBe(completing + 1)
      })
    })

    it('a cancelled turn keeps the text held back for a possible stop string', async () => {
      const engine = make({ seed: 5, eosProbability: 0 })
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      // Every word token ends in a vowel: these stop strings hold the last one back.
      const turn = request.beginTurn('hold', { maxGeneratedTokens: 20, stop: ['a zz', 'e zz', 'i zz', 'o zz', 'u zz'] })
      const before = [step(engine, buffer), step(engine, buffer), step(engine, buffer)].flat()
      const tokens = tokensOf(before, request)
      const whole = engine.detokenize(tokens)
      expect(before.map((e) => e.text).join('')).toBe(whole.slice(0, -1))
      expect(turn.cancel()).toBe(true)
      const after = drain(engine, buffer)
      expect(after.map((e) => e.text).join('')).toBe(whole.slice(-1))
      const result = await turn.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.text).toBe(whole)
    })

    it('logprobs carry the text of the token and of each alternative', async () => {
      const engine = make({ seed: 4 })
      const result = await engine.generate('logprob text', { maxGeneratedTokens: 8, temperature: 1, seed: 2, logprobs: 3 }).done
      expect(result.logprobs).toHaveLength(8)
      for (const entry of result.logprobs!) {
        expect(entry.text).toBe(engine.detokenize([entry.token]))
        for (const alternative of entry.top) expect(alternative.text).toBe(engine.detokenize([alternative.token]))
      }
    })
  })
})

describe('text across targets', () => {
  it('native and wasm stream the same deltas, stop strings and logprob texts', async () => {
    const run = async (backend: 'native' | 'wasm') => {
      const engine = ortex(backend).Engine.simulated({ seed: 9, vocabSize: 400, eosProbability: 0 })
      const out: unknown[] = []
      for (const options of [{ maxGeneratedTokens: 300 }, { maxGeneratedTokens: 300, stop: [' ba', '\u00e9'], logprobs: 2, temperature: 1, seed: 1 }]) {
        const turn = engine.generate('the same on both', options)
        for await (const chunk of turn) out.push(chunk)
        out.push(await turn.done)
      }
      await engine.close()
      return out
    }
    const [native, wasm] = await Promise.all([run('native'), run('wasm')])
    expect(wasm).toEqual(native)
  })
})
