// The WebAssembly backend: the wasm-bindgen package of crates/ortex-wasm (target nodejs, so a
// CommonJS module that instantiates the .wasm synchronously when required). It has only the
// simulated model, and its `run` executes on the calling thread.
//
// A trap poisons an instance, and only that instance. Every engine, session manager and chat
// template made here lives in the linear memory of one instantiation, and a trap (a panic under
// panic=abort, a stack overflow, an out-of-bounds access) or a JavaScript exception unwinding
// through wasm frames leaves that memory in an unknown state: the shadow stack pointer is not
// restored, a borrow flag or the allocator may be half-updated. So after one:
//
//   instance A (trapped) ── every object on it: each call throws ENGINE_UNHEALTHY without
//   │                       entering wasm, its engines are marked unhealthy (their turns fail,
//   │                       their sessions close), and its objects are detached from
//   │                       wasm-bindgen's finalizers, so not even a free runs on that memory
//   instance B (fresh)  ── every engine made after the trap
//
// A fresh instance comes from evaluating the package's module again (its require cache entry
// dropped), which compiles and instantiates the .wasm anew.

import { createRequire } from 'node:module'

import type { CoreChat, CoreEngine, WasmBinding } from './binding'
import type { Backend } from './backend'
import { fromPackageRoot } from './backend'
import { OrtexError, isErrorCode } from './errors'

/** Where the wasm-bindgen package's entry lives, relative to the package root. The one place
 *  that names it. */
export const WASM_PACKAGE_PATH = 'wasm-pkg/ortex_wasm.js'

/** What wasm-bindgen gives every exported object: detaching it from its finalizer without
 *  freeing (the memory goes with the instance). */
interface WasmObject {
  __destroy_into_raw(): number
}

/** An error the binding returned on purpose (coded by crates/ortex-wasm): the wasm call came
 *  back normally, and the instance is intact. */
function isCodedError(error: unknown): boolean {
  return typeof error === 'object' && error !== null && isErrorCode((error as { code?: unknown }).code)
}

/** One instantiation of the wasm package and what lives in its memory. */
class WasmInstance {
  readonly binding: WasmBinding
  /** Set by the first trap; then every call throws it. */
  private failure: OrtexError | null = null
  /** Every object made on this instance that may still be alive (pruned as they are collected). */
  private readonly objects = new Set<WeakRef<object>>()
  private readonly collected = new FinalizationRegistry<WeakRef<object>>((ref) => this.objects.delete(ref))
  /** Told when the instance traps, by the object they watch. */
  private readonly trapListeners = new WeakMap<object, () => void>()
  /** The object each guard wraps. */
  private readonly targets = new WeakMap<object, object>()

  constructor(binding: WasmBinding) {
    this.binding = binding
  }

  get trapped(): boolean {
    return this.failure !== null
  }

  /** Runs one call into the instance; a trap poisons it. */
  call<T>(fn: () => T): T {
    if (this.failure !== null) throw this.failure
    try {
      return fn()
    } catch (error) {
      if (isCodedError(error)) throw error
      throw this.poison(error)
    }
  }

  /** `object` with every method run through call(), and what a method returns on this instance
   *  (createSessions' manager) guarded too. */
  guard<T extends object>(object: T): T {
    const ref = new WeakRef(object)
    this.objects.add(ref)
    this.collected.register(object, ref)
    const methods = new Map<PropertyKey, (...args: unknown[]) => unknown>()
    const guarded = new Proxy(object, {
      get: (target, key) => {
        const member: unknown = Reflect.get(target, key, target)
        if (typeof member !== 'function') return member
        let method = methods.get(key)
        if (method === undefined) {
          method = (...args) => this.guardResult(this.call(() => (member as (...a: unknown[]) => unknown).apply(target, args)))
          methods.set(key, method)
        }
        return method
      },
    })
    this.targets.set(guarded, object)
    return guarded
  }

