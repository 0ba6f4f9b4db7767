// One mixture-of-experts block alone in an ONNX model, timed per call in onnxruntime-node at 1 and
// 16 rows: ts/modelkit/moe.ts (each expert on the rows routed to it) in float32 and in 4-bit
// blocks, against what ONNX Runtime offers instead: its fused com.microsoft.MoE (float32) and
// com.microsoft.QMoE (4-bit blocks of 32), and every expert on every row (three MatMulNBits over
// all experts' weights, the experts a row did not choose weighted zero). Every variant reads the
// same random GGUF layer (Q4_0 experts, which QMoE represents exactly; Q4_K for the block's
// minimum path), and its output is compared with the float32 block's.
//
//   npx esbuild bench/moe-block.ts --bundle --platform=node --format=esm --external:onnxruntime-node \
//     --outfile=bench/out/moe-block.mjs && node bench/out/moe-block.mjs [--threads N] [--quick]
//
// Output: a table on stdout and bench/out/moe-block.json. Results: docs/performance.md
// ("A mixture-of-experts block on the CPU").

import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { TestRng, randomTensorData, str, u32, writeGguf } from '../test/helpers/gguf-writer'
import { dequantize } from '../ts/modelkit/gguf/dequantize'
import { type ExpertSources, expertSources, expertTensorNames, planExperts } from '../ts/modelkit/gguf/experts'
import { GgmlTypeId } from '../ts/modelkit/gguf/ggml-types'
import { packInt4 } from '../ts/modelkit/gguf/int4'
import { GgufData, type GgufFile, readGguf } from '../ts/modelkit/gguf/reader'
import type { PlannedTensor } from '../ts/modelkit/gguf/tensors'
import { type ExpertDims, type ExpertStorage, moeFeedForward, routerWeightName } from '../ts/modelkit/moe'
import { DataType, GraphBuilder, I, S } from '../ts/modelkit/onnx-builder'
import { DataFileWriter, type TensorSpec, layoutWeights } from '../ts/modelkit/weights'

const { values: args } = parseArgs({ options: { threads: { type: 'string', default: '1' }, quick: { type: 'boolean', default: false } } })
const THREADS = Number(args.threads)
const SECONDS_PER_ROW = args.quick ? 0.5 : 2
const ROWS = [1, 16]
/** Scaled-down shapes of the two common ratios: Mixtral-like 8 experts, top 2; Qwen3-MoE's 128, top 8. */
const SHAPES: ExpertDims[] = [
  { hiddenSize: 1024, numExperts: 8, numExpertsPerToken: 2, expertIntermediateSize: 768 },
  { hiddenSize: 1024, numExperts: 128, numExpertsPerToken: 8, expertIntermediateSize: 512 },
]
const PREFIX = 'model.layers.0.mlp'

/** A variant: its data file's tensors and its graph over x [rows, H] -> y. */
interface Variant {
  name: string
  planned: (sources: ExpertSources, d: ExpertDims) => PlannedTensor[]
  graph: (g: GraphBuilder, w: Weights, d: ExpertDims) => string
}

interface Weights {
  w: (name: string) => string
  has: (name: string) => boolean
  weightDims: (name: string) => number[]
}

const block = (storage: ExpertStorage): Pick<Variant, 'planned' | 'graph'> => ({
  planned: (sources, d) => planExperts(sources, PREFIX, d, storage),
  graph: (g, w, d) => moeFeedForward({ g, ...w }, 'x', { weights: PREFIX, nodes: '/mlp', dims: d, renormalize: true, storage }),
})

