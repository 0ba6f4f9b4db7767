// The throughput benchmark's concurrency-1 interleaving (bench/throughput/throughput.ts): every system runs
// every request once, in orders that vary, and each system's requests are laid end to end.

import { describe, expect, it } from 'vitest'

import { type SoloSystem, type Workload, runInterleavedSolo, turnOrder } from '../bench/throughput/throughput'

describe('turnOrder', () => {
  it('runs every system once per request, in every position, after different systems', () => {
    const systems = 5
    const positions = Array.from({ length: systems }, () => new Set<number>())
    const predecessors = Array.from({ length: systems }, () => new Set<number>())
    for (let index = 0; index < 2 * systems; index++) {
      const order = Array.from({ length: systems }, (_, k) => turnOrder(index, k, systems))
      expect([...order].sort()).toEqual([0, 1, 2, 3, 4])
      order.forEach((s, k) => {
        positions[s]!.add(k)
        if (k > 0) predecessors[s]!.add(order[k - 1]!)
      })
    }
    for (let s = 0; s < systems; s++) {
      expect(positions[s]!.size).toBe(systems)
      expect(predecessors[s]!.size).toBeGreaterThan(1)
    }
  })
})

describe('runInterleavedSolo', () => {
  const workload = { generatedTokens: 3, requestsByConcurrency: { 1: 4 } } as unknown as Workload

  it('lays each system requests end to end on its own clock', async () => {
    const calls: string[] = []
    const system = (name: 'ortex' | 'naive', msPerToken: number): SoloSystem => ({
      system: name,
      one: async (index) => {
        calls.push(`${name}:${index}`)
        return [1, 2, 3].map((t) => t * msPerToken)
      },
    })
    const rows = await runInterleavedSolo([system('ortex', 10), system('naive', 20)], workload, 2)
    expect(calls.sort()).toEqual(['naive:0', 'naive:1', 'naive:2', 'naive:3', 'ortex:0', 'ortex:1', 'ortex:2', 'ortex:3'])
    const [ortex, naive] = rows
    expect(ortex).toMatchObject({ system: 'ortex', concurrency: 1, round: 2, requests: 4, tokens: 12, wallMs: 120 })
    expect(naive).toMatchObject({ system: 'naive', requests: 4, tokens: 12, wallMs: 240 })
    if ('error' in ortex! || 'error' in naive!) throw new Error('no error expected')
    expect(ortex.tokensPerSecond).toBeCloseTo(100)
    expect(naive.tokensPerSecond).toBeCloseTo(50)
    expect(ortex.ttftMs.p50).toBe(10)
    expect(naive.itlMs.p50).toBe(20)
  })

  it('reports a failing system as an error row and keeps measuring the others', async () => {
    let runs = 0
    const failing: SoloSystem = {
      system: 'genai-generator',
      one: async () => {
        runs++
        throw new Error('the process exited')
      },
    }
    const short: SoloSystem = { system: 'naive', one: async () => [5, 6] }
    const good: SoloSystem = { system: 'ortex', one: async () => [1, 2, 3] }
    const rows = await runInterleavedSolo([failing, short, good], workload, 1)
    expect(runs).toBe(1)
    expect(rows[0]).toEqual({ system: 'genai-generator', concurrency: 1, round: 1, error: 'the process exited' })
    expect(rows[1]).toMatchObject({ system: 'naive', error: expect.stringMatching(/did not generate exactly 3 tokens/) })
    expect(rows[2]).toMatchObject({ system: 'ortex', tokens: 12, wallMs: 12 })
  })
})
