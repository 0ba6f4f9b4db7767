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
// The experts run as plain operators, each expert on the rows routed to it. A token's k choices
// are its slots (slot s = token s / k); the slots are sorted by expert, so each expert's rows are
// one run of the sorted rows:
//
//   x [.., H] -> rows [N, H] -> router -> Softmax -> TopK -> experts, weights   [N, k]
//   slots sorted by expert -> X = their rows [N k, H]; per expert e a run [start_e, end_e)
//   for each expert e:  X[start_e : end_e] -> gate_up -> SiLU(gate) * up -> down   (6 nodes)
//   the experts' outputs, concatenated, back in slot order [N, k, H] -> times the weights
//   -> summed over the k slots (in llama.cpp's order) -> [.., H]
//
// Each expert's weights are initializers of their own, so ONNX Runtime prepacks them like any
// other MatMul / MatMulNBits, and a token costs k experts, not E. ONNX Runtime's fused CPU kernels
// were measured against this (docs/performance.md): com.microsoft.MoE (float32) computes
// qwen3moe's routing with and without renormalization but runs slower than these operators;
// com.microsoft.QMoE has no per-block minimum (Q4_1, Q4_K are not exact in it), always
// renormalizes, and runs 10 to 90 times slower on the CPU.
//
// Load time: ONNX Runtime's memory planner looks for a freed buffer of the same shape for every
// value whose rank it knows, through all buffers freed so far; values with a dimension it cannot
// name (an expert's row count) never match, so with known ranks the search grows with every
// expert of every layer and the model's load time with the square of its experts. The experts'
// rows are therefore sliced from a view of unknown rank (a Reshape to a shape computed at run
// time), which their values inherit: the planner skips them.
//
// Weights (prefix p, e.g. `model.layers.3.mlp`; gate and up share one projection per expert,
// gate's F outputs first):
//   p.gate.weight                          float32 [H, E]: the router, as MatMul takes it
//   fp32:  p.experts.{e}.gate_up_proj.weight   float32 [H, 2F]
//          p.experts.{e}.down_proj.weight      float32 [F, H]
//   int4:  p.experts.{e}.gate_up_proj.{qweight, scales, qzeros, mins}   MatMulNBits blocks, as
//          p.experts.{e}.down_proj.{qweight, scales, qzeros, mins}      decoder.ts's int4 storage
//          (mins only where the blocks have minimums; qweight [N, K/32, 32] for 8-bit blocks)

import { DataType, type GraphBuilder, I, S } from './onnx-builder'

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

/** What the block needs of the decoder graph (decoder.ts's graph context has these). */
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
  const { hiddenSize: H, numExpertsPerToken: k } = dims
  const rows = g.op('Reshape', [x, g.int64([-1, H])], undefined, { name: `${base}/rows/Reshape` })
  const { experts, weights } = route(graph, rows, block)
  const slots = sortSlots(g, experts, dims.numExperts, k, `${base}/slots`)
  // [N k, width]: t's rows in sorted slot order, as a view of unknown rank (see the header).
  const sortedView = (t: string, width: number, tag: string) => {
    const sorted = g.op('Gather', [t, slots.tokens], { axis: I(0) }, { name: `${base}/slots/${tag}/Gather` })
    const shape = g.op('Concat', [slots.unknownLength, g.int64([width])], { axis: I(0) }, { name: `${base}/slots/${tag}/shape` })
    return g.op('Reshape', [sorted, shape], undefined, { name: `${base}/slots/${tag}/Reshape` })
  }
  const sortedRows = sortedView(rows, H, 'rows')
  const sums = block.storage.kind === 'int4' && anyMinimums(graph, block) ? sortedView(blockSums(g, rows, H, `${base}/rows`), H / 32, 'block_sums') : undefined
  const outputs = Array.from({ length: dims.numExperts }, (_, e) => {
    const run = (t: string, tag: string) => g.op('Slice', [t, slots.starts[e]!, slots.ends[e]!], undefined, { name: `${base}/experts.${e}/${tag}/Slice` })
    return expert(graph, run(sortedRows, 'rows'), sums && run(sums, 'block_sums'), block, e)
  })
  // Back in slot order: token t's k outputs are rows t k .. t k + k - 1, weighted and added in
  // slot order as llama.cpp adds them, whatever else is in the batch.
  const sorted = g.op('Concat', outputs, { axis: I(0) }, { name: `${base}/experts/Concat` })
  const inSlotOrder = g.op('Gather', [sorted, slots.inverse], { axis: I(0) }, { name: `${base}/slots/Gather` })
  const perToken = g.op('Reshape', [inSlotOrder, g.int64([-1, k, H])], undefined, { name: `${base}/slots/Reshape` })
  const weighted = g.op('Mul', [perToken, g.op('Unsqueeze', [weights, g.int64([-1])], undefined, { name: `${base}/weights/Unsqueeze` })], undefined, { name: `${base}/weighted` })
  const sum = g.op('ReduceSum', [weighted, g.int64([1])], { keepdims: I(0) }, { name: `${base}/ReduceSum` })
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
 * Each row's k experts [N, k] (best first) and their weights. TopK takes the lower index first
 * among equal probabilities where llama.cpp's sort leaves the order of ties unspecified: the two
 * can choose differently only between exactly equal probabilities.
 */
