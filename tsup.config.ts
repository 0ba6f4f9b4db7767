// Builds the TypeScript facade into dist/.
//
// One implementation serves both module systems, so `ortex` imported as ESM and required as
// CommonJS share every class (one OrtexError, one Request): no dual-package hazard.
// - The code is built once, as CommonJS (dist/index.js, dist/wasm.js, dist/cli.js), with code
//   splitting so the two entry points and the CLI share one chunk.
// - dist/index.mjs and dist/wasm.mjs are small ESM wrappers that re-export the CommonJS build;
//   they are written after the build from the CommonJS modules' own export lists.
// - Types: .d.ts for `require`, .d.mts for `import`.
// Outputs stay flat in dist/, which the backends rely on to find native/ and wasm-pkg/ at the
// package root (ts/backend.ts).
import { rmSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import path from 'node:path'
import { defineConfig } from 'tsup'

const ENTRY_POINTS = { index: 'ts/index.ts', wasm: 'ts/wasm.ts' }

/**
 * tsup turns the split CommonJS chunks into CommonJS with sucrase, which also rewrites every `?.`
 * and `??` into calls of its `_optionalChain` / `_nullishCoalesce` helpers (an array and a closure
 * per access: 6% of the JS thread's time per model step, measured with perf; tsup has no option to
 * turn that off, egoist/tsup#1087). esbuild lowers the two operators first, inline, so sucrase
 * finds none.
 */
function lowerOptionalChaining(options: { supported?: Record<string, boolean> }): void {
  options.supported = { ...options.supported, 'optional-chain': false, 'nullish-coalescing': false }
}
const dist = path.resolve('dist')

// The configurations below build in parallel, so neither cleans; this runs once, before both.
rmSync(dist, { recursive: true, force: true })

function writeEsmWrappers(): void {
  const require = createRequire(path.join(dist, 'index.js'))
  for (const name of Object.keys(ENTRY_POINTS)) {
    const file = path.join(dist, `${name}.js`)
    delete require.cache[file]
    const names = Object.keys(require(file) as object).filter((n) => n !== '__esModule' && n !== 'default')
    const source =
      `// ESM entry point: re-exports the CommonJS build, so both module systems share one copy.\n` +
      `import cjs from './${name}.js'\n` +
      `export const { ${names.join(', ')} } = cjs\n`
    writeFileSync(path.join(dist, `${name}.mjs`), source)
  }
}

export default defineConfig([
  {
    // gguf-worker: an import's conversion thread (ts/modelkit/gguf/convert.ts starts it by this name).
    entry: { ...ENTRY_POINTS, cli: 'ts/cli/main.ts', 'gguf-worker': 'ts/modelkit/gguf/convert-worker.ts' },
    format: ['cjs'],
    outDir: 'dist',
    // A devDependency that the model tooling may reach (the reference loop): never bundle its
    // native binding.
    // ioredis: an optional peer dependency, loaded only by a server given a session store.
    external: ['onnxruntime-node', 'ioredis'],
    // The /metrics endpoint's prom-client (Apache-2.0) and its one dependency chain are bundled:
    // the package's users install only `ws` besides ortex itself (test/packaging.test.ts).
    noExternal: ['prom-client', 'tdigest', 'bintrees'],
    target: 'node20',
    esbuildOptions: lowerOptionalChaining,
    platform: 'node',
    splitting: true,
    shims: true,
    dts: { entry: ENTRY_POINTS },
    sourcemap: true,
    clean: false,
    onSuccess: async () => writeEsmWrappers(),
  },
  {
    entry: ENTRY_POINTS,
    format: ['esm'],
    outDir: 'dist',
    target: 'node20',
    platform: 'node',
    dts: { entry: ENTRY_POINTS, only: true },
    clean: false,
  },
])
