// The throughput benchmark's text report (bench/throughput/report.ts): a goal's printed value agrees with
// its verdict, and ortex's engines say how much of their weights went on huge pages.

import { describe, expect, it } from 'vitest'

import { formatTable } from '../bench/throughput/report'
import type { Goal, Row, ThroughputReport } from '../bench/throughput/throughput'

function report(goals: Goal[], summary: Row[] = [], ortexWeights: ThroughputReport['ortexWeights'] = []): ThroughputReport {
  return {
    createdAt: '2026-11-30T00:00:00.000Z',
    quick: false,
    machine: { cpus: 2, cpuModel: 'test', loadAverageStart: [0, 0, 0], loadAverageEnd: [0, 0, 0], node: 'v20' },
    workload: {
      modelDir: 'model',
      promptLengths: [32],
      generatedTokens: 128,
      concurrencies: [1, 16],
      requestsByConcurrency: { 1: 8, 16: 16 },
      staggerMs: 5,
      intraOpThreads: 2,
      intraOpSpinning: true,
      maxBatchSize: 16,
    },
    rounds: 3,
    rows: [],
    summary,
    naive: { ok: true },
    genai: { ok: true, version: '0.18.0', onnxruntimeVersion: '1.32.0' },
    ortexWeights,
    goals,
    elapsedS: 1,
  }
}

describe('formatTable', () => {
  it('prints a ratio just under its target so that it reads as missed', () => {
    const text = formatTable(
      report([
        {
          name: 'vs onnxruntime-genai, concurrency 1',
          goal: 'ortex >= 1.0x onnxruntime-genai at concurrency 1',
          value: 0.99507,
          perRound: [0.99507, 0.98176, 1.00658],
          unit: 'x',
          ratio: 0.99507,
          met: false,
          detail: '',
        },
        {
          name: 'outside session runs, concurrency 16',
          goal: 'engine time outside session runs <= 10% of step time at concurrency 16',
          value: 5.41,
          perRound: [5.51, 5.41, null],
          unit: '%',
          ratio: 0.541,
          met: true,
          detail: '',
        },
      ]),
    )
    expect(text).toContain(
      'ortex >= 1.0x onnxruntime-genai at concurrency 1: 0.995x, 0.995 of the target (missed) (rounds: 0.995, 0.982, 1.007)',
    )
    expect(text).not.toContain('1.00x')
    expect(text).toContain('at concurrency 16: 5.4%, 0.541 of the target (met) (rounds: 5.51, 5.41, -)')
  })

  it('lists each ortex engine weights on huge pages and in chunks under its steps', () => {
    const percentiles = { p50: 1, p99: 2 }
    const row: Row = {
      system: 'ortex',
      concurrency: 1,
      round: 0,
      requests: 8,
      tokens: 1024,
      wallMs: 12_000,
      tokensPerSecond: 85,
      ttftMs: percentiles,
      itlMs: percentiles,
      executor: {
        steps: 1024,
        invocations: 1024,
        runMs: 11_600,
        gatherMs: 30,
        scatterMs: 45,
        executeMs: 11_700,
        stepMs: 11.7,
        outsideRunPct: 3.3,
      },
    }
    const text = formatTable(
      report([], [row], [
        { system: 'ortex', hugePageBytes: 212 * 2 ** 20, weightChunkBytes: 217 * 2 ** 20 },
        { system: 'ortex-blocking', hugePageBytes: 0, weightChunkBytes: 0 },
      ]),
    )
    const lines = text.split('\n')
    const steps = lines.findIndex((line) => line.startsWith('  ortex           concurrency  1: 1024 steps'))
    expect(steps).toBeGreaterThan(0)
    expect(lines[steps + 1]).toBe('  ortex           weights: 212 MiB on huge pages, 217 MiB in weight chunks')
    expect(lines[steps + 2]).toBe('  ortex-blocking  weights: 0 MiB on huge pages, 0 MiB in weight chunks')
  })
})
