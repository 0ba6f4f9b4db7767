// `ortex/wasm`: the WebAssembly build of the same core. It has only the simulated model
// (Engine.load rejects with UNSUPPORTED) and run() executes on the calling thread.

import { wasmBackend } from './backend-wasm'
import type { Backend } from './backend'
import { Engine as EngineBase } from './engine'

export class Engine extends EngineBase {
  /** @internal */
  static override _backend: Backend | null = wasmBackend
}

export * from './exports'
