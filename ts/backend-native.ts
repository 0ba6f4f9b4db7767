// The native backend: the napi-rs addon (crates/ortex-napi). Its `run` executes the model
// transaction on the libuv thread pool and writes the events on the JS thread when it resolves.
// The addon is loaded on first use, so importing `ortex` never fails on a machine without it.

import { statSync } from 'node:fs'
import { createRequire } from 'node:module'
import path from 'node:path'

import type { NativeBinding, NativeCoreEngine } from './binding'
import type { Backend } from './backend'
import { fromPackageRoot } from './backend'
import { OrtexError } from './errors'

/** Where the addon lives, relative to the package root. The one place that names it. */
export const NATIVE_ADDON_PATH = 'native/ortex.linux-x64-gnu.node'

let binding: NativeBinding | null = null

function loadBinding(): NativeBinding {
  if (binding !== null) return binding
  const file = fromPackageRoot(NATIVE_ADDON_PATH)
  try {
    const require = createRequire(file)
    binding = require(file) as NativeBinding
  } catch (error) {
    const platform = `${process.platform}-${process.arch}`
    throw new OrtexError(
      'UNSUPPORTED',
      `the native ortex addon is not available for ${platform}: cannot load ${NATIVE_ADDON_PATH} ` +
        `(${(error as Error)?.message?.split('\n')[0] ?? String(error)}); build it with \`npm run build\`, ` +
        `or use the WebAssembly build: import { Engine } from 'ortex/wasm'`,
      { cause: error },
    )
  }
  return binding
}

/** The checks that do not need ONNX Runtime: the folder exists and has a genai_config.json. */
function checkModelFolder(modelDir: string): void {
  const dir = path.resolve(modelDir)
  if (stat(dir)?.isDirectory() !== true) {
    throw new OrtexError('MODEL_LOAD', `model folder ${JSON.stringify(modelDir)} does not exist or is not a folder`)
  }
  if (stat(path.join(dir, 'genai_config.json'))?.isFile() !== true) {
    throw new OrtexError('MODEL_LOAD', `${JSON.stringify(modelDir)} is not a model folder: it has no genai_config.json`)
  }
}

function stat(file: string): ReturnType<typeof statSync> | undefined {
  try {
    return statSync(file, { throwIfNoEntry: false })
  } catch {
    return undefined // unreadable counts as missing
  }
}

export const nativeBackend: Backend = {
  kind: 'native',
  simulated(optionsJson) {
    return loadBinding().CoreEngine.simulated(optionsJson)
  },
  async load(modelDir) {
    checkModelFolder(modelDir)
    throw new OrtexError(
      'UNSUPPORTED',
      `cannot load ${JSON.stringify(modelDir)}: ONNX model folders arrive with ONNX Runtime support, ` +
        `not yet in this build; use Engine.simulated() meanwhile`,
    )
  },
  run(core, events, capacity) {
    return (core as NativeCoreEngine).run(events, capacity)
  },
}
