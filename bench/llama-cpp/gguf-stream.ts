// A GGUF writer that streams (version 3, little-endian): the header first, from the tensors'
// names, shapes and types alone, then each tensor's bytes appended to the file descriptor as they
// are made, so a model of a gigabyte never sits in memory. The header (and the metadata values'
// types) are the test writer's (test/helpers/gguf-writer.ts); its ggufBytes builds a whole file in
// one Buffer, which is right for the tests' tiny models and wrong here. llama.cpp's reference Q4_0
// quantizer lives beside the test writer too, and is re-exported here for the benchmark's files.

import { closeSync, openSync, writeSync } from 'node:fs'

import { type MetaValue, ggufHeader } from '../../test/helpers/gguf-writer'
import { GGML_TYPES } from '../../ts/modelkit/gguf/ggml-types'

export { Q4_0_BLOCK, quantizeQ4_0 } from '../../test/helpers/gguf-writer'

/** A tensor as the header describes it; its bytes come later, through GgufStream.append. */
export interface TensorHeader {
  name: string
  /** ggml order: dims[0] is the row length. */
  dims: number[]
  type: number
}

const ALIGNMENT = 32
/** Bytes of a tensor of this shape and type. */
export function tensorBytes(t: TensorHeader): number {
  const geometry = GGML_TYPES.get(t.type)
  if (geometry === undefined) throw new Error(`unknown ggml type ${t.type}`)
  return (t.dims.reduce((a, b) => a * b, 1) / geometry.blockSize) * geometry.typeSize
}

const aligned = (n: number) => Math.ceil(n / ALIGNMENT) * ALIGNMENT

/**
 * One GGUF file being written: the header at open, then every tensor's bytes in header order
 * (append may be called several times per tensor; `next` moves to the following tensor, padding
 * to the alignment). `close` checks every tensor got exactly its bytes.
 */
export class GgufStream {
  private readonly fd: number
  private readonly sizes: number[]
  private tensor = 0
  private written = 0
  private position: number

  constructor(path: string, metadata: Array<[string, MetaValue]>, tensors: TensorHeader[]) {
    this.sizes = tensors.map(tensorBytes)
    const { header: bytes } = ggufHeader(metadata, tensors.map((t, i) => ({ ...t, bytes: this.sizes[i]! })), ALIGNMENT)
    this.fd = openSync(path, 'w')
    this.position = this.write(bytes, 0)
    this.pad()
  }

  private write(bytes: Uint8Array, at: number): number {
    let done = 0
    while (done < bytes.length) done += writeSync(this.fd, bytes, done, bytes.length - done, at + done)
    return at + bytes.length
  }

  private pad(): void {
    const zeros = aligned(this.position) - this.position
    if (zeros > 0) this.position = this.write(new Uint8Array(zeros), this.position)
  }

  /** More bytes of the current tensor. */
  append(bytes: Uint8Array): void {
    if (this.written + bytes.length > this.sizes[this.tensor]!) throw new Error(`tensor ${this.tensor} gets more than its ${this.sizes[this.tensor]} bytes`)
    this.position = this.write(bytes, this.position)
    this.written += bytes.length
  }

  /** The current tensor is complete: pad to the alignment and move on. */
  next(): void {
    if (this.written !== this.sizes[this.tensor]) throw new Error(`tensor ${this.tensor} got ${this.written} of its ${this.sizes[this.tensor]} bytes`)
    this.tensor++
    this.written = 0
    this.pad()
  }

  close(): void {
    closeSync(this.fd)
    if (this.tensor !== this.sizes.length) throw new Error(`the file got ${this.tensor} of its ${this.sizes.length} tensors`)
  }
}
