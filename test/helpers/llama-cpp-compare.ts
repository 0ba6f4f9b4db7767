// ortex against llama.cpp on the same GGUF file: one architecture's random-weight file
// (test/helpers/gguf-archs.ts), imported by ortex (fp32 from the F32 file, int4 from the Q4_0
// file) and run by both over the standard prompts:
//
//   greedy          the engine's greedy tokens (Engine.load of the folder) against llama.cpp's
//                   (test/reference/llama-cpp.ts), with llama.cpp's margin at every step
//   teacher-forced  the folder's model.onnx on onnxruntime-node (test/reference/reference.ts,
//                   forwardBatch) and llama.cpp over the same ids (the prompt and llama.cpp's
//                   greedy tokens): the top-1 at every position, and the largest logit error
//
// Against a Q4_0 file, 8-bit activations (llama.cpp quantizes them to Q8_0 for every Q4_0
// matmul; an int4 import at accuracy level 4 to int8) flip the teacher-forced top-1 choices that
// are near ties, about as often as llama.cpp's Q4_0 run disagrees with its own F32 run of the
// same weights. So the comparison also counts the positions that are not near ties (llama.cpp's
// margin at least NEAR_TIE), and, against the Q4_0 file, reports llama.cpp's own agreement with
// its F32 twin (`llamaSelfAgreement`, the floor for int4AgreementFloor).
//
// A per-architecture test is then a few lines:
//
//   const c = await compareWithLlamaCpp('qwen3', { weights: 'fp32', root })
//   expect(c.greedyEqual, describeComparison(c)).toBe(true)
//   const q = await compareWithLlamaCpp('qwen3', { weights: 'int4', root })
//   expect(q.agreement, describeComparison(q)).toBeGreaterThanOrEqual(int4AgreementFloor(q))
//
// Files and imports are made once per root and options, and reused by later calls.

import { existsSync, mkdirSync } from 'node:fs'
import { join } from 'node:path'
import { Engine } from 'ortex'
import { type ImportOptions, type ImportSummary, importGguf } from '../../ts/modelkit/gguf/import'
import { LlamaCpp, greedyMargins, topTwo } from '../reference/llama-cpp'
import { ReferenceModel, emptyCache, forwardBatch } from '../reference/reference'
import { type ArchFormat, type ArchName, type ArchOptions, STANDARD_NEW_TOKENS, STANDARD_PROMPTS, archModel, writeArchGguf } from './gguf-archs'

export type CompareWeights = 'fp32' | 'int4'

/** A teacher-forced position where llama.cpp's top-1 beats its top-2 by less than this is a near
 *  tie for 8-bit activations (well above the logit error they cause on these files). */
export const NEAR_TIE = 0.5

export interface CompareOptions {
  /** fp32: ortex's fp32 import of the F32 file; int4: its int4 import of the Q4_0 file. */
  weights: CompareWeights
  /** The folder for the files and the imports (a test's temporary root). */
  root: string
  /** The architecture's file (seed, scales, metadata). */
  model?: ArchOptions
  /** Import options beyond the file, the folder and the weights (kv, accuracyLevel, attention...). */
  import?: Omit<ImportOptions, 'file' | 'outDir' | 'weights'>
  /** Default STANDARD_PROMPTS. */
  prompts?: readonly string[]
  /** Greedy tokens after each prompt; default STANDARD_NEW_TOKENS. */
  newTokens?: number
  /** llama.cpp's context size; default the file's context length. */
  contextSize?: number
  /** The file llama.cpp runs: default the one ortex imported. The F32 file holds the Q4_0 file's
   *  weights, so an int4 import with float activations and KV ({ accuracyLevel: 0, kv: 'fp32' })
   *  against 'F32' is an exact comparison. */
  reference?: ArchFormat
}

export interface PromptComparison {
  text: string
  /** llama.cpp's tokenization of the text, after BOS where the vocabulary adds one. */
  prompt: number[]
  llama: number[]
  ortex: number[]
  /** llama.cpp's margin (top-1 minus top-2 logit) at each of its greedy steps. */
  margins: number[]
  /** The first generated index where the two differ; -1 when none does. */
  firstDifference: number
  /** Teacher-forced over the prompt and llama.cpp's tokens: positions whose top-1 agrees. */
  agree: number
  positions: number
  /** The same over the positions that are not near ties (llama.cpp's margin >= NEAR_TIE). */
  clearAgree: number
  clearPositions: number
  /** Against the Q4_0 file: positions where llama.cpp's F32 twin has the same top-1. */
  llamaSelfAgree?: number
  /** The largest |ortex - llama.cpp| logit over those positions and the whole vocabulary. */
  maxLogitError: number
}

