// What every `ortex` command shares: usage errors, flag parsing, the choice of engine
// (--model DIR|FILE.gguf | --simulated, --backend, --seed, a GGUF file's import flags) and the
// progress lines on a terminal.

import { readdirSync, statSync } from 'node:fs'
import path from 'node:path'

import type { Engine } from '../engine'
import { Engine as NativeEngine } from '../index'
import { modelPathKind } from '../model-source'
import type { EngineOptions, GgufLoadEvent, GgufLoadOptions } from '../types'
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
  weights: { type: 'string' },
  kv: { type: 'string' },
  'accuracy-level': { type: 'string' },
  'import-workers': { type: 'string' },
  context: { type: 'string' },
} as const

/** The flags of ENGINE_FLAGS that shape a GGUF file's import, with their help's lines. */
const GGUF_FLAGS: ReadonlyArray<[string, string[]]> = [
  ['--weights FORMAT', ["a GGUF --model: its import's weights, 'int4' (default) or 'fp32'"]],
  ['--kv TYPE', ["a GGUF --model: its import's KV type, 'fp16' or 'fp32' (default: fp16", 'with int4 weights, fp32 with fp32 weights)']],
  ['--accuracy-level N', ["a GGUF --model, int4: MatMulNBits' accuracy level, 4 (default) or 0"]],
  ['--import-workers N', ['a GGUF --model: threads that convert its tensors (default: one per', 'core)']],
  ['--context N', ["a GGUF --model: its import's context (default: the file's context_length)"]],
]

/** The help's lines of the GGUF import flags, their text starting at `column`. */
export function ggufFlagsHelp(column: number): string {
  return GGUF_FLAGS.map(([flag, lines]) => lines.map((line, i) => `${(i === 0 ? `  ${flag}` : '').padEnd(column)}${line}\n`).join('')).join('')
}

export interface EngineChoice {
  /** The model folder or GGUF file, or undefined for the simulated model. */
  model: string | undefined
  /** How a GGUF --model is imported (the flags given; Engine.load's defaults for the rest). */
  gguf: Omit<GgufLoadOptions, 'onProgress'>
  seed: number
  backend: 'native' | 'wasm'
  /** --kv-cache-bytes: the model's KV budget (EngineOptions.kvCacheBytes). */
  kvCacheBytes: number | undefined
}

/** Checks --model / --simulated / --seed / --backend and the import flags as parseArgs returned them. */
export function engineChoice(values: {
  model?: string
  simulated?: boolean
  seed?: string
  backend?: string
  'kv-cache-bytes'?: string
  weights?: string
  kv?: string
  'accuracy-level'?: string
  'import-workers'?: string
  context?: string
}): EngineChoice {
  if (values.model !== undefined && values.simulated === true) throw new UsageError('give either --model or --simulated, not both')
  if (values.model === undefined && values.simulated !== true) throw new UsageError('give --model DIR or --simulated')
  if (values.model === '') throw new UsageError('--model needs a folder or a .gguf file')
  const level = choiceFlag('accuracy-level', values['accuracy-level'], ['0', '4'] as const)
  const gguf: EngineChoice['gguf'] = {
    weights: choiceFlag('weights', values.weights, ['int4', 'fp32'] as const),
    kv: choiceFlag('kv', values.kv, ['fp16', 'fp32'] as const),
    accuracyLevel: level === undefined ? undefined : (Number(level) as 0 | 4),
    workers: integerFlag('import-workers', values['import-workers'], undefined, 1, 256),
    contextLength: integerFlag('context', values.context, undefined, 1, 1 << 20),
  }
  const given = (['weights', 'kv', 'accuracy-level', 'import-workers', 'context'] as const).filter((flag) => values[flag] !== undefined)
  if (given.length > 0 && (values.model === undefined || modelPathKind(values.model) === 'folder')) {
    throw new UsageError(`${given.map((flag) => `--${flag}`).join(', ')}: for a GGUF file's import (--model FILE.gguf), not a model folder or the simulated model`)
  }
  return {
    model: values.model,
    gguf,
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
  // A GGUF file shows its hash and import instead of the folder's spinner (both draw on one line).
  const engine =
    modelPathKind(choice.model) === 'gguf'
      ? await withImportProgress((onProgress) => EngineClass.load(choice.model!, { ...options, ...budget, gguf: { ...choice.gguf, onProgress } }))
      : await withLoadProgress(choice.model, EngineClass.load(choice.model, { ...options, ...budget }))
  process.stderr.write(`${describeKvPool(choice.model, engine.config)}\n`)
  return engine
}

/**
 * A GGUF load's progress on stderr: on a terminal, a bar while the file is hashed and one while
 * it is imported; elsewhere a line when each starts and one at each quarter of the import. Either
 * way a line that says which import runs: the summary `ortex import` prints, or the cached one.
 */
async function withImportProgress<T>(load: (onProgress: (event: GgufLoadEvent) => void) => Promise<T>): Promise<T> {
  const live = process.stderr.isTTY === true
  // The bar of the phase running: hashing or importing.
  const shown: { phase: GgufLoadEvent['kind'] | null; bar: ReturnType<typeof progressBar> | null } = { phase: null, bar: null }
  let quarter = 0
  const onProgress = (event: GgufLoadEvent): void => {
    if (event.kind !== shown.phase) {
      shown.bar?.end()
      shown.bar = event.kind === 'hashing' || event.kind === 'importing' ? progressBar(event.kind) : null
      shown.phase = event.kind
      if (event.kind === 'hashing' && !live) process.stderr.write(`reading ${event.file} (${(event.totalBytes / 1e6).toFixed(1)} MB) for the sha256 that keys its import\n`)
      if (event.kind === 'importing' && !live) process.stderr.write(`importing ${event.file} into ${event.folder} (its first use)\n`)
    }
    switch (event.kind) {
      case 'hashing':
        shown.bar?.update(event.doneBytes, event.totalBytes)
        break
      case 'importing':
        shown.bar?.update(event.doneBytes, event.totalBytes)
        if (!live && quarter < 3 && event.totalBytes > 0 && 4 * event.doneBytes >= (quarter + 1) * event.totalBytes) {
          quarter = Math.min(3, Math.floor((4 * event.doneBytes) / event.totalBytes))
          const mb = (n: number) => (n / 1e6).toFixed(1)
          process.stderr.write(`importing ${event.file}: ${25 * quarter}% (${mb(event.doneBytes)} of ${mb(event.totalBytes)} MB)\n`)
        }
        break
      case 'imported':
        process.stderr.write(`imported ${event.file} into ${event.summary}\n`)
        break
      case 'reused':
        process.stderr.write(`${event.file}: its import in the cache, ${event.folder}\n`)
        break
    }
  }
  try {
    return await load(onProgress)
  } finally {
    shown.bar?.end()
  }
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
