// The GPU benchmark (bench/gpu/): issue 32's goals as ratios, the greedy-token agreement, the
// executor's bus counters per step ("n/a" where the executor has none), the report's CPU banner,
// and the benchmark itself run on the CPU on the tiny model with ortex alone (its Python sides need
// torch and onnxruntime-genai: bench/gpu/test-cpu.sh runs them, outside npm test).

import { execFileSync, spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import * as os from 'node:os'
import { join, resolve } from 'node:path'
import { describe, expect, it } from 'vitest'

import type { ExecutorStats } from 'ortex'

import { busBytesPerStep } from '../bench/gpu/ortex'
import { type GpuReport, type GpuRow, agreementOf, computeGoals, formatReport, goalModel } from '../bench/gpu/report'

const ROOT = resolve(__dirname, '..')

function row(system: GpuRow['system'], concurrency: number, tokensPerSecond: number, model = 'bench'): GpuRow {
  return { model, system, concurrency, requests: concurrency, tokens: concurrency * 128, wallMs: 1, tokensPerSecond }
}

describe('GPU benchmark goals', () => {
  const rows = [
    row('ortex', 1, 1200),
    row('ortex', 64, 29_000),
    row('transformers', 64, 17_000),
    row('genai', 1, 1500),
    row('genai', 64, 20_000),
    { model: 'bench', system: 'genai', concurrency: 256, error: 'skipped' } as GpuRow,
    row('ortex', 1, 99_999, 'smollm2'),
  ]
  const goals = computeGoals(rows, [1, 64, 256])
  const byName = (name: string) => goals.find((g) => g.name === name)!

  it('computes absolute goals on the bench model only', () => {
    expect(byName('ortex, concurrency 1')).toMatchObject({ value: 1200, target: 1000, met: true })
    expect(byName('ortex, concurrency 1').ratio).toBeCloseTo(1.2)
    expect(byName('ortex, concurrency 64')).toMatchObject({ value: 29_000, met: false })
  })

  it('computes ratios against the other systems at the same concurrency', () => {
    expect(byName('ortex / transformers, concurrency 64').value).toBeCloseTo(29_000 / 17_000)
    expect(byName('ortex / transformers, concurrency 64').met).toBe(true)
    expect(byName('ortex / onnxruntime-genai, concurrency 1')).toMatchObject({ met: false })
    expect(byName('ortex / onnxruntime-genai, concurrency 64').value).toBeCloseTo(1.45)
  })

  it('reports a goal whose rows are missing or failed as not measured, never as met', () => {
    expect(byName('ortex / onnxruntime-genai, concurrency 256')).toMatchObject({ value: null, ratio: null, met: null })
    const table = formatReport(report(rows, goals))
    expect(table).toContain('| ortex / onnxruntime-genai, concurrency 256 | n/a | 1x | n/a | n/a (not measured) |')
    expect(table).toContain('| ortex, concurrency 64 | 29,000.0 | 30,000 | 0.97 | not met |')
  })

  it('describes each system as loaded, without its token ids', () => {
    const table = formatReport({ ...report(rows, goals), systems: { bench: { genai: { version: '0.18.0', batching: 'dynamic', loadS: 1.234, firstTokens: [1, 2] } } } })
    expect(table).toContain('- bench, onnxruntime-genai: version 0.18.0, batching dynamic, loadS 1.2')
    expect(table).not.toContain('firstTokens')
  })

  it('computes the goals on the bench model where the run has it, else on its first model', () => {
    expect(goalModel([{ name: 'tiny', dir: 'a', form: 'gqa-fp32' }, { name: 'bench', dir: 'b', form: 'gqa-fp32' }])).toBe('bench')
    expect(goalModel([{ name: 'tiny', dir: 'a', form: 'gqa-fp32' }])).toBe('tiny')
  })

  it('marks a CPU run as a dry run, not the GPU result', () => {
    const cpu = formatReport({ ...report(rows, goals), provider: 'cpu' })
    expect(cpu.split('\n')[0]).toContain('CPU DRY RUN')
    expect(cpu).toContain('NOT the GPU result')
    expect(formatReport(report(rows, goals))).not.toContain('DRY RUN')
  })
})

describe('GPU benchmark measures', () => {
  it('counts equal greedy tokens position by position over ortex\'s', () => {
    expect(agreementOf([1, 2, 3, 4], [1, 2, 9, 4, 5])).toEqual({ same: 3, of: 4 })
    expect(agreementOf([1, 2], [])).toEqual({ same: 0, of: 2 })
  })

  it('divides the executor\'s byte counters by the steps between two snapshots', () => {
    const stats = (steps: number, hostInputBytes: number, logitsBytes: number, kvCopiedBytes: number) =>
      ({ steps, hostInputBytes, logitsBytes, kvCopiedBytes }) as unknown as ExecutorStats
    expect(busBytesPerStep(stats(10, 1000, 0, 7), stats(30, 5000, 2000, 7))).toEqual({ hostInputs: 200, logits: 100, kvCopied: 0 })
  })
})

describe('GPU benchmark on the CPU (tiny model, ortex alone)', () => {
  it('runs every concurrency, writes the report and prints the goals', () => {
    const out = mkdtempSync(join(os.tmpdir(), 'ortex-gpu-bench-'))
    try {
      // the bundle lives in the repository (it imports 'ortex' by the package's own name)
      const inRepo = join(ROOT, 'bench', 'out', `gpu-bench-test-${process.pid}.mjs`)
      execFileSync(join(ROOT, 'node_modules', '.bin', 'esbuild'), [
        join(ROOT, 'bench', 'gpu', 'main.ts'),
        '--bundle', '--platform=node', '--format=esm', '--external:ortex', '--external:onnxruntime-node', '--log-level=warning', `--outfile=${inRepo}`,
      ])
      const run = spawnSync(process.execPath, [inRepo, '--quick', '--provider', 'cpu', '--size', 'tiny', '--no-hf', '--no-genai', '--concurrency', '1,16,64', '--out', out, '--models', join(out, 'models')], {
        encoding: 'utf8',
        timeout: 50_000,
      })
      rmSync(inRepo, { force: true })
      expect(run.status, run.stderr).toBe(0)
      expect(run.stdout).toContain('CPU DRY RUN')
      const json = JSON.parse(readFileSync(join(out, 'gpu-bench.json'), 'utf8')) as GpuReport
      expect(json.models).toEqual([expect.objectContaining({ name: 'tiny', form: 'gqa-fp32' })])
      expect(json.rows.map((r) => [r.system, r.concurrency, r.error])).toEqual([['ortex', 1, undefined], ['ortex', 16, undefined], ['ortex', 64, undefined]])
      for (const r of json.rows) {
        expect(r.tokens).toBe(r.concurrency === 1 ? 2 * 16 : r.concurrency * 16)
        // the gqa folder on the CPU: inputs and logits every step, KV copied between the store and its tensors
        expect(r.busBytesPerStep!.hostInputs).toBeGreaterThan(0)
        expect(r.busBytesPerStep!.logits).toBeGreaterThan(0)
        expect(r.busBytesPerStep!.kvCopied).toBeGreaterThan(0)
        expect(r.steps).toBeGreaterThan(0)
      }
      expect(json.goals.find((g) => g.name === 'ortex, concurrency 1')?.value).toBe(json.rows[0]!.tokensPerSecond)
      expect(readFileSync(join(out, 'gpu-bench.md'), 'utf8')).toContain('| ortex | 64 | 64 |')
    } finally {
      rmSync(out, { recursive: true, force: true })
    }
  })
})

function report(rows: GpuRow[], goals: GpuReport['goals']): GpuReport {
  return {
    createdAt: '2026-12-05T00:00:00.000Z',
    quick: false,
    provider: 'cuda',
    machine: { gpu: 'NVIDIA H200', cpus: 16, node: 'v20' },
    models: [{ name: 'bench', dir: 'm', form: 'paged-fp16' }],
    workload: { concurrencies: [1, 64, 256], generatedTokens: 128, promptLengths: [16, 72], requestsByConcurrency: {} },
    systems: {},
    rows,
    agreement: [],
    goals,
    elapsedS: 1,
  }
}
