// OrtexError: the one error class of the public API, shared by the `ortex` and `ortex/wasm` entry
// points. Misuse throws it with a stable `code`; runtime failures of the engine are events, not
// throws (see events.ts).

import { ERROR_CODES, RETRYABLE_ERROR_CODES } from './generated/boundary'

/** Every stable error code: the Rust core's `ErrorCode::as_str` strings, generated from it. */
export { ERROR_CODES }

export type ErrorCode = (typeof ERROR_CODES)[number]

const KNOWN_CODES: ReadonlySet<string> = new Set(ERROR_CODES)
const RETRYABLE_CODES: ReadonlySet<string> = new Set(RETRYABLE_ERROR_CODES)

/** Retryable errors describe a temporary condition: the same call may succeed later. */
function isRetryable(code: ErrorCode): boolean {
  return RETRYABLE_CODES.has(code)
}

// A brand shared through the global symbol registry. The package is importable both as ESM and
// as CommonJS, and Node may load both copies in one process (the dual-package hazard); the brand
// makes `err instanceof OrtexError` true for an error built by either copy.
const BRAND: unique symbol = Symbol.for('ortex.OrtexError') as never

export class OrtexError extends Error {
  readonly code: ErrorCode
  readonly retryable: boolean

  constructor(code: ErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options)
    this.name = 'OrtexError'
    this.code = code
    this.retryable = isRetryable(code)
    Object.defineProperty(this, BRAND, { value: true, enumerable: false })
  }

  static override [Symbol.hasInstance]<T>(this: abstract new (...args: never[]) => T, value: unknown): value is T {
    // Typed as a predicate on the class it is called on, so `err instanceof OrtexError` (and of a
    // subclass) narrows in TypeScript. Subclasses keep the ordinary prototype-chain check.
    if ((this as unknown) !== OrtexError) return Function.prototype[Symbol.hasInstance].call(this, value)
    return typeof value === 'object' && value !== null && (value as { [BRAND]?: unknown })[BRAND] === true
  }
}

export function isErrorCode(value: unknown): value is ErrorCode {
  return typeof value === 'string' && KNOWN_CODES.has(value)
}

/**
 * Converts whatever a binding threw into an OrtexError. The bindings throw an Error whose `code`
 * is one of ERROR_CODES; anything else (a WebAssembly trap, a Node-API conversion failure) means
 * the engine itself went wrong and becomes `fallback` (ENGINE_UNHEALTHY unless said otherwise),
 * with the original error as `cause`.
 */
export function toOrtexError(error: unknown, fallback: ErrorCode = 'ENGINE_UNHEALTHY'): OrtexError {
  if (error instanceof OrtexError) return error
  const code = typeof error === 'object' && error !== null ? (error as { code?: unknown }).code : undefined
  const message = error instanceof Error ? error.message : String(error)
  if (isErrorCode(code)) return new OrtexError(code, stripCodePrefix(message, code))
  return new OrtexError(fallback, `internal engine error: ${message}`, { cause: error })
}

/** The core formats errors as "CODE: message"; the code already travels in `code`. */
function stripCodePrefix(message: string, code: string): string {
  return message.startsWith(`${code}: `) ? message.slice(code.length + 2) : message
}

export function invalidArgument(message: string): OrtexError {
  return new OrtexError('INVALID_ARGUMENT', message)
}
