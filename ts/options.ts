// Option objects: each public option object (engine, simulated model, request, turn) checked
// into the input the core takes (its type generated from the Rust side's mirror,
// ts/generated/boundary.ts; the core refuses unknown fields), built only from validated values.
// Each key list is checked against both the public option type and the generated input type, so a
// key added on one side only fails the build. The value checks they use, and the rules they
// follow (strict keys, `undefined` as absent), are validate.ts's.

import { invalidArgument } from './errors'
import {
  type ConstraintInput,
  type FaultsInput,
  type ModelOptionsInput,
  type RequestOptionsInput,
  type SimOptionsInput,
  type TurnOptionsInput,
} from './generated/boundary'
import type { EngineOptions, GgufLoadOptions, LoadOptions, RequestOptions, SimulatedFaults, SimulatedOptions, TurnOptions } from './types'
import * as check from './validate'

/** True when `Keys` (a key list's entries) are exactly the keys of `T`; else `never`, which makes
 *  the `satisfies` below fail. */
type ExactKeys<Keys extends PropertyKey, T> = [Exclude<keyof T, Keys>, Exclude<Keys, keyof T>] extends [never, never] ? true : never

const MODEL_KEYS = ['executionProvider', 'intraOpThreads', 'intraOpSpinning'] as const

const CORE_ENGINE_KEYS = [
  'batching',
  'blockSize',
  'numBlocks',
  'kvCacheBytes',
  'maxBatchSize',
  'maxScheduledTokens',
  'prefillChunkSize',
  'maxPrefillWaitSteps',
  'maxRequests',
  'prefixCaching',
] as const

const ENGINE_KEYS = [...CORE_ENGINE_KEYS, ...MODEL_KEYS] as const

const LOAD_KEYS = [...ENGINE_KEYS, 'gguf'] as const

const GGUF_KEYS = ['weights', 'kv', 'accuracyLevel', 'dtype', 'attention', 'pagedKernel', 'blockSize', 'contextLength', 'workers', 'onProgress'] as const

const SIM_ONLY_KEYS = ['seed', 'vocabSize', 'eosTokenId', 'maxLength', 'eosProbability', 'faults', 'stepCostUs', 'tokenCostUs'] as const

const SIM_KEYS = [...ENGINE_KEYS, ...SIM_ONLY_KEYS] as const

const FAULT_KEYS = [
  'retryableSteps',
  'fatalSteps',
  'capacitySteps',
  'retryableRate',
  'capacityRate',
  'fatalRate',
  'seed',
] as const

export const REQUEST_KEYS = ['maxSessionTokens'] as const

const CORE_TURN_KEYS = [
  'maxGeneratedTokens',
  'temperature',
  'topK',
  'topP',
  'minP',
  'repetitionPenalty',
  'presencePenalty',
  'frequencyPenalty',
  'seed',
  'ignoreEos',
  'stopTokenIds',
  'eosTokenIds',
  'logprobs',
  'stop',
  'constraint',
] as const

export const TURN_KEYS = [...CORE_TURN_KEYS, 'signal'] as const

// The key lists against the public types and the generated inputs (compile-time only).
true satisfies ExactKeys<(typeof ENGINE_KEYS)[number], EngineOptions>
true satisfies ExactKeys<(typeof ENGINE_KEYS)[number], ModelOptionsInput>
true satisfies ExactKeys<(typeof LOAD_KEYS)[number], LoadOptions>
true satisfies ExactKeys<(typeof GGUF_KEYS)[number], GgufLoadOptions>
true satisfies ExactKeys<(typeof SIM_KEYS)[number], SimulatedOptions>
true satisfies ExactKeys<(typeof CORE_ENGINE_KEYS | typeof SIM_ONLY_KEYS)[number], SimOptionsInput>
true satisfies ExactKeys<(typeof FAULT_KEYS)[number], SimulatedFaults>
true satisfies ExactKeys<(typeof FAULT_KEYS)[number], FaultsInput>
true satisfies ExactKeys<(typeof REQUEST_KEYS)[number], RequestOptions>
true satisfies ExactKeys<(typeof REQUEST_KEYS)[number], RequestOptionsInput>
true satisfies ExactKeys<(typeof TURN_KEYS)[number], TurnOptions>
true satisfies ExactKeys<(typeof CORE_TURN_KEYS)[number], TurnOptionsInput>

