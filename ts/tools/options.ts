// The tool options of engine.chat and engine.createChat (`tools`, `toolChoice`,
// `parallelToolCalls`), checked into a ToolPlan, and the parser of a turn's calls under a plan
// (output.ts parses a turn's result with it).

import { randomBytes } from 'node:crypto'

import { invalidArgument } from '../errors'
import * as v from '../validate'
import { type ToolFamily, type ToolFunction, type ToolMode, type ToolPlan } from './format'
import { ToolCallParser } from './parse'

export const TOOL_KEYS = ['toolChoice', 'parallelToolCalls'] as const

/** OpenAI's rule for a function's name. */
const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/

/**
 * The plan of a chat turn with tools; null when it has none, or `toolChoice` is 'none' (the
 * template still sees the tools). Takes `toolChoice` and `parallelToolCalls` out of `present`.
 * `family` is asked only when there is a plan.
 */
export function takeToolPlan(name: string, present: Map<string, unknown>, tools: unknown[] | undefined, family: () => ToolFamily): ToolPlan | null {
  const choice = present.get('toolChoice')
  const parallel = present.get('parallelToolCalls')
  present.delete('toolChoice')
  present.delete('parallelToolCalls')
  const parallelCalls = parallel === undefined ? true : v.boolean(`${name}.parallelToolCalls`, parallel)
  if (tools === undefined || tools.length === 0) {
    if (choice !== undefined) throw invalidArgument(`${name}.toolChoice needs ${name}.tools`)
    if (parallel !== undefined) throw invalidArgument(`${name}.parallelToolCalls needs ${name}.tools`)
    return null
  }
  const functions = tools.map((tool, i) => checkTool(`${name}.tools[${i}]`, tool))
  const names = new Set<string>()
  for (const f of functions) {
    if (names.has(f.name)) throw invalidArgument(`${name}.tools has two functions named "${f.name}"`)
    names.add(f.name)
  }
  const mode = toolMode(`${name}.toolChoice`, choice, names)
  if (mode === null) return null
  return { family: family(), functions, tools, mode, parallel: parallelCalls }
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}

function checkTool(name: string, tool: unknown): ToolFunction {
  if (!isObject(tool) || tool.type !== 'function' || !isObject(tool.function)) {
    throw invalidArgument(`${name} must be { type: 'function', function: { name, description?, parameters? } }, got ${v.describe(tool)}`)
  }
  const f = tool.function
  if (typeof f.name !== 'string' || !FUNCTION_NAME.test(f.name)) {
    throw invalidArgument(`${name}.function.name must be 1 to 64 letters, digits, underscores or dashes, got ${v.describe(f.name)}`)
  }
  if (f.description !== undefined && typeof f.description !== 'string') {
    throw invalidArgument(`${name}.function.description must be a string, got ${v.describe(f.description)}`)
  }
  if (f.parameters !== undefined && !isObject(f.parameters)) {
    throw invalidArgument(`${name}.function.parameters must be a JSON Schema object, got ${v.describe(f.parameters)}`)
  }
  const parameters = (f.parameters as Record<string, unknown> | undefined) ?? { type: 'object', properties: {} }
  return { name: f.name, description: f.description as string | undefined, parameters }
}

function toolMode(name: string, choice: unknown, names: Set<string>): ToolMode | null {
  if (choice === undefined || choice === 'auto') return { kind: 'auto' }
  if (choice === 'none') return null
  if (choice === 'required') return { kind: 'required' }
  if (isObject(choice) && choice.type === 'function' && isObject(choice.function) && typeof choice.function.name === 'string') {
    const fn = choice.function.name
    if (!names.has(fn)) throw invalidArgument(`${name} names "${fn}", which is not one of the tools`)
    return { kind: 'named', name: fn }
  }
  throw invalidArgument(`${name} must be 'none', 'auto', 'required' or { type: 'function', function: { name } }, got ${v.describe(choice)}`)
}

/** A call id: OpenAI's shape, or Mistral's nine letters and digits (its template checks them). */
export function newCallId(family: ToolFamily): () => string {
  if (family !== 'mistral') return () => `call_${randomBytes(12).toString('hex')}`
  const alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789'
  return () => Array.from(randomBytes(9), (b) => alphabet[b % alphabet.length]).join('')
}

/** The parser for a turn's output under `plan` (a stream's deltas, or the whole text). */
export function toolCallParser(plan: ToolPlan): ToolCallParser {
  return new ToolCallParser(plan.family, newCallId(plan.family))
}
