// llama.cpp (node-llama-cpp's prebuilt CPU binary) as the oracle for GGUF files, proved on what
// exists: every architecture's random-weight file (test/helpers/gguf-archs.ts) loads in
// llama.cpp in F32 and Q4_0 and generates something that is neither a near tie nor degenerate;
// each feature that sets an architecture apart changes llama.cpp's tokens when taken away (so the
// files exercise it); and on llama and qwen2, which ortex imports, ortex's tokens are llama.cpp's
// (test/helpers/llama-cpp-compare.ts).

import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { ARCHS, ARCH_FEATURES, type ArchFormat, type ArchModel, STANDARD_NEW_TOKENS, STANDARD_PROMPTS, PHI3_ORIGINAL_CONTEXT, archModel, withMetadata, writeArchModel } from '../helpers/gguf-archs'
import { u32 } from '../helpers/gguf-writer'
import { compareWithLlamaCpp, describeComparison, int4AgreementFloor, promptIds } from '../helpers/llama-cpp-compare'
import { tinySentencePieceVocabulary, tinyVocabulary } from '../helpers/gguf-models'
import { LlamaCpp, closeLlamaCpp, greedyMargins } from '../reference/llama-cpp'
import { LlamaCppBpe, LlamaCppSpm } from '../reference/llama-vocab'

/** llama.cpp's smallest greedy margin on an F32 file: far above float32 rounding, and above what
 *  llama.cpp's float16 GELU table (float16 precision on gemma's feed-forward activations) moves. */
const MIN_MARGIN = 0.05

let root: string

beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'ortex-llama-cpp-'))
})

afterAll(async () => {
  await closeLlamaCpp()
  if (root) rmSync(root, { recursive: true, force: true })
})

/** llama.cpp's greedy runs over the standard prompts on `model` written in `format` (written
 *  once per name: the same name is the same model). */
async function llamaRuns(model: ArchModel, format: ArchFormat, name: string, contextSize?: number, newTokens = STANDARD_NEW_TOKENS) {
  const file = join(root, `${name}.${format}.gguf`)
  if (!existsSync(file)) writeArchModel(file, model, format)
  const llama = await LlamaCpp.load(file, { contextSize })
  const runs = []
  if (newTokens > 0) for (const text of STANDARD_PROMPTS) runs.push(await greedyMargins(llama, promptIds(llama, text, model.bos), newTokens))
  return { llama, runs }
}

