// The imports of SmolLM2-135M-Instruct's Q4_1 file the quality benchmark compares, each a folder
// of `ortex import` with one combination of options, cached under ${cacheRoot()}/quality/KEY/
// (KEY: the options and IMPORTER_VERSION). Each is made in a private folder, marked done after the
// import finished and renamed into place, so a second run imports nothing and an interrupted one
// leaves nothing that looks finished.

import { existsSync, renameSync, rmSync, writeFileSync } from 'node:fs'
import { join } from 'node:path'

import { type AccuracyLevel, IMPORTER_VERSION, describeImport, importGguf, type WeightFormat } from '../../ts/modelkit/gguf/import'
import type { KvType } from '../../ts/modelkit/decoder'
import { SMOLLM2, cacheRoot } from '../../ts/modelkit/real-model'

export interface Variant {
  id: string
  weights: WeightFormat
  kv: KvType
  /** int4 only. */
  accuracyLevel?: AccuracyLevel
  /** What a reader of the table is told. */
  label: string
}

/** The reference first: every other row is compared with it. */
export const VARIANTS: readonly Variant[] = [
  { id: 'fp32-kv32', weights: 'fp32', kv: 'fp32', label: 'fp32 weights, fp32 KV (reference; `--weights fp32` default)' },
  { id: 'fp32-kv16', weights: 'fp32', kv: 'fp16', label: 'fp32 weights, fp16 KV' },
  { id: 'int4-kv16-a4', weights: 'int4', kv: 'fp16', accuracyLevel: 4, label: 'int4, fp16 KV, int8 activations (`--weights int4` default)' },
  { id: 'int4-kv32-a4', weights: 'int4', kv: 'fp32', accuracyLevel: 4, label: 'int4, fp32 KV, int8 activations' },
  { id: 'int4-kv16-a0', weights: 'int4', kv: 'fp16', accuracyLevel: 0, label: 'int4, fp16 KV, fp32 activations' },
  { id: 'int4-kv32-a0', weights: 'int4', kv: 'fp32', accuracyLevel: 0, label: 'int4, fp32 KV, fp32 activations' },
]

export const qualityCacheDir = () => join(cacheRoot(), 'quality')

const DONE_MARKER = 'ortex-quality-import.done'

/** The variant's folder, imported from `gguf` on first use. */
export async function variantFolder(gguf: string, v: Variant, progress: (line: string) => void): Promise<string> {
  const dir = join(qualityCacheDir(), `smollm2-${SMOLLM2.version}-${v.id}-i${IMPORTER_VERSION}`)
  if (existsSync(join(dir, DONE_MARKER))) return dir
  const tmp = `${dir}.tmp-${process.pid}`
  rmSync(tmp, { recursive: true, force: true })
  try {
    const summary = await importGguf({ file: gguf, outDir: tmp, weights: v.weights, kv: v.kv, accuracyLevel: v.accuracyLevel })
    writeFileSync(join(tmp, DONE_MARKER), `${JSON.stringify({ importerVersion: IMPORTER_VERSION, file: gguf, ...v }, null, 2)}\n`)
    rmSync(dir, { recursive: true, force: true })
    renameSync(tmp, dir)
    progress(`imported ${describeImport({ ...summary, outDir: dir })}`)
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
  return dir
}
