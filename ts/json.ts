// JSON-like arguments: the caller's values that cross a binding as JSON (chat messages, tools,
// documents, template variables). Each is checked and copied here first, so the binding sees a
// plain tree of bounded size, never the caller's object:
//
// - Only null, booleans, finite numbers, strings, arrays and plain objects (prototype
//   Object.prototype or null). A BigInt, NaN, Infinity, a function, a symbol, `undefined` in an
//   array, a hole of a sparse array, a Date or a Map is INVALID_ARGUMENT naming its path. An object
//   property set to `undefined` is absent, as everywhere in the API.
// - At most MAX_JSON_DEPTH nested arrays and objects per argument: the bindings convert
//   recursively (a value nested 5,000 deep overflowed the WebAssembly stack and trapped).
// - No cycles: a value that contains itself is refused naming where it refers back.
// - At most MAX_JSON_VALUES values in one call's arguments together: a tree with shared branches
//   (`a = [a, a]` thirty times) is small as a graph but expands to 2^30 values as JSON.
// - Everything is read once: a getter or a Proxy trap that throws is INVALID_ARGUMENT naming the
//   path, and one that answers differently on a second read cannot change what was checked, since
//   the copy crosses, not the original.

import { invalidArgument } from './errors'
import { readOnce } from './validate'

/** The most arrays and objects one JSON-like argument may nest. */
export const MAX_JSON_DEPTH = 64
/** The most values (of any kind, containers included) one call's JSON-like arguments may hold. */
export const MAX_JSON_VALUES = 500_000

export type JsonValue = null | boolean | number | string | JsonValue[] | { [key: string]: JsonValue }

/** Copies the JSON-like arguments of one call, counting their values against one budget. */
export class JsonCopier {
  private remainingValues = MAX_JSON_VALUES

  /** A checked, plain copy of `value`, the argument called `name`. Throws INVALID_ARGUMENT. */
  copy(name: string, value: unknown): JsonValue {
    return this.copyAt(new JsonPath(name), value)
  }

  private copyAt(path: JsonPath, value: unknown): JsonValue {
    if (this.remainingValues === 0) {
      throw invalidArgument(`${path} holds too many values: one call's JSON-like arguments hold at most ${MAX_JSON_VALUES} together`)
    }
    this.remainingValues--
    switch (typeof value) {
      case 'string':
      case 'boolean':
        return value
      case 'number':
        if (!Number.isFinite(value)) throw invalidArgument(`${path} is ${value}: JSON numbers are finite`)
        return value
      case 'object':
        return value === null ? null : this.copyContainer(path, value)
      case 'bigint':
        throw invalidArgument(`${path} is a BigInt (${value}n): JSON numbers are doubles; pass a number or a string`)
      default:
        // undefined (in an array, or the whole argument), a function, a symbol
        throw invalidArgument(`${path} is ${typeof value === 'undefined' ? 'undefined' : `a ${typeof value}`}, which JSON cannot hold`)
    }
  }

  private copyContainer(path: JsonPath, container: object): JsonValue {
    const cycleStart = path.indexOfAncestor(container)
    if (cycleStart !== -1) {
      throw invalidArgument(`${path} refers back to ${path.prefix(cycleStart)}, which contains it: a cycle, which JSON cannot hold`)
    }
    if (path.depth >= MAX_JSON_DEPTH) {
      throw invalidArgument(`${path} is nested more than ${MAX_JSON_DEPTH} arrays and objects deep (the most a JSON-like argument may nest)`)
    }
    path.enter(container)
    try {
      return readOnce(path, () => Array.isArray(container)) ? this.copyArray(path, container as unknown[]) : this.copyObject(path, container)
    } finally {
      path.leave()
    }
  }

  private copyArray(path: JsonPath, array: unknown[]): JsonValue[] {
    const length = readOnce(path, () => array.length)
    const out: JsonValue[] = []
    for (let i = 0; i < length; i++) {
      path.push(`[${i}]`)
      if (!readOnce(path, () => i in array)) throw invalidArgument(`${path} is a hole of a sparse array, which JSON cannot hold`)
      out.push(this.copyAt(path, readOnce(path, () => array[i])))
      path.pop()
    }
    return out
  }

  private copyObject(path: JsonPath, object: object): { [key: string]: JsonValue } {
    const prototype = readOnce(path, () => Object.getPrototypeOf(object) as unknown)
    if (prototype !== Object.prototype && prototype !== null) {
      const kind = (prototype as { constructor?: { name?: unknown } } | null)?.constructor?.name
      throw invalidArgument(`${path} is ${typeof kind === 'string' && kind !== '' ? `a ${kind}` : 'an object with a prototype'}, not a plain object or array`)
    }
    const out: { [key: string]: JsonValue } = {}
    for (const key of readOnce(path, () => Object.keys(object))) {
      path.push(JsonPath.keySegment(key))
      const item = readOnce(path, () => (object as Record<string, unknown>)[key])
      // Absent, as JSON.stringify and every option of the API treat it.
      if (item !== undefined) {
        // defineProperty: a "__proto__" key stays an own key instead of setting the prototype.
        Object.defineProperty(out, key, { value: this.copyAt(path, item), enumerable: true, writable: true, configurable: true })
      }
      path.pop()
    }
    return out
  }
}

/** One checked, plain copy of a single JSON-like argument. */
export function copyJson(name: string, value: unknown): JsonValue {
  return new JsonCopier().copy(name, value)
}

/** Where the copy is: `messages[0].content[2]`, and the containers that enclose it. */
class JsonPath {
  private readonly segments: string[]
  /** The enclosing containers, and the segment count at which each was entered. */
  private readonly ancestors: { container: object; at: number }[] = []

  constructor(name: string) {
    this.segments = [name]
  }

  static keySegment(key: string): string {
    return /^[A-Za-z_$][\w$]*$/.test(key) ? `.${key}` : `[${JSON.stringify(key.length > 40 ? `${key.slice(0, 40)}…` : key)}]`
  }

  get depth(): number {
    return this.ancestors.length
  }

  push(segment: string): void {
    this.segments.push(segment)
  }

  pop(): void {
    this.segments.pop()
  }

  enter(container: object): void {
    this.ancestors.push({ container, at: this.segments.length })
  }

  leave(): void {
    this.ancestors.pop()
  }

  /** The segment count of the path to `container` if it encloses the current value; else -1.
   *  Linear in the depth, which is bounded. */
  indexOfAncestor(container: object): number {
    return this.ancestors.find((a) => a.container === container)?.at ?? -1
  }

  prefix(count: number): string {
    return format(this.segments.slice(0, count))
  }

  toString(): string {
    return format(this.segments)
  }
}

/** A path, its middle elided when long (a value nested 64 deep has a path of 64 segments). */
function format(segments: string[]): string {
  if (segments.length <= 12) return segments.join('')
  return `${segments.slice(0, 8).join('')}…${segments.slice(-3).join('')}`
}
