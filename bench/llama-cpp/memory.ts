// Resident memory of one system on one file, in a child process of its own: the RSS of a process
// holding two runtimes mixes them. Load the system, read /proc/self/status (VmRSS: after the
// load; VmHWM: the load's peak), reset the peak (clear_refs 5), run one concurrency-16 closed
// loop, and read VmHWM again: the peak under load. llama.cpp maps the GGUF file (its weights count
// in RssFile as they are touched: after the load that may be little of the file; under load all of
// it); ortex's weights are its own allocations.

import { readFileSync, writeFileSync } from 'node:fs'

import type { BenchFile, SystemId } from './files'
import { type RunSettings, batchedRun, benchWorkload, loadOptions } from './pair'
import { loadSystem } from './systems'

export interface MemorySpec {
  file: BenchFile
  system: SystemId
  settings: RunSettings
  /** The pair's prompts (ortex's ids), so a llama.cpp-only process runs the same ones. */
  prompts: number[][]
  resultPath: string
}

/** /proc/self/status's memory lines, in MiB. */
export interface ProcMemory {
  vmRssMb: number
  vmHwmMb: number
  rssAnonMb: number
  rssFileMb: number
}

export interface MemoryResult {
  file: BenchFile['id']
  system: SystemId
  /** Before loading the runtime (node and the bundle). */
  beforeLoad: ProcMemory
  afterLoad: ProcMemory
  /** After the concurrency-16 run: vmHwmMb is the peak under load when the reset worked. */
  afterRun: ProcMemory
  peakReset: boolean
  /** VmHWM over the process's life: the load's peak and the run's (the number the goal compares). */
  peakMb: number
  /** The run's own peak (null where the peak could not be reset). */
  peakUnderLoadMb: number | null
  concurrency: number
  tokensPerSecond: number
}

const MEMORY_CONCURRENCY = 16

export function procMemory(): ProcMemory {
  const status = readFileSync('/proc/self/status', 'utf8')
  const kb = (key: string) => {
    const m = new RegExp(`^${key}:\\s+(\\d+) kB`, 'm').exec(status)
    if (m === null) throw new Error(`/proc/self/status has no ${key}`)
    return Number(m[1]) / 1024
  }
  return { vmRssMb: kb('VmRSS'), vmHwmMb: kb('VmHWM'), rssAnonMb: kb('RssAnon'), rssFileMb: kb('RssFile') }
}

/** Resets VmHWM to the current RSS (Linux 4.0+: "5" to clear_refs); false where refused. */
function resetPeak(): boolean {
  try {
    writeFileSync('/proc/self/clear_refs', '5')
    return true
  } catch {
    return false
  }
}

export async function runMemory(spec: MemorySpec, progress: (line: string) => void): Promise<MemoryResult> {
  const beforeLoad = procMemory()
  const system = await loadSystem(spec.system, spec.file, loadOptions(spec.settings))
  try {
    const afterLoad = procMemory()
    const peakReset = resetPeak()
    // The pair's prompts replace the ones cut from these placeholder ids (the workload's shape is what is wanted).
    const w = { ...benchWorkload(spec.settings, () => spec.prompts.flat()), prompts: spec.prompts }
    progress(`${spec.file.id} memory: ${spec.system} alone, concurrency ${MEMORY_CONCURRENCY}`)
    const summary = await batchedRun(system, w, MEMORY_CONCURRENCY)
    const afterRun = procMemory()
    return {
      file: spec.file.id,
      system: spec.system,
      beforeLoad,
      afterLoad,
      afterRun,
      peakReset,
      peakMb: Math.max(afterLoad.vmHwmMb, afterRun.vmHwmMb),
      peakUnderLoadMb: peakReset ? afterRun.vmHwmMb : null,
      concurrency: MEMORY_CONCURRENCY,
      tokensPerSecond: summary.tokensPerSecond,
    }
  } finally {
    await system.close()
  }
}
