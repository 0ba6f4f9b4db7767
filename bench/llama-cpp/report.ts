// The llama.cpp benchmark's report: the pairs' samples and the memory children's numbers folded
// into one row per (file, system, concurrency) (medians over the accepted rounds), the goals as
// ratios measured in one run, a table as text, and grouped bars of tokens/s as a hand-written SVG.

import { median } from '../throughput/throughput'
import { axis, escapeXml } from '../throughput/report'
import type { Percentiles } from '../throughput/stats'
import type { BenchFile, FileId, SystemId } from './files'
import type { MemoryResult } from './memory'
import type { PairResult, RunSettings, Sample } from './pair'

export interface LlamaCppReport {
  createdAt: string
  quick: boolean
  machine: { cpus: number; cpuModel: string; loadAverageStart: number[]; loadAverageEnd: number[]; node: string }
  settings: RunSettings
  files: BenchFile[]
  pairs: PairResult[]
  memory: MemoryResult[]
  summary: SummaryRow[]
  goals: Goal[]
  elapsedS: number
}

export interface SummaryRow {
  file: FileId
  system: SystemId
  concurrency: number
  /** Rounds measured, and of them refused (other processes busy) or failed. */
  rounds: number
  refused: number
  error?: string
  requests: number | null
  tokens: number | null
  /** Medians over the accepted rounds (null: none accepted). */
  tokensPerSecond: number | null
  ttftMs: Percentiles
  itlMs: Percentiles
  /** The largest share of a core other processes used during an accepted sample. */
  othersCoresMax: number | null
  processCores: number | null
  /** The most the hypervisor took for other guests during an accepted sample (not refused on). */
  stealCoresMax: number | null
  /** The system alone in its own process (memory.ts): after its load, and its peak (load + a concurrency-16 run). */
  rssAfterLoadMb: number | null
  peakRssMb: number | null
}

export interface Goal {
  file: FileId
  goal: string
  /** Median of the rounds' ratios (the memory goal: one measurement). */
  value: number | null
  perRound: (number | null)[]
  target: number
  atMost: boolean
  met: boolean | null
  detail: string
}

export const SYSTEM_LABELS: Readonly<Record<SystemId, string>> = {
  'llama.cpp': 'llama.cpp (node-llama-cpp)',
  'ortex-int4': 'ortex int4 (ortex import --weights int4)',
  'ortex-fp32': 'ortex fp32 (ortex import --weights fp32)',
}
const COLORS: Readonly<Record<SystemId, string>> = { 'llama.cpp': '#f59e0b', 'ortex-int4': '#2563eb', 'ortex-fp32': '#93c5fd' }

const ok = (s: Sample) => s.summary !== undefined

export function summaryRows(pairs: PairResult[], memory: MemoryResult[]): SummaryRow[] {
  const rows: SummaryRow[] = []
  for (const pair of pairs) {
    for (const c of pair.workload.concurrencies) {
      for (const system of pair.systems) {
        const samples = pair.samples.filter((s) => s.system === system && s.concurrency === c)
        rows.push(summaryRow(pair.file.id, system, c, samples, memory.find((m) => m.file === pair.file.id && m.system === system)))
      }
    }
  }
  return rows
}

function summaryRow(file: FileId, system: SystemId, concurrency: number, samples: Sample[], mem: MemoryResult | undefined): SummaryRow {
  const accepted = samples.filter(ok)
  const m = (pick: (s: Sample) => number | null | undefined) => median(accepted.map(pick).filter((v): v is number => typeof v === 'number'))
  const error = samples.find((s) => s.error !== undefined)?.error
  return {
    file,
    system,
    concurrency,
    rounds: samples.length,
    refused: samples.filter((s) => s.refused).length,
    ...(error !== undefined ? { error } : {}),
    requests: accepted[0]?.summary?.requests ?? null,
    tokens: accepted[0]?.summary?.tokens ?? null,
    tokensPerSecond: m((s) => s.summary?.tokensPerSecond),
    ttftMs: { p50: m((s) => s.summary?.ttftMs.p50), p99: m((s) => s.summary?.ttftMs.p99) },
    itlMs: { p50: m((s) => s.summary?.itlMs.p50), p99: m((s) => s.summary?.itlMs.p99) },
    othersCoresMax: accepted.length === 0 ? null : Math.max(...accepted.map((s) => s.othersCores ?? 0)),
    processCores: m((s) => s.processCores),
    stealCoresMax: accepted.length === 0 ? null : Math.max(...accepted.map((s) => s.stealCores ?? 0)),
    rssAfterLoadMb: mem?.afterLoad.vmRssMb ?? null,
    peakRssMb: mem?.peakMb ?? null,
  }
}

