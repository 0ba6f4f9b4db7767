// The mixture-of-experts feed-forward block (qwen3moe), as llama.cpp's build_moe_ffn computes it
// for that architecture:
//
//   logits = x router                         [tokens, experts]
//   probs  = softmax(logits)                  over all experts
//   top k experts by probability; weights = their probabilities, divided by their sum where the
//   block renormalizes (qwen3moe always does: it passes norm_w = true whatever the file says;
//   qwen2moe passes false)
//   y = sum over the k experts of weight * down(silu(gate(x)) * up(x))
//
// The experts run as plain operators, each expert on the rows that chose it:
//
//   x [.., H] -> rows [N, H] -> router -> Softmax -> TopK -> weights, scattered into [N, E]
//                                                     (zero where an expert was not chosen)
//   for each expert e:  NonZero(column e) = its rows -> Gather -> gate_up -> SiLU * up -> down
//                       -> times the row's weight
//   every expert's rows and outputs, concatenated -> ScatterND(add) into zeros [N, H] -> [.., H]
//
// Each expert's weights are initializers of their own, so ONNX Runtime prepacks them like any
// other MatMul / MatMulNBits, and a token costs k experts, not E. ONNX Runtime's fused CPU kernels
// were measured against this (docs/performance.md): com.microsoft.MoE (float32) computes
// qwen3moe's routing with and without renormalization but runs slower than these operators;
// com.microsoft.QMoE has no per-block minimum (Q4_1, Q4_K are not exact in it), always
// renormalizes, and runs an order of magnitude slower on the CPU.
//
// Weights (prefix p, e.g. `model.layers.3.mlp`; gate and up share one projection per expert,
// gate's F outputs first):
//   p.gate.weight                          float32 [H, E]: the router, as MatMul takes it
//   fp32:  p.experts.{e}.gate_up_proj.weight   float32 [H, 2F]
//          p.experts.{e}.down_proj.weight      float32 [F, H]
//   int4:  p.experts.{e}.gate_up_proj.{qweight, scales, qzeros, mins}   MatMulNBits blocks, as
//          p.experts.{e}.down_proj.{qweight, scales, qzeros, mins}      llama.ts's int4 storage
//          (mins only where the blocks have minimums; qweight [N, K/32, 32] for 8-bit blocks)

import { DataType, type GraphBuilder, I, Is, S } from './onnx-builder'

export interface ExpertDims {
  hiddenSize: number
  /** E: experts per layer. */
  numExperts: number
  /** k: experts each token is routed to. */
  numExpertsPerToken: number
  /** F: the intermediate size of one expert. */
  expertIntermediateSize: number
}

/** How the experts' projections are stored (the router is float32 in both). */
export type ExpertStorage = { kind: 'fp32' } | { kind: 'int4'; accuracyLevel: number }

/** What the block needs of the decoder graph (llama.ts's graph context has these). */
export interface MoeGraph {
  g: GraphBuilder
  /** The initializer of a weight, added to the graph on first use. */
  w: (name: string) => string
  has: (name: string) => boolean
  weightDims: (name: string) => number[]
  /** The element type of the arithmetic; the block computes in float32 only. Default float32. */
  computeType?: number
}

export interface MoeBlock {
  /** Weight names' prefix, e.g. `model.layers.3.mlp`. */
  weights: string
  /** Node names' prefix, e.g. `/model/layers.3/mlp`. */
  nodes: string
  dims: ExpertDims
  /** Divide the k chosen probabilities by their sum (qwen3moe: true). */
  renormalize: boolean
  storage: ExpertStorage
}

export type ExpertProjection = 'gate_up_proj' | 'down_proj'

export const routerWeightName = (prefix: string): string => `${prefix}.gate.weight`
/** A projection's weight-name prefix: `<prefix>.experts.<e>.<proj>` (then .weight, .qweight, ...). */
export const expertProjectionName = (prefix: string, expert: number, proj: ExpertProjection): string => `${prefix}.experts.${expert}.${proj}`

