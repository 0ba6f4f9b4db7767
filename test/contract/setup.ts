// What every contract suite (test/contract/*.test.ts) shares: each file runs its sections under
// `contract (native)` and `contract (wasm)`, so a test's full name says its backend and section
// (`contract (wasm) > cancellation > ...`), whichever file it lives in.
import { afterEach, describe } from 'vitest'
import { BACKENDS, ortex, type BackendName, type OrtexModule } from '../helpers/backends'
import { drain, tokensOf, type Engine } from '../helpers/util'

export interface Contract {
  backend: BackendName
  mod: OrtexModule
  /** A simulated engine with `options`; it is closed after the test. */
  make(options?: Record<string, unknown>): Engine
  /** Greedy tokens a fresh request generates for `prompt` on an engine with `options`. */
  referenceTokens(prompt: string | number[], maxGeneratedTokens: number, options?: Record<string, unknown>): number[]
}

/** Declares `sections` once per backend, inside `describe('contract (<backend>)')`. */
export function describeContract(sections: (contract: Contract) => void): void {
  describe.each(BACKENDS)('contract (%s)', (backend: BackendName) => sections(contractFor(backend)))
}

function contractFor(backend: BackendName): Contract {
  const mod = ortex(backend)
  const open: Engine[] = []

  function make(options?: Record<string, unknown>): Engine {
    const engine = mod.Engine.simulated(options as any)
    open.push(engine)
    return engine
  }

  afterEach(async () => {
    for (const engine of open.splice(0)) await engine.close()
  })

  function referenceTokens(prompt: string | number[], maxGeneratedTokens: number, options?: Record<string, unknown>): number[] {
    const engine = make(options)
    const request = engine.createRequest()
    request.beginTurn(prompt, { maxGeneratedTokens })
    const events = drain(engine, engine.createEventBuffer(64))
    return tokensOf(events, request)
  }

  return { backend, mod, make, referenceTokens }
}