// ---- goals -------------------------------------------------------------------------------------

function tps(pair: PairResult, system: SystemId, c: number, round: number): number | null {
  return pair.samples.find((s) => s.system === system && s.concurrency === c && s.round === round)?.summary?.tokensPerSecond ?? null
}

/** ortex int4 over llama.cpp at concurrency c, round by round (the systems took turns within a round). */
function speedGoal(pair: PairResult, c: number, target: number, rounds: number): Goal {
  const perRound = Array.from({ length: rounds }, (_, i) => {
    const ortex = tps(pair, 'ortex-int4', c, i + 1)
    const llama = tps(pair, 'llama.cpp', c, i + 1)
    return ortex !== null && llama !== null ? ortex / llama : null
  })
  return goal(pair.file.id, `ortex int4 >= ${target.toFixed(1)}x llama.cpp at concurrency ${c}`, perRound, target, false, 'tokens/s ratio, same file, same round')
}

function memoryGoal(file: FileId, memory: MemoryResult[]): Goal {
  const peak = (system: SystemId) => memory.find((m) => m.file === file && m.system === system)?.peakMb ?? null
  const ortex = peak('ortex-int4')
  const llama = peak('llama.cpp')
  const value = ortex !== null && llama !== null ? ortex / llama : null
  return goal(file, 'ortex int4 peak RSS <= 1.3x llama.cpp', [value], 1.3, true, 'VmHWM over load + a concurrency-16 run, each system alone in its own process')
}

function goal(file: FileId, text: string, perRound: (number | null)[], target: number, atMost: boolean, detail: string): Goal {
  const value = median(perRound.filter((v): v is number => v !== null))
  return { file, goal: text, value, perRound, target, atMost, met: value === null ? null : atMost ? value <= target : value >= target, detail }
}

/** The goals, for every 4-bit file measured (ortex int4 against llama.cpp on the same file). */
export function goals(pairs: PairResult[], memory: MemoryResult[], rounds: number): Goal[] {
  const out: Goal[] = []
  for (const pair of pairs) {
    if (!pair.file.fourBit || !pair.systems.includes('ortex-int4')) continue
    const cs = pair.workload.concurrencies
    if (cs.includes(1)) out.push(speedGoal(pair, 1, 1, rounds))
    if (cs.includes(16)) out.push(speedGoal(pair, 16, 2, rounds))
    out.push(memoryGoal(pair.file.id, memory))
  }
  return out
}

// ---- text --------------------------------------------------------------------------------------

const fixed = (x: number | null | undefined, digits = 1) => (x === null || x === undefined ? '-' : x.toFixed(digits))
const pct = (cores: number | null | undefined) => (cores === null || cores === undefined ? '-' : `${(100 * cores).toFixed(0)}%`)

export function formatTable(r: LlamaCppReport): string {
  return [...headerLines(r), '', ...resultLines(r), '', ...fileLines(r), '', ...memoryLines(r), '', 'goals:', ...r.goals.map(goalLine)].join('\n')
}

function headerLines(r: LlamaCppReport): string[] {
  const m = r.machine
  const s = r.settings
  const w = r.pairs[0]?.workload
  const loads = (a: number[]) => a.map((x) => x.toFixed(2)).join(' ')
  return [
    `machine: ${m.cpus} CPUs (${m.cpuModel}), load average ${loads(m.loadAverageStart)} at the start, ${loads(m.loadAverageEnd)} at the end; node ${m.node}`,
    `${s.threads} threads per system; greedy; ${w?.generatedTokens ?? '?'} tokens per request (EOS ignored); prompts of ${w?.promptLengths.join('/') ?? '?'} tokens (cycled); ` +
      `arrivals ${s.staggerMs} ms apart; ${s.rounds} round${s.rounds > 1 ? 's (medians)' : ''}; a sample is refused when other processes used more than ` +
      `${pct(s.guard.maxOthersCores)} of a core during it (${s.guard.retries} retries)`,
  ]
}

