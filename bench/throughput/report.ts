// The throughput benchmark's report: a table and the goals as text, and a bar chart as a
// hand-written SVG (no dependencies): tokens per second by concurrency for every system.

import type { Goal, Row, SystemName, ThroughputReport } from './throughput'

export const SYSTEM_LABELS: Readonly<Record<SystemName, string>> = {
  ortex: 'ortex',
  'ortex-blocking': 'ortex, threads blocking (its default)',
  naive: 'naive loop (onnxruntime-node)',
  'genai-engine': 'onnxruntime-genai Engine (static batching)',
  'genai-generator': 'onnxruntime-genai Generator (batch of prompts)',
}

const SYSTEM_ORDER: readonly SystemName[] = ['ortex', 'ortex-blocking', 'naive', 'genai-engine', 'genai-generator']
const COLORS: Readonly<Record<SystemName, string>> = {
  ortex: '#2563eb',
  'ortex-blocking': '#93c5fd',
  naive: '#9ca3af',
  'genai-engine': '#f59e0b',
  'genai-generator': '#b45309',
}

/** Ratios near a goal's target print with three decimals: with two, 0.995x read "1.00x (missed)". */
const RATIO_DIGITS = 3

const mib = (bytes: number) => (bytes / 2 ** 20).toFixed(0)

const fixed = (x: number | null | undefined, digits = 1) => (x === null || x === undefined ? '-' : x.toFixed(digits))

export function formatTable(report: ThroughputReport): string {
  return [
    ...workloadLines(report),
    '',
    ...resultLines(report),
    ...executorLines(report),
    ...memoryLines(report),
    ...baselineLines(report),
    '',
    'goals:',
    ...report.goals.map((g) => goalLine(g, report.rounds > 1)),
  ].join('\n')
}

/** What ran, and on what machine under what load. */
function workloadLines(report: ThroughputReport): string[] {
  const w = report.workload
  const m = report.machine
  const loads = (averages: number[]) => averages.map((x) => x.toFixed(2)).join(' ')
  return [
    `model ${w.modelDir}; prompts of ${w.promptLengths.join('/')} tokens (cycled), ${w.generatedTokens} tokens per ` +
      `request (ignoreEos, greedy), arrivals ${w.staggerMs} ms apart, ${w.intraOpThreads} intra-op threads` +
      (w.intraOpSpinning ? ' spinning during runs (ortex-blocking: blocking)' : ''),
    `machine: ${m.cpus} CPUs (${m.cpuModel}), load average ${loads(m.loadAverageStart)} at the start, ` +
      `${loads(m.loadAverageEnd)} at the end; node ${m.node}`,
  ]
}

const RESULT_HEADER = ['system', 'conc', 'req', 'tokens', 'wall s', 'tokens/s', 'TTFT p50', 'TTFT p99', 'ITL p50', 'ITL p99']

/** The table of every measured configuration, by concurrency then system, and its note. */
function resultLines(report: ThroughputReport): string[] {
  const rounds = report.rounds > 1
  const header = rounds ? [...RESULT_HEADER, 'tokens/s by round'] : RESULT_HEADER
  const table: string[][] = [header]
  for (const c of report.workload.concurrencies) {
    for (const system of SYSTEM_ORDER) {
      const row = report.summary.find((r) => r.system === system && r.concurrency === c)
      if (row !== undefined) table.push(resultCells(report, row))
    }
  }
  return [
    ...alignColumns(table, header.length),
    `(latencies in ms; TTFT from the scheduled arrival${rounds ? `; medians of ${report.rounds} rounds` : ''})`,
  ]
}

/** One summary row's cells; with several rounds, each round's tokens/s last. */
function resultCells(report: ThroughputReport, row: Row): string[] {
  const c = row.concurrency
  if ('error' in row) return [row.system, String(c), '-', '-', '-', `failed: ${row.error}`, '', '', '', '']
  const byRound = report.rows
    .filter((r) => r.system === row.system && r.concurrency === c)
    .map((r) => ('error' in r ? 'failed' : fixed(r.tokensPerSecond)))
    .join(' / ')
  return [
    row.system,
    String(c),
    String(row.requests),
    String(row.tokens),
    fixed(row.wallMs / 1000, 2),
    fixed(row.tokensPerSecond),
    fixed(row.ttftMs.p50),
    fixed(row.ttftMs.p99),
    fixed(row.itlMs.p50),
    fixed(row.itlMs.p99),
    ...(report.rounds > 1 ? [byRound] : []),
  ]
}

/** The first column left-aligned, the others right-aligned, each as wide as its widest cell. */
function alignColumns(table: string[][], columns: number): string[] {
  const widths = Array.from({ length: columns }, (_, i) => Math.max(...table.map((r) => (r[i] ?? '').length)))
  return table.map((r) => r.map((cell, i) => (i === 0 ? cell.padEnd(widths[i]!) : cell.padStart(widths[i]!))).join('  ').trimEnd())
}

