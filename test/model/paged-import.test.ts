// `ortex import --attention paged` on the real model, SmolLM2-135M-Instruct (the GGUF file the
// real-model suite caches): the reference-kernel import, fed a prompt in two chunks (the second
// with the first in the cache, blocks out of order), picks at every position what the gqa import
// of the same file picks, teacher-forced; the float16 import (reference kernel, on the CPU
// provider with its inserted casts) mostly agrees with it. Skipped, with a line saying why, where
// the model cannot be fetched.

import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { importGguf } from '../../ts/modelkit/gguf/import'
import { RealModelUnavailable, smolLM2Folder, smolLM2Gguf } from '../../ts/modelkit/real-model'
import { PagedModel } from '../reference/paged'
import { ReferenceModel, argmax, emptyCache, forwardBatch } from '../reference/reference'

async function prepare(): Promise<{ gguf: string; gqa: string } | string> {
  try {
    return { gguf: await smolLM2Gguf(), gqa: (await smolLM2Folder('fp32')).dir }
  } catch (error) {
    if (error instanceof RealModelUnavailable) return error.message
    throw error
  }
}

const model = await prepare()
if (typeof model === 'string') console.warn(`[paged-import] SmolLM2 suite skipped: ${model}`)
const ready = typeof model !== 'string' ? model : undefined

// Three sentences of the tokenizer fixture, as token ids: 10 + 23 + 26 = 59 positions.
const FIXTURE = join(dirname(fileURLToPath(import.meta.url)), '..', 'fixtures', 'gguf', 'smollm2-tokens.json')
const PROMPT = (JSON.parse(readFileSync(FIXTURE, 'utf8')) as { ids: number[][] }).ids
  .filter((_, i) => i === 0 || i === 2 || i === 3)
  .flat()
const BLOCK = 16
const SPLIT = 37 // the first chunk ends inside a block

let root = ''
const dirs = { fp32: '', fp16: '' }

/** Every position's logits from the gqa import, the prompt run alone from an empty past. */
async function gqaLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
  const reference = await ReferenceModel.load(dir)
  try {
    const [row] = await forwardBatch(reference, [{ cache: emptyCache(reference), tokens }])
    return row!.logits
  } finally {
    await reference.release()
  }
}

/** Every position's logits from a paged import: the prompt in two runs, blocks [3, 0, 2, 1]. */
async function pagedLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
  const paged = await PagedModel.load(dir)
  try {
    expect(paged.blockSize).toBe(BLOCK)
    const blocks = [3, 0, 2, 1]
    const pool = paged.pool(4)
    const head = tokens.slice(0, SPLIT)
    const tail = tokens.slice(SPLIT)
    const first = await paged.run(pool, [{ blocks, past: 0, tokens: head }], head.map((_, i) => i))
    const second = await paged.run(pool, [{ blocks, past: SPLIT, tokens: tail }], tail.map((_, i) => i))
    return [...first, ...second]
  } finally {
    await paged.release()
  }
}

describe.skipIf(!ready)('ortex import --attention paged, SmolLM2', () => {
  beforeAll(async () => {
    root = mkdtempSync(join(tmpdir(), 'ortex-paged-import-'))
    for (const dtype of ['fp32', 'fp16'] as const) {
      dirs[dtype] = join(root, dtype)
      await importGguf({ file: ready!.gguf, outDir: dirs[dtype], attention: 'paged', pagedKernel: 'reference', blockSize: BLOCK, dtype })
    }
  }, 120_000)
  afterAll(() => {
    if (root) rmSync(root, { recursive: true, force: true })
  })

  it('the float32 reference kernel picks what the gqa import picks at every position', async () => {
    const want = await gqaLogits(ready!.gqa, PROMPT)
    const got = await pagedLogits(dirs.fp32, PROMPT)
    expect(got.map((l) => argmax(l))).toEqual(want.map((l) => argmax(l)))
    let worst = 0
    got.forEach((row, i) => row.forEach((x, j) => (worst = Math.max(worst, Math.abs(x - want[i]![j]!)))))
    expect(worst).toBeLessThan(1e-3)
  }, 60_000)

  it('the float16 import agrees with it on almost every position', async () => {
    const want = (await pagedLogits(dirs.fp32, PROMPT)).map((l) => argmax(l))
    const got = (await pagedLogits(dirs.fp16, PROMPT)).map((l) => argmax(l))
    const agree = got.filter((t, i) => t === want[i]).length / want.length
    expect(agree).toBeGreaterThanOrEqual(0.95)
  }, 60_000)
})
