// The bodies of POST /v1/chat/completions and /v1/completions, checked strictly (an unknown field,
// a wrong type or a value out of range is a 400 naming the parameter) and turned into one job.

import type { ChatMessage, TurnOptions } from '../../types'
import { ApiError, invalidParam, unsupportedParam } from './errors'
import { type ChatTools, chatTemplateKwargs, chatTools, messageKeys, responseFormat, structuredOutputs, toolMessageFields } from './tools'

export type JobKind = 'chat' | 'completion'

export interface CompletionJob {
  kind: JobKind
  model: string
  /** kind 'chat'. */
  messages: ChatMessage[] | null
  /** kind 'completion': text or token ids. */
  prompt: string | number[] | null
  stream: boolean
  includeUsage: boolean
  turn: TurnOptions
  /** Log-probabilities asked for: chat's `logprobs: true` (with `top_logprobs` alternatives), or
   *  completions' `logprobs: n`; null when not. */
  logprobs: { top: number } | null
  /** kind 'chat': the tools the model may call; null when none. */
  tools: ChatTools | null
  /** kind 'chat': `chat_template_kwargs`, the template's variables; undefined when none. */
  templateVariables?: Record<string, unknown>
}

/** OpenAI's limits on alternatives: 20 for chat, 5 for completions. */
const MAX_CHAT_TOP_LOGPROBS = 20
const MAX_COMPLETION_LOGPROBS = 5

/** OpenAI's own limit on stop sequences. */
export const MAX_STOP_SEQUENCES = 4
const MAX_MESSAGES = 10_000

const SAMPLING_FIELDS = [
  'model',
  'max_tokens',
  'temperature',
  'top_p',
  'seed',
  'stop',
  'presence_penalty',
  'frequency_penalty',
  'user',
  'stream',
  'stream_options',
  'n',
  // Extensions that vLLM and llama.cpp's servers take too.
  'top_k',
  'min_p',
  'repetition_penalty',
]
/** Fields OpenAI defines that this server refuses with a clear message instead of ignoring. */
const CHAT_UNSUPPORTED: Record<string, string> = {
  functions: 'the deprecated `functions` is not supported: use `tools`',
  function_call: 'the deprecated `function_call` is not supported: use `tool_choice`',
  logit_bias: 'logit_bias is not supported',
}
const TOOL_FIELDS = ['tools', 'tool_choice', 'parallel_tool_calls', 'response_format']
/** Extensions of vLLM's (and llama.cpp's, for the kwargs) chat requests. */
const TEMPLATE_FIELDS = ['chat_template_kwargs', 'structured_outputs']
const COMPLETION_UNSUPPORTED: Record<string, string> = {
  logit_bias: 'logit_bias is not supported',
  echo: 'echo is not supported',
  suffix: 'suffix is not supported',
  best_of: 'best_of is not supported',
}
const CHAT_FIELDS = [...SAMPLING_FIELDS, 'messages', 'max_completion_tokens', 'logprobs', 'top_logprobs', ...TOOL_FIELDS, ...TEMPLATE_FIELDS, ...Object.keys(CHAT_UNSUPPORTED)]
const COMPLETION_FIELDS = [...SAMPLING_FIELDS, 'prompt', 'logprobs', ...Object.keys(COMPLETION_UNSUPPORTED)]
const ROLES = new Set(['system', 'developer', 'user', 'assistant', 'tool'])

type Body = Record<string, unknown>

function describe(value: unknown): string {
  if (value === null) return 'null'
  if (Array.isArray(value)) return 'an array'
  return typeof value === 'string' ? 'a string' : typeof value
}

function checkObject(value: unknown): Body {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw invalidParam('body', `the request body must be a JSON object, got ${describe(value)}`)
  }
  return value as Body
}

function checkKnown(body: Body, known: readonly string[]): void {
  for (const key of Object.keys(body)) {
    if (!known.includes(key)) throw invalidParam(key, `Unrecognized request argument supplied: ${key}`, 'unknown_parameter')
  }
}

function present(body: Body, key: string): boolean {
  return body[key] !== undefined && body[key] !== null
}