/** Where ortex's engine steps spent their time, and its engines' weights (none without rows). */
function executorLines(report: ThroughputReport): string[] {
  const executorRows = report.summary.filter((r): r is Extract<Row, { executor?: unknown }> => !('error' in r) && r.executor !== undefined)
  if (executorRows.length === 0) return []
  return [
    '',
    'ortex engine steps: wall ms/step, session run ms/step, gather + scatter ms/step, outside the runs % of wall',
    ...executorRows.map((r) => {
      const e = r.executor!
      const perStep = (ms: number) => fixed(ms / Math.max(1, e.steps), 2)
      return (
        `  ${r.system.padEnd(15)} concurrency ${String(r.concurrency).padStart(2)}: ${e.steps} steps (${e.invocations} model runs), ` +
        `${fixed(e.stepMs, 2)} ms/step wall, ${perStep(e.runMs)} run, ${perStep(e.gatherMs + e.scatterMs)} gather+scatter, ` +
        `${fixed(e.outsideRunPct)}% outside the runs`
      )
    }),
    ...report.ortexWeights.map(
      (weights) =>
        `  ${weights.system.padEnd(15)} weights: ${mib(weights.hugePageBytes)} MiB on huge pages, ` +
        `${mib(weights.weightChunkBytes)} MiB in weight chunks`,
    ),
  ]
}

/**
 * Resident memory: each process after its first model load (and after all its loads: ortex's
 * process holds a second engine and the naive loop's session, onnxruntime-genai's a second
 * og.Model), then per batched run its peak and what the peak adds over the process's memory after
 * all its loads, per live token (prompt + generated of the requests in flight): at most, and at the peak.
 */
function memoryLines(report: ThroughputReport): string[] {
  const memory = report.memory
  if (memory === undefined) return []
  const loads = (what: string, m: { rssBeforeLoadMb: number; rssAfterLoadMb: number; rssAfterAllLoadsMb: number }) =>
    `  ${what}: ${fixed(m.rssBeforeLoadMb, 0)} MiB before the load, ${fixed(m.rssAfterLoadMb, 0)} MiB after it ` +
    `(+${fixed(m.rssAfterLoadMb - m.rssBeforeLoadMb, 0)}), ${fixed(m.rssAfterAllLoadsMb, 0)} MiB after all its loads`
  const lines = ['', 'resident memory (RSS, MiB):', loads('ortex process (first engine)', memory.ortex)]
  if (memory.ortex.kvPositionBytes !== null) {
    lines.push(`  ortex KV per live token: ${(memory.ortex.kvPositionBytes / 1024).toFixed(1)} KiB (executorStats().kvPositionBytes)`)
  }
  if (memory.genai !== undefined) lines.push(loads('onnxruntime-genai process (Engine model)', memory.genai))
  for (const row of report.summary) {
    if ('error' in row || row.memory === undefined) continue
    const m = row.memory
    const base = row.system.startsWith('genai') ? memory.genai?.rssAfterAllLoadsMb : memory.ortex.rssAfterAllLoadsMb
    const perToken = (live: number) =>
      base === undefined || live === 0 ? '-' : `${fixed(((m.rssPeakMb - base) * 1024) / live, 1)} KiB`
    lines.push(
      `  ${row.system.padEnd(15)} concurrency ${String(row.concurrency).padStart(2)}: peak ${fixed(m.rssPeakMb, 0)} MiB ` +
        `(+${base === undefined ? '-' : fixed(m.rssPeakMb - base, 0)} over after all loads) with ${m.liveTokensAtPeak} live tokens, ` +
        `at most ${m.liveTokensMax}: ${perToken(m.liveTokensMax)} per live token at most (${perToken(m.liveTokensAtPeak)} at the peak)`,
    )
  }
  return lines
}

/** Whether the systems ortex is compared with were measured (and which onnxruntime-genai). */
function baselineLines(report: ThroughputReport): string[] {
  const lines: string[] = []
  if (!report.naive.ok) lines.push(`naive loop: not measured (${report.naive.error ?? 'unavailable'})`)
  if (!report.genai.ok) lines.push(`onnxruntime-genai: not measured (${report.genai.error ?? 'unavailable'})`)
  else {
    const dir = report.workload.genaiModelDir
    const check = report.genai.tokenizerCheck
    lines.push(
      `onnxruntime-genai ${report.genai.version ?? '?'} (onnxruntime ${report.genai.onnxruntimeVersion ?? '?'})` +
        (dir !== undefined ? ` on its own folder ${dir}` : '') +
        (check?.same === true ? `; its tokenizer gives ortex's ${check.tokens} ids for the prompt text` : ''),
    )
  }
  return lines
}

/** A goal's value, its share of the target and verdict; with several rounds, each round's value. */
function goalLine(g: Goal, rounds: boolean): string {
  const digits = g.unit === '%' ? 1 : RATIO_DIGITS
  const value = g.value === null ? 'not measured' : `${fixed(g.value, digits)}${g.unit}`
  const verdict = g.met === null ? '' : g.met ? ' (met)' : ' (missed)'
  const each = rounds ? ` (rounds: ${g.perRound.map((v) => fixed(v, g.unit === '%' ? 2 : RATIO_DIGITS)).join(', ')})` : ''
  return `  ${g.goal}: ${value}${g.ratio === null ? '' : `, ${fixed(g.ratio, RATIO_DIGITS)} of the target`}${verdict}${each}`
}