/** The block: x [.., H] (any leading dims: [batch, sequence, H] or [tokens, H]) -> y like x. */
export function moeFeedForward(graph: MoeGraph, x: string, block: MoeBlock): string {
  checkBlock(graph, block)
  const { g } = graph
  const { dims, nodes: base } = block
  const H = dims.hiddenSize
  const rows = g.op('Reshape', [x, g.int64([-1, H])], undefined, { name: `${base}/rows/Reshape` })
  const weights = routingWeights(graph, rows, block)
  const inputSums = block.storage.kind === 'int4' && anyMinimums(graph, block) ? blockSums(g, rows, H, `${base}/rows`) : undefined
  const chosen: string[] = []
  const outputs: string[] = []
  for (let e = 0; e < dims.numExperts; e++) {
    const [tokens, y] = expert(graph, rows, weights, inputSums, block, e)
    chosen.push(tokens)
    outputs.push(y)
  }
  // Each token's k contributions are added to its row in the order of the experts' index, whatever
  // else is in the batch, so a row's output does not depend on the other rows.
  const indices = g.op('Concat', chosen, { axis: I(1) }, { name: `${base}/experts/rows/Concat` })
  const scatterIndices = g.op('Transpose', [indices], { perm: Is([1, 0]) }, { name: `${base}/experts/rows/Transpose` })
  const updates = g.op('Concat', outputs, { axis: I(0) }, { name: `${base}/experts/outputs/Concat` })
  const zeros = g.op('ConstantOfShape', [g.op('Shape', [rows], undefined, { name: `${base}/rows/Shape` })], undefined, { name: `${base}/zeros` })
  const sum = g.op('ScatterND', [zeros, scatterIndices, updates], { reduction: S('add') }, { name: `${base}/experts/ScatterND` })
  return g.op('Reshape', [sum, g.op('Shape', [x], undefined, { name: `${base}/Shape` })], undefined, { name: `${base}/Reshape` })
}

function checkBlock(graph: MoeGraph, block: MoeBlock): void {
  const { hiddenSize: H, numExperts: E, numExpertsPerToken: k, expertIntermediateSize: F } = block.dims
  if ((graph.computeType ?? DataType.FLOAT) !== DataType.FLOAT) throw new Error('the mixture-of-experts block computes in float32 only')
  if (![H, E, k, F].every((n) => Number.isInteger(n) && n > 0)) throw new Error(`expert sizes must be positive integers, got ${JSON.stringify(block.dims)}`)
  if (k > E) throw new Error(`${k} experts per token of ${E} experts`)
  const router = graph.weightDims(routerWeightName(block.weights))
  if (router.join() !== [H, E].join()) throw new Error(`${routerWeightName(block.weights)} has the shape [${router}], expected [${[H, E]}]`)
}

/**
 * [N, E]: each row's weight for each expert, zero for the experts it did not choose. TopK takes
 * the lower index first among equal probabilities where llama.cpp's sort leaves the order of ties
 * unspecified: the two can pick different experts only on exactly equal probabilities.
 */
function routingWeights(graph: MoeGraph, rows: string, block: MoeBlock): string {
  const { g, w } = graph
  const base = `${block.nodes}/router`
  const logits = g.op('MatMul', [rows, w(routerWeightName(block.weights))], undefined, { name: `${base}/MatMul` })
  const probs = g.op('Softmax', [logits], { axis: I(-1) }, { name: `${base}/Softmax` })
  const [top, chosen] = g.node('TopK', [probs, g.int64([block.dims.numExpertsPerToken])], {
    name: `${base}/TopK`,
    outputs: 2,
    attrs: { axis: I(-1), largest: I(1), sorted: I(1) },
  }) as [string, string]
  // llama.cpp clamps the sum to at least 2^-14 before dividing; the k largest of E probabilities
  // sum to at least k / E, above that for any E up to its limit of 1024 experts, so no clamp here.
  const weights = block.renormalize
    ? g.op('Div', [top, g.op('ReduceSum', [top, g.int64([-1])], { keepdims: I(1) }, { name: `${base}/ReduceSum` })], undefined, { name: `${base}/Div` })
    : top
  const zeros = g.op('ConstantOfShape', [g.op('Shape', [probs], undefined, { name: `${base}/Shape` })], undefined, { name: `${base}/zeros` })
  return g.op('ScatterElements', [zeros, chosen, weights], { axis: I(1) }, { name: `${base}/ScatterElements` })
}

