// The engine on real ONNX models (crates/ortex-ort through the native addon), over tiny models
// generated at test time in both attention forms. The ground truth is test/reference/reference.ts's
// plain single-request loop on onnxruntime-node: no paging, no batching.

import { spawnSync } from 'node:child_process'
import { cpSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import os from 'node:os'
import { join, resolve } from 'node:path'
import { Engine, OrtexError } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { expectModelLoad, tinyPrompt, useTinyModels } from '../helpers/tiny-models'
import { naiveGenerate } from '../reference/reference'
import { streamedChunks } from '../reference/streaming-text'

const FORMS = ['mha', 'gqa'] as const
type Form = (typeof FORMS)[number]
type NativeEngine = Awaited<ReturnType<typeof Engine.load>>
type Turn = ReturnType<NativeEngine['generate']>

const models = useTinyModels('engine', { mha: { attention: 'mha', seed: 7 }, gqa: { attention: 'gqa', seed: 7 } })
const { dirs, references } = models
const prompt = tinyPrompt

const LENGTHS = [1, 3, 7, 12, 20, 33, 5, 41]
const ARRIVAL_STEPS = [0, 0, 1, 2, 4, 5, 7, 9]
const MAX_NEW = 12
const CONTINUE_NEW = 6

interface Workload {
  first: number[][]
  second: (number[] | null)[]
}

/** Runs 8 requests arriving at different steps (caller-driven), each with a first turn and, for
 *  every other one, a continuation turn once the first is done. Returns each turn's tokens. */
async function runWorkload(engine: NativeEngine, options: { temperature?: number; seed?: number } = {}): Promise<Workload> {
  const buffer = engine.createEventBuffer(64)
  const requests = LENGTHS.map(() => engine.createRequest())
  const first: (Turn | null)[] = LENGTHS.map(() => null)
  const second: (Turn | null)[] = LENGTHS.map(() => null)
  const turnOptions = (i: number, max: number) => ({
    maxGeneratedTokens: max,
    ...(options.temperature === undefined ? {} : { temperature: options.temperature, topK: 40, seed: (options.seed ?? 0) + i }),
  })
  for (let step = 0; step < 10_000; step++) {
    LENGTHS.forEach((length, i) => {
      if (first[i] === null && ARRIVAL_STEPS[i]! <= step) {
        first[i] = requests[i]!.beginTurn(prompt(length, i), turnOptions(i, MAX_NEW))
      }
    })
    await engine.run(buffer)
    for (let i = 0; i < LENGTHS.length; i += 2) {
      const request = requests[i]!
      if (second[i] === null && first[i] !== null && request.state === 'turn-complete') {
        try {
          second[i] = request.beginTurn(prompt(4 + i, 100 + i), turnOptions(i, CONTINUE_NEW))
        } catch (error) {
          if ((error as OrtexError).code !== 'EVENTS_PENDING') throw error
        }
      }
    }
    engine.checkInvariants()
    const allStarted = first.every((t) => t !== null) && second.every((t, i) => i % 2 === 1 || t !== null)
    if (allStarted && !engine.hasPendingWork()) break
  }
  const tokens = async (turn: Turn | null) => (turn === null ? null : Array.from((await turn.done).tokens))
  const result: Workload = {
    first: (await Promise.all(first.map(tokens))) as number[][],
    second: await Promise.all(second.map(tokens)),
  }
  for (const request of requests) request.close()
  return result
}

/** What the plain loop gives for the same workload (continuations over the full context). */
async function referenceWorkload(form: Form): Promise<Workload> {
  const model = references[form]
  const first: number[][] = []
  const second: (number[] | null)[] = []
  for (let i = 0; i < LENGTHS.length; i++) {
    const p = prompt(LENGTHS[i]!, i)
    const out = await naiveGenerate(model, p, MAX_NEW)
    first.push(out)
    second.push(i % 2 === 0 ? await naiveGenerate(model, [...p, ...out, ...prompt(4 + i, 100 + i)], CONTINUE_NEW) : null)
  }
  return { first, second }
}

/** Whether ortex packs a session's weights into 2 MiB-aligned chunks here: Linux with transparent
 *  huge pages not off (crates/ortex-ort/src/weight_chunks.rs). */
function weightChunksExpected(): boolean {
  try {
    return !readFileSync('/sys/kernel/mm/transparent_hugepage/enabled', 'utf8').includes('[never]')
  } catch {
    return false
  }
}

const reference = {} as Record<Form, Promise<Workload>>
function referenceFor(form: Form): Promise<Workload> {
  reference[form] ??= referenceWorkload(form)
  return reference[form]
}

describe.each(FORMS)('%s form', (form) => {
  // maxScheduledTokens 16: the 20-, 33- and 41-token prompts prefill in chunks, beside decodes.
  const options = { maxScheduledTokens: 16, intraOpThreads: 1 }

  it('greedy tokens of staggered concurrent requests with chunked prefill and continuations equal the plain loop', async () => {
    const engine = await Engine.load(dirs[form], options)
    try {
      expect(engine.backend).toBe('native')
      expect(engine.config.vocabSize).toBe(512)
      expect(engine.config.maxLength).toBe(2048)
      expect(engine.config.eosTokenIds).toEqual([2])
      const got = await runWorkload(engine)
      expect(got).toEqual(await referenceFor(form))
      const stats = engine.executorStats()!
      expect(stats.steps).toBeGreaterThan(0)
      expect(stats.invocations).toBeGreaterThanOrEqual(stats.steps)
      expect(stats.runUs).toBeGreaterThan(0)
      expect(stats.executeUs).toBeGreaterThanOrEqual(stats.gatherUs + stats.runUs + stats.scatterUs)
      expect(stats.hugePageBytes % (2 << 20)).toBe(0) // whole 2 MiB pages (the tiny model may have none)
      if (weightChunksExpected()) expect(stats.weightChunkBytes).toBeGreaterThan(0)
      // Stable stretches of decode steps pass present back as past (gqa: always; mha: only rows of
      // equal length, which this workload does not have).
      if (form === 'gqa') expect(stats.carried).toBeGreaterThan(0)
      // Where ONNX Runtime placed the nodes, as it recorded them: all on its CPU provider.
      const placement = engine.nodePlacement()!
      expect(placement.executionProvider).toBe('cpu')
      expect(Object.keys(placement.providers)).toEqual(['CPUExecutionProvider'])
      const ops = placement.providers.CPUExecutionProvider
      expect(ops.MatMul).toBeGreaterThan(0)
      const layers = JSON.parse(readFileSync(join(dirs[form], 'genai_config.json'), 'utf8')).model.decoder.num_hidden_layers
      expect(ops['com.microsoft:GroupQueryAttention'] ?? 0).toBe(form === 'gqa' ? layers : 0)
      expect(placement.cpuFallback).toBeNull()
    } finally {
      await engine.close()
    }
  })

  it('the default KV pool is held to a quarter of the machine, and a kvCacheBytes budget shrinks it without changing greedy tokens', async () => {
    const engine = await Engine.load(dirs[form], options)
    const { blockSize, maxBatchSize, maxLength, kvPositionBytes, numBlocks, kvCacheBytes } = engine.config
    const blockBytes = blockSize * kvPositionBytes
    const defaultStoreBytes = engine.executorStats()!.kvStoreBytes
    expect(kvPositionBytes).toBe(engine.executorStats()!.kvPositionBytes)
    await engine.close()
    const full = maxBatchSize * Math.ceil(maxLength / blockSize)
    expect(numBlocks).toBe(Math.min(full, Math.floor(Math.floor(os.totalmem() / 4) / blockBytes)))
    expect(kvCacheBytes).toBe(numBlocks * blockBytes)

    // 64 blocks hold the workload (8 requests of at most 41 + 12 + 10 + 6 positions) but are far
    // fewer than the default 16 rows of 2048 positions.
    const budget = 64 * blockBytes + blockBytes - 1
    const small = await Engine.load(dirs[form], { ...options, kvCacheBytes: budget })
    try {
      expect(small.config.numBlocks).toBe(64)
      expect(small.config.kvCacheBytes).toBe(64 * blockBytes)
      expect(small.executorStats()!.kvStoreBytes).toBeGreaterThanOrEqual(64 * blockBytes)
      expect(small.executorStats()!.kvStoreBytes).toBeLessThan(defaultStoreBytes)
      expect(await runWorkload(small)).toEqual(await referenceFor(form))
    } finally {
      await small.close()
    }
  })

  it('a session built without weight chunks gives the same tokens', async () => {
    process.env.ORTEX_WEIGHT_CHUNKS = '0'
    const engine = await Engine.load(dirs[form], options).finally(() => delete process.env.ORTEX_WEIGHT_CHUNKS)
    try {
      expect(await runWorkload(engine)).toEqual(await referenceFor(form))
      expect(engine.executorStats()!.weightChunkBytes).toBe(0)
    } finally {
      await engine.close()
    }
  })

  it('decode steps that carry present over as past give the same tokens as gathering', async () => {
    // Equal prompt lengths arriving together, prefilled in one step: every decode step after the
    // first continues the last one's rows, and the rows share one past length (what mha needs).
    const prompts = [0, 1, 2, 3].map((i) => prompt(9, 50 + i))
    const expected = await Promise.all(prompts.map((p) => naiveGenerate(references[form], p, 16, { ignoreEos: true })))
    // gqa decodes share one buffer as past and present unless ORTEX_SHARE_PAST=0 (then they carry
    // ONNX Runtime's present tensors, as mha does); intraOpSpinning changes threading only.
    const variants = [
      { env: { ORTEX_CARRY_PRESENT: '1' }, carries: true },
      { env: { ORTEX_CARRY_PRESENT: '0' }, carries: false },
      { env: { ORTEX_SHARE_PAST: '0' }, carries: true },
      { env: {}, carries: true, intraOpSpinning: true },
    ]
    for (const variant of variants) {
      Object.assign(process.env, variant.env)
      const engine = await Engine.load(dirs[form], {
        intraOpThreads: 1,
        ...(variant.intraOpSpinning ? { intraOpSpinning: true } : {}),
      }).finally(() => {
        for (const key of Object.keys(variant.env)) delete process.env[key]
      })
      try {
        const turns = prompts.map((p) => engine.generate(p, { maxGeneratedTokens: 16, ignoreEos: true }))
        const got = await Promise.all(turns.map(async (t) => Array.from((await t.done).tokens)))
        expect(got, JSON.stringify(variant)).toEqual(expected)
        const { carried, steps } = engine.executorStats()!
        expect(carried).toBe(variant.carries ? steps - 2 : 0) // not the prefill nor the first decode
      } finally {
        await engine.close()
      }
    }
  })

  it('decode rows that outgrow their shared buffers refill them from the blocks', async () => {
    // 9-token prompts: the first shared buffers (gqa) hold 64 positions (32 of headroom, in steps
    // of 32), so 240 new tokens refill them three times on the way: at 64, 128 and 192.
    const prompts = [prompt(9, 70), prompt(9, 71)]
    const expected = await Promise.all(prompts.map((p) => naiveGenerate(references[form], p, 240, { ignoreEos: true })))
    const engine = await Engine.load(dirs[form], { intraOpThreads: 1 })
    try {
      const turns = prompts.map((p) => engine.generate(p, { maxGeneratedTokens: 240, ignoreEos: true }))
      const got = await Promise.all(turns.map(async (t) => Array.from((await t.done).tokens)))
      expect(got).toEqual(expected)
      const { carried, steps } = engine.executorStats()!
      // Not carried: the prefill, the first decode and (gqa) the three refills.
      expect(carried).toBe(steps - (form === 'gqa' ? 5 : 2))
    } finally {
      await engine.close()
    }
  })

  it('static batching gives the same tokens as dynamic', async () => {
    const engine = await Engine.load(dirs[form], { ...options, batching: 'static', maxBatchSize: 4 })
    try {
      expect(engine.config.batching).toBe('static')
      expect(await runWorkload(engine)).toEqual(await referenceFor(form))
    } finally {
      await engine.close()
    }
  })

  it('seeded sampling is reproducible', async () => {
    const runs: Workload[] = []
    for (let i = 0; i < 2; i++) {
      const engine = await Engine.load(dirs[form], options)
      try {
        runs.push(await runWorkload(engine, { temperature: 0.9, seed: 11 }))
      } finally {
        await engine.close()
      }
    }
    expect(runs[1]).toEqual(runs[0])
    expect(runs[0]).not.toEqual(await referenceFor(form)) // it did sample
  })
})

describe('text on a real tokenizer', () => {
  let engine: NativeEngine
  beforeAll(async () => {
    engine = await Engine.load(dirs.gqa, { intraOpThreads: 1 })
  })
  afterAll(async () => {
    await engine?.close()
  })

  it('tokenize and detokenize round-trip', () => {
    for (const text of ['The river starts as a thin line of water.', 'héllo wörld ✓ 日本語 🙂', ' ', 'a\nb\tc']) {
      const ids = engine.tokenize(text)
      expect(ids).toBeInstanceOf(Int32Array)
      expect(ids.length).toBeGreaterThan(0)
      expect(engine.detokenize(ids)).toBe(text)
    }
    expect(engine.tokenize('')).toEqual(new Int32Array(0))
    expect(() => engine.detokenize([512])).toThrow(expect.objectContaining({ code: 'INVALID_ARGUMENT' }))
  })

  it('a string prompt is tokenized', async () => {
    const text = 'The river starts as a thin line'
    const fromText = await engine.generate(text, { maxGeneratedTokens: 8, ignoreEos: true }).done
    const fromIds = await engine.generate(engine.tokenize(text), { maxGeneratedTokens: 8, ignoreEos: true }).done
    expect(Array.from(fromText.tokens)).toEqual(Array.from(fromIds.tokens))
    expect(fromText.usage.promptTokens).toBe(engine.tokenize(text).length)
    const plain = await naiveGenerate(references.gqa, Array.from(engine.tokenize(text)), 8, { ignoreEos: true })
    expect(Array.from(fromText.tokens)).toEqual(plain)
  })

  it('streamed text deltas equal the detokenized tokens, also when a multi-byte character spans tokens', async () => {
    // Sampled byte tokens now and then form a valid multi-byte character (each byte one token).
    const turns = Array.from({ length: 8 }, (_, i) =>
      engine.generate('Once upon a time', { maxGeneratedTokens: 300, ignoreEos: true, temperature: 1.5, seed: 1000 + i }),
    )
    let spanning = 0
    await Promise.all(
      turns.map(async (turn) => {
        const chunks: string[] = []
        for await (const chunk of turn) chunks.push(chunk.text)
        const streamed = chunks.join('')
        const result = await turn.done
        const whole = engine.detokenize(result.tokens)
        expect(streamed).toBe(whole)
        expect(result.text).toBe(whole)
        // Each chunk's text is what the facade's own detokenizer gave it before the core made it.
        expect(chunks).toEqual(streamedChunks((ids) => engine.detokenize(ids), result.tokens).chunks)
        // A non-ASCII character other than U+FFFD needs several byte tokens (merges are ASCII).
        if (/[^\x00-\x7f\ufffd]/u.test(whole)) spanning++
      }),
    )
    expect(spanning).toBeGreaterThan(0)
  })

  it('a stop string ends the turn with reason stop, the text cut before it', async () => {
    const input = 'The river starts'
    const free = await engine.generate(input, { maxGeneratedTokens: 24, ignoreEos: true }).done
    const stop = free.text.slice(6, 9)
    expect(stop.length).toBe(3)
    const stopped = await engine.generate(input, { maxGeneratedTokens: 24, ignoreEos: true, stop: [stop] }).done
    expect(stopped.finishReason).toBe('stop')
    expect(stopped.text).toBe(free.text.slice(0, free.text.indexOf(stop)))
    const before = streamedChunks((ids) => engine.detokenize(ids), free.tokens, [stop])
    expect(Array.from(stopped.tokens)).toEqual(Array.from(free.tokens.subarray(0, before.chunks.length)))
    expect(stopped.stop).toEqual({ kind: 'string', index: before.stopIndex })
  })
})

describe('Engine.load errors', () => {
  const modelLoad = expectModelLoad

  /** A copy of the gqa folder, changed by `edit`. */
  const variant = (name: string, edit: (dir: string) => void): string => {
    const dir = join(models.root(), name)
    cpSync(dirs.gqa, dir, { recursive: true })
    edit(dir)
    return dir
  }

  const editConfig = (dir: string, edit: (config: any) => void) => {
    const file = join(dir, 'genai_config.json')
    const config = JSON.parse(readFileSync(file, 'utf8'))
    edit(config)
    writeFileSync(file, JSON.stringify(config))
  }

  it('a missing folder', async () => {
    await modelLoad(join(models.root(), 'no-such-model'), {}, 'no-such-model')
  })

  it('a folder without model.onnx', async () => {
    const dir = variant('no-onnx', (d) => rmSync(join(d, 'model.onnx')))
    await modelLoad(dir, {}, 'model.onnx', 'missing')
  })

  it('a corrupt genai_config.json', async () => {
    const dir = variant('corrupt-config', (d) => writeFileSync(join(d, 'genai_config.json'), '{"model": {"vocab_size": 5'))
    await modelLoad(dir, {}, 'genai_config.json', 'not valid JSON')
    const missing = variant('incomplete-config', (d) => editConfig(d, (c) => delete c.model.decoder.num_hidden_layers))
    await modelLoad(missing, {}, 'genai_config.json', 'num_hidden_layers')
    const heads = variant('inconsistent-heads', (d) => editConfig(d, (c) => (c.model.decoder.num_key_value_heads = 3)))
    await modelLoad(heads, {}, 'genai_config.json', 'num_key_value_heads')
  })

  it('a vocabulary that does not match the model or the tokenizer', async () => {
    const wide = variant('vocab-wide', (d) => editConfig(d, (c) => (c.model.vocab_size = 600)))
    await modelLoad(wide, {}, 'genai_config.json', 'vocab_size', '512')
    const narrow = variant('vocab-narrow', (d) => editConfig(d, (c) => (c.model.vocab_size = 400)))
    await modelLoad(narrow, {}, 'tokenizer.json', 'vocab_size')
  })

  it('a missing or broken tokenizer.json', async () => {
    await modelLoad(variant('no-tokenizer', (d) => rmSync(join(d, 'tokenizer.json'))), {}, 'tokenizer.json', 'missing')
    await modelLoad(variant('bad-tokenizer', (d) => writeFileSync(join(d, 'tokenizer.json'), '{}')), {}, 'tokenizer.json')
  })

  it("executionProvider 'cuda' after this process opened the CPU library, or without the CUDA package", async () => {
    // Earlier loads opened the CPU ONNX Runtime; where npm/linux-x64-gnu-cuda is not filled (as
    // test/model/cuda-runtime.test.ts fills it), the package is missing first. Neither runs on the CPU.
    const error = await Engine.load(dirs.gqa, { executionProvider: 'cuda' }).catch((e: unknown) => e as OrtexError)
    expect(error).toBeInstanceOf(OrtexError)
    expect(error.code).toBe('UNSUPPORTED')
    expect(error.message).toMatch(/this process already opened the ONNX Runtime library .*libonnxruntime\.so\.1|the package ortex-linux-x64-gnu-cuda, which is not installed/)
  })

  it('options are checked', async () => {
    await expect(Engine.load(dirs.gqa, { intraOpThreads: -1 } as never)).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    await expect(Engine.load(dirs.gqa, { intraOpSpinning: 1 } as never)).rejects.toMatchObject({
      code: 'INVALID_ARGUMENT',
      message: expect.stringContaining('intraOpSpinning'),
    })
    await expect(Engine.load(dirs.gqa, { numBlocks: 0 } as never)).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    for (const kvCacheBytes of [0, -1, 1.5, 2 ** 53, '1']) {
      await expect(Engine.load(dirs.gqa, { kvCacheBytes } as never)).rejects.toMatchObject({
        code: 'INVALID_ARGUMENT',
        message: expect.stringContaining('kvCacheBytes'),
      })
    }
    await expect(Engine.load(dirs.gqa, { numBlocks: 64, kvCacheBytes: 1 << 20 })).rejects.toMatchObject({
      code: 'INVALID_ARGUMENT',
      message: expect.stringMatching(/numBlocks.*kvCacheBytes.*not both/),
    })
    // A budget smaller than one block still leaves the pool one block.
    const tiny = await Engine.load(dirs.gqa, { kvCacheBytes: 1 })
    expect(tiny.config.numBlocks).toBe(1)
    await tiny.close()
  })

  it('the simulated model has no executor stats or node placement, and keeps no KV bytes for a budget to bound', async () => {
    const engine = Engine.simulated()
    expect(engine.executorStats()).toBeNull()
    expect(engine.nodePlacement()).toBeNull()
    expect(engine.config).toMatchObject({ kvCacheBytes: 0, kvPositionBytes: 0 })
    const budgeted = Engine.simulated({ kvCacheBytes: 1 })
    expect(budgeted.config.numBlocks).toBe(engine.config.numBlocks)
    await budgeted.close()
    await engine.close()
  })
})

describe('the ortex command line on model folders', () => {
  const cli = resolve(__dirname, '../../dist/cli.js')
  const ortex = (args: string[], env: Record<string, string> = {}) =>
    spawnSync(process.execPath, [cli, ...args], { encoding: 'utf8', env: { ...process.env, ...env }, timeout: 60_000 })

  it('make-model writes a folder that generate streams from', () => {
    const dir = join(models.root(), 'cli-made')
    const made = ortex(['make-model', '--out', dir, '--size', 'tiny', '--attention', 'mha', '--seed', '7'])
    expect(made.status, made.stderr).toBe(0)
    expect(made.stdout).toContain('tiny mha seed 7')
    expect(readFileSync(join(dir, 'model.onnx.data'))).toEqual(readFileSync(join(dirs.mha, 'model.onnx.data')))
    const run = ortex(['generate', '--model', dir, '--prompt', 'The river', '--prompt', 'Once', '--max-tokens', '5'])
    expect(run.status, run.stderr).toBe(0)
    expect(run.stdout).toMatch(/total: \d+ tokens from 2 requests/)
    expect(run.stderr).toMatch(/^loaded .*cli-made: KV pool of \d+ blocks x 16 positions, [\d.]+ MiB reserved \([\d.]+ KiB per position\)$/m)
    // A budget of 1 MiB: the pool shrinks to what it holds, and the line says so.
    const budgeted = ortex(['generate', '--model', dir, '--prompt', 'Once', '--max-tokens', '5', '--kv-cache-bytes', String(1 << 20)])
    expect(budgeted.status, budgeted.stderr).toBe(0)
    const [, blocks, mib] = /KV pool of (\d+) blocks x 16 positions, ([\d.]+) MiB reserved/.exec(budgeted.stderr) ?? []
    expect(Number(mib)).toBeLessThanOrEqual(1)
    expect(Number(blocks)).toBeGreaterThan(0)
  })

  it('make-model refuses bad flags with a one-line reason', () => {
    const bad = ortex(['make-model', '--out', join(models.root(), 'x'), '--size', 'huge'])
    expect(bad.status).toBe(2)
    expect(bad.stderr.trim().split('\n')).toHaveLength(1)
    expect(ortex(['make-model']).status).toBe(2)
  })

  it('ORTEX_ORT_DYLIB overrides the ONNX Runtime library', () => {
    const run = ortex(['generate', '--model', dirs.gqa, '--max-tokens', '2'], { ORTEX_ORT_DYLIB: '/nonexistent/libonnxruntime.so.1' })
    expect(run.status).toBe(1)
    expect(run.stderr).toContain('MODEL_LOAD')
    expect(run.stderr).toContain('ORTEX_ORT_DYLIB')
  })
})

describe('where a model step runs', () => {
  // A child process with one libuv pool thread, held by a 0.5-2 s pbkdf2 while the engine
  // generates: the model's steps run on the engine's own thread, so the turn finishes first. On
  // the pool they would wait for the pbkdf2.
  const script = (index: string, dir: string) => `
    const { Engine } = require(${JSON.stringify(index)})
    const { pbkdf2 } = require('node:crypto')
    const { readdirSync, readFileSync } = require('node:fs')
    const threads = () => readdirSync('/proc/self/task').map((t) => readFileSync('/proc/self/task/' + t + '/comm', 'utf8').trim())
    ;(async () => {
      const engine = await Engine.load(${JSON.stringify(dir)})
      const order = []
      const blocker = new Promise((done) => pbkdf2('x', 'y', 2_000_000, 32, 'sha256', () => done(order.push('pool job'))))
      const turn = engine.generate([5, 6, 7], { maxGeneratedTokens: 8, ignoreEos: true })
      const result = await turn.done
      order.push('turn')
      const named = threads().filter((name) => name === 'ortex-step').length
      await blocker
      await engine.close()
      console.log(JSON.stringify({ order, tokens: result.usage.generatedTokens, named }))
    })().catch((error) => { console.error(error); process.exit(1) })
  `

  it.runIf(process.platform === 'linux')('on the engine thread, not the libuv pool', () => {
    const index = resolve(__dirname, '../../dist/index.js')
    const run = spawnSync(process.execPath, ['-e', script(index, dirs.gqa)], {
      encoding: 'utf8',
      env: { ...process.env, UV_THREADPOOL_SIZE: '1' },
      timeout: 60_000,
    })
    expect(run.status, run.stderr).toBe(0)
    expect(JSON.parse(run.stdout)).toEqual({ order: ['turn', 'pool job'], tokens: 8, named: 1 })
  })
})

describe("a model engine's runs at the edges of the program's life", () => {
  // test/fixtures/model-run-lifetimes.mjs; each mode in its own process.
  const fixture = resolve(__dirname, '../fixtures/model-run-lifetimes.mjs')
  const runMode = (mode: string, flags: string[] = []) =>
    spawnSync(process.execPath, [...flags, fixture, dirs.gqa, mode], { encoding: 'utf8', timeout: 60_000 })
  const report = (stdout: string) => JSON.parse(stdout.trim().split('\n').pop()!)

  it('a run in flight holds the process, an idle engine never closed does not', () => {
    const run = runMode('settle')
    expect(run.signal, 'the process had to be killed (an idle engine kept it alive)').toBeNull()
    expect(run.status, run.stderr).toBe(0)
    // Exiting before a run settled would print nothing.
    expect(report(run.stdout)).toEqual({ settled: [1, 1] })
  })

  it('terminating a worker mid-turn leaves the process working', () => {
    const run = runMode('worker')
    expect(run.signal, run.stderr).toBeNull()
    expect(run.status, run.stderr).toBe(0)
    expect(report(run.stdout)).toEqual({ afterTerminate: 4 })
  })

  it('process.exit() while a step is in flight exits cleanly', () => {
    const run = runMode('exit')
    expect(run.signal, run.stderr).toBeNull()
    expect(run.status, run.stderr).toBe(0)
    expect(report(run.stdout)).toEqual({ exiting: 3 })
  })

  it('engines collected without close() leave the next one working', () => {
    const run = runMode('gc', ['--expose-gc'])
    expect(run.signal, run.stderr).toBeNull()
    expect(run.status, run.stderr).toBe(0)
    expect(report(run.stdout)).toEqual({ afterGc: 4 })
  })

  it('close() alone releases the threads, without waiting for the collector', () => {
    const run = spawnSync(process.execPath, [resolve(__dirname, '../fixtures/model-close.mjs'), dirs.gqa], {
      encoding: 'utf8',
      timeout: 60_000,
    })
    expect(run.status, run.stderr).toBe(0)
    const { threads } = report(run.stdout)
    const [before, loaded, closed] = threads
    // Six engines: each has a step thread and (2 intra-op threads) one ONNX Runtime worker.
    expect(loaded - before).toBeGreaterThanOrEqual(6)
    expect(closed).toBe(before)
  })

  it('closed engines give their memory back', () => {
    const run = spawnSync(
      process.execPath,
      ['--expose-gc', resolve(__dirname, '../fixtures/model-memory.mjs'), dirs.gqa],
      { encoding: 'utf8', timeout: 60_000 },
    )
    expect(run.status, run.stderr).toBe(0)
    const { growthMiB, weightChunkBytes } = report(run.stdout)
    if (weightChunksExpected()) expect(weightChunkBytes).toBeGreaterThan(0) // else this proves little
    // Ten more load/close cycles: an engine's chunk of weights left mapped each time would add
    // 10 x 64 MiB. (A glibc malloc arena for a new thread can add a 64 MiB heap now and then.)
    expect(growthMiB).toBeLessThan(5 * 64)
  })
})