async function main(): Promise<void> {
  const root = mkdtempSync(join(tmpdir(), 'ortex-moe-bench-'))
  const results: Array<Record<string, unknown>> = []
  try {
    for (const d of SHAPES) {
      console.log(`\nE=${d.numExperts} k=${d.numExpertsPerToken} H=${d.hiddenSize} F=${d.expertIntermediateSize}, ${THREADS} thread(s): ms per call`)
      console.log(`${'variant'.padEnd(38)}${ROWS.map((r) => `${r} row${r > 1 ? 's' : ''}`.padStart(10)).join('')}${'load ms'.padStart(10)}   max |diff| / max |y|`)
      const layers = { Q4_0: writeLayer(root, d, 'Q4_0'), Q4_K: writeLayer(root, d, 'Q4_K') }
      const inputs = ROWS.map((rows) => Array.from({ length: 8 }, (_, i) => randomRows(rows, d.hiddenSize, 1000 * rows + i)))
      let baseline: Float32Array[] | undefined
      for (const v of variants()) {
        const file = v.name.includes('Q4_K') ? layers.Q4_K : layers.Q4_0
        const model = await writeModel(root, file, d, v)
        const { ms, outputs, createMs } = await time(model, inputs, d.hiddenSize)
        baseline ??= outputs
        // The Q4_K layer has other weights: its accuracy is test/model/moe.test.ts's to check.
        const diff = file === layers.Q4_0 ? Math.max(...outputs.map((y, i) => relativeDiff(y, baseline![i]!))) : undefined
        console.log(`${v.name.padEnd(38)}${ms.map((t) => t.toFixed(3).padStart(10)).join('')}${createMs.toFixed(0).padStart(10)}   ${diff?.toExponential(1) ?? '-'}`)
        results.push({ ...d, threads: THREADS, variant: v.name, msPerCall: Object.fromEntries(ROWS.map((r, i) => [r, ms[i]])), sessionCreateMs: createMs, maxRelativeDiff: diff ?? null })
        rmSync(dirname(model), { recursive: true, force: true })
      }
    }
    results.push(...(await loadScaling(root)))
  } finally {
    rmSync(root, { recursive: true, force: true })
  }
  // Run from bench/out (the bundle) or bench/ (the source): the report goes to bench/out.
  const here = dirname(fileURLToPath(import.meta.url))
  const out = here.endsWith('out') ? here : resolve(here, 'out')
  mkdirSync(out, { recursive: true })
  writeFileSync(join(out, 'moe-block.json'), JSON.stringify(results, null, 2) + '\n')
  console.log(`wrote ${join(out, 'moe-block.json')}`)
}

/**
 * Session creation of L blocks one after another (each block's output is the next one's input),
 * int4 Q4_0 and Q4_K, with narrow rows so that the graph, not the weights, is what loads: how it
 * grows with L (moe.ts keeps ONNX Runtime's memory planner from growing with the square of it).
 */
async function loadScaling(root: string): Promise<Array<Record<string, unknown>>> {
  const d: ExpertDims = { hiddenSize: 256, numExperts: 128, numExpertsPerToken: 8, expertIntermediateSize: 256 }
  const storage: ExpertStorage = { kind: 'int4', accuracyLevel: 4 }
  const rows: Array<Record<string, unknown>> = []
  console.log(`\nsession creation of L stacked blocks, E=${d.numExperts} k=${d.numExpertsPerToken} H=${d.hiddenSize} F=${d.expertIntermediateSize}, int4`)
  for (const type of ['Q4_0', 'Q4_K'] as const) {
    const file = writeLayer(root, d, type)
    const sources = expertSources(file, new Map(file.tensors.map((t) => [t.name, t])), 0, d)
    for (const L of args.quick ? [1, 4] : [1, 4, 16]) {
      const prefixes = Array.from({ length: L }, (_, l) => `model.layers.${l}.mlp`)
      const variant: Variant = {
        name: `${L} blocks ${type}`,
        planned: () => prefixes.flatMap((p) => planExperts(sources, p, d, storage)),
        graph: (g, w) => prefixes.reduce((x, p, l) => moeFeedForward({ g, ...w }, x, { weights: p, nodes: `/layers.${l}/mlp`, dims: d, renormalize: true, storage }), 'x'),
      }
      const model = await writeModel(root, file, d, variant)
      const { createMs } = await time(model, [[randomRows(1, d.hiddenSize, 1)]], d.hiddenSize)
      console.log(`${variant.name.padEnd(38)}${createMs.toFixed(0).padStart(10)} ms`)
      rows.push({ ...d, layers: L, type, sessionCreateMs: createMs })
      rmSync(dirname(model), { recursive: true, force: true })
    }
  }
  return rows
}

