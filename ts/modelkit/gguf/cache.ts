// A GGUF file where a model folder goes (Engine.load, `ortex generate|serve --model file.gguf`):
// imported on first use into the cache, and that import reused after.
//
//   ${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ortex}/gguf/
//     imports/<sha256 of the file, 32 hex>-<options>-i<IMPORTER_VERSION>/   the folder, and in it
//             ortex-gguf.json: the file it came from, its whole sha256, the options, the summary
//     hashes/<sha256 of the file's path, 32 hex>.json    the file's sha256 against its identity
//
// The key is what decides the folder's bytes: the file's content (the sha256 of its bytes), the
// importer's version and the options that shape the import (weights, KV type, accuracy level,
// dtype, attention form); never its name or place. Hashing a multi-gigabyte file takes seconds,
// so a file's sha256 is kept against its path and identity (device, inode, size, mtime and ctime
// in nanoseconds) and reused while that identity holds; an mtime less than RACY_MS before the
// hash began proves nothing (a write in the same clock tick keeps it), so such a file is hashed
// again, as git does with its "racily clean" entries.
//
// Concurrent loads are safe: in one process they share one import (a promise per folder); across
// processes each imports into a private folder beside the final one (its name carries the host
// and process id) and renames it into place; a rename that finds the folder already there drops
// its own copy. A failed import leaves nothing; a crashed process's private folder is removed by
// the next import of the same key on that host.

import { createHash, randomBytes } from 'node:crypto'
import { createReadStream, existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { hostname } from 'node:os'
import { basename, dirname, join, resolve } from 'node:path'
import { OrtexError } from '../../errors'
import type { GgufLoadEvent } from '../../types'
import { cacheRoot } from '../cache-root'
import { planModel } from './architecture'
import { type CheckedOptions, IMPORTER_VERSION, type ImportOptions, checkOptions, describeImport, importGguf } from './import'
import { readGguf } from './reader'

/** The options of a GGUF load (types.ts's GgufLoadOptions): the import's, without the paths;
 *  weights default to int4. */
export type GgufImportOptions = Omit<ImportOptions, 'file' | 'outDir' | 'onProgress'> & {
  onProgress?: (event: GgufLoadEvent) => void
}

/** The file's mtime must be this much older than the hash for its identity to vouch for it. */
const RACY_MS = 2000
const MARKER = 'ortex-gguf.json'

const ggufRoot = () => join(cacheRoot(), 'gguf')

/** Imports that are running in this process, by folder. */
const running = new Map<string, Promise<void>>()

/** The folder of `file`'s import with `options`, made on first use. Rejects with OrtexError:
 *  MODEL_LOAD naming the file for a file that does not import (or a cache that cannot be
 *  written), INVALID_ARGUMENT for options. */
export async function importedFolder(path: string, options: GgufImportOptions = {}): Promise<string> {
  const file = resolve(path)
  const { onProgress, ...shaping } = options
  const checked = checkOptions({ ...shaping, weights: shaping.weights ?? 'int4' })
  return cachedImport(file, checked, onProgress).catch((error: unknown) => {
    if (error instanceof OrtexError) throw error
    throw new OrtexError('MODEL_LOAD', `${file}: importing into the cache (${ggufRoot()}) failed: ${(error as Error).message}`, { cause: error })
  })
}

async function cachedImport(file: string, checked: CheckedOptions, onProgress: GgufImportOptions['onProgress']): Promise<string> {
  // Before seconds of hashing, the refusals that need only the header (not a GGUF file, a
  // truncated or hostile one, an architecture or tensor type the importer does not read).
  const hashed = await contentHash(file, onProgress, () => planModel(readGguf(file)))
  const folder = join(ggufRoot(), 'imports', `${hashed.sha256.slice(0, 32)}-${optionsTag(checked)}-i${IMPORTER_VERSION}`)
  let imported = false
  if (!isImported(folder)) {
    let importing = running.get(folder)
    if (importing === undefined) {
      importing = importInto(folder, file, hashed.sha256, checked, onProgress).finally(() => running.delete(folder))
      running.set(folder, importing)
      imported = true
    }
    await importing
  }
  // Only a file that imported is remembered: a corrupt one leaves nothing in the cache.
  hashed.remember()
  if (!imported) onProgress?.({ kind: 'reused', file, folder })
  return folder
}

const isImported = (folder: string) => existsSync(join(folder, 'genai_config.json'))

/** The part of the folder's name that says which options made it (the defaults included, so a
 *  folder made with explicit defaults is the one made without). */
export function optionsTag(o: CheckedOptions): string {
  const parts: string[] = [o.weights, `kv${o.kv}`]
  if (o.accuracyLevel !== null) parts.push(`al${o.accuracyLevel}`)
  if (o.dtype !== 'fp32') parts.push(o.dtype)
  if (o.paged) parts.push(`paged-${o.paged.kernel}-${o.paged.blockSize}`)
  if (o.contextLength !== undefined) parts.push(`ctx${o.contextLength}`)
  return parts.join('-')
}

async function importInto(folder: string, file: string, sha256: string, o: CheckedOptions, onProgress: GgufImportOptions['onProgress']): Promise<void> {
  mkdirSync(dirname(folder), { recursive: true })
  removeAbandoned(folder)
  const staging = `${folder}.tmp-${hostTag()}-${process.pid}-${randomBytes(4).toString('hex')}`
  try {
    const summary = await importGguf({
      file,
      outDir: staging,
      weights: o.weights,
      kv: o.kv,
      accuracyLevel: o.accuracyLevel ?? undefined,
      dtype: o.dtype,
      attention: o.attention,
      pagedKernel: o.paged?.kernel,
      blockSize: o.paged?.blockSize,
      workers: o.workers,
      contextLength: o.contextLength,
      onProgress: (doneBytes, totalBytes) => onProgress?.({ kind: 'importing', file, folder, doneBytes, totalBytes }),
    })
    const described = { ...summary, outDir: folder }
    const { workers: _, ...shaping } = o
    const marker = { file, sha256, importerVersion: IMPORTER_VERSION, options: shaping, summary: describeImport(described) }
    writeFileSync(join(staging, MARKER), `${JSON.stringify(marker, null, 2)}\n`)
    try {
      renameSync(staging, folder)
    } catch (error) {
      // Another process finished first: its folder is the same import.
      if (!isImported(folder)) throw error
    }
    onProgress?.({ kind: 'imported', file, folder, summary: describeImport(described), elapsedMs: summary.elapsedMs })
  } finally {
    rmSync(staging, { recursive: true, force: true })
  }
}

/** This host's name as a private folder's name carries it. */
const hostTag = () => hostname().replace(/[^A-Za-z0-9.-]/g, '_')

/** Removes the private folders that crashed imports of `folder` on this host left. */
function removeAbandoned(folder: string): void {
  const prefix = `${basename(folder)}.tmp-${hostTag()}-`
  for (const name of readdirSync(dirname(folder))) {
    if (!name.startsWith(prefix)) continue
    const pid = Number(name.slice(prefix.length).split('-')[0])
    if (Number.isInteger(pid) && pid !== process.pid && !isAlive(pid)) rmSync(join(dirname(folder), name), { recursive: true, force: true })
  }
}

function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0)
    return true
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === 'EPERM'
  }
}

