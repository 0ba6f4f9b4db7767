// The import's conversion threads (ts/modelkit/gguf/convert.ts): the folder an import writes is
// the same byte for byte whether one thread or several dequantize and requantize its tensors, in
// every weight form; a failure inside a worker fails the import with the worker's error and
// leaves no folder. The workers run the built package's dist/gguf-worker.js.

import { createHash } from 'node:crypto'
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync, truncateSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { fromPackageRoot } from '../../ts/backend'
import { type ImportOptions, importGguf } from '../../ts/modelkit/gguf/import'
import type { TinyGgufOptions } from '../helpers/gguf-models'
import { writeTinyGguf } from '../helpers/gguf-models'

/** Every type the importer reads, over two layers, a Q8_0 embedding and a Q6_K output. */
const EVERY_TYPE: TinyGgufOptions = {
  architecture: 'llama',
  types: {
    embedding: 'Q8_0',
    output: 'Q6_K',
    layers: [
      ['F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0'],
      ['Q4_K', 'Q5_K', 'Q6_K', 'F32', 'Q4_0', 'Q4_K', 'Q4_1'],
    ],
  },
  seed: 11,
  ropeFactors: true,
}

/** qwen2 with biases and an embedding the int4 lm_head is tied to (Q8_0: kept as 8-bit blocks). */
const TIED: TinyGgufOptions = {
  architecture: 'qwen2',
  types: { embedding: 'Q8_0', layers: [Array(7).fill('Q4_K'), Array(7).fill('Q6_K')] },
  seed: 12,
}

let root: string
const files = {} as Record<'everyType' | 'tied', string>

beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'ortex-gguf-parallel-'))
  files.everyType = join(root, 'every-type.gguf')
  files.tied = join(root, 'tied.gguf')
  writeTinyGguf(files.everyType, EVERY_TYPE)
  writeTinyGguf(files.tied, TIED)
})

afterAll(() => rmSync(root, { recursive: true, force: true }))

/** sha256 of each file of a folder, by name. */
function folderHashes(dir: string): Record<string, string> {
  const out: Record<string, string> = {}
  for (const name of readdirSync(dir).sort()) out[name] = createHash('sha256').update(readFileSync(join(dir, name))).digest('hex')
  return out
}

let serial = 0
async function importWith(options: Omit<ImportOptions, 'outDir'>): Promise<Record<string, string>> {
  const outDir = join(root, `out-${serial++}`)
  await importGguf({ ...options, outDir })
  return folderHashes(outDir)
}

describe('an import on worker threads', () => {
  it('has its worker script built (dist/gguf-worker.js), so these tests run the threads', () => {
    expect(existsSync(fromPackageRoot('dist/gguf-worker.js'))).toBe(true)
  })

  const forms: Array<[string, keyof typeof files, Partial<ImportOptions>]> = [
    ['fp32 weights', 'everyType', { weights: 'fp32' }],
    ['int4 weights', 'everyType', { weights: 'int4' }],
    ['int4, float32 activations, float32 KV', 'everyType', { weights: 'int4', accuracyLevel: 0, kv: 'fp32' }],
    ['float16 weights, paged', 'everyType', { dtype: 'fp16', attention: 'paged', blockSize: 16 }],
    ['int4 with a tied 8-bit lm_head', 'tied', { weights: 'int4' }],
  ]
  for (const [name, file, options] of forms) {
    it(`writes the same folder as one thread, byte for byte: ${name}`, async () => {
      const one = await importWith({ file: files[file], ...options, workers: 1 })
      expect(Object.keys(one)).toContain('model.onnx.data')
      for (const workers of [2, 5]) expect(await importWith({ file: files[file], ...options, workers })).toEqual(one)
    })
  }

  it('reports progress in bytes of model.onnx.data, in order, to the total', async () => {
    const seen: Array<[number, number]> = []
    await importGguf({ file: files.everyType, outDir: join(root, 'progress'), weights: 'int4', workers: 3, onProgress: (done, total) => seen.push([done, total]) })
    const total = seen[0]![1]
    expect(seen[0]![0]).toBe(0)
    expect(seen.at(-1)).toEqual([total, total])
    for (let i = 1; i < seen.length; i++) expect(seen[i]![0]).toBeGreaterThanOrEqual(seen[i - 1]![0])
  })

  it("fails with the worker's error (MODEL_LOAD naming the file) when the file is cut short mid-import, leaving no folder", async () => {
    for (const workers of [1, 3]) {
      const file = join(root, `cut-${workers}.gguf`)
      writeTinyGguf(file, EVERY_TYPE)
      const outDir = join(root, `cut-out-${workers}`)
      // The first progress report comes before any tensor is converted.
      let cut = false
      const onProgress = () => {
        if (cut) return
        cut = true
        truncateSync(file, 4096)
      }
      const failure = await importGguf({ file, outDir, weights: 'int4', workers, onProgress }).catch((error: unknown) => error)
      expect(failure, `workers ${workers}`).toMatchObject({ code: 'MODEL_LOAD' })
      expect((failure as Error).message).toContain(file)
      expect(existsSync(outDir)).toBe(false)
    }
  })

  it('refuses a worker count outside [1, 256]', async () => {
    for (const workers of [0, 257, 1.5]) {
      await expect(importGguf({ file: files.tied, outDir: join(root, 'never'), workers })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringContaining('workers must be an integer in [1, 256]') })
    }
  })
})
