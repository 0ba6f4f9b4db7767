// The GPU benchmark's report (bench/gpu/): its rows, issue 32's goals computed from them as ratios,
// and the markdown table it prints. Pure functions: test/bench-gpu-report.test.ts checks them.

import type { Percentiles } from '../throughput/stats'

export type GpuSystem = 'ortex' | 'transformers' | 'genai'

export const SYSTEM_LABELS: Readonly<Record<GpuSystem, string>> = {
  ortex: 'ortex',
  transformers: 'transformers (static cache)',
  genai: 'onnxruntime-genai',
}

/** Bytes that crossed the bus per engine step, where the executor counts them (null: not counted). */
export interface BusBytes {
  /** Host inputs sent to the model per step (host -> device on CUDA). */
  hostInputs: number
  /** Logits received per step (device -> host on CUDA). */
  logits: number
  /** KV copied between the host KV store and the model's tensors per step (both ways). */
  kvCopied: number
}

/** One system at one concurrency on one model: its numbers, or why it has none. */
export interface GpuRow {
  model: string
  system: GpuSystem
  concurrency: number
  error?: string
  requests?: number
  tokens?: number
  wallMs?: number
  tokensPerSecond?: number
  ttftMs?: Percentiles
  itlMs?: Percentiles
  /** Device memory in use (all processes, nvidia-smi) right after the run, MiB; null without a GPU. */
  gpuMemoryMb?: number | null
  /** The process's resident memory after the run, MiB (where the system reports it). */
  rssMb?: number | null
  /** ortex only: engine steps of the run and the bytes its executor moved per step. */
  steps?: number
  busBytesPerStep?: BusBytes
}

export interface GoalResult {
  name: string
  /** The goal as issue 32 states it. */
  goal: string
  value: number | null
  target: number
  /** fraction: a share of positions or tokens, printed as a percentage. */
  unit: 'tokens/s' | 'x' | 'fraction'
  /** value / target; >= 1 meets the goal. */
  ratio: number | null
  met: boolean | null
}

/** Whether a system's greedy tokens for request 0 equal ortex's. */
export interface Agreement {
  model: string
  system: GpuSystem
  same: number
  of: number
}

/** Teacher-forced top-1 agreement of ortex on the provider with ortex on the CPU (issue 32, item 3). */
export interface CorrectnessEntry {
  model: string
  /** The float32 folder it ran on. */
  dir: string
  form: string
  provider: 'cpu' | 'cuda'
  prompts: number
  /** Greedy tokens of the CPU reference per prompt. */
  referenceTokens: number
  positions: number
  matches: number
  /** The first disagreements, as [prompt index, position]. */
  mismatches: [number, number][]
  /** The phase's share of the time budget ran out before every position was checked. */
  cut: boolean
  error?: string
}

/** ortex's tokens/s on one folder at one KV block size (issue 32, item 1: 16 against 256). */
export interface BlockSizeRow {
  model: string
  blockSize: number
  concurrency: number
  tokensPerSecond?: number
  error?: string
}

export interface ModelEntry {
  name: string
  dir: string
  /** The folder's form as made (paged-fp16, gqa-fp32, ...). */
  form: string
  /** Why the form differs from the one asked for, or other notes on the folder. */
  note?: string
}

export interface GpuReport {
  createdAt: string
  quick: boolean
  provider: 'cpu' | 'cuda'
  machine: { gpu: string | null; cpus: number; node: string }
  models: ModelEntry[]
  workload: { concurrencies: number[]; generatedTokens: number; promptLengths: number[]; requestsByConcurrency: Record<string, number> }
  /** What each system reported about itself once loaded (versions, batching, load time), per model. */
  systems: Record<string, Partial<Record<GpuSystem, Record<string, unknown>>>>
  rows: GpuRow[]
  agreement: Agreement[]
  correctness: CorrectnessEntry[]
  blockSizes: BlockSizeRow[]
  goals: GoalResult[]
  elapsedS: number
}

/** The model issue 32's goals are stated for. */
export const GOAL_MODEL = 'bench'

/** The model the goals are computed on: the bench model where the run has it, else its first
 *  (a dry run on the tiny model still exercises the arithmetic; the report says which). */
