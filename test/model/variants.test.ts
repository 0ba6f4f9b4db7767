// The model variants of `ortex make-model` that the executor must handle beyond the default
// float32 folders (docs/model-format.md, "Variants"): float16 past, present and logits in both
// attention forms (and float16 weights in the gqa form), a windowed GroupQueryAttention cache (as onnxruntime-genai's builder makes
// Gemma-2), and a window given only in genai_config.json (as it makes Mistral). The oracle is the
// plain onnxruntime-node loop (test/reference/reference.ts), one request at a time; the engine
// runs the same prompts alone, concurrently (batched decodes of rows with different past
// lengths), with chunked prefill and continuation turns, well past the window.

import { join } from 'node:path'
import { Engine } from 'ortex'
import { describe, expect, it } from 'vitest'
import { makeModel, type MakeModelOptions } from '../../ts/modelkit/make-model'
import { copyWithConfig, expectModelLoad, tinyPrompt, useTinyModels } from '../helpers/tiny-models'
import { ReferenceModel, argmax, emptyCache, forwardBatch, naiveGenerate } from '../reference/reference'

type NativeEngine = Awaited<ReturnType<typeof Engine.load>>

const WINDOW = 16
const VARIANTS = {
  'gqa fp16': { attention: 'gqa', kv: 'fp16' },
  'mha fp16': { attention: 'mha', kv: 'fp16' },
  // Float16 weights and arithmetic too, as the builder's `-p fp16 -e cuda` folders (on the CPU,
  // onnxruntime inserts float32 casts around nodes without a float16 kernel).
  'gqa dtype fp16': { attention: 'gqa', dtype: 'fp16' },
  // As the builder's CPU float16 folders: a chunk after a past fails inside the graph, so the
  // executor runs such rows one position per invocation.
  'mha fp16 square mask': { attention: 'mha', kv: 'fp16', causalMask: 'square' },
  'gqa window cache': { attention: 'gqa', window: { size: WINDOW, form: 'cache' } },
  'gqa fp16 window cache': { attention: 'gqa', kv: 'fp16', window: { size: WINDOW, form: 'cache' } },
  'gqa window config': { attention: 'gqa', window: { size: WINDOW, form: 'config' } },
  'gqa window graph': { attention: 'gqa', window: { size: WINDOW, form: 'graph' } },
  'gqa fp32': { attention: 'gqa' },
} satisfies Record<string, Omit<MakeModelOptions, 'outDir'>>
type Variant = keyof typeof VARIANTS

/** The folder the reference loop runs for each variant: itself, except that a window given only
 *  in genai_config.json (which the plain loop does not read) is checked against its twin with
 *  the window in the graph. */
const ORACLE: Partial<Record<Variant, Variant>> = { 'gqa window config': 'gqa window graph' }

const models = useTinyModels(
  'variants',
  Object.fromEntries(Object.entries(VARIANTS).map(([name, options]) => [name, { seed: 11, ...options }])) as Record<
    Variant,
    Omit<MakeModelOptions, 'outDir' | 'size'>
  >,
)
const { dirs, references } = models
const prompt = tinyPrompt

// Prompt lengths around and past the window; 40 new tokens each take every row past it.
const LENGTHS = [1, 5, 9, 17, 26, 41]
const NEW_TOKENS = 40
const FOLLOW_UP = [7, 3]

interface Run {
  first: number[][]
  /** Continuation turns of the first two requests. */
  second: number[][]
}

/** The plain loop, one request at a time; a continuation runs over its whole context. */
async function referenceRun(variant: Variant): Promise<Run> {
  const model = references[ORACLE[variant] ?? variant]
  const first: number[][] = []
  for (const [i, length] of LENGTHS.entries()) {
    first.push(await naiveGenerate(model, prompt(length, i), NEW_TOKENS, { ignoreEos: true }))
  }
  const second = await Promise.all(
    FOLLOW_UP.map((length, i) =>
      naiveGenerate(model, [...prompt(LENGTHS[i]!, i), ...first[i]!, ...prompt(length, 50 + i)], 12, { ignoreEos: true }),
    ),
  )
  return { first, second }
}

const expected = {} as Record<Variant, Promise<Run>>
const expectedRun = (variant: Variant) => (expected[variant] ??= referenceRun(variant))

const tokensOf = async (turn: { done: Promise<{ tokens: ArrayLike<number> }> }) => Array.from((await turn.done).tokens)

/** Half the requests at once; the rest join when the first has 10 tokens (decodes of rows with
 *  different past lengths batch together, prefill chunks run beside them); then continuations. */