function variants(): Variant[] {
  return [
    { name: 'block fp32', ...block({ kind: 'fp32' }) },
    { name: 'com.microsoft.MoE fp32', planned: fusedFp32, graph: fusedGraph('MoE') },
    { name: 'block int4 Q4_0, int8 activations', ...block({ kind: 'int4', accuracyLevel: 4 }) },
    { name: 'block int4 Q4_0, fp32 activations', ...block({ kind: 'int4', accuracyLevel: 0 }) },
    { name: 'block int4 Q4_K, int8 activations', ...block({ kind: 'int4', accuracyLevel: 4 }) },
    { name: 'com.microsoft.QMoE Q4_0', planned: fusedQ4_0, graph: fusedGraph('QMoE') },
    { name: 'every expert, Q4_0, int8 activations', planned: denseQ4_0, graph: denseGraph },
  ]
}

/** A GGUF layer: an F32 router of logits of a few units, experts of `type` with unit outputs. */
function writeLayer(root: string, d: ExpertDims, type: 'Q4_0' | 'Q4_K'): GgufFile {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = d
  const rng = new TestRng(d.numExperts)
  const names = expertTensorNames(0)
  const tensor = (name: string, dims: number[], t: number, std: number) => ({ name, dims, type: t, data: randomTensorData(t, dims.reduce((a, b) => a * b, 1), std, rng) })
  const path = join(root, `layer-${E}-${type}.gguf`)
  writeGguf(path, [['general.architecture', str('qwen3moe')], ['qwen3moe.expert_count', u32(E)]], [
    tensor(names.router, [H, E], GgmlTypeId.F32, 2 / Math.sqrt(H)),
    tensor(names.gate, [H, F, E], GgmlTypeId[type], 1 / Math.sqrt(H)),
    tensor(names.up, [H, F, E], GgmlTypeId[type], 1 / Math.sqrt(H)),
    tensor(names.down, [F, H, E], GgmlTypeId[type], 1 / Math.sqrt(F)),
  ])
  return readGguf(path)
}

async function writeModel(root: string, file: GgufFile, d: ExpertDims, v: Variant): Promise<string> {
  const dir = mkdtempSync(join(root, 'model-'))
  const sources = expertSources(file, new Map(file.tensors.map((t) => [t.name, t])), 0, d)
  const planned = v.planned(sources, d)
  const layout = layoutWeights(planned.flatMap((t) => t.specs), 'model.onnx.data')
  const data = new GgufData(file)
  const out = await DataFileWriter.create(join(dir, 'model.onnx.data'), layout)
  for (const t of planned) for (const [index, chunk] of t.chunks(data)) await out.append(layout.tensors.get(t.specs[index]!.name)!, chunk)
  await out.finish()
  data.close()
  const g = new GraphBuilder('moe-bench')
  const added = new Set<string>()
  const weights: Weights = {
    w: (name) => {
      const t = layout.tensors.get(name)
      if (!t) throw new Error(`missing weight ${name}`)
      if (!added.has(name)) g.external(t)
      added.add(name)
      return name
    },
    has: (name) => layout.tensors.has(name),
    weightDims: (name) => layout.tensors.get(name)?.dims ?? [],
  }
  g.input('x', DataType.FLOAT, ['rows', d.hiddenSize])
  g.op('Identity', [v.graph(g, weights, d)], undefined, { name: '/y', outputs: ['y'] })
  g.output('y', DataType.FLOAT, ['rows', d.hiddenSize])
  const path = join(dir, 'model.onnx')
  writeFileSync(path, g.encode({ irVersion: 10, opsets: { '': 21, 'com.microsoft': 1 }, producerName: 'moe-block bench', producerVersion: '0' }))
  return path
}

