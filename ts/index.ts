// `ortex`: the native addon (napi-rs). Model work of run() happens off the JS thread.

import { nativeBackend } from './backend-native'
import type { Backend } from './backend'
import { Engine as EngineBase } from './engine'

export class Engine extends EngineBase {
  /** @internal */
  static override _backend: Backend | null = nativeBackend
}

export * from './exports'
