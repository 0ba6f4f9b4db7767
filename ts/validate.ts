// Argument validation. Every public call checks its arguments here before anything reaches a
// binding, so a wrong call throws OrtexError('INVALID_ARGUMENT') with a message that names the
// argument, and the bindings only ever see the types they declare.
//
// Rules:
// - Counts and ids are integers in [0, 2^31 - 1] (seeds up to Number.MAX_SAFE_INTEGER): NaN,
//   Infinity, negatives, fractions, strings and bigints are refused.
// - An option set to `undefined` counts as absent (api.md). `null` is a value, and a wrong one.
// - Option objects are checked strictly: an own key this version does not know throws
//   INVALID_ARGUMENT naming the key. Ignoring unknown keys would be friendlier to code written for
//   a later version, but a misspelled option (`maxTokens`, `top_k`) silently ignored is a trap
//   that costs far more; the core refuses unknown JSON fields for the same reason.

import { OrtexError, invalidArgument } from './errors'
import {
  type ConstraintInput,
  type FaultsInput,
  LIMITS,
  type ModelOptionsInput,
  type RequestOptionsInput,
  type SimOptionsInput,
  type TurnOptionsInput,
} from './generated/boundary'
import type { EngineOptions, RequestOptions, SimulatedFaults, SimulatedOptions, TurnOptions } from './types'

export const MAX_INT32 = 2 ** 31 - 1
/** Largest EventBuffer capacity. */
export const MAX_EVENT_CAPACITY = 65_536
/** Most stop strings / stop token sequences per turn (the core's limit). */
export const MAX_STOP_ENTRIES = LIMITS.maxStopEntries
/** Longest session id, in characters (the core's limit; every entry taking an id checks it). */
export const MAX_SESSION_ID_CHARS = LIMITS.maxSessionIdChars

/** INVALID_ARGUMENT for argument `name`: "`name` `what`". */
export function invalidArgumentFor(name: string, what: string): ReturnType<typeof invalidArgument> {
  return invalidArgument(`${name} ${what}`)
}

export function describe(value: unknown): string {
  if (value === null) return 'null'
  if (value === undefined) return 'undefined'
  if (typeof value === 'number') return Number.isNaN(value) ? 'NaN' : String(value)
  if (typeof value === 'string') return value.length > 40 ? `a string of ${value.length} chars` : JSON.stringify(value)
  if (typeof value === 'bigint') return `${value}n`
  // Array.isArray throws for a revoked Proxy; describing a wrong value must not throw.
  if (readOnce('', () => Array.isArray(value), false)) return 'an array'
  if (ArrayBuffer.isView(value)) return `a ${value.constructor.name}`
  if (typeof value === 'function') return 'a function'
  if (typeof value === 'object') return 'an object'
  return typeof value
}

/** An integer in [min, max]. */
export function integer(name: string, value: unknown, min = 0, max = MAX_INT32): number {
  if (typeof value !== 'number' || !Number.isInteger(value) || value < min || value > max) {
    throw invalidArgument(`${name} must be an integer in [${min}, ${max}], got ${describe(value)}`)
  }
  return value
}

/** A seed: an integer in [0, Number.MAX_SAFE_INTEGER]. */
export function seed(name: string, value: unknown): number {
  return integer(name, value, 0, Number.MAX_SAFE_INTEGER)
}

/** A finite number in [min, max], or (min, max] when minExclusive. */
export function finite(name: string, value: unknown, min: number, max: number, minExclusive = false): number {
  const ok = typeof value === 'number' && Number.isFinite(value) && (minExclusive ? value > min : value >= min) && value <= max
  if (!ok) {
    const range = `${minExclusive ? '(' : '['}${min}, ${max === Number.MAX_VALUE ? 'inf)' : `${max}]`}`
    throw invalidArgument(`${name} must be a finite number in ${range}, got ${describe(value)}`)
  }
  return value as number
}

/** A finite number (its range is the caller's, or the core's). */
export function number(name: string, value: unknown): number {
  if (typeof value !== 'number' || !Number.isFinite(value)) throw invalidArgument(`${name} must be a finite number, got ${describe(value)}`)
  return value
}

export function boolean(name: string, value: unknown): boolean {
  if (typeof value !== 'boolean') throw invalidArgument(`${name} must be a boolean, got ${describe(value)}`)
  return value
}

export function string(name: string, value: unknown): string {
  if (typeof value !== 'string') throw invalidArgument(`${name} must be a string, got ${describe(value)}`)
  return value
}

