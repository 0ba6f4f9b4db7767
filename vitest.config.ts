// vitest configuration for ortex's TypeScript suites (test/).
//
// What is tested: the BUILT package, imported by its package names `ortex` and `ortex/wasm`, the
// way users import it. The aliases below resolve those names through package.json "exports"
// (the `import` condition) to the files in dist/ that `npm run build:ts` (scripts/build.sh)
// writes, and `server.deps.external` hands those files to Node's own loader untransformed, so
// the native addon, the wasm package and the ESM/CommonJS split load exactly as in production.
// Build before testing: `npm test` (scripts/test.sh) does.
//
// Workers are forks started with --expose-gc: the reclamation tests (a Request dropped without
// close()) and the simulation's dropped-handle seeds call `global.gc()`.
import { existsSync, readFileSync } from 'node:fs'
import { dirname, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { defineConfig } from 'vitest/config'

const root = dirname(fileURLToPath(import.meta.url))

/** Resolves a subpath of the package's "exports" with the ESM conditions, like Node does. */
function entry(subpath: '.' | './wasm', fallback: string): string {
  const pkg = JSON.parse(readFileSync(resolve(root, 'package.json'), 'utf8'))
  const pick = (target: unknown): string | undefined => {
    if (typeof target === 'string') return target
    if (Array.isArray(target)) return target.map(pick).find(Boolean)
    if (target && typeof target === 'object') {
      for (const condition of ['node', 'import', 'default']) {
        const found = pick((target as Record<string, unknown>)[condition])
        if (found) return found
      }
    }
    return undefined
  }
  const exportsField = pkg.exports
  const target =
    typeof exportsField === 'string' && subpath === '.'
      ? exportsField
      : pick(exportsField?.[subpath] ?? (subpath === '.' && !exportsField?.['.'] ? exportsField : undefined))
  const file = resolve(root, target ?? fallback)
  if (!existsSync(file)) {
    // Leave the alias in place: the import then fails with a clear "cannot find" naming the file.
    console.warn(`[vitest.config] ${file} is missing: build the package first (npm run build)`)
  }
  return file
}

export default defineConfig({
  resolve: {
    alias: [
      { find: /^ortex\/wasm$/, replacement: entry('./wasm', 'dist/wasm.js') },
      { find: /^ortex$/, replacement: entry('.', 'dist/index.js') },
    ],
  },
  test: {
    include: ['test/**/*.test.ts'],
    // The suites that need redis-server and nginx run by `npm run test:scale` (vitest.scale.config.ts).
    exclude: ['test/scale/**', '**/node_modules/**'],
    pool: 'forks',
    execArgv: ['--expose-gc'],
    // Two cores in CI: the simulation file is the long pole; the rest run beside it.
    maxWorkers: 2,
    testTimeout: 60_000,
    hookTimeout: 60_000,
    server: {
      deps: {
        // The built package runs in Node untransformed (real module loading, one OrtexError).
        external: [/[\\/]dist[\\/]/],
      },
    },
  },
})
