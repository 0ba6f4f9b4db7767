// A small ONNX graph builder over the protobufjs classes of the npm package `onnx-proto`.
// Weights are never held here: initializers point into an external data file (ONNX "external
// data": location / offset / length), which the generator streams to disk separately.

import onnxProto from 'onnx-proto'
import type { onnx as P } from 'onnx-proto'
import { toHalfArray } from './half'

const { onnx } = onnxProto

export const DataType = {
  FLOAT: 1,
  UINT8: 2,
  INT32: 6,
  INT64: 7,
  BOOL: 9,
  FLOAT16: 10,
} as const
export type DataTypeCode = (typeof DataType)[keyof typeof DataType]

/** A dimension: a fixed size or a symbolic name. */
export type Dim = number | string

/** Typed attribute values (ONNX needs the type; a JS number alone is ambiguous). */
export type Attr =
  | { kind: 'float'; value: number }
  | { kind: 'int'; value: number }
  | { kind: 'ints'; value: number[] }
  | { kind: 'string'; value: string }
  | { kind: 'tensor'; value: P.ITensorProto }

export const F = (value: number): Attr => ({ kind: 'float', value })
export const I = (value: number): Attr => ({ kind: 'int', value })
export const Is = (value: number[]): Attr => ({ kind: 'ints', value })
export const S = (value: string): Attr => ({ kind: 'string', value })

export interface ExternalTensor {
  name: string
  dataType: DataTypeCode
  dims: number[]
  /** File name relative to the model file. */
  location: string
  offset: number
  length: number
}

export interface NodeOptions {
  /** Node name; defaults to a numbered name from the op type. */
  name?: string
  /** Number of outputs (named `<node name>/output_<i>`) or explicit output names. */
  outputs?: number | string[]
  attrs?: Record<string, Attr>
  domain?: string
}

export class GraphBuilder {
  private readonly nodes: P.INodeProto[] = []
  private readonly initializers: P.ITensorProto[] = []
  private readonly inputs: P.IValueInfoProto[] = []
  private readonly outputs: P.IValueInfoProto[] = []
  private readonly constants = new Map<string, string>()
  private readonly names = new Set<string>()
  private counter = 0

  constructor(readonly graphName: string) {}

  input(name: string, dataType: DataTypeCode, dims: Dim[]): string {
    this.inputs.push(valueInfo(name, dataType, dims))
    return name
  }

  output(name: string, dataType: DataTypeCode, dims: Dim[]): string {
    this.outputs.push(valueInfo(name, dataType, dims))
    return name
  }

  /** Adds a node; returns its output names. */
  node(opType: string, inputs: string[], options: NodeOptions = {}): string[] {
    const name = options.name ?? `/${opType}_${this.counter++}`
    if (this.names.has(name)) throw new Error(`duplicate node name ${name}`)
    this.names.add(name)
    const outputs =
      typeof options.outputs === 'object'
        ? options.outputs
        : Array.from({ length: options.outputs ?? 1 }, (_, i) => `${name}/output_${i}`)
    const attribute = Object.entries(options.attrs ?? {}).map(([attrName, a]) => attribute_(attrName, a))
    this.nodes.push(
      onnx.NodeProto.create({
        name,
        opType,
        input: inputs,
        output: outputs,
        attribute,
        ...(options.domain ? { domain: options.domain } : {}),
      }),
    )
    return outputs
  }

  /** Adds a single-output node; returns the output name. */
  op(opType: string, inputs: string[], attrs?: Record<string, Attr>, options: Omit<NodeOptions, 'attrs'> = {}): string {
    return this.node(opType, inputs, { ...options, attrs })[0]!
  }

