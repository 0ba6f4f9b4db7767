// The model generator (ts/modelkit/make-model.ts): folder layout, determinism, genai_config.json,
// tokenizer.json, the ONNX graph's signature. Tiny models only, generated into a temp dir.

import { createHash } from 'node:crypto'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import onnxProto from 'onnx-proto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { readModelConfig } from '../../ts/modelkit/genai-config'
import { countParameters } from '../../ts/modelkit/decoder'
import { DATA_FILE, MODEL_FILE, SIZES, makeModel, type ModelSummary } from '../../ts/modelkit/make-model'
import { ByteLevelBpe, BYTE_TO_CHAR, trainBpe } from '../../ts/modelkit/tokenizer'

const { onnx } = onnxProto
const FILES = ['genai_config.json', MODEL_FILE, DATA_FILE, 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json']

let root: string
let a: ModelSummary // gqa, seed 1
let b: ModelSummary // gqa, seed 1 again
let c: ModelSummary // gqa, seed 2
let m: ModelSummary // mha, seed 1
const progress: Array<[number, number, string]> = []

const sha = (dir: string, file: string) => createHash('sha256').update(readFileSync(join(dir, file))).digest('hex')
const json = (dir: string, file: string) => JSON.parse(readFileSync(join(dir, file), 'utf8'))

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'ortex-make-model-'))
  a = await makeModel({ outDir: join(root, 'a'), size: 'tiny', attention: 'gqa', seed: 1, onProgress: (d, t, l) => progress.push([d, t, l]) })
  b = await makeModel({ outDir: join(root, 'b'), size: 'tiny', attention: 'gqa', seed: 1 })
  c = await makeModel({ outDir: join(root, 'c'), size: 'tiny', attention: 'gqa', seed: 2 })
  m = await makeModel({ outDir: join(root, 'm'), size: 'tiny', attention: 'mha', seed: 1 })
})

afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
})

describe('make-model tiny', () => {
  it('writes the folder, under 5 MB', () => {
    for (const s of [a, m]) {
      expect(s.files.map((f) => f.name).sort()).toEqual([...FILES].sort())
      expect(s.totalBytes).toBeLessThan(5 * 1024 * 1024)
      expect(s.parameters).toBe(countParameters(SIZES.tiny))
      expect(s.dims.numKvHeads).toBeLessThan(s.dims.numHeads)
    }
  })

  it('reports progress up to the data file size', () => {
    expect(progress.length).toBeGreaterThan(2)
    const total = progress[0]![1]
    let last = 0
    for (const [done, t] of progress) {
      expect(t).toBe(total)
      expect(done).toBeGreaterThanOrEqual(last)
      last = done
    }
    expect(last).toBe(total)
    expect(a.files.find((f) => f.name === DATA_FILE)!.bytes).toBe(total)
  })

  it('is deterministic: the same seed gives byte-identical files', () => {
    for (const f of FILES) expect(sha(b.outDir, f), f).toBe(sha(a.outDir, f))
  })

  it('GENERATOR_VERSION 1 bytes: new forms and options leave the existing folders as they were', () => {
    // Pinned from the generator before the paged form and float16 weights were added; a change
    // here needs GENERATOR_VERSION bumped (make-model.ts).
    expect(sha(a.outDir, MODEL_FILE)).toBe('46f79b0bba058327421e80ab4453f2c6f2e80bb9464eb71b36fcec610a2cf886')
    expect(sha(a.outDir, DATA_FILE)).toBe('4a1d341f429df7fb24a3b934e066d674ddd352a6ac404e593263e0af555707ca')
    expect(sha(a.outDir, 'genai_config.json')).toBe('41eff8a7575193764478755a38e3805b6aa36ecbabff8ef3183eaee4382457ec')
    expect(sha(m.outDir, MODEL_FILE)).toBe('ae974dc189124f5a26cb779794200bd4f3fe1bdeaed35ba564930866a226194b')
  })

  it('another seed gives other weights, the same tokenizer and config', () => {
    expect(sha(c.outDir, DATA_FILE)).not.toBe(sha(a.outDir, DATA_FILE))
    for (const f of ['genai_config.json', 'tokenizer.json', 'tokenizer_config.json']) {
      expect(sha(c.outDir, f), f).toBe(sha(a.outDir, f))
    }
  })

  it('both attention forms share the weights', () => {
    expect(sha(m.outDir, DATA_FILE)).toBe(sha(a.outDir, DATA_FILE))
    expect(sha(m.outDir, MODEL_FILE)).not.toBe(sha(a.outDir, MODEL_FILE))
  })

  it('rejects bad options', async () => {
    const outDir = join(root, 'bad')
    await expect(makeModel({ outDir, size: 'huge' as never })).rejects.toThrow(/size/)
    await expect(makeModel({ outDir, attention: 'flash' as never })).rejects.toThrow(/attention/)
    await expect(makeModel({ outDir, seed: -1 })).rejects.toThrow(/seed/)
    await expect(makeModel({ outDir, seed: 1.5 })).rejects.toThrow(/seed/)
  })
})