export function goalModel(models: readonly ModelEntry[]): string {
  return models.some((m) => m.name === GOAL_MODEL) ? GOAL_MODEL : (models[0]?.name ?? GOAL_MODEL)
}

function tokensPerSecond(rows: readonly GpuRow[], model: string, system: GpuSystem, concurrency: number): number | null {
  const row = rows.find((r) => r.model === model && r.system === system && r.concurrency === concurrency)
  return row?.tokensPerSecond ?? null
}

function goal(name: string, text: string, value: number | null, target: number, unit: GoalResult['unit']): GoalResult {
  return { name, goal: text, value, target, unit, ratio: value === null ? null : value / target, met: value === null ? null : value >= target }
}

/** Issue 32's goals on the bench model: absolute rates at 1 and 64, ratios against transformers and onnxruntime-genai. */
export function computeGoals(rows: readonly GpuRow[], concurrencies: readonly number[], model = GOAL_MODEL): GoalResult[] {
  const ortex = (c: number) => tokensPerSecond(rows, model, 'ortex', c)
  const over = (system: GpuSystem, c: number): number | null => {
    const ours = ortex(c)
    const theirs = tokensPerSecond(rows, model, system, c)
    return ours === null || theirs === null || theirs <= 0 ? null : ours / theirs
  }
  return [
    goal('ortex, concurrency 1', '>= 1,000 tokens/s at concurrency 1', ortex(1), 1000, 'tokens/s'),
    goal('ortex, concurrency 64', '>= 30,000 tokens/s at concurrency 64', ortex(64), 30000, 'tokens/s'),
    goal('ortex / transformers, concurrency 64', '>= 1.5x transformers at concurrency 64', over('transformers', 64), 1.5, 'x'),
    ...concurrencies.map((c) => goal(`ortex / onnxruntime-genai, concurrency ${c}`, '>= 1.0x onnxruntime-genai-cuda at every concurrency', over('genai', c), 1, 'x')),
  ]
}

/** Issue 32's correctness goals on `model`: teacher-forced top-1 agreement with the CPU on a
 *  float32 folder (>= 99%), and request 0's greedy tokens equal to onnxruntime-genai's on the run's
 *  folder (all of them; the fp16 paged folder on cuda). */
export function correctnessGoals(report: Pick<GpuReport, 'correctness' | 'agreement' | 'models'>, model = GOAL_MODEL): GoalResult[] {
  const tf = report.correctness.find((c) => c.model === model && c.error === undefined && c.positions > 0)
  const genai = report.agreement.find((a) => a.model === model && a.system === 'genai' && a.of > 0)
  const form = report.models.find((m) => m.name === model)?.form ?? 'the run\'s'
  return [
    goal('top-1 agreement with the CPU, fp32 (teacher-forced)', '>= 99% of positions on an fp32 folder', tf ? tf.matches / tf.positions : null, 0.99, 'fraction'),
    goal(`greedy tokens = onnxruntime-genai, request 0 (${form} folder)`, "fp16 greedy = genai-cuda: every greedy token equal on the same folder", genai ? genai.same / genai.of : null, 1, 'fraction'),
  ]
}

/** Which block size gave more tokens/s, per concurrency where at least two were measured, and
 *  by how much over the next; null where nothing can be compared. */
export function fasterBlockSize(rows: readonly BlockSizeRow[], model: string): string | null {
  const measured = rows.filter((r) => r.model === model && r.tokensPerSecond !== undefined)
  const concurrencies = [...new Set(measured.map((r) => r.concurrency))].sort((a, b) => a - b)
  const winners: { concurrency: number; blockSize: number; over: number }[] = []
  for (const c of concurrencies) {
    const ranked = measured.filter((r) => r.concurrency === c).sort((a, b) => b.tokensPerSecond! - a.tokensPerSecond!)
    if (ranked.length < 2) continue
    winners.push({ concurrency: c, blockSize: ranked[0]!.blockSize, over: ranked[0]!.tokensPerSecond! / ranked[1]!.tokensPerSecond! })
  }
  if (winners.length === 0) return null
  const each = winners.map((w) => `concurrency ${w.concurrency}: ${w.over.toFixed(2)}x`).join(', ')
  if (winners.every((w) => w.blockSize === winners[0]!.blockSize)) return `block size ${winners[0]!.blockSize} is faster at every concurrency compared (${each} over the next)`
  return `no single winner: ${winners.map((w) => `block size ${w.blockSize} at concurrency ${w.concurrency} (${w.over.toFixed(2)}x)`).join(', ')}`
}

