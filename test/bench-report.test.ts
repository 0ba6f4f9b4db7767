// The throughput benchmark's text report (ts/bench/report.ts): a goal's printed value agrees with
// its verdict.

import { describe, expect, it } from 'vitest'

import { formatTable } from '../ts/bench/report'
import type { Goal, ThroughputReport } from '../ts/bench/throughput'

function report(goals: Goal[]): ThroughputReport {
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
    summary: [],
    naive: { ok: true },
    genai: { ok: true, version: '0.18.0', onnxruntimeVersion: '1.32.0' },
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
})