/** Characters (Unicode code points) in `text`: the unit of every length limit on a string. */
export function charCount(text: string): number {
  let count = 0
  for (let i = 0; i < text.length; i++) {
    const unit = text.charCodeAt(i)
    // A high surrogate followed by a low one is one character.
    if (unit >= 0xd800 && unit <= 0xdbff && i + 1 < text.length) {
      const next = text.charCodeAt(i + 1)
      if (next >= 0xdc00 && next <= 0xdfff) i++
    }
    count++
  }
  return count
}

/**
 * A string that crosses into the Rust core (a session id, an operation id, a reason): it must be
 * well-formed Unicode, since Rust strings cannot hold a lone surrogate and the binding would
 * silently replace it (two different ids would become one), and at most `maxChars` characters
 * (the core checks its own limits; a caller may check one earlier).
 */
export function text(name: string, value: unknown, maxChars = Number.POSITIVE_INFINITY): string {
  const s = string(name, value)
  if (!(s as unknown as { isWellFormed(): boolean }).isWellFormed()) {
    throw invalidArgument(`${name} is not well-formed Unicode (it holds a lone surrogate)`)
  }
  if (s.length > maxChars && charCount(s) > maxChars) {
    throw invalidArgument(`${name} is longer than ${maxChars} characters`)
  }
  return s
}

/** A session id: well-formed Unicode of at most MAX_SESSION_ID_CHARS characters. Checked at every
 *  entry that takes one, before any lookup: an id no session can have is a wrong argument, not a
 *  session that is missing. */
export function sessionId(name: string, value: unknown): string {
  return text(name, value, MAX_SESSION_ID_CHARS)
}

export function oneOf<T extends string>(name: string, value: unknown, allowed: readonly T[]): T {
  if (typeof value !== 'string' || !(allowed as readonly string[]).includes(value)) {
    throw invalidArgument(`${name} must be one of ${allowed.map((a) => `'${a}'`).join(', ')}, got ${describe(value)}`)
  }
  return value as T
}

/** One read of the caller's object (its keys, a property): what a getter or a Proxy trap throws
 *  becomes INVALID_ARGUMENT naming what was read (`name` is formatted only then), or `fallback`
 *  where one is given. */
export function readOnce<T>(name: string | { toString(): string }, read: () => T, fallback?: T): T {
  try {
    return read()
  } catch (error) {
    if (fallback !== undefined) return fallback
    throw invalidArgument(`${String(name)} cannot be read: ${thrownMessage(error)}`)
  }
}

/** Runs a check that reads the caller's value deeply (an array's items, a signal's fields): what
 *  a getter or a Proxy trap throws becomes INVALID_ARGUMENT, while the check's own refusals (and
 *  an OrtexError the caller's getter threw) pass as they are. */
export function checkingReads<T>(name: string, check: () => T): T {
  try {
    return check()
  } catch (error) {
    if (error instanceof OrtexError) throw error
    throw invalidArgument(`${name} cannot be read: ${thrownMessage(error)}`)
  }
}

/** What a caller's getter threw, as text; never throws itself (the thrown value may be hostile). */
function thrownMessage(error: unknown): string {
  try {
    return error instanceof Error ? String(error.message) : String(error)
  } catch {
    return 'it threw a value that cannot be shown'
  }
}

/**
 * Checks an options object and returns its own keys whose value is not undefined. `undefined`
 * for the whole object means no options. Throws on a non-object and on an unknown key.
 */
export function options(name: string, value: unknown, known: readonly string[]): Map<string, unknown> {
  const present = new Map<string, unknown>()
  if (value === undefined) return present
  if (typeof value !== 'object' || value === null || readOnce(name, () => Array.isArray(value)) || ArrayBuffer.isView(value)) {
    throw invalidArgument(`${name} must be an object, got ${describe(value)}`)
  }
  for (const key of readOnce(name, () => Object.keys(value))) {
    // Each value is read once, here: what the caller's getter answers now is what is checked.
    const v = readOnce(`${name}.${key}`, () => (value as Record<string, unknown>)[key])
    if (v === undefined) continue
    if (!known.includes(key)) {
      throw invalidArgument(`${name} has an unknown option "${key}" (known: ${known.join(', ')})`)
    }
    present.set(key, v)
  }
  return present
}

/**
 * A token sequence: an array of integers, a typed array, or another array-like of numbers (not a
 * string). Returns an Int32Array (the Int32Array itself when given one: the bindings copy it).
 * Range against the vocabulary is the core's check.
 */
export function tokens(name: string, value: unknown): Int32Array {
  return checkingReads(name, () => tokensOf(name, value))
}