/** How many of `theirs` equal `ours`, position by position (over ours' length). */
export function agreementOf(ours: readonly number[], theirs: readonly number[]): { same: number; of: number } {
  let same = 0
  for (let i = 0; i < ours.length; i++) if (ours[i] === theirs[i]) same++
  return { same, of: ours.length }
}

const fmt = (value: number | null | undefined, digits = 1): string =>
  value === null || value === undefined ? 'n/a' : value.toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: digits })

function bytes(value: number | null | undefined): string {
  if (value === null || value === undefined) return 'n/a'
  if (value < 1024) return `${value.toFixed(0)} B`
  if (value < 1024 ** 2) return `${(value / 1024).toFixed(1)} KiB`
  return `${(value / 1024 ** 2).toFixed(1)} MiB`
}

/** A system's self-description (versions, provider, batching, load time), without its token ids. */
export function describeSystem(info: Record<string, unknown>): string {
  return Object.entries(info)
    .filter(([key, value]) => key !== 'firstTokens' && value !== null && value !== undefined && typeof value !== 'object')
    .map(([key, value]) => `${key} ${typeof value === 'number' && !Number.isInteger(value) ? value.toFixed(1) : String(value).slice(0, 200)}`)
    .join(', ')
}

/** The markdown report: a banner for a CPU dry run, one table per model, agreement and the goals. */
export function formatReport(report: GpuReport): string {
  const lines: string[] = []
  if (report.provider === 'cpu') {
    lines.push('> CPU DRY RUN: these numbers check that the benchmark runs; they are NOT the GPU result.', '')
  }
  lines.push(
    `GPU benchmark, ${report.provider}${report.machine.gpu ? ` (${report.machine.gpu})` : ''}${report.quick ? ', --quick' : ''}: ` +
      `${report.workload.generatedTokens} tokens per request, greedy, EOS ignored, prompts of ${Math.min(...report.workload.promptLengths)}-` +
      `${Math.max(...report.workload.promptLengths)} tokens, all requests of a concurrency arriving at once`,
  )
  for (const model of report.models) {
    lines.push('', `### ${model.name}: ${model.dir} (${model.form})${model.note ? `; ${model.note}` : ''}`, '')
    lines.push('| system | concurrency | requests | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | GPU MiB | bytes/step inputs / logits / KV |')
    lines.push('|---|---:|---:|---:|---:|---:|---:|---:|')
    for (const r of report.rows.filter((row) => row.model === model.name)) {
      const label = SYSTEM_LABELS[r.system]
      if (r.error !== undefined) {
        lines.push(`| ${label} | ${r.concurrency} | | ${r.error.replace(/\|/g, '/').slice(0, 160)} | | | | |`)
        continue
      }
      const bus = r.system === 'ortex' ? `${bytes(r.busBytesPerStep?.hostInputs)} / ${bytes(r.busBytesPerStep?.logits)} / ${bytes(r.busBytesPerStep?.kvCopied)}` : ''
      lines.push(
        `| ${label} | ${r.concurrency} | ${r.requests} | ${fmt(r.tokensPerSecond)} | ${fmt(r.ttftMs?.p50)} / ${fmt(r.ttftMs?.p99)} | ` +
          `${fmt(r.itlMs?.p50, 2)} / ${fmt(r.itlMs?.p99, 2)} | ${fmt(r.gpuMemoryMb, 0)} | ${bus} |`,
      )
    }
  }
  const described = report.models.flatMap((m) =>
    Object.entries(report.systems[m.name] ?? {}).map(([system, info]) => `- ${m.name}, ${SYSTEM_LABELS[system as GpuSystem]}: ${describeSystem(info ?? {})}`),
  )
  if (described.length > 0) lines.push('', 'Systems as loaded:', ...described)
  if (report.agreement.length > 0) {
    lines.push('', "Greedy tokens of request 0 equal to ortex's:")
    for (const a of report.agreement) lines.push(`- ${a.model}, ${SYSTEM_LABELS[a.system]}: ${a.same} of ${a.of}`)
  }
  lines.push(...correctnessLines(report.correctness), ...blockSizeLines(report.blockSizes))
  const on = goalModel(report.models)
  const where = on === GOAL_MODEL ? `the ${GOAL_MODEL} model` : `stated for the ${GOAL_MODEL} model, computed here on ${on}`
  lines.push('', `Goals (issue 32, ${where})${report.provider === 'cpu' ? ', on the CPU dry run: not the GPU result' : ''}:`, '')
  lines.push('| goal | value | target | ratio | verdict |', '|---|---:|---:|---:|---|')
  for (const g of report.goals) {
    const verdict = g.met === null ? 'n/a (not measured)' : g.met ? 'met' : 'not met'
    lines.push(`| ${g.name} | ${goalValue(g.value, g.unit)} | ${goalTarget(g)} | ${g.ratio === null ? 'n/a' : g.ratio.toFixed(2)} | ${verdict} |`)
  }
  return lines.join('\n')
}

