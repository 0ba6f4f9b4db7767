// What only one backend does: the native addon runs steps off the event loop (and takes calls
// on other requests meanwhile); WebAssembly refuses Engine.load.
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { drain, eventsOf, finishesOf, expectRejects, readEvents, smokeGeneration, step, tokensOf } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ backend, mod, make }) => {
  const { Engine: EngineClass } = mod

  describe.runIf(backend === 'native')('native threading', () => {
    function bigPromptEngine() {
      return make({ maxLength: 1 << 20, maxScheduledTokens: 1 << 20, maxBatchSize: 4, numBlocks: 34_000 })
    }

    it('run() does not block the event loop while a long step executes', async () => {
      const engine = bigPromptEngine()
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn(new Int32Array(500_000).fill(100), { maxGeneratedTokens: 1 })
      let fired = false
      const pending = engine.run(buffer)
      setImmediate(() => {
        fired = true
      })
      const n = await pending
      expect(fired).toBe(true)
      expect(n).toBe(1)
      expect(buffer.at(0).request).toBe(request)
    })

    it('beginTurn, cancelTurn and close on other requests work while a run is in flight', async () => {
      const engine = bigPromptEngine()
      const buffer = engine.createEventBuffer(8)
      const b = engine.createRequest()
      const c = engine.createRequest()
      const tb = b.beginTurn('bbbb', { maxGeneratedTokens: 100 })
      c.beginTurn('cccc', { maxGeneratedTokens: 100 })
      const warm = step(engine, buffer)
      expect(tokensOf(warm, b)).toHaveLength(1)
      const a = engine.createRequest()
      a.beginTurn(new Int32Array(500_000).fill(101), { maxGeneratedTokens: 2 })
      const pending = engine.run(buffer)
      // Applied at the next boundary; the calls themselves must not wait for the step.
      expect(b.cancelTurn(tb.id)).toBe(true)
      c.close()
      expect(c.state).toBe('closed')
      const d = engine.createRequest()
      const td = d.beginTurn('dddd', { maxGeneratedTokens: 2 })
      expect(td.id).toBe(1)
      const n = await pending
      const events = readEvents(buffer, n)
      ;(engine as any).checkInvariants()
      const rest = drain(engine, buffer)
      const all = [...events, ...rest]
      expect(eventsOf(all, c)).toEqual([])
      expect(tokensOf(all, b)).toEqual([])
      const bFinish = finishesOf(all, b)
      expect(bFinish).toHaveLength(1)
      expect(bFinish[0].finishReason).toBe('cancelled')
      expect(bFinish[0].usage!.generatedTokens).toBe(1)
      expect(tokensOf(all, d)).toHaveLength(2)
      expect(tokensOf(all, a)).toHaveLength(2)
      for (const r of [a, b, d]) r.close()
      expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
    })

    it('close() of a request planned in the in-flight step frees its blocks when the step commits', async () => {
      const engine = bigPromptEngine()
      const buffer = engine.createEventBuffer(8)
      const a = engine.createRequest()
      a.beginTurn(new Int32Array(300_000).fill(102), { maxGeneratedTokens: 5 })
      const pending = engine.run(buffer)
      a.close()
      const n = await pending
      expect(n).toBe(0)
      ;(engine as any).checkInvariants()
      expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
      expect(engine.hasPendingWork()).toBe(false)
    })
  })

  describe.runIf(backend === 'wasm')('wasm specifics', () => {
    it('Engine.load rejects with UNSUPPORTED', async () => {
      await expectRejects(mod, () => EngineClass.load('/nonexistent/model'), 'UNSUPPORTED')
      smokeGeneration(make())
    })
  })
})