describe('genai_config.json', () => {
  it('has onnxruntime-genai builder fields', () => {
    const cfg = json(a.outDir, 'genai_config.json')
    expect(Object.keys(cfg)).toEqual(['model', 'search'])
    const model = cfg.model
    expect(model).toMatchObject({
      type: 'llama',
      vocab_size: 512,
      bos_token_id: 1,
      eos_token_id: 2,
      pad_token_id: 0,
    })
    expect(model.context_length).toBeGreaterThanOrEqual(2048)
    expect(model.decoder).toMatchObject({
      filename: 'model.onnx',
      head_size: 16,
      hidden_size: 64,
      num_attention_heads: 4,
      num_key_value_heads: 2,
      num_hidden_layers: 2,
      outputs: { logits: 'logits', present_key_names: 'present.%d.key', present_value_names: 'present.%d.value' },
    })
    expect(model.decoder.inputs).toEqual({
      input_ids: 'input_ids',
      attention_mask: 'attention_mask',
      past_key_names: 'past_key_values.%d.key',
      past_value_names: 'past_key_values.%d.value',
    })
    expect(cfg.search).toMatchObject({ max_length: model.context_length, do_sample: false, past_present_share_buffer: true })
    for (const k of ['top_k', 'top_p', 'temperature', 'num_beams', 'repetition_penalty']) expect(cfg.search).toHaveProperty(k)
  })

  it('the mha form adds position_ids and does not share past and present', () => {
    const cfg = json(m.outDir, 'genai_config.json')
    expect(cfg.model.decoder.inputs.position_ids).toBe('position_ids')
    expect(cfg.search.past_present_share_buffer).toBe(false)
    const parsed = readModelConfig(m.outDir)
    expect(parsed.positionIds).toBe('position_ids')
    expect(readModelConfig(a.outDir).positionIds).toBeUndefined()
  })
})

describe('model.onnx', () => {
  const decode = (dir: string) => onnx.ModelProto.decode(readFileSync(join(dir, MODEL_FILE)))

  it('declares the decoder signature, external weights and ortex metadata', () => {
    for (const [s, form] of [[a, 'gqa'], [m, 'mha']] as const) {
      const model = decode(s.outDir)
      const graph = model.graph!
      const inputs = graph.input!.map((i) => i.name)
      const expected = ['input_ids', 'attention_mask', ...(form === 'mha' ? ['position_ids'] : [])]
      for (let l = 0; l < 2; l++) expected.push(`past_key_values.${l}.key`, `past_key_values.${l}.value`)
      expect(inputs).toEqual(expected)
      const outputs = graph.output!.map((o) => o.name)
      expect(outputs).toEqual(['logits', 'present.0.key', 'present.0.value', 'present.1.key', 'present.1.value'])
      const meta = Object.fromEntries(model.metadataProps!.map((p) => [p.key, p.value]))
      expect(meta['ortex.attention']).toBe(form)
      expect(meta['ortex.seed']).toBe('1')
      const big = graph.initializer!.filter((t) => t.dataLocation === onnx.TensorProto.DataLocation.EXTERNAL)
      expect(big.length).toBe(1 + 2 * 9 + 1 + 1 + 2) // embed, 9 per layer, norm, lm_head, cos, sin
      for (const t of big) expect(t.externalData!.find((e) => e.key === 'location')!.value).toBe(DATA_FILE)
      const gqa = graph.node!.filter((n) => n.opType === 'GroupQueryAttention')
      expect(gqa.length).toBe(form === 'gqa' ? 2 : 0)
      for (const n of gqa) {
        expect(n.domain).toBe('com.microsoft')
        const attr = Object.fromEntries(n.attribute!.map((x) => [x.name, x]))
        expect(Number(attr.do_rotary!.i)).toBe(1)
        expect(Number(attr.num_heads!.i)).toBe(4)
        expect(Number(attr.kv_num_heads!.i)).toBe(2)
        expect(n.input!.length).toBe(9)
      }
    }
  })
})

