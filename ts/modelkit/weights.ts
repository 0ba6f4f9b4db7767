// Streams the model's weights to the external data file: each tensor is generated chunk by chunk
// from its own seeded stream and written as raw little-endian float32, so memory stays small
// whatever the model size.

import { open } from 'node:fs/promises'
import type { ExternalTensor } from './onnx-builder'
import { DataType } from './onnx-builder'
import type { LlamaDims, WeightSpec } from './llama'
import { tensorStream } from './random'
import { BOS_TOKEN_ID, FIRST_BYTE_TOKEN_ID, PAD_TOKEN_ID } from './tokenizer'

/** Tensors start on this byte boundary in the data file (lets ONNX Runtime map them directly). */
export const DATA_ALIGNMENT = 4096
const CHUNK = 1 << 18 // floats per write (1 MiB)

export interface WeightLayout {
  tensors: Map<string, ExternalTensor>
  totalBytes: number
}

export function layoutWeights(specs: WeightSpec[], location: string): WeightLayout {
  const tensors = new Map<string, ExternalTensor>()
  let offset = 0
  for (const s of specs) {
    const length = s.dims.reduce((a, b) => a * b, 1) * 4
    tensors.set(s.name, { name: s.name, dataType: DataType.FLOAT, dims: s.dims, location, offset, length })
    offset = align(offset + length)
  }
  return { tensors, totalBytes: offset }
}

function align(n: number): number {
  return Math.ceil(n / DATA_ALIGNMENT) * DATA_ALIGNMENT
}

/** Writes every tensor of `specs` at its place in `layout`; reports progress in bytes. */
export async function writeWeights(
  file: string,
  specs: WeightSpec[],
  layout: WeightLayout,
  dims: LlamaDims,
  seed: number,
  onProgress?: (done: number, total: number, label: string) => void,
): Promise<void> {
  if (new Uint8Array(new Float32Array([1]).buffer)[3] !== 0x3f) {
    throw new Error('the model generator needs a little-endian machine')
  }
  const handle = await open(file, 'w')
  try {
    const buf = new Float32Array(CHUNK)
    const bytes = new Uint8Array(buf.buffer)
    const zeros = new Uint8Array(DATA_ALIGNMENT)
    let written = 0
    onProgress?.(0, layout.totalBytes, 'weights')
    for (const s of specs) {
      const t = layout.tensors.get(s.name)!
      if (written < t.offset) {
        await handle.write(zeros, 0, t.offset - written, written)
        written = t.offset
      }
      const count = t.length / 4
      const fill = valueSource(s, dims, seed)
      for (let start = 0; start < count; start += CHUNK) {
        const n = Math.min(CHUNK, count - start)
        for (let i = 0; i < n; i++) buf[i] = fill(start + i)
        await handle.write(bytes, 0, n * 4, written)
        written += n * 4
        onProgress?.(written, layout.totalBytes, s.name)
      }
    }
    if (written < layout.totalBytes) {
      await handle.write(zeros, 0, layout.totalBytes - written, written)
      written = layout.totalBytes
    }
    onProgress?.(written, layout.totalBytes, 'weights')
  } finally {
    await handle.close()
  }
}

/** Element index -> value (called in index order for the random kinds). */
function valueSource(s: WeightSpec, d: LlamaDims, seed: number): (i: number) => number {
  const init = s.init
  switch (init.kind) {
    case 'uniform': {
      const rng = tensorStream(seed, s.name)
      const a = init.std * Math.sqrt(3) // uniform on [-a, a) has this standard deviation
      return () => rng.nextSigned() * a
    }
    case 'lm-head': {
      // Columns of <pad>, <s>, the control bytes but newline, and the bytes 0x7F-0xFF (which alone
      // are not valid UTF-8) are scaled down, so that a random model mostly emits tokens that
      // decode to readable text (they stay possible, only less likely).
      const rng = tensorStream(seed, s.name)
      const a = init.std * Math.sqrt(3)
      const damped = (id: number) => {
        if (id === PAD_TOKEN_ID || id === BOS_TOKEN_ID) return true
        const byte = id - FIRST_BYTE_TOKEN_ID
        return byte >= 0 && byte < 0x100 && ((byte < 0x20 && byte !== 0x0a) || byte >= 0x7f)
      }
      const colScale = Float64Array.from({ length: init.vocabSize }, (_, id) => (damped(id) ? 0.5 : 1))
      return (i) => rng.nextSigned() * a * colScale[i % init.vocabSize]!
    }
    case 'norm': {
      const rng = tensorStream(seed, s.name)
      return () => 1 + rng.nextSigned() * init.jitter
    }
    case 'rope-cos':
    case 'rope-sin': {
      const half = d.headSize / 2
      const invFreq = Array.from({ length: half }, (_, i) => 1 / Math.pow(d.ropeTheta, (2 * i) / d.headSize))
      const fn = init.kind === 'rope-cos' ? Math.cos : Math.sin
      return (i) => fn(Math.floor(i / half) * invFreq[i % half]!)
    }
  }
}
