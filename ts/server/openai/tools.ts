// The chat fields of tool calling, structured output and the template: `tools`, `tool_choice`,
// `parallel_tool_calls`, `response_format`, vLLM's `structured_outputs` and `chat_template_kwargs`,
// and the messages that carry calls and reasoning (an assistant's `tool_calls` and
// `reasoning_content`, a `tool` message's result), checked as OpenAI checks them and turned into
// the engine's chat options (ToolOptions, TurnOptions.constraint, ChatTemplateOptions.variables).

import type { ChatMessage, Constraint, FunctionTool, ToolChoice } from '../../types'
import { invalidParam } from './errors'

type Body = Record<string, unknown>

export interface ChatTools {
  tools: FunctionTool[]
  toolChoice: ToolChoice | undefined
  parallelToolCalls: boolean | undefined
}

/** OpenAI's limit on tools per request. */
const MAX_TOOLS = 128
const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/

function isObject(value: unknown): value is Body {
  return typeof value === 'object' && value !== null && !Array.isArray(value)
}

function present(body: Body, key: string): boolean {
  return body[key] !== undefined && body[key] !== null
}

/** `tools`, `tool_choice` and `parallel_tool_calls`; null when no tools are given. */
export function chatTools(body: Body): ChatTools | null {
  if (!present(body, 'tools')) {
    if (present(body, 'tool_choice') && body.tool_choice !== 'none') {
      throw invalidParam('tool_choice', "tool_choice is only allowed when 'tools' are specified")
    }
    return null
  }
  const list = body.tools
  if (!Array.isArray(list) || list.length === 0) throw invalidParam('tools', 'tools must be a non-empty array of tools', 'invalid_type')
  if (list.length > MAX_TOOLS) throw invalidParam('tools', `tools holds at most ${MAX_TOOLS} tools, got ${list.length}`, 'array_above_max_length')
  const tools = list.map((tool, i) => functionTool(`tools[${i}]`, tool))
  const names = new Set(tools.map((t) => t.function.name))
  if (names.size !== tools.length) throw invalidParam('tools', 'tools holds two functions of the same name', 'invalid_value')
  let parallelToolCalls: boolean | undefined
  if (present(body, 'parallel_tool_calls')) {
    if (typeof body.parallel_tool_calls !== 'boolean') throw invalidParam('parallel_tool_calls', 'parallel_tool_calls must be a boolean', 'invalid_type')
    parallelToolCalls = body.parallel_tool_calls
  }
  return { tools, toolChoice: toolChoice(body.tool_choice, names), parallelToolCalls }
}

function functionTool(param: string, tool: unknown): FunctionTool {
  if (!isObject(tool) || tool.type !== 'function' || !isObject(tool.function)) {
    throw invalidParam(param, `${param} must be { "type": "function", "function": { "name", "description", "parameters" } }`, 'invalid_type')
  }
  const f = tool.function
  for (const key of Object.keys(f)) {
    if (!['name', 'description', 'parameters', 'strict'].includes(key)) throw invalidParam(`${param}.function.${key}`, `Unrecognized function field: ${key}`, 'unknown_parameter')
  }
  if (typeof f.name !== 'string' || !FUNCTION_NAME.test(f.name)) {
    throw invalidParam(`${param}.function.name`, `${param}.function.name must be 1 to 64 letters, digits, underscores or dashes`, 'invalid_value')
  }
  if (present(f, 'description') && typeof f.description !== 'string') {
    throw invalidParam(`${param}.function.description`, `${param}.function.description must be a string`, 'invalid_type')
  }
  if (present(f, 'parameters') && !isObject(f.parameters)) {
    throw invalidParam(`${param}.function.parameters`, `${param}.function.parameters must be a JSON Schema object`, 'invalid_type')
  }
  if (present(f, 'strict') && typeof f.strict !== 'boolean') throw invalidParam(`${param}.function.strict`, `${param}.function.strict must be a boolean`, 'invalid_type')
  const fn: FunctionTool['function'] = { name: f.name }
  if (typeof f.description === 'string') fn.description = f.description
  if (isObject(f.parameters)) fn.parameters = f.parameters
  return { type: 'function', function: fn }
}

function toolChoice(value: unknown, names: Set<string>): ToolChoice | undefined {
  if (value === undefined || value === null) return undefined
  if (value === 'none' || value === 'auto' || value === 'required') return value
  if (isObject(value) && value.type === 'function' && isObject(value.function) && typeof value.function.name === 'string') {
    const name = value.function.name
    if (!names.has(name)) throw invalidParam('tool_choice', `tool_choice names the function "${name}", which is not in tools`, 'invalid_value')
    return { type: 'function', function: { name } }
  }
  throw invalidParam('tool_choice', `tool_choice must be "none", "auto", "required" or { "type": "function", "function": { "name" } }`, 'invalid_value')
}

