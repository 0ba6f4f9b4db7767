// The public contract (docs/api.md), run unchanged against both backends: every rule of "Rules the
// tests check" and of the events section, through the built package's entry points.
import { execFileSync, spawnSync } from 'node:child_process'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { afterEach, describe, expect, it } from 'vitest'
import { BACKENDS, ortex, type BackendName } from './helpers/backends'
import {
  FLAGS,
  copyEvent,
  drain,
  eventsOf,
  expectCode,
  expectCodeAsync,
  finishesOf,
  expectRejects,
  gcUntil,
  readEvents,
  requireGc,
  smokeGeneration,
  step,
  tokensOf,
  type Engine,
  type EventCopy,
  type Request,
} from './helpers/util'

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..')

describe.each(BACKENDS)('contract (%s)', (backend: BackendName) => {
  const mod = ortex(backend)
  const { Engine: EngineClass, EventFlags } = mod
  const open: Engine[] = []

  function make(options?: Record<string, unknown>): Engine {
    const engine = EngineClass.simulated(options as any)
    open.push(engine)
    return engine
  }

  afterEach(async () => {
    for (const engine of open.splice(0)) await engine.close()
  })

  /** Greedy tokens a fresh request generates for `prompt` on an engine with `options`. */
  function referenceTokens(prompt: string | number[], maxGeneratedTokens: number, options?: Record<string, unknown>): number[] {
    const engine = make(options)
    const request = engine.createRequest()
    request.beginTurn(prompt, { maxGeneratedTokens })
    const events = drain(engine, engine.createEventBuffer(64))
    return tokensOf(events, request)
  }

  describe('engine basics', () => {
    it('reports its backend and resolved defaults', () => {
      const engine = make()
      expect(engine.backend).toBe(backend)
      expect(engine.config).toMatchObject({
        batching: 'dynamic',
        blockSize: 16,
        numBlocks: 16 * Math.ceil(2048 / 16),
        maxBatchSize: 16,
        maxScheduledTokens: 512,
        vocabSize: 32000,
        maxLength: 2048,
      })
      expect([...engine.config.eosTokenIds]).toEqual([2])
      const custom = make({ blockSize: 8, maxBatchSize: 3, maxLength: 100, eosTokenId: 7, batching: 'static' })
      expect(custom.config).toMatchObject({ blockSize: 8, maxBatchSize: 3, numBlocks: 3 * 13, maxLength: 100, batching: 'static' })
      expect([...custom.config.eosTokenIds]).toEqual([7])
    })

    it('exports EventFlags with the documented bits', () => {
      expect({ ...EventFlags }).toEqual({ Token: 1, TurnFinished: 2, CapacityBlocked: 4, Failed: 8, Retryable: 16 })
    })

    it('tokenizes bytes as byte + 3 and detokenizes words as syllables', () => {
      const engine = make()
      const ids = engine.tokenize('hi')
      expect(ids).toBeInstanceOf(Int32Array)
      expect([...ids]).toEqual([3 + 104, 3 + 105])
      expect(engine.detokenize(engine.tokenize('héllo ✓'))).toBe('héllo ✓')
      expect(engine.detokenize([259])).toBe(' baba')
      expect(engine.detokenize(new Int32Array([3 + 104, 259]))).toBe('h baba')
    })

    it('has stats with every documented field', () => {
      const engine = make()
      const stats = engine.stats()
      for (const key of ['totalBlocks', 'freeBlocks', 'activeRequests', 'pendingTurns', 'retainedEvents', 'steps', 'promptTokens', 'generatedTokens']) {
        expect(typeof (stats as any)[key], key).toBe('number')
      }
      expect(stats.totalBlocks).toBe(engine.config.numBlocks)
      expect(stats.freeBlocks).toBe(stats.totalBlocks)
      expect(engine.hasPendingWork()).toBe(false)
    })

    it('run and runSync produce the same events', async () => {
      const a = make({ seed: 4 })
      const b = make({ seed: 4 })
      const ra = a.createRequest()
      const rb = b.createRequest()
      ra.beginTurn('same', { maxGeneratedTokens: 4 })
      rb.beginTurn('same', { maxGeneratedTokens: 4 })
      const ba = a.createEventBuffer(8)
      const bb = b.createEventBuffer(8)
      const viaSync = drain(a, ba).map((e) => ({ ...e, request: e.request === ra }))
      const viaAsync: EventCopy[] = []
      while (b.hasPendingWork()) {
        const n = await b.run(bb)
        viaAsync.push(...readEvents(bb, n))
      }
      expect(viaAsync.map((e) => ({ ...e, request: e.request === rb }))).toEqual(viaSync)
    })
  })

  describe('requests and turn ids', () => {
    it('walks the request states created -> queued -> active -> turn-complete -> closed', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      expect(request.state).toBe('created')
      expect(request.tokenCount).toBe(0)
      request.beginTurn('abc', { maxGeneratedTokens: 3 })
      expect(request.state).toBe('queued')
      expect(request.tokenCount).toBe(3)
      step(engine, buffer)
      expect(request.state).toBe('active')
      drain(engine, buffer)
      expect(request.state).toBe('turn-complete')
      expect(request.tokenCount).toBe(6)
      request.close()
      expect(request.state).toBe('closed')
    })

    it('numbers turns from 1 per request; a refused beginTurn consumes no id', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const a = engine.createRequest()
      const b = engine.createRequest()
      expect(a.id).not.toBe(b.id)
      const t1 = a.beginTurn('one', { maxGeneratedTokens: 2 })
      expect(t1.id).toBe(1)
      expect(t1.request).toBe(a)
      expectCode(mod, () => a.beginTurn('again'), 'TURN_ACTIVE')
      expect(b.beginTurn('other', { maxGeneratedTokens: 1 }).id).toBe(1)
      drain(engine, buffer)
      expectCode(mod, () => a.beginTurn([]), 'INVALID_ARGUMENT')
      expectCode(mod, () => a.beginTurn('x', { temperature: -1 }), 'INVALID_ARGUMENT')
      expectCode(mod, () => a.beginTurn(new Array(3000).fill(70)), 'INVALID_ARGUMENT')
      const t2 = a.beginTurn('two', { maxGeneratedTokens: 2 })
      expect(t2.id).toBe(2)
      drain(engine, buffer)
      expect(a.beginTurn('three', { maxGeneratedTokens: 1 }).id).toBe(3)
      drain(engine, buffer)
    })

    it('throws TURN_ACTIVE while a turn is queued or running, for beginTurn and prefill', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(8)
      const request = engine.createRequest()
      request.beginTurn('abc', { maxGeneratedTokens: 5 })
      expectCode(mod, () => request.beginTurn('more'), 'TURN_ACTIVE')
      expectCode(mod, () => request.prefill('more'), 'TURN_ACTIVE')
      step(engine, buffer)
      expect(request.state).toBe('active')
      expectCode(mod, () => request.beginTurn('more'), 'TURN_ACTIVE')
      expectCode(mod, () => request.prefill('more'), 'TURN_ACTIVE')
      const events = drain(engine, buffer)
      expect(tokensOf(events, request).length).toBe(4)
      expect(request.beginTurn('more', { maxGeneratedTokens: 1 }).id).toBe(2)
    })

    it('throws EVENTS_PENDING while the finish event is retained (capacity-1 buffer)', () => {
      const engine = make()
      const buffer = engine.createEventBuffer(1)
      const a = engine.createRequest()
      const b = engine.createRequest()
      a.beginTurn('aa', { maxGeneratedTokens: 1 })
      b.beginTurn('bb', { maxGeneratedTokens: 1 })
      const first = step(engine, buffer)
      expect(first).toHaveLength(1)
      expect(first[0].flags).toBe(FLAGS.Token | FLAGS.TurnFinished)
      const delivered = first[0].request
      const retained = delivered === a ? b : a
      expect([a, b]).toContain(delivered)
      expect(engine.stats().retainedEvents).toBe(1)
      expect(retained.state).toBe('turn-complete')
      expectCode(mod, () => retained.beginTurn('next', { maxGeneratedTokens: 1 }), 'EVENTS_PENDING')
      expect(delivered!.beginTurn('next', { maxGeneratedTokens: 1 }).id).toBe(2)
      const steps = engine.stats().steps
      const second = step(engine, buffer)
      expect(second).toHaveLength(1)
      expect(second[0].request).toBe(retained)
      expect(second[0].flags & FLAGS.TurnFinished).toBeTruthy()
      expect(engine.stats().steps).toBe(steps)
      expect(retained.beginTurn('next', { maxGeneratedTokens: 1 }).id).toBe(2)
      drain(engine, buffer)
    })
  })

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

  describe('continuations and prefill', () => {
    it('a continuation counts only its new input as promptTokens and reuses the context', () => {
      const engine = make({ seed: 11 })
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      request.beginTurn('first turn', { maxGeneratedTokens: 4 })
      const e1 = drain(engine, buffer)
      const gen1 = tokensOf(e1, request)
      expect(finishesOf(e1, request)[0].usage).toEqual({ promptTokens: 10, generatedTokens: 4, cachedPromptTokens: 0 })
      expect(request.tokenCount).toBe(14)
      const t2 = request.beginTurn('second', { maxGeneratedTokens: 5 })
      expect(t2.id).toBe(2)
      expect(request.tokenCount).toBe(20)
      const e2 = drain(engine, buffer)
      const finish = finishesOf(e2, request)
      expect(finish).toHaveLength(1)
      expect(finish[0].turnId).toBe(2)
      expect(finish[0].usage).toEqual({ promptTokens: 6, generatedTokens: 5, cachedPromptTokens: 0 })
      expect(request.tokenCount).toBe(25)
      const context = [...engine.tokenize('first turn'), ...gen1, ...engine.tokenize('second')]
      expect(tokensOf(e2, request)).toEqual(referenceTokens(context, 5, { seed: 11 }))
    })

    it('prefill adds context without a turn; the next turn counts only its own input', () => {
      const engine = make({ seed: 12 })
      const buffer = engine.createEventBuffer(16)
      const request = engine.createRequest()
      request.prefill('system: be brief. ')
      expect(request.tokenCount).toBe(18)
      expect(engine.hasPendingWork()).toBe(true)
      const prefillEvents = drain(engine, buffer)
      expect(eventsOf(prefillEvents, request)).toEqual([])
      expect(engine.stats().promptTokens).toBe(18)
      const turn = request.beginTurn('hi', { maxGeneratedTokens: 4 })
      expect(turn.id).toBe(1)
      const events = drain(engine, buffer)
      expect(finishesOf(events, request)[0].usage).toEqual({ promptTokens: 2, generatedTokens: 4, cachedPromptTokens: 0 })
      expect(request.tokenCount).toBe(24)
      expect(tokensOf(events, request)).toEqual(referenceTokens('system: be brief. hi', 4, { seed: 12 }))
    })
  })

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

  describe('determinism', () => {
    it('greedy decoding: same seed, same tokens; another seed, other tokens', () => {
      const a = referenceTokens('determinism', 16, { seed: 21 })
      const b = referenceTokens('determinism', 16, { seed: 21 })
      const c = referenceTokens('determinism', 16, { seed: 22 })
      expect(a).toEqual(b)
      expect(a).not.toEqual(c)
    })

    it('seeded sampling reproduces; another sampler seed differs', () => {
      const sample = (engineSeed: number, seed?: number) => {
        const engine = make({ seed: engineSeed })
        const request = engine.createRequest()
        request.beginTurn('sampling', { temperature: 1.0, topK: 6, topP: 0.95, seed, maxGeneratedTokens: 24 })
        return tokensOf(drain(engine, engine.createEventBuffer(8)), request)
      }
      expect(sample(1, 42)).toEqual(sample(1, 42))
      expect(sample(1, 42)).not.toEqual(sample(1, 43))
      // Unseeded sampled turns derive their seed from (engine seed, request id, turn id).
      expect(sample(3)).toEqual(sample(3))
      expect(sample(3)).not.toEqual(sample(4))
    })

    it('a continuation under KV preemption generates the same tokens as without pressure', () => {
      const run = (options: Record<string, unknown>) => {
        const engine = make({ seed: 8, blockSize: 4, ...options })
        const buffer = engine.createEventBuffer(3)
        const requests = [0, 1, 2].map(() => engine.createRequest())
        requests.forEach((r, i) => r.beginTurn(`prompt ${i}`, { maxGeneratedTokens: 6 }))
        const first = drain(engine, buffer)
        requests.forEach((r) => r.beginTurn('+', { maxGeneratedTokens: 5 }))
        const second = drain(engine, buffer)
        const out = requests.map((r) => [...tokensOf(first, r), ...tokensOf(second, r)])
        requests.forEach((r) => r.close())
        expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
        return out
      }
      expect(run({ numBlocks: 6 })).toEqual(run({}))
    })
  })

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
        // test "collecting an engine with a queued reclamation ..." below).
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
  })

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

