// The engine itself: its backend and resolved defaults, EventFlags, the simulated tokenizer, stats,
// run and runSync alike; and determinism: the same seed gives the same tokens, under KV
// preemption too.
// Part of the public contract (docs/api.md), run unchanged on both backends (setup.ts).
import { describe, expect, it } from 'vitest'
import { drain, readEvents, tokensOf, type EventCopy } from '../helpers/util'
import { describeContract } from './setup'

describeContract(({ backend, mod, make, referenceTokens }) => {
  const { EventFlags } = mod

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
        prefixCaching: true,
      })
      expect([...engine.config.eosTokenIds]).toEqual([2])
      expect(make({ prefixCaching: false }).config.prefixCaching).toBe(false)
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
      for (const key of ['totalBlocks', 'freeBlocks', 'activeRequests', 'pendingTurns', 'retainedEvents', 'steps', 'promptTokens', 'generatedTokens',
        'virtualTimeUs', 'cachedBlocks', 'prefixCacheLookups', 'prefixCacheHits']) {
        expect(typeof (stats as any)[key], key).toBe('number')
      }
      expect(stats.totalBlocks).toBe(engine.config.numBlocks)
      expect(stats.freeBlocks).toBe(stats.totalBlocks)
      expect(engine.hasPendingWork()).toBe(false)
    })

    it('serves a shared prompt prefix from the cache, and not with prefixCaching false', async () => {
      const system = Array.from({ length: 40 }, (_, i) => 100 + i)
      const outcome = async (prefixCaching: boolean) => {
        const engine = make({ seed: 9, blockSize: 16, prefixCaching })
        const results = []
        for (const question of [7, 8, 9]) results.push(await engine.generate([...system, question], { maxGeneratedTokens: 5 }).done)
        const stats = engine.stats()
        await engine.close()
        return { results, stats }
      }
      const on = await outcome(true)
      const off = await outcome(false)
      expect(on.results.map((r) => r.usage.cachedPromptTokens)).toEqual([0, 32, 32])
      expect(off.results.map((r) => r.usage.cachedPromptTokens)).toEqual([0, 0, 0])
      expect(on.results.map((r) => [...r.tokens])).toEqual(off.results.map((r) => [...r.tokens]))
      expect(on.results.map((r) => r.usage.promptTokens)).toEqual([41, 41, 41])
      // Each request's two full prompt blocks, looked up by the later two and found.
      expect(on.stats).toMatchObject({ prefixCacheLookups: 1 + 2 + 2, prefixCacheHits: 4 })
      expect(on.stats.cachedBlocks).toBeGreaterThanOrEqual(2)
      expect(on.stats.freeBlocks).toBe(on.stats.totalBlocks) // evictable blocks count as free
      expect(off.stats).toMatchObject({ cachedBlocks: 0, prefixCacheLookups: 0, prefixCacheHits: 0 })
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
})
