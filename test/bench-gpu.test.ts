// The GPU benchmark (bench/gpu/): issue 32's goals as ratios, the greedy-token agreement, the
// executor's bus counters per step ("n/a" where the executor has none), the report's CPU banner,
// and the benchmark itself run on the CPU on the tiny model with ortex alone (its Python sides need
// torch and onnxruntime-genai: bench/gpu/test-cpu.sh runs them, outside npm test).

import { execFileSync, spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import * as os from 'node:os'
import { join, resolve } from 'node:path'
import { describe, expect, it } from 'vitest'

import { Engine, type ExecutorStats } from 'ortex'

import { greedyReference, teacherForcedAgreement } from '../bench/gpu/correctness'
import { folderBlockSize, prepareModel } from '../bench/gpu/models'
import { busBytesPerStep } from '../bench/gpu/ortex'
import { type BlockSizeRow, type GpuReport, type GpuRow, agreementOf, computeGoals, correctnessGoals, fasterBlockSize, formatReport, goalModel } from '../bench/gpu/report'
import { makeModel } from '../ts/modelkit/make-model'
import { tinyPrompt } from './helpers/tiny-models'

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

describe('GPU benchmark correctness goals (issue 32, item 3)', () => {
  const entry = (matches: number, positions: number) =>
    ({ model: 'bench', dir: 'f', form: 'gqa-fp32', provider: 'cuda', prompts: 2, referenceTokens: 64, positions, matches, mismatches: [[1, 40]], cut: false }) as GpuReport['correctness'][number]
  const models = [{ name: 'bench', dir: 'm', form: 'paged-fp16' }]
  const goalsOf = (tf: GpuReport['correctness'], same: number) => correctnessGoals({ models, correctness: tf, agreement: [{ model: 'bench', system: 'genai', same, of: 128 }] })

  it('meets teacher-forced agreement at 99% of positions and greedy equality with genai only at every token', () => {
    const [tf, genai] = goalsOf([entry(127, 128)], 128)
    expect(tf).toMatchObject({ target: 0.99, unit: 'fraction', met: true })
    expect(tf!.value).toBeCloseTo(127 / 128)
    expect(genai).toMatchObject({ name: 'greedy tokens = onnxruntime-genai, request 0 (paged-fp16 folder)', value: 1, met: true })
    const [tfLow, genaiLow] = goalsOf([entry(126, 128)], 127)
    expect(tfLow!.met).toBe(false)
    expect(genaiLow!.met).toBe(false)
  })

  it('leaves a failed or missing agreement unmeasured, never met', () => {
    const failed = { ...entry(0, 0), error: 'cuda failed: boom' }
    const [tf, genai] = correctnessGoals({ models, correctness: [failed], agreement: [] })
    expect(tf).toMatchObject({ value: null, met: null })
    expect(genai).toMatchObject({ value: null, met: null })
  })

  it('prints the agreement, its first disagreements and the goal lines', () => {
    const goals = goalsOf([entry(127, 128)], 128)
    const text = formatReport({ ...report([], goals), correctness: [entry(127, 128)] })
    expect(text).toContain('- bench, cuda (gqa-fp32, 2 prompts x 64 reference tokens): 127 of 128 positions, 99.2%; first disagreements at 1:40 (prompt:position)')
    expect(text).toContain('| top-1 agreement with the CPU, fp32 (teacher-forced) | 99.2% | 99% | 1.00 | met |')
    expect(text).toContain('| greedy tokens = onnxruntime-genai, request 0 (paged-fp16 folder) | 100.0% | 100% | 1.00 | met |')
  })
})

describe('GPU benchmark teacher-forced agreement on a real engine (tiny model, CPU)', () => {
  it('agrees with its own greedy reference at every position, and not with a perturbed one', async () => {
    const dir = mkdtempSync(join(os.tmpdir(), 'ortex-gpu-tf-'))
    try {
      await makeModel({ outDir: dir, size: 'tiny' })
      const engine = await Engine.load(dir, { maxBatchSize: 16, numBlocks: 128, intraOpThreads: 1 })
      try {
        const prompts = [tinyPrompt(12, 1), tinyPrompt(20, 2)]
        const reference = await greedyReference(engine, prompts, 8)
        expect(reference.map((r) => r.length)).toEqual([8, 8])
        expect(await teacherForcedAgreement(engine, prompts, reference)).toEqual({ positions: 16, matches: 16, mismatches: [], cut: false })
        // one token changed: its position disagrees (the positions after it see a changed prefix)
        const perturbed = reference.map((r) => [...r])
        perturbed[1]![3] = perturbed[1]![3] === 5 ? 6 : 5
        const result = await teacherForcedAgreement(engine, prompts, perturbed)
        expect(result.positions).toBe(16)
        expect(result.matches).toBeLessThan(16)
        expect(result.mismatches).toContainEqual([1, 3])
        expect(result.mismatches.every(([p, k]) => p === 1 && k >= 3)).toBe(true)
        // a deadline already past stops before the first chunk and says so
        expect(await teacherForcedAgreement(engine, prompts, reference, performance.now() - 1)).toEqual({ positions: 0, matches: 0, mismatches: [], cut: true })
      } finally {
        await engine.close()
      }
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })
})

describe('GPU benchmark block sizes (issue 32, item 1)', () => {
  const sized = (blockSize: number, concurrency: number, tokensPerSecond?: number, error?: string): BlockSizeRow => ({ model: 'bench', blockSize, concurrency, tokensPerSecond, error })

  it('names the faster block size and by how much over the next, per concurrency', () => {
    const rows = [sized(256, 1, 1000), sized(256, 64, 30_000), sized(16, 1, 800), sized(16, 64, 20_000)]
    expect(fasterBlockSize(rows, 'bench')).toBe('block size 256 is faster at every concurrency compared (concurrency 1: 1.25x, concurrency 64: 1.50x over the next)')
    const mixed = [sized(256, 1, 1000), sized(256, 64, 20_000), sized(16, 1, 800), sized(16, 64, 30_000)]
    expect(fasterBlockSize(mixed, 'bench')).toBe('no single winner: block size 256 at concurrency 1 (1.25x), block size 16 at concurrency 64 (1.50x)')
  })

  it('makes a paged folder per block size (make-model --block-size), and leaves other forms to the engine', () => {
    const dir = mkdtempSync(join(os.tmpdir(), 'ortex-gpu-bs-'))
    try {
      const lines: string[] = []
      const sized = prepareModel(ROOT, dir, { name: 'tiny', kind: { make: 'tiny' } }, 'paged-fp16', (line) => lines.push(line), 32)
      expect(sized).toMatchObject({ name: 'tiny', form: 'paged-fp16', dir: join(dir, 'tiny-paged-fp16-bs32') })
      expect(folderBlockSize(sized.dir)).toBe(32)
      expect(lines).toEqual([expect.stringContaining('--block-size 32')])
      const plain = prepareModel(ROOT, dir, { name: 'tiny', kind: { make: 'tiny' } }, 'gqa-fp32', () => {}, 32)
      expect(plain.dir).toBe(join(dir, 'tiny-gqa-fp32'))
      expect(folderBlockSize(plain.dir)).toBeUndefined()
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it('compares only measured rows, and says so where fewer than two block sizes were measured', () => {
    const rows = [sized(256, 1, 1000), sized(256, 64, 30_000), sized(16, 1, 800), sized(16, 64, undefined, 'skipped: about 90 s, more than the time left')]
    expect(fasterBlockSize(rows, 'bench')).toBe('block size 256 is faster at every concurrency compared (concurrency 1: 1.25x over the next)')
    expect(fasterBlockSize([sized(256, 1, 1000)], 'bench')).toBeNull()
    const text = formatReport({ ...report([], []), blockSizes: [sized(256, 1, 1000), sized(16, 1, undefined, 'load failed: x')] })
    expect(text).toContain('| block size | concurrency 1 |')
    expect(text).toContain('| 256 | 1,000.0 |')
    expect(text).toContain('| 16 | load failed: x |')
    expect(text).toContain('Faster: n/a (fewer than two block sizes measured at any concurrency)')
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
      const run = spawnSync(process.execPath, [inRepo, '--quick', '--provider', 'cpu', '--size', 'tiny', '--no-hf', '--no-genai', '--concurrency', '1,16,64', '--block-sizes', '16,32', '--out', out, '--models', join(out, 'models')], {
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
      const md = readFileSync(join(out, 'gpu-bench.md'), 'utf8')
      expect(md).toContain('| ortex | 64 | 64 |')
      // correctness: both sides are the CPU on the dry run, so every position agrees
      expect(json.correctness).toEqual([expect.objectContaining({ model: 'tiny', form: 'gqa-fp32', provider: 'cpu', prompts: 2, referenceTokens: 16, positions: 32, matches: 32, cut: false })])
      expect(json.goals.find((g) => g.name.startsWith('top-1 agreement'))).toMatchObject({ value: 1, met: true })
      expect(json.goals.find((g) => g.name.startsWith('greedy tokens = onnxruntime-genai'))).toMatchObject({ value: null, met: null })
      // block sizes: each measured at concurrency 1 and 64 in its own engine
      expect(json.blockSizes.map((r) => [r.blockSize, r.concurrency, r.error])).toEqual([[16, 1, undefined], [16, 64, undefined], [32, 1, undefined], [32, 64, undefined]])
      for (const r of json.blockSizes) expect(r.tokensPerSecond).toBeGreaterThan(0)
      expect(md).toMatch(/Faster: block size (16|32) is faster|Faster: no single winner/)
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
    correctness: [],
    blockSizes: [],
    goals,
    elapsedS: 1,
  }
}
