// Closing and reclamation: close() frees blocks (at once in dynamic mode, at the batch's recycle
// in static mode), never delivers a closed request's events, and a Request dropped without
// close() is reclaimed after garbage collection.
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { FLAGS, drain, eventsOf, expectCode, finishesOf, gcUntil, requireGc, step, tokensOf, type Engine, type EventCopy, type Request } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ mod, make }) => {
  describe('close and reclamation', () => {
    it('close frees blocks at once in dynamic mode, also for a turn-complete request', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const total = engine.stats().totalBlocks
      const running = engine.createRequest()
      const complete = engine.createRequest()
      running.beginTurn(new Array(40).fill(90), { maxGeneratedTokens: 100 })
      complete.beginTurn(new Array(20).fill(91), { maxGeneratedTokens: 1 })
      for (let i = 0; i < 3; i++) step(engine, buffer)
      expect(complete.state).toBe('turn-complete')
      const held = total - engine.stats().freeBlocks
      expect(held).toBeGreaterThanOrEqual(5)
      complete.close()
      expect(total - engine.stats().freeBlocks).toBeLessThan(held)
      running.close()
      expect(engine.stats()).toMatchObject({ freeBlocks: total, activeRequests: 0, pendingTurns: 0 })
      expect(engine.hasPendingWork()).toBe(false)
      ;(engine as any).checkInvariants()
    })

    it('close is idempotent and works after Engine.close()', async () => {
      const engine = make()
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn('abc')
      a.close()
      a.close()
      expect(a.state).toBe('closed')
      expectCode(mod, () => a.beginTurn('x'), 'REQUEST_CLOSED')
      await engine.close()
      await engine.close()
      a.close()
      b.close()
      b.close()
    })

    it('events retained for a request are never delivered after it is closed', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(1)
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn('aa', { maxGeneratedTokens: 3 })
      b.beginTurn('bb', { maxGeneratedTokens: 3 })
      const first = step(engine, buffer)
      const retained = first[0].request === a ? b : a
      retained.close()
      const rest = drain(engine, buffer)
      expect(eventsOf(rest, retained)).toEqual([])
      expect(finishesOf([...first, ...rest], retained === a ? b : a)).toHaveLength(1)
    })

    it('static batching: a closed row stays taken and the batch recycles only when all rows are done', () => {
      const engine = make({ batching: 'static', maxBatchSize: 2 })
      const buffer = engine.createEventBuffer(8)
      const total = engine.stats().totalBlocks
      const a = engine.createRequest()
      const b = engine.createRequest()
      const c = engine.createRequest()
      a.beginTurn(new Array(20).fill(60), { maxGeneratedTokens: 2 })
      b.beginTurn(new Array(20).fill(61), { maxGeneratedTokens: 6 })
      c.beginTurn(new Array(20).fill(62), { maxGeneratedTokens: 2 })
      const log: EventCopy[] = []
      let freeAfterClose = -1
      while (engine.hasPendingWork()) {
        const events = step(engine, buffer)
        log.push(...events)
        ;(engine as any).checkInvariants()
        if (a.state === 'turn-complete' && freeAfterClose < 0) {
          const free = engine.stats().freeBlocks
          a.close()
          freeAfterClose = engine.stats().freeBlocks
          expect(freeAfterClose).toBe(free)
        }
        if (freeAfterClose >= 0 && b.state !== 'turn-complete') expect(engine.stats().freeBlocks).toBeLessThanOrEqual(freeAfterClose)
      }
      const bFinish = log.findIndex((e) => e.request === b && e.flags & FLAGS.TurnFinished)
      const cFirst = log.findIndex((e) => e.request === c)
      expect(bFinish).toBeGreaterThanOrEqual(0)
      expect(cFirst).toBeGreaterThan(bFinish)
      expect(tokensOf(log, c)).toHaveLength(2)
      b.close()
      c.close()
      engine.runSync(buffer)
      expect(engine.stats().freeBlocks).toBe(total)
    })

    it('static batching: a row closed early never starves the rest of its batch', () => {
      // A holds 10 of 20 blocks and finishes at once; closing it keeps its row (and blocks) until
      // the batch recycles. B alone fits the pool (5 + 10 tokens), so it must still finish.
      const engine = make({ batching: 'static', maxBatchSize: 2, blockSize: 1, numBlocks: 20 })
      const buffer = engine.createEventBuffer(8)
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn(new Array(10).fill(50), { maxGeneratedTokens: 1 })
      b.beginTurn(new Array(5).fill(51), { maxGeneratedTokens: 10 })
      const log: EventCopy[] = []
      for (let runs = 0; engine.hasPendingWork() && runs < 200; runs++) {
        const events = step(engine, buffer)
        log.push(...events)
        if (events.some((e) => e.request === a && e.flags & FLAGS.TurnFinished)) a.close()
      }
      expect(engine.hasPendingWork(), 'B is stuck: its batch never recycles').toBe(false)
      expect(tokensOf(log, b)).toHaveLength(10)
      expect(finishesOf(log, b)[0].finishReason).toBe('max-generated-tokens')
    })

    it('dynamic batching: a freed row is reused at once (contrast with static)', () => {
      const engine = make({ maxBatchSize: 2 })
      const buffer = engine.createEventBuffer(8)
      const [a, b, c] = [0, 1, 2].map(() => engine.createRequest())
      a.beginTurn('aaaa', { maxGeneratedTokens: 2 })
      b.beginTurn('bbbb', { maxGeneratedTokens: 6 })
      c.beginTurn('cccc', { maxGeneratedTokens: 2 })
      const log = drain(engine, buffer)
      const bFinish = log.findIndex((e) => e.request === b && e.flags & FLAGS.TurnFinished)
      const cFirst = log.findIndex((e) => e.request === c)
      expect(cFirst).toBeLessThan(bFinish)
    })

    it('an event of a collected Request is never delivered as an engine-level event', async () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      dropWhileRunning(engine, buffer)
      // A new job, so the WeakRef may go; then collect and run before the FinalizationRegistry
      // callback has had a turn: the core still runs the request and emits its events.
      await new Promise((resolve) => setTimeout(resolve, 0))
      requireGc()()
      let events: EventCopy[]
      try {
        events = step(engine, buffer)
      } finally {
        // Let the queued cleanup run while the engine is alive: in Node 20 a FinalizationRegistry
        // collected with a cleanup still queued stops all later ones in the process (see the
        // test "collecting an engine with a queued reclamation ..." in entry-points.test.ts).
        await gcUntil(() => engine.stats().activeRequests === 0, () => engine.hasPendingWork())
      }
      for (const e of events) {
        if (e.request === null) expect(e, 'a request-less event must be engine-level').toMatchObject({ turnId: 0, finishReason: 'none', usage: null })
        expect(e.flags & FLAGS.Token && e.request === null, 'a token event without its request').toBeFalsy()
      }
    })

    it('a dropped Request with a finished turn is reclaimed after GC', async () => {
      const engine = make()
      const buffer = engine.createEventBuffer(64)
      const total = engine.stats().totalBlocks
      dropAfterFinishedTurn(engine, buffer)
      expect(engine.stats().freeBlocks).toBeLessThan(total)
      const reclaimed = await gcUntil(
        () => engine.stats().freeBlocks === total,
        () => engine.hasPendingWork(),
      )
      expect(reclaimed).toBe(true)
      expect(engine.stats().activeRequests).toBe(0)
      ;(engine as any).checkInvariants()
    })

    it('a dropped Request with a running turn is reclaimed after GC and emits nothing more', async () => {
      const engine = make()
      const buffer = engine.createEventBuffer(64)
      const total = engine.stats().totalBlocks
      const keep = engine.createRequest()
      keep.beginTurn('keep', { maxGeneratedTokens: 1000 })
      dropWhileRunning(engine, buffer)
      expect(engine.stats().freeBlocks).toBeLessThan(total)
      const reclaimed = await gcUntil(
        () => engine.stats().activeRequests === 1,
        () => engine.runSync(buffer),
      )
      expect(reclaimed).toBe(true)
      for (let i = 0; i < 3; i++) {
        for (const ev of step(engine, buffer)) expect(ev.request).toBe(keep)
      }
      keep.close()
      expect(engine.stats().freeBlocks).toBe(total)
      expect(engine.hasPendingWork()).toBe(false)
    })

    it('a Request dropped with a running turn on an engine that then failed is reclaimed after GC (issue 30)', async () => {
      // An unhealthy engine refuses run() and createRequest() and reports no pending work: the
      // reclamation cannot wait for one of those, or the request holds its slot and blocks until
      // the engine closes.
      const engine = make({ maxRequests: 2, faults: { fatalSteps: [3] } })
      const buffer = engine.createEventBuffer(64)
      const total = engine.stats().totalBlocks
      const kept = engine.createRequest()
      kept.beginTurn(new Array(20).fill(79), { maxGeneratedTokens: 1000 })
      dropWhileRunning(engine, buffer)
      expect(engine.runSync(buffer)).toBe(1)
      expectCode(mod, () => engine.runSync(buffer), 'ENGINE_UNHEALTHY')
      kept.close()
      const reclaimed = await gcUntil(() => engine.stats().activeRequests === 0, () => engine.hasPendingWork())
      expect(reclaimed).toBe(true)
      expect(engine.stats()).toMatchObject({ activeRequests: 0, pendingTurns: 0, freeBlocks: total })
      ;(engine as any).checkInvariants()
    })
  })
})

// Helpers that drop their Request when they return (nothing else may hold it).
function dropAfterFinishedTurn(engine: Engine, buffer: ReturnType<Engine['createEventBuffer']>): void {
  const request: Request = engine.createRequest()
  request.beginTurn(new Array(40).fill(77), { maxGeneratedTokens: 2 })
  while (engine.hasPendingWork()) engine.runSync(buffer)
}

function dropWhileRunning(engine: Engine, buffer: ReturnType<Engine['createEventBuffer']>): void {
  const request: Request = engine.createRequest()
  request.beginTurn(new Array(40).fill(78), { maxGeneratedTokens: 1000 })
  for (let i = 0; i < 3; i++) engine.runSync(buffer)
}