function goalValue(value: number | null, unit: GoalResult['unit']): string {
  if (value === null) return 'n/a'
  if (unit === 'x') return `${value.toFixed(2)}x`
  if (unit === 'fraction') return `${(value * 100).toFixed(1)}%`
  return fmt(value)
}

function goalTarget(g: GoalResult): string {
  if (g.unit === 'x') return `${g.target}x`
  if (g.unit === 'fraction') return `${Math.round(g.target * 100)}%`
  return fmt(g.target, 0)
}

/** The teacher-forced agreement, one line per model. */
function correctnessLines(entries: readonly CorrectnessEntry[]): string[] {
  if (entries.length === 0) return []
  const lines = ['', 'Teacher-forced top-1 agreement with ortex on the CPU (fp32 folder):']
  for (const c of entries) {
    const head = `- ${c.model}, ${c.provider} (${c.form}, ${c.prompts} prompts x ${c.referenceTokens} reference tokens)`
    if (c.error !== undefined) {
      lines.push(`${head}: ${c.error.slice(0, 200)}`)
      continue
    }
    const share = c.positions > 0 ? `${((100 * c.matches) / c.positions).toFixed(1)}%` : 'n/a'
    const where = c.mismatches.length > 0 ? `; first disagreements at ${c.mismatches.map(([p, k]) => `${p}:${k}`).join(', ')} (prompt:position)` : ''
    lines.push(`${head}: ${c.matches} of ${c.positions} positions, ${share}${c.cut ? ' (cut at its share of the time budget)' : ''}${where}`)
  }
  return lines
}

/** ortex's tokens/s per KV block size and concurrency, and which block size is faster. */
function blockSizeLines(rows: readonly BlockSizeRow[]): string[] {
  const lines: string[] = []
  for (const model of [...new Set(rows.map((r) => r.model))]) {
    const mine = rows.filter((r) => r.model === model)
    const concurrencies = [...new Set(mine.map((r) => r.concurrency))].sort((a, b) => a - b)
    lines.push('', `KV block size, ${model}, ortex tokens/s (issue 32, item 1):`, '')
    lines.push(`| block size | ${concurrencies.map((c) => `concurrency ${c}`).join(' | ')} |`, `|---:|${concurrencies.map(() => '---:').join('|')}|`)
    for (const size of [...new Set(mine.map((r) => r.blockSize))]) {
      const cells = concurrencies.map((c) => {
        const r = mine.find((x) => x.blockSize === size && x.concurrency === c)
        if (r === undefined) return ''
        if (r.error !== undefined) return r.error.replace(/\|/g, '/').slice(0, 100)
        return fmt(r.tokensPerSecond)
      })
      lines.push(`| ${size} | ${cells.join(' | ')} |`)
    }
    lines.push('', `Faster: ${fasterBlockSize(mine, model) ?? 'n/a (fewer than two block sizes measured at any concurrency)'}`)
  }
  return lines
}
