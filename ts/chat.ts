// Chat: a model's chat template rendered in the core (crates/ortex-chat through ortex-boundary, the same
// on both backends), one-shot chat turns, and conversations that keep one Request for their whole
// life and prefill only what each new turn adds.
//
// A conversation's send is one core call (CoreEngine.beginConversationTurn,
// crates/ortex-boundary/src/conversation.rs): it renders the whole conversation, appends what is
// not resident yet (the text after the previous prompt and its reply; where the render no longer
// extends them, the tokens after the longest common prefix, the context cut there) and begins the
// turn. What it compares with lives in Rust: the last prompt's text in the Chat's
// CoreConversation, the reply in the core. The history of messages stays here.
//
// The template's end-of-turn strings that are one token of the vocabulary (`<|im_end|>`,
// `<|eot_id|>`) end a turn with finishReason 'eos' (TurnOptions.eosTokenIds).
//
// Prompts are rendered *marked* (crates/ortex-boundary/src/prompt_text.rs): the control strings in
// message text are escaped before the render and tokenize as plain text after it, so only what
// the template writes becomes control tokens.

import { readFileSync } from 'node:fs'
import path from 'node:path'

import type { CoreChat, CoreConversation } from './binding'
import { OrtexError, invalidArgument, isErrorCode } from './errors'
import type { ChatFilesInput, ChatRenderInput, ChatTurnView, TurnOptionsInput } from './generated/boundary'
import { JsonCopier, copyJson } from './json'
import type { Request, Turn } from './request'
import type { ChatMessage, ChatTemplateOptions, TurnOptions, TurnResult } from './types'
import { type OutputPlan, attachOutputPlan } from './tools/output'
import { applyToolPlan } from './tools/plan'
import * as opts from './options'
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

/** What the engine gives chat: its template, its text codec and its conversations. */
export interface ChatHost {
  template(): CoreChat
  /** Text whose control strings all become control tokens. */
  tokenize(text: string): Int32Array
  /** A conversation's memory of its last send, on this engine's core. */
  createConversation(): CoreConversation
  /** A conversation's send in the core (CoreEngine.beginConversationTurn with the template). */
  beginConversationTurn(
    requestId: number,
    conversation: CoreConversation,
    input: ChatRenderInput,
    parseSpecialTokens: boolean,
    options: TurnOptionsInput,
  ): ChatTurnView
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

export interface ChatInit {
  host: ChatHost
  /** Prompts as plain text (ChatPromptOptions.parseSpecialTokens); false: marked. */
  parseSpecialTokens: boolean
  request: Request
  system: string | null
  templateOptions: ChatTemplateOptions
  /** Starts the engine's driven loop (as generate does). */
  start(): void
  /** How every send's output is read: tool calls (createChat's tools) and reasoning. */
  output: OutputPlan
}

/**
 * A conversation on one Request: each `send` renders the whole conversation, but prefills only
 * what is not resident yet, so turn N costs its new tokens (usage.promptTokens shows it).
 */
export class Chat {
  readonly request: Request
  private readonly host: ChatHost
  private readonly parseSpecialTokens: boolean
  private readonly conversation: CoreConversation
  private readonly options: ChatTemplateOptions
  private readonly start: () => void
  private readonly output: OutputPlan
  private readonly history: ChatMessage[] = []
  private pending: Turn | null = null

  /** @internal Made by engine.createChat. */
  constructor(init: ChatInit) {
    this.host = init.host
    this.parseSpecialTokens = init.parseSpecialTokens
    this.conversation = init.host.createConversation()
    this.request = init.request
    this.options = init.templateOptions
    this.start = init.start
    this.output = init.output
    if (init.system !== null) this.history.push({ role: 'system', content: init.system })
  }

  /** The conversation so far (each reply is added when its turn finishes). */
  get messages(): readonly ChatMessage[] {
    return this.history.map((m) => ({ ...m }))
  }

  /** A user message (or any message object) and the assistant's reply to it, as a Turn. Throws
   *  TURN_ACTIVE while the previous reply is still generating. */
  send(content: string | ChatMessage, options?: TurnOptions): Turn {
    const message = copyJson('content', typeof content === 'string' ? { role: 'user', content } : content)
    checkMessage('content', message)
    if (this.pending !== null) {
      throw new OrtexError('TURN_ACTIVE', `the reply to the previous message (turn ${this.pending.id}) has not finished yet`)
    }
    const present = v.options('options', options, opts.TURN_KEYS)
    const messages = [...this.history, message]
    if (messages.length > MAX_CHAT_MESSAGES) throw invalidArgument(`a chat holds at most ${MAX_CHAT_MESSAGES} messages`)
    const renderOptions = { ...this.options, addGenerationPrompt: true }
    const { tools, reasoning } = this.output
    const prompt = tools === null ? messages : applyToolPlan(tools, this.host, messages, renderOptions, present, reasoning)
    const checked = opts.turnOptions('options', present)
    const input = renderInput(prompt, renderOptions)
    // One call renders, plans, truncates and begins; bad options throw before the context changes.
    const turn = this.request._beginChat(
      checked,
      (id, core) => this.host.beginConversationTurn(id, this.conversation, input, this.parseSpecialTokens, core),
      false,
    )
    attachOutputPlan(turn, this.output)
    this.history.push(message)
    this.pending = turn
    void turn.done.then((result) => this.finished(result))
    this.start()
    return turn
  }

  /** Closes the conversation's request (a reply in progress ends 'cancelled'). Idempotent. */
  close(): void {
    this.request.close()
  }

  private finished(result: TurnResult): void {
    this.pending = null
    // The reply goes into the history as OpenAI's messages (and vLLM's, for the reasoning) have
    // it; the template renders it (Qwen 3's prints the reasoning of the turns since the last user
    // message and drops the earlier ones).
    const reply: ChatMessage = { role: 'assistant', content: result.content === undefined ? result.text : (result.content ?? '') }
    if (typeof result.reasoning === 'string') reply.reasoning_content = result.reasoning
    const calls = result.toolCalls ?? []
    if (calls.length > 0) reply.tool_calls = calls
    this.history.push(reply)
  }
}