async function engineRun(engine: NativeEngine): Promise<Run> {
  const requests = LENGTHS.map(() => engine.createRequest())
  const begin = (i: number) => requests[i]!.beginTurn(prompt(LENGTHS[i]!, i), { maxGeneratedTokens: NEW_TOKENS, ignoreEos: true })
  const half = LENGTHS.length / 2
  const turns = Array.from({ length: half }, (_, i) => begin(i))
  let seen = 0
  for await (const _chunk of turns[0]!) {
    if (++seen === 10) for (let i = half; i < LENGTHS.length; i++) turns.push(begin(i))
  }
  const first = await Promise.all(turns.map(tokensOf))
  const second = await Promise.all(
    FOLLOW_UP.map((length, i) => tokensOf(requests[i]!.beginTurn(prompt(length, 50 + i), { maxGeneratedTokens: 12, ignoreEos: true }))),
  )
  for (const request of requests) request.close()
  return { first, second }
}

async function withEngine<T>(dir: string, options: object, f: (engine: NativeEngine) => Promise<T>): Promise<T> {
  const engine = await Engine.load(dir, { intraOpThreads: 1, ...options })
  engine.start()
  try {
    return await f(engine)
  } finally {
    await engine.close()
  }
}

describe.each(Object.keys(VARIANTS).filter((v) => v !== 'gqa fp32') as Variant[])('%s', (variant) => {
  it('alone, concurrent with chunked prefill, and continued: the plain loop token for token, past the window', async () => {
    const want = await expectedRun(variant)
    // maxScheduledTokens 8: the longer prompts prefill in chunks beside the decodes.
    const got = await withEngine(dirs[variant], { maxScheduledTokens: 8 }, engineRun)
    expect(got).toEqual(want)
    const alone = await withEngine(dirs[variant], {}, (engine) =>
      tokensOf(engine.generate(prompt(LENGTHS[5]!, 5), { maxGeneratedTokens: NEW_TOKENS, ignoreEos: true })),
    )
    expect(alone).toEqual(want.first[5])
  })

  it.runIf(variant === 'mha fp16 square mask')('runs chunks after a past one position at a time', async () => {
    const stats = await withEngine(dirs[variant], { maxScheduledTokens: 8 }, async (engine) => {
      await engineRun(engine)
      return engine.executorStats() as unknown as { positionRounds: number }
    })
    expect(stats.positionRounds).toBeGreaterThan(0)
    // The mask really refuses such a chunk (the reference loop's batch-1 chunk fails in the graph).
    const model = references[variant]
    const [head] = await forwardBatch(model, [{ cache: emptyCache(model), tokens: prompt(4, 1) }])
    await expect(forwardBatch(model, [{ cache: head!.cache, tokens: prompt(3, 2) }])).rejects.toThrow(/expand/i)
  })

  it('without shared buffers or carried present (every decode gathers) the same tokens', async () => {
    for (const env of [{ ORTEX_SHARE_PAST: '0' }, { ORTEX_CARRY_PRESENT: '0' }]) {
      Object.assign(process.env, env)
      try {
        const got = await withEngine(dirs[variant], { maxScheduledTokens: 8 }, engineRun)
        expect(got, JSON.stringify(env)).toEqual(await expectedRun(variant))
      } finally {
        for (const key of Object.keys(env)) delete process.env[key]
      }
    }
  })
})

describe('a window wider than the first shared buffers', () => {
  // Shared decode buffers start 192 positions wide (crates/ortex-ort/src/shared_past.rs); a
  // windowed cache must get at least its window there too, and rows must go past it.
  it('a 200-position windowed cache: concurrent rows past the window equal the plain loop', async () => {
    const dir = join(models.root(), 'window-200')
    await makeModel({ outDir: dir, size: 'tiny', seed: 11, attention: 'gqa', window: { size: 200, form: 'cache' } })
    const model = await ReferenceModel.load(dir)
    const prompts = [prompt(9, 1), prompt(41, 2)]
    try {
      const want = await Promise.all(prompts.map((p) => naiveGenerate(model, p, 220, { ignoreEos: true })))
      const got = await withEngine(dir, { maxScheduledTokens: 16 }, (engine) =>
        Promise.all(prompts.map((p) => tokensOf(engine.generate(p, { maxGeneratedTokens: 220, ignoreEos: true })))),
      )
      expect(got).toEqual(want)
    } finally {
      await model.release()
    }
  })
})

