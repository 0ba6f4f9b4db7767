// Every architecture the importer maps, in every attention form an import writes, with the
// engine's scheduling on: the oracle's random-weight files (test/helpers/gguf-archs.ts), imported
// at fp32 from their F32 file, and
//
//   paged      the paged reference kernel's folder (standard operators on the CPU, the
//              PagedAttention form's inputs: windows, soft-caps, partial or no rotary, q/k norms
//              in the packed-token shape) gives the gqa folder's logits over prompts that cross
//              every sliding window, blocks out of order, a second run after a past;
//   engine     prefix caching and chunked prefill leave the tokens as the plain onnxruntime-node
//              loop computes them, for requests that share a prefix, arrive together and prefill
//              in chunks of a few tokens, on both folders;
//   cuda       the PagedAttention folder for CUDA carries each layer's window, soft-cap, scale,
//              rotary table and its width as the gqa folder's GroupQueryAttention does (ONNX
//              Runtime runs it on CUDA only: the run itself is bench/gpu's).
//
// test/model/llama-cpp-oracle.test.ts holds the gqa folders against llama.cpp itself.

import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import { Engine } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { importGguf } from '../../ts/modelkit/gguf/import'
import { ARCHS, type ArchName, archModel, writeArchGguf } from '../helpers/gguf-archs'
import { PagedModel } from '../reference/paged'
import { ReferenceModel, argmax, emptyCache, forwardBatch, naiveGenerate } from '../reference/reference'

const { onnx } = onnxProto

let root: string
beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'ortex-archs-'))
})
afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
})

const BLOCK = 4

/** ids of a prompt of `n` tokens drawn from the vocabulary (after BOS where the file adds one). */
function prompt(arch: ArchName, n: number, seed: number): number[] {
  const model = archModel(arch)
  const ids = Array.from({ length: n }, (_, i) => 3 + ((seed * 7919 + i * 104729) % (model.vocab - 3)))
  return model.bos === undefined ? ids : [model.bos, ...ids]
}

async function folders(arch: ArchName): Promise<{ file: string; gqa: string; paged: string }> {
  const file = join(root, `${arch}.F32.gguf`)
  writeArchGguf(file, arch, 'F32')
  const gqa = join(root, `${arch}-gqa`)
  const paged = join(root, `${arch}-paged`)
  await importGguf({ file, outDir: gqa })
  await importGguf({ file, outDir: paged, attention: 'paged', pagedKernel: 'reference', blockSize: BLOCK })
  return { file, gqa, paged }
}

/** Every position's logits from the gqa folder, one run. */
async function gqaLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
  const model = await ReferenceModel.load(dir)
  try {
    const [row] = await forwardBatch(model, [{ cache: emptyCache(model), tokens }])
    return row!.logits
  } finally {
    await model.release()
  }
}

/** Every position's logits from the paged folder: two runs (the second after a past), its blocks out of order. */
async function pagedLogits(dir: string, tokens: number[]): Promise<Float32Array[]> {
  const paged = await PagedModel.load(dir)
  try {
    const needed = Math.ceil(tokens.length / BLOCK)
    const pool = paged.pool(needed + 4)
    const blocks = Array.from({ length: needed }, (_, i) => needed + 3 - i) // distinct, in reverse
    const head = tokens.slice(0, 9)
    const tail = tokens.slice(9)
    const first = await paged.run(pool, [{ blocks, past: 0, tokens: head }], head.map((_, i) => i))
    return [...first, ...(await paged.run(pool, [{ blocks, past: head.length, tokens: tail }], tail.map((_, i) => i)))]
  } finally {
    await paged.release()
  }
}

function relativeRms(got: Float32Array[], want: Float32Array[]): number {
  let diff = 0
  let norm = 0
  want.forEach((w, s) => w.forEach((v, i) => ((diff += (got[s]![i]! - v) ** 2), (norm += v * v))))
  return Math.sqrt(diff / norm)
}

