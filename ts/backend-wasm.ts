// The WebAssembly backend: the wasm-bindgen package of crates/ortex-wasm (target nodejs, so a
// CommonJS module that instantiates the .wasm synchronously when required). It has only the
// simulated model, and its `run` executes on the calling thread.

import { createRequire } from 'node:module'

import type { CoreEngine, WasmBinding } from './binding'
import type { Backend } from './backend'
import { fromPackageRoot } from './backend'
import { OrtexError } from './errors'

/** Where the wasm-bindgen package's entry lives, relative to the package root. The one place
 *  that names it. */
export const WASM_PACKAGE_PATH = 'wasm-pkg/ortex_wasm.js'

let binding: WasmBinding | null = null

function loadBinding(): WasmBinding {
  if (binding !== null) return binding
  const file = fromPackageRoot(WASM_PACKAGE_PATH)
  try {
    const require = createRequire(file)
    binding = require(file) as WasmBinding
  } catch (error) {
    throw new OrtexError(
      'UNSUPPORTED',
      `the ortex WebAssembly build is not available: cannot load ${WASM_PACKAGE_PATH} ` +
        `(${(error as Error)?.message?.split('\n')[0] ?? String(error)}); build it with \`npm run build\``,
      { cause: error },
    )
  }
  return binding
}

export const wasmBackend: Backend = {
  kind: 'wasm',
  simulated(options) {
    return loadBinding().CoreEngine.simulated(options)
  },
  async load(modelDir) {
    throw new OrtexError(
      'UNSUPPORTED',
      `cannot load ${JSON.stringify(modelDir)}: the WebAssembly build runs only the simulated model; ` +
        `use Engine.simulated(), or the native build (import { Engine } from 'ortex') for model folders`,
    )
  },
  chat(files, controls) {
    const factory = loadBinding().CoreChat
    return files === null ? factory.chatml(controls) : factory.fromFiles(files, controls)
  },
  async run(core: CoreEngine, events, capacity) {
    return core.runSync(events, capacity)
  },
}