export const escapeXml = (s: string) => s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')

/** A round axis maximum and tick step above `max`. */
export function axis(max: number): { top: number; step: number } {
  const raw = Math.max(max, 1) / 5
  const magnitude = 10 ** Math.floor(Math.log10(raw))
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw)!
  return { top: Math.ceil(max / step) * step, step }
}

/** Grouped bars: one group per concurrency, one bar per measured system. */
export function svgChart(report: ThroughputReport): string {
  const systems = SYSTEM_ORDER.filter((s) => report.summary.some((r) => r.system === s && !('error' in r)))
  const concurrencies = report.workload.concurrencies
  const value = (s: SystemName, c: number): number | null => {
    const row = report.summary.find((r) => r.system === s && r.concurrency === c)
    return row === undefined || 'error' in row ? null : row.tokensPerSecond
  }
  const W = 720
  const H = 420
  const left = 70
  const right = 20
  const top = 50
  const bottom = 140
  const plotW = W - left - right
  const plotH = H - top - bottom
  const max = Math.max(1, ...systems.flatMap((s) => concurrencies.map((c) => value(s, c) ?? 0)))
  const { top: yTop, step } = axis(max)
  const y = (v: number) => top + plotH - (v / yTop) * plotH
  const groupW = plotW / concurrencies.length
  const barW = Math.min(48, (groupW * 0.8) / Math.max(1, systems.length))
  const out: string[] = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`)
  out.push(`<rect width="${W}" height="${H}" fill="#ffffff"/>`)
  const w = report.workload
  out.push(
    `<text x="${W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">` +
      escapeXml(`Aggregate tokens/s by concurrency (${w.modelDir.split(/[\\/]/).filter(Boolean).pop() ?? w.modelDir}, ${w.intraOpThreads} intra-op threads)`) + `</text>`,
  )
  out.push(
    `<text x="${W / 2}" y="40" text-anchor="middle" fill="#4b5563">` +
      escapeXml(`${w.generatedTokens} tokens per request, ignoreEos, prompts ${Math.min(...w.promptLengths)}-${Math.max(...w.promptLengths)} tokens, arrivals ${w.staggerMs} ms apart${report.rounds > 1 ? `, medians of ${report.rounds} rounds` : ''}`) +
      `</text>`,
  )
  for (let v = 0; v <= yTop + 1e-9; v += step) {
    const yy = y(v).toFixed(1)
    out.push(`<line x1="${left}" x2="${W - right}" y1="${yy}" y2="${yy}" stroke="#e5e7eb"/>`)
    out.push(`<text x="${left - 6}" y="${yy}" dy="4" text-anchor="end" fill="#374151">${Number(v.toFixed(6))}</text>`)
  }
  out.push(`<text transform="translate(18 ${top + plotH / 2}) rotate(-90)" text-anchor="middle" fill="#374151">tokens per second</text>`)
  concurrencies.forEach((c, gi) => {
    const groupX = left + gi * groupW
    const startX = groupX + (groupW - barW * systems.length) / 2
    systems.forEach((s, si) => {
      const v = value(s, c)
      if (v === null) return
      const x = startX + si * barW
      out.push(
        `<rect x="${(x + 2).toFixed(1)}" y="${y(v).toFixed(1)}" width="${(barW - 4).toFixed(1)}" ` +
          `height="${(top + plotH - y(v)).toFixed(1)}" fill="${COLORS[s]}"><title>${escapeXml(`${SYSTEM_LABELS[s]}, concurrency ${c}: ${v.toFixed(1)} tokens/s`)}</title></rect>`,
      )
      out.push(`<text x="${(x + barW / 2).toFixed(1)}" y="${(y(v) - 4).toFixed(1)}" text-anchor="middle" font-size="10" fill="#111827">${v.toFixed(0)}</text>`)
    })
    out.push(`<text x="${(groupX + groupW / 2).toFixed(1)}" y="${top + plotH + 18}" text-anchor="middle" fill="#111827">concurrency ${c}</text>`)
  })
  out.push(`<line x1="${left}" x2="${W - right}" y1="${top + plotH}" y2="${top + plotH}" stroke="#374151"/>`)
  systems.forEach((s, i) => {
    const ly = top + plotH + 40 + i * 18
    out.push(`<rect x="${left}" y="${ly - 10}" width="12" height="12" fill="${COLORS[s]}"/>`)
    out.push(`<text x="${left + 18}" y="${ly}" fill="#111827">${escapeXml(SYSTEM_LABELS[s])}</text>`)
  })
  const m = report.machine
  out.push(
    `<text x="${W - right}" y="${H - 8}" text-anchor="end" font-size="10" fill="#6b7280">` +
      escapeXml(`${m.cpus} CPUs (shared), load ${m.loadAverageStart[0]!.toFixed(1)}-${m.loadAverageEnd[0]!.toFixed(1)}, ${report.createdAt.slice(0, 10)}`) +
      `</text>`,
  )
  out.push('</svg>')
  return `${out.join('\n')}\n`
}
