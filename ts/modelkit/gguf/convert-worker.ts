// An import's conversion thread (convert.ts): plans the import again from the file and the
// options the main thread gives it, then converts each tensor it is handed by index and sends
// the bytes back (the buffers transferred). Errors go back as replies, with their OrtexError code.

import { parentPort, workerData } from 'node:worker_threads'
import { planModel } from './architecture'
import { type ConversionJob, type TensorParts, plannedTensors } from './convert'
import { GgufData, readGguf } from './reader'

const job = workerData as ConversionJob
const port = parentPort!
let converter: ((index: number) => { names: string[]; parts: TensorParts }) | null = null
let planError: unknown = null
try {
  const file = readGguf(job.file)
  const planned = plannedTensors(planModel(file), job.storage, job.dtype)
  const data = new GgufData(file)
  converter = (index) => {
    const t = planned[index]!
    // Copies: a tensor may reuse one buffer for its successive chunks.
    const parts: TensorParts = Array.from(t.chunks(data), ([spec, chunk]) => [spec, chunk.slice()])
    return { names: t.specs.map((s) => s.name), parts }
  }
} catch (error) {
  planError = error
}

port.on('message', (index: number) => {
  try {
    if (converter === null) throw planError
    const { names, parts } = converter(index)
    port.postMessage({ index, names, parts }, parts.map(([, chunk]) => chunk.buffer as ArrayBuffer))
  } catch (error) {
    const e = error as { code?: unknown; message?: unknown }
    const code = typeof e?.code === 'string' ? e.code : undefined
    port.postMessage({ index, error: { ...(code === undefined ? {} : { code }), message: String(e?.message ?? error) } })
  }
})
