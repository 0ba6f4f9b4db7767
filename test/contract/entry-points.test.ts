// The entry points from plain Node processes (test/fixtures): import and require of both, one
// OrtexError class everywhere, FinalizationRegistry callbacks after an engine is collected, and a
// driven engine that lets its process exit.
import { execFileSync, spawnSync } from 'node:child_process'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { describe, expect, it } from 'vitest'

const root = resolve(dirname(fileURLToPath(import.meta.url)), '../..')

describe('entry points from ESM and CommonJS', () => {
  function runFixture(file: string): any {
    const out = execFileSync(process.execPath, [resolve(root, 'test/fixtures', file)], { cwd: root, encoding: 'utf8', timeout: 60_000 })
    return JSON.parse(out.trim().split('\n').pop()!)
  }

  it('import and require both entry points; one OrtexError class everywhere', () => {
    const report = runFixture('entry-points.mjs')
    for (const label of ['esmNative', 'esmWasm', 'cjsNative', 'cjsWasm']) {
      expect(report[label].exports, label).toEqual(['Engine', 'Request', 'Turn', 'EventBuffer', 'EventFlags', 'OrtexError'])
      expect(report[label].code, label).toBe('INVALID_ARGUMENT')
      expect(report[label].tokens, label).toEqual(report.esmNative.tokens)
    }
    expect(report.esmNative.backend).toBe('native')
    expect(report.esmWasm.backend).toBe('wasm')
    expect(report.cjsNative.backend).toBe('native')
    expect(report.cjsWasm.backend).toBe('wasm')
    expect(report.sameClass).toEqual({ esmEntryPoints: true, cjsEntryPoints: true, esmAndCjs: true })
    for (const label of ['esmNative', 'esmWasm', 'cjsNative', 'cjsWasm']) expect(report[label].errorIsShared, label).toBe(true)
  })

  it('a CommonJS program requires both entry points', () => {
    const report = runFixture('entry-points.cjs')
    expect(report).toEqual({ native: { backend: 'native', tokens: 3 }, wasm: { backend: 'wasm', tokens: 3 }, sameOrtexError: true })
  })

  it('collecting an engine with a queued reclamation does not stop later FinalizationRegistry callbacks', () => {
    for (const entry of ['ortex', 'ortex/wasm']) {
      const out = execFileSync(process.execPath, ['--expose-gc', resolve(root, 'test/fixtures/finalization-after-engine-gc.mjs'), entry], {
        cwd: root,
        encoding: 'utf8',
        timeout: 60_000,
      })
      expect(JSON.parse(out.trim().split('\n').pop()!), entry).toEqual({ unrelatedRegistryFired: true, droppedRequestReclaimed: true })
    }
  })

  it('a driven engine does not keep the process alive when it has no work', () => {
    for (const entry of ['ortex', 'ortex/wasm']) {
      const result = spawnSync(process.execPath, [resolve(root, 'test/fixtures/driven-exit.mjs'), entry], {
        cwd: root,
        encoding: 'utf8',
        timeout: 60_000,
      })
      expect(result.signal, `${entry}: the process had to be killed (still alive after its work)`).toBeNull()
      expect(result.status, result.stderr).toBe(0)
      const report = JSON.parse(result.stdout.trim().split('\n').pop()!)
      expect(report.tokens).toBe(3)
    }
  })
})
