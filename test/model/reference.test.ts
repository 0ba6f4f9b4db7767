// The reference loop (test/reference/reference.ts) on onnxruntime-node over tiny generated models, and
// the padding contract the engine's executor relies on (docs/model-format.md): batched rows with
// different past lengths equal each row alone, for both attention forms.

import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { layerName } from '../../ts/modelkit/genai-config'
import { makeModel } from '../../ts/modelkit/make-model'
import {
  ReferenceModel,
  argmax,
  emptyCache,
  forwardBatch,
  naiveGenerate,
  referenceGenerate,
  type KvCache,
} from '../reference/reference'

const FORMS = ['mha', 'gqa'] as const
const PROMPTS = [
  [1, 312, 455, 306, 311, 282],
  [1, 40, 41, 42],
  [7],
  [1, 100, 200, 300, 400, 500, 260, 270, 280, 290, 301],
]

let root: string
const dirs: Record<string, string> = {}
const models: Record<string, ReferenceModel> = {}

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'ortex-reference-'))
  for (const form of FORMS) {
    dirs[form] = join(root, form)
    await makeModel({ outDir: dirs[form]!, size: 'tiny', attention: form, seed: 3 })
    models[form] = await ReferenceModel.load(dirs[form]!)
  }
})

afterAll(async () => {
  for (const m of Object.values(models)) await m.release()
  if (root) rmSync(root, { recursive: true, force: true })
})

function maxAbsDiff(x: Float32Array, y: Float32Array): number {
  expect(x.length).toBe(y.length)
  let d = 0
  for (let i = 0; i < x.length; i++) d = Math.max(d, Math.abs(x[i]! - y[i]!))
  return d
}

function expectSameCache(x: KvCache, y: KvCache): void {
  expect(x.length).toBe(y.length)
  x.keys.forEach((k, l) => expect(maxAbsDiff(k, y.keys[l]!)).toBeLessThan(1e-5))
  x.values.forEach((v, l) => expect(maxAbsDiff(v, y.values[l]!)).toBeLessThan(1e-5))
}

/** Prefills one row alone (batch 1, empty past). */
async function prefill(model: ReferenceModel, tokens: number[]) {
  const [r] = await forwardBatch(model, [{ cache: emptyCache(model), tokens }])
  return r!
}

describe.each(FORMS)('%s form', (form) => {
  it('loads in onnxruntime-node and runs', async () => {
    const model = models[form]!
    expect(model.attention).toBe(form)
    const c = model.config
    const feeds: Record<string, ort.Tensor> = {
      ...model.emptyPast(1),
      [c.inputIds]: new ort.Tensor('int64', BigInt64Array.from([1n, 5n, 9n]), [1, 3]),
      [c.attentionMask]: new ort.Tensor('int64', BigInt64Array.from([1n, 1n, 1n]), [1, 3]),
    }
    if (c.positionIds) feeds[c.positionIds] = new ort.Tensor('int64', BigInt64Array.from([0n, 1n, 2n]), [1, 3])
    const out = await model.run(feeds)
    expect(out[c.logits]!.dims).toEqual([1, 3, 512])
    expect(out[layerName(c.presentKeyNames, 1)]!.dims).toEqual([1, 2, 3, 16])
    const logits = out[c.logits]!.data as Float32Array
    expect(logits.every(Number.isFinite)).toBe(true)
  })

  it('greedy output of 8 tokens is deterministic and varies across prompts', async () => {
    const model = models[form]!
    const outputs: string[] = []
    for (const p of PROMPTS) {
      const x = await naiveGenerate(model, p, 8, { ignoreEos: true })
      const y = await referenceGenerate(dirs[form]!, p, 8, { greedy: true, ignoreEos: true })
      expect(x).toHaveLength(8)
      expect(y).toEqual(x)
      outputs.push(x.join(','))
    }
    expect(new Set(outputs).size).toBeGreaterThanOrEqual(3)
  })

  it('stops after EOS unless ignoreEos', async () => {
    const model = models[form]!
    let calls = 0
    const pick = (logits: Float32Array) => (++calls === 3 ? 2 : argmax(logits))
    expect(await naiveGenerate(model, [1, 5], 8, { pick })).toHaveLength(3)
    calls = 0
    const all = await naiveGenerate(model, [1, 5], 8, { pick, ignoreEos: true })
    expect(all).toHaveLength(8)
    expect(all[2]).toBe(2)
  })

  it('chunked prefill (batch 1, with past) equals a one-shot prefill', async () => {
    const model = models[form]!
    const prompt = PROMPTS[3]!
    const whole = await prefill(model, prompt)
    const first = await prefill(model, prompt.slice(0, 4))
    const [second] = await forwardBatch(model, [{ cache: first.cache, tokens: prompt.slice(4) }])
    expectSameCache(second!.cache, whole.cache)
    const lastWhole = whole.logits[prompt.length - 1]!
    const lastChunked = second!.logits[prompt.length - 5]!
    expect(maxAbsDiff(lastChunked, lastWhole)).toBeLessThan(1e-4)
  })

  it('batched decode of rows with different past lengths (right-padded past) equals each row alone', async () => {
    const model = models[form]!
    const prompts = [PROMPTS[0]!, PROMPTS[2]!, PROMPTS[3]!] // past lengths 6, 1, 11
    const steps = 6
    // Alone: the plain loop.
    const alone = await Promise.all(prompts.map((p) => naiveGenerate(model, p, steps, { ignoreEos: true })))
    // Batched: prefill each row alone, then decode all rows together, one invocation per step.
    const rows = await Promise.all(prompts.map((p) => prefill(model, p)))
    const tokens = rows.map((r) => [argmax(r.logits[r.logits.length - 1]!)])
    let caches = rows.map((r) => r.cache)
    for (let s = 1; s < steps; s++) {
      const batched = await forwardBatch(model, caches.map((cache, i) => ({ cache, tokens: [tokens[i]!.at(-1)!] })))
      // Each row alone gives the same logits and the same new KV.
      for (let i = 0; i < prompts.length; i++) {
        const [single] = await forwardBatch(model, [{ cache: caches[i]!, tokens: [tokens[i]!.at(-1)!] }])
        expect(maxAbsDiff(batched[i]!.logits[0]!, single!.logits[0]!)).toBeLessThan(1e-4)
        expectSameCache(batched[i]!.cache, single!.cache)
      }
      batched.forEach((r, i) => tokens[i]!.push(argmax(r.logits[0]!)))
      caches = batched.map((r) => r.cache)
    }
    expect(tokens).toEqual(alone)
  })

  it('a one-token prompt without past joins a decode batch', async () => {
    const model = models[form]!
    const a = await prefill(model, PROMPTS[0]!)
    const rows = [
      { cache: a.cache, tokens: [42] },
      { cache: emptyCache(model), tokens: [9] },
    ]
    const batched = await forwardBatch(model, rows)
    for (let i = 0; i < rows.length; i++) {
      const [single] = await forwardBatch(model, [rows[i]!])
      expect(maxAbsDiff(batched[i]!.logits[0]!, single!.logits[0]!)).toBeLessThan(1e-4)
      expectSameCache(batched[i]!.cache, single!.cache)
    }
  })

  it('a batch of first prompts of different lengths (right-padded) equals each prompt alone', async () => {
    const model = models[form]!
    const prompts = [PROMPTS[0]!, PROMPTS[1]!, PROMPTS[2]!]
    const batched = await forwardBatch(
      model,
      prompts.map((tokens) => ({ cache: emptyCache(model), tokens })),
    )
    for (let i = 0; i < prompts.length; i++) {
      const single = await prefill(model, prompts[i]!)
      const n = prompts[i]!.length
      expect(maxAbsDiff(batched[i]!.logits[n - 1]!, single.logits[n - 1]!)).toBeLessThan(1e-4)
      expectSameCache(batched[i]!.cache, single.cache)
    }
  })
})

