// Chat: a model's chat template rendered in the core (crates/ortex-chat through ortex-boundary, the same
// on both backends), one-shot chat turns, and conversations that keep one Request for their whole
// life and prefill only what each new turn adds.
//
//   send(content) ──render(messages + user, generation prompt)──▶ text
//        │  the text starts with what is resident (previous prompt + the reply)?
//        ├─ yes: append tokenize(the rest); a reply that ended on its end-of-turn token keeps it
//        └─ no (the template rewrote history): keep the longest common token prefix, truncate the
//           request there, append the remainder
//
// The template's end-of-turn strings that are one token of the vocabulary (`<|im_end|>`,
// `<|eot_id|>`) end a turn with finishReason 'eos' (TurnOptions.eosTokenIds).
//
// Prompts are rendered *marked* (crates/ortex-boundary/src/prompt_text.rs): the control strings in
// message text are escaped before the render and tokenize as plain text after it, so only what
// the template writes becomes control tokens. The comparisons below work on the marked text.

import { readFileSync } from 'node:fs'
import path from 'node:path'

import type { CoreChat } from './binding'
import { OrtexError, invalidArgument, isErrorCode } from './errors'
import type { ChatFilesInput, ChatRenderInput, TurnOptionsInput } from './generated/boundary'
import { JsonCopier, copyJson } from './json'
import type { Request } from './request'
import type { Turn } from './turn'
import type { ChatMessage, ChatTemplateOptions, TurnResult } from './types'
import type { ToolPlan } from './tools/format'
import { attachToolPlan } from './tools/options'
import { applyToolPlan } from './tools/plan'
import * as v from './validate'

/** Most messages one conversation or render may hold. */
export const MAX_CHAT_MESSAGES = 100_000

export const CHAT_TEMPLATE_KEYS = ['addGenerationPrompt', 'tools', 'documents', 'templateName', 'variables'] as const
/** The keys of ChatPromptOptions (engine.chat, engine.createChat). */
export const CHAT_PROMPT_KEYS = ['parseSpecialTokens'] as const

/** The chat files of a model folder, as the core reads them; a missing file is absent. */
export function readChatFiles(modelDir: string): ChatFilesInput {
  const read = (name: string): string | undefined => {
    try {
      return readFileSync(path.join(modelDir, name), 'utf8')
    } catch (error) {
      if ((error as NodeJS.ErrnoException)?.code === 'ENOENT') return undefined
      throw new OrtexError('CHAT_CONFIG_INVALID', `cannot read ${name} in ${modelDir}: ${(error as Error).message}`)
    }
  }
  return {
    chatTemplateJinja: read('chat_template.jinja'),
    tokenizerConfigJson: read('tokenizer_config.json'),
    generationConfigJson: read('generation_config.json'),
    genaiConfigJson: read('genai_config.json'),
  }
}