/** Median ms per call for each row count (8 different inputs in turn), and the first input's outputs. */
async function time(modelPath: string, inputs: Float32Array[][], H: number): Promise<{ ms: number[]; outputs: Float32Array[]; createMs: number }> {
  const created = performance.now()
  const session = await ort.InferenceSession.create(modelPath, {
    intraOpNumThreads: THREADS,
    extra: { session: { intra_op: { allow_spinning: '0' } } },
  })
  const createMs = performance.now() - created
  const ms: number[] = []
  const outputs: Float32Array[] = []
  for (const batch of inputs) {
    const feeds = batch.map((x) => ({ x: new ort.Tensor('float32', x, [x.length / H, H]) }))
    for (const f of feeds.slice(0, 2)) await session.run(f)
    const times: number[] = []
    const start = performance.now()
    while (times.length < 5 || (performance.now() - start < SECONDS_PER_ROW * 1000 && times.length < 500)) {
      const t0 = performance.now()
      await session.run(feeds[times.length % feeds.length]!)
      times.push(performance.now() - t0)
    }
    times.sort((a, b) => a - b)
    ms.push(times[times.length >> 1]!)
    outputs.push((await session.run(feeds[0]!)).y!.data as Float32Array)
  }
  await session.release()
  return { ms, outputs, createMs }
}

function randomRows(rows: number, H: number, seed: number): Float32Array {
  const rng = new TestRng(seed)
  return Float32Array.from({ length: rows * H }, () => rng.signed() * Math.sqrt(3))
}

function relativeDiff(y: Float32Array, ref: Float32Array): number {
  let diff = 0
  let scale = 0
  for (let i = 0; i < ref.length; i++) {
    diff = Math.max(diff, Math.abs(y[i]! - ref[i]!))
    scale = Math.max(scale, Math.abs(ref[i]!))
  }
  return diff / scale
}

// ---------------------------------------------------------------------------------------------
// The alternatives' weights and graphs.

function floatBytes(values: Float32Array): Uint8Array {
  return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
}

/** Expert e's N rows of t (rows e N ..), dequantized: [N, K]. */
function expertRows(data: GgufData, t: ExpertSources['gate'], e: number, N: number): Float32Array {
  const K = t.dims[0]!
  const out = new Float32Array(N * K)
  dequantize(t.type, data.rows(t, e * N, N), N * K, out)
  return out
}

/** The block's router tensor, shared by every variant. */
function routerOnly(sources: ExpertSources, d: ExpertDims): PlannedTensor {
  return planExperts(sources, PREFIX, d, { kind: 'fp32' })[0]!
}

/** com.microsoft.MoE's float32 weights: fc1 [E, 2F, H] with gate and up rows interleaved
 *  (swiglu_fusion 1, the only form its CPU kernel takes), fc2 [E, H, F]. */
function fusedFp32(sources: ExpertSources, d: ExpertDims): PlannedTensor[] {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = d
  return [
    routerOnly(sources, d),
    {
      specs: [{ name: 'fc1', dims: [E, 2 * F, H] }, { name: 'fc2', dims: [E, H, F] }],
      *chunks(data) {
        const rows = new Float32Array(2 * F * H)
        for (let e = 0; e < E; e++) {
          const gate = expertRows(data, sources.gate, e, F)
          const up = expertRows(data, sources.up, e, F)
          for (let f = 0; f < F; f++) {
            rows.set(gate.subarray(f * H, (f + 1) * H), 2 * f * H)
            rows.set(up.subarray(f * H, (f + 1) * H), (2 * f + 1) * H)
          }
          yield [0, floatBytes(rows)]
        }
        for (let e = 0; e < E; e++) yield [1, floatBytes(expertRows(data, sources.down, e, H))]
      },
    },
  ]
}

