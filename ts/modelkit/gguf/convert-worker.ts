// An import's conversion thread (convert.ts): plans the import again from the file and the
// options the main thread gives it, then converts each tensor it is handed by index and sends
// each chunk back as it is made (the buffers transferred), then the tensor's end. Errors go back
// as messages, with their OrtexError code.

import { parentPort, workerData } from 'node:worker_threads'
import { type ConversionJob, plannedTensors } from './convert'
import { importPlan } from './import'
import { GgufData, readGguf } from './reader'

const job = workerData as ConversionJob
const port = parentPort!
let convert: ((index: number) => void) | null = null
let planError: unknown = null
try {
  const file = readGguf(job.file)
  const planned = plannedTensors(importPlan(file, job.options), job.storage, job.dtype)
  const data = new GgufData(file)
  convert = (index) => {
    const t = planned[index]!
    for (const [spec, chunk] of t.chunks(data)) {
      // A copy: a tensor may reuse one buffer for its successive chunks.
      const copy = chunk.slice()
      port.postMessage({ index, chunk: [spec, copy] }, [copy.buffer as ArrayBuffer])
    }
    port.postMessage({ index, done: t.specs.map((s) => s.name) })
  }
} catch (error) {
  planError = error
}

port.on('message', (index: number) => {
  try {
    if (convert === null) throw planError
    convert(index)
  } catch (error) {
    const e = error as { code?: unknown; message?: unknown }
    const code = typeof e?.code === 'string' ? e.code : undefined
    port.postMessage({ index, error: { ...(code === undefined ? {} : { code }), message: String(e?.message ?? error) } })
  }
})