export interface Comparison {
  arch: ArchName
  weights: CompareWeights
  /** The file llama.cpp ran. */
  file: string
  folder: string
  summary: ImportSummary
  prompts: PromptComparison[]
  /** Every prompt's greedy tokens equal. */
  greedyEqual: boolean
  /** Teacher-forced top-1 agreement over every position of every prompt (0 to 1). */
  agreement: number
  /** The same over the positions that are not near ties. */
  clearAgreement: number
  /** Against the Q4_0 file: llama.cpp's own teacher-forced agreement with its F32 twin (the same
   *  weights), the noise floor of 8-bit activations on these models. */
  llamaSelfAgreement?: number
  /** llama.cpp's smallest margin over every generated step. */
  minMargin: number
  maxLogitError: number
}

const FORMAT: Readonly<Record<CompareWeights, ArchFormat>> = { fp32: 'F32', int4: 'Q4_0' }

/** Made once per process: the files written, and each folder's import. */
const files = new Set<string>()
const imports = new Map<string, Promise<ImportSummary>>()

/** A short stable name for a set of options. */
function tag(value: unknown): string {
  const text = JSON.stringify(value) ?? ''
  let hash = 0x811c9dc5
  for (let i = 0; i < text.length; i++) hash = Math.imul(hash ^ text.charCodeAt(i), 0x01000193) >>> 0
  return hash.toString(36)
}

/** The architecture's file in `format` under `root`, written on first use. */
export function archFile(root: string, arch: ArchName, format: ArchFormat, model: ArchOptions = {}): string {
  const path = join(root, `${arch}-${tag(model)}.${format}.gguf`)
  if (!files.has(path) || !existsSync(path)) {
    mkdirSync(root, { recursive: true })
    writeArchGguf(path, arch, format, model)
    files.add(path)
  }
  return path
}

/** ortex's import of the architecture's file for `weights`, made on first use. */
export function archImport(root: string, arch: ArchName, o: Pick<CompareOptions, 'weights' | 'model' | 'import'>): Promise<ImportSummary> {
  const file = archFile(root, arch, FORMAT[o.weights], o.model)
  const outDir = join(root, `${arch}-${tag([o.model ?? {}, o.import ?? {}])}-${o.weights}`)
  let summary = imports.get(outDir)
  if (summary === undefined) {
    summary = importGguf({ ...o.import, file, outDir, weights: o.weights })
    imports.set(outDir, summary)
    summary.catch(() => imports.delete(outDir))
  }
  return summary
}

/** Prompt ids as llama.cpp makes them: BOS where the vocabulary adds it, then the text's tokens. */
export function promptIds(llama: LlamaCpp, text: string, bos: number | undefined): number[] {
  return [...(bos !== undefined ? [bos] : []), ...llama.tokenize(text)]
}

export async function compareWithLlamaCpp(arch: ArchName, o: CompareOptions): Promise<Comparison> {
  const file = archFile(o.root, arch, o.reference ?? FORMAT[o.weights], o.model)
  const summary = await archImport(o.root, arch, o)
  const llama = await LlamaCpp.load(file, { contextSize: o.contextSize })
  const bos = archModel(arch, o.model).bos
  const n = o.newTokens ?? STANDARD_NEW_TOKENS
  const texts = o.prompts ?? STANDARD_PROMPTS

  const runs = []
  for (const text of texts) {
    const prompt = promptIds(llama, text, bos)
    runs.push({ text, prompt, run: await greedyMargins(llama, prompt, n) })
  }
  const ortex = await engineGreedy(summary.outDir, runs.map((r) => r.prompt), n)
  const twin = file.endsWith('.Q4_0.gguf') ? await LlamaCpp.load(archFile(o.root, arch, 'F32', o.model), { contextSize: o.contextSize }) : undefined
  const forced = await teacherForced(llama, twin, summary.outDir, runs.map((r) => [...r.prompt, ...r.run.tokens]))

  const prompts: PromptComparison[] = runs.map(({ text, prompt, run }, i) => ({
    text,
    prompt,
    llama: run.tokens,
    ortex: ortex[i]!,
    margins: run.margins,
    firstDifference: run.tokens.findIndex((t, j) => ortex[i]![j] !== t),
    ...forced[i]!,
  }))
  const sum = (f: (p: PromptComparison) => number) => prompts.reduce((a, p) => a + f(p), 0)
  return {
    arch,
    weights: o.weights,
    file,
    folder: summary.outDir,
    summary,
    prompts,
    greedyEqual: prompts.every((p) => p.firstDifference < 0 && p.ortex.length === p.llama.length),
    agreement: sum((p) => p.agree) / sum((p) => p.positions),
    clearAgreement: sum((p) => p.clearAgree) / sum((p) => p.clearPositions),
    llamaSelfAgreement: twin ? sum((p) => p.llamaSelfAgree!) / sum((p) => p.positions) : undefined,
    minMargin: Math.min(...prompts.flatMap((p) => p.margins)),
    maxLogitError: Math.max(...prompts.map((p) => p.maxLogitError)),
  }
}

