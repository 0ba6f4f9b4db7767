// The paged folders of `ortex make-model --attention paged` (docs/model-format.md, "The paged
// form") run on onnxruntime-node's CPU provider with the reference kernel: rows packed on one
// token axis over a pool of blocks, block tables out of order, a row with past in the cache beside
// a fresh one, logits only where asked. The oracle is the gqa folder of the same seed (the same
// weights), teacher-forced over each row's whole sequence in one run.

import ort from 'onnxruntime-node'
import type { Tensor } from 'onnxruntime-node'
import { spawnSync } from 'node:child_process'
import { readFileSync, readdirSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { describe, expect, it } from 'vitest'
import { readModelConfig } from '../../ts/modelkit/genai-config'
import { tinyPrompt, useTinyModels } from '../helpers/tiny-models'
import { PagedModel, type PagedPool } from '../reference/paged'
import { ReferenceModel, argmax, floatData } from '../reference/reference'

const SEED = 5
const models = useTinyModels('paged', {
  gqa: { attention: 'gqa', seed: SEED },
  paged: { attention: 'paged', pagedKernel: 'reference', seed: SEED },
  'paged block 4': { attention: 'paged', pagedKernel: 'reference', blockSize: 4, seed: SEED },
})

/** Every position's logits of `tokens` run alone from an empty past ([S][vocab]). */
async function teacherForced(model: ReferenceModel, tokens: number[]): Promise<Float32Array[]> {
  const c = model.config
  const S = tokens.length
  const feeds: Record<string, Tensor> = {
    ...model.emptyPast(1),
    [c.inputIds]: new ort.Tensor('int64', BigInt64Array.from(tokens, BigInt), [1, S]),
    [c.attentionMask]: new ort.Tensor('int64', new BigInt64Array(S).fill(1n), [1, S]),
  }
  const logits = floatData((await model.run(feeds))[c.logits]!)
  const V = c.vocabSize
  return Array.from({ length: S }, (_, s) => logits.slice(s * V, (s + 1) * V))
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
