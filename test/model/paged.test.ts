// The paged folders of `ortex make-model --attention paged` (docs/model-format.md, "The paged
// form") run on onnxruntime-node's CPU provider with the reference kernel: rows packed on one
// token axis over a pool of blocks, block tables out of order, a row with past in the cache beside
// a fresh one, logits only where asked. The oracle is the gqa folder of the same seed (the same
// weights), teacher-forced over each row's whole sequence in one run.

import onnxProto from 'onnx-proto'
import ort from 'onnxruntime-node'
import { spawnSync } from 'node:child_process'
import { readFileSync, readdirSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { beforeAll, describe, expect, it } from 'vitest'
import { readModelConfig } from '../../ts/modelkit/genai-config'
import { makeModel, type ModelSummary } from '../../ts/modelkit/make-model'
import { tinyPrompt, useTinyModels } from '../helpers/tiny-models'
import { PagedModel, type PagedPool } from '../reference/paged'
import { ReferenceModel, argmax, emptyCache, forwardBatch } from '../reference/reference'

const SEED = 5
const models = useTinyModels('paged', {
  gqa: { attention: 'gqa', seed: SEED },
  paged: { attention: 'paged', pagedKernel: 'reference', seed: SEED },
  'paged block 4': { attention: 'paged', pagedKernel: 'reference', blockSize: 4, seed: SEED },
  'gqa fp16': { attention: 'gqa', dtype: 'fp16', seed: SEED },
  'paged fp16': { attention: 'paged', pagedKernel: 'reference', dtype: 'fp16', seed: SEED },
})

/** Every position's logits of `tokens` run alone from an empty past ([S][vocab]). */
async function teacherForced(model: ReferenceModel, tokens: number[]): Promise<Float32Array[]> {
  const [row] = await forwardBatch(model, [{ cache: emptyCache(model), tokens }])
  return row!.logits
}

function expectClose(actual: Float32Array, expected: Float32Array, tolerance: number): void {
  let worst = 0
  for (let i = 0; i < expected.length; i++) worst = Math.max(worst, Math.abs(actual[i]! - expected[i]!))
  expect(worst).toBeLessThan(tolerance)
  expect(argmax(actual)).toBe(argmax(expected))
}

/** The blocks of `pool` (one layer's keys), as numbers, for checking what a run left alone. */
const blockOf = (pool: PagedPool, model: PagedModel, layer: number, block: number) =>
  Array.from(pool.keys[layer]!.subarray(block * model.blockElements, (block + 1) * model.blockElements))

describe('paged folder, reference kernel, float32', () => {
  for (const variant of ['paged', 'paged block 4'] as const) {
    it(`${variant}: a fresh row beside a row with past give the gqa folder's logits`, async () => {
      const paged = await PagedModel.load(models.dirs[variant])
      const gqa = models.references.gqa
      try {
        const bs = paged.blockSize
        const a = tinyPrompt(3 * bs + 3, 1) // prefilled first, then 5 more tokens
        const aMore = tinyPrompt(5, 2)
        const b = tinyPrompt(bs + 6, 3) // fresh in the second run
        const blocksFor = (n: number) => Math.ceil(n / bs)
        // Out-of-order blocks, a spare block the runs must not touch, unwritten slots holding a
        // large finite value (what stale data would be) that the mask must keep out.
        const aBlocks = [6, 2, 0, 4, 9].slice(0, blocksFor(a.length + aMore.length))
        const bBlocks = [5, 1, 8, 3].slice(0, blocksFor(b.length))
        const spare = 7
        const pool = paged.pool(10, 1000)
        const first = await paged.run(pool, [{ blocks: aBlocks, past: 0, tokens: a }], [a.length - 1])
        const expectedA = await teacherForced(gqa, [...a, ...aMore])
        expectClose(first[0]!, expectedA[a.length - 1]!, 1e-3)
        const spareBefore = blockOf(pool, paged, 0, spare)
        // Second run: row 0 has past a.length and 5 new tokens, row 1 none and b; logits of both
        // rows' last tokens and of one position inside row 1 (any packed index may be asked).
        const second = await paged.run(
          pool,
          [
            { blocks: aBlocks, past: a.length, tokens: aMore },
            { blocks: bBlocks, past: 0, tokens: b },
          ],
          [aMore.length - 1, aMore.length + b.length - 1, aMore.length + 2],
        )
        const expectedB = await teacherForced(gqa, b)
        expectClose(second[0]!, expectedA.at(-1)!, 1e-3)
        expectClose(second[1]!, expectedB.at(-1)!, 1e-3)
        expectClose(second[2]!, expectedB[2]!, 1e-3)
        expect(blockOf(pool, paged, 0, spare)).toEqual(spareBefore)
        expect(blockOf(pool, paged, 0, spare).every((x) => x === 1000)).toBe(true)
      } finally {
        await paged.release()
      }
    })
  }

  it('runs in place: each present bound to its past\'s buffer gives the same logits and pool', async () => {
    const paged = await PagedModel.load(models.dirs['paged block 4'])
    try {
      const rows = (past: number) => [
        { blocks: [4, 1, 6], past, tokens: tinyPrompt(past === 0 ? 7 : 3, past) },
        { blocks: [0, 5, 2], past, tokens: tinyPrompt(past === 0 ? 5 : 4, past + 1) },
      ]
      const copied = paged.pool(7, 1000)
      const bound = paged.pool(7, 1000)
      const buffers = [...bound.keys, ...bound.values]
      for (const past of [0, 7]) {
        const indices = past === 0 ? [6, 11] : [2, 6]
        const want = await paged.run(copied, rows(past), indices)
        const got = await paged.run(bound, rows(past), indices, { inPlace: true })
        expect(got).toEqual(want)
      }
      // The arrays first bound hold the written pool: the graph wrote where they are.
      expect(buffers.map((b) => Array.from(b))).toEqual([...copied.keys, ...copied.values].map((b) => Array.from(b)))
    } finally {
      await paged.release()
    }
  })

  it('a chunk with no logits wanted still fills the cache; a row with no new tokens is carried along', async () => {
    const paged = await PagedModel.load(models.dirs['paged block 4'])
    try {
      const prompt = tinyPrompt(9, 21)
      const pool = paged.pool(5)
      // A prefill chunk mid-prompt samples nothing: num_logits 0.
      expect(await paged.run(pool, [{ blocks: [3, 1, 4], past: 0, tokens: prompt.slice(0, 6) }], [])).toEqual([])
      // The rest of the prompt beside a row with nothing new (its block table row still given).
      const [last] = await paged.run(
        pool,
        [
          { blocks: [2], past: 0, tokens: [] },
          { blocks: [3, 1, 4], past: 6, tokens: prompt.slice(6) },
        ],
        [2],
      )
      const want = await teacherForced(models.references.gqa, prompt)
      expectClose(last!, want.at(-1)!, 1e-3)
    } finally {
      await paged.release()
    }
  })

  it('writes each new key at its slot: block_table[row][p / block_size], slot p % block_size', async () => {
    const paged = await PagedModel.load(models.dirs['paged block 4'])
    try {
      const c = paged.config
      const pool = paged.pool(4, 1000)
      // 6 tokens at positions 0..5 in blocks [2, 0]: positions 0-3 in block 2, 4-5 in block 0's
      // first two slots; block 0's last two slots, blocks 1 and 3 untouched.
      await paged.run(pool, [{ blocks: [2, 0], past: 0, tokens: tinyPrompt(6, 9) }], [5])
      const slot = c.numKvHeads * c.headSize
      const written = (block: number, s: number) => Array.from(pool.keys[1]!.subarray((block * 4 + s) * slot, (block * 4 + s + 1) * slot))
      for (const [block, s] of [[2, 0], [2, 3], [0, 0], [0, 1]]) expect(written(block!, s!).some((x) => x !== 1000)).toBe(true)
      for (const [block, s] of [[0, 2], [0, 3], [1, 0], [3, 3]]) expect(written(block!, s!).every((x) => x === 1000)).toBe(true)
    } finally {
      await paged.release()
    }
  })

  it("genai_config.json is the builder's paged form, with the folder's block size", () => {
    const config = JSON.parse(readFileSync(join(models.dirs.paged, 'genai_config.json'), 'utf8'))
    expect(config.model.decoder.inputs).toEqual({
      input_ids: 'input_ids',
      block_table: 'block_table',
      cumulative_sequence_lengths: 'cumulative_sequence_lengths',
      past_sequence_lengths: 'past_sequence_lengths',
      attention_metadata: 'attention_metadata',
      logits_indices: 'logits_indices',
      past_key_names: 'past_key_values.%d.key',
      past_value_names: 'past_key_values.%d.value',
    })
    expect(config.model.decoder.state_groups).toEqual([{ kind: 'paged_kv', layer_ids: [0, 1] }])
    expect(config.engine).toEqual({ dynamic_batching: { block_size: 16, max_batch_size: 100, gpu_utilization_factor: 0.6 } })
    expect(config.search.past_present_share_buffer).toBe(true)
    expect(config.model.decoder.session_options.provider_options).toEqual([])
    expect(readModelConfig(models.dirs['paged block 4']).paged).toEqual({ blockSize: 4 })
  })
})

describe('ortex make-model --attention paged', () => {
  it('writes the same bytes as makeModel with the same options', () => {
    const out = join(models.root(), 'cli')
    const cli = resolve(dirname(fileURLToPath(import.meta.url)), '../../dist/cli.js')
    const args = ['make-model', '--out', out, '--attention', 'paged', '--paged-kernel', 'reference', '--block-size', '4', '--seed', String(SEED)]
    const run = spawnSync(process.execPath, [cli, ...args], { encoding: 'utf8' })
    expect(run.status, run.stderr).toBe(0)
    expect(run.stdout).toMatch(/tiny paged seed 5 reference kernel block 4,/)
    const made = models.dirs['paged block 4']
    for (const file of readdirSync(made)) expect(readFileSync(join(out, file)).equals(readFileSync(join(made, file))), file).toBe(true)
  })
})

/** Top-1 agreement of two lists of logits, and the largest difference. */
function agreement(a: Float32Array[], b: Float32Array[]): { agree: number; worst: number } {
  let agree = 0
  let worst = 0
  a.forEach((row, i) => {
    if (argmax(row) === argmax(b[i]!)) agree++
    for (let j = 0; j < row.length; j++) worst = Math.max(worst, Math.abs(row[j]! - b[i]![j]!))
  })
  return { agree: agree / a.length, worst }
}

describe('float16 folders (--dtype fp16) on the CPU provider', () => {
  // onnxruntime-node's CPU provider runs them: nodes without a float16 CPU kernel (MatMul on x86,
  // ...) get float32 Casts inserted around them at load (its InsertCastTransformer).
  const prompt = tinyPrompt(60, 11)

  it('the paged reference kernel in float16 picks what the float32 folder picks', async () => {
    const [f16, f32] = await Promise.all([PagedModel.load(models.dirs['paged fp16']), PagedModel.load(models.dirs.paged)])
    try {
      expect(f16.kvType).toBe('float16')
      const all = prompt.map((_, i) => i)
      const rows = [{ blocks: [3, 1, 0, 2], past: 0, tokens: prompt }]
      const half = await f16.run(f16.pool(4), rows, all)
      const full = await f32.run(f32.pool(4), rows, all)
      const { agree, worst } = agreement(half, full)
      expect(agree).toBeGreaterThanOrEqual(0.95)
      expect(worst).toBeLessThan(0.2)
    } finally {
      await Promise.all([f16.release(), f32.release()])
    }
  })

  it('the gqa folder in float16 picks what the float32 folder picks', async () => {
    const half = await teacherForced(models.references['gqa fp16'], prompt)
    const full = await teacherForced(models.references.gqa, prompt)
    const { agree, worst } = agreement(half, full)
    expect(agree).toBeGreaterThanOrEqual(0.95)
    expect(worst).toBeLessThan(0.2)
  })
})

/**
 * The cuda kernel's folder, held against onnxruntime-genai 0.18's builder (`-p fp16 -e cuda
 * --extra_options use_paged_attention=true prune_lm_head=true`), builders/base.py:
 *   input names, types, shapes          163-220 (input_names / input_types / input_shapes),
 *                                       581-592 (make_inputs_init: paged shapes, no attention_mask),
 *                                       638-644 (make_outputs_init: caches, logits [num_logits, vocab]),
 *                                       2200-2217 (make_inputs_and_outputs: every key, then every value)
 *   PagedAttention inputs, domain       4515-4580 (make_paged_attention: slot 16 attention_metadata)
 *   its attributes                      4259-4270 (get_attention_op_attributes), 744-746 (do_rotary
 *                                       on CUDA: is_fused_rope_supported)
 *   genai_config inputs, engine         1324-1333, 1473-1486 (make_genai_config), 144-146 (cuda
 *                                       provider options), 1537-1577 (state_groups)
 */
describe('the cuda kernel folder (--attention paged --dtype fp16)', () => {
  const { onnx } = onnxProto
  const T = onnx.TensorProto.DataType
  let dir = ''
  let summary: ModelSummary
  beforeAll(async () => {
    dir = join(models.root(), 'paged-cuda')
    summary = await makeModel({ outDir: dir, size: 'tiny', attention: 'paged', dtype: 'fp16', seed: SEED })
  })
  const model = () => onnx.ModelProto.decode(readFileSync(join(dir, 'model.onnx')))
  const config = () => JSON.parse(readFileSync(join(dir, 'genai_config.json'), 'utf8'))

  it('is made with the cuda kernel by default', () => {
    expect(summary.paged).toEqual({ kernel: 'cuda', blockSize: 16 })
    const meta = Object.fromEntries(model().metadataProps!.map((p) => [p.key, p.value]))
    expect(meta).toMatchObject({ 'ortex.attention': 'paged', 'ortex.paged_kernel': 'cuda', 'ortex.block_size': '16', 'ortex.dtype': 'fp16', 'ortex.kv': 'fp16' })
  })

  it("has the builder's inputs and outputs", () => {
    const shape = (v: onnxProto.onnx.IValueInfoProto) => v.type!.tensorType!.shape!.dim!.map((d) => d.dimParam || Number(d.dimValue))
    const io = (list: onnxProto.onnx.IValueInfoProto[]) => list.map((v) => [v.name, v.type!.tensorType!.elemType, shape(v)])
    const cache = ['num_blocks', 'block_size', 2, 16]
    expect(io(model().graph!.input!)).toEqual([
      ['input_ids', T.INT64, ['num_tokens']],
      ['past_key_values.0.key', T.FLOAT16, cache],
      ['past_key_values.1.key', T.FLOAT16, cache],
      ['past_key_values.0.value', T.FLOAT16, cache],
      ['past_key_values.1.value', T.FLOAT16, cache],
      ['block_table', T.INT32, ['batch_size', 'max_num_blocks']],
      ['cumulative_sequence_lengths', T.INT32, ['batch_size + 1']],
      ['past_sequence_lengths', T.INT32, ['batch_size']],
      ['attention_metadata', T.INT32, [3]],
      ['logits_indices', T.INT32, ['num_logits']],
    ])
    expect(io(model().graph!.output!)).toEqual([
      ['logits', T.FLOAT16, ['num_logits', 512]],
      ['present.0.key', T.FLOAT16, cache],
      ['present.1.key', T.FLOAT16, cache],
      ['present.0.value', T.FLOAT16, cache],
      ['present.1.value', T.FLOAT16, cache],
    ])
  })

  it("each layer's com.microsoft.PagedAttention has the builder's inputs and attributes", () => {
    const graph = model().graph!
    const nodes = graph.node!.filter((n) => n.opType === 'PagedAttention')
    expect(nodes).toHaveLength(2)
    nodes.forEach((node, l) => {
      expect(node.domain).toBe('com.microsoft')
      const [q, k, v, ...rest] = node.input!
      // q/k/v packed, as the builder: one MatMul over the three weights concatenated (folded by
      // ONNX Runtime at load), key and value left empty.
      expect([q, k, v]).toEqual([`/model/layers.${l}/attn/qkv_proj/MatMul/output_0`, '', ''])
      expect(graph.node!.find((n) => n.name === `/model/layers.${l}/attn/qkv_proj/weight/Concat`)!.input).toEqual(
        ['q_proj', 'k_proj', 'v_proj'].map((p) => `model.layers.${l}.self_attn.${p}.weight`),
      )
      expect(rest).toEqual([
        `past_key_values.${l}.key`,
        `past_key_values.${l}.value`,
        'cumulative_sequence_lengths',
        'past_sequence_lengths',
        'block_table',
        'cos_cache',
        'sin_cache',
        '', // slot_mapping
        '', // head_sink
        '', // q_norm_weight
        '', // k_norm_weight
        '', // k_scale
        '', // v_scale
        'attention_metadata',
      ])
      expect(node.output!.slice(1)).toEqual([`present.${l}.key`, `present.${l}.value`])
      const attrs = Object.fromEntries(node.attribute!.map((a) => [a.name, a.type === onnx.AttributeProto.AttributeType.FLOAT ? a.f : Number(a.i)]))
      expect(attrs).toEqual({ num_heads: 4, kv_num_heads: 2, scale: 0.25, local_window_size: -1, softcap: 0, do_rotary: 1, rotary_interleaved: 0 })
    })
    // The rotary tables and every weight are float16 initializers (the kernel takes one type).
    const types = new Map(graph.initializer!.map((t) => [t.name, t.dataType]))
    expect(types.get('cos_cache')).toBe(T.FLOAT16)
    expect(types.get('model.layers.0.self_attn.q_proj.weight')).toBe(T.FLOAT16)
    // Rows are selected by logits_indices after the last attention: both inputs of the fused
    // residual norm (the builder's make_selected_hidden_rows).
    expect(graph.node!.filter((n) => n.input!.includes('logits_indices')).map((n) => n.name)).toEqual([
      '/model/selected_rows/root_input/Gather',
      '/model/selected_rows/skip_input/Gather',
    ])
    expect(graph.node!.filter((n) => n.opType === 'SkipSimplifiedLayerNormalization' && n.domain === 'com.microsoft')).toHaveLength(4)
  })

  it("genai_config.json names the CUDA provider as the builder's -e cuda does", () => {
    const c = config()
    expect(c.model.decoder.session_options.provider_options).toEqual([{ cuda: { enable_cuda_graph: '0' } }])
    expect(c.model.decoder.inputs.block_table).toBe('block_table')
    expect(c.engine.dynamic_batching.block_size).toBe(16)
  })

  it("does not load on onnxruntime-node's CPU provider (PagedAttention has a CUDA kernel only)", async () => {
    await expect(ort.InferenceSession.create(join(dir, 'model.onnx'), { executionProviders: ['cpu'] })).rejects.toThrow(/PagedAttention/)
  })

  it('the reference kernel is standard operators only', () => {
    const reference = onnx.ModelProto.decode(readFileSync(join(models.dirs.paged, 'model.onnx')))
    expect(reference.graph!.node!.filter((n) => n.domain).map((n) => n.opType)).toEqual([])
  })
})
