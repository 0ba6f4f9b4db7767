// The mixture-of-experts block (ts/modelkit/moe.ts) with its weights planned from a GGUF layer
// (ts/modelkit/gguf/experts.ts), alone in a one-block ONNX model run by onnxruntime-node, against
// llama.cpp's routing and experts in float64 (test/reference/moe.ts) over the same GGUF tensors:
// float32 and 4-bit weights, renormalized and not, batches of several tokens in both input forms
// ([batch, sequence, hidden] and [tokens, hidden]).
//
// Routing ties: ONNX's TopK takes the lower index first among equal probabilities, llama.cpp's
// std::sort leaves their order unspecified, so the two may choose different experts on a tie (and
// float32 rounding can turn a near tie either way). The tokens are drawn until the k-th
// probability exceeds the next by a relative margin far above float32's rounding, so every
// choice here is the same in both.

import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { DataType, type Dim, GraphBuilder } from '../../ts/modelkit/onnx-builder'
import { type ExpertDims, type ExpertStorage, expertProjectionName, moeFeedForward, routerWeightName } from '../../ts/modelkit/moe'
import { dequantize } from '../../ts/modelkit/gguf/dequantize'
import { expertSources, expertTensorNames, planExperts, readExpertDims } from '../../ts/modelkit/gguf/experts'
import { GgmlTypeId, type GgmlTypeName } from '../../ts/modelkit/gguf/ggml-types'
import { int4Value, mapsExactly, packInt4 } from '../../ts/modelkit/gguf/int4'
import { GgufData, type GgufFile, readGguf } from '../../ts/modelkit/gguf/reader'
import { DataFileWriter, layoutWeights } from '../../ts/modelkit/weights'
import type { PlannedTensor } from '../../ts/modelkit/gguf/tensors'
import { type MetaValue, TestRng, randomTensorData, str, u32, writeGguf } from '../helpers/gguf-writer'
import { type MoeReferenceWeights, moeReference, routeToken } from '../reference/moe'

const { onnx } = onnxProto
const DATA_FILE = 'model.onnx.data'
/** The k-th probability exceeds the next by at least this fraction of itself (see the header). */
const ROUTING_MARGIN = 1e-3

interface LayerTypes {
  router: GgmlTypeName
  gate: GgmlTypeName
  up: GgmlTypeName
  down: GgmlTypeName
}

let root: string
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'ortex-moe-'))
})
afterAll(() => {
  rmSync(root, { recursive: true, force: true })
})

function metadata(d: ExpertDims, extra: Array<[string, MetaValue]> = []): Array<[string, MetaValue]> {
  const given = new Map(extra)
  const entries: Array<[string, MetaValue]> = [
    ['general.architecture', str('qwen3moe')],
    ['qwen3moe.embedding_length', u32(d.hiddenSize)],
    ['qwen3moe.expert_count', u32(d.numExperts)],
    ['qwen3moe.expert_used_count', u32(d.numExpertsPerToken)],
    ['qwen3moe.expert_feed_forward_length', u32(d.expertIntermediateSize)],
  ]
  return [...entries.filter(([key]) => !given.has(key)), ...extra]
}

/**
 * A GGUF file with layer 0's router and experts, laid out as llama.cpp's converter writes them.
 * The router's spread gives logits of a few units (routing that depends on the token), the
 * experts' give projections of about unit size.
 */
function writeLayer(path: string, d: ExpertDims, types: LayerTypes, seed: number, extra: Array<[string, MetaValue]> = []): void {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = d
  const rng = new TestRng(seed)
  const names = expertTensorNames(0)
  const tensor = (name: string, dims: number[], type: GgmlTypeName, std: number) => {
    const elements = dims.reduce((a, b) => a * b, 1)
    return { name, dims, type: GgmlTypeId[type], data: randomTensorData(GgmlTypeId[type], elements, std, rng) }
  }
  writeGguf(path, metadata(d, extra), [
    tensor(names.router, [H, E], types.router, 2 / Math.sqrt(H)),
    tensor(names.gate, [H, F, E], types.gate, 1 / Math.sqrt(H)),
    tensor(names.up, [H, F, E], types.up, 1 / Math.sqrt(H)),
    tensor(names.down, [F, H, E], types.down, 1 / Math.sqrt(F)),
  ])
}

/** The weights as the imported block holds them: dequantized, or, for 4-bit blocks of another
 *  type, the values of the requantized blocks. */