/** What identifies a file's content without reading it (see the header). */
interface Identity {
  dev: string
  ino: string
  size: string
  mtimeNs: string
  ctimeNs: string
}

interface HashRecord {
  file: string
  identity: Identity
  sha256: string
  /** When the hash began (ms since the epoch). */
  hashedAtMs: number
}

function identityOf(file: string): Identity {
  const s = statSync(file, { bigint: true })
  return { dev: String(s.dev), ino: String(s.ino), size: String(s.size), mtimeNs: String(s.mtimeNs), ctimeNs: String(s.ctimeNs) }
}

const sameIdentity = (a: Identity, b: Identity) => a.dev === b.dev && a.ino === b.ino && a.size === b.size && a.mtimeNs === b.mtimeNs && a.ctimeNs === b.ctimeNs

/** The sha256 of the file's bytes: the recorded one while the file's identity vouches for it,
 *  else read (with progress) after `check`; `remember` records it, unless the file changed while
 *  it was read. */
async function contentHash(file: string, onProgress: GgufImportOptions['onProgress'], check: () => void): Promise<{ sha256: string; remember: () => void }> {
  const record = join(ggufRoot(), 'hashes', `${createHash('sha256').update(file).digest('hex').slice(0, 32)}.json`)
  const before = identityOf(file)
  const known = readRecord(record)
  const vouched = known !== null && known.file === file && sameIdentity(known.identity, before)
  if (vouched && Number(BigInt(before.mtimeNs) / 1_000_000n) < known.hashedAtMs - RACY_MS) return { sha256: known.sha256, remember: () => {} }
  check()
  const hashedAtMs = Date.now()
  const sha256 = await hashBytes(file, Number(before.size), onProgress)
  const unchanged = sameIdentity(identityOf(file), before)
  const remember = () => {
    if (unchanged) writeRecord(record, { file, identity: before, sha256, hashedAtMs })
  }
  return { sha256, remember }
}

function readRecord(path: string): HashRecord | null {
  try {
    return JSON.parse(readFileSync(path, 'utf8')) as HashRecord
  } catch {
    return null
  }
}

/** Written through a private name and a rename, so a reader never sees half a record. */
function writeRecord(path: string, record: HashRecord): void {
  mkdirSync(dirname(path), { recursive: true })
  const tmp = `${path}.tmp-${process.pid}-${randomBytes(4).toString('hex')}`
  writeFileSync(tmp, `${JSON.stringify(record, null, 2)}\n`)
  renameSync(tmp, path)
}

async function hashBytes(file: string, totalBytes: number, onProgress: GgufImportOptions['onProgress']): Promise<string> {
  const hash = createHash('sha256')
  let doneBytes = 0
  onProgress?.({ kind: 'hashing', file, doneBytes, totalBytes })
  for await (const chunk of createReadStream(file, { highWaterMark: 4 << 20 }) as AsyncIterable<Buffer>) {
    hash.update(chunk)
    doneBytes += chunk.length
    onProgress?.({ kind: 'hashing', file, doneBytes, totalBytes })
  }
  return hash.digest('hex')
}