describe('the oracle', () => {
  it("tokenizes as the project's own models of llama.cpp's tokenizers do (BPE pre-tokenizers, SentencePiece)", async () => {
    const texts = [...STANDARD_PROMPTS, "  spaces,\ttabs\nand 12345 digits; don't", 'Ünïcödé — 日本語 ✓ 🦀']
    const bpe = tinyVocabulary()
    for (const arch of ['llama', 'qwen2', 'phi3', 'granite', 'gemma3'] as const) {
      const model = archModel(arch)
      const llama = (await llamaRuns(model, 'F32', `${arch}-own`, undefined, 0)).llama
      const pre = model.metadata.find(([k]) => k === 'tokenizer.ggml.pre')![1]
      const oracle =
        arch === 'gemma3'
          ? new LlamaCppSpm({ ...tinySentencePieceVocabulary(), scores: Array.from(Float32Array.from(tinySentencePieceVocabulary().scores)), addSpacePrefix: false })
          : new LlamaCppBpe({ ...bpe, pre: (pre as { value: string }).value })
      for (const text of texts) expect(llama.tokenize(text, { special: true }), `${arch}: ${JSON.stringify(text)}`).toEqual(oracle.encode(text))
    }
  })

  it('names the file and the reason when llama.cpp cannot load it', async () => {
    const whole = join(root, 'whole.gguf')
    writeArchModel(whole, archModel('llama'), 'F32')
    const cut = join(root, 'cut.gguf')
    writeFileSync(cut, readFileSync(whole).subarray(0, 30_000))
    await expect(LlamaCpp.load(cut)).rejects.toThrow(/^llama\.cpp could not load .*cut\.gguf: Failed to load model; .*not within the file bounds/)
    await expect(LlamaCpp.load(join(root, 'missing.gguf'))).rejects.toThrow(/^llama\.cpp could not load .*missing\.gguf: ENOENT/)
  })

  it('stops at an end-of-generation token only when asked', async () => {
    const model = archModel('llama')
    const own = (await llamaRuns(model, 'F32', 'llama-own', undefined, 0)).llama
    const prompt = promptIds(own, STANDARD_PROMPTS[1]!, model.bos)
    const tokens = await own.greedy(prompt, 8)
    // The same model, its EOS a greedy token from the third on that came no earlier.
    const at = tokens.findIndex((t, i) => i >= 2 && !tokens.slice(0, i).includes(t))
    const eos = withMetadata(model, [['tokenizer.ggml.eos_token_id', u32(tokens[at]!)]])
    const llama = (await llamaRuns(eos, 'F32', 'llama-eos', undefined, 0)).llama
    expect(llama.isEndOfGeneration(tokens[at]!)).toBe(true)
    expect(await llama.greedy(prompt, 8)).toEqual(tokens)
    expect(await llama.greedy(prompt, 8, { ignoreEos: false })).toEqual(tokens.slice(0, at + 1))
  })

  it('loads a file once per context size, and refuses ids it cannot run', async () => {
    const file = join(root, 'once.gguf')
    writeArchModel(file, archModel('llama'), 'F32')
    const a = await LlamaCpp.load(file)
    expect(await LlamaCpp.load(file)).toBe(a)
    const wider = await LlamaCpp.load(file, { contextSize: 512 })
    expect([a.contextSize, wider.contextSize]).toEqual([256, 512])
    await expect(a.greedy([], 4)).rejects.toThrow(/at least one token/)
    await expect(a.logits([1, 384])).rejects.toThrow(/token 384 is outside the vocabulary of 384/)
    await expect(a.greedy([1, 2, 3], 300)).rejects.toThrow(/3 \+ 300 tokens do not fit llama\.cpp's context of 256/)
    await wider.close()
  })
})

describe('llama.cpp reads every architecture file', () => {
  for (const arch of ARCHS) {
    it(`${arch}: F32 and Q4_0 generate, not degenerate, no greedy choice near a tie (F32)`, async () => {
      const model = archModel(arch)
      for (const format of ['F32', 'Q4_0'] as const) {
        const { llama, runs } = await llamaRuns(model, format, `${arch}-own`)
        expect(llama.setup).toMatchObject({ flashAttention: false, kvCache: 'F32/F32' })
        const longestWindow = Math.max(...model.windows)
        for (const run of runs) {
          const where = `${arch} ${format} ${JSON.stringify(llama.detokenize(run.prompt))}`
          expect(run.tokens, where).toHaveLength(STANDARD_NEW_TOKENS)
          // Not degenerate: many different tokens, not one repeated.
          expect(new Set(run.tokens).size, where).toBeGreaterThanOrEqual(8)
          // Step by step and in one batch, llama.cpp picks the same tokens.
          expect(run.disagreements, where).toEqual([])
          if (format === 'F32') expect(Math.min(...run.margins), where).toBeGreaterThanOrEqual(MIN_MARGIN)
          // Every run goes past every sliding window.
          expect(run.prompt.length + run.tokens.length, where).toBeGreaterThan(longestWindow)
        }
        // The prompts lead to different continuations.
        expect(new Set(runs.map((r) => r.tokens.join(','))).size).toBe(runs.length)
        if (longestWindow > 0) expect(Math.max(...runs.map((r) => r.prompt.length))).toBeGreaterThan(longestWindow)
      }
    })
  }
})

describe('each feature that sets an architecture apart changes llama.cpp\'s tokens when taken away', () => {
  for (const arch of ARCHS) {
    it(`${arch}: ${ARCH_FEATURES[arch].map((f) => f.feature).join('; ')}`, async () => {
      const own = (await llamaRuns(archModel(arch), 'F32', `${arch}-own`)).runs.map((r) => r.tokens)
      for (const [i, feature] of ARCH_FEATURES[arch].entries()) {
        const without = (await llamaRuns(feature.without({}), 'F32', `${arch}-without-${i}`, feature.contextSize)).runs.map((r) => r.tokens)
        const differing = without.filter((tokens, p) => tokens.join(',') !== own[p]!.join(',')).length
        expect(differing, `${arch} without ${feature.feature}: prompts whose tokens differ`).toBeGreaterThanOrEqual(STANDARD_PROMPTS.length - 1)
      }
    })
  }
})

/**
 * How far ortex's float32 logits may be from llama.cpp's on an F32 file: float32 rounding, but
 * for the GELU-gated architectures, whose GELU llama.cpp's CPU computes through a float16 table
 * of its input (GGML_GELU_FP16): on these files that moves a logit by up to about 0.02 (of a
 * spread of about 8), against 1e-4 for the SiLU-gated ones, and never a greedy choice.
 */
const LOGIT_TOLERANCE: Partial<Record<(typeof ARCHS)[number], number>> = { gemma3: 0.05, gemma2: 0.05 }

describe("ortex gives llama.cpp's tokens on the same file", () => {
  for (const arch of ARCHS) {
    const tolerance = LOGIT_TOLERANCE[arch] ?? 1e-3
    it(`${arch}: the fp32 import of the F32 file: greedy tokens equal, logits within float32 rounding`, async () => {
      const c = await compareWithLlamaCpp(arch, { weights: 'fp32', root })
      expect(c.greedyEqual, describeComparison(c)).toBe(true)
      expect(c.agreement, describeComparison(c)).toBe(1)
      expect(c.maxLogitError, describeComparison(c)).toBeLessThan(tolerance)
    })

    it(`${arch}: the int4 import of the Q4_0 file with float activations: llama.cpp's greedy tokens and logits on the F32 twin`, async () => {
      // The F32 file holds the Q4_0 blocks' values: the same arithmetic, so exact.
      const c = await compareWithLlamaCpp(arch, { weights: 'int4', import: { accuracyLevel: 0, kv: 'fp32' }, reference: 'F32', root })
      expect(c.greedyEqual, describeComparison(c)).toBe(true)
      expect(c.agreement, describeComparison(c)).toBe(1)
      expect(c.maxLogitError, describeComparison(c)).toBeLessThan(tolerance)
    })

    it(`${arch}: the int4 import of the Q4_0 file: teacher-forced top-1 as llama.cpp's on the Q4_0 file`, async () => {
      // 8-bit activations on both sides (llama.cpp's Q8_0, MatMulNBits' int8) flip the choices
      // that are near ties, about as often as llama.cpp's Q4_0 run disagrees with its own F32 run
      // of the same weights (int4AgreementFloor); the others all agree.
      const c = await compareWithLlamaCpp(arch, { weights: 'int4', root })
      expect(c.agreement, describeComparison(c)).toBeGreaterThanOrEqual(int4AgreementFloor(c))
      expect(c.clearAgreement, describeComparison(c)).toBeGreaterThanOrEqual(0.99)
    })
  }

  it("phi3 at its original context: the import's contextLength picks LongRoPE's short factors, as llama.cpp's context size does", async () => {
    const c = await compareWithLlamaCpp('phi3', { weights: 'fp32', root, import: { contextLength: PHI3_ORIGINAL_CONTEXT }, contextSize: PHI3_ORIGINAL_CONTEXT, newTokens: 16 })
    expect(c.greedyEqual, describeComparison(c)).toBe(true)
    expect(c.maxLogitError, describeComparison(c)).toBeLessThan(1e-3)
  })
})