/** A number within OpenAI's own bounds for `key` (max_tokens, n, seed, top_logprobs); the
 *  sampling fields' ranges are the core's (see checkedTurnOptions). */
function number(body: Body, key: string, min = -Number.MAX_VALUE, max = Number.MAX_VALUE): number | undefined {
  if (!present(body, key)) return undefined
  const value = body[key]
  if (typeof value !== 'number' || !Number.isFinite(value) || value < min || value > max) {
    const range = min === -Number.MAX_VALUE ? '' : ` in [${min}, ${max}]`
    throw invalidParam(key, `${key} must be a number${range}, got ${JSON.stringify(value)}`, 'invalid_value')
  }
  return value
}

function integer(body: Body, key: string, min: number, max: number): number | undefined {
  const value = number(body, key, min, max)
  if (value !== undefined && !Number.isInteger(value)) {
    throw invalidParam(key, `${key} must be an integer, got ${value}`, 'invalid_type')
  }
  return value
}

function boolean(body: Body, key: string): boolean | undefined {
  if (!present(body, key)) return undefined
  if (typeof body[key] !== 'boolean') throw invalidParam(key, `${key} must be a boolean, got ${describe(body[key])}`, 'invalid_type')
  return body[key] as boolean
}

function string(body: Body, key: string): string | undefined {
  if (!present(body, key)) return undefined
  if (typeof body[key] !== 'string') throw invalidParam(key, `${key} must be a string, got ${describe(body[key])}`, 'invalid_type')
  return body[key] as string
}

function stop(body: Body): string[] | undefined {
  if (!present(body, 'stop')) return undefined
  const value = body.stop
  const list = typeof value === 'string' ? [value] : value
  if (!Array.isArray(list) || list.some((s) => typeof s !== 'string' || s.length === 0)) {
    throw invalidParam('stop', 'stop must be a non-empty string or an array of non-empty strings', 'invalid_type')
  }
  if (list.length > MAX_STOP_SEQUENCES) {
    throw invalidParam('stop', `stop holds at most ${MAX_STOP_SEQUENCES} sequences, got ${list.length}`, 'invalid_value')
  }
  return list.length === 0 ? undefined : (list as string[])
}

function refuseUnsupported(body: Body, unsupported: Record<string, string>): void {
  for (const [key, reason] of Object.entries(unsupported)) {
    // `logprobs: false` and `echo: false` ask for nothing, as OpenAI's clients sometimes send.
    if (present(body, key) && body[key] !== false && body[key] !== 0) throw unsupportedParam(key, reason)
  }
  if (present(body, 'n') && body.n !== 1) {
    const n = integer(body, 'n', 1, 128)
    if (n !== 1) throw unsupportedParam('n', 'only n = 1 is supported')
  }
}

function streamOptions(body: Body, stream: boolean): boolean {
  if (!present(body, 'stream_options')) return false
  if (!stream) throw invalidParam('stream_options', 'stream_options is only allowed when stream is true')
  const options = body.stream_options
  if (typeof options !== 'object' || options === null || Array.isArray(options)) {
    throw invalidParam('stream_options', 'stream_options must be an object', 'invalid_type')
  }
  for (const key of Object.keys(options)) {
    if (key !== 'include_usage') throw invalidParam(`stream_options.${key}`, `Unrecognized stream option: ${key}`, 'unknown_parameter')
  }
  const include = (options as Body).include_usage
  if (include !== undefined && include !== null && typeof include !== 'boolean') {
    throw invalidParam('stream_options.include_usage', 'include_usage must be a boolean', 'invalid_type')
  }
  return include === true
}

/** The request fields behind each turn option, for the core's refusals (checkedTurnOptions). */
const PARAMS: Record<string, string> = {
  maxGeneratedTokens: 'max_tokens',
  temperature: 'temperature',
  topP: 'top_p',
  topK: 'top_k',
  minP: 'min_p',
  repetitionPenalty: 'repetition_penalty',
  presencePenalty: 'presence_penalty',
  frequencyPenalty: 'frequency_penalty',
  seed: 'seed',
  logprobs: 'logprobs',
  constraint: 'response_format',
}

/** The sampling fields both endpoints share, as ortex turn options. Their types are checked
 *  here, and OpenAI's own bounds (temperature up to 2, a signed seed); every other rule is the
 *  core's, applied by checkedTurnOptions. */