function referenceWeights(file: GgufFile, storage: ExpertStorage): MoeReferenceWeights {
  const data = new GgufData(file)
  try {
    const names = expertTensorNames(0)
    const values = (name: string, asBlocks: boolean): Float64Array => {
      const t = file.tensors.find((x) => x.name === name)!
      const K = t.dims[0]!
      const rows = t.elements / K
      if (asBlocks && !mapsExactly(t.type)) {
        const w = packInt4(t.type, rows, K, (n) => data.rows(t, n, 1))
        return Float64Array.from({ length: t.elements }, (_, i) => int4Value(w, rows, K, Math.floor(i / K), i % K))
      }
      const out = new Float32Array(t.elements)
      dequantize(t.type, data.rows(t, 0, rows), t.elements, out)
      return Float64Array.from(out)
    }
    const blocks = storage.kind === 'int4'
    return { router: values(names.router, false), gate: values(names.gate, blocks), up: values(names.up, blocks), down: values(names.down, blocks) }
  } finally {
    data.close()
  }
}

/** The layer's planned tensors written as a data file, and one model per input form. */
async function buildBlock(dir: string, file: GgufFile, d: ExpertDims, storage: ExpertStorage, renormalize: boolean): Promise<{ rows: string; sequences: string; planned: PlannedTensor[] }> {
  const sources = expertSources(file, new Map(file.tensors.map((t) => [t.name, t])), 0, d)
  const planned = planExperts(sources, 'model.layers.0.mlp', d, storage)
  const layout = layoutWeights(planned.flatMap((t) => t.specs), DATA_FILE)
  const data = new GgufData(file)
  const out = await DataFileWriter.create(join(dir, DATA_FILE), layout)
  for (const t of planned) for (const [index, chunk] of t.chunks(data)) await out.append(layout.tensors.get(t.specs[index]!.name)!, chunk)
  await out.finish()
  data.close()
  const model = (name: string, dims: Dim[]): string => {
    const g = new GraphBuilder('moe-block')
    const added = new Set<string>()
    const graph = {
      g,
      w: (weight: string) => {
        const t = layout.tensors.get(weight)
        if (!t) throw new Error(`missing weight ${weight}`)
        if (!added.has(weight)) g.external(t)
        added.add(weight)
        return weight
      },
      has: (weight: string) => layout.tensors.has(weight),
      weightDims: (weight: string) => layout.tensors.get(weight)?.dims ?? [],
    }
    g.input('x', DataType.FLOAT, dims)
    const y = moeFeedForward(graph, 'x', { weights: 'model.layers.0.mlp', nodes: '/model/layers.0/mlp', dims: d, renormalize, storage })
    g.op('Identity', [y], undefined, { name: '/y', outputs: ['y'] })
    g.output('y', DataType.FLOAT, dims)
    const path = join(dir, `${name}.onnx`)
    writeFileSync(path, g.encode({ irVersion: 10, opsets: { '': 21, 'com.microsoft': 1 }, producerName: 'moe.test', producerVersion: '0' }))
    return path
  }
  return { rows: model('rows', ['tokens', d.hiddenSize]), sequences: model('sequences', ['batch', 'sequence', d.hiddenSize]), planned }
}

/** `count` tokens of unit spread whose routing has no near tie (see the header). */
function drawTokens(count: number, w: MoeReferenceWeights, d: ExpertDims, rng: TestRng): Float32Array {
  const H = d.hiddenSize
  const out = new Float32Array(count * H)
  for (let t = 0; t < count; t++) {
    for (;;) {
      const row = Float32Array.from({ length: H }, () => rng.signed() * Math.sqrt(3))
      if (routeToken(Float64Array.from(row), w, d, true).margin >= ROUTING_MARGIN) {
        out.set(row, t * H)
        break
      }
    }
  }
  return out
}

async function run(modelPath: string, x: Float32Array, dims: number[]): Promise<Float32Array> {
  const session = await ort.InferenceSession.create(modelPath, { intraOpNumThreads: 1 })
  try {
    const result = await session.run({ x: new ort.Tensor('float32', x, dims) })
    expect(result.y!.dims).toEqual(dims)
    return result.y!.data as Float32Array
  } finally {
    await session.release()
  }
}

/** max |y - ref| over max(1, max |ref|). */
function relativeError(y: Float32Array, ref: Float64Array): number {
  let diff = 0
  let scale = 1
  for (let i = 0; i < ref.length; i++) {
    diff = Math.max(diff, Math.abs(y[i]! - ref[i]!))
    scale = Math.max(scale, Math.abs(ref[i]!))
  }
  return diff / scale
}

interface Case {
  name: string
  dims: ExpertDims
  types: LayerTypes
  storage: ExpertStorage
  renormalize: boolean
  /** Bound on relativeError. */
  tolerance: number
}

