// Tool calling per chat-template family, as llama.cpp's server does it (common/chat.cpp): which
// format a model's template speaks, how tools and earlier calls reach its prompt, and the
// constraint that makes `required` and named calls (and, from the moment a call starts, `auto`
// ones) always name a declared function with arguments that validate against its parameters.
//
//   family    how the template is told the tools          what the model writes
//   hermes    the template's own `tools` (Qwen, Hermes)    <tool_call>\n{"name", "arguments"}\n</tool_call>
//   llama3    the template's own `tools` (Llama 3.x)       {"name", "parameters"}
//   mistral   the template's own `tools` ([AVAILABLE_TOOLS]) [TOOL_CALLS][{"name", "arguments"}, ...]
//   generic   a system message this module writes          {"tool_calls": [...]} or {"response": "..."}
//
// The family is told by rendering a probe conversation through the template (what it writes for
// a tool, not what its source looks like), once per engine.

import type { ChatMessage, Constraint, ToolCall } from '../types'

export type ToolFamily = 'hermes' | 'llama3' | 'mistral' | 'generic'

/** A function tool, checked (options.ts). */
export interface ToolFunction {
  name: string
  description?: string
  parameters: Record<string, unknown>
}

export type ToolMode = { kind: 'auto' } | { kind: 'required' } | { kind: 'named'; name: string }

/** How one chat turn calls tools. */
export interface ToolPlan {
  family: ToolFamily
  functions: ToolFunction[]
  /** The tools as the caller gave them (OpenAI's shape), for templates that render them. */
  tools: unknown[]
  mode: ToolMode
  parallel: boolean
}

const PROBE_FUNCTION = 'ortex_probe_function'
const PROBE_TOOLS = [
  { type: 'function', function: { name: PROBE_FUNCTION, description: 'A probe.', parameters: { type: 'object', properties: {} } } },
]
const PROBE_MESSAGES: ChatMessage[] = [{ role: 'user', content: 'ortex probe question' }]

/** The family of a template, told from what it renders for a conversation with one tool. A
 *  template that leaves the tool out (SmolLM2's), raises, or writes an unknown format is generic. */
export function detectFamily(render: (messages: ChatMessage[], tools: unknown[]) => string): ToolFamily {
  let text: string
  try {
    text = render(PROBE_MESSAGES, PROBE_TOOLS)
  } catch {
    return 'generic'
  }
  if (!text.includes(PROBE_FUNCTION)) return 'generic'
  if (text.includes('<tool_call>')) return 'hermes'
  if (text.includes('[AVAILABLE_TOOLS]') || text.includes('[TOOL_CALLS]')) return 'mistral'
  if (text.includes('<|start_header_id|>') && (text.includes('"parameters"') || text.includes('ipython'))) return 'llama3'
  return 'generic'
}

/** The tools the template renders: its own for the families that have a format, none for generic
 *  (their description is a system message: promptMessages). */
export function templateTools(plan: ToolPlan): unknown[] | undefined {
  return plan.family === 'generic' ? undefined : plan.tools
}

/** The conversation as the family's template takes it. Earlier calls' arguments become objects
 *  (templates print them with `tojson`); for generic, calls and results become JSON text and the
 *  tools' description leads the system message. */
export function promptMessages(plan: ToolPlan, messages: ChatMessage[]): ChatMessage[] {
  if (plan.family !== 'generic') return messages.map(withObjectArguments)
  const out = messages.map(genericMessage)
  const description = genericDescription(plan)
  if (out[0]?.role === 'system' && typeof out[0].content === 'string') {
    out[0] = { ...out[0], content: `${out[0].content}\n\n${description}` }
  } else {
    out.unshift({ role: 'system', content: description })
  }
  return out
}

function withObjectArguments(message: ChatMessage): ChatMessage {
  const calls = message.tool_calls
  if (!Array.isArray(calls)) return message
  return { ...message, tool_calls: calls.map((call: ToolCall) => ({ ...call, function: { ...call.function, arguments: argumentsObject(call.function?.arguments) } })) }
}

function argumentsObject(value: unknown): unknown {
  if (typeof value !== 'string') return value
  try {
    return JSON.parse(value) as unknown
  } catch {
    return value
  }
}

/** generic: an assistant's calls as the JSON it answers with; a tool's result as a user message
 *  (templates without tool support know no `tool` role), as llama.cpp's polyfill writes them. */
function genericMessage(message: ChatMessage): ChatMessage {
  if (message.role === 'assistant' && Array.isArray(message.tool_calls) && message.tool_calls.length > 0) {
    const calls = (message.tool_calls as ToolCall[]).map((call) => ({ name: call.function.name, arguments: argumentsObject(call.function.arguments), id: call.id }))
    return { role: 'assistant', content: JSON.stringify({ tool_calls: calls }) }
  }
  if (message.role === 'tool') {
    const response = { tool_call_id: message.tool_call_id, content: message.content }
    return { role: 'user', content: JSON.stringify({ tool_response: response }) }
  }
  return message
}

