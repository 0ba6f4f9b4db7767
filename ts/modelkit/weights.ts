// The external data file (model.onnx.data): the layout of its tensors, a front-to-back writer that
// streams each tensor in chunks (make-model and the GGUF importer both write through it), and the
// random weights of `ortex make-model`, each tensor generated chunk by chunk from its own seeded
// stream as raw little-endian float32, so memory stays small whatever the model size.

import { open, type FileHandle } from 'node:fs/promises'
import type { DataTypeCode, ExternalTensor } from './onnx-builder'
import { DataType } from './onnx-builder'
import type { DecoderDims, WeightSpec } from './decoder'
import { toHalfArray } from './half'
import { tensorStream } from './random'
import { BOS_TOKEN_ID, FIRST_BYTE_TOKEN_ID, PAD_TOKEN_ID } from './tokenizer'

/** Tensors start on this byte boundary in the data file (lets ONNX Runtime map them directly). */
export const DATA_ALIGNMENT = 4096
const CHUNK = 1 << 18 // floats per write (1 MiB)
const MAX_WRITE = 64 << 20 // bytes per write call

export interface WeightLayout {
  tensors: Map<string, ExternalTensor>
  totalBytes: number
}

/** What a tensor in the data file needs: its name, dims and element type (default float32). */
export interface TensorSpec {
  name: string
  dims: number[]
  dataType?: DataTypeCode
}

const ELEMENT_BYTES: Readonly<Record<number, number>> = { [DataType.FLOAT]: 4, [DataType.FLOAT16]: 2, [DataType.UINT8]: 1 }

/** `specs` with every float32 tensor stored as float16 (a float16 folder's data file). */
export function asHalfSpecs<T extends TensorSpec>(specs: readonly T[]): T[] {
  return specs.map((s) => ((s.dataType ?? DataType.FLOAT) === DataType.FLOAT ? { ...s, dataType: DataType.FLOAT16 } : s))
}

/** A chunk of float32 values as the bytes of a tensor of `dataType`: themselves, or their float16 bits. */
export function floatBytes(dataType: DataTypeCode, values: Float32Array): Uint8Array {
  if (dataType === DataType.FLOAT16) return new Uint8Array(toHalfArray(values).buffer)
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
}

/** Places the tensors one after another, each on a DATA_ALIGNMENT boundary. */
export function layoutWeights(specs: readonly TensorSpec[], location: string): WeightLayout {
  const tensors = new Map<string, ExternalTensor>()
  let offset = 0
  for (const s of specs) {
    const dataType = s.dataType ?? DataType.FLOAT
    const elementBytes = ELEMENT_BYTES[dataType]
    if (elementBytes === undefined) throw new Error(`no external data layout for data type ${dataType}`)
    const length = s.dims.reduce((a, b) => a * b, 1) * elementBytes
    tensors.set(s.name, { name: s.name, dataType, dims: s.dims, location, offset, length })
    offset = align(offset + length)
  }
  return { tensors, totalBytes: offset }
}

function align(n: number): number {
  return Math.ceil(n / DATA_ALIGNMENT) * DATA_ALIGNMENT
}

export function assertLittleEndian(): void {
  if (new Uint8Array(new Float32Array([1]).buffer)[3] !== 0x3f) {
    throw new Error('the model tooling needs a little-endian machine')
  }
}

/**
 * The external data file, written front to back: each tensor's bytes in chunks, in layout order,
 * with the zero padding between tensors written as it is reached. Progress is reported in bytes.
 */
export class DataFileWriter {
  private written = 0
  private readonly zeros = new Uint8Array(DATA_ALIGNMENT)

  private constructor(
    private readonly handle: FileHandle,
    private readonly layout: WeightLayout,
    private readonly onProgress?: (done: number, total: number, label: string) => void,
  ) {}

  static async create(
    file: string,
    layout: WeightLayout,
    onProgress?: (done: number, total: number, label: string) => void,
  ): Promise<DataFileWriter> {
    assertLittleEndian()
    const writer = new DataFileWriter(await open(file, 'w'), layout, onProgress)
    onProgress?.(0, layout.totalBytes, 'weights')
    return writer
  }

  /** Appends the next chunk of tensor `t`; its first chunk must come after the previous tensor's last. */
  async append(t: ExternalTensor, bytes: Uint8Array, label = t.name): Promise<void> {
    if (this.written < t.offset) await this.pad(t.offset)
    if (this.written < t.offset || this.written + bytes.length > t.offset + t.length) {
      throw new Error(`data file: ${t.name} written out of order or past its ${t.length} bytes`)
    }
    // One write may not exceed 2 GiB (a big float32 tensor can): write in pieces.
    for (let at = 0; at < bytes.length; at += MAX_WRITE) {
      const n = Math.min(MAX_WRITE, bytes.length - at)
      await this.handle.write(bytes, at, n, this.written)
      this.written += n
      this.onProgress?.(this.written, this.layout.totalBytes, label)
    }
  }

  /** Pads to the layout's end, reports the last progress and closes the file. */
  async finish(): Promise<void> {
    if (this.written < this.layout.totalBytes) await this.pad(this.layout.totalBytes)
    this.onProgress?.(this.written, this.layout.totalBytes, 'weights')
    await this.close()
  }

  async close(): Promise<void> {
    await this.handle.close()
  }

  private async pad(to: number): Promise<void> {
    while (this.written < to) {
      const n = Math.min(this.zeros.length, to - this.written)
      await this.handle.write(this.zeros, 0, n, this.written)
      this.written += n
    }
  }
}

/** Writes every tensor of `specs` at its place in `layout` (float32, or float16 where the layout
 *  says so: the same values rounded); reports progress in bytes. */
export async function writeWeights(
  file: string,
  specs: WeightSpec[],
  layout: WeightLayout,
  dims: DecoderDims,
  seed: number,
  onProgress?: (done: number, total: number, label: string) => void,
): Promise<void> {
  const out = await DataFileWriter.create(file, layout, onProgress)
  try {
    const buf = new Float32Array(CHUNK)
    for (const s of specs) {
      const t = layout.tensors.get(s.name)!
      const count = t.dims.reduce((a, b) => a * b, 1)
      const fill = valueSource(s, dims, seed)
      for (let start = 0; start < count; start += CHUNK) {
        const n = Math.min(CHUNK, count - start)
        for (let i = 0; i < n; i++) buf[i] = fill(start + i)
        await out.append(t, floatBytes(t.dataType, buf.subarray(0, n)), s.name)
      }
    }
    await out.finish()
  } catch (error) {
    await out.close().catch(() => {})
    throw error
  }
}

/** Element index -> value (called in index order for the random kinds). */
function valueSource(s: WeightSpec, d: DecoderDims, seed: number): (i: number) => number {
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
