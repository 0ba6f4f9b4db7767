// ONNX Runtime's profile (a Chrome trace, one event per operator run and one per model run),
// reduced to the decode steps of a full batch: the median time per step of each operator type.

import { readFileSync } from 'node:fs'

interface TraceEvent {
  cat?: string
  name?: string
  ts?: number
  dur?: number
  args?: { op_name?: string; input_type_shape?: Record<string, number[]>[] }
}

/** Per full decode step, in step order: the model run, its operators' kernels, each operator type's. */
export interface StepProfile {
  files: string[]
  /** The model runs whose query is [batch, 1, hidden], and all model runs. */
  steps: number
  runs: number
  runUs: number[]
  kernelUs: number[]
  /** op type -> its nodes' summed microseconds at each step, and nodes per step. */
  ops: Map<string, { us: number[]; nodes: number }>
  /** The past key input of the first GroupQueryAttention of the first such step: [B, KH, width, D]. */
  pastShape: number[] | null
}

function firstShape(event: TraceEvent, input: number): number[] | null {
  const entry = event.args?.input_type_shape?.[input]
  return entry === undefined ? null : (Object.values(entry)[0] ?? null)
}

/** A decode step of `batch` rows: its first GroupQueryAttention (or the first node taking a
 *  [batch, 1, hidden] input, for models without it) has a query of one position per row. */
function isFullDecode(nodes: TraceEvent[], batch: number): boolean {
  const gqa = nodes.find((n) => n.args?.op_name === 'GroupQueryAttention')
  const shape = gqa === undefined ? firstShape(nodes[0] ?? {}, 0) : firstShape(gqa, 0)
  return shape !== null && shape.length === 3 && shape[0] === batch && shape[1] === 1
}

/** The first rank-4 input of the first GroupQueryAttention: its past key [B, KH, width, D]. */
function pastKeyShape(nodes: TraceEvent[]): number[] | null {
  const gqa = nodes.find((n) => n.args?.op_name === 'GroupQueryAttention')
  const inputs = gqa?.args?.input_type_shape ?? []
  return inputs.map((entry) => Object.values(entry)[0] ?? []).find((shape) => shape.length === 4) ?? null
}

/** Each model run's kernel events, in time order. */
function runsWithNodes(events: TraceEvent[]): [TraceEvent, TraceEvent[]][] {
  const runs = events.filter((e) => e.cat === 'Session' && e.name === 'model_run').sort((a, b) => a.ts! - b.ts!)
  const kernels = events
    .filter((e) => e.cat === 'Node' && e.name?.endsWith('_kernel_time') === true)
    .sort((a, b) => a.ts! - b.ts!)
  let k = 0
  return runs.map((run) => {
    while (k < kernels.length && kernels[k]!.ts! < run.ts!) k++
    const nodes: TraceEvent[] = []
    while (k < kernels.length && kernels[k]!.ts! <= run.ts! + run.dur!) nodes.push(kernels[k++]!)
    return [run, nodes]
  })
}

export function readProfile(file: string, batch: number): StepProfile {
  const all = runsWithNodes(JSON.parse(readFileSync(file, 'utf8')) as TraceEvent[])
  const full = all.filter(([, nodes]) => isFullDecode(nodes, batch))
  if (full.length === 0) throw new Error(`${file}: no model run with a [${batch}, 1, hidden] query`)
  const profile: StepProfile = {
    files: [file],
    steps: full.length,
    runs: all.length,
    runUs: full.map(([run]) => run.dur!),
    kernelUs: full.map(([, nodes]) => nodes.reduce((sum, n) => sum + n.dur!, 0)),
    ops: new Map(),
    pastShape: pastKeyShape(full[0]![1]),
  }
  full.forEach(([, nodes], step) => {
    for (const node of nodes) {
      const op = node.args?.op_name ?? '?'
      const entry = profile.ops.get(op) ?? { us: new Array<number>(full.length).fill(0), nodes: 0 }
      entry.us[step]! += node.dur!
      entry.nodes += 1 / full.length
      profile.ops.set(op, entry)
    }
  })
  return profile
}

/** The steps of several runs of the same system as one profile. */
export function mergeProfiles(profiles: StepProfile[]): StepProfile {
  const merged: StepProfile = { ...profiles[0]!, files: [], steps: 0, runs: 0, runUs: [], kernelUs: [], ops: new Map() }
  for (const p of profiles) {
    for (const [op, entry] of p.ops) {
      const into = merged.ops.get(op) ?? { us: new Array<number>(merged.steps).fill(0), nodes: entry.nodes }
      into.us.push(...entry.us)
      merged.ops.set(op, into)
    }
    for (const into of merged.ops.values()) while (into.us.length < merged.steps + p.steps) into.us.push(0)
    merged.files.push(...p.files)
    merged.steps += p.steps
    merged.runs += p.runs
    merged.runUs.push(...p.runUs)
    merged.kernelUs.push(...p.kernelUs)
  }
  return merged
}

/** The median: on a shared 2-core machine a few steps meet a neighbour's burst. */
export function median(values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b)
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

const ms = (us: number) => (us / 1000).toFixed(2)

/** A markdown table: one row per operator type (the slowest first), then the totals. */
export function formatProfiles(profiles: [string, StepProfile][]): string {
  const names = profiles.map(([name]) => name)
  const opTypes = [...new Set(profiles.flatMap(([, p]) => [...p.ops.keys()]))]
  const first = profiles[0]![1]
  const opUs = (p: StepProfile, op: string) => median(p.ops.get(op)?.us ?? [0])
  opTypes.sort((a, b) => opUs(first, b) - opUs(first, a))
  const ratio = profiles.length === 2
  const header = ['operator', ...names.map((n) => `${n} ms/step (nodes)`), ...(ratio ? [`${names[0]} / ${names[1]}`] : [])]
  const lines = [`| ${header.join(' | ')} |`, `|${header.map(() => '---').join('|')}|`]
  const cells = (value: (p: StepProfile) => number, label: (p: StepProfile) => string) => {
    const row = profiles.map(([, p]) => label(p))
    if (ratio) {
      const [a, b] = profiles.map(([, p]) => value(p))
      row.push(b! > 0 ? `${(a! / b!).toFixed(2)}x` : '-')
    }
    return row
  }
  for (const op of opTypes) {
    const row = cells(
      (p) => opUs(p, op),
      (p) => {
        const e = p.ops.get(op)
        return e === undefined ? '-' : `${ms(opUs(p, op))} (${Math.round(e.nodes)})`
      },
    )
    lines.push(`| ${op} | ${row.join(' | ')} |`)
  }
  const outside = (p: StepProfile) => median(p.runUs.map((us, i) => us - p.kernelUs[i]!))
  lines.push(`| all operators | ${cells((p) => median(p.kernelUs), (p) => ms(median(p.kernelUs))).join(' | ')} |`)
  lines.push(`| model run | ${cells((p) => median(p.runUs), (p) => ms(median(p.runUs))).join(' | ')} |`)
  lines.push(`| run outside operators | ${cells(outside, (p) => ms(outside(p))).join(' | ')} |`)
  const notes = profiles.map(
    ([name, p]) => `${name}: ${p.steps} full decode steps of ${p.runs} model runs in ${p.files.length} runs of the workload, GroupQueryAttention past key ${JSON.stringify(p.pastShape)} at the first`,
  )
  return [...lines, '', ...notes].join('\n')
}