const SMALL: ExpertDims = { hiddenSize: 256, numExperts: 8, numExpertsPerToken: 2, expertIntermediateSize: 64 }
const WIDE: ExpertDims = { hiddenSize: 256, numExperts: 16, numExpertsPerToken: 4, expertIntermediateSize: 256 }
const F32: LayerTypes = { router: 'F32', gate: 'F32', up: 'F32', down: 'F32' }
/** The three 4-bit types int4 keeps exactly, mixed (gate has minimums, up has none). */
const EXACT_4BIT: LayerTypes = { router: 'F32', gate: 'Q4_K', up: 'Q4_0', down: 'Q4_1' }
/** Types int4 requantizes; the router in a type the importer dequantizes. */
const REQUANTIZED: LayerTypes = { router: 'F16', gate: 'F16', up: 'Q8_0', down: 'Q6_K' }
const FLOAT_ACTIVATIONS: ExpertStorage = { kind: 'int4', accuracyLevel: 0 }

const CASES: Case[] = [
  { name: 'fp32, renormalized', dims: SMALL, types: F32, storage: { kind: 'fp32' }, renormalize: true, tolerance: 1e-5 },
  { name: 'fp32, not renormalized', dims: SMALL, types: F32, storage: { kind: 'fp32' }, renormalize: false, tolerance: 1e-5 },
  { name: 'fp32 from quantized types, 16 experts, top 4', dims: WIDE, types: { router: 'Q8_0', gate: 'Q4_K', up: 'Q5_0', down: 'Q6_K' }, storage: { kind: 'fp32' }, renormalize: true, tolerance: 1e-5 },
  { name: 'int4 (Q4_K, Q4_0, Q4_1 exactly), renormalized', dims: SMALL, types: EXACT_4BIT, storage: FLOAT_ACTIVATIONS, renormalize: true, tolerance: 1e-5 },
  { name: 'int4 (Q4_K, Q4_0, Q4_1 exactly), not renormalized', dims: SMALL, types: EXACT_4BIT, storage: FLOAT_ACTIVATIONS, renormalize: false, tolerance: 1e-5 },
  { name: 'int4 requantized, 16 experts, top 4', dims: WIDE, types: REQUANTIZED, storage: FLOAT_ACTIVATIONS, renormalize: true, tolerance: 1e-5 },
  // int8 activations (the int4 default): MatMulNBits rounds each block of the input to 8 bits.
  { name: 'int4 with int8 activations', dims: WIDE, types: { router: 'F32', gate: 'Q4_K', up: 'Q4_K', down: 'Q4_0' }, storage: { kind: 'int4', accuracyLevel: 4 }, renormalize: true, tolerance: 3e-2 },
]

describe('mixture-of-experts block against llama.cpp semantics', () => {
  CASES.forEach((c, index) => {
    it(c.name, async () => {
      const dir = mkdtempSync(join(root, 'case-'))
      const path = join(dir, 'layer.gguf')
      writeLayer(path, c.dims, c.types, 10 + index)
      const file = readGguf(path)
      const w = referenceWeights(file, c.storage)
      const models = await buildBlock(dir, file, c.dims, c.storage, c.renormalize)
      const rng = new TestRng(100 + index)
      const H = c.dims.hiddenSize
      // Several tokens as paged rows, as two sequences of three, and one decode token (most
      // experts then have no rows).
      for (const [model, dims] of [
        [models.rows, [7, H]],
        [models.sequences, [2, 3, H]],
        [models.sequences, [1, 1, H]],
      ] as const) {
        const count = dims.slice(0, -1).reduce((a, b) => a * b, 1)
        const x = drawTokens(count, w, c.dims, rng)
        const y = await run(model, x, [...dims])
        const ref = moeReference(Float64Array.from(x), w, c.dims, c.renormalize)
        expect(relativeError(y, ref), `[${dims}]`).toBeLessThan(c.tolerance)
      }
    })
  })

  it('renormalizing changes the output (the two cases above are not the same computation)', () => {
    const path = join(root, 'renormalize.gguf')
    writeLayer(path, SMALL, F32, 1)
    const w = referenceWeights(readGguf(path), { kind: 'fp32' })
    const x = Float64Array.from(drawTokens(1, w, SMALL, new TestRng(2)))
    const [a, b] = [true, false].map((renormalize) => moeReference(x, w, SMALL, renormalize))
    expect(relativeError(Float32Array.from(a!), b!)).toBeGreaterThan(1e-3)
  })

  it("a token's output does not depend on the other tokens of the batch", async () => {
    const dir = mkdtempSync(join(root, 'batch-'))
    const path = join(dir, 'layer.gguf')
    writeLayer(path, WIDE, EXACT_4BIT, 7)
    const file = readGguf(path)
    const storage: ExpertStorage = { kind: 'int4', accuracyLevel: 4 }
    const w = referenceWeights(file, storage)
    const models = await buildBlock(dir, file, WIDE, storage, true)
    const H = WIDE.hiddenSize
    const x = drawTokens(6, w, WIDE, new TestRng(8))
    const together = await run(models.rows, x, [6, H])
    for (let t = 0; t < 6; t++) {
      const alone = await run(models.rows, x.slice(t * H, (t + 1) * H), [1, H])
      expect(Array.from(alone), `token ${t}`).toEqual(Array.from(together.subarray(t * H, (t + 1) * H)))
    }
  })
})