/** A checked copy of the messages (json.ts: the copy, not the caller's array, crosses). */
export function checkMessages(name: string, messages: unknown, json: JsonCopier = new JsonCopier()): ChatMessage[] {
  const value = json.copy(name, messages)
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array of messages, got ${v.describe(value)}`)
  if (value.length === 0) throw invalidArgument(`${name} is empty`)
  if (value.length > MAX_CHAT_MESSAGES) throw invalidArgument(`${name} holds at most ${MAX_CHAT_MESSAGES} messages`)
  value.forEach((message, i) => checkMessage(`${name}[${i}]`, message))
  return value as ChatMessage[]
}

function checkMessage(name: string, message: unknown): asserts message is ChatMessage {
  if (typeof message !== 'object' || message === null || Array.isArray(message)) {
    throw invalidArgument(`${name} must be a message object ({ role, content }), got ${v.describe(message)}`)
  }
  // content is passed to the template as it is (a string, a list of parts, a tool's object):
  // templates differ in what they take, and say so themselves (CHAT_TEMPLATE_RAISED).
  const { role } = message as Record<string, unknown>
  if (typeof role !== 'string' || role.length === 0) {
    throw invalidArgument(`${name}.role must be a non-empty string, got ${v.describe(role)}`)
  }
}

function plainList(name: string, value: unknown): unknown[] {
  if (!Array.isArray(value)) throw invalidArgument(`${name} must be an array, got ${v.describe(value)}`)
  return value
}

/** ChatTemplateOptions from the keys present (validate.options already refused unknown ones);
 *  tools, documents and variables as checked copies (json.ts). */
export function templateOptions(name: string, present: Map<string, unknown>, json: JsonCopier = new JsonCopier()): ChatTemplateOptions {
  const out: ChatTemplateOptions = {}
  for (const [key, value] of present) {
    const arg = `${name}.${key}`
    switch (key) {
      case 'addGenerationPrompt':
        out.addGenerationPrompt = v.boolean(arg, value)
        break
      case 'tools':
      case 'documents':
        out[key] = plainList(arg, json.copy(arg, value))
        break
      case 'templateName':
        out.templateName = v.string(arg, value)
        break
      case 'variables': {
        const variables = json.copy(arg, value)
        if (typeof variables !== 'object' || variables === null || Array.isArray(variables)) {
          throw invalidArgument(`${arg} must be an object, got ${v.describe(variables)}`)
        }
        out.variables = variables
        break
      }
    }
  }
  return out
}

/** Splits `present` into the template's keys and the rest. */
export function takeTemplateKeys(present: Map<string, unknown>): Map<string, unknown> {
  const taken = new Map<string, unknown>()
  for (const key of CHAT_TEMPLATE_KEYS) {
    if (present.has(key)) {
      taken.set(key, present.get(key))
      present.delete(key)
    }
  }
  return taken
}

/** What the engine gives chat: its template, its text codec and its end-of-turn token ids. */
export interface ChatHost {
  template(): CoreChat
  /** Text whose control strings all become control tokens. */
  tokenize(text: string): Int32Array
  /** A prompt from template().renderMarked: only what the template wrote becomes control tokens. */
  tokenizeMarked(marked: string): Int32Array
  /** Throws where beginTurn would refuse these options (the core's rules), beginning nothing. */
  validateTurnOptions(options: TurnOptionsInput): void
  /** The single-token end-of-turn strings, by token id. */
  endTokens(): ReadonlyMap<number, string>
}

/** How one chat's prompts become tokens: marked (the default), or as plain text for trusted
 *  callers (ChatPromptOptions.parseSpecialTokens). */
export interface PromptCodec {
  render(messages: ChatMessage[], options: ChatTemplateOptions): string
  tokenize(text: string): Int32Array
}

export function promptCodec(host: ChatHost, parseSpecialTokens: boolean): PromptCodec {
  const marked = !parseSpecialTokens
  const tokenize = marked ? (text: string) => host.tokenizeMarked(text) : (text: string) => host.tokenize(text)
  return {
    render: (messages, options) => renderOnThread(host, messages, options, marked),
    tokenize,
  }
}

/** ChatPromptOptions from the keys present; they are taken out of `present`. */
export function takePromptOptions(name: string, present: Map<string, unknown>): { parseSpecialTokens: boolean } {
  const value = present.get('parseSpecialTokens')
  present.delete('parseSpecialTokens')
  return { parseSpecialTokens: value === undefined ? false : v.boolean(`${name}.parseSpecialTokens`, value) }
}

/** The prompt as plain text (applyChatTemplate). */
export function render(host: ChatHost, messages: ChatMessage[], options: ChatTemplateOptions): string {
  return renderOnThread(host, messages, options, false)
}

function renderOnThread(host: ChatHost, messages: ChatMessage[], options: ChatTemplateOptions, marked: boolean): string {
  const template = host.template()
  const input = renderInput(messages, options)
  try {
    return marked ? template.renderMarked(input) : template.render(input)
  } catch (error) {
    throw toChatError(error)
  }
}

/** A render's input as JSON text, which V8 writes in one call, for a binding that renders off
 *  the JS thread (CoreEngine.beginChatTurnAsync). */
export function renderInputJson(input: ChatRenderInput): string {
  try {
    return JSON.stringify(input)
  } catch (error) {
    throw invalidArgument(`messages, tools, documents and variables must be JSON: ${(error as Error).message}`)
  }
}

/** What the core renders: the messages and the template's options. */
export function renderInput(messages: ChatMessage[], options: ChatTemplateOptions): ChatRenderInput {
  return {
    messages,
    addGenerationPrompt: options.addGenerationPrompt ?? true,
    tools: options.tools,
    documents: options.documents,
    templateName: options.templateName,
    variables: options.variables,
    // Templates that print today's date (Llama 3's) read it here: the core reads no clock.
    nowUnixSeconds: Math.floor(Date.now() / 1000),
  }
}

export function toChatError(error: unknown): OrtexError {
  if (error instanceof OrtexError) return error
  const code = (error as { code?: unknown })?.code
  const message = (error as Error)?.message ?? String(error)
  // Only the core's codes pass: anything else a binding throws is a failed render, never a code
  // the caller was not told about.
  return new OrtexError(isErrorCode(code) ? code : 'CHAT_TEMPLATE_FAILED', message, { cause: error })
}

/** The turn options' eosTokenIds plus the template's end-of-turn tokens. */
export function withEndTokens(host: ChatHost, eosTokenIds: unknown): number[] {
  const own = eosTokenIds === undefined ? [] : Array.from(v.tokens('options.eosTokenIds', eosTokenIds))
  return [...new Set([...own, ...host.endTokens().keys()])]
}

export interface ChatInit {
  host: ChatHost
  prompts: PromptCodec
  request: Request
  system: string | null
  templateOptions: ChatTemplateOptions
  /** Starts the engine's driven loop (as generate does). */
  start(): void
  /** Tool calling on every send (createChat's tools); null: none. */
  tools: ToolPlan | null
}

/** What the last turn left resident, to tell what the next render adds. */
interface LastTurn {
  promptText: string
  result: TurnResult
}

/**
 * A conversation on one Request: each `send` renders the whole conversation, but prefills only
 * what is not resident yet, so turn N costs its new tokens (usage.promptTokens shows it).
 */
export class Chat {
  readonly request: Request
  private readonly host: ChatHost
  private readonly prompts: PromptCodec
  private readonly options: ChatTemplateOptions
  private readonly start: () => void
  private readonly tools: ToolPlan | null
  private readonly history: ChatMessage[] = []
  private pending: Turn | null = null
  private last: LastTurn | null = null

  /** @internal Made by engine.createChat. */
  constructor(init: ChatInit) {
    this.host = init.host
    this.prompts = init.prompts
    this.request = init.request
    this.options = init.templateOptions
    this.start = init.start
    this.tools = init.tools
    if (init.system !== null) this.history.push({ role: 'system', content: init.system })
  }

  /** The conversation so far (each reply is added when its turn finishes). */
  get messages(): readonly ChatMessage[] {
    return this.history.map((m) => ({ ...m }))
  }

  /** A user message (or any message object) and the assistant's reply to it, as a Turn. Throws
   *  TURN_ACTIVE while the previous reply is still generating. */
  send(content: string | ChatMessage, options?: import('./types').TurnOptions): Turn {
    const message = copyJson('content', typeof content === 'string' ? { role: 'user', content } : content)
    checkMessage('content', message)
    if (this.pending !== null) {
      throw new OrtexError('TURN_ACTIVE', `the reply to the previous message (turn ${this.pending.id}) has not finished yet`)
    }
    const present = v.options('options', options, v.TURN_KEYS)
    const messages = [...this.history, message]
    if (messages.length > MAX_CHAT_MESSAGES) throw invalidArgument(`a chat holds at most ${MAX_CHAT_MESSAGES} messages`)
    const renderOptions = { ...this.options, addGenerationPrompt: true }
    const prompt = this.tools === null ? messages : applyToolPlan(this.tools, this.host, messages, renderOptions, present)
    const text = this.prompts.render(prompt, renderOptions)
    const { keep, tokens } = this.plan(text)
    present.set('eosTokenIds', withEndTokens(this.host, present.get('eosTokenIds')))
    // Bad options throw before the context changes.
    this.host.validateTurnOptions(v.turnOptions('options', new Map(present)).core)
    if (keep < this.request.tokenCount) {
      this.request.truncate(keep)
      // Should beginTurn still fail (input past the session limit), the next send compares
      // tokens: what is resident no longer ends with the last reply.
      this.last = null
    }
    const turn = this.request.beginTurn(tokens, Object.fromEntries(present))
    if (this.tools !== null) attachToolPlan(turn, this.tools)
    this.history.push(message)
    this.pending = turn
    void turn.done.then((result) => this.finished(text, result))
    this.start()
    return turn
  }

  /** Closes the conversation's request (a reply in progress ends 'cancelled'). Idempotent. */
  close(): void {
    this.request.close()
  }

  private finished(promptText: string, result: TurnResult): void {
    this.pending = null
    const calls = result.toolCalls ?? []
    // The calls go into the history as OpenAI's messages have them; the template renders them.
    this.history.push(calls.length === 0 ? { role: 'assistant', content: result.content ?? result.text } : { role: 'assistant', content: result.content ?? '', tool_calls: calls })
    this.last = { promptText, result }
  }

  /** How much of the resident context to keep and which tokens to append. */
  private plan(text: string): { keep: number; tokens: Int32Array } {
    const resident = this.request.tokenCount
    const appended = this.last === null ? null : this.appendAfterReply(text, this.last, resident)
    if (appended !== null) return appended
    const full = this.prompts.tokenize(text)
    const context = this.request.tokens()
    let keep = 0
    while (keep < context.length && keep < full.length - 1 && context[keep] === full[keep]) keep++
    return { keep, tokens: full.subarray(keep) }
  }

  /** The usual case: the new render extends the previous prompt and reply as they are. */
  private appendAfterReply(text: string, last: LastTurn, resident: number): { keep: number; tokens: Int32Array } | null {
    const { result } = last
    // A stop string cut the reply's text short of its tokens; a cancelled turn may hold back
    // part of a character: both leave text and tokens apart, so the token comparison decides.
    const textMatchesTokens = result.finishReason === 'eos' || result.finishReason === 'max-generated-tokens' ||
      (result.finishReason === 'stop' && result.stop?.kind === 'token-ids')
    const base = last.promptText + result.text
    if (!textMatchesTokens || !text.startsWith(base)) return null
    let rest = text.slice(base.length)
    let keep = resident
    const lastToken = result.tokens[result.tokens.length - 1]
    if (result.finishReason === 'eos' && lastToken !== undefined) {
      const endText = this.host.endTokens().get(lastToken)
      // The reply's own end-of-turn token is what the template writes next: keep it. A model's
      // EOS without that text (the simulated model's) goes, and the template's end follows.
      if (endText !== undefined && rest.startsWith(endText)) rest = rest.slice(endText.length)
      else keep -= 1
    }
    const tokens = rest.length > 0 ? this.prompts.tokenize(rest) : new Int32Array(0)
    if (tokens.length === 0) return null
    return { keep, tokens }
  }
}
