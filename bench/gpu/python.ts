// The Python sides of the GPU benchmark (bench/gpu/hf_bench.py, bench/gpu/genai_bench.py): each runs
// as a child process over the workload file and answers JSON lines ({"info"}, {"row"} per
// concurrency, {"done"}); its stderr is progress. The device's memory is read as each row arrives,
// while the child still holds what it allocated. A child that outlives its budget is killed and
// its missing concurrencies say so.

import { spawn, spawnSync } from 'node:child_process'
import { createInterface } from 'node:readline'

import type { GpuRow, GpuSystem } from './report'

export interface PythonPhase {
  system: Exclude<GpuSystem, 'ortex'>
  model: string
  python: string
  script: string
  args: string[]
  env?: NodeJS.ProcessEnv
  concurrencies: number[]
  /** Seconds after which the child is killed (its script also skips what it estimates will not fit). */
  killAfterS: number
  onProgress: (line: string) => void
  onRow: (row: GpuRow) => void
  gpuMemoryMb: () => number | null
}

export interface PhaseResult {
  info: Record<string, unknown> | null
  rows: GpuRow[]
  error?: string
}

type Line = { info?: Record<string, unknown>; row?: Record<string, unknown> & { concurrency: number }; done?: boolean }

export function runPythonPhase(phase: PythonPhase): Promise<PhaseResult> {
  return new Promise((resolve) => {
    const child = spawn(phase.python, [phase.script, ...phase.args], { stdio: ['ignore', 'pipe', 'pipe'], env: phase.env ?? process.env })
    const result: PhaseResult = { info: null, rows: [] }
    const stderrTail: string[] = []
    let killed = false
    const timer = setTimeout(() => {
      killed = true
      child.kill('SIGKILL')
    }, phase.killAfterS * 1000)
    createInterface({ input: child.stderr }).on('line', (line) => {
      if (line.trim() === '') return
      stderrTail.push(line)
      if (stderrTail.length > 5) stderrTail.shift()
      phase.onProgress(line)
    })
    createInterface({ input: child.stdout }).on('line', (line) => {
      let message: Line
      try {
        message = JSON.parse(line) as Line
      } catch {
        if (line.trim() !== '') phase.onProgress(`${phase.system}: ${line}`)
        return
      }
      if (message.info !== undefined) result.info = message.info
      if (message.row !== undefined) {
        const row = toRow(phase, message.row)
        result.rows.push(row)
        phase.onRow(row)
      }
    })
    child.on('error', (error) => (result.error = `${phase.python} failed to start: ${error.message}`))
    child.on('close', (code, signal) => {
      clearTimeout(timer)
      if (code !== 0 || killed) {
        result.error ??= killed ? `killed after ${phase.killAfterS} s (the time budget)` : `exited (${signal ?? `status ${code}`}): ${stderrTail.join(' / ')}`
      }
      for (const c of phase.concurrencies) {
        if (result.rows.some((r) => r.concurrency === c)) continue
        const row: GpuRow = { model: phase.model, system: phase.system, concurrency: c, error: result.error ?? 'not run' }
        result.rows.push(row)
        phase.onRow(row)
      }
      resolve(result)
    })
  })
}

function toRow(phase: PythonPhase, raw: Record<string, unknown> & { concurrency: number }): GpuRow {
  const base = { model: phase.model, system: phase.system, concurrency: raw.concurrency }
  if (typeof raw.error === 'string') return { ...base, error: raw.error }
  const memory = (raw.memory ?? {}) as Record<string, number>
  return {
    ...base,
    requests: raw.requests as number,
    tokens: raw.tokens as number,
    wallMs: raw.wallMs as number,
    tokensPerSecond: raw.tokensPerSecond as number,
    ttftMs: raw.ttftMs as GpuRow['ttftMs'],
    itlMs: raw.itlMs as GpuRow['itlMs'],
    gpuMemoryMb: phase.gpuMemoryMb(),
    rssMb: memory.rssMb ?? memory.rssPeakMb ?? null,
  }
}

/**
 * The device's memory in use (MiB, all processes): nvidia-smi where the machine has it, else
 * PyTorch's cudaMemGetInfo from a short Python call (that count includes the call's own CUDA
 * context, a few hundred MiB). Null where neither answers (no GPU).
 */
export function gpuMemoryProbe(python: string): () => number | null {
  let way: 'nvidia-smi' | 'torch' | 'none' | undefined
  const smi = (): number | null => {
    const r = spawnSync('nvidia-smi', ['--query-gpu=memory.used', '--format=csv,noheader,nounits'], { encoding: 'utf8', timeout: 10_000 })
    const value = r.status === 0 ? Number(r.stdout.trim().split('\n')[0]) : NaN
    return Number.isFinite(value) ? value : null
  }
  const torch = (): number | null => {
    const code = 'import torch; f, t = torch.cuda.mem_get_info(); print((t - f) / 2**20)'
    const r = spawnSync(python, ['-c', code], { encoding: 'utf8', timeout: 60_000 })
    const value = r.status === 0 ? Number(r.stdout.trim()) : NaN
    return Number.isFinite(value) ? value : null
  }
  return () => {
    if (way === 'none') return null
    if (way === undefined) {
      const first = smi()
      if (first !== null) {
        way = 'nvidia-smi'
        return first
      }
      const second = torch()
      way = second === null ? 'none' : 'torch'
      return second
    }
    return way === 'nvidia-smi' ? smi() : torch()
  }
}