/** Engine options common to every model, into `out`. `forSimulated` drops the ONNX Runtime
 *  settings, which mean nothing to the simulated model (and which its core options do not have). */
function engineFields(name: string, present: Map<string, unknown>, out: ModelOptionsInput, forSimulated: boolean): void {
  for (const [key, value] of present) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'batching':
        out.batching = check.oneOf(arg, value, ['dynamic', 'static'] as const)
        break
      case 'blockSize':
      case 'numBlocks':
      case 'maxBatchSize':
      case 'maxScheduledTokens':
      case 'prefillChunkSize':
      case 'maxRequests':
        out[key] = check.integer(arg, value, 1)
        break
      case 'maxPrefillWaitSteps':
        out[key] = check.integer(arg, value, 0)
        break
      case 'kvCacheBytes':
        out.kvCacheBytes = check.integer(arg, value, 1, Number.MAX_SAFE_INTEGER)
        break
      case 'prefixCaching':
        out.prefixCaching = check.boolean(arg, value)
        break
      case 'executionProvider': {
        const provider = check.oneOf(arg, value, ['cpu', 'cuda'])
        if (!forSimulated) out.executionProvider = provider
        break
      }
      case 'intraOpThreads': {
        const threads = check.integer(arg, value, 0, 1024)
        if (!forSimulated) out.intraOpThreads = threads
        break
      }
      case 'intraOpSpinning': {
        const spinning = check.boolean(arg, value)
        if (!forSimulated) out.intraOpSpinning = spinning
        break
      }
    }
  }
}

export function engineOptions(name: string, value: unknown): ModelOptionsInput {
  const out: ModelOptionsInput = {}
  engineFields(name, check.options(name, value, ENGINE_KEYS), out, false)
  return out
}

/** `Engine.load`'s options: the engine's (for the core) and, apart, a GGUF file's import's. */
export function loadOptions(name: string, value: unknown): { engine: ModelOptionsInput; gguf: GgufLoadOptions | undefined } {
  const present = check.options(name, value, LOAD_KEYS)
  const gguf = present.get('gguf')
  present.delete('gguf')
  const engine: ModelOptionsInput = {}
  engineFields(name, present, engine, false)
  return { engine, gguf: gguf === undefined ? undefined : ggufOptions(`${name}.gguf`, gguf) }
}

/** The import's options, each of the right kind; the rules between them are the importer's. */
function ggufOptions(name: string, value: unknown): GgufLoadOptions {
  const out: GgufLoadOptions = {}
  for (const [key, v] of check.options(name, value, GGUF_KEYS)) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'weights':
        out.weights = check.oneOf(arg, v, ['int4', 'fp32'] as const)
        break
      case 'kv':
        out.kv = check.oneOf(arg, v, ['fp16', 'fp32'] as const)
        break
      case 'accuracyLevel':
        if (v !== 0 && v !== 4) throw invalidArgument(`${arg} must be 0 or 4, got ${check.describe(v)}`)
        out.accuracyLevel = v
        break
      case 'dtype':
        out.dtype = check.oneOf(arg, v, ['fp32', 'fp16'] as const)
        break
      case 'attention':
        out.attention = check.oneOf(arg, v, ['gqa', 'paged'] as const)
        break
      case 'pagedKernel':
        out.pagedKernel = check.oneOf(arg, v, ['cuda', 'reference'] as const)
        break
      case 'blockSize':
        out.blockSize = check.integer(arg, v, 1, 1 << 16)
        break
      case 'contextLength':
        out.contextLength = check.integer(arg, v, 1, 1 << 20)
        break
      case 'workers':
        out.workers = check.integer(arg, v, 1, 256)
        break
      case 'onProgress':
        if (typeof v !== 'function') throw invalidArgument(`${arg} must be a function, got ${check.describe(v)}`)
        out.onProgress = v as GgufLoadOptions['onProgress']
        break
    }
  }
  return out
}