/** Expert e's rows of a Q4_0 tensor as MatMulNBits / QMoE blocks (zero point 8, QMoE's default). */
function q4_0Blocks(data: GgufData, t: ExpertSources['gate'], e: number, N: number) {
  if (t.type !== GgmlTypeId.Q4_0) throw new Error('these variants take Q4_0 experts')
  const K = t.dims[0]!
  const bytes = data.rows(t, e * N, N)
  const rowBytes = bytes.length / N
  return packInt4(t.type, N, K, (n) => bytes.subarray(n * rowBytes, (n + 1) * rowBytes))
}

/** com.microsoft.QMoE's 4-bit weights: fc1 [E, 2F, H/2] (gate and up rows interleaved) and its
 *  scales [E, 2F, H/32], fc2 [E, H, F/2] and scales [E, H, F/32]; no zero points (8). */
function fusedQ4_0(sources: ExpertSources, d: ExpertDims): PlannedTensor[] {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = d
  const specs: TensorSpec[] = [
    { name: 'fc1', dims: [E, 2 * F, H / 2], dataType: DataType.UINT8 },
    { name: 'fc1_scales', dims: [E, 2 * F, H / 32] },
    { name: 'fc2', dims: [E, H, F / 2], dataType: DataType.UINT8 },
    { name: 'fc2_scales', dims: [E, H, F / 32] },
  ]
  return [
    routerOnly(sources, d),
    {
      specs,
      *chunks(data) {
        const interleaved = (e: number) => {
          const gate = q4_0Blocks(data, sources.gate, e, F)
          const up = q4_0Blocks(data, sources.up, e, F)
          const q = new Uint8Array(2 * F * (H / 2))
          const s = new Float32Array(2 * F * (H / 32))
          for (let f = 0; f < F; f++) {
            q.set(gate.qweight.subarray(f * (H / 2), (f + 1) * (H / 2)), 2 * f * (H / 2))
            q.set(up.qweight.subarray(f * (H / 2), (f + 1) * (H / 2)), (2 * f + 1) * (H / 2))
            s.set(gate.scales.subarray(f * (H / 32), (f + 1) * (H / 32)), 2 * f * (H / 32))
            s.set(up.scales.subarray(f * (H / 32), (f + 1) * (H / 32)), (2 * f + 1) * (H / 32))
          }
          return { q, s }
        }
        for (let e = 0; e < E; e++) yield [0, interleaved(e).q]
        for (let e = 0; e < E; e++) yield [1, floatBytes(interleaved(e).s)]
        for (let e = 0; e < E; e++) yield [2, q4_0Blocks(data, sources.down, e, H).qweight]
        for (let e = 0; e < E; e++) yield [3, floatBytes(q4_0Blocks(data, sources.down, e, H).scales)]
      },
    },
  ]
}

function fusedGraph(op: 'MoE' | 'QMoE') {
  return (g: GraphBuilder, { w }: Weights, d: ExpertDims): string => {
    const logits = g.op('MatMul', ['x', w(routerWeightName(PREFIX))], undefined, { name: '/router' })
    const attrs = {
      k: I(d.numExpertsPerToken),
      activation_type: S('swiglu'),
      swiglu_fusion: I(1),
      normalize_routing_weights: I(1),
      activation_alpha: { kind: 'float' as const, value: 1 },
      activation_beta: { kind: 'float' as const, value: 0 },
      ...(op === 'QMoE' ? { expert_weight_bits: I(4), block_size: I(32) } : {}),
    }
    const inputs = op === 'MoE' ? ['x', logits, w('fc1'), '', w('fc2')] : ['x', logits, w('fc1'), w('fc1_scales'), '', w('fc2'), w('fc2_scales')]
    return g.op(op, inputs, attrs, { name: `/${op}`, domain: 'com.microsoft' })
  }
}

