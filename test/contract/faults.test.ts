// When the engine cannot serve: a request that can never fit the KV pool fails unserviceable, one
// that fits later waits with CapacityBlocked events; injected retryable, capacity and fatal
// faults of the simulated executor.
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { FLAGS, drain, expectCode, finishesOf, expectRejects, step, tokensOf } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ mod, make, referenceTokens }) => {
  describe('KV capacity', () => {
    it('a request that can never fit the pool fails with request-unserviceable', () => {
      const engine = make({ blockSize: 4, numBlocks: 2 })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn('123456789', { maxGeneratedTokens: 1 })
      const events = drain(engine, buffer)
      expect(events).toHaveLength(1)
      expect(events[0]).toMatchObject({
        request,
        flags: FLAGS.TurnFinished | FLAGS.Failed,
        finishReason: 'failed',
        errorCode: 'request-unserviceable',
        usage: { promptTokens: 9, generatedTokens: 0, cachedPromptTokens: 0 },
      })
      request.close()
      const ok = engine.createRequest()
      ok.beginTurn('123', { maxGeneratedTokens: 2 })
      expect(tokensOf(drain(engine, buffer), ok)).toHaveLength(2)
    })

    it('requests that fit later wait with CapacityBlocked events and lose nothing', () => {
      const prompts = ['first!', 'second', 'third.']
      const reference = prompts.map((p) => referenceTokens(p, 10, { seed: 9 }))
      const engine = make({ seed: 9, blockSize: 4, numBlocks: 6, maxBatchSize: 4 })
      const buffer = engine.createEventBuffer(2)
      const requests = prompts.map(() => engine.createRequest())
      requests.forEach((r, i) => r.beginTurn(prompts[i], { maxGeneratedTokens: 10 }))
      const events = drain(engine, buffer)
      const blocked = events.filter((e) => e.flags & FLAGS.CapacityBlocked)
      expect(blocked.length).toBeGreaterThan(0)
      for (const e of blocked) {
        expect(e.flags).toBe(FLAGS.CapacityBlocked)
        expect(e.errorCode).toBe('capacity-deferred')
        expect(requests).toContain(e.request)
        expect(e.finishReason).toBe('none')
      }
      requests.forEach((r, i) => {
        expect(tokensOf(events, r)).toEqual(reference[i])
        expect(finishesOf(events, r)).toHaveLength(1)
        expect(finishesOf(events, r)[0].finishReason).toBe('max-generated-tokens')
        r.close()
      })
      expect(engine.stats().freeBlocks).toBe(6)
    })
  })

  describe('injected faults', () => {
    function runWith(options: Record<string, unknown>) {
      const engine = make({ seed: 41, ...options })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn('faults', { maxGeneratedTokens: 6 })
      const events = drain(engine, buffer)
      return { engine, request, events }
    }

    it('a retryable fault is an engine-level event; progress resumes with the same tokens', () => {
      const clean = runWith({})
      const faulty = runWith({ faults: { retryableSteps: [0, 2] } })
      const engineEvents = faulty.events.filter((e) => e.request === null)
      expect(engineEvents).toHaveLength(2)
      for (const e of engineEvents) {
        expect(e).toMatchObject({ flags: FLAGS.Retryable, turnId: 0, finishReason: 'none', errorCode: 'retryable-execution', usage: null })
      }
      expect(tokensOf(faulty.events, faulty.request)).toEqual(tokensOf(clean.events, clean.request))
      expect(faulty.engine.stats().steps).toBe(clean.engine.stats().steps + 2)
      expect(faulty.engine.stats().freeBlocks).toBe(clean.engine.stats().freeBlocks)
      faulty.request.close()
      expect(faulty.engine.stats().freeBlocks).toBe(faulty.engine.stats().totalBlocks)
      ;(faulty.engine as any).checkInvariants()
    })

    it('an execution-capacity fault is CapacityBlocked at engine level; nothing is lost', () => {
      const clean = runWith({})
      const faulty = runWith({ faults: { capacitySteps: [1] } })
      const engineEvents = faulty.events.filter((e) => e.request === null)
      expect(engineEvents).toHaveLength(1)
      expect(engineEvents[0]).toMatchObject({ flags: FLAGS.CapacityBlocked, errorCode: 'execution-capacity-exceeded' })
      expect(tokensOf(faulty.events, faulty.request)).toEqual(tokensOf(clean.events, clean.request))
    })

    it('a fatal fault is a Failed event; then the engine is unhealthy but closes', async () => {
      const engine = make({ faults: { fatalSteps: [1] } })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn('fatal', { maxGeneratedTokens: 6 })
      const first = step(engine, buffer)
      expect(tokensOf(first, request)).toHaveLength(1)
      const failed = step(engine, buffer)
      expect(failed).toHaveLength(1)
      expect(failed[0]).toMatchObject({ flags: FLAGS.Failed, request: null, errorCode: 'engine-execution-failure' })
      expectCode(mod, () => engine.runSync(buffer), 'ENGINE_UNHEALTHY')
      await expectRejects(mod, () => engine.run(buffer), 'ENGINE_UNHEALTHY')
      expectCode(mod, () => engine.createRequest(), 'ENGINE_UNHEALTHY')
      const idle = request
      expectCode(mod, () => idle.beginTurn('x'), 'ENGINE_UNHEALTHY')
      ;(engine as any).checkInvariants()
      request.close()
      await engine.close()
      expectCode(mod, () => engine.createRequest(), 'ENGINE_CLOSED')
    })
  })
})
