// A GGUF file where a model folder goes (ts/modelkit/gguf/cache.ts, ts/model-source.ts):
// Engine.load and `ortex generate|serve --model file.gguf` import it into the cache on first use,
// keyed by the file's content, the importer's version and the import's options, and reuse that
// import after. Every test here has its own cache (ORTEX_CACHE_DIR), on small files written at
// test time.

import { type ChildProcess, spawn, spawnSync } from 'node:child_process'
import { closeSync, copyFileSync, existsSync, mkdtempSync, openSync, readFileSync, readdirSync, rmSync, statSync, truncateSync, utimesSync, writeSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { basename, join, resolve } from 'node:path'
import { Engine, type GgufLoadEvent } from 'ortex'
import { Engine as WasmEngine } from 'ortex/wasm'
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'
import { type TinyGgufOptions, writeTinyGguf } from '../helpers/gguf-models'

const CLI = resolve(__dirname, '../../dist/cli.js')

const TINY: TinyGgufOptions = {
  architecture: 'llama',
  types: { embedding: 'Q8_0', output: 'Q6_K', layers: [Array(7).fill('Q4_K'), Array(7).fill('Q6_K')] },
  seed: 3,
}

let root: string
let cache: string
const savedCacheDir = process.env.ORTEX_CACHE_DIR

beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), 'ortex-gguf-path-'))
})

afterAll(() => {
  if (savedCacheDir === undefined) delete process.env.ORTEX_CACHE_DIR
  else process.env.ORTEX_CACHE_DIR = savedCacheDir
  rmSync(root, { recursive: true, force: true })
})

let caches = 0
beforeEach(() => {
  cache = join(root, `cache-${caches++}`)
  process.env.ORTEX_CACHE_DIR = cache
})

let files = 0
/** A fresh tiny GGUF file (its mtime an hour ago unless `recent`). */
function ggufFile(options: TinyGgufOptions = TINY, recent = false): string {
  const file = join(root, `model-${files++}.gguf`)
  writeTinyGguf(file, options)
  if (!recent) age(file)
  return file
}

/** Sets the file's mtime an hour back (whole seconds, so that it can be put back exactly): a file
 *  older than its hash, as a downloaded one is. */
function age(file: string): void {
  const hourAgo = Math.floor(Date.now() / 1000) - 3600
  utimesSync(file, hourAgo, hourAgo)
}

const imports = () => (existsSync(join(cache, 'gguf', 'imports')) ? readdirSync(join(cache, 'gguf', 'imports')) : [])

async function load(file: string, gguf: Record<string, unknown> = {}): Promise<{ engine: Awaited<ReturnType<typeof Engine.load>>; events: GgufLoadEvent[] }> {
  const events: GgufLoadEvent[] = []
  const engine = await Engine.load(file, { intraOpThreads: 1, maxBatchSize: 4, gguf: { ...gguf, onProgress: (e) => events.push(e) } })
  return { engine, events }
}

async function greedy(engine: Awaited<ReturnType<typeof Engine.load>>): Promise<number[]> {
  return Array.from((await engine.generate('The river starts', { maxGeneratedTokens: 8, ignoreEos: true }).done).tokens)
}

const kinds = (events: GgufLoadEvent[]) => [...new Set(events.map((e) => e.kind))]

