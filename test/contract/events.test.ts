// Event buffers and pacing: run() calls queue, a buffer's capacity paces events (retained events
// drain without model work), one event per request per transaction, chunked prefill; and the
// shape of one event (plain objects with data properties).
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { FLAGS, copyEvent, drain, expectCode, finishesOf, expectRejects, readEvents, step, tokensOf, type EventCopy } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ mod, make, referenceTokens }) => {
  describe('buffers and pacing', () => {
    it('run() calls execute one after another; runSync meanwhile throws RUN_IN_PROGRESS', async () => {
      const engine = make()
      const request = engine.createRequest()
      request.beginTurn('queued runs', { maxGeneratedTokens: 3 })
      const buffers = [0, 1, 2].map(() => engine.createEventBuffer(8))
      const settled: number[] = []
      const runs = buffers.map((buffer, i) =>
        engine.run(buffer).then((n) => {
          settled.push(i)
          return readEvents(buffer, n)
        }),
      )
      expectCode(mod, () => engine.runSync(engine.createEventBuffer(8)), 'RUN_IN_PROGRESS')
      const events = (await Promise.all(runs)).flat()
      expect(settled).toEqual([0, 1, 2])
      expect(tokensOf(events, request)).toEqual(referenceTokens('queued runs', 3))
      expect(engine.runSync(buffers[0]!)).toBe(0)
    })

    it('a run queued behind one that rejected still runs', async () => {
      const engine = make({ faults: { fatalSteps: [1] } })
      const request = engine.createRequest()
      request.beginTurn('fatal queue', { maxGeneratedTokens: 6 })
      const buffer = engine.createEventBuffer(8)
      const first = engine.run(buffer)
      const failing = engine.run(buffer)
      const refused = engine.run(buffer)
      const after = engine.run(buffer)
      expect(await first).toBe(1)
      expect(await failing).toBe(1)
      expect(buffer.at(0)).toMatchObject({ flags: FLAGS.Failed, request: null })
      await expectRejects(mod, () => refused, 'ENGINE_UNHEALTHY')
      await expectRejects(mod, () => after, 'ENGINE_UNHEALTHY')
      // Its own refusal (it ran its own checks), not the rejection of the run before it.
      const [refusedError, afterError] = await Promise.all([refused.catch((e) => e), after.catch((e) => e)])
      expect(afterError).not.toBe(refusedError)
      request.close()
    })

    it('capacity 1 paces one event per call and drains retained events without model work', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(1)
      expect(buffer.capacity).toBe(1)
      const requests = [0, 1, 2].map(() => engine.createRequest())
      requests.forEach((r, i) => r.beginTurn(`req ${i}`, { maxGeneratedTokens: 2 }))
      const all: EventCopy[] = []
      let calls = 0
      while (engine.hasPendingWork()) {
        const before = engine.stats()
        const n = engine.runSync(buffer)
        calls++
        expect(n).toBe(1)
        all.push(...readEvents(buffer, n))
        const after = engine.stats()
        if (before.retainedEvents > 0) {
          expect(after.steps).toBe(before.steps)
          expect(after.retainedEvents).toBe(before.retainedEvents - 1)
        } else {
          expect(after.steps).toBe(before.steps + 1)
          expect(after.retainedEvents).toBe(2)
        }
        expect(calls).toBeLessThanOrEqual(6)
      }
      expect(calls).toBe(6)
      expect(engine.stats().steps).toBe(2)
      for (const r of requests) {
        expect(tokensOf(all, r)).toHaveLength(2)
        expect(finishesOf(all, r)).toHaveLength(1)
      }
    })

    it('one run writes at most one event per request for the transaction it executed', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(1024)
      const requests = [0, 1, 2, 3].map(() => engine.createRequest())
      requests.forEach((r) => r.beginTurn('xy', { maxGeneratedTokens: 3 }))
      while (engine.hasPendingWork()) {
        const events = step(engine, buffer)
        const ids = events.map((e) => e.request)
        expect(new Set(ids).size).toBe(ids.length)
        expect(events.length).toBeLessThanOrEqual(4)
      }
    })

    it('capacity 0 is a no-op', () => {
      const engine = make()
      const zero = engine.createEventBuffer(0)
      expect(zero.capacity).toBe(0)
      const request = engine.createRequest()
      request.beginTurn('abc', { maxGeneratedTokens: 2 })
      for (let i = 0; i < 3; i++) {
        expect(engine.runSync(zero)).toBe(0)
        expect(zero.count).toBe(0)
      }
      expect(engine.stats().steps).toBe(0)
      expect(engine.hasPendingWork()).toBe(true)
      expect(request.state).toBe('queued')
      const events = drain(engine, engine.createEventBuffer(4))
      expect(tokensOf(events, request)).toHaveLength(2)
    })

    it('a prompt longer than maxScheduledTokens is prefilled across runs that return no events', () => {
      const engine = make({ maxScheduledTokens: 16 })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn(new Array(40).fill(100), { maxGeneratedTokens: 1 })
      expect(engine.runSync(buffer)).toBe(0)
      expect(engine.hasPendingWork()).toBe(true)
      expect(engine.stats()).toMatchObject({ steps: 1, promptTokens: 16, generatedTokens: 0 })
      expect(engine.runSync(buffer)).toBe(0)
      expect(engine.stats()).toMatchObject({ steps: 2, promptTokens: 32 })
      const last = step(engine, buffer)
      expect(last).toHaveLength(1)
      expect(last[0].flags).toBe(FLAGS.Token | FLAGS.TurnFinished)
      expect(engine.stats()).toMatchObject({ steps: 3, promptTokens: 40, generatedTokens: 1 })
      expect(last[0].token).toBe(referenceTokens(new Array(40).fill(100), 1)[0])
    })

    it('prefillChunkSize bounds one request per step', () => {
      const engine = make({ prefillChunkSize: 10 })
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn(new Array(35).fill(50), { maxGeneratedTokens: 1 })
      let empty = 0
      while (engine.runSync(buffer) === 0) empty++
      expect(empty).toBe(3)
    })
  })

  describe('events', () => {
    it('at(i) returns plain objects with own enumerable data properties; the buffer iterates', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn('aa', { maxGeneratedTokens: 1 })
      b.beginTurn('bb', { maxGeneratedTokens: 2 })
      const n = engine.runSync(buffer)
      expect(n).toBe(2)
      expect(buffer.count).toBe(2)
      const fields = ['flags', 'request', 'turnId', 'token', 'finishReason', 'errorCode', 'usage']
      for (let i = 0; i < n; i++) {
        const ev = buffer.at(i)
        const descriptors = Object.getOwnPropertyDescriptors(ev)
        for (const field of fields) {
          expect(descriptors[field], field).toBeDefined()
          expect(descriptors[field].enumerable, field).toBe(true)
          expect('value' in descriptors[field], `${field} is a data property`).toBe(true)
          expect(descriptors[field].get, field).toBeUndefined()
        }
        expect(Object.keys({ ...ev }).sort()).toEqual(expect.arrayContaining(fields))
        if (ev.usage) {
          const usageDescriptors = Object.getOwnPropertyDescriptors(ev.usage)
          for (const field of ['promptTokens', 'generatedTokens', 'cachedPromptTokens']) {
            expect(usageDescriptors[field]?.enumerable, field).toBe(true)
            expect('value' in usageDescriptors[field], field).toBe(true)
          }
        }
      }
      const finished = copyEvent(buffer.at(buffer.at(0).request === a ? 0 : 1))
      expect(finished).toMatchObject({ request: a, turnId: 1, flags: FLAGS.Token | FLAGS.TurnFinished, usage: { promptTokens: 2, generatedTokens: 1 } })
      const other = copyEvent(buffer.at(buffer.at(0).request === a ? 1 : 0))
      expect(other).toMatchObject({ request: b, flags: FLAGS.Token, finishReason: 'none', errorCode: 'none', usage: null })
      const iterated = [...buffer].map(copyEvent)
      expect(iterated).toEqual([copyEvent(buffer.at(0)), copyEvent(buffer.at(1))])
    })
  })
})
