// What every `ortex` command shares: usage errors, flag parsing, the choice of engine
// (--model DIR | --simulated, --backend, --seed) and the progress lines on a terminal.

import { readdirSync, statSync } from 'node:fs'
import path from 'node:path'

import type { Engine } from '../engine'
import { Engine as NativeEngine } from '../index'
import type { EngineOptions } from '../types'
import { Engine as WasmEngine } from '../wasm'

/** A wrong command line: the process exits with status 2 and this message. */
export class UsageError extends Error {}

/** `--name N`: an integer in [min, max], or `fallback` when absent. */
export function integerFlag(name: string, value: string | undefined, fallback: number, min: number, max: number): number
export function integerFlag(name: string, value: string | undefined, fallback: undefined, min: number, max: number): number | undefined
export function integerFlag(
  name: string,
  value: string | undefined,
  fallback: number | undefined,
  min: number,
  max: number,
): number | undefined {
  if (value === undefined) return fallback
  const n = Number(value)
  if (!/^\d+$/.test(value) || !Number.isSafeInteger(n) || n < min || n > max) {
    throw new UsageError(`--${name} must be an integer in [${min}, ${max}], got ${JSON.stringify(value)}`)
  }
  return n
}

/** `--name X`: a finite number >= 0, or undefined when absent. */
export function numberFlag(name: string, value: string | undefined): number | undefined {
  if (value === undefined) return undefined
  const n = Number(value)
  if (value.trim() === '' || !Number.isFinite(n) || n < 0) {
    throw new UsageError(`--${name} must be a number >= 0, got ${JSON.stringify(value)}`)
  }
  return n
}

/** `--name X`: one of `choices`, or undefined when absent. */
export function choiceFlag<T extends string>(name: string, value: string | undefined, choices: readonly T[]): T | undefined {
  if (value === undefined) return undefined
  if (!(choices as readonly string[]).includes(value)) {
    throw new UsageError(`--${name} must be ${choices.map((c) => `'${c}'`).join(' or ')}, got ${JSON.stringify(value)}`)
  }
  return value as T
}

/** The parseArgs options of the engine choice, shared by generate and serve. */
export const ENGINE_FLAGS = {
  model: { type: 'string' },
  simulated: { type: 'boolean' },
  seed: { type: 'string' },
  backend: { type: 'string' },
  'kv-cache-bytes': { type: 'string' },
} as const

export interface EngineChoice {
  /** The model folder, or undefined for the simulated model. */
  model: string | undefined
  seed: number
  backend: 'native' | 'wasm'
  /** --kv-cache-bytes: the model's KV budget (EngineOptions.kvCacheBytes). */
  kvCacheBytes: number | undefined
}

/** Checks --model / --simulated / --seed / --backend as parseArgs returned them. */
export function engineChoice(values: {
  model?: string
  simulated?: boolean
  seed?: string
  backend?: string
  'kv-cache-bytes'?: string
}): EngineChoice {
  if (values.model !== undefined && values.simulated === true) throw new UsageError('give either --model or --simulated, not both')
  if (values.model === undefined && values.simulated !== true) throw new UsageError('give --model DIR or --simulated')
  if (values.model === '') throw new UsageError('--model needs a folder')
  return {
    model: values.model,
    seed: integerFlag('seed', values.seed, 0, 0, Number.MAX_SAFE_INTEGER),
    backend: choiceFlag('backend', values.backend, ['native', 'wasm'] as const) ?? 'native',
    kvCacheBytes: integerFlag('kv-cache-bytes', values['kv-cache-bytes'], undefined, 1, Number.MAX_SAFE_INTEGER),
  }
}

/** Opens the chosen engine: a model folder (with a progress line on a terminal while it loads,
 *  and a line on stderr saying what its KV pool reserves) or the simulated model with
 *  `simulated` options. */
export async function openEngine(
  choice: EngineChoice,
  options: EngineOptions,
  simulated: Record<string, unknown> = {},
): Promise<Engine> {
  const EngineClass = choice.backend === 'wasm' ? WasmEngine : NativeEngine
  if (choice.model === undefined) return EngineClass.simulated({ ...options, ...simulated, seed: choice.seed })
  const budget = choice.kvCacheBytes === undefined ? {} : { kvCacheBytes: choice.kvCacheBytes }
  const engine = await withLoadProgress(choice.model, EngineClass.load(choice.model, { ...options, ...budget }))
  process.stderr.write(`${describeKvPool(choice.model, engine.config)}\n`)
  return engine
}

const MIB = 1024 * 1024

/** `loaded DIR: KV pool of 2048 blocks x 16 positions, 1440.0 MiB reserved (45.0 KiB per position)`. */
export function describeKvPool(modelDir: string, config: Engine['config']): string {
  const reserved = `${(config.kvCacheBytes / MIB).toFixed(1)} MiB reserved`
  const perPosition = `${(config.kvPositionBytes / 1024).toFixed(1)} KiB per position`
  return `loaded ${modelDir}: KV pool of ${config.numBlocks} blocks x ${config.blockSize} positions, ${reserved} (${perPosition})`
}

/** On a terminal, a line on stderr while a model loads (a large one takes seconds): the folder's
 *  size and the time so far, cleared when it is done. Elsewhere nothing. */
async function withLoadProgress<T>(modelDir: string, loading: Promise<T>): Promise<T> {
  if (process.stderr.isTTY !== true) return loading
  const startedAt = performance.now()
  const size = folderBytes(modelDir)
  const frames = ['|', '/', '-', '\\']
  let frame = 0
  const draw = (): void => {
    const seconds = ((performance.now() - startedAt) / 1000).toFixed(1)
    const mb = size > 0 ? ` (${(size / 1e6).toFixed(1)} MB)` : ''
    process.stderr.write(`\r\x1b[2Kloading ${modelDir}${mb} ${frames[frame++ % frames.length]} ${seconds} s`)
  }
  draw()
  const timer = setInterval(draw, 100)
  try {
    return await loading
  } finally {
    clearInterval(timer)
    process.stderr.write('\r\x1b[2K')
  }
}

function folderBytes(dir: string): number {
  try {
    return readdirSync(dir, { withFileTypes: true })
      .filter((entry) => entry.isFile())
      .reduce((sum, entry) => sum + statSync(path.join(dir, entry.name)).size, 0)
  } catch {
    return 0
  }
}

/** A one-line bar on stderr, redrawn on a terminal; elsewhere nothing until the summary. */
export function progressBar(label: string): { update: (done: number, total: number) => void; end: () => void } {
  const live = process.stderr.isTTY === true
  let last = -1
  return {
    update(done, total) {
      if (!live || total <= 0) return
      const fraction = Math.min(1, done / total)
      const percent = Math.floor(fraction * 100)
      if (percent === last) return
      last = percent
      const width = 30
      const filled = Math.round(fraction * width)
      const mb = (n: number) => (n / 1e6).toFixed(1)
      process.stderr.write(
        `\r\x1b[2K${label} [${'#'.repeat(filled)}${' '.repeat(width - filled)}] ${String(percent).padStart(3)}% ` +
          `${mb(done)}/${mb(total)} MB`,
      )
    },
    end() {
      if (live && last >= 0) process.stderr.write('\r\x1b[2K')
    },
  }
}
