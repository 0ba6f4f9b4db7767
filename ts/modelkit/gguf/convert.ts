// The conversion stage of an import: every planned tensor (tensors.ts) made into its bytes, in
// layout order, for the data file writer. Dequantizing and requantizing are the import's work;
// they run on the calling thread (one worker) or on worker threads (convert-worker.ts), each of
// which re-plans the import from the file and the options and converts the tensors it is handed:
//
//   main thread                                    worker k (of n)
//   plan, layout                                   plan again (the same function, the same file)
//   hand out tensor indices, in order  ──index──►  t.chunks(data): read, convert
//   write tensor i once 0..i-1 are written ◄─bytes─ (the buffers transferred, not copied)
//
// A tensor is only handed out while fewer than MAX_TENSORS_IN_FLIGHT(n) tensors, holding at most
// MAX_BYTES_IN_FLIGHT, are converted or converting and not yet written (one is always allowed),
// so memory stays bounded whatever the model's size. Each tensor's conversion is a pure function
// of the file's bytes, so the data file is the same byte for byte whatever the number of workers.

import { existsSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { Worker } from 'node:worker_threads'
import { fromPackageRoot } from '../../backend'
import { OrtexError } from '../../errors'
import type { KvType, LinearStorage } from '../llama'
import { DataType } from '../onnx-builder'
import { asHalfSpecs, floatBytes, type WeightLayout } from '../weights'
import type { ModelPlan } from './architecture'
import type { GgufData } from './reader'
import { type PlannedTensor, planTensors } from './tensors'

/** The worker script, built beside the library (tsup's `gguf-worker` entry). */
const WORKER_SCRIPT = 'dist/gguf-worker.js'
/** Most conversion threads an import starts. */
export const MAX_IMPORT_WORKERS = 256
/** Bytes of converted tensors held at once, besides the one being written (at least one tensor
 *  is always in flight, however large). */
const MAX_BYTES_IN_FLIGHT = 512 * 1024 * 1024
const MAX_TENSORS_IN_FLIGHT = (workers: number) => 2 * workers

/** The default: one conversion thread per core. */
export function defaultImportWorkers(): number {
  return Math.min(MAX_IMPORT_WORKERS, availableParallelism())
}

/** What a worker needs to plan the same tensors as the main thread. */
export interface ConversionJob {
  file: string
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
 * Every planned tensor's bytes, in order: on this thread for one worker (chunk by chunk, as the
 * tensor makes them), else from `workers` threads (each tensor whole). Without a worker count,
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

type WorkerReply = { index: number; names: string[]; parts: TensorParts } | { index: number; error: { code?: string; message: string } }

/** n worker threads converting tensors by index; results are handed back in index order. */
class WorkerPool {
  private readonly workers: Worker[]
  private readonly idle: Worker[]
  private readonly results = new Map<number, WorkerReply>()
  private failure: Error | null = null
  private wake: (() => void) | null = null

  constructor(script: string, job: ConversionJob, threads: number) {
    this.workers = Array.from({ length: threads }, () => new Worker(script, { workerData: job }))
    this.idle = [...this.workers]
    for (const worker of this.workers) {
      worker.on('message', (reply: WorkerReply) => {
        this.results.set(reply.index, reply)
        this.idle.push(worker)
        this.notify()
      })
      worker.on('error', (error) => this.fail(error))
      worker.on('exit', (code) => {
        if (code !== 0) this.fail(new Error(`an import worker exited with status ${code}`))
      })
    }
  }

  async *convert(planned: PlannedTensor[], layout: WeightLayout): AsyncGenerator<[PlannedTensor, TensorParts]> {
    const sizes = planned.map((t) => t.specs.reduce((n, s) => n + layout.tensors.get(s.name)!.length, 0))
    const limit = MAX_TENSORS_IN_FLIGHT(this.workers.length)
    let handedOut = 0
    let bytesInFlight = 0
    // Hands tensors to idle workers while under the bounds; the tensor to be written next always fits.
    const handOut = (next: number) => {
      while (handedOut < planned.length && this.idle.length > 0 && handedOut - next < limit) {
        if (handedOut > next && bytesInFlight + sizes[handedOut]! > MAX_BYTES_IN_FLIGHT) break
        bytesInFlight += sizes[handedOut]!
        this.idle.pop()!.postMessage(handedOut++)
      }
    }
    try {
      for (let next = 0; next < planned.length; next++) {
        const reply = await this.reply(next, () => handOut(next))
        this.results.delete(next)
        if ('error' in reply) throw workerError(reply.error)
        checkParts(planned[next]!, reply, layout)
        yield [planned[next]!, reply.parts]
        bytesInFlight -= sizes[next]!
      }
    } finally {
      await Promise.all(this.workers.map((w) => w.terminate()))
    }
  }

  /** Tensor `index`'s reply, once its worker sent it; `handOut` runs first and at every reply
   *  meanwhile, so that a worker that finished gets more work at once. */
  private async reply(index: number, handOut: () => void): Promise<WorkerReply> {
    for (;;) {
      if (this.failure) throw this.failure
      handOut()
      const reply = this.results.get(index)
      if (reply !== undefined) return reply
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

function workerError(error: { code?: string; message: string }): Error {
  return error.code === undefined ? new Error(error.message) : new OrtexError(error.code as never, error.message)
}

/** A worker's tensor is the main thread's, byte for byte in size: a worker built from other
 *  sources (a stale build) must fail the import, never write a shifted file. */
function checkParts(t: PlannedTensor, reply: { names: string[]; parts: TensorParts }, layout: WeightLayout): void {
  const names = t.specs.map((s) => s.name)
  if (reply.names.join() !== names.join()) throw new Error(`import worker: converted ${reply.names.join(', ')} where ${names.join(', ')} was asked (is dist/ built from these sources?)`)
  const bytes = t.specs.map(() => 0)
  for (const [index, chunk] of reply.parts) bytes[index] = (bytes[index] ?? 0) + chunk.byteLength
  t.specs.forEach((s, i) => {
    const want = layout.tensors.get(s.name)!.length
    if (bytes[i] !== want) throw new Error(`import worker: ${s.name} came back with ${bytes[i]} bytes, expected ${want} (is dist/ built from these sources?)`)
  })
}