describe('tokenizer.json', () => {
  it('is a byte-level BPE whose size is the model vocab size', () => {
    const tj = json(a.outDir, 'tokenizer.json')
    expect(tj.model.type).toBe('BPE')
    expect(tj.pre_tokenizer).toMatchObject({ type: 'ByteLevel', use_regex: true })
    expect(tj.decoder.type).toBe('ByteLevel')
    const vocab = tj.model.vocab as Record<string, number>
    const ids = Object.values(vocab).sort((x, y) => x - y)
    expect(ids).toEqual(Array.from({ length: 512 }, (_, i) => i))
    expect(ids.length).toBe(json(a.outDir, 'genai_config.json').model.vocab_size)
    for (const ch of BYTE_TO_CHAR) expect(vocab[ch]).toBeDefined()
    expect(tj.added_tokens.map((t: { id: number; content: string; special: boolean }) => [t.id, t.content, t.special])).toEqual([
      [0, '<pad>', true],
      [1, '<s>', true],
      [2, '</s>', true],
    ])
    expect(tj.model.merges.length).toBe(512 - 3 - 256)
    for (const merge of tj.model.merges as string[]) {
      const [l, r] = merge.split(' ')
      expect(vocab[l!]).toBeDefined()
      expect(vocab[r!]).toBeDefined()
      expect(vocab[l! + r!]).toBeGreaterThan(Math.max(vocab[l!]!, vocab[r!]!))
    }
    const tc = json(a.outDir, 'tokenizer_config.json')
    expect(tc).toMatchObject({ bos_token: '<s>', eos_token: '</s>', pad_token: '<pad>', tokenizer_class: 'GPT2Tokenizer' })
  })

  it('round-trips text through the JS implementation', () => {
    const tok = new ByteLevelBpe(readFileSync(join(a.outDir, 'tokenizer.json'), 'utf8'))
    expect(tok.vocabSize).toBe(512)
    for (const text of [
      'The river starts as a thin line of water high in the hills.',
      "  spaces,\ttabs\nand newlines\n\n don't vanish ",
      'Ünïcödé — 日本語 ✓ 🦀 <s> inside </s>',
      '',
    ]) {
      const ids = tok.encode(text)
      expect(tok.decode(ids)).toBe(text)
      for (const id of ids) expect(id).toBeLessThan(512)
    }
    const common = tok.encode('the river and the water')
    expect(common.length).toBeLessThan('the river and the water'.length / 2) // merges apply
    expect(tok.encode('<s>')).toEqual([1])
    expect(tok.decode([1, 2], { skipSpecial: true })).toBe('')
  })

  it('learns the bench size deterministically', () => {
    const x = trainBpe(SIZES.bench.vocabSize)
    const y = trainBpe(SIZES.bench.vocabSize)
    expect(x.vocab.length).toBe(SIZES.bench.vocabSize)
    expect(new Set(x.vocab).size).toBe(x.vocab.length)
    expect(y).toEqual(x)
  })
})
