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
//
// The option objects (engine, simulated model, request, turn) are checked with these in
// options.ts.

import { OrtexError, invalidArgument } from './errors'
import { LIMITS } from './generated/boundary'

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