describe.each(ARCHS.map((arch) => [arch]))('%s', (arch) => {
  let dirs: Awaited<ReturnType<typeof folders>>
  beforeAll(async () => {
    dirs = await folders(arch)
  })

  it('the paged reference folder gives the gqa folder\'s logits past every window', async () => {
    const tokens = prompt(arch, 44, 1)
    const want = await gqaLogits(dirs.gqa, tokens)
    const got = await pagedLogits(dirs.paged, tokens)
    expect(got.map((l) => argmax(l))).toEqual(want.map((l) => argmax(l)))
    expect(relativeRms(got, want)).toBeLessThan(1e-5)
  })

  it('the engine with prefix caching and chunked prefill gives the plain loop\'s tokens, on both folders', async () => {
    // Three requests share a 20-token prefix (five blocks of 4), one is alone; 24 new tokens carry
    // every prompt past the windows.
    const shared = prompt(arch, 20, 2)
    const prompts = [
      [...shared, ...prompt(arch, 7, 3).slice(-7)],
      [...shared, ...prompt(arch, 3, 4).slice(-3)],
      shared,
      prompt(arch, 13, 5),
    ]
    const reference = await ReferenceModel.load(dirs.gqa)
    const expected: number[][] = []
    for (const p of prompts) expected.push(await naiveGenerate(reference, p, 24, { ignoreEos: true }))
    await reference.release()
    expect(new Set(expected.flat()).size).toBeGreaterThan(5) // not a degenerate model
    for (const dir of [dirs.gqa, dirs.paged]) {
      const engine = await Engine.load(dir, { intraOpThreads: 1, blockSize: BLOCK, maxScheduledTokens: 6, prefixCaching: true })
      try {
        // The first request fills the cache; the others arrive together and reuse its blocks.
        const first = Array.from((await engine.generate(prompts[0]!, { maxGeneratedTokens: 24, ignoreEos: true }).done).tokens)
        const rest = await Promise.all(prompts.slice(1).map(async (p) => Array.from((await engine.generate(p, { maxGeneratedTokens: 24, ignoreEos: true }).done).tokens)))
        expect([first, ...rest], dir).toEqual(expected)
        // The later requests find the prefix's five full blocks (four for the one that is the
        // prefix itself: its last token is computed, for its logits).
        expect(engine.stats().prefixCacheHits, dir).toBeGreaterThanOrEqual(5 + 4)
      } finally {
        await engine.close()
      }
    }
  })

  it('the float16 gqa folder (the arithmetic of the CUDA folders, run on the CPU) stays close to the float32 one', async () => {
    if (arch === 'qwen3moe') return // the experts' block has no float16 form (refused below)
    const dir = join(root, `${arch}-fp16`)
    await importGguf({ file: dirs.file, outDir: dir, dtype: 'fp16' })
    const tokens = prompt(arch, 44, 6)
    const want = await gqaLogits(dirs.gqa, tokens)
    const got = await gqaLogits(dir, tokens)
    const agree = got.filter((l, i) => argmax(l) === argmax(want[i]!)).length
    expect(agree / tokens.length).toBeGreaterThanOrEqual(0.95)
    expect(relativeRms(got, want)).toBeLessThan(2e-2)
  })

  it('the CUDA paged folder carries each layer\'s attention as the gqa folder does', async () => {
    const dir = join(root, `${arch}-cuda`)
    const plan = archModel(arch)
    if (arch === 'qwen3moe') {
      // The experts' block computes in float32; the CUDA folders are float16.
      await expect(importGguf({ file: dirs.file, outDir: dir, attention: 'paged', dtype: 'fp16' })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringMatching(/mixture-of-experts/) })
      return
    }
    await importGguf({ file: dirs.file, outDir: dir, attention: 'paged', dtype: 'fp16' })
    const attention = (folder: string, op: string) => {
      const graph = onnx.ModelProto.decode(readFileSync(join(folder, 'model.onnx'))).graph!
      const shape = (name: string) => graph.initializer!.find((t) => t.name === name)?.dims?.map(Number)
      return graph.node!.filter((n) => n.opType === op).map((n) => {
        const attr = (name: string) => n.attribute!.find((a) => a.name === name)!
        const cos = n.input![op === 'PagedAttention' ? 8 : 7]
        return {
          window: Number(attr('local_window_size').i),
          softcap: attr('softcap').f,
          scale: attr('scale').f,
          rotary: Number(attr('do_rotary').i),
          // The rotary table (an initializer in both folders, float32 or float16): its width.
          tableDims: cos ? shape(cos) : undefined,
        }
      })
    }
    const paged = attention(dir, 'PagedAttention')
    const gqa = attention(dirs.gqa, 'GroupQueryAttention')
    expect(paged).toHaveLength(plan.shape.layers)
    expect(paged.map(({ window, softcap, scale, rotary }) => ({ window, softcap, scale, rotary }))).toEqual(gqa.map(({ window, softcap, scale, rotary }) => ({ window, softcap, scale, rotary })))
    expect(paged.map((p) => p.tableDims)).toEqual(gqa.map((p) => p.tableDims))
  })
})