/** Every expert's gate_up rows one after another [E 2F, H/32, 16], and the down projections side
 *  by side along the input [H, E F/32, 16]: one MatMulNBits each over all experts. */
function denseQ4_0(sources: ExpertSources, d: ExpertDims): PlannedTensor[] {
  const { hiddenSize: H, numExperts: E, expertIntermediateSize: F } = d
  const specs: TensorSpec[] = [
    { name: 'gate_up.qweight', dims: [E * 2 * F, H / 32, 16], dataType: DataType.UINT8 },
    { name: 'gate_up.scales', dims: [E * 2 * F, H / 32] },
    { name: 'down.qweight', dims: [H, (E * F) / 32, 16], dataType: DataType.UINT8 },
    { name: 'down.scales', dims: [H, (E * F) / 32] },
  ]
  return [
    routerOnly(sources, d),
    {
      specs,
      *chunks(data) {
        for (let e = 0; e < E; e++) for (const t of [sources.gate, sources.up]) yield [0, q4_0Blocks(data, t, e, F).qweight]
        for (let e = 0; e < E; e++) for (const t of [sources.gate, sources.up]) yield [1, floatBytes(q4_0Blocks(data, t, e, F).scales)]
        const downs = Array.from({ length: E }, (_, e) => q4_0Blocks(data, sources.down, e, H))
        const q = new Uint8Array(H * (E * F) / 2)
        const s = new Float32Array(H * (E * F) / 32)
        for (let h = 0; h < H; h++) {
          for (let e = 0; e < E; e++) {
            q.set(downs[e]!.qweight.subarray(h * (F / 2), (h + 1) * (F / 2)), (h * E + e) * (F / 2))
            s.set(downs[e]!.scales.subarray(h * (F / 32), (h + 1) * (F / 32)), (h * E + e) * (F / 32))
          }
        }
        yield [2, q]
        yield [3, floatBytes(s)]
      },
    },
  ]
}

function denseGraph(g: GraphBuilder, { w }: Weights, d: ExpertDims): string {
  const { hiddenSize: H, numExperts: E, numExpertsPerToken: k, expertIntermediateSize: F } = d
  const nbits = (x: string, name: string, K: number, N: number) =>
    g.op('MatMulNBits', [x, w(`${name}.qweight`), w(`${name}.scales`)], { K: I(K), N: I(N), bits: I(4), block_size: I(32), accuracy_level: I(4) }, { name: `/${name}`, domain: 'com.microsoft' })
  const probs = g.op('Softmax', [g.op('MatMul', ['x', w(routerWeightName(PREFIX))])], { axis: I(-1) })
  const [top, chosen] = g.node('TopK', [probs, g.int64([k])], { outputs: 2, attrs: { axis: I(-1) } }) as [string, string]
  const weights = g.op('Div', [top, g.op('ReduceSum', [top, g.int64([-1])], { keepdims: I(1) })])
  const dense = g.op('ScatterElements', [g.op('ConstantOfShape', [g.op('Shape', [probs])]), chosen, weights], { axis: I(1) })
  const gateUp = g.op('Reshape', [nbits('x', 'gate_up', H, E * 2 * F), g.int64([0, E, 2 * F])])
  const [gate, up] = g.node('Split', [gateUp, g.int64([F, F])], { outputs: 2, attrs: { axis: I(-1) } }) as [string, string]
  const act = g.op('Mul', [g.op('Mul', [gate, g.op('Sigmoid', [gate])]), up])
  const weighted = g.op('Mul', [act, g.op('Unsqueeze', [dense, g.int64([-1])])])
  return nbits(g.op('Reshape', [weighted, g.int64([0, E * F])]), 'down', E * F, H)
}

await main()