/** The engine's greedy tokens for each prompt (EOS ignored), all submitted at once. */
async function engineGreedy(folder: string, prompts: number[][], n: number): Promise<number[][]> {
  const engine = await Engine.load(folder, { intraOpThreads: 1 })
  try {
    return await Promise.all(prompts.map(async (p) => Array.from((await engine.generate(p, { maxGeneratedTokens: n, ignoreEos: true }).done).tokens)))
  } finally {
    await engine.close()
  }
}

type Forced = Pick<PromptComparison, 'agree' | 'positions' | 'clearAgree' | 'clearPositions' | 'llamaSelfAgree' | 'maxLogitError'>

/** Per sequence, teacher-forced: the positions whose top-1 agrees between the folder and llama.cpp
 *  (all, and those that are not near ties), llama.cpp's agreement with `twin`, the largest logit error. */
async function teacherForced(llama: LlamaCpp, twin: LlamaCpp | undefined, folder: string, sequences: number[][]): Promise<Forced[]> {
  const model = await ReferenceModel.load(folder)
  try {
    const out: Forced[] = []
    for (const ids of sequences) {
      const [row] = await forwardBatch(model, [{ cache: emptyCache(model), tokens: ids }])
      const want = await llama.logits(ids)
      const other = await twin?.logits(ids)
      const f: Forced = { agree: 0, positions: ids.length, clearAgree: 0, clearPositions: 0, llamaSelfAgree: other ? 0 : undefined, maxLogitError: 0 }
      row!.logits.forEach((got, j) => {
        const reference = topTwo(want[j]!)
        const same = topTwo(got).top === reference.top
        if (same) f.agree++
        if (reference.first - reference.second >= NEAR_TIE) {
          f.clearPositions++
          if (same) f.clearAgree++
        }
        if (other && topTwo(other[j]!).top === reference.top) f.llamaSelfAgree!++
        for (let v = 0; v < got.length; v++) f.maxLogitError = Math.max(f.maxLogitError, Math.abs(got[v]! - want[j]![v]!))
      })
      out.push(f)
    }
    return out
  } finally {
    await model.release()
  }
}

/**
 * The teacher-forced agreement an int4 import must reach against llama.cpp's Q4_0 run: 99%, or,
 * where 8-bit activations alone flip more of the model's choices than that (llama.cpp's own Q4_0
 * run against its F32 twin), llama.cpp's own agreement less 2 points.
 */
export function int4AgreementFloor(c: Comparison): number {
  if (c.llamaSelfAgreement === undefined) throw new Error(`${c.file}: not a Q4_0 comparison`)
  return Math.min(0.99, c.llamaSelfAgreement - 0.02)
}

/** The comparison in a few lines, for a failing assertion's message. */
export function describeComparison(c: Comparison): string {
  const percent = (x: number) => `${(100 * x).toFixed(1)}%`
  const self = c.llamaSelfAgreement === undefined ? '' : ` (llama.cpp's own against its F32 twin: ${percent(c.llamaSelfAgreement)})`
  const lines = [
    `${c.arch} ${c.weights} against ${c.file}: greedy ${c.greedyEqual ? 'equal' : 'different'}; teacher-forced top-1 agreement ${percent(c.agreement)}${self}, ` +
      `${percent(c.clearAgreement)} where not a near tie; llama.cpp's smallest greedy margin ${c.minMargin.toFixed(3)}; largest logit error ${c.maxLogitError.toExponential(2)}`,
  ]
  for (const p of c.prompts) {
    const at = p.firstDifference
    const where = at < 0 ? 'equal' : `first difference at token ${at} (llama.cpp ${p.llama[at]}, ortex ${p.ortex[at]}; llama.cpp's margin there ${p.margins[at]?.toFixed(3)})`
    lines.push(`  ${JSON.stringify(p.text.slice(0, 30))} (${p.prompt.length} tokens): ${where}; top-1 ${p.agree}/${p.positions}, not near ties ${p.clearAgree}/${p.clearPositions}`)
  }
  return lines.join('\n')
}