function route(graph: MoeGraph, rows: string, block: MoeBlock): { experts: string; weights: string } {
  const { g, w } = graph
  const base = `${block.nodes}/router`
  const logits = g.op('MatMul', [rows, w(routerWeightName(block.weights))], undefined, { name: `${base}/MatMul` })
  const probs = g.op('Softmax', [logits], { axis: I(-1) }, { name: `${base}/Softmax` })
  const [top, experts] = g.node('TopK', [probs, g.int64([block.dims.numExpertsPerToken])], {
    name: `${base}/TopK`,
    outputs: 2,
    attrs: { axis: I(-1), largest: I(1), sorted: I(1) },
  }) as [string, string]
  if (!block.renormalize) return { experts, weights: top }
  // llama.cpp clamps the sum to at least 2^-14 before dividing; the k largest of E probabilities
  // sum to at least k / E, above that for any E up to its limit of 1024 experts, so no clamp here.
  const sum = g.op('ReduceSum', [top, g.int64([-1])], { keepdims: I(1) }, { name: `${base}/ReduceSum` })
  return { experts, weights: g.op('Div', [top, sum], undefined, { name: `${base}/Div` }) }
}

interface SortedSlots {
  /** [N k]: the token of each slot, the slots sorted by expert. */
  tokens: string
  /** [N k]: where each slot (in slot order) is among the sorted ones. */
  inverse: string
  /** Expert e's run of sorted slots: [start, end) as 1-element tensors of unknown rank. */
  starts: string[]
  ends: string[]
  /** [-1], as a tensor whose length is unknown until run time (the views of unknown rank). */
  unknownLength: string
}

/**
 * The slots (N k of them, slot s of token s / k) sorted by expert: TopK of the expert ids (ONNX's
 * TopK puts equal keys in index order, so an expert's rows keep their token order); expert e's run
 * ends at the count of slots of experts 0 .. e.
 */
function sortSlots(g: GraphBuilder, experts: string, E: number, k: number, base: string): SortedSlots {
  const ids = g.op('Reshape', [experts, g.int64([-1])], undefined, { name: `${base}/ids` })
  const count = g.op('Shape', [ids], undefined, { name: `${base}/Shape` })
  const ascending = (t: string, name: string) => {
    const key = g.op('Cast', [t], { to: I(DataType.FLOAT) }, { name: `${name}/Cast` })
    return g.node('TopK', [key, count], { name: `${name}/TopK`, outputs: 2, attrs: { axis: I(0), largest: I(0), sorted: I(1) } })[1]!
  }
  const order = ascending(ids, `${base}/order`)
  const inverse = ascending(order, `${base}/inverse`)
  const tokens = g.op('Div', [order, g.int64([k], [])], undefined, { name: `${base}/tokens` })
  const ones = g.op('Expand', [g.int64([1]), count], undefined, { name: `${base}/ones` })
  const counts = g.op('ScatterElements', [g.int64(new Array<number>(E).fill(0)), ids, ones], { axis: I(0), reduction: S('add') }, { name: `${base}/counts` })
  const ends = g.op('CumSum', [counts, g.int64([0], [])], undefined, { name: `${base}/ends` })
  const starts = g.op('Sub', [ends, counts], undefined, { name: `${base}/starts` })
  // [-1] sliced out to a run-time length (N k >= 1), so its length is unknown to shape inference.
  const unknownLength = g.op('Slice', [g.int64([-1]), g.int64([0]), count], undefined, { name: `${base}/unknown_length` })
  const split = (t: string, tag: string) =>
    g.node('Split', [g.op('Reshape', [t, unknownLength], undefined, { name: `${base}/${tag}/Reshape` })], {
      name: `${base}/${tag}/Split`,
      outputs: E,
      attrs: { axis: I(0), num_outputs: I(E) },
    })
  return { tokens, inverse, starts: split(starts, 'starts'), ends: split(ends, 'ends'), unknownLength }
}