describe('attention forms', () => {
  it('mha and gqa folders from the same seed give the same greedy tokens', async () => {
    for (const p of PROMPTS) {
      const x = await naiveGenerate(models.mha!, p, 16, { ignoreEos: true })
      const y = await naiveGenerate(models.gqa!, p, 16, { ignoreEos: true })
      expect(y).toEqual(x)
    }
  })

  it('mha runs a mixed batch (a decode row and a prefill chunk with past) in one invocation', async () => {
    const model = models.mha!
    const a = await prefill(model, PROMPTS[0]!)
    const b = await prefill(model, PROMPTS[3]!.slice(0, 3))
    const rows = [
      { cache: a.cache, tokens: [42] },
      { cache: b.cache, tokens: PROMPTS[3]!.slice(3) },
    ]
    const batched = await forwardBatch(model, rows)
    for (let i = 0; i < rows.length; i++) {
      const [single] = await forwardBatch(model, [rows[i]!])
      const n = rows[i]!.tokens.length
      expect(maxAbsDiff(batched[i]!.logits[n - 1]!, single!.logits[n - 1]!)).toBeLessThan(1e-4)
      expectSameCache(batched[i]!.cache, single!.cache)
    }
  })

  it('gqa refuses past context with several new tokens in a batch (such rows run as batch 1)', async () => {
    const model = models.gqa!
    const a = await prefill(model, PROMPTS[0]!)
    const b = await prefill(model, PROMPTS[1]!)
    await expect(
      forwardBatch(model, [
        { cache: a.cache, tokens: [5, 6] },
        { cache: b.cache, tokens: [7, 8] },
      ]),
    ).rejects.toThrow(/batch 1/)
    // And ONNX Runtime itself refuses it (the reason forwardBatch checks first).
    const c = model.config
    const P = 2
    const feeds: Record<string, ort.Tensor> = {
      [c.inputIds]: new ort.Tensor('int64', BigInt64Array.from([5n, 6n, 7n, 8n]), [2, 2]),
      [c.attentionMask]: new ort.Tensor('int64', new BigInt64Array(2 * (P + 2)).fill(1n), [2, P + 2]),
    }
    for (let l = 0; l < c.numLayers; l++) {
      for (const t of [c.pastKeyNames, c.pastValueNames]) {
        feeds[layerName(t, l)] = new ort.Tensor('float32', new Float32Array(2 * 2 * P * 16), [2, 2, P, 16])
      }
    }
    await expect(model.run(feeds)).rejects.toThrow(/batch_size must be 1/)
  })
})
