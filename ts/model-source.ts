// What Engine.load is given: a model folder, or a GGUF file (llama.cpp's format), which it
// imports into the cache on first use and then runs from there (modelkit/gguf/cache.ts, loaded
// only for a GGUF file, so a folder's load never reads the importer).

import { closeSync, openSync, readSync, statSync } from 'node:fs'
import { invalidArgument } from './errors'
import type { BackendKind, GgufLoadOptions } from './types'

/** What a model path names: a folder, a GGUF file, another file, or nothing. */
export type ModelPathKind = 'folder' | 'gguf' | 'file' | 'missing'

/** A GGUF file is one named `*.gguf` (the importer refuses it if its bytes are not GGUF) or one
 *  that starts with the bytes "GGUF" whatever its name (Ollama keeps its models so). */
export function modelPathKind(path: string): ModelPathKind {
  let stats
  try {
    stats = statSync(path)
  } catch {
    return 'missing'
  }
  if (stats.isDirectory()) return 'folder'
  if (!stats.isFile()) return 'file'
  return /\.gguf$/i.test(path) || startsWithGguf(path) ? 'gguf' : 'file'
}

function startsWithGguf(path: string): boolean {
  try {
    const fd = openSync(path, 'r')
    try {
      const magic = Buffer.alloc(4)
      return readSync(fd, magic, 0, 4, 0) === 4 && magic.toString('latin1') === 'GGUF'
    } finally {
      closeSync(fd)
    }
  } catch {
    return false
  }
}

/**
 * The folder to load for `path`: the path itself, or a GGUF file's import in the cache (made on
 * first use). The WebAssembly build runs no model, so it gets the path and refuses it as it
 * refuses any model, before anything is imported.
 */
export async function modelFolder(path: string, gguf: GgufLoadOptions | undefined, backend: BackendKind): Promise<string> {
  const kind = modelPathKind(path)
  if (gguf !== undefined && kind === 'folder') throw invalidArgument(`options.gguf applies to a GGUF file, and ${JSON.stringify(path)} is a model folder`)
  // A missing path or another file: the backend's load says what is wrong with it.
  if (kind !== 'gguf' || backend === 'wasm') return path
  const { importedFolder } = await import('./modelkit/gguf/cache')
  return importedFolder(path, gguf)
}