function stepList(name: string, value: unknown): number[] {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of step numbers, got ${check.describe(value)}`)
  if (value.length > 1_000_000) throw invalidArgument(`${name} holds at most 1000000 steps`)
  return items(value, (v, i) => check.seed(`${name}[${i}]`, v))
}

function faults(name: string, value: unknown): FaultsInput {
  const out: FaultsInput = {}
  for (const [key, v] of check.options(name, value, FAULT_KEYS)) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'retryableSteps':
      case 'fatalSteps':
      case 'capacitySteps':
        out[key] = stepList(arg, v)
        break
      case 'retryableRate':
      case 'capacityRate':
      case 'fatalRate':
        out[key] = check.finite(arg, v, 0, 1)
        break
      case 'seed':
        out.seed = check.seed(arg, v)
        break
    }
  }
  return out
}

export function simulatedOptions(name: string, value: unknown): SimOptionsInput {
  const present = check.options(name, value, SIM_KEYS)
  const out: SimOptionsInput = {}
  const engine = new Map<string, unknown>()
  for (const [key, v] of present) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'seed':
      case 'stepCostUs':
      case 'tokenCostUs':
        out[key] = check.seed(arg, v)
        break
      case 'vocabSize':
        out.vocabSize = check.integer(arg, v, 2)
        break
      case 'eosTokenId':
        out.eosTokenId = check.integer(arg, v, 0)
        break
      case 'maxLength':
        out.maxLength = check.integer(arg, v, 1)
        break
      case 'eosProbability':
        out.eosProbability = check.finite(arg, v, 0, 1)
        break
      case 'faults':
        out.faults = check.checkingReads(arg, () => faults(arg, v))
        break
      default:
        engine.set(key, v)
    }
  }
  engineFields(name, engine, out, true)
  return out
}

export function requestOptions(name: string, present: Map<string, unknown>): RequestOptionsInput {
  const value = present.get('maxSessionTokens')
  return value === undefined ? {} : { maxSessionTokens: check.integer(`${name}.maxSessionTokens`, value) }
}

export interface CheckedTurnOptions {
  /** TurnOptions as the core takes them (without signal). */
  core: TurnOptionsInput
  signal: AbortSignal | null
}

function stopTokenIds(name: string, value: unknown): number[][] {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of token id arrays, got ${check.describe(value)}`)
  if (value.length > check.MAX_STOP_ENTRIES) throw invalidArgument(`${name} holds at most ${check.MAX_STOP_ENTRIES} sequences`)
  return items(value, (sequence, i) => Array.from(check.tokens(`${name}[${i}]`, sequence)))
}

/** `constraint`'s shape, with a JSON Schema copied through JSON (a snapshot, and plain JSON for
 *  the core, which compiles it and says what is wrong inside it). */
