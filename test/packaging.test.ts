// The published packages, installed the way a user installs them.
//
// scripts/package.sh packs the platform package (npm/linux-x64-gnu: the addon and ONNX Runtime)
// and the root package (dist/, wasm-pkg/, optionalDependencies) into a temporary folder; a fresh
// temporary project installs both tarballs with `npm install --offline`, while `cargo`, `rustc`
// and `wasm-pack` on PATH fail and record any call, and npm's script shell records any install
// script. Then, as a user: ESM and CommonJS imports of `ortex` and `ortex/wasm` run a simulated
// generation, `npx ortex make-model` writes a tiny model and `npx ortex generate --model` streams
// from it (through the platform package's own libonnxruntime.so.1), and a missing platform
// package gives UNSUPPORTED naming it, as does executionProvider 'cuda' without the CUDA package
// (npm/linux-x64-gnu-cuda, whose manifest is checked here; it is not packed: 300 MB).
//
// The root package's runtime dependencies (ws) come from the local npm cache: the repository's
// `npm install` put their tarballs there. An install from a lockfile caches only abbreviated
// metadata, while installing a tarball needs the full document, so the test first runs
// `npm cache add NAME@VERSION --prefer-offline` for each (a no-op when cached; otherwise it fetches
// that document only, as on a fresh CI machine), then installs with --offline.
//
// Needs the build (npm test runs scripts/build.sh first).
import { spawnSync, type SpawnSyncReturns } from 'node:child_process'
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const PLATFORM_PACKAGE = 'ortex-linux-x64-gnu'
const CUDA_PACKAGE = 'ortex-linux-x64-gnu-cuda'
const FAKE_TOOLS = ['cargo', 'rustc', 'wasm-pack']

const supported = process.platform === 'linux' && process.arch === 'x64'

let work: string // everything temporary
let project: string // the user's project
let fakeBin: string
let calls: string // what the fake tools and the script shell recorded
let tarballs: { platform: string; root: string }
let env: NodeJS.ProcessEnv

/** The environment a user's shell would have: no npm_* variables of the `npm test` that runs us,
 *  the failing toolchain first on PATH. The npm cache stays the user's (npm_config_cache kept). */
function userEnv(): NodeJS.ProcessEnv {
  const out: NodeJS.ProcessEnv = {}
  for (const [key, value] of Object.entries(process.env)) {
    const lower = key.toLowerCase()
    if (lower.startsWith('npm_') && lower !== 'npm_config_cache' && lower !== 'npm_config_registry') continue
    if (key === 'NODE_OPTIONS' || key === 'NODE_PATH' || key.startsWith('VITEST') || key === 'ORTEX_ORT_DYLIB' || key === 'ORT_DYLIB_PATH') continue
    out[key] = value
  }
  out.PATH = `${fakeBin}${path.delimiter}${process.env.PATH ?? ''}`
  out.npm_config_update_notifier = 'false'
  out.npm_config_fund = 'false'
  out.npm_config_audit = 'false'
  return out
}

function run(command: string, args: string[], cwd: string, timeout = 120_000): SpawnSyncReturns<string> {
  return spawnSync(command, args, { cwd, env, encoding: 'utf8', timeout })
}

function ok(result: SpawnSyncReturns<string>, what: string): string {
  if (result.status !== 0) {
    throw new Error(`${what} exited ${result.status} (${result.signal ?? 'no signal'}):\n${result.stdout}\n${result.stderr}`)
  }
  return result.stdout
}

function recordedCalls(): string {
  return existsSync(calls) ? readFileSync(calls, 'utf8') : ''
}