function genericDescription(plan: ToolPlan): string {
  const tools = JSON.stringify(plan.tools, null, 2)
  const answer =
    plan.mode.kind === 'auto'
      ? 'Respond in JSON format, either with `tool_calls` (a request to call tools) or with `response` (a reply to the user\'s request).'
      : 'Respond in JSON format with `tool_calls` (a request to call tools).'
  return (
    `You can call any of the following tools to satisfy the user's requests:\n${tools}\n\n${answer}\n` +
    'Example tool call syntax:\n{"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]}'
  )
}

/** One call of `f` as JSON: its name and arguments that validate against its parameters. */
function callSchema(f: ToolFunction, argumentsKey: string): Record<string, unknown> {
  return {
    type: 'object',
    properties: { name: { type: 'string', const: f.name }, [argumentsKey]: f.parameters },
    required: ['name', argumentsKey],
    additionalProperties: false,
  }
}

function anyCall(functions: ToolFunction[], argumentsKey: string): Record<string, unknown> {
  const calls = functions.map((f) => callSchema(f, argumentsKey))
  return calls.length === 1 ? calls[0]! : { anyOf: calls }
}

/** `schema` written as templates print JSON (`tojson`, Python's json.dumps): no whitespace but
 *  `", "` and `": "` (llguidance's x-guidance options). A model under a schema that allows any
 *  whitespace can fill its turn with it (a small or random one does); this way the calls are
 *  short, and read back through the template as the model wrote them. */
function compact(schema: Record<string, unknown>): Record<string, unknown> {
  return { 'x-guidance': { whitespace_flexible: false, item_separator: ', ', key_separator: ': ' }, ...schema }
}

/** A lark rule's inline JSON Schema. */
function inlineJson(schema: Record<string, unknown>): string {
  return `%json ${JSON.stringify(compact(schema))}`
}

/** The functions a turn may call: the named one, or all. */
function callable(plan: ToolPlan): ToolFunction[] {
  const mode = plan.mode
  return mode.kind === 'named' ? plan.functions.filter((f) => f.name === mode.name) : plan.functions
}

/**
 * The constraint of a turn with tools. `response`: the caller's own constraint on a reply that
 * is not a call (generic only: the `response` value's schema). `tokenId`: the id of a text that
 * is one token of the vocabulary (Mistral's `[TOOL_CALLS]`), null when it is not.
 */
export function toolConstraint(plan: ToolPlan, response: Constraint | undefined, tokenId: (text: string) => number | null): Constraint {
  const functions = callable(plan)
  switch (plan.family) {
    case 'generic':
      return { type: 'json_schema', schema: compact(genericSchema(plan, functions, response)) }
    case 'hermes':
      return { type: 'lark', grammar: hermesGrammar(plan, functions) }
    case 'llama3':
      return plan.mode.kind === 'auto'
        ? { type: 'lark', grammar: `start: TEXT | call\nTEXT: /[^{](.|\\n)*/\ncall: ${inlineJson(anyCall(functions, 'parameters'))}\n` }
        : { type: 'json_schema', schema: compact(anyCall(functions, 'parameters')) }
    case 'mistral':
      return { type: 'lark', grammar: mistralGrammar(plan, functions, tokenId('[TOOL_CALLS]')) }
  }
}

function genericSchema(plan: ToolPlan, functions: ToolFunction[], response: Constraint | undefined): Record<string, unknown> {
  const calls: Record<string, unknown> = { type: 'array', items: anyCall(functions, 'arguments'), minItems: 1 }
  if (!plan.parallel) calls.maxItems = 1
  const callsObject = { type: 'object', properties: { tool_calls: calls }, required: ['tool_calls'], additionalProperties: false }
  if (plan.mode.kind !== 'auto') return callsObject
  const reply = response?.type === 'json_schema' ? response.schema : response?.type === 'json' ? { type: 'object' } : { type: 'string' }
  const responseObject = { type: 'object', properties: { response: reply }, required: ['response'], additionalProperties: false }
  return { anyOf: [callsObject, responseObject] }
}

/** hermes: calls in tags. `auto` lets the model write text: either to its end (a lexeme that stops
 *  only at EOS) or up to its first `<tool_call>` (one that stops there), from where the call must
 *  be one of the functions; llguidance's Earley parser follows both until the text tells. */
function hermesGrammar(plan: ToolPlan, functions: ToolFunction[]): string {
  const more = plan.parallel ? ' ("\\n" call)*' : ''
  const rules = `call: "<tool_call>" body\nbody: "\\n" fn "\\n</tool_call>"\nfn: ${inlineJson(anyCall(functions, 'arguments'))}\n`
  if (plan.mode.kind !== 'auto') return `start: call${more}\n${rules}`
  return `start: reply | before_call body${more}\nreply[stop=""]: /(.|\\n)*/\nbefore_call[stop="<tool_call>"]: /(.|\\n)*/\n${rules}`
}

function mistralGrammar(plan: ToolPlan, functions: ToolFunction[], callsToken: number | null): string {
  const opener = callsToken === null ? '"[TOOL_CALLS]"' : `<[${callsToken}]>`
  const list: Record<string, unknown> = { type: 'array', items: anyCall(functions, 'arguments'), minItems: 1 }
  if (!plan.parallel) list.maxItems = 1
  const calls = `calls: ${opener} ${inlineJson(list)}\n`
  if (plan.mode.kind !== 'auto') return `start: calls\n${calls}`
  return `start: TEXT | calls\nTEXT: /[^\\[](.|\\n)*/\n${calls}`
}