describe("the block's graph", () => {
  // ONNX Runtime's memory planner searches every freed buffer for each value whose rank it knows
  // (moe.ts): were the experts' values of known rank, a model's load time would grow with the
  // square of its experts. A Transpose over 7 axes after a value makes shape inference refuse the
  // model when it knows that value's rank, so the model with one after every expert's value loads
  // only if it knows none of them.
  it("the experts' values have no rank known before run time (the memory planner skips them)", async () => {
    const dir = mkdtempSync(join(root, 'rank-'))
    const path = join(dir, 'layer.gguf')
    writeLayer(path, SMALL, EXACT_4BIT, 9)
    const models = await buildBlock(dir, readGguf(path), SMALL, FLOAT_ACTIVATIONS, true)
    const probed = (values: (name: string) => boolean): string => {
      const model = onnx.ModelProto.decode(readFileSync(models.sequences))
      const nodes = model.graph!.node!
      const outputs = nodes.flatMap((n) => n.output ?? []).filter(values)
      outputs.forEach((value, i) => {
        nodes.push(onnx.NodeProto.create({ name: `/probe_${i}`, opType: 'Transpose', input: [value], output: [`probe_${i}`], attribute: [{ name: 'perm', type: onnx.AttributeProto.AttributeType.INTS, ints: [6, 5, 4, 3, 2, 1, 0] }] }))
        model.graph!.output!.push(onnx.ValueInfoProto.create({ name: `probe_${i}`, type: { tensorType: { elemType: DataType.FLOAT } } }))
      })
      expect(outputs.length).toBeGreaterThan(0)
      const out = join(dir, `probed-${outputs.length}.onnx`)
      writeFileSync(out, onnx.ModelProto.encode(model).finish())
      return out
    }
    const perExpert = probed((name) => /\/experts\.\d+\//.test(name))
    await (await ort.InferenceSession.create(perExpert)).release()
    // The probe itself: a value of known rank (the router's probabilities) is refused.
    await expect(ort.InferenceSession.create(probed((name) => name.endsWith('/router/Softmax/output_0')))).rejects.toThrow(/perm/)
  })
})

describe('expert weights from a GGUF layer', () => {
  it('one gate_up and one down projection per expert, under the layer prefix', async () => {
    const path = join(root, 'names.gguf')
    writeLayer(path, SMALL, EXACT_4BIT, 3)
    const file = readGguf(path)
    const sources = expertSources(file, new Map(file.tensors.map((t) => [t.name, t])), 0, SMALL)
    const p = 'model.layers.0.mlp'
    const [router, gateUp, up, down] = planExperts(sources, p, SMALL, FLOAT_ACTIVATIONS)
    expect(router!.specs).toEqual([{ name: routerWeightName(p), dims: [256, 8] }])
    expect(gateUp!.specs.slice(0, 4)).toEqual([
      { name: `${expertProjectionName(p, 0, 'gate_up_proj')}.qweight`, dims: [128, 8, 16], dataType: DataType.UINT8 },
      { name: `${expertProjectionName(p, 0, 'gate_up_proj')}.scales`, dims: [128, 8] },
      { name: `${expertProjectionName(p, 0, 'gate_up_proj')}.qzeros`, dims: [128, 4], dataType: DataType.UINT8 },
      { name: `${expertProjectionName(p, 0, 'gate_up_proj')}.mins`, dims: [8, 128] },
    ])
    expect(gateUp!.specs).toHaveLength(8 * 4)
    // The up tensor's rows travel with the gate's; it is listed for the tally only.
    expect(up!.specs).toEqual([])
    expect([gateUp!.mapping, up!.mapping, down!.mapping]).toEqual(['exact', 'exact', 'exact'])
    expect([up!.source!.name, down!.source!.name]).toEqual(['blk.0.ffn_up_exps.weight', 'blk.0.ffn_down_exps.weight'])
    expect(down!.specs.slice(0, 4).map((s) => [s.name.slice(p.length), s.dims])).toEqual([
      ['.experts.0.down_proj.qweight', [256, 2, 16]],
      ['.experts.0.down_proj.scales', [256, 2]],
      ['.experts.0.down_proj.qzeros', [256, 1]],
      ['.experts.0.down_proj.mins', [2, 256]],
    ])
    const fp32 = planExperts(sources, p, SMALL, { kind: 'fp32' })
    expect(fp32.flatMap((t) => t.specs).slice(1, 2)).toEqual([{ name: `${p}.experts.0.gate_up_proj.weight`, dims: [256, 128] }])
    expect(fp32[3]!.specs[7]).toEqual({ name: `${p}.experts.7.down_proj.weight`, dims: [64, 256] })
  })

  it('reads the sizes from the metadata, or refuses what it does not support', () => {
    const at = (name: string, extra: Array<[string, MetaValue]>) => {
      const path = join(root, `${name}.gguf`)
      writeGguf(path, metadata(SMALL, extra), [])
      return readGguf(path)
    }
    expect(readExpertDims(at('plain', []), 'qwen3moe', 256)).toEqual(SMALL)
    // Without expert_feed_forward_length, llama.cpp divides feed_forward_length by the experts used.
    const derived = at('derived', [['qwen3moe.feed_forward_length', u32(256)]])
    const withoutLength = { ...derived, metadata: new Map([...derived.metadata].filter(([key]) => key !== 'qwen3moe.expert_feed_forward_length')) }
    expect(readExpertDims(withoutLength, 'qwen3moe', 256).expertIntermediateSize).toBe(128)
    expect(() => readExpertDims(at('used', [['qwen3moe.expert_used_count', u32(9)]]), 'qwen3moe', 256)).toThrow(/expert_used_count is 9: expected 1 to 8/)
    expect(() => readExpertDims(at('groups', [['qwen3moe.expert_group_count', u32(4)]]), 'qwen3moe', 256)).toThrow(/routing within groups of experts is not supported/)
    expect(() => readExpertDims(at('many', [['qwen3moe.expert_count', u32(2048)]]), 'qwen3moe', 256)).toThrow(/expected 1 to 1024 experts/)
  })

  it('refuses expert tensors of the wrong shape, and rows that are not whole blocks for int4', () => {
    const path = join(root, 'shape.gguf')
    writeLayer(path, SMALL, F32, 4)
    const file = readGguf(path)
    const tensors = new Map(file.tensors.map((t) => [t.name, t]))
    expect(() => expertSources(file, tensors, 0, { ...SMALL, expertIntermediateSize: 32 })).toThrow(/blk\.0\.ffn_gate_exps\.weight has the shape \[256,64,8\], expected \[256,32,8\]/)
    expect(() => expertSources(file, tensors, 1, SMALL)).toThrow(/the tensor "blk\.1\.ffn_gate_inp\.weight" is missing/)
    const odd: ExpertDims = { hiddenSize: 48, numExperts: 2, numExpertsPerToken: 1, expertIntermediateSize: 32 }
    const oddPath = join(root, 'odd.gguf')
    writeLayer(oddPath, odd, F32, 5)
    const oddFile = readGguf(oddPath)
    const sources = expertSources(oddFile, new Map(oddFile.tensors.map((t) => [t.name, t])), 0, odd)
    expect(() => planExperts(sources, 'p', odd, FLOAT_ACTIVATIONS)).toThrow(/rows of 48 elements cannot be 4-bit blocks of 32/)
    expect(planExperts(sources, 'p', odd, { kind: 'fp32' })).toHaveLength(4)
  })

  it('the block refuses float16 arithmetic and a router of the wrong shape', () => {
    const g = new GraphBuilder('refusals')
    const dims = new Map([[routerWeightName('p'), [256, 8]]])
    const graph = { g, w: (name: string) => name, has: (name: string) => dims.has(name), weightDims: (name: string) => dims.get(name) ?? [] }
    const block = { weights: 'p', nodes: '/p', dims: SMALL, renormalize: true, storage: { kind: 'fp32' } as const }
    expect(() => moeFeedForward({ ...graph, computeType: DataType.FLOAT16 }, 'x', block)).toThrow(/float32 only/)
    expect(() => moeFeedForward(graph, 'x', { ...block, dims: { ...SMALL, numExperts: 4 } })).toThrow(/p\.gate\.weight has the shape \[256,8\], expected \[256,4\]/)
    expect(() => moeFeedForward(graph, 'x', { ...block, dims: { ...SMALL, numExpertsPerToken: 9 } })).toThrow(/9 experts per token of 8 experts/)
  })
})
