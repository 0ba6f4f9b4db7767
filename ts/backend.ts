// What the Engine needs from a binding, whichever it is: make a core engine, and run one
// transaction asynchronously. backend-native.ts and backend-wasm.ts provide the two.

import path from 'node:path'
import { fileURLToPath } from 'node:url'

import type { CoreChat, CoreEngine } from './binding'
import type { ChatFilesInput, ModelOptionsInput, SimOptionsInput } from './generated/boundary'
import type { BackendKind } from './types'

export interface Backend {
  readonly kind: BackendKind
  /** The simulated model. Throws OrtexError. */
  simulated(options: SimOptionsInput): CoreEngine
  /** An ONNX model folder. Rejects with OrtexError. */
  load(modelDir: string, options: ModelOptionsInput): Promise<CoreEngine>
  /** A chat template from a model folder's files, or the built-in ChatML one (null), for
   *  prompts tokenized by a codec with these control strings. Throws OrtexError
   *  (CHAT_CONFIG_INVALID, CHAT_TEMPLATE_INVALID). */
  chat(files: ChatFilesInput | null, controls: string[]): CoreChat
  /** Drains retained events or executes one transaction; resolves with the event count. */
  run(core: CoreEngine, events: Int32Array, capacity: number): Promise<number>
  /** Where engines share memory (WebAssembly: one instance), a trap of one poisons all: calls
   *  `listener` once, after the failing call, if that happens to `core`'s memory. */
  onTrap?(core: CoreEngine, listener: () => void): void
}

/** The folder this module's file lives in: dist/ when built, ts/ when run from source. Both sit
 *  directly under the package root. */
function moduleDir(): string {
  // The CommonJS build has __dirname; the ESM build (and the sources under vitest) has
  // import.meta.url. Never both, so the unreachable branch is harmless in each format.
  if (typeof __dirname === 'string') return __dirname
  return path.dirname(fileURLToPath(import.meta.url))
}

/** The package root (the folder holding package.json, dist/, native/ and wasm-pkg/). */
export function packageRoot(): string {
  return path.resolve(moduleDir(), '..')
}

export function fromPackageRoot(relative: string): string {
  return path.join(packageRoot(), relative)
}