const HEADER = ['system', 'file', 'conc', 'req', 'tokens', 'tokens/s', 'TTFT p50', 'TTFT p99', 'ITL p50', 'ITL p99', 'RSS load', 'RSS peak', 'others', 'steal', 'cores']

function resultLines(r: LlamaCppReport): string[] {
  const byRound = r.settings.rounds > 1
  const header = byRound ? [...HEADER, 'tokens/s by round'] : HEADER
  const table = [header, ...r.summary.map((row) => resultCells(r, row, byRound))]
  return [
    ...alignColumns(table),
    ...retryLines(r),
    '(latencies in ms, TTFT from the scheduled arrival; RSS in MiB, each system alone in its own process: after the load, and the peak over the load ' +
      'and a concurrency-16 run; others: the most other processes used of a core during an accepted sample; steal: the most the hypervisor took for other guests; ' +
      'cores: the pair process\'s CPU over the sample)',
  ]
}

/** The samples that ran again because other processes were busy (the table has only accepted ones). */
function retryLines(r: LlamaCppReport): string[] {
  const limit = r.settings.guard.maxOthersCores
  const retried = r.pairs.flatMap((p) =>
    p.samples
      .map((s) => ({ s, refused: s.attempts.filter((a) => a.othersCores > limit).length }))
      .filter(({ refused }) => refused > 0)
      .map(({ s, refused }) => `${p.file.id} ${s.system} concurrency ${s.concurrency} round ${s.round}: ${refused} attempt${refused > 1 ? 's' : ''} refused${s.refused ? ', never accepted' : ''}`),
  )
  return retried.length === 0 ? [] : ['samples refused because other processes were busy (then run again):', ...retried.map((line) => `  ${line}`)]
}

function resultCells(r: LlamaCppReport, row: SummaryRow, byRound: boolean): string[] {
  const head = [row.system, row.file, String(row.concurrency)]
  const memory = [fixed(row.rssAfterLoadMb, 0), fixed(row.peakRssMb, 0)]
  const rounds = r.pairs
    .find((p) => p.file.id === row.file)!
    .samples.filter((s) => s.system === row.system && s.concurrency === row.concurrency)
    .map((s) => (s.error !== undefined ? 'failed' : s.refused ? 'refused' : fixed(s.summary!.tokensPerSecond)))
    .join(' / ')
  const tail = byRound ? [rounds] : []
  if (row.error !== undefined) return [...head, '-', '-', `failed: ${row.error}`, '', '', '', '', ...memory, '', '', '', ...tail]
  if (row.tokensPerSecond === null) return [...head, '-', '-', `refused (${row.refused}/${row.rounds})`, '', '', '', '', ...memory, '', '', '', ...tail]
  return [
    ...head,
    String(row.requests),
    String(row.tokens),
    fixed(row.tokensPerSecond),
    fixed(row.ttftMs.p50),
    fixed(row.ttftMs.p99),
    fixed(row.itlMs.p50),
    fixed(row.itlMs.p99),
    ...memory,
    pct(row.othersCoresMax),
    pct(row.stealCoresMax),
    fixed(row.processCores, 2),
    ...tail,
  ]
}

/** The first two columns left-aligned, the others right-aligned, each as wide as its widest cell. */
function alignColumns(table: string[][]): string[] {
  const columns = Math.max(...table.map((row) => row.length))
  const widths = Array.from({ length: columns }, (_, i) => Math.max(...table.map((row) => (row[i] ?? '').length)))
  return table.map((row) => row.map((cell, i) => (i < 2 ? cell.padEnd(widths[i]!) : cell.padStart(widths[i]!))).join('  ').trimEnd())
}