function turnOptions(body: Body, maxTokens: number | undefined): TurnOptions {
  const turn: TurnOptions = {}
  if (maxTokens !== undefined) turn.maxGeneratedTokens = maxTokens
  const temperature = number(body, 'temperature', 0, 2)
  if (temperature !== undefined) turn.temperature = temperature
  const fields = [
    ['top_p', 'topP'],
    ['min_p', 'minP'],
    ['repetition_penalty', 'repetitionPenalty'],
    ['presence_penalty', 'presencePenalty'],
    ['frequency_penalty', 'frequencyPenalty'],
  ] as const
  for (const [field, option] of fields) {
    const value = number(body, field)
    if (value !== undefined) turn[option] = value
  }
  const topK = integer(body, 'top_k', 0, 2 ** 31 - 1)
  if (topK !== undefined) turn.topK = topK
  const seed = integer(body, 'seed', -(2 ** 53 - 1), 2 ** 53 - 1)
  // OpenAI's seeds are signed; ortex's are unsigned integers below 2^53: a negative one maps to
  // 2^53 + seed, so distinct seeds stay distinct.
  if (seed !== undefined) turn.seed = seed < 0 ? 2 ** 53 + seed : seed
  const stops = stop(body)
  if (stops !== undefined) turn.stop = stops
  return turn
}

/** A job's turn options checked by the core as a turn's begin checks them (`check`: the engine's
 *  validateTurnOptions), a refusal answered as OpenAI's 400 naming the request field. */
export function checkedTurnOptions(job: CompletionJob, check: (options: TurnOptions) => void): void {
  try {
    check(job.turn)
  } catch (error) {
    const { code, message } = error as { code?: unknown; message: string }
    if (code !== 'INVALID_ARGUMENT') throw error
    // The core names the option first ("topP must be in (0, 1], got 0"): name the field instead.
    const option = /^\w+/.exec(message)?.[0] ?? ''
    const param = PARAMS[option]
    if (param === undefined) throw new ApiError(400, message, 'invalid_request_error', null, 'invalid_value')
    throw invalidParam(param, param + message.slice(option.length), 'invalid_value')
  }
}

function common(body: Body): { model: string; stream: boolean; includeUsage: boolean } {
  const model = string(body, 'model')
  if (model === undefined) throw invalidParam('model', 'you must provide a model parameter', 'missing_required_parameter')
  string(body, 'user')
  const stream = boolean(body, 'stream') ?? false
  return { model, stream, includeUsage: streamOptions(body, stream) }
}

function messageContent(param: string, content: unknown): string | unknown[] {
  if (typeof content === 'string') return content
  if (!Array.isArray(content)) throw invalidParam(param, `${param} must be a string or an array of content parts`, 'invalid_type')
  return content.map((part, i) => {
    const p = part as Body
    if (typeof part !== 'object' || part === null || p.type !== 'text' || typeof p.text !== 'string') {
      throw unsupportedParam(`${param}[${i}]`, 'only text content parts ({ type: "text", text }) are supported')
    }
    return { type: 'text', text: p.text }
  })
}

function messages(body: Body): ChatMessage[] {
  const list = body.messages
  if (!Array.isArray(list) || list.length === 0) {
    throw invalidParam('messages', 'messages must be a non-empty array of messages', list === undefined ? 'missing_required_parameter' : 'invalid_type')
  }
  if (list.length > MAX_MESSAGES) throw invalidParam('messages', `messages holds at most ${MAX_MESSAGES} messages`)
  return list.map((message, i) => {
    const param = `messages[${i}]`
    const m = message as Body
    if (typeof message !== 'object' || message === null || Array.isArray(message)) {
      throw invalidParam(param, `${param} must be an object`, 'invalid_type')
    }
    if (typeof m.role !== 'string' || !ROLES.has(m.role)) {
      throw invalidParam(`${param}.role`, `${param}.role must be one of ${[...ROLES].join(', ')}, got ${JSON.stringify(m.role)}`)
    }
    const keys = messageKeys(m.role)
    for (const key of Object.keys(m)) {
      if (!keys.includes(key)) {
        throw unsupportedParam(`${param}.${key}`, `${param}.${key} is not supported (a ${m.role} message has ${keys.join(', ')})`)
      }
    }
    // An assistant message that only calls tools has no content.
    const callsOnly = m.role === 'assistant' && (m.content === null || m.content === undefined) && Array.isArray(m.tool_calls)
    const out: ChatMessage = {
      // Templates know `system`; OpenAI's newer `developer` role means the same.
      role: m.role === 'developer' ? 'system' : m.role,
      content: callsOnly ? '' : messageContent(`${param}.content`, m.content),
    }
    toolMessageFields(param, m, out)
    if (m.name !== undefined) {
      if (typeof m.name !== 'string') throw invalidParam(`${param}.name`, `${param}.name must be a string`, 'invalid_type')
      out.name = m.name
    }
    return out
  })
}