/** Expert e on the rows that chose it: [1, n] row indices (NonZero's form) and [n, H] weighted outputs. */
function expert(graph: MoeGraph, rows: string, weights: string, inputSums: string | undefined, block: MoeBlock, e: number): [string, string] {
  const { g } = graph
  const F = block.dims.expertIntermediateSize
  const base = `${block.nodes}/experts.${e}`
  const column = g.op('Gather', [weights, g.int64([e], [])], { axis: I(1) }, { name: `${base}/weights/Gather` })
  // A chosen expert whose weight is exactly zero is skipped: its contribution would be zero.
  const tokens = g.op('NonZero', [column], undefined, { name: `${base}/NonZero` })
  const list = g.op('Reshape', [tokens, g.int64([-1])], undefined, { name: `${base}/tokens` })
  const h = g.op('Gather', [rows, list], { axis: I(0) }, { name: `${base}/rows/Gather` })
  const sums = inputSums && g.op('Gather', [inputSums, list], { axis: I(0) }, { name: `${base}/rows/block_sums/Gather` })
  const gateUp = projection(graph, h, sums, block, e, 'gate_up_proj')
  const [gate, up] = g.node('Split', [gateUp, g.int64([F, F])], { name: `${base}/Split`, outputs: 2, attrs: { axis: I(-1) } }) as [string, string]
  const sigmoid = g.op('Sigmoid', [gate], undefined, { name: `${base}/act/Sigmoid` })
  const silu = g.op('Mul', [gate, sigmoid], undefined, { name: `${base}/act/Mul` })
  const product = g.op('Mul', [silu, up], undefined, { name: `${base}/Mul` })
  const down = projection(graph, product, undefined, block, e, 'down_proj')
  // Weighted after the down projection, as llama.cpp does.
  const weight = g.op('Reshape', [g.op('Gather', [column, list], { axis: I(0) }, { name: `${base}/weight/Gather` }), g.int64([-1, 1])], undefined, {
    name: `${base}/weight/Reshape`,
  })
  return [tokens, g.op('Mul', [down, weight], undefined, { name: `${base}/weighted` })]
}

/** h [n, K] -> [n, N] through expert e's projection; `sums`: h's block sums where already gathered. */
function projection(graph: MoeGraph, h: string, sums: string | undefined, block: MoeBlock, e: number, proj: ExpertProjection): string {
  const { g, w } = graph
  const name = expertProjectionName(block.weights, e, proj)
  const base = `${block.nodes}/experts.${e}/${proj}`
  const { hiddenSize: H, expertIntermediateSize: F } = block.dims
  const [K, N] = proj === 'gate_up_proj' ? [H, 2 * F] : [F, H]
  if (block.storage.kind === 'fp32') {
    checkDims(graph, `${name}.weight`, [K, N])
    return g.op('MatMul', [h, w(`${name}.weight`)], undefined, { name: `${base}/MatMul` })
  }
  const qweight = graph.weightDims(`${name}.qweight`)
  const bits = ((qweight[2] ?? 0) * 8) / 32
  if (K % 32 !== 0 || qweight.join() !== [N, K / 32, (bits * 32) / 8].join() || (bits !== 4 && bits !== 8)) {
    throw new Error(`${name}.qweight has the shape [${qweight}], expected 4- or 8-bit blocks of 32 [${N}, ${K / 32}, 16 or 32]`)
  }
  const attrs = { K: I(K), N: I(N), bits: I(bits), block_size: I(32), accuracy_level: I(block.storage.accuracyLevel) }
  // 8-bit blocks without zero points: MatMulNBits takes 128.
  const zeros = graph.has(`${name}.qzeros`) ? [w(`${name}.qzeros`)] : []
  const product = g.op('MatMulNBits', [h, w(`${name}.qweight`), w(`${name}.scales`), ...zeros], attrs, { name: `${base}/MatMulNBits`, domain: 'com.microsoft' })
  if (!graph.has(`${name}.mins`)) return product
  // Blocks with minimums (Q4_1, Q4_K): add h's 32-element block sums times the minimums.
  const offsets = g.op('MatMul', [sums ?? blockSums(g, h, K, base), w(`${name}.mins`)], undefined, { name: `${base}/mins/MatMul` })
  return g.op('Add', [product, offsets], undefined, { name: `${base}/mins/Add` })
}

function anyMinimums(graph: MoeGraph, block: MoeBlock): boolean {
  return Array.from({ length: block.dims.numExperts }, (_, e) => graph.has(`${expertProjectionName(block.weights, e, 'gate_up_proj')}.mins`)).some(Boolean)
}

/**
 * Sums of the 32-element blocks of x [n, K] along its last axis: [n, K / 32]. The last Reshape
 * is for an expert without rows: ONNX Runtime's ReduceSum returns an empty input unreduced.
 */
function blockSums(g: GraphBuilder, x: string, K: number, base: string): string {
  const blocks = g.op('Reshape', [x, g.int64([0, K / 32, 32])], undefined, { name: `${base}/block_sums/Reshape` })
  const sums = g.op('ReduceSum', [blocks, g.int64([-1])], { keepdims: I(1) }, { name: `${base}/block_sums/ReduceSum` })
  return g.op('Reshape', [sums, g.int64([0, K / 32])], undefined, { name: `${base}/block_sums/Squeeze` })
}

function checkDims(graph: MoeGraph, name: string, dims: number[]): void {
  const got = graph.weightDims(name)
  if (got.join() !== dims.join()) throw new Error(`${name} has the shape [${got}], expected [${dims}]`)
}
