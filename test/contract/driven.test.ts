// Driven mode: AbortSignal and async iteration of a Turn, generate(), start() and stop(), and
// Engine.close() settling pending turns.
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { drain, expectCode, expectCodeAsync, tokensOf } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ mod, make, referenceTokens }) => {
  describe('AbortSignal and driven iteration', () => {
    it('aborting ends the iterator without throwing and done resolves cancelled', async () => {
      const engine = make()
      const request = engine.createRequest()
      const controller = new AbortController()
      const turn = request.beginTurn('abort me', { signal: controller.signal, maxGeneratedTokens: 1000 })
      const chunks: { token: number; text: string }[] = []
      for await (const chunk of turn) {
        chunks.push(chunk)
        if (chunks.length === 3) controller.abort()
      }
      expect(chunks).toHaveLength(3)
      const result = await turn.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.errorCode).toBe('none')
      expect([...result.tokens]).toEqual(chunks.map((c) => c.token))
      expect(result.usage.generatedTokens).toBe(3)
      expect(request.tokenCount).toBe(8 + 3)
    })

    it('a signal aborted before beginTurn cancels the turn without throwing', async () => {
      const engine = make()
      engine.start()
      const request = engine.createRequest()
      const turn = request.beginTurn('late', { signal: AbortSignal.abort(), maxGeneratedTokens: 100 })
      const result = await turn.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.tokens.length).toBe(0)
    })

    it('a cancel from the first chunk is seen before the next step', async () => {
      const engine = make()
      const request = engine.createRequest()
      const turn = request.beginTurn('stop soon', { maxGeneratedTokens: 1000 })
      let chunks = 0
      for await (const chunk of turn) {
        chunks++
        expect(typeof chunk.token).toBe('number')
        turn.cancel()
      }
      expect(chunks).toBe(1)
      const result = await turn.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.tokens.length).toBe(1)
      expect(result.usage).toEqual({ promptTokens: 9, generatedTokens: 1, cachedPromptTokens: 0 })
    })
  })

  describe('driven mode', () => {
    it('generate() streams chunks, resolves done and text(), and closes its request', async () => {
      const reference = referenceTokens('hello', 5, { seed: 31 })
      const engine = make({ seed: 31 })
      const turn = engine.generate('hello', { maxGeneratedTokens: 5 })
      expect(turn.id).toBe(1)
      const chunks: { token: number; text: string }[] = []
      for await (const chunk of turn) chunks.push({ token: chunk.token, text: chunk.text })
      const result = await turn.done
      expect(chunks.map((c) => c.token)).toEqual(reference)
      expect(result.tokens).toBeInstanceOf(Int32Array)
      expect([...result.tokens]).toEqual(reference)
      expect(result.finishReason).toBe('max-generated-tokens')
      expect(result.errorCode).toBe('none')
      expect(result.usage).toEqual({ promptTokens: 5, generatedTokens: 5, cachedPromptTokens: 0 })
      expect(result.text).toBe(engine.detokenize(reference))
      expect(chunks.map((c) => c.text).join('')).toBe(result.text)
      expect(turn.request.state).toBe('closed')
      expect(await engine.generate('hello', { maxGeneratedTokens: 5 }).text()).toBe(result.text)
    })

    it('generate() takes RequestOptions too', async () => {
      const engine = make()
      const result = await engine.generate('hello', { maxSessionTokens: 9 }).done
      expect(result.finishReason).toBe('max-session-tokens')
      expect(result.tokens.length).toBe(4)
    })

    it('start() drives beginTurn turns, continuations included', async () => {
      const engine = make({ seed: 32 })
      engine.start()
      const request = engine.createRequest()
      const first = await request.beginTurn('abc', { maxGeneratedTokens: 3 }).done
      expect(first.tokens.length).toBe(3)
      const t2 = request.beginTurn('d', { maxGeneratedTokens: 2 })
      expect(t2.id).toBe(2)
      const second = await t2.done
      expect(second.usage).toEqual({ promptTokens: 1, generatedTokens: 2, cachedPromptTokens: 0 })
      expect(request.tokenCount).toBe(3 + 3 + 1 + 2)
      expect(request.state).toBe('turn-complete')
    })

    it('run and runSync throw ENGINE_DRIVEN while driven; stop() returns control', async () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      engine.start()
      expectCode(mod, () => engine.runSync(buffer), 'ENGINE_DRIVEN')
      await expectCodeAsync(mod, () => engine.run(buffer), 'ENGINE_DRIVEN')
      await engine.stop()
      expect(engine.runSync(buffer)).toBe(0)
      const request = engine.createRequest()
      request.beginTurn('after stop', { maxGeneratedTokens: 2 })
      expect(tokensOf(drain(engine, buffer), request)).toHaveLength(2)
      // Iterating a Turn implies start() again.
      const turn = request.beginTurn('again', { maxGeneratedTokens: 2 })
      let n = 0
      for await (const _ of turn) n++
      expect(n).toBe(2)
      expectCode(mod, () => engine.runSync(buffer), 'ENGINE_DRIVEN')
    })

    it('Engine.close() resolves pending done promises with cancelled (driven and caller-driven)', async () => {
      const engine = make()
      engine.start()
      const running = engine.createRequest().beginTurn('long', { maxGeneratedTokens: 100000, ignoreEos: true })
      const iterator = running[Symbol.asyncIterator]()
      const first = await iterator.next()
      expect(first.done).toBe(false)
      await engine.close()
      const result = await running.done
      expect(result.finishReason).toBe('cancelled')
      expect(result.tokens.length).toBeGreaterThanOrEqual(1)

      const idle = make()
      const queued = idle.createRequest().beginTurn('never runs', { maxGeneratedTokens: 3 })
      await idle.close()
      const queuedResult = await queued.done
      expect(queuedResult.finishReason).toBe('cancelled')
      expect(queuedResult.tokens.length).toBe(0)
    })
  })
})