function chatLogprobs(body: Body): { top: number } | null {
  const wanted = boolean(body, 'logprobs') ?? false
  const top = integer(body, 'top_logprobs', 0, MAX_CHAT_TOP_LOGPROBS)
  if (top !== undefined && !wanted) throw invalidParam('top_logprobs', 'top_logprobs needs logprobs: true')
  return wanted ? { top: top ?? 0 } : null
}

function withLogprobs(turn: TurnOptions, logprobs: { top: number } | null): TurnOptions {
  return logprobs === null ? turn : { ...turn, logprobs: logprobs.top }
}

export function parseChatRequest(value: unknown): CompletionJob {
  const body = checkObject(value)
  checkKnown(body, CHAT_FIELDS)
  refuseUnsupported(body, CHAT_UNSUPPORTED)
  // Both are checked when both are sent (the first must not shadow a bad second); the newer wins.
  const legacyMaxTokens = integer(body, 'max_tokens', 1, 2 ** 31 - 1)
  const maxTokens = integer(body, 'max_completion_tokens', 1, 2 ** 31 - 1) ?? legacyMaxTokens
  const logprobs = chatLogprobs(body)
  const turn = withLogprobs(turnOptions(body, maxTokens), logprobs)
  const constraint = structuredOutputs(body) ?? responseFormat(body)
  if (constraint !== undefined) turn.constraint = constraint
  const job: CompletionJob = { kind: 'chat', ...common(body), messages: messages(body), prompt: null, turn, logprobs, tools: chatTools(body) }
  const variables = chatTemplateKwargs(body)
  if (variables !== undefined) job.templateVariables = variables
  return job
}

/** OpenAI's default for /v1/completions. */
const COMPLETION_DEFAULT_MAX_TOKENS = 16

function prompt(body: Body): string | number[] {
  const value = body.prompt
  const tokenList = (list: unknown[]): list is number[] => list.every((t) => Number.isInteger(t) && (t as number) >= 0)
  if (typeof value === 'string' && value.length > 0) return value
  if (Array.isArray(value) && value.length > 0) {
    if (tokenList(value)) return value
    if (value.length > 1) throw unsupportedParam('prompt', 'only one prompt per request is supported')
    const only = value[0]
    if (typeof only === 'string' && only.length > 0) return only
    if (Array.isArray(only) && only.length > 0 && tokenList(only)) return only
  }
  throw invalidParam(
    'prompt',
    'prompt must be a non-empty string or a non-empty array of token ids',
    value === undefined ? 'missing_required_parameter' : 'invalid_type',
  )
}

export function parseCompletionRequest(value: unknown): CompletionJob {
  const body = checkObject(value)
  checkKnown(body, COMPLETION_FIELDS)
  refuseUnsupported(body, COMPLETION_UNSUPPORTED)
  const maxTokens = integer(body, 'max_tokens', 1, 2 ** 31 - 1) ?? COMPLETION_DEFAULT_MAX_TOKENS
  const top = integer(body, 'logprobs', 0, MAX_COMPLETION_LOGPROBS)
  const logprobs = top === undefined ? null : { top }
  const turn = withLogprobs(turnOptions(body, maxTokens), logprobs)
  return { kind: 'completion', ...common(body), messages: null, prompt: prompt(body), turn, logprobs, tools: null }
}