function constraint(name: string, value: unknown): ConstraintInput {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw invalidArgument(`${name} must be an object with a type, got ${check.describe(value)}`)
  }
  const given = value as Record<string, unknown>
  const fields = (type: string, field: string | null): void => {
    const extra = Object.keys(given).find((key) => key !== 'type' && key !== field)
    if (extra !== undefined) throw invalidArgument(`${name}.${extra} is not an option of a '${type}' constraint`)
  }
  const text = (field: string): string => {
    const v = given[field]
    if (typeof v !== 'string') throw invalidArgument(`${name}.${field} must be a string, got ${check.describe(v)}`)
    return v
  }
  switch (given.type) {
    case 'json':
      fields('json', null)
      return { type: 'json' }
    case 'json_schema': {
      fields('json_schema', 'schema')
      const schema = given.schema
      if (typeof schema !== 'boolean' && (typeof schema !== 'object' || schema === null || Array.isArray(schema))) {
        throw invalidArgument(`${name}.schema must be a JSON Schema (an object or a boolean), got ${check.describe(schema)}`)
      }
      let copy: Record<string, unknown> | boolean
      try {
        copy = JSON.parse(JSON.stringify(schema)) as Record<string, unknown> | boolean
      } catch (error) {
        throw invalidArgument(`${name}.schema is not JSON: ${(error as Error).message}`)
      }
      return { type: 'json_schema', schema: copy }
    }
    case 'regex':
      fields('regex', 'pattern')
      return { type: 'regex', pattern: text('pattern') }
    case 'lark':
      fields('lark', 'grammar')
      return { type: 'lark', grammar: text('grammar') }
    default:
      throw invalidArgument(
        `${name}.type must be 'json', 'json_schema', 'regex' or 'lark', got ${check.describe(given.type)}`,
      )
  }
}

function stopStrings(name: string, value: unknown): string[] | null {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of strings, got ${check.describe(value)}`)
  if (value.length > check.MAX_STOP_ENTRIES) throw invalidArgument(`${name} holds at most ${check.MAX_STOP_ENTRIES} strings`)
  // The count bounds what is copied here; that each string is non-empty is the core's rule.
  const out = items(value, (s, i) => {
    if (typeof s !== 'string') throw invalidArgument(`${name}[${i}] must be a string, got ${check.describe(s)}`)
    return s
  })
  return out.length > 0 ? out : null
}

/** `check` of every item of `array`, holes included (Array.prototype.map skips a sparse array's
 *  holes, which would leave holes in what was checked). */
function items<T>(array: unknown[], check: (item: unknown, index: number) => T): T[] {
  const out: T[] = []
  for (let i = 0; i < array.length; i++) out.push(check(array[i], i))
  return out
}

export function turnOptions(name: string, present: Map<string, unknown>): CheckedTurnOptions {
  const checked: CheckedTurnOptions = { core: {}, signal: null }
  for (const [key, value] of present) {
    const arg = `${name}.${key}`
    check.checkingReads(arg, () => turnOption(checked, key, arg, value))
  }
  return checked
}

/** One turn option into `checked`: its type here (what only JavaScript can tell: NaN, a string,
 *  a getter that throws); its range and the rules between options in the core
 *  (TurnOptions::resolve), which beginTurn and CoreEngine.validateTurnOptions apply. */
function turnOption(checked: CheckedTurnOptions, key: string, arg: string, value: unknown): void {
  const core = checked.core
  switch (key) {
    case 'maxGeneratedTokens':
    case 'topK':
    case 'logprobs':
      core[key] = check.integer(arg, value)
      break
    case 'temperature':
    case 'topP':
    case 'minP':
    case 'repetitionPenalty':
    case 'presencePenalty':
    case 'frequencyPenalty':
      core[key] = check.number(arg, value)
      break
    case 'seed':
      core.seed = check.seed(arg, value)
      break
    case 'ignoreEos':
      core.ignoreEos = check.boolean(arg, value)
      break
    case 'stopTokenIds':
      core.stopTokenIds = stopTokenIds(arg, value)
      break
    case 'eosTokenIds':
      if (!Array.isArray(value)) throw invalidArgument(`${arg} must be an array of token ids, got ${check.describe(value)}`)
      if (value.length > check.MAX_STOP_ENTRIES) throw invalidArgument(`${arg} holds at most ${check.MAX_STOP_ENTRIES} ids`)
      core.eosTokenIds = Array.from(check.tokens(arg, value))
      break
    case 'constraint':
      core.constraint = constraint(arg, value)
      break
    case 'stop': {
      const stop = stopStrings(arg, value)
      if (stop !== null) core.stop = stop
      break
    }
    case 'signal':
      checked.signal = check.signal(arg, value)
      break
  }
}
