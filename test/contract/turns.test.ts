// How a turn ends: cancellation (exactly one finish event, what was committed is kept) and every
// finish reason with its cause (limits, eos, stop token ids and stop strings).
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { FLAGS, drain, eventsOf, expectCode, finishesOf, step, tokensOf, type EventCopy } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ mod, make, referenceTokens }) => {
  describe('cancellation', () => {
    it('emits exactly one finish event with cancelled and keeps what was committed', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      const turn = request.beginTurn('hello', { maxGeneratedTokens: 50 })
      const before: EventCopy[] = []
      for (let i = 0; i < 4; i++) before.push(...step(engine, buffer))
      const generated = tokensOf(before, request)
      expect(generated).toHaveLength(4)
      expect(turn.cancel()).toBe(true)
      expect(turn.cancel()).toBe(false)
      expect(request.cancelTurn(turn.id)).toBe(false)
      const after = drain(engine, buffer)
      const finishes = finishesOf(after, request)
      expect(finishes).toHaveLength(1)
      expect(finishes[0].finishReason).toBe('cancelled')
      expect(finishes[0].errorCode).toBe('none')
      expect(finishes[0].turnId).toBe(turn.id)
      const all = [...before, ...after]
      const kept = tokensOf(all, request)
      expect(finishes[0].usage).toEqual({ promptTokens: 5, generatedTokens: kept.length, cachedPromptTokens: 0 })
      expect(request.tokenCount).toBe(5 + kept.length)
      expect(request.state).toBe('turn-complete')
      // The kept context is live: a continuation generates what a fresh request would from it.
      const next = request.beginTurn('!', { maxGeneratedTokens: 3 })
      expect(next.id).toBe(2)
      const cont = tokensOf(drain(engine, buffer), request, 2)
      const context = [...engine.tokenize('hello'), ...kept, ...engine.tokenize('!')]
      expect(cont).toEqual(referenceTokens(context, 3))
    })

    it('cancelTurn returns true once, false for another id or a finished turn', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      const other = engine.createRequest()
      const turn = request.beginTurn('queued', { maxGeneratedTokens: 5 })
      const otherTurn = other.beginTurn('other', { maxGeneratedTokens: 1 })
      expect(request.cancelTurn(turn.id + 1)).toBe(false)
      expect(request.cancelTurn(0)).toBe(false)
      expect(other.cancelTurn(turn.id + 5)).toBe(false)
      expect(request.cancelTurn(turn.id)).toBe(true)
      expect(request.cancelTurn(turn.id)).toBe(false)
      const events = drain(engine, buffer)
      const finish = finishesOf(events, request)
      expect(finish).toHaveLength(1)
      expect(finish[0].finishReason).toBe('cancelled')
      expect(finish[0].usage).toEqual({ promptTokens: 6, generatedTokens: 0, cachedPromptTokens: 0 })
      expect(tokensOf(events, request)).toEqual([])
      expect(request.tokenCount).toBe(6)
      expect(finishesOf(events, other)[0].finishReason).toBe('max-generated-tokens')
      expect(otherTurn.cancel()).toBe(false)
    })

    it('a cancel merges into a retained token event: still exactly one finish', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(1)
      const a = engine.createRequest()
      const b = engine.createRequest()
      const ta = a.beginTurn('aa', { maxGeneratedTokens: 10 })
      const tb = b.beginTurn('bb', { maxGeneratedTokens: 10 })
      const first = step(engine, buffer)
      const retained = first[0].request === a ? b : a
      const retainedTurn = retained === a ? ta : tb
      expect(retainedTurn.cancel()).toBe(true)
      const events = [...first, ...drain(engine, buffer)]
      const mine = eventsOf(events, retained)
      expect(finishesOf(events, retained)).toHaveLength(1)
      const last = mine[mine.length - 1]
      expect(last.finishReason).toBe('cancelled')
      const tokens = tokensOf(events, retained)
      expect(last.usage!.generatedTokens).toBe(tokens.length)
      expect(retained.tokenCount).toBe(2 + tokens.length)
    })
  })

  describe('penalties and min-p', () => {
    // The simulated model offers 8 candidates per step with logits 4.0, 3.5, ..., 0.5.
    it('a repetition penalty of 100 keeps greedy decoding off every token of the context', () => {
      const engine = make({ seed: 5, vocabSize: 300 })
      const prompt = [10, 11, 12, 13, 14, 15, 16, 17]
      const plain = referenceTokens(prompt, 40, { seed: 5, vocabSize: 300 })
      expect(new Set(plain).size, 'this seed repeats tokens without the penalty').toBeLessThan(plain.length)
      const request = engine.createRequest()
      request.beginTurn(prompt, { maxGeneratedTokens: 40, repetitionPenalty: 100 })
      const penalized = tokensOf(drain(engine, engine.createEventBuffer(8)), request)
      expect(penalized).toHaveLength(40)
      // A seen token scores 4.0 / 100 at best, below the weakest unseen candidate (0.5).
      expect(new Set(penalized).size).toBe(penalized.length)
      expect(penalized.filter((t) => prompt.includes(t))).toEqual([])
    })

    it('presence and frequency penalties keep greedy decoding off what this turn generated', () => {
      const engine = make({ seed: 5, vocabSize: 300 })
      const request = engine.createRequest()
      const plain = referenceTokens([1, 2, 3], 40, { seed: 5, vocabSize: 300 })
      // Nothing generated yet: the first token is the plain one. Afterwards a generated token
      // scores 4.0 - 2 - 2 = 0 at best, below the weakest unseen candidate (0.5).
      request.beginTurn([1, 2, 3], { maxGeneratedTokens: 40, presencePenalty: 2, frequencyPenalty: 2 })
      const penalized = tokensOf(drain(engine, engine.createEventBuffer(8)), request)
      expect(penalized[0]).toBe(plain[0])
      expect(new Set(penalized).size).toBe(penalized.length)
      expect(penalized).not.toEqual(plain)
    })

    it('minP near 1 leaves only the best candidate: sampling equals greedy', () => {
      const engine = make({ seed: 9 })
      const greedy = referenceTokens('min p', 24, { seed: 9 })
      const run = (options: Record<string, unknown>) => {
        const request = engine.createRequest()
        request.beginTurn('min p', { maxGeneratedTokens: 24, temperature: 1.5, seed: 3, ...options })
        return tokensOf(drain(engine, engine.createEventBuffer(8)), request)
      }
      expect(run({}), 'temperature 1.5 alone strays from greedy').not.toEqual(greedy)
      // The runner-up's weight is exp(-0.5 / 1.5) = 0.72 of the best one's.
      expect(run({ minP: 0.75 })).toEqual(greedy)
    })
  })

  describe('finish reasons', () => {
    it('per-turn maxGeneratedTokens ends with max-generated-tokens', () => {
      const engine = make()
      const request = engine.createRequest()
      request.beginTurn('limit', { maxGeneratedTokens: 7 })
      const events = drain(engine, engine.createEventBuffer(8))
      expect(tokensOf(events, request)).toHaveLength(7)
      const finish = finishesOf(events, request)
      expect(finish).toHaveLength(1)
      expect(finish[0].flags).toBe(FLAGS.Token | FLAGS.TurnFinished)
      expect(finish[0].finishReason).toBe('max-generated-tokens')
      expect(finish[0].usage!.generatedTokens).toBe(7)
    })

    it('maxSessionTokens ends with max-session-tokens, also when maxGeneratedTokens is larger', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const a = engine.createRequest({ maxSessionTokens: 12 })
      const b = engine.createRequest({ maxSessionTokens: 12 })
      a.beginTurn('12345')
      b.beginTurn('12345', { maxGeneratedTokens: 100 })
      const events = drain(engine, buffer)
      for (const r of [a, b]) {
        expect(tokensOf(events, r)).toHaveLength(7)
        expect(finishesOf(events, r)[0].finishReason).toBe('max-session-tokens')
        expect(r.tokenCount).toBe(12)
        expectCode(mod, () => r.beginTurn('x'), 'INVALID_ARGUMENT')
      }
      // 0 means the model's maxLength.
      const c = make({ maxLength: 20 }).createRequest({ maxSessionTokens: 0 })
      c.beginTurn('0123456789')
      expect(c.tokenCount).toBe(10)
    })

    it('absent limits run to maxLength', () => {
      const engine = make({ maxLength: 24 })
      const request = engine.createRequest()
      request.beginTurn('four')
      const events = drain(engine, engine.createEventBuffer(8))
      expect(tokensOf(events, request)).toHaveLength(20)
      expect(finishesOf(events, request)[0].finishReason).toBe('max-session-tokens')
    })

    it('ends with eos when the model emits the EOS token, unless ignoreEos', () => {
      const engine = make({ eosProbability: 1, eosTokenId: 7 })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn('end now', { maxGeneratedTokens: 10 })
      const events = drain(engine, buffer)
      expect(events).toHaveLength(1)
      expect(events[0]).toMatchObject({ flags: FLAGS.Token | FLAGS.TurnFinished, token: 7, finishReason: 'eos', errorCode: 'none' })
      const ignoring = engine.createRequest()
      ignoring.beginTurn('go on', { maxGeneratedTokens: 4, ignoreEos: true })
      const more = drain(engine, buffer)
      expect(tokensOf(more, ignoring)).toEqual([7, 7, 7, 7])
      expect(finishesOf(more, ignoring)[0].finishReason).toBe('max-generated-tokens')
    })

    it('ends with stop when the output ends with a stopTokenIds sequence', () => {
      const free = referenceTokens('stop test', 12, { seed: 5 })
      const k = free.findIndex((t, i) => i >= 2 && !free.slice(0, i).includes(t))
      expect(k).toBeGreaterThan(0)
      const engine = make({ seed: 5 })
      const buffer = engine.createEventBuffer(8)
      const single = engine.createRequest()
      single.beginTurn('stop test', { maxGeneratedTokens: 12, stopTokenIds: [[free[k]]] })
      const pair = engine.createRequest()
      const absent = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313].find((t) => !free.includes(t))!
      pair.beginTurn('stop test', { maxGeneratedTokens: 12, stopTokenIds: [[absent], [free[k - 1], free[k]]] })
      const events = drain(engine, buffer)
      for (const r of [single, pair]) {
        expect(tokensOf(events, r)).toEqual(free.slice(0, k + 1))
        const finish = finishesOf(events, r)
        expect(finish[0]).toMatchObject({ finishReason: 'stop', flags: FLAGS.Token | FLAGS.TurnFinished, token: free[k] })
      }
    })

    it('ends with stop on a stop string (driven)', async () => {
      const free = referenceTokens('stop text', 12, { seed: 6 })
      const reader = make({ seed: 6 })
      const texts = free.map((t) => reader.detokenize([t]))
      const k = texts.findIndex((s, i) => i >= 1 && free[i] >= 259 && !texts.slice(0, i).join('').includes(s))
      expect(k).toBeGreaterThan(0)
      const engine = make({ seed: 6 })
      const turn = engine.generate('stop text', { maxGeneratedTokens: 12, stop: [texts[k]] })
      const result = await turn.done
      expect(result.finishReason).toBe('stop')
      expect([...result.tokens]).toEqual(free.slice(0, k + 1))
    })
  })
})
