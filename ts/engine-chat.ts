// Chat on an engine: the model folder's chat template (the simulated model's: ChatML), loaded
// once on the first chat call and owned here (the core works out its end-of-turn tokens), and the
// engine's chat calls (applyChatTemplate, chat, chatAsync, createChat), which the Engine's methods
// forward to. The core renders, tokenizes and begins a chat turn in one call
// (crates/ortex-boundary's chat); chat.ts reads the folder's chat files and checks messages;
// tools/ adds tool calling.
//
// This module reaches its engine only through ChatEngineHost, so it imports nothing of engine.ts.

import type { Backend } from './backend'
import type { CoreChat, CoreEngine, NativeCoreEngine } from './binding'
import * as chat from './chat'
import type { OrtexError } from './errors'
import type { ChatRenderInput } from './generated/boundary'
import { JsonCopier } from './json'
import type { Request, Turn } from './request'
import { type OutputPlan, attachOutputPlan } from './tools/output'
import { TOOL_KEYS, takeToolPlan } from './tools/options'
import { applyToolPlan, reasoningPlan, toolFamily } from './tools/plan'
import type { ChatMessage, ChatOptions, ChatTemplateOptions, CreateChatOptions, RequestOptions } from './types'
import * as opts from './options'
import * as v from './validate'

/** What the chat calls need of their engine. */
export interface ChatEngineHost {
  readonly core: CoreEngine
  readonly backend: Backend
  /** The model folder (its chat files); null: the simulated model, whose template is ChatML. */
  readonly modelDir: string | null
  /** Calls the binding and converts what it throws into an OrtexError. */
  call<T>(fn: () => T): T
  convertError(error: unknown): OrtexError
  /** ENGINE_CLOSED. */
  checkOpen(): void
  /** ENGINE_CLOSED or ENGINE_UNHEALTHY. */
  checkUsable(): void
  /** A request for one turn (closed when it finishes) from the options present: the request's
   *  are taken out, the rest are the turn's, checked. */
  ownedRequest(present: Map<string, unknown>): { request: Request; checked: opts.CheckedTurnOptions }
  createRequest(options?: RequestOptions): Request
  /** Starts the engine's driven loop. */
  start(): void
}

/** What chat and chatAsync begin a turn with. */
interface ChatArguments {
  template: CoreChat
  input: ChatRenderInput
  parseSpecialTokens: boolean
  /** The request's and the turn's options. */
  present: Map<string, unknown>
  /** How the output is read: tool calls and reasoning (tools/). */
  output: OutputPlan
}

/** @internal The chat calls of one engine, and its template once loaded. */
export class EngineChat {
  /** Made on the first chat call: the folder's template (or ChatML); the core works out its
   *  end-of-turn tokens. */
  private chatTemplate: CoreChat | null = null

  constructor(private readonly engine: ChatEngineHost) {}

  /** The text the model reads for `messages`, rendered with the model folder's chat template
   *  (the simulated model's: ChatML). CHAT_TEMPLATE_MISSING names what a folder lacks. */
  applyChatTemplate(messages: ChatMessage[], options?: ChatTemplateOptions): string {
    // One budget for the call's JSON-like arguments together (json.ts).
    const json = new JsonCopier()
    const checked = chat.checkMessages('messages', messages, json)
    const present = v.options('options', options, chat.CHAT_TEMPLATE_KEYS)
    const templateOptions = chat.templateOptions('options', present, json)
    this.engine.checkOpen()
    return chat.render(this.chatHost(), checked, templateOptions)
  }

  /** One chat turn on its own request (closed when it finishes), as generate: the messages are
   *  rendered with a generation prompt; the template's end-of-turn token ends it with 'eos'. */
  chat(messages: ChatMessage[], options?: ChatOptions): Turn {
    return this.beginChat(this.chatArguments(messages, options))
  }

  private beginChat({ template, input, parseSpecialTokens, present, output }: ChatArguments): Turn {
    const { request, checked } = this.engine.ownedRequest(present)
    let turn: Turn
    try {
      // One call renders, tokenizes and begins the turn (crates/ortex-boundary's Chat::prompt).
      turn = request._beginChat(checked, (id, core) => this.engine.core.beginChatTurn(id, template, input, parseSpecialTokens, core))
    } catch (error) {
      request.close()
      throw chat.toChatError(error)
    }
    attachOutputPlan(turn, output)
    this.engine.start()
    return turn
  }