describe('Engine.load of a GGUF file', () => {
  it('imports it on first use (int4 by default) and reuses the import after: no import, the folder untouched', async () => {
    const file = ggufFile()
    const first = await load(file)
    expect(kinds(first.events)).toEqual(['hashing', 'importing', 'imported'])
    const folder = first.engine.modelDir!
    expect(folder.startsWith(join(cache, 'gguf', 'imports'))).toBe(true)
    expect(first.events.at(-1)).toMatchObject({ kind: 'imported', file, folder, summary: expect.stringMatching(/^.*: llama "tiny llama", [\d,]+ parameters, int4 weights .* float16 KV/) })
    const tokens = await greedy(first.engine)
    await first.engine.close()
    const marker = JSON.parse(readFileSync(join(folder, 'ortex-gguf.json'), 'utf8'))
    expect(marker).toMatchObject({ file, importerVersion: expect.any(Number), options: { weights: 'int4', kv: 'fp16', accuracyLevel: 4 } })
    const before = Object.fromEntries(readdirSync(folder).map((name) => [name, statSync(join(folder, name)).mtimeMs]))

    // The file is older than its recorded hash: the second load reads neither the file nor the importer.
    const second = await load(file)
    expect(second.events).toEqual([{ kind: 'reused', file, folder }])
    expect(second.engine.modelDir).toBe(folder)
    expect(await greedy(second.engine)).toEqual(tokens)
    await second.engine.close()
    expect(Object.fromEntries(readdirSync(folder).map((name) => [name, statSync(join(folder, name)).mtimeMs]))).toEqual(before)
    expect(imports()).toEqual([folder.split('/').at(-1)])
  })

  it('runs the import the CLI makes of the same file (ortex import --weights int4): the same tokens', async () => {
    const file = ggufFile()
    const out = join(root, 'cli-import')
    const run = spawnSync(process.execPath, [CLI, 'import', file, '--out', out, '--weights', 'int4'], { encoding: 'utf8' })
    expect(run.status, run.stderr).toBe(0)
    const cached = await load(file)
    const folder = await Engine.load(out, { intraOpThreads: 1, maxBatchSize: 4 })
    expect(await greedy(cached.engine)).toEqual(await greedy(folder))
    for (const name of readdirSync(out)) expect(readFileSync(join(cached.engine.modelDir!, name)), name).toEqual(readFileSync(join(out, name)))
    await Promise.all([cached.engine.close(), folder.close()])
  })

  it('hashes a file whose mtime is too recent to vouch for it again, and still reuses its import', async () => {
    const file = ggufFile(TINY, true)
    const first = await load(file)
    await first.engine.close()
    const second = await load(file)
    expect(kinds(second.events)).toEqual(['hashing', 'reused'])
    expect(second.engine.modelDir).toBe(first.engine.modelDir)
    await second.engine.close()
  })

  it('imports a file changed by one byte again, even with its size and mtime kept (the key is the content)', async () => {
    const file = ggufFile()
    const first = await load(file)
    await first.engine.close()
    const { mtimeNs } = statSync(file, { bigint: true })
    const seconds = Number(mtimeNs / 1_000_000_000n)
    // One byte of the last tensor's data, flipped in place; the mtime put back as it was.
    const at = statSync(file).size - 3
    const fd = openSync(file, 'r+')
    writeSync(fd, Buffer.from([readFileSync(file)[at]! ^ 0x01]), 0, 1, at)
    closeSync(fd)
    utimesSync(file, seconds, seconds)
    expect(statSync(file, { bigint: true }).mtimeNs).toBe(mtimeNs)
    const second = await load(file)
    expect(kinds(second.events)).toEqual(['hashing', 'importing', 'imported'])
    expect(second.engine.modelDir).not.toBe(first.engine.modelDir)
    await second.engine.close()
    expect(imports()).toHaveLength(2)
  })

  it('keys the import by content, not by name or place: a copy reuses it', async () => {
    const file = ggufFile()
    const first = await load(file)
    await first.engine.close()
    const copy = join(root, 'elsewhere.gguf')
    copyFileSync(file, copy)
    const second = await load(copy)
    expect(kinds(second.events)).toEqual(['hashing', 'reused'])
    expect(second.engine.modelDir).toBe(first.engine.modelDir)
    await second.engine.close()
  })

  it('makes one import per set of options that shape it; explicit defaults are the defaults', async () => {
    const file = ggufFile()
    const int4 = await load(file)
    const explicit = await load(file, { weights: 'int4', kv: 'fp16', accuracyLevel: 4, workers: 1 })
    expect(explicit.engine.modelDir).toBe(int4.engine.modelDir)
    expect(kinds(explicit.events)).toEqual(['reused'])
    const fp32 = await load(file, { weights: 'fp32' })
    expect(fp32.engine.modelDir).not.toBe(int4.engine.modelDir)
    expect(kinds(fp32.events)).toEqual(['importing', 'imported'])
    expect(fp32.events.at(-1)).toMatchObject({ summary: expect.stringContaining('fp32 weights') })
    const exactInt4 = await load(file, { accuracyLevel: 0, kv: 'fp32' })
    expect(new Set([int4, fp32, exactInt4].map((l) => l.engine.modelDir)).size).toBe(3)
    await Promise.all([int4, explicit, fp32, exactInt4].map((l) => l.engine.close()))
    expect(imports()).toHaveLength(3)
  })

  it('gives concurrent loads of one file one import, and both engines work', async () => {
    const file = ggufFile()
    const [a, b] = await Promise.all([load(file), load(file)])
    const imported = [...a.events, ...b.events].filter((e) => e.kind === 'imported')
    expect(imported).toHaveLength(1)
    expect(a.engine.modelDir).toBe(b.engine.modelDir)
    expect(await greedy(a.engine)).toEqual(await greedy(b.engine))
    await Promise.all([a.engine.close(), b.engine.close()])
    expect(imports()).toHaveLength(1)
  })

  it('fails on a corrupt file with MODEL_LOAD naming it, and leaves nothing in the cache', async () => {
    const notGguf = join(root, 'garbage.gguf')
    copyFileSync(CLI, notGguf)
    const truncated = ggufFile()
    truncateSync(truncated, statSync(truncated).size - 100)
    const noArchitecture = ggufFile({ ...TINY, metadata: [['general.architecture', { kind: 'string', value: 'mamba' }]] })
    const cases: Array<[string, RegExp]> = [
      [notGguf, /not a GGUF file/],
      [truncated, /truncated|ends|past the end/],
      [noArchitecture, /the architecture "mamba" is not supported/],
    ]
    for (const [file, reason] of cases) {
      const failure = await load(file).catch((error: unknown) => error)
      expect(failure, file).toMatchObject({ code: 'MODEL_LOAD' })
      expect((failure as Error).message).toContain(file)
      expect((failure as Error).message).toMatch(reason)
      expect(imports()).toEqual([])
      expect(existsSync(join(cache, 'gguf', 'hashes')) ? readdirSync(join(cache, 'gguf', 'hashes')) : []).toEqual([])
    }
  })

  it('refuses import options for a model folder, and says what else is wrong with a path', async () => {
    const folder = join(root, 'folder')
    await makeModel({ outDir: folder })
    await expect(Engine.load(folder, { gguf: { weights: 'fp32' } })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringContaining('options.gguf applies to a GGUF file') })
    await expect(Engine.load(join(root, 'none'))).rejects.toMatchObject({ code: 'MODEL_LOAD', message: expect.stringMatching(/model folder ".*none" does not exist \(Engine\.load takes a model folder or a GGUF file\)/) })
    const text = join(root, 'notes.txt')
    copyFileSync(join(folder, 'genai_config.json'), text)
    await expect(Engine.load(text)).rejects.toMatchObject({ code: 'MODEL_LOAD', message: expect.stringContaining('is neither a model folder nor a GGUF file') })
    const file = ggufFile()
    await expect(Engine.load(file, { gguf: { weights: 'int8' } as never })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringContaining('options.gguf.weights') })
    await expect(Engine.load(file, { gguf: { wieghts: 'fp32' } as never })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringContaining('unknown option "wieghts"') })
    await expect(Engine.load(file, { gguf: { weights: 'fp32', accuracyLevel: 4 } })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT', message: expect.stringContaining('accuracyLevel applies to int4 weights only') })
    expect(imports()).toEqual([])
  })

  it('recognizes a GGUF file by its first bytes whatever its name (as Ollama keeps them)', async () => {
    const file = ggufFile()
    const blob = join(root, 'sha256-0123abcd')
    copyFileSync(file, blob)
    const { engine, events } = await load(blob)
    expect(kinds(events)).toContain('imported')
    await engine.close()
  })

  it('is refused by the WebAssembly build before anything is imported', async () => {
    const file = ggufFile()
    await expect(WasmEngine.load(file)).rejects.toMatchObject({ code: 'UNSUPPORTED' })
    expect(existsSync(join(cache, 'gguf'))).toBe(false)
  })
})

