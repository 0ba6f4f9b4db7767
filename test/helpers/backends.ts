// The two entry points under test, imported by their package names exactly as users import them.
// vitest.config.ts maps `ortex` and `ortex/wasm` to the BUILT package (dist/, via package.json
// "exports"), so these suites test what users get; run `npm run build:ts` (or scripts/build.sh)
// first.
import * as nativeEntry from 'ortex'
import * as wasmEntry from 'ortex/wasm'

export type BackendName = 'native' | 'wasm'
export type OrtexModule = typeof nativeEntry

export const BACKENDS: readonly BackendName[] = ['native', 'wasm']

const modules: Record<BackendName, OrtexModule> = {
  native: nativeEntry,
  wasm: wasmEntry as unknown as OrtexModule,
}

export function ortex(backend: BackendName): OrtexModule {
  return modules[backend]
}

/** SIM_BACKEND / ORTEX_BACKEND restrict a run to one backend (replaying a failure, say). */
export function selectedBackends(): BackendName[] {
  const wanted = process.env.SIM_BACKEND ?? process.env.ORTEX_BACKEND
  if (!wanted) return [...BACKENDS]
  if (wanted !== 'native' && wanted !== 'wasm') throw new Error(`unknown backend ${wanted}: use native or wasm`)
  return [wanted]
}