/** Per file: what it is, whether the tokenizers agree, the greedy tokens' agreement, and how llama.cpp ran. */
function fileLines(r: LlamaCppReport): string[] {
  const lines: string[] = []
  for (const p of r.pairs) {
    const t = p.tokenizerCheck
    lines.push(`${p.file.id}: ${p.file.label}, ${p.file.gguf} (${fixed(p.file.ggufMb, 0)} MiB); pair process ${fixed(p.elapsedS, 0)} s, load average ${p.loadAverageStart[0]!.toFixed(2)} -> ${p.loadAverageEnd[0]!.toFixed(2)}`)
    lines.push(
      t.same
        ? `  tokenizers: llama.cpp's model.tokenize gives ortex's ${t.tokens} ids for the prompt text`
        : `  tokenizers DIFFER at token ${t.firstDifference}: llama.cpp ${JSON.stringify(t.llamaCpp)}, ortex ${JSON.stringify(t.ortex)} (both ran ortex's ids)`,
    )
    const agreement = Object.entries(p.agreement)
      .filter(([system]) => system !== 'llama.cpp')
      .map(([system, a]) => `${system} ${a!.sameAsLlamaCpp}/${a!.tokens.length}`)
    lines.push(`  greedy tokens after prompt 0 equal to llama.cpp's (leading): ${agreement.join(', ')}`)
    lines.push(`  idle between runs, the process used ${fixed(p.idle.processCores, 2)} cores`)
    const info = p.info['llama.cpp']
    if (info !== undefined) {
      lines.push(
        `  llama.cpp: node-llama-cpp ${String(info.nodeLlamaCpp)} (${String(info.buildType)}, llama.cpp ${JSON.stringify(info.llamaCppRelease)}), ${String(info.threads)} threads, ` +
          `${String(info.sequences)} sequences x ${String(info.contextSizePerSequence)} cells, batch ${String(info.batchSize)}, flash attention ${String(info.flashAttention)}, mmap ${String(info.mmap)}`,
      )
    }
  }
  return lines
}

function memoryLines(r: LlamaCppReport): string[] {
  if (r.memory.length === 0) return ['resident memory: not measured (--no-memory)']
  return [
    'resident memory, each system alone in its own process (MiB):',
    ...r.memory.map(
      (m) =>
        `  ${m.file} ${m.system.padEnd(10)}: ${fixed(m.beforeLoad.vmRssMb, 0)} before the load, ${fixed(m.afterLoad.vmRssMb, 0)} after it ` +
        `(anon ${fixed(m.afterLoad.rssAnonMb, 0)}, file ${fixed(m.afterLoad.rssFileMb, 0)}), load peak ${fixed(m.afterLoad.vmHwmMb, 0)}, ` +
        `peak under load ${m.peakUnderLoadMb === null ? '- (no reset)' : fixed(m.peakUnderLoadMb, 0)} ` +
        `(after it anon ${fixed(m.afterRun.rssAnonMb, 0)}, file ${fixed(m.afterRun.rssFileMb, 0)}), ${fixed(m.tokensPerSecond)} tokens/s at concurrency ${m.concurrency}`,
    ),
  ]
}

function goalLine(g: Goal): string {
  const value = g.value === null ? 'not measured' : `${g.value.toFixed(3)}x`
  const verdict = g.met === null ? '' : g.met ? ' (met)' : ' (not met)'
  const rounds = g.perRound.length > 1 ? ` (rounds: ${g.perRound.map((v) => fixed(v, 3)).join(', ')})` : ''
  return `  ${g.file}: ${g.goal}: ${value}${verdict}${rounds}`
}

// ---- chart -------------------------------------------------------------------------------------

const PANEL_W = 380
const PANEL_H = 300
const MARGIN = { left: 56, right: 12, top: 70, bottom: 120 }