function tarList(file: string): string[] {
  return ok(run('tar', ['tzf', file], work), `tar tzf ${file}`)
    .split('\n')
    .filter((line) => line !== '' && !line.endsWith('/'))
    .map((line) => line.replace(/^package\//, ''))
    .sort()
}

function manifest(dir: string): Record<string, any> {
  return JSON.parse(readFileSync(path.join(dir, 'package.json'), 'utf8'))
}

describe.skipIf(!supported)('the published packages, installed in a fresh project', () => {
  beforeAll(() => {
    work = mkdtempSync(path.join(tmpdir(), 'ortex-packaging-'))
    project = path.join(work, 'user-project')
    fakeBin = path.join(work, 'fake-bin')
    calls = path.join(work, 'calls.log')
    mkdirSync(project)
    mkdirSync(fakeBin)
    for (const tool of [...FAKE_TOOLS, 'script-shell']) {
      const file = path.join(fakeBin, tool)
      writeFileSync(file, `#!/bin/sh\necho "${tool} $*" >> '${calls}'\necho "${tool}: called during a user's install" >&2\nexit 1\n`)
      chmodSync(file, 0o755)
    }
    env = userEnv()

    // Pack with the repository's environment (node_modules, the dev npm config).
    const packed = spawnSync('bash', ['scripts/package.sh', '--no-build', '--pack', path.join(work, 'tarballs')], {
      cwd: repo,
      encoding: 'utf8',
      timeout: 120_000,
    })
    const lines = ok(packed, 'scripts/package.sh --pack').trim().split('\n')
    tarballs = { platform: lines.at(-2)!, root: lines.at(-1)! }

    writeFileSync(
      path.join(project, 'package.json'),
      JSON.stringify({ name: 'user-project', version: '1.0.0', private: true }, null, 2),
    )
    // The runtime dependencies' metadata into the cache (see the top of the file).
    const rootDeps = JSON.parse(
      ok(run('tar', ['xzf', tarballs.root, '-O', 'package/package.json'], work), 'tar xzf package.json'),
    ).dependencies as Record<string, string>
    for (const [name, version] of Object.entries(rootDeps ?? {})) {
      ok(run('npm', ['cache', 'add', `${name}@${version}`, '--prefer-offline'], project), `npm cache add ${name}@${version}`)
    }
    // --script-shell: any lifecycle script of any package would run through the recorder.
    ok(
      run(
        'npm',
        ['install', '--offline', '--no-audit', '--no-fund', `--script-shell=${path.join(fakeBin, 'script-shell')}`, tarballs.platform, tarballs.root],
        project,
      ),
      'npm install --offline (the two tarballs)',
    )
  }, 240_000)

  afterAll(() => {
    if (work !== undefined) rmSync(work, { recursive: true, force: true })
  })

  it('packs the addon and ONNX Runtime into the platform package, the rest into the root package', () => {
    expect(tarList(tarballs.platform)).toEqual(
      ['LICENSE', 'LICENSE-onnxruntime', 'README.md', 'libonnxruntime.so.1', 'ortex.linux-x64-gnu.node', 'package.json'].sort(),
    )
    const rootFiles = tarList(tarballs.root)
    for (const file of ['dist/index.js', 'dist/index.mjs', 'dist/wasm.js', 'dist/wasm.mjs', 'dist/cli.js', 'dist/index.d.ts', 'wasm-pkg/ortex_wasm.js', 'wasm-pkg/ortex_wasm_bg.wasm', 'README.md', 'LICENSE']) {
      expect(rootFiles).toContain(file)
    }
    expect(rootFiles.filter((f) => f.endsWith('.node') || f.includes('libonnxruntime'))).toEqual([])

    const root = manifest(path.join(project, 'node_modules', 'ortex'))
    const platform = manifest(path.join(project, 'node_modules', PLATFORM_PACKAGE))
    // Every prebuilt platform's package (npm installs only the one whose os/cpu/libc match).
    expect(root.optionalDependencies).toEqual({ 'ortex-linux-x64-gnu': root.version, 'ortex-linux-arm64-gnu': root.version })
    expect(Object.keys(root.dependencies ?? {})).not.toContain('onnxruntime-node')
    expect(platform).toMatchObject({
      name: PLATFORM_PACKAGE,
      version: root.version,
      os: ['linux'],
      cpu: ['x64'],
      libc: ['glibc'],
      main: 'ortex.linux-x64-gnu.node',
      license: 'MIT',
    })
  })

  it('keeps the platform package as `napi create-npm-dirs` generates it, plus ONNX Runtime', () => {
    const dirs = path.join(repo, '.cache', `napi-dirs-${process.pid}`)
    try {
      ok(
        spawnSync(path.join(repo, 'node_modules', '.bin', 'napi'), ['create-npm-dirs', '--npm-dir', path.relative(repo, dirs)], {
          cwd: repo,
          encoding: 'utf8',
        }),
        'napi create-npm-dirs',
      )
      for (const platform of ['linux-x64-gnu', 'linux-arm64-gnu']) {
        const generated = manifest(path.join(dirs, platform))
        const ours = manifest(path.join(repo, 'npm', platform))
        for (const key of ['name', 'version', 'os', 'cpu', 'libc', 'main', 'license', 'engines']) {
          expect(ours[key], `${platform} ${key}`).toEqual(generated[key])
        }
        for (const file of generated.files) expect(ours.files).toContain(file)
        expect(ours.files).toContain('libonnxruntime.so.1')
        expect(ours.files).toContain('LICENSE-onnxruntime')
        expect(existsSync(path.join(repo, 'npm', platform, 'LICENSE-onnxruntime')), `${platform} LICENSE-onnxruntime`).toBe(true)
      }
    } finally {
      rmSync(dirs, { recursive: true, force: true })
    }
  })

  it('keeps the CUDA package beside the x64 one: same platform and version, libraries only, not a dependency', () => {
    const check = spawnSync('node', ['scripts/package-manifest.cjs', 'check', 'linux-x64-gnu-cuda'], { cwd: repo, encoding: 'utf8' })
    expect(check.status, check.stderr).toBe(0)
    const cuda = manifest(path.join(repo, 'npm', 'linux-x64-gnu-cuda'))
    const x64 = manifest(path.join(repo, 'npm', 'linux-x64-gnu'))
    expect(cuda.name).toBe(CUDA_PACKAGE)
    for (const key of ['version', 'os', 'cpu', 'libc', 'engines', 'license']) expect(cuda[key], key).toEqual(x64[key])
    expect(cuda.main).toBeUndefined()
    expect(cuda.files.filter((f: string) => f.startsWith('lib')).sort()).toEqual(
      ['libonnxruntime.so.1', 'libonnxruntime_providers_cuda.so', 'libonnxruntime_providers_shared.so'],
    )
    // Installed by the user: in no published package.json's dependencies.
    const root = manifest(path.join(project, 'node_modules', 'ortex'))
    for (const deps of [root.dependencies, root.optionalDependencies, root.peerDependencies]) expect(deps?.[CUDA_PACKAGE]).toBeUndefined()
  })

  it('installs offline without a toolchain and without running any install script', () => {
    expect(recordedCalls()).toBe('')
    // Only the two packages and the root's runtime dependencies: no onnxruntime-node.
    const installed = readdirSync(path.join(project, 'node_modules')).filter((n) => !n.startsWith('.')).sort()
    expect(installed).toEqual(['ortex', PLATFORM_PACKAGE, 'ws'].sort())
    for (const name of installed) {
      const dir = path.join(project, 'node_modules', name)
      const scripts = manifest(dir).scripts ?? {}
      for (const hook of ['preinstall', 'install', 'postinstall', 'prepare']) expect(scripts[hook], `${name} ${hook}`).toBeUndefined()
      expect(existsSync(path.join(dir, 'binding.gyp')), `${name} binding.gyp`).toBe(false)
    }
  })

  it('imports ortex and ortex/wasm from ESM and CommonJS and generates with the simulated model', () => {
    const generate = `
      for (const [label, mod] of entries) {
        const engine = mod.Engine.simulated({ seed: 5 })
        const turn = engine.generate('Hello from a user project', { maxGeneratedTokens: 12 })
        let streamed = ''
        for await (const chunk of turn) streamed += chunk.text
        const result = await turn.done
        await engine.close()
        out[label] = { backend: engine.backend, finishReason: result.finishReason,
          generated: result.usage.generatedTokens, tokens: Array.from(result.tokens), same: streamed === result.text,
          sharedError: mod.OrtexError === entries[0][1].OrtexError }
      }
      const maps = require('node:fs').readFileSync('/proc/self/maps', 'utf8')
      out.addon = maps.split('\\n').map((l) => l.split(/\\s+/).at(-1)).find((f) => f.endsWith('.node') && f.includes('ortex')) ?? null
      console.log(JSON.stringify(out))`
    writeFileSync(
      path.join(project, 'esm.mjs'),
      `import { createRequire } from 'node:module'\nconst require = createRequire(import.meta.url)\n` +
        `import * as native from 'ortex'\nimport * as wasm from 'ortex/wasm'\n` +
        `const out = {}\nconst entries = [['native', native], ['wasm', wasm]]\n${generate}\n`,
    )
    writeFileSync(
      path.join(project, 'cjs.cjs'),
      `const native = require('ortex')\nconst wasm = require('ortex/wasm')\n` +
        `const out = {}\nconst entries = [['native', native], ['wasm', wasm]]\n;(async () => {${generate}})()\n`,
    )
    const addon = path.join(project, 'node_modules', PLATFORM_PACKAGE, 'ortex.linux-x64-gnu.node')
    for (const script of ['esm.mjs', 'cjs.cjs']) {
      const report = JSON.parse(ok(run('node', [script], project), `node ${script}`).trim())
      expect(report.native).toMatchObject({ backend: 'native', finishReason: 'max-generated-tokens', generated: 12, same: true, sharedError: true })
      expect(report.wasm).toMatchObject({ backend: 'wasm', finishReason: 'max-generated-tokens', generated: 12, same: true, sharedError: true })
      expect(report.wasm.tokens).toEqual(report.native.tokens) // one core, two targets, one trace
      expect(report.addon).toBe(addon) // the platform package's addon, not a build
    }
  })

  it('runs `npx ortex make-model` and `npx ortex generate --model` on the result', () => {
    const model = path.join(work, 'tiny-model')
    const made = run('npx', ['ortex', 'make-model', '--out', model], project)
    expect(made.status, made.stderr).toBe(0)
    expect(made.stdout).toMatch(/tiny-model: tiny gqa seed 0, [\d,]+ parameters/)
    for (const file of ['genai_config.json', 'model.onnx', 'model.onnx.data', 'tokenizer.json']) {
      expect(existsSync(path.join(model, file)), file).toBe(true)
    }
    // The installed generator writes the very bytes the repository's does.
    const reference = path.join(work, 'reference-model')
    ok(spawnSync('node', [path.join(repo, 'dist', 'cli.js'), 'make-model', '--out', reference], { encoding: 'utf8' }), 'make-model (repository)')
    for (const file of ['model.onnx', 'model.onnx.data', 'tokenizer.json', 'genai_config.json']) {
      expect(readFileSync(path.join(model, file)).equals(readFileSync(path.join(reference, file))), file).toBe(true)
    }

    const generated = run('npx', ['ortex', 'generate', '--model', model, '--max-tokens', '8'], project)
    expect(generated.status, generated.stderr).toBe(0)
    expect(generated.stdout).toMatch(/^\[r1\] /m)
    expect(generated.stdout).toMatch(/^total: [1-8] tokens from 1 requests in [\d.]+ ms: [\d.]+ tok\/s \(native\)$/m)

    // The model runs on the platform package's ONNX Runtime (onnxruntime-node is not installed).
    writeFileSync(
      path.join(project, 'load.mjs'),
      `import { readFileSync } from 'node:fs'\nimport { Engine } from 'ortex'\n` +
        `const engine = await Engine.load(process.argv[2])\n` +
        `const result = await engine.generate('The river', { maxGeneratedTokens: 4, ignoreEos: true }).done\n` +
        `await engine.close()\n` +
        `const ort = readFileSync('/proc/self/maps', 'utf8').split('\\n').map((l) => l.split(/\\s+/).at(-1)).find((f) => f.includes('libonnxruntime')) ?? null\n` +
        `console.log(JSON.stringify({ generated: result.usage.generatedTokens, ort }))\n`,
    )
    const loaded = JSON.parse(ok(run('node', ['load.mjs', model], project), 'node load.mjs').trim())
    expect(loaded).toEqual({ generated: 4, ort: path.join(project, 'node_modules', PLATFORM_PACKAGE, 'libonnxruntime.so.1') })
    expect(recordedCalls()).toBe('')
  })

  it("names the CUDA package when executionProvider 'cuda' is asked for without it", () => {
    const model = path.join(work, 'tiny-model') // made by the test above
    writeFileSync(
      path.join(project, 'cuda.mjs'),
      `import { Engine, OrtexError } from 'ortex'\n` +
        `let error = null\ntry { await Engine.load(process.argv[2], { executionProvider: 'cuda' }) } catch (e) { error = { ortex: e instanceof OrtexError, code: e.code, message: e.message } }\n` +
        `const engine = await Engine.load(process.argv[2])\n` +
        `const generated = (await engine.generate('The river', { maxGeneratedTokens: 2, ignoreEos: true }).done).usage.generatedTokens\n` +
        `await engine.close()\nconsole.log(JSON.stringify({ error, generated }))\n`,
    )
    const report = JSON.parse(ok(run('node', ['cuda.mjs', model], project), 'node cuda.mjs').trim())
    expect(report.error).toMatchObject({ ortex: true, code: 'UNSUPPORTED' })
    expect(report.error.message).toContain(`the package ${CUDA_PACKAGE}, which is not installed: \`npm install ${CUDA_PACKAGE}@${manifest(path.join(project, 'node_modules', 'ortex')).version}\` beside ortex`)
    expect(report.error.message).toContain('NVIDIA driver for CUDA 13')
    expect(report.generated).toBe(2) // the refusal opened nothing: the CPU load still works
  })

  it('names the platform package when it is missing or the platform has none; ortex/wasm still works', () => {
    rmSync(path.join(project, 'node_modules', PLATFORM_PACKAGE), { recursive: true, force: true })
    writeFileSync(
      path.join(project, 'missing.mjs'),
      `import { Engine, OrtexError } from 'ortex'\nimport { Engine as WasmEngine } from 'ortex/wasm'\n` +
        `let error = null\ntry { Engine.simulated() } catch (e) { error = { ortex: e instanceof OrtexError, code: e.code, message: e.message } }\n` +
        `const text = await WasmEngine.simulated({ seed: 1 }).generate('hi', { maxGeneratedTokens: 3 }).text()\n` +
        `console.log(JSON.stringify({ error, wasm: typeof text }))\n`,
    )
    const report = JSON.parse(ok(run('node', ['missing.mjs'], project), 'node missing.mjs').trim())
    expect(report.wasm).toBe('string')
    expect(report.error).toMatchObject({ ortex: true, code: 'UNSUPPORTED' })
    expect(report.error.message).toContain(`npm install ${PLATFORM_PACKAGE}@`)

    // On a platform without a prebuilt addon the error says so and points at ortex/wasm.
    writeFileSync(
      path.join(project, 'unsupported.cjs'),
      `Object.defineProperty(process, 'arch', { value: 'riscv64' })\n` +
        `const { Engine } = require('ortex')\n` +
        `try { Engine.simulated(); console.log('{}') } catch (e) { console.log(JSON.stringify({ code: e.code, message: e.message })) }\n`,
    )
    const unsupported = JSON.parse(ok(run('node', ['unsupported.cjs'], project), 'node unsupported.cjs').trim())
    expect(unsupported.code).toBe('UNSUPPORTED')
    expect(unsupported.message).toMatch(
      /no native addon for linux-riscv64-gnu \(prebuilt: ortex-linux-x64-gnu, ortex-linux-arm64-gnu\).*ortex\/wasm/,
    )

    const cli = run('npx', ['ortex', 'generate', '--simulated', '--max-tokens', '2'], project)
    expect(cli.status).toBe(1)
    expect(cli.stderr.trim().split('\n')).toHaveLength(1)
    expect(cli.stderr).toMatch(new RegExp(`^ortex: UNSUPPORTED: .*${PLATFORM_PACKAGE}`))
    expect(recordedCalls()).toBe('')
  })
})