/** `response_format` as the turn's constraint; undefined for `text` or none. */
export function responseFormat(body: Body): Constraint | undefined {
  if (!present(body, 'response_format')) return undefined
  const format = body.response_format
  if (!isObject(format)) throw invalidParam('response_format', 'response_format must be an object', 'invalid_type')
  switch (format.type) {
    case 'text':
      return undefined
    case 'json_object':
      return { type: 'json' }
    case 'json_schema': {
      const spec = format.json_schema
      if (!isObject(spec)) throw invalidParam('response_format.json_schema', 'response_format.json_schema must be an object', 'missing_required_parameter')
      if (typeof spec.name !== 'string' || !FUNCTION_NAME.test(spec.name)) {
        throw invalidParam('response_format.json_schema.name', 'response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes', 'invalid_value')
      }
      if (present(spec, 'strict') && typeof spec.strict !== 'boolean') throw invalidParam('response_format.json_schema.strict', 'strict must be a boolean', 'invalid_type')
      if (!present(spec, 'schema')) return { type: 'json' }
      // A boolean schema is JSON Schema too (true: anything).
      if (!isObject(spec.schema) && typeof spec.schema !== 'boolean') {
        throw invalidParam('response_format.json_schema.schema', 'response_format.json_schema.schema must be a JSON Schema object', 'invalid_type')
      }
      return { type: 'json_schema', schema: spec.schema }
    }
  }
  throw invalidParam('response_format.type', `response_format.type must be "text", "json_object" or "json_schema", got ${JSON.stringify(format.type)}`, 'invalid_value')
}

/** vLLM's `structured_outputs` (`regex`, or `grammar`: a Lark grammar in llguidance's dialect) as
 *  the turn's constraint; undefined when absent. One kind per request, and not beside
 *  `response_format`. */
export function structuredOutputs(body: Body): Constraint | undefined {
  if (!present(body, 'structured_outputs')) return undefined
  const spec = body.structured_outputs
  if (!isObject(spec)) throw invalidParam('structured_outputs', 'structured_outputs must be an object', 'invalid_type')
  const kinds = Object.keys(spec).filter((key) => present(spec, key))
  for (const key of kinds) {
    if (key !== 'regex' && key !== 'grammar') {
      throw invalidParam(`structured_outputs.${key}`, `structured_outputs.${key} is not supported (regex and grammar are; use response_format for JSON)`, 'unsupported_parameter')
    }
  }
  if (kinds.length !== 1) throw invalidParam('structured_outputs', 'structured_outputs must hold exactly one of regex or grammar', 'invalid_value')
  if (present(body, 'response_format')) throw invalidParam('structured_outputs', 'structured_outputs cannot be combined with response_format', 'invalid_value')
  const key = kinds[0]!
  const value = spec[key]
  if (typeof value !== 'string' || value.length === 0) throw invalidParam(`structured_outputs.${key}`, `structured_outputs.${key} must be a non-empty string`, 'invalid_type')
  return key === 'regex' ? { type: 'regex', pattern: value } : { type: 'lark', grammar: value }
}

/** `chat_template_kwargs` (vLLM's and llama.cpp's): more variables for the chat template, such as
 *  `enable_thinking`; undefined when absent. */
export function chatTemplateKwargs(body: Body): Record<string, unknown> | undefined {
  if (!present(body, 'chat_template_kwargs')) return undefined
  const kwargs = body.chat_template_kwargs
  if (!isObject(kwargs)) throw invalidParam('chat_template_kwargs', 'chat_template_kwargs must be an object', 'invalid_type')
  return kwargs
}

/** The fields of an assistant message with calls or reasoning, or of a tool message, checked. */
export function toolMessageFields(param: string, m: Body, out: ChatMessage): void {
  if (m.role === 'assistant' && present(m, 'tool_calls')) {
    const calls = m.tool_calls
    if (!Array.isArray(calls)) throw invalidParam(`${param}.tool_calls`, `${param}.tool_calls must be an array`, 'invalid_type')
    out.tool_calls = calls.map((call, i) => toolCall(`${param}.tool_calls[${i}]`, call))
  }
  // An earlier reply's thinking, as this server (and vLLM) returned it: templates that print it
  // (Qwen 3's, for the turns since the last user message) read `reasoning_content`.
  if (m.role === 'assistant' && present(m, 'reasoning_content')) {
    if (typeof m.reasoning_content !== 'string') throw invalidParam(`${param}.reasoning_content`, `${param}.reasoning_content must be a string`, 'invalid_type')
    out.reasoning_content = m.reasoning_content
  }
  if (m.role === 'tool') {
    if (typeof m.tool_call_id !== 'string') throw invalidParam(`${param}.tool_call_id`, `${param}.tool_call_id must be a string`, 'missing_required_parameter')
    out.tool_call_id = m.tool_call_id
  }
}

function toolCall(param: string, call: unknown): object {
  const c = call as Body
  if (!isObject(call) || typeof c.id !== 'string' || c.type !== 'function' || !isObject(c.function)) {
    throw invalidParam(param, `${param} must be { "id", "type": "function", "function": { "name", "arguments" } }`, 'invalid_type')
  }
  const f = c.function as Body
  if (typeof f.name !== 'string' || typeof f.arguments !== 'string') {
    throw invalidParam(`${param}.function`, `${param}.function must have a string name and string arguments`, 'invalid_type')
  }
  return { id: c.id, type: 'function', function: { name: f.name, arguments: f.arguments } }
}

/** The keys each role's message may have. */
export function messageKeys(role: unknown): readonly string[] {
  if (role === 'assistant') return ['role', 'content', 'name', 'tool_calls', 'refusal', 'reasoning_content']
  if (role === 'tool') return ['role', 'content', 'tool_call_id']
  return ['role', 'content', 'name']
}