describe('entry points from ESM and CommonJS', () => {
  function runFixture(file: string): any {
    const out = execFileSync(process.execPath, [resolve(root, 'test/fixtures', file)], { cwd: root, encoding: 'utf8', timeout: 60_000 })
    return JSON.parse(out.trim().split('\n').pop()!)
  }

  it('import and require both entry points; one OrtexError class everywhere', () => {
    const report = runFixture('entry-points.mjs')
    for (const label of ['esmNative', 'esmWasm', 'cjsNative', 'cjsWasm']) {
      expect(report[label].exports, label).toEqual(['Engine', 'Request', 'Turn', 'EventBuffer', 'EventFlags', 'OrtexError'])
      expect(report[label].code, label).toBe('INVALID_ARGUMENT')
      expect(report[label].tokens, label).toEqual(report.esmNative.tokens)
    }
    expect(report.esmNative.backend).toBe('native')
    expect(report.esmWasm.backend).toBe('wasm')
    expect(report.cjsNative.backend).toBe('native')
    expect(report.cjsWasm.backend).toBe('wasm')
    expect(report.sameClass).toEqual({ esmEntryPoints: true, cjsEntryPoints: true, esmAndCjs: true })
    for (const label of ['esmNative', 'esmWasm', 'cjsNative', 'cjsWasm']) expect(report[label].errorIsShared, label).toBe(true)
  })

  it('a CommonJS program requires both entry points', () => {
    const report = runFixture('entry-points.cjs')
    expect(report).toEqual({ native: { backend: 'native', tokens: 3 }, wasm: { backend: 'wasm', tokens: 3 }, sameOrtexError: true })
  })

  it('collecting an engine with a queued reclamation does not stop later FinalizationRegistry callbacks', () => {
    for (const entry of ['ortex', 'ortex/wasm']) {
      const out = execFileSync(process.execPath, ['--expose-gc', resolve(root, 'test/fixtures/finalization-after-engine-gc.mjs'), entry], {
        cwd: root,
        encoding: 'utf8',
        timeout: 60_000,
      })
      expect(JSON.parse(out.trim().split('\n').pop()!), entry).toEqual({ unrelatedRegistryFired: true, droppedRequestReclaimed: true })
    }
  })

  it('a driven engine does not keep the process alive when it has no work', () => {
    for (const entry of ['ortex', 'ortex/wasm']) {
      const result = spawnSync(process.execPath, [resolve(root, 'test/fixtures/driven-exit.mjs'), entry], {
        cwd: root,
        encoding: 'utf8',
        timeout: 60_000,
      })
      expect(result.signal, `${entry}: the process had to be killed (still alive after its work)`).toBeNull()
      expect(result.status, result.stderr).toBe(0)
      const report = JSON.parse(result.stdout.trim().split('\n').pop()!)
      expect(report.tokens).toBe(3)
    }
  })
})
