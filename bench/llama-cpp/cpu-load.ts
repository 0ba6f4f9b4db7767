// Whether a sample ran on a quiet machine. /proc/stat counts every CPU's busy time and
// /proc/self/stat this process's (utime + stime: all its threads, so llama.cpp's and ONNX
// Runtime's workers too, and the threads that already exited); their difference over a sample is
// what other processes (and the kernel on their behalf) took. On a 2-core machine a compile or a
// test run beside the benchmark moves its numbers by tens of percent, so a sample during which
// others used more than a share of one core is refused and run again after a pause; one never
// accepted is reported as refused, not as a number.

import { readFileSync } from 'node:fs'

export interface CpuReading {
  /** All CPUs, in clock ticks: busy (user, nice, system, irq, softirq), everything (idle, iowait, steal too), stolen by the hypervisor. */
  busyTicks: number
  totalTicks: number
  stealTicks: number
  cpus: number
  /** This process's utime + stime, in clock ticks. */
  ownTicks: number
  atMs: number
}

/** What a sample's wall time held, in cores (1 = one core busy throughout). */
export interface CpuShare {
  wallMs: number
  /** Other processes' CPU time over the wall time (0.1 = 10% of one core). */
  othersCores: number
  /** This process's CPU time over the wall time (its two runtimes' threads included). */
  processCores: number
  /** Time the hypervisor gave to other guests (not refused on: nothing here can wait it out). */
  stealCores: number
}

export function readCpu(): CpuReading {
  const lines = readFileSync('/proc/stat', 'utf8').split('\n')
  const all = lines[0]!.trim().split(/\s+/).slice(1).map(Number)
  const [user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0] = all
  const busyTicks = user + nice + system + irq + softirq
  return {
    busyTicks,
    totalTicks: busyTicks + idle + iowait + steal,
    stealTicks: steal,
    cpus: lines.filter((l) => /^cpu\d+ /.test(l)).length,
    ownTicks: ownTicks(),
    atMs: performance.now(),
  }
}

/** utime + stime of this process: fields 14 and 15 of /proc/self/stat, counted after the
 *  parenthesized command name (which may hold spaces). */
function ownTicks(): number {
  const stat = readFileSync('/proc/self/stat', 'utf8')
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  return Number(fields[11]) + Number(fields[12])
}

export function cpuShare(before: CpuReading, after: CpuReading): CpuShare {
  // Ticks per CPU over the interval: the wall time in ticks, without assuming the tick rate.
  const perCpu = Math.max(1, (after.totalTicks - before.totalTicks) / after.cpus)
  const busy = after.busyTicks - before.busyTicks
  const own = after.ownTicks - before.ownTicks
  return {
    wallMs: after.atMs - before.atMs,
    othersCores: Math.max(0, busy - own) / perCpu,
    processCores: own / perCpu,
    stealCores: (after.stealTicks - before.stealTicks) / perCpu,
  }
}

export interface LoadGuard {
  /** Refuse a sample when other processes used more than this many cores (0.1: 10% of one). */
  maxOthersCores: number
  /** Runs after a refused sample (default 3). */
  retries: number
  /** Pause before a retry, to let the other work pass. */
  pauseMs: number
  onProgress: (line: string) => void
}

export interface GuardedSample<T> {
  /** The accepted attempt's result; null when every attempt was refused. */
  result: T | null
  /** Every attempt's CPU share, the accepted one last. */
  attempts: CpuShare[]
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms))

/** Runs `sample` until an attempt ran on a quiet machine, at most 1 + retries times. */
export async function guarded<T>(label: string, guard: LoadGuard, sample: () => Promise<T>): Promise<GuardedSample<T>> {
  const attempts: CpuShare[] = []
  for (let attempt = 0; attempt <= guard.retries; attempt++) {
    const before = readCpu()
    const result = await sample()
    const share = cpuShare(before, readCpu())
    attempts.push(share)
    if (share.othersCores <= guard.maxOthersCores) return { result, attempts }
    guard.onProgress(
      `  ${label}: refused: other processes used ${(100 * share.othersCores).toFixed(0)}% of a core ` +
        `(limit ${(100 * guard.maxOthersCores).toFixed(0)}%)${attempt < guard.retries ? `; again in ${guard.pauseMs / 1000} s` : '; reported as refused'}`,
    )
    if (attempt < guard.retries) await sleep(guard.pauseMs)
  }
  return { result: null, attempts }
}

/** This process's own CPU over `ms` of idling: what its runtimes' threads burn between runs. */
export async function idleProcessCores(ms: number): Promise<CpuShare> {
  const before = readCpu()
  await sleep(ms)
  return cpuShare(before, readCpu())
}