/** Expert e on its rows h [n, H] (`sums`: their block sums, where the projection has minimums) -> [n, H]. */
function expert(graph: MoeGraph, h: string, sums: string | undefined, block: MoeBlock, e: number): string {
  const { g } = graph
  const F = block.dims.expertIntermediateSize
  const base = `${block.nodes}/experts.${e}`
  const gateUp = projection(graph, h, sums, block, e, 'gate_up_proj')
  const [gate, up] = g.node('Split', [gateUp, g.int64([F, F])], { name: `${base}/Split`, outputs: 2, attrs: { axis: I(-1) } }) as [string, string]
  // SiLU: com.microsoft.QuickGelu with alpha 1 is x sigmoid(x) in one node (bit for bit Sigmoid and
  // Mul on the CPU), one node fewer per expert.
  const silu = g.op('QuickGelu', [gate], { alpha: { kind: 'float', value: 1 } }, { name: `${base}/act/QuickGelu`, domain: 'com.microsoft' })
  const product = g.op('Mul', [silu, up], undefined, { name: `${base}/Mul` })
  return projection(graph, product, undefined, block, e, 'down_proj')
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
  // Blocks with minimums (Q4_1, Q4_K): add h's 32-element block sums times the minimums. An
  // expert's own block sums (of its product) are a MatMul by a block indicator, which holds for an
  // expert without rows (ReduceSum returns an empty input unreduced). MatMul and Add, not Gemm:
  // Gemm's output is 2-D whatever its input, and a known rank is what the planner searches for.
  const blockSum = sums ?? g.op('MatMul', [h, blockIndicator(g, K)], undefined, { name: `${base}/block_sums/MatMul` })
  const offsets = g.op('MatMul', [blockSum, w(`${name}.mins`)], undefined, { name: `${base}/mins/MatMul` })
  return g.op('Add', [product, offsets], undefined, { name: `${base}/mins/Add` })
}

function anyMinimums(graph: MoeGraph, block: MoeBlock): boolean {
  return Array.from({ length: block.dims.numExperts }, (_, e) => graph.has(`${expertProjectionName(block.weights, e, 'gate_up_proj')}.mins`)).some(Boolean)
}

/** Sums of the 32-element blocks of x [n, K] along its last axis: [n, K / 32] (n >= 1). */
function blockSums(g: GraphBuilder, x: string, K: number, base: string): string {
  const blocks = g.op('Reshape', [x, g.int64([0, K / 32, 32])], undefined, { name: `${base}/block_sums/Reshape` })
  return g.op('ReduceSum', [blocks, g.int64([-1])], { keepdims: I(0) }, { name: `${base}/block_sums/ReduceSum` })
}

/** [K, K / 32]: 1 where input k is in block b, so x [n, K] times it is x's block sums. */
function blockIndicator(g: GraphBuilder, K: number): string {
  const values = new Array<number>(K * (K / 32)).fill(0)
  for (let i = 0; i < K; i++) values[i * (K / 32) + Math.floor(i / 32)] = 1
  return g.float(values, [K, K / 32])
}

function checkDims(graph: MoeGraph, name: string, dims: number[]): void {
  const got = graph.weightDims(name)
  if (got.join() !== dims.join()) throw new Error(`${name} has the shape [${got}], expected [${dims}]`)
}