  /** An int64 constant initializer (deduplicated). Scalar when `dims` is []. */
  int64(values: number[], dims: number[] = [values.length]): string {
    const key = `i64:${dims.join('x')}:${values.join(',')}`
    let name = this.constants.get(key)
    if (!name) {
      name = `/constants/INT64/${dims.length ? `[${values.join(',')}]` : values[0]}`
      const raw = new BigInt64Array(values.map((v) => BigInt(v)))
      this.initializers.push(
        onnx.TensorProto.create({ name, dataType: DataType.INT64, dims, rawData: new Uint8Array(raw.buffer) }),
      )
      this.constants.set(key, name)
    }
    return name
  }

  /** A float32 constant initializer (deduplicated). Scalar when `dims` is []. */
  float(values: number[], dims: number[] = [values.length]): string {
    const key = `f32:${dims.join('x')}:${values.join(',')}`
    let name = this.constants.get(key)
    if (!name) {
      name = `/constants/FLOAT/${dims.length ? `[${values.join(',')}]` : values[0]}`
      const raw = new Float32Array(values)
      this.initializers.push(
        onnx.TensorProto.create({ name, dataType: DataType.FLOAT, dims, rawData: new Uint8Array(raw.buffer) }),
      )
      this.constants.set(key, name)
    }
    return name
  }

  /** A float16 constant initializer (deduplicated). Scalar when `dims` is []. */
  half(values: number[], dims: number[] = [values.length]): string {
    const key = `f16:${dims.join('x')}:${values.join(',')}`
    let name = this.constants.get(key)
    if (!name) {
      name = `/constants/FLOAT16/${dims.length ? `[${values.join(',')}]` : values[0]}`
      const raw = toHalfArray(values)
      this.initializers.push(
        onnx.TensorProto.create({ name, dataType: DataType.FLOAT16, dims, rawData: new Uint8Array(raw.buffer) }),
      )
      this.constants.set(key, name)
    }
    return name
  }

  /** An initializer whose bytes live in an external data file. */
  external(t: ExternalTensor): string {
    this.initializers.push(
      onnx.TensorProto.create({
        name: t.name,
        dataType: t.dataType,
        dims: t.dims,
        dataLocation: onnx.TensorProto.DataLocation.EXTERNAL,
        externalData: [
          { key: 'location', value: t.location },
          { key: 'offset', value: String(t.offset) },
          { key: 'length', value: String(t.length) },
        ],
      }),
    )
    return t.name
  }

  /** Serializes the model. */
  encode(options: {
    irVersion: number
    opsets: Record<string, number>
    producerName: string
    producerVersion: string
    metadata?: Record<string, string>
  }): Uint8Array {
    const model = onnx.ModelProto.create({
      irVersion: options.irVersion,
      producerName: options.producerName,
      producerVersion: options.producerVersion,
      opsetImport: Object.entries(options.opsets).map(([domain, version]) => ({ domain, version })),
      metadataProps: Object.entries(options.metadata ?? {}).map(([key, value]) => ({ key, value })),
      graph: onnx.GraphProto.create({
        name: this.graphName,
        node: this.nodes,
        initializer: this.initializers,
        input: this.inputs,
        output: this.outputs,
      }),
    })
    return onnx.ModelProto.encode(model).finish()
  }
}

function valueInfo(name: string, elemType: DataTypeCode, dims: Dim[]): P.IValueInfoProto {
  return onnx.ValueInfoProto.create({
    name,
    type: {
      tensorType: {
        elemType,
        shape: { dim: dims.map((d) => (typeof d === 'number' ? { dimValue: d } : { dimParam: d })) },
      },
    },
  })
}

function attribute_(name: string, a: Attr): P.IAttributeProto {
  const T = onnx.AttributeProto.AttributeType
  switch (a.kind) {
    case 'float':
      return { name, type: T.FLOAT, f: a.value }
    case 'int':
      return { name, type: T.INT, i: a.value }
    case 'ints':
      return { name, type: T.INTS, ints: a.value }
    case 'string':
      return { name, type: T.STRING, s: new TextEncoder().encode(a.value) }
    case 'tensor':
      return { name, type: T.TENSOR, t: a.value }
  }
}
