// Tool calling per chat-template family, as llama.cpp's server does it (common/chat.cpp): which
// format a model's template speaks, how tools and earlier calls reach its prompt, and the
// constraint that makes `required` and named calls (and, from the moment a call starts, `auto`
// ones) always name a declared function with arguments that validate against its parameters.
//
//   family    how the template is told the tools          what the model writes
//   hermes    the template's own `tools` (Qwen, Hermes)    <tool_call>\n{"name", "arguments"}\n</tool_call>
//   llama3    the template's own `tools` (Llama 3.x)       {"name", "parameters"}
//   mistral   the template's own `tools` ([AVAILABLE_TOOLS]) [TOOL_CALLS][{"name", "arguments"}, ...]
//   phi4      the system message's `tools` (Phi-4-mini)     <|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|>
//   generic   a system message this module writes          {"tool_calls": [...]} or {"response": "..."}
//
// The family is told by rendering a probe conversation through the template (what it writes for
// a tool, not what its source looks like), once per engine. A template with a reasoning format
// (reasoning.ts) lets a constrained turn think before it answers, as llama.cpp's grammars do.

import type { ChatMessage, Constraint, ToolCall } from '../types'
import type { ReasoningPlan } from './reasoning'

export type ToolFamily = 'hermes' | 'llama3' | 'mistral' | 'phi4' | 'generic'

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

/** Phi-4-mini's template takes the tools as JSON text in the system message's own `tools` field
 *  and prints them between `<|tool|>` and `<|/tool|>`; its model answers in these tags. */
const PHI4_TOOLS = '<|tool|>'
const PHI4_CALL = '<|tool_call|>'
const PHI4_CALL_END = '<|/tool_call|>'
/** The system message Ollama's Phi-4-mini template writes when tools come without one. */
const PHI4_DEFAULT_SYSTEM = 'You are a helpful assistant with some tools.'

/** The family of a template, told from what it renders for a conversation with one tool (given
 *  as the `tools` argument, else in the system message's `tools` field, which Phi-4-mini's reads).
 *  A template that leaves the tool out (SmolLM2's), raises, or writes an unknown format is
 *  generic. */
export function detectFamily(render: (messages: ChatMessage[], tools: unknown[] | undefined) => string): ToolFamily {
  let text: string
  try {
    text = render(PROBE_MESSAGES, PROBE_TOOLS)
  } catch {
    return 'generic'
  }
  if (!text.includes(PROBE_FUNCTION)) return systemFieldFamily(render)
  if (text.includes('<tool_call>')) return 'hermes'
  if (text.includes('[AVAILABLE_TOOLS]') || text.includes('[TOOL_CALLS]')) return 'mistral'
  if (text.includes('<|start_header_id|>') && (text.includes('"parameters"') || text.includes('ipython'))) return 'llama3'
  return 'generic'
}

function systemFieldFamily(render: (messages: ChatMessage[], tools: unknown[] | undefined) => string): ToolFamily {
  const system: ChatMessage = { role: 'system', content: 'ortex probe system', tools: JSON.stringify(PROBE_TOOLS.map((t) => t.function)) }
  try {
    const text = render([system, ...PROBE_MESSAGES], undefined)
    return text.includes(`${PHI4_TOOLS}[{"name":"${PROBE_FUNCTION}"`) ? 'phi4' : 'generic'
  } catch {
    return 'generic'
  }
}

/** The tools the template renders: its own for the families that have a format, none for generic
 *  (their description is a system message: promptMessages). */
export function templateTools(plan: ToolPlan): unknown[] | undefined {
  return plan.family === 'generic' || plan.family === 'phi4' ? undefined : plan.tools
}

/** The conversation as the family's template takes it. Earlier calls' arguments become objects
 *  (templates print them with `tojson`); for generic, calls and results become JSON text and the
 *  tools' description leads the system message. */