  /** Calls `listener` once if this instance traps while `object` (a guard) is alive. */
  onTrap(object: object, listener: () => void): void {
    const target = this.targets.get(object)
    if (target !== undefined) this.trapListeners.set(target, listener)
  }

  private guardResult(value: unknown): unknown {
    if (typeof value !== 'object' || value === null) return value
    const { CoreEngine, CoreSessions, CoreChat, CoreConversation } = this.binding as unknown as Record<string, abstract new () => unknown>
    const isOwn = value instanceof CoreEngine! || value instanceof CoreSessions! || value instanceof CoreChat! || value instanceof CoreConversation!
    return isOwn ? this.guard(value) : value
  }

  /** The instance is lost: detach its objects, tell their watchers. Returns the error that every
   *  call on it throws from now on. */
  private poison(trap: unknown): OrtexError {
    const reason = trap instanceof Error ? `${trap.name}: ${trap.message}` : String(trap)
    this.failure = new OrtexError(
      'ENGINE_UNHEALTHY',
      `the WebAssembly instance this engine runs on trapped (${reason}); every engine on it is unusable, close them ` +
        `(engines made from now on get a fresh instance)`,
      { cause: trap },
    )
    const listeners: (() => void)[] = []
    for (const ref of this.objects) {
      const object = ref.deref()
      if (object === undefined) continue
      try {
        ;(object as WasmObject).__destroy_into_raw()
      } catch {
        // Detaching only touches JavaScript; nothing to do if it cannot.
      }
      const listener = this.trapListeners.get(object)
      if (listener !== undefined) listeners.push(listener)
    }
    this.objects.clear()
    // After the failing call has unwound: a listener (an engine ending its sessions) must not
    // run inside whatever call trapped.
    queueMicrotask(() => {
      for (const listener of listeners) {
        try {
          listener()
        } catch {
          // One engine's reaction is its own; the others are still told.
        }
      }
    })
    return this.failure
  }
}

let current: WasmInstance | null = null

/** The instance new objects are made on: the current one, or a fresh one after a trap. */
function instance(): WasmInstance {
  if (current === null || current.trapped) current = new WasmInstance(instantiate(current !== null))
  return current
}

function instantiate(again: boolean): WasmBinding {
  const file = fromPackageRoot(WASM_PACKAGE_PATH)
  try {
    const require = createRequire(file)
    // Evaluating the module again instantiates the .wasm again (and compiles it: a trap is rare).
    if (again) delete require.cache[require.resolve(file)]
    return require(file) as WasmBinding
  } catch (error) {
    throw new OrtexError(
      'UNSUPPORTED',
      `the ortex WebAssembly build is not available: cannot load ${WASM_PACKAGE_PATH} ` +
        `(${(error as Error)?.message?.split('\n')[0] ?? String(error)}); build it with \`npm run build\``,
      { cause: error },
    )
  }
}

/** Which instance each guarded engine lives on. */
const instanceOf = new WeakMap<object, WasmInstance>()

export const wasmBackend: Backend = {
  kind: 'wasm',
  simulated(options) {
    const wasm = instance()
    const core = wasm.guard(wasm.call(() => wasm.binding.CoreEngine.simulated(options)))
    instanceOf.set(core, wasm)
    return core
  },
  async load(modelDir) {
    throw new OrtexError(
      'UNSUPPORTED',
      `cannot load ${JSON.stringify(modelDir)}: the WebAssembly build runs only the simulated model; ` +
        `use Engine.simulated(), or the native build (import { Engine } from 'ortex') for model folders`,
    )
  },
  chat(files, controls) {
    const wasm = instance()
    const factory = wasm.binding.CoreChat
    return wasm.guard(wasm.call((): CoreChat => (files === null ? factory.chatml(controls) : factory.fromFiles(files, controls))))
  },
  async run(core: CoreEngine, events, capacity) {
    return core.runSync(events, capacity)
  },
  onTrap(core: CoreEngine, listener: () => void) {
    instanceOf.get(core)?.onTrap(core, listener)
  },
}