function tokensOf(name: string, value: unknown): Int32Array {
  if (value instanceof Int32Array) {
    for (let i = 0; i < value.length; i++) {
      if (value[i]! < 0) throw invalidArgument(`${name}[${i}] must be a token id (an integer in [0, ${MAX_INT32}]), got ${value[i]}`)
    }
    return value
  }
  if (typeof value !== 'object' || value === null || typeof value === 'function') {
    throw invalidArgument(`${name} must be an array of token ids, got ${describe(value)}`)
  }
  if (value instanceof BigInt64Array || value instanceof BigUint64Array) {
    throw invalidArgument(`${name} must hold numbers, got a ${value.constructor.name}`)
  }
  if (ArrayBuffer.isView(value) && !('length' in value)) {
    throw invalidArgument(`${name} must be an array of token ids, got a DataView`)
  }
  const length = (value as { length?: unknown }).length
  if (typeof length !== 'number' || !Number.isInteger(length) || length < 0 || length > MAX_INT32) {
    throw invalidArgument(`${name} must be an array of token ids, got ${describe(value)}`)
  }
  const out = new Int32Array(length)
  const items = value as ArrayLike<unknown>
  for (let i = 0; i < length; i++) {
    const t = items[i]
    if (typeof t !== 'number' || !Number.isInteger(t) || t < 0 || t > MAX_INT32) {
      throw invalidArgument(`${name}[${i}] must be a token id (an integer in [0, ${MAX_INT32}]), got ${describe(t)}`)
    }
    out[i] = t
  }
  return out
}

/** Input of prefill / beginTurn / generate: text or token ids. Text is returned as is. */
export function input(name: string, value: unknown): string | Int32Array {
  if (typeof value === 'string') return value
  return tokens(name, value)
}

export function capacity(name: string, value: unknown): number {
  return integer(name, value, 0, MAX_EVENT_CAPACITY)
}

/** An AbortSignal (or anything shaped like one: `aborted` plus add/removeEventListener). */
export function signal(name: string, value: unknown): AbortSignal {
  return checkingReads(name, () => signalOf(name, value))
}

function signalOf(name: string, value: unknown): AbortSignal {
  const s = value as Partial<AbortSignal> | null
  if (
    typeof s !== 'object' ||
    s === null ||
    typeof s.aborted !== 'boolean' ||
    typeof s.addEventListener !== 'function' ||
    typeof s.removeEventListener !== 'function'
  ) {
    throw invalidArgument(`${name} must be an AbortSignal, got ${describe(value)}`)
  }
  return s as AbortSignal
}

// -----------------------------------------------------------------------------------------------
// Option objects. Each returns the input the core takes (its type generated from the Rust side's
// mirror, ts/generated/boundary.ts; the core refuses unknown fields), built only from validated
// values. Each key list is checked against both the public option type and the generated input
// type, so a key added on one side only fails the build.
// -----------------------------------------------------------------------------------------------

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
  'constraint',
] as const

export const TURN_KEYS = [...CORE_TURN_KEYS, 'stop', 'signal'] as const

// The key lists against the public types and the generated inputs (compile-time only).
true satisfies ExactKeys<(typeof ENGINE_KEYS)[number], EngineOptions>
true satisfies ExactKeys<(typeof ENGINE_KEYS)[number], ModelOptionsInput>
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
        out.batching = oneOf(arg, value, ['dynamic', 'static'] as const)
        break
      case 'blockSize':
      case 'numBlocks':
      case 'maxBatchSize':
      case 'maxScheduledTokens':
      case 'prefillChunkSize':
      case 'maxRequests':
        out[key] = integer(arg, value, 1)
        break
      case 'maxPrefillWaitSteps':
        out[key] = integer(arg, value, 0)
        break
      case 'kvCacheBytes':
        out.kvCacheBytes = integer(arg, value, 1, Number.MAX_SAFE_INTEGER)
        break
      case 'prefixCaching':
        out.prefixCaching = boolean(arg, value)
        break
      case 'executionProvider': {
        const provider = oneOf(arg, value, ['cpu', 'cuda'])
        if (!forSimulated) out.executionProvider = provider
        break
      }
      case 'intraOpThreads': {
        const threads = integer(arg, value, 0, 1024)
        if (!forSimulated) out.intraOpThreads = threads
        break
      }
      case 'intraOpSpinning': {
        const spinning = boolean(arg, value)
        if (!forSimulated) out.intraOpSpinning = spinning
        break
      }
    }
  }
}

export function engineOptions(name: string, value: unknown): ModelOptionsInput {
  const out: ModelOptionsInput = {}
  engineFields(name, options(name, value, ENGINE_KEYS), out, false)
  return out
}