describe('the variants differ where they should', () => {
  it('a window changes the tokens once a row is past it; the config window equals the graph window', async () => {
    const [full, graph, config, cache] = await Promise.all(
      (['gqa fp32', 'gqa window graph', 'gqa window config', 'gqa window cache'] as const).map((v) =>
        withEngine(dirs[v], {}, (engine) => tokensOf(engine.generate(prompt(9, 1), { maxGeneratedTokens: NEW_TOKENS, ignoreEos: true }))),
      ),
    )
    // Within the window (prompt 9 + 7 new tokens = 16 positions) every form agrees.
    expect(graph!.slice(0, 7)).toEqual(full!.slice(0, 7))
    expect(cache!.slice(0, 7)).toEqual(full!.slice(0, 7))
    expect(graph).not.toEqual(full)
    expect(cache).not.toEqual(full)
    expect(config).toEqual(graph)
  })

  it('float16 KV takes half the bytes per position of its float32 twin, and gives close logits', async () => {
    const bytes = await Promise.all(
      (['gqa fp32', 'gqa fp16'] as const).map((v) => withEngine(dirs[v], {}, async (engine) => engine.executorStats()!)),
    )
    const [fp32, fp16] = bytes.map((s) => s as unknown as { kvPositionBytes: number; kvStoreBytes: number })
    // tiny: 2 layers x keys and values x 2 KV heads x 16 = 128 elements a position.
    expect(fp32!.kvPositionBytes).toBe(128 * 4)
    expect(fp16!.kvPositionBytes).toBe(128 * 2)
    expect(fp16!.kvStoreBytes * 2).toBe(fp32!.kvStoreBytes)
    // The same weights: the first tokens agree (float16 rounding only).
    const p = prompt(9, 3)
    const [a, b] = await Promise.all(
      (['gqa fp32', 'gqa fp16'] as const).map((v) => naiveGenerate(references[v], p, 4, { ignoreEos: true })),
    )
    expect(b!.slice(0, 2)).toEqual(a!.slice(0, 2))
  })
})

describe('the reference loop on a windowed cache', () => {
  it('batched rows of different past lengths and chunked prefill past the window equal each row alone', async () => {
    const model = references['gqa window cache']
    expect(model.windowCaches).toEqual([WINDOW, 0])
    const prompts = [prompt(20, 1), prompt(3, 2)]
    const alone = await Promise.all(prompts.map((p) => naiveGenerate(model, p, 24, { ignoreEos: true })))
    // Prefill in two chunks (the second with past), then decode both rows together.
    const rows = []
    for (const p of prompts) {
      const [head] = await forwardBatch(model, [{ cache: emptyCache(model), tokens: p.slice(0, 2) }])
      const [rest] = p.length > 2 ? await forwardBatch(model, [{ cache: head!.cache, tokens: p.slice(2) }]) : [head]
      rows.push(rest!)
    }
    const tokens = rows.map((r) => [argmax(r.logits.at(-1)!)])
    let caches = rows.map((r) => r.cache)
    for (let step = 1; step < 24; step++) {
      const out = await forwardBatch(model, caches.map((cache, i) => ({ cache, tokens: [tokens[i]!.at(-1)!] })))
      out.forEach((r, i) => tokens[i]!.push(argmax(r.logits[0]!)))
      caches = out.map((r) => r.cache)
    }
    expect(tokens).toEqual(alone)
  })
})

describe('Engine.load refuses what it does not implement, naming it', () => {
  const refused = (dir: string, ...named: string[]) => expectModelLoad(dir, {}, ...named)
  const variant = (from: Variant, name: string, edit: (config: any) => void) =>
    copyWithConfig(dirs[from], join(models.root(), name), edit)

  it('a config field that would change what the model computes', async () => {
    await refused(variant('gqa fp32', 'softcap', (c) => (c.model.decoder.final_logit_softcapping = 30)), 'final_logit_softcapping')
    await refused(variant('gqa fp32', 'vision', (c) => (c.model.vision = { filename: 'vision.onnx' })), 'model.vision')
    await refused(variant('gqa fp32', 'pipeline', (c) => (c.model.decoder.pipeline = [])), 'model.decoder.pipeline')
    await refused(variant('gqa fp32', 'type', (c) => (c.model.type = 'whisper')), 'model.type', 'whisper')
  })

  it('a window the graph contradicts, or one it has no place for', async () => {
    const other = (c: any) => (c.model.decoder.sliding_window.window_size = WINDOW * 2)
    await refused(variant('gqa window cache', 'other-window', other), 'window_size is 32', 'local_window_size 16')
    const window = (c: any) =>
      (c.model.decoder.sliding_window = { window_size: WINDOW, slide_key_value_cache: false, slide_inputs: false, layers: [] })
    await refused(variant('mha fp16', 'mha-window', window), 'sliding_window', 'plain ONNX operators')
  })
})