describe('ortex generate and serve --model file.gguf', () => {
  const env = () => {
    const out: Record<string, string | undefined> = { ...process.env, ORTEX_CACHE_DIR: cache }
    delete out.ORTEX_ORT_DYLIB
    delete out.ORT_DYLIB_PATH
    return out
  }

  it('generate imports on first use with progress and the summary on stderr, then reuses the import', () => {
    const file = ggufFile()
    const args = [CLI, 'generate', '--model', file, '--prompt', 'The river starts', '--max-tokens', '6', '--import-workers', '2']
    const first = spawnSync(process.execPath, args, { encoding: 'utf8', env: env() })
    expect(first.status, first.stderr).toBe(0)
    expect(first.stderr).toMatch(new RegExp(`^reading ${file} \\([\\d.]+ MB\\) for the sha256 that keys its import$`, 'm'))
    expect(first.stderr).toMatch(new RegExp(`^importing ${file} into .*/gguf/imports/.* \\(its first use\\)$`, 'm'))
    expect(first.stderr).toMatch(/^importing .*: 50% \([\d.]+ of [\d.]+ MB\)$/m)
    expect(first.stderr).toMatch(new RegExp(`^imported ${file} into .*: llama "tiny llama", .* int4 weights .* in [\\d.]+ s$`, 'm'))
    expect(first.stderr).toMatch(new RegExp(`^loaded ${file}: KV pool of`, 'm'))
    expect(first.stdout).toMatch(/^total: 6 tokens from 1 requests/m)
    const second = spawnSync(process.execPath, args, { encoding: 'utf8', env: env() })
    expect(second.status, second.stderr).toBe(0)
    expect(second.stderr).not.toMatch(/importing/)
    expect(second.stderr).toMatch(new RegExp(`^${file}: its import in the cache, .*/gguf/imports/`, 'm'))
    // Greedy: the same text both times.
    expect(second.stdout.split('\n')[0]).toBe(first.stdout.split('\n')[0])
    const fp32 = spawnSync(process.execPath, [...args, '--weights', 'fp32'], { encoding: 'utf8', env: env() })
    expect(fp32.status, fp32.stderr).toBe(0)
    expect(fp32.stderr).toMatch(/^imported .* fp32 weights/m)
  })

  it('refuses import flags without a GGUF file (status 2), and a corrupt file in one line (status 1)', () => {
    const sim = spawnSync(process.execPath, [CLI, 'generate', '--simulated', '--weights', 'fp32'], { encoding: 'utf8', env: env() })
    expect([sim.status, sim.stderr]).toEqual([2, "ortex: --weights: for a GGUF file's import (--model FILE.gguf), not a model folder or the simulated model\n"])
    const bad = join(root, 'bad.gguf')
    copyFileSync(CLI, bad)
    const corrupt = spawnSync(process.execPath, [CLI, 'generate', '--model', bad], { encoding: 'utf8', env: env() })
    expect(corrupt.status).toBe(1)
    expect(corrupt.stderr).toBe(`ortex: MODEL_LOAD: ${bad}: not a GGUF file (the first bytes are not "GGUF")\n`)
    const levels = spawnSync(process.execPath, [CLI, 'generate', '--model', bad, '--accuracy-level', '2'], { encoding: 'utf8', env: env() })
    expect([levels.status, levels.stderr]).toEqual([2, `ortex: --accuracy-level must be '0' or '4', got "2"\n`])
  })

  it('serve answers the OpenAI API from a GGUF file', async () => {
    const file = ggufFile()
    const child: ChildProcess = spawn(process.execPath, [CLI, 'serve', '--model', file, '--port', '0', '--max-output-tokens', '5'], { stdio: ['ignore', 'pipe', 'pipe'], env: env() })
    let stderr = ''
    child.stderr!.on('data', (data) => (stderr += String(data)))
    try {
      const line = await new Promise<string>((resolve, reject) => {
        let out = ''
        child.stdout!.on('data', (data) => {
          out += String(data)
          if (out.includes('\n')) resolve(out)
        })
        child.once('exit', (code) => reject(new Error(`serve exited ${code}: ${stderr}`)))
      })
      const url = /listening on (http:\/\/[^ ]+) /.exec(line)![1]!
      const response = await fetch(`${url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model: basename(file, '.gguf'), prompt: 'The river starts', max_tokens: 5, temperature: 0 }),
      })
      const body = (await response.json()) as { usage: { completion_tokens: number } }
      expect(response.status).toBe(200)
      expect(body.usage.completion_tokens).toBeGreaterThan(0)
      expect(stderr).toMatch(new RegExp(`^imported ${file} into `, 'm'))
    } finally {
      child.kill('SIGTERM')
      await new Promise((resolve) => child.once('exit', resolve))
    }
    expect(child.exitCode).toBe(0)
  })
})
