// The engine on paged-attention folders (docs/model-format.md, "Paged attention: the executor"):
// the reference-kernel folder runs on the CPU provider with its KV pool bound as past and present
// once, every step's rows packed into one invocation. The oracle is the gqa folder of the same
// seed (the same weights) under the same engine options: greedy tokens must be equal, for
// concurrent requests of different prompt lengths with chunked prefill, and with prefix-cache
// hits reading shared blocks the step did not compute.

import { readFileSync, writeFileSync, cpSync } from 'node:fs'
import { join } from 'node:path'
import { Engine } from 'ortex'
import { describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'
import { expectModelLoad, tinyPrompt, useTinyModels } from '../helpers/tiny-models'

const SEED = 7
const models = useTinyModels('paged-engine', {
  gqa: { attention: 'gqa', seed: SEED },
  paged: { attention: 'paged', pagedKernel: 'reference', seed: SEED },
  'paged block 4': { attention: 'paged', pagedKernel: 'reference', blockSize: 4, seed: SEED },
  'gqa fp16': { attention: 'gqa', dtype: 'fp16', seed: SEED },
  'paged fp16': { attention: 'paged', pagedKernel: 'reference', dtype: 'fp16', seed: SEED },
})

type NativeEngine = Awaited<ReturnType<typeof Engine.load>>

/** Prompts of 5 to 41 tokens: the longer ones prefill in chunks of maxScheduledTokens 16. */
const PROMPTS = [5, 41, 12, 33, 1, 20].map((n, i) => tinyPrompt(n, 40 + i))
const SYSTEM = tinyPrompt(37, 900)
const options = { maxScheduledTokens: 16, intraOpThreads: 1 }

/** Requests arriving while earlier ones decode (one joins every other step); the greedy tokens. */
async function staggered(engine: NativeEngine, prompts: number[][], maxNew: number): Promise<number[][]> {
  const buffer = engine.createEventBuffer(64)
  const turns: ReturnType<ReturnType<NativeEngine['createRequest']>['beginTurn']>[] = []
  for (let step = 0; turns.length < prompts.length || engine.hasPendingWork(); step++) {
    if (step % 2 === 0 && turns.length < prompts.length) {
      turns.push(engine.createRequest().beginTurn(prompts[turns.length]!, { maxGeneratedTokens: maxNew, ignoreEos: true }))
    }
    await engine.run(buffer)
    engine.checkInvariants()
    if (step > 10_000) throw new Error('the engine did not settle')
  }
  return Promise.all(turns.map(async (t) => Array.from((await t.done).tokens)))
}

async function withEngine<T>(dir: string, engineOptions: object, f: (engine: NativeEngine) => Promise<T>): Promise<T> {
  const engine = await Engine.load(dir, engineOptions as never)
  try {
    return await f(engine)
  } finally {
    await engine.close()
  }
}

describe('paged folder, reference kernel, on the CPU provider', () => {
  for (const variant of ['paged', 'paged block 4'] as const) {
    it(`${variant}: greedy tokens of staggered requests with chunked prefill equal the gqa folder's`, async () => {
      const expected = await withEngine(models.dirs.gqa, options, (e) => staggered(e, PROMPTS, 12))
      const blockSize = variant === 'paged' ? 16 : 4
      await withEngine(models.dirs[variant], options, async (engine) => {
        expect(engine.config.blockSize).toBe(blockSize)
        const got = await staggered(engine, PROMPTS, 12)
        expect(got).toEqual(expected)
        const stats = engine.executorStats()!
        // One invocation per step, whatever its mix of decodes and prefill chunks.
        expect(stats.invocations).toBe(stats.steps)
        // No KV crosses between the host and the model: the graph writes its pool in place.
        expect(stats.kvCopiedBytes).toBe(0)
        expect(stats.kvStoreBytes).toBe(engine.config.kvCacheBytes)
        expect(stats.hostInputBytes).toBeGreaterThan(0)
        // Logits come back for sampled rows only: at most one row per step's row, never per token.
        expect(stats.logitsBytes).toBeLessThanOrEqual(stats.rows * 512 * 4)
        expect(stats.logitsBytes).toBeLessThan(stats.tokens * 512 * 4)
      })
    })
  }

  it('a prompt prefilled alone in chunks (steps that sample no row) gives the gqa folder\'s tokens', async () => {
    const prompt = [tinyPrompt(41, 61)]
    const expected = await withEngine(models.dirs.gqa, options, (e) => staggered(e, prompt, 6))
    await withEngine(models.dirs.paged, options, async (engine) => {
      expect(await staggered(engine, prompt, 6)).toEqual(expected)
      // ceil(41 / 16) = 3 prefill steps, 2 of them sampling nothing, then 5 decodes: the logits of
      // the 6 sampled rows and of the index the 2 others asked for (dropped).
      const stats = engine.executorStats()!
      expect(stats.steps).toBe(8)
      expect(stats.logitsBytes).toBe(8 * 512 * 4)
    })
  })

  it("the gqa folder's stats count the KV it copies, the paged folder's none", async () => {
    await withEngine(models.dirs.gqa, options, async (engine) => {
      await staggered(engine, PROMPTS.slice(0, 2), 4)
      expect(engine.executorStats()!.kvCopiedBytes).toBeGreaterThan(0)
    })
  })

  it('prefix-cache hits read shared blocks and give the tokens of the cache off', async () => {
    const prompts = [3, 9, 1, 6].map((n, i) => [...SYSTEM, ...tinyPrompt(n, 70 + i)])
    const dir = models.dirs['paged block 4']
    const off = await withEngine(dir, { ...options, prefixCaching: false }, (e) => staggered(e, prompts, 8))
    await withEngine(dir, options, async (engine) => {
      expect(await staggered(engine, prompts, 8)).toEqual(off)
      expect(engine.stats().prefixCacheHits).toBeGreaterThan(0)
      expect(engine.executorStats()!.kvCopiedBytes).toBe(0)
    })
    const gqa = await withEngine(models.dirs.gqa, { ...options, blockSize: 4 }, (e) => staggered(e, prompts, 8))
    expect(off).toEqual(gqa)
  })

  it("the engine runs with the folder's block size and refuses another", async () => {
    await withEngine(models.dirs['paged block 4'], { blockSize: 4 }, async (engine) => {
      expect(engine.config.blockSize).toBe(4)
    })
    const error = await Engine.load(models.dirs['paged block 4'], { blockSize: 16 }).then(
      async (engine) => {
        await engine.close()
        throw new Error('the conflicting blockSize was accepted')
      },
      (e: unknown) => e as Error & { code: string },
    )
    expect(error.code).toBe('INVALID_ARGUMENT')
    expect(error.message).toContain('blockSize 16')
    expect(error.message).toContain('block size 4')
  })

  it("a float16 folder keeps its pool in float16 and gives the float16 gqa folder's tokens", async () => {
    const expected = await withEngine(models.dirs['gqa fp16'], options, (e) => staggered(e, PROMPTS, 12))
    await withEngine(models.dirs['paged fp16'], options, async (engine) => {
      expect(engine.config.kvPositionBytes).toBe(256) // 2 layers x (keys, values) x 2 heads x 16 x 2 bytes
      expect(await staggered(engine, PROMPTS, 12)).toEqual(expected)
      expect(engine.executorStats()!.kvCopiedBytes).toBe(0)
    })
  })

  it("a folder with com.microsoft.PagedAttention fails to load on 'cpu', saying what runs there", async () => {
    // Made here: useTinyModels opens a plain CPU session on each folder, which this one cannot have.
    const dir = join(models.root(), 'cuda-kernel')
    await makeModel({ attention: 'paged', pagedKernel: 'cuda', dtype: 'fp16', seed: SEED, size: 'tiny', outDir: dir })
    await expectModelLoad(dir, {}, 'model.onnx', 'PagedAttention', 'CUDA only', "executionProvider: 'cuda'")
  })

  it('a folder whose metadata says the cuda kernel fails to load on the CPU, saying what runs there', async () => {
    // The reference folder with its metadata saying the cuda kernel: metadata_props is a
    // top-level field of the model, so the entry is rewritten in place with its own length.
    const dir = join(models.root(), 'says-cuda')
    cpSync(models.dirs.paged, dir, { recursive: true })
    const file = join(dir, 'model.onnx')
    const bytes = readFileSync(file)
    const entry = (value: string) => {
      const key = Buffer.from('ortex.paged_kernel')
      const body = Buffer.concat([Buffer.from([0x0a, key.length]), key, Buffer.from([0x12, value.length]), Buffer.from(value)])
      return Buffer.concat([Buffer.from([0x72, body.length]), body])
    }
    const at = bytes.indexOf(entry('reference'))
    expect(at).toBeGreaterThan(0)
    writeFileSync(file, Buffer.concat([bytes.subarray(0, at), entry('cuda'), bytes.subarray(at + entry('reference').length)]))
    await expectModelLoad(dir, {}, 'model.onnx', 'PagedAttention', 'CUDA only', "executionProvider: 'cuda'", '--paged-kernel reference')
  })
})