function stepList(name: string, value: unknown): number[] {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of step numbers, got ${describe(value)}`)
  if (value.length > 1_000_000) throw invalidArgument(`${name} holds at most 1000000 steps`)
  return items(value, (v, i) => seed(`${name}[${i}]`, v))
}

function faults(name: string, value: unknown): FaultsInput {
  const out: FaultsInput = {}
  for (const [key, v] of options(name, value, FAULT_KEYS)) {
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
        out[key] = finite(arg, v, 0, 1)
        break
      case 'seed':
        out.seed = seed(arg, v)
        break
    }
  }
  return out
}

export function simulatedOptions(name: string, value: unknown): SimOptionsInput {
  const present = options(name, value, SIM_KEYS)
  const out: SimOptionsInput = {}
  const engine = new Map<string, unknown>()
  for (const [key, v] of present) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'seed':
      case 'stepCostUs':
      case 'tokenCostUs':
        out[key] = seed(arg, v)
        break
      case 'vocabSize':
        out.vocabSize = integer(arg, v, 2)
        break
      case 'eosTokenId':
        out.eosTokenId = integer(arg, v, 0)
        break
      case 'maxLength':
        out.maxLength = integer(arg, v, 1)
        break
      case 'eosProbability':
        out.eosProbability = finite(arg, v, 0, 1)
        break
      case 'faults':
        out.faults = checkingReads(arg, () => faults(arg, v))
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
  return value === undefined ? {} : { maxSessionTokens: integer(`${name}.maxSessionTokens`, value) }
}

export interface CheckedTurnOptions {
  /** TurnOptions as the core takes them (without stop / signal). */
  core: TurnOptionsInput
  stop: string[] | null
  signal: AbortSignal | null
}

function stopTokenIds(name: string, value: unknown): number[][] {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of token id arrays, got ${describe(value)}`)
  if (value.length > MAX_STOP_ENTRIES) throw invalidArgument(`${name} holds at most ${MAX_STOP_ENTRIES} sequences`)
  return items(value, (sequence, i) => Array.from(tokens(`${name}[${i}]`, sequence)))
}

/** `constraint`'s shape, with a JSON Schema copied through JSON (a snapshot, and plain JSON for
 *  the core, which compiles it and says what is wrong inside it). */
function constraint(name: string, value: unknown): ConstraintInput {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw invalidArgument(`${name} must be an object with a type, got ${describe(value)}`)
  }
  const given = value as Record<string, unknown>
  const fields = (type: string, field: string | null): void => {
    const extra = Object.keys(given).find((key) => key !== 'type' && key !== field)
    if (extra !== undefined) throw invalidArgument(`${name}.${extra} is not an option of a '${type}' constraint`)
  }
  const text = (field: string): string => {
    const v = given[field]
    if (typeof v !== 'string') throw invalidArgument(`${name}.${field} must be a string, got ${describe(v)}`)
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
        throw invalidArgument(`${name}.schema must be a JSON Schema (an object or a boolean), got ${describe(schema)}`)
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
        `${name}.type must be 'json', 'json_schema', 'regex' or 'lark', got ${describe(given.type)}`,
      )
  }
}

function stopStrings(name: string, value: unknown): string[] | null {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of strings, got ${describe(value)}`)
  if (value.length > MAX_STOP_ENTRIES) throw invalidArgument(`${name} holds at most ${MAX_STOP_ENTRIES} strings`)
  const out = items(value, (s, i) => {
    if (typeof s !== 'string' || s.length === 0) {
      throw invalidArgument(`${name}[${i}] must be a non-empty string, got ${describe(s)}`)
    }
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
  const checked: CheckedTurnOptions = { core: {}, stop: null, signal: null }
  for (const [key, value] of present) {
    const arg = `${name}.${key}`
    checkingReads(arg, () => turnOption(checked, key, arg, value))
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
      core[key] = integer(arg, value)
      break
    case 'temperature':
    case 'topP':
    case 'minP':
    case 'repetitionPenalty':
    case 'presencePenalty':
    case 'frequencyPenalty':
      core[key] = number(arg, value)
      break
    case 'seed':
      core.seed = seed(arg, value)
      break
    case 'ignoreEos':
      core.ignoreEos = boolean(arg, value)
      break
    case 'stopTokenIds':
      core.stopTokenIds = stopTokenIds(arg, value)
      break
    case 'eosTokenIds':
      if (!Array.isArray(value)) throw invalidArgument(`${arg} must be an array of token ids, got ${describe(value)}`)
      if (value.length > MAX_STOP_ENTRIES) throw invalidArgument(`${arg} holds at most ${MAX_STOP_ENTRIES} ids`)
      core.eosTokenIds = Array.from(tokens(arg, value))
      break
    case 'constraint':
      core.constraint = constraint(arg, value)
      break
    case 'stop':
      checked.stop = stopStrings(arg, value)
      break
    case 'signal':
      checked.signal = signal(arg, value)
      break
  }
}
