// Lifecycle edges a hostile caller found (issue 15), on both backends: a turn whose finish is in a
// run() that has not returned yet, the largest documented sizes, and the virtual clock's range.
import { afterEach, describe, expect, it } from 'vitest'
import { BACKENDS, ortex, type BackendName } from './helpers/backends'
import { drain, expectCode, type Engine } from './helpers/util'

describe.each(BACKENDS)('lifecycle (%s)', (backend: BackendName) => {
  const mod = ortex(backend)
  const engines: Engine[] = []

  function simulated(options: Record<string, unknown> = {}): Engine {
    const engine = mod.Engine.simulated({ seed: 1, ...options })
    engines.push(engine)
    return engine
  }

  afterEach(async () => {
    for (const engine of engines.splice(0)) await engine.close()
  })

  it('a new turn waits while the previous turn\'s finish is in a run() in flight; every turn ends once', async () => {
    const engine = simulated()
    const request = engine.createRequest()
    const first = request.beginTurn('hello', { maxGeneratedTokens: 50 })
    const buffer = engine.createEventBuffer(8)
    await engine.run(buffer)
    first.cancel()
    // This run carries first's finish event; it is routed only when the run returns.
    const inFlight = engine.run(buffer)
    expectCode(mod, () => request.beginTurn(' next', { maxGeneratedTokens: 3 }), 'EVENTS_PENDING')
    await inFlight
    const result = await first.done
    expect(result.finishReason).toBe('cancelled')
    const second = request.beginTurn(' next', { maxGeneratedTokens: 3 })
    expect(second.id).toBe(2)
    drain(engine, buffer)
    expect((await second.done).finishReason).toBe('max-generated-tokens')
    await engine.close()
    expect((await first.done).finishReason).toBe('cancelled')
  })

  it('close() settles every done, whatever runs are in flight', async () => {
    const engine = simulated()
    const requests = [0, 1, 2].map(() => engine.createRequest())
    const turns = requests.map((request) => request.beginTurn('go', { maxGeneratedTokens: 20 }))
    const buffer = engine.createEventBuffer(1)
    await engine.run(buffer)
    turns[1]!.cancel()
    const inFlight = [engine.run(buffer), engine.run(buffer)]
    await engine.close()
    await Promise.allSettled(inFlight)
    const results = await Promise.all(turns.map((turn) => turn.done))
    for (const result of results) expect(['cancelled', 'max-generated-tokens']).toContain(result.finishReason)
  })

  it('a stop carries which stop sequence it was: a stop string (matched in the text) or stop token ids', async () => {
    const engine = simulated()
    const free = await engine.generate('tell me', { maxGeneratedTokens: 12, ignoreEos: true }).done
    expect(free.stop).toBe(null)
    const third = free.tokens[3]!
    const byTokens = await engine.generate('tell me', { maxGeneratedTokens: 12, ignoreEos: true, stopTokenIds: [[99_999 % 300], [third]] }).done
    expect(byTokens.finishReason).toBe('stop')
    expect(byTokens.stop).toEqual({ kind: 'token-ids', index: 1 })
    expect(Array.from(byTokens.tokens)).toEqual(Array.from(free.tokens.slice(0, byTokens.tokens.length)))
    const word = engine.detokenize([free.tokens[5]!]).trim()
    const byText = await engine.generate('tell me', { maxGeneratedTokens: 12, ignoreEos: true, stop: ['no such text', word] }).done
    expect(byText.finishReason).toBe('stop')
    expect(byText.stop).toEqual({ kind: 'string', index: 1 })
    expect(byText.text).toBe(free.text.slice(0, free.text.indexOf(word)))
  })

  it('documented-valid sizes work: maxLength 2^24 and numBlocks 2^24 allocate only what is used', async () => {
    for (const options of [{ maxLength: 2 ** 24 }, { numBlocks: 2 ** 24 }, { maxLength: 2 ** 24, numBlocks: 2 ** 24, blockSize: 16 }]) {
      const engine = simulated(options)
      const turn = engine.generate('a long context, sized for it', { maxGeneratedTokens: 8 })
      const result = await turn.done
      expect(result.usage.generatedTokens, JSON.stringify(options)).toBe(8)
      expect(engine.stats().totalBlocks).toBe(engine.config.numBlocks)
      await engine.close()
    }
  })

  it('virtualTimeUs saturates at Number.MAX_SAFE_INTEGER instead of wrapping around', async () => {
    const max = Number.MAX_SAFE_INTEGER
    const engine = simulated({ stepCostUs: max, tokenCostUs: max })
    const request = engine.createRequest()
    request.beginTurn('tick tock', { maxGeneratedTokens: 5 })
    const buffer = engine.createEventBuffer(8)
    let last = 0
    while (engine.hasPendingWork()) {
      engine.runSync(buffer)
      const now = engine.stats().virtualTimeUs
      expect(now).toBeGreaterThanOrEqual(last)
      expect(now).toBeLessThanOrEqual(max)
      last = now
    }
    expect(last).toBe(max)
    const small = simulated({ stepCostUs: 10, tokenCostUs: 3 })
    small.createRequest().beginTurn('abc', { maxGeneratedTokens: 1 })
    drain(small, small.createEventBuffer(8))
    expect(small.stats().virtualTimeUs).toBe(10 + 3 * 3)
  })

  it('Engine.simulated never reports an internal failure as UNSUPPORTED', () => {
    for (const options of [{ numBlocks: 2 ** 24, blockSize: 4096 }, { maxLength: 2 ** 25 }]) {
      try {
        mod.Engine.simulated(options)
        throw new Error('accepted')
      } catch (error) {
        expect((error as { code?: string }).code, JSON.stringify(options)).toBe('INVALID_ARGUMENT')
      }
    }
  })
})
