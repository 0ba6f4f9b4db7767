// The conversion stage of an import: every planned tensor (tensors.ts) made into its bytes, in
// layout order, for the data file writer. Dequantizing and requantizing are the import's work;
// they run on the calling thread (one worker) or on worker threads (convert-worker.ts), each of
// which re-plans the import from the file and the options and converts the tensors it is handed:
//
//   main thread                                    worker k (of n)
//   plan, layout                                   plan again (the same function, the same file)
//   hand out tensor indices (Schedule) ──index──►  t.chunks(data): read, convert
//   write tensor i's chunks once 0..i-1  ◄─chunk─  each chunk as it is made (transferred, not
//   are written                          ◄─done──  copied), then the tensor's spec names
//
// A worker sends each chunk as the tensor makes it, so the tensor being written streams through
// (a float32 embedding is never held whole). A tensor is only handed out while fewer than
// MAX_TENSORS_IN_FLIGHT(n) tensors, holding at most MAX_BYTES_IN_FLIGHT, are handed out and not
// yet written (the next one to write always goes), so memory stays bounded whatever the model's
// size; the costliest few go first (Schedule). Each tensor's conversion is a pure function of the
// file's bytes, so the data file is the same byte for byte whatever the number of workers.

import { existsSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { Worker } from 'node:worker_threads'
import { fromPackageRoot } from '../../backend'
import { OrtexError } from '../../errors'
import type { KvType, LinearStorage } from '../decoder'
import { DataType } from '../onnx-builder'
import { asHalfSpecs, floatBytes, type WeightLayout } from '../weights'
import type { ModelPlan } from './architecture'
import type { PlanOptions } from './import'
import type { GgufData } from './reader'
import { type PlannedTensor, planTensors } from './tensors'

/** The worker script, built beside the library (tsup's `gguf-worker` entry). */
const WORKER_SCRIPT = 'dist/gguf-worker.js'
/** Most conversion threads an import starts. */
export const MAX_IMPORT_WORKERS = 256
/** Bytes of converted tensors held at once, besides the one being written (at least one tensor
 *  is always in flight, however large): the bound on memory. */
const MAX_BYTES_IN_FLIGHT = 512 * 1024 * 1024
/** Tensors handed out and not yet written: enough that a worker finds work while the tensor to be
 *  written next (a requantized feed-forward layer) and a hoisted one (the lm_head) take their
 *  time, which two per worker were not. */
const MAX_TENSORS_IN_FLIGHT = (workers: number) => 8 * workers

/** The default: one conversion thread per core. */
export function defaultImportWorkers(): number {
  return Math.min(MAX_IMPORT_WORKERS, availableParallelism())
}

/** What a worker needs to plan the same tensors as the main thread: the file and the import's
 *  options (import.ts's importPlan), the linear layers' storage and the float type. */
export interface ConversionJob {
  file: string
  options: PlanOptions
  storage: LinearStorage
  dtype: KvType
}

/** A tensor's bytes: [spec index, chunk], in order. */
export type TensorParts = Array<[number, Uint8Array]>

/** The tensors an import writes, in layout order (float16 folders store their float32 parts as
 *  float16). The workers call it too, so they convert exactly the main thread's tensors. */
export function plannedTensors(plan: ModelPlan, storage: LinearStorage, dtype: KvType): PlannedTensor[] {
  return dtype === 'fp16' ? planTensors(plan, storage).map(asHalfTensor) : planTensors(plan, storage)
}

/** A planned tensor with its float32 parts stored as float16 (a float16 folder's data file). */
function asHalfTensor(t: PlannedTensor): PlannedTensor {
  const specs = asHalfSpecs(t.specs)
  return {
    ...t,
    specs,
    *chunks(data) {
      for (const [index, chunk] of t.chunks(data)) {
        if (specs[index]!.dataType !== t.specs[index]!.dataType) {
          const values = new Float32Array(chunk.buffer.slice(chunk.byteOffset, chunk.byteOffset + chunk.byteLength))
          yield [index, floatBytes(DataType.FLOAT16, values)]
        } else {
          yield [index, chunk]
        }
      }
    },
  }
}

/**
 * Every planned tensor's bytes, in order, chunk by chunk as the tensors make them: on this thread
 * for one worker, else from `workers` threads. Without a worker count,
 * one per core, or this thread where the worker script is not built (sources bundled elsewhere):
 * the bytes are the same. A count asked for needs the script.
 */
export async function* convertTensors(
  job: ConversionJob,
  data: GgufData,
  planned: PlannedTensor[],
  layout: WeightLayout,
  workers: number | undefined,
): AsyncGenerator<[PlannedTensor, TensorParts]> {
  const script = fromPackageRoot(WORKER_SCRIPT)
  const built = existsSync(script)
  if (workers !== undefined && workers > 1 && !built) throw new Error(`${workers} import workers need the worker script ${script}, which is not built (npm run build:ts)`)
  const threads = Math.min(workers ?? (built ? defaultImportWorkers() : 1), planned.length)
  if (threads <= 1) {
    for (const t of planned) for (const part of t.chunks(data)) yield [t, [part]]
    return
  }
  yield* new WorkerPool(script, job, threads).convert(planned, layout)
}

/** What a worker sends: a chunk of a tensor as it is made, the tensor's end (its specs' names, to
 *  check against the main thread's), or the error that stopped it. */
type WorkerMessage =
  | { index: number; chunk: [number, Uint8Array] }
  | { index: number; done: string[] }
  | { index: number; error: { code?: string; message: string } }

/** A tensor handed out: the chunks received and not yet written, and whether it is finished. */
interface Converting {
  chunks: TensorParts
  done: string[] | null
  error: Error | null
}

/** n worker threads converting tensors by index; their chunks are handed back in layout order. */
class WorkerPool {
  private readonly workers: Worker[]
  private readonly idle: Worker[]
  private readonly converting = new Map<number, Converting>()
  private failure: Error | null = null
  private wake: (() => void) | null = null

  constructor(script: string, job: ConversionJob, threads: number) {
    this.workers = Array.from({ length: threads }, () => new Worker(script, { workerData: job }))
    this.idle = [...this.workers]
    for (const worker of this.workers) {
      worker.on('message', (message: WorkerMessage) => {
        const tensor = this.converting.get(message.index)!
        if ('chunk' in message) tensor.chunks.push(message.chunk)
        else {
          if ('done' in message) tensor.done = message.done
          else tensor.error = workerError(message.error)
          this.idle.push(worker)
        }
        this.notify()
      })
      worker.on('error', (error) => this.fail(error))
      worker.on('exit', (code) => {
        if (code !== 0) this.fail(new Error(`an import worker exited with status ${code}`))
      })
    }
  }

  async *convert(planned: PlannedTensor[], layout: WeightLayout): AsyncGenerator<[PlannedTensor, TensorParts]> {
    const schedule = new Schedule(planned, layout, this.workers.length)
    const handOut = (next: number) => {
      for (let index = schedule.pick(next); index !== null && this.idle.length > 0; index = schedule.pick(next)) {
        schedule.handedOut(index)
        this.converting.set(index, { chunks: [], done: null, error: null })
        this.idle.pop()!.postMessage(index)
      }
    }
    try {
      for (let next = 0; next < planned.length; next++) {
        const t = planned[next]!
        const written = t.specs.map(() => 0)
        for (;;) {
          const tensor = await this.progress(next, () => handOut(next))
          if (tensor.error) throw tensor.error
          const parts = tensor.chunks.splice(0)
          for (const [spec, chunk] of parts) written[spec] = written[spec]! + chunk.byteLength
          if (parts.length > 0) yield [t, parts]
          if (tensor.done !== null && tensor.chunks.length === 0) {
            checkTensor(t, tensor.done, written, layout)
            break
          }
        }
        this.converting.delete(next)
        schedule.written(next)
      }
    } finally {
      await Promise.all(this.workers.map((w) => w.terminate()))
    }
  }

  /** Tensor `index` once it has chunks to write, has finished or failed; `handOut` runs first
   *  and at every message meanwhile, so that a worker that finished gets more work at once. */
  private async progress(index: number, handOut: () => void): Promise<Converting> {
    for (;;) {
      if (this.failure) throw this.failure
      handOut()
      const tensor = this.converting.get(index)
      if (tensor !== undefined && (tensor.chunks.length > 0 || tensor.done !== null || tensor.error !== null)) return tensor
      await new Promise<void>((resolve) => (this.wake = resolve))
    }
  }

  private notify(): void {
    const wake = this.wake
    this.wake = null
    wake?.()
  }

  private fail(error: Error): void {
    this.failure ??= error
    this.notify()
  }
}

/**
 * Which tensor to hand out next. Mostly layout order, so that converted tensors are written soon
 * after they are made; but the costliest tensors (a requantized lm_head, the 6-bit feed-forward
 * layers of a Q4_K_M file), at most one per worker, go first: started last, the longest of them
 * would leave every other worker idle while it finishes. Cost is estimated as the source's
 * elements, four times over where they are dequantized and requantized. Bounds: at most
 * MAX_TENSORS_IN_FLIGHT tensors and MAX_BYTES_IN_FLIGHT bytes handed out and not yet written,
 * except that the tensor to be written next is always handed out.
 */
class Schedule {
  private readonly sizes: number[]
  private readonly order: number[]
  private readonly handed: boolean[]
  private readonly limit: number
  private cursor = 0
  private inFlight = 0
  private bytesInFlight = 0

  constructor(planned: PlannedTensor[], layout: WeightLayout, workers: number) {
    this.sizes = planned.map((t) => t.specs.reduce((n, s) => n + layout.tensors.get(s.name)!.length, 0))
    this.handed = planned.map(() => false)
    this.limit = MAX_TENSORS_IN_FLIGHT(workers)
    const costs = planned.map((t) => (t.source?.elements ?? 0) * (t.mapping === 'requantized' ? 4 : 1))
    const total = costs.reduce((a, b) => a + b, 0)
    const heavy = planned
      .map((_, i) => i)
      .filter((i) => costs[i]! > total / (4 * workers) && this.sizes[i]! <= MAX_BYTES_IN_FLIGHT / 4)
      .sort((a, b) => costs[b]! - costs[a]! || a - b)
      .slice(0, workers)
    this.order = [...heavy, ...planned.map((_, i) => i).filter((i) => !heavy.includes(i))]
  }

  /** The tensor to hand out now, or null while the bounds say wait. */
  pick(next: number): number | null {
    while (this.cursor < this.order.length && this.handed[this.order[this.cursor]!]) this.cursor++
    if (this.cursor === this.order.length) return null
    const candidate = this.order[this.cursor]!
    const fits = this.inFlight < this.limit && (this.inFlight === 0 || this.bytesInFlight + this.sizes[candidate]! <= MAX_BYTES_IN_FLIGHT)
    if (fits) return candidate
    return this.handed[next] ? null : next
  }

  handedOut(index: number): void {
    this.handed[index] = true
    this.inFlight++
    this.bytesInFlight += this.sizes[index]!
  }

  written(index: number): void {
    this.inFlight--
    this.bytesInFlight -= this.sizes[index]!
  }
}

function workerError(error: { code?: string; message: string }): Error {
  return error.code === undefined ? new Error(error.message) : new OrtexError(error.code as never, error.message)
}

/** A worker's tensor is the main thread's, byte for byte in size: a worker built from other
 *  sources (a stale build) fails the import before the next tensor is written, never leaving a
 *  shifted file (the writer itself refuses bytes past a tensor's end). */
function checkTensor(t: PlannedTensor, names: string[], written: number[], layout: WeightLayout): void {
  const expected = t.specs.map((s) => s.name)
  if (names.join() !== expected.join()) throw new Error(`import worker: converted ${names.join(', ')} where ${expected.join(', ')} was asked (is dist/ built from these sources?)`)
  t.specs.forEach((s, i) => {
    const want = layout.tensors.get(s.name)!.length
    if (written[i] !== want) throw new Error(`import worker: ${s.name} came back with ${written[i]} bytes, expected ${want} (is dist/ built from these sources?)`)
  })
}