  /** Addition: chat() with the template rendered and the prompt tokenized off the JS thread on
   *  native (the libuv thread pool), so a large conversation does not hold the event loop; the
   *  turn begins once the prompt is ready. WebAssembly renders on the calling thread. Rejects
   *  where chat() throws. */
  async chatAsync(messages: ChatMessage[], options?: ChatOptions): Promise<Turn> {
    const args = this.chatArguments(messages, options)
    const core = this.engine.core as Partial<NativeCoreEngine>
    if (core.beginChatTurnAsync === undefined) return this.beginChat(args)
    const { template, input, parseSpecialTokens, present, output } = args
    const json = chat.renderInputJson(input)
    const { request, checked } = this.engine.ownedRequest(present)
    let turn: Turn
    try {
      turn = await request._beginChatAsync(checked, (id, options) => core.beginChatTurnAsync!(id, template, json, parseSpecialTokens, options))
    } catch (error) {
      request.close()
      throw this.engine.convertError(error)
    }
    attachOutputPlan(turn, output)
    this.engine.start()
    return turn
  }

  /** Checked arguments of chat and chatAsync, the engine's template and the render's input. */
  private chatArguments(messages: ChatMessage[], options: ChatOptions | undefined): ChatArguments {
    const json = new JsonCopier()
    const checked = chat.checkMessages('messages', messages, json)
    const present = v.options('options', options, [...opts.REQUEST_KEYS, ...opts.TURN_KEYS, ...chat.CHAT_TEMPLATE_KEYS, ...chat.CHAT_PROMPT_KEYS, ...TOOL_KEYS])
    if (present.has('addGenerationPrompt')) throw v.invalidArgumentFor('options.addGenerationPrompt', 'is not a chat option')
    const templateOptions = chat.templateOptions('options', chat.takeTemplateKeys(present), json)
    const { parseSpecialTokens } = chat.takePromptOptions('options', present)
    this.engine.checkUsable()
    const template = this.loadChatTemplate()
    const host = this.chatHost()
    const render = (messages: ChatMessage[], options: ChatTemplateOptions) => chat.render(host, messages, options)
    const tools = takeToolPlan('options', present, templateOptions.tools, () => toolFamily(host, render))
    const reasoning = reasoningPlan(host, render, templateOptions)
    const prompt = tools === null ? checked : applyToolPlan(tools, host, checked, templateOptions, present, reasoning)
    return { template, input: chat.renderInput(prompt, { ...templateOptions, addGenerationPrompt: true }), parseSpecialTokens, present, output: { tools, reasoning } }
  }

  /** A conversation on one request: `send(content)` returns the reply's Turn and prefills only
   *  what the new message adds. */
  createChat(options?: CreateChatOptions): chat.Chat {
    const present = v.options('options', options, ['system', ...opts.REQUEST_KEYS, ...chat.CHAT_TEMPLATE_KEYS, ...chat.CHAT_PROMPT_KEYS, ...TOOL_KEYS])
    if (present.has('addGenerationPrompt')) throw v.invalidArgumentFor('options.addGenerationPrompt', 'is not a chat option')
    const system = present.has('system') ? v.string('options.system', present.get('system')) : null
    present.delete('system')
    const templateOptions = chat.templateOptions('options', chat.takeTemplateKeys(present))
    const { parseSpecialTokens } = chat.takePromptOptions('options', present)
    const host = this.chatHost()
    // Fail now, not at the first send, on a folder without a template.
    host.template()
    const render = (messages: ChatMessage[], options: ChatTemplateOptions) => chat.render(host, messages, options)
    const tools = takeToolPlan('options', present, templateOptions.tools, () => toolFamily(host, render))
    const reasoning = reasoningPlan(host, render, templateOptions)
    const request = this.engine.createRequest(Object.fromEntries(present))
    return new chat.Chat({ host, parseSpecialTokens, request, system, templateOptions, output: { tools, reasoning }, start: () => this.engine.start() })
  }

  private chatHost(): chat.ChatHost {
    return {
      template: () => this.loadChatTemplate(),
      tokenize: (text) => this.engine.call(() => this.engine.core.tokenize(text)),
      createConversation: () => this.engine.call(() => this.engine.core.createConversation()),
      beginConversationTurn: (requestId, conversation, input, parseSpecialTokens, options) =>
        this.engine.core.beginConversationTurn(requestId, conversation, this.loadChatTemplate(), input, parseSpecialTokens, options),
    }
  }

  private loadChatTemplate(): CoreChat {
    if (this.chatTemplate === null) {
      const files = this.engine.modelDir === null ? null : chat.readChatFiles(this.engine.modelDir)
      this.chatTemplate = this.engine.call(() => this.engine.backend.chat(files, this.engine.core.controlStrings()))
      if (!this.chatTemplate.hasTemplate()) {
        const template = this.chatTemplate
        this.chatTemplate = null
        // The core's message names the files it looked in.
        try {
          template.render({ messages: [{ role: 'user', content: '' }] })
        } catch (error) {
          throw chat.toChatError(error)
        }
      }
    }
    return this.chatTemplate!
  }
}