export function promptMessages(plan: ToolPlan, messages: ChatMessage[]): ChatMessage[] {
  if (plan.family === 'phi4') return phi4Messages(plan, messages)
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

/** phi4: the functions as JSON text in the system message's `tools` field (as Phi-4-mini's model
 *  card writes them: name, description, parameters); an assistant's calls in its content, in the
 *  tags the model writes them in (the template prints only content), as Ollama's template does;
 *  a tool's result stays a `tool` message (the template prints `<|tool|>result<|end|>`). */
function phi4Messages(plan: ToolPlan, messages: ChatMessage[]): ChatMessage[] {
  const tools = JSON.stringify(plan.functions.map((f) => ({ name: f.name, description: f.description, parameters: f.parameters })))
  const out = messages.map(phi4Message)
  if (out[0]?.role === 'system' && typeof out[0].content === 'string') out[0] = { ...out[0], tools }
  else out.unshift({ role: 'system', content: PHI4_DEFAULT_SYSTEM, tools })
  return out
}

function phi4Message(message: ChatMessage): ChatMessage {
  if (message.role === 'tool' && typeof message.content !== 'string') return { ...message, content: JSON.stringify(message.content) }
  const calls = message.tool_calls
  if (message.role !== 'assistant' || !Array.isArray(calls) || calls.length === 0) return message
  const written = (calls as ToolCall[]).map((call) => `{"name": ${JSON.stringify(call.function.name)}, "arguments": ${argumentsText(call.function.arguments)}}`)
  const text = typeof message.content === 'string' ? message.content : ''
  const { tool_calls: _, ...rest } = message
  return { ...rest, content: `${text}${PHI4_CALL}[${written.join(', ')}]${PHI4_CALL_END}` }
}

/** A call's arguments as JSON text: as the caller sent them when they are JSON, else encoded. */
function argumentsText(value: unknown): string {
  if (typeof value === 'string') {
    try {
      JSON.parse(value)
      return value
    } catch {
      return JSON.stringify(value)
    }
  }
  return JSON.stringify(value ?? {})
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
export function toolConstraint(plan: ToolPlan, response: Constraint | undefined, tokenId: (text: string) => number | null, reasoning: ReasoningPlan | null = null): Constraint {
  const answer = answerConstraint(plan, response, tokenId)
  // A prompt that closed the block switched thinking off: the answer comes at once.
  return reasoning === null || reasoning.prompt === 'closed' ? answer : { type: 'lark', grammar: thinkingFirst(answer, reasoning) }
}

function answerConstraint(plan: ToolPlan, response: Constraint | undefined, tokenId: (text: string) => number | null): Constraint {
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
    case 'phi4':
      return { type: 'lark', grammar: phi4Grammar(plan, functions, tokenId(PHI4_CALL), tokenId(PHI4_CALL_END)) }
  }
}

/** The answer's grammar behind an optional reasoning block (a required one when the prompt left
 *  it open): the thought runs to the closing tag, so a call written inside it is thought, and the
 *  answer may follow after whitespace. */
function thinkingFirst(answer: Constraint, reasoning: ReasoningPlan): string {
  let rules: string
  if (answer.type === 'lark') {
    if (!answer.grammar.startsWith('start:')) throw new Error('a tool grammar begins with its start rule')
    rules = answer.grammar.replace(/^start:/, 'answer:')
  } else if (answer.type === 'json_schema') {
    rules = `answer: %json ${JSON.stringify(answer.schema)}\n`
  } else {
    throw new Error(`no reasoning prefix for a ${answer.type} constraint`)
  }
  const { start, end } = reasoning.format
  const thought = `thought[stop=${JSON.stringify(end)}]: /(.|\\n)*/\nGAP: /[ \\t\\r\\n]+/\n`
  const head = reasoning.prompt === 'open' ? 'start: thought GAP? answer\n' : `start: ${JSON.stringify(start)} thought GAP? answer | answer\n`
  return head + thought + rules
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

/** phi4: a list of calls between its tags, which are each one token where the vocabulary has
 *  them so; `auto` lets a reply be text instead (one that does not open the tag). */
function phi4Grammar(plan: ToolPlan, functions: ToolFunction[], callToken: number | null, endToken: number | null): string {
  const opener = callToken === null ? JSON.stringify(PHI4_CALL) : `<[${callToken}]>`
  const closer = endToken === null ? JSON.stringify(PHI4_CALL_END) : `<[${endToken}]>`
  const list: Record<string, unknown> = { type: 'array', items: anyCall(functions, 'arguments'), minItems: 1 }
  if (!plan.parallel) list.maxItems = 1
  const calls = `calls: ${opener} ${inlineJson(list)} ${closer}\n`
  if (plan.mode.kind !== 'auto') return `start: calls\n${calls}`
  // As text, a reply must not begin the tag; as a token, the tag is no text a reply can hold.
  const text = callToken === null ? '/[^<](.|\\n)*/' : '/(.|\\n)+/'
  return `start: TEXT | calls\nTEXT: ${text}\n${calls}`
}

function mistralGrammar(plan: ToolPlan, functions: ToolFunction[], callsToken: number | null): string {
  const opener = callsToken === null ? '"[TOOL_CALLS]"' : `<[${callsToken}]>`
  const list: Record<string, unknown> = { type: 'array', items: anyCall(functions, 'arguments'), minItems: 1 }
  if (!plan.parallel) list.maxItems = 1
  const calls = `calls: ${opener} ${inlineJson(list)}\n`
  if (plan.mode.kind !== 'auto') return `start: calls\n${calls}`
  return `start: TEXT | calls\nTEXT: /[^\\[](.|\\n)*/\n${calls}`
}