/** Grouped bars: a panel per file, a group per concurrency, a bar per system (refused: marked). */
export function svgChart(r: LlamaCppReport): string {
  const files = r.pairs.map((p) => p.file)
  const W = MARGIN.left + files.length * PANEL_W + MARGIN.right
  const H = MARGIN.top + PANEL_H + MARGIN.bottom
  const out: string[] = [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`,
    `<rect width="${W}" height="${H}" fill="#ffffff"/>`,
    `<text x="${W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">${escapeXml('ortex and llama.cpp on the same GGUF file: aggregate tokens/s by concurrency')}</text>`,
    `<text x="${W / 2}" y="40" text-anchor="middle" fill="#4b5563">${escapeXml(subtitle(r))}</text>`,
  ]
  files.forEach((file, i) => out.push(...panel(r, file, MARGIN.left + i * PANEL_W)))
  const systems = [...new Set(r.pairs.flatMap((p) => p.systems))]
  systems.forEach((s, i) => {
    const ly = MARGIN.top + PANEL_H + 50 + i * 18
    out.push(`<rect x="${MARGIN.left}" y="${ly - 10}" width="12" height="12" fill="${COLORS[s]}"/>`)
    out.push(`<text x="${MARGIN.left + 18}" y="${ly}" fill="#111827">${escapeXml(SYSTEM_LABELS[s])}</text>`)
  })
  const m = r.machine
  out.push(
    `<text x="${W - MARGIN.right}" y="${H - 8}" text-anchor="end" font-size="10" fill="#6b7280">` +
      escapeXml(`${m.cpus} CPUs, load ${m.loadAverageStart[0]!.toFixed(1)}-${m.loadAverageEnd[0]!.toFixed(1)}, ${r.createdAt.slice(0, 10)}`) +
      `</text>`,
    '</svg>',
  )
  return `${out.join('\n')}\n`
}

function subtitle(r: LlamaCppReport): string {
  const w = r.pairs[0]?.workload
  const rounds = r.settings.rounds > 1 ? `, medians of ${r.settings.rounds} rounds` : ''
  return `${r.settings.threads} threads each, greedy, ${w?.generatedTokens ?? '?'} tokens per request, arrivals ${r.settings.staggerMs} ms apart${rounds}`
}

function panel(r: LlamaCppReport, file: BenchFile, x0: number): string[] {
  const rows = r.summary.filter((row) => row.file === file.id)
  const systems = [...new Set(rows.map((row) => row.system))]
  const concurrencies = [...new Set(rows.map((row) => row.concurrency))]
  const { top, step } = axis(Math.max(1, ...rows.map((row) => row.tokensPerSecond ?? 0)))
  const plotW = PANEL_W - 24
  const y = (v: number) => MARGIN.top + PANEL_H - (v / top) * PANEL_H
  const out = [`<text x="${x0 + plotW / 2}" y="${MARGIN.top - 12}" text-anchor="middle" font-weight="bold">${escapeXml(file.label)}</text>`]
  for (let v = 0; v <= top + 1e-9; v += step) {
    const yy = y(v).toFixed(1)
    out.push(`<line x1="${x0}" x2="${x0 + plotW}" y1="${yy}" y2="${yy}" stroke="#e5e7eb"/>`)
    out.push(`<text x="${x0 - 4}" y="${yy}" dy="4" text-anchor="end" font-size="10" fill="#374151">${Number(v.toFixed(6))}</text>`)
  }
  const groupW = plotW / Math.max(1, concurrencies.length)
  const barW = Math.min(36, (groupW * 0.8) / Math.max(1, systems.length))
  concurrencies.forEach((c, gi) => {
    const gx = x0 + gi * groupW
    const start = gx + (groupW - barW * systems.length) / 2
    systems.forEach((s, si) => out.push(...bar(rows.find((row) => row.system === s && row.concurrency === c)!, start + si * barW, barW, y)))
    out.push(`<text x="${(gx + groupW / 2).toFixed(1)}" y="${MARGIN.top + PANEL_H + 16}" text-anchor="middle" fill="#111827">concurrency ${c}</text>`)
  })
  out.push(`<line x1="${x0}" x2="${x0 + plotW}" y1="${MARGIN.top + PANEL_H}" y2="${MARGIN.top + PANEL_H}" stroke="#374151"/>`)
  return out
}

function bar(row: SummaryRow, x: number, barW: number, y: (v: number) => number): string[] {
  const base = y(0)
  const cx = (x + barW / 2).toFixed(1)
  if (row.tokensPerSecond === null) {
    const why = row.error !== undefined ? 'failed' : 'refused'
    return [`<text x="${cx}" y="${(base - 4).toFixed(1)}" text-anchor="start" font-size="9" fill="#b91c1c" transform="rotate(-90 ${cx} ${(base - 4).toFixed(1)})">${why}</text>`]
  }
  const v = row.tokensPerSecond
  const title = `${SYSTEM_LABELS[row.system]}, concurrency ${row.concurrency}: ${v.toFixed(1)} tokens/s`
  return [
    `<rect x="${(x + 2).toFixed(1)}" y="${y(v).toFixed(1)}" width="${(barW - 4).toFixed(1)}" height="${(base - y(v)).toFixed(1)}" fill="${COLORS[row.system]}"><title>${escapeXml(title)}</title></rect>`,
    `<text x="${cx}" y="${(y(v) - 4).toFixed(1)}" text-anchor="middle" font-size="10" fill="#111827">${v.toFixed(0)}</text>`,
  ]
}
