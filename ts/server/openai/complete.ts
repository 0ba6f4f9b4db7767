// One completion request, from its checked job to the HTTP response: a chat turn (the model's
// chat template) or a plain completion, answered as one JSON object or streamed as server-sent
// events. A client that goes away cancels its turn at once (its KV is freed in the next step),
// and what the turn had produced for it is dropped unformatted. What waits to be sent to a client
// is bounded as a WebSocket connection's (flow.ts): a client that stops reading is dropped after
// sendStallMs.

import { randomBytes } from 'node:crypto'
import type { ServerResponse } from 'node:http'

import type { Engine } from '../../engine'
import { OrtexError } from '../../errors'
import { OutputParser, outputPlanOf } from '../../tools/output'
import type { ToolCallDelta } from '../../tools/parse'
import type { Turn } from '../../request'
import type { FinishReason, TokenLogprob, TurnResult } from '../../types'
import { type FlowLimits, StallTimer } from '../flow'
import type { CompletionTracker } from '../metrics'
import { ApiError } from './errors'
import type { CompletionJob } from './parse'

export type OpenAiFinishReason = 'stop' | 'length' | 'tool_calls'

export interface CompletionContext {
  engine: Engine
  /** The name /v1/models lists; requests name it as `model`. */
  modelName: string
  /** maxGeneratedTokens of a chat completion that sets neither max_tokens nor max_completion_tokens
   *  (undefined: until the session limit). */
  defaultMaxTokens: number | undefined
  /** Bounds on what waits to be sent to the client. */
  flow: FlowLimits
  tracker: CompletionTracker
}

interface Usage {
  prompt_tokens: number
  completion_tokens: number
  total_tokens: number
  prompt_tokens_details: { cached_tokens: number }
}

export function finishReasonOf(reason: FinishReason, calledTools = false): OpenAiFinishReason {
  if (reason === 'max-generated-tokens' || reason === 'max-session-tokens') return 'length'
  return calledTools ? 'tool_calls' : 'stop'
}

function usageOf(result: TurnResult): Usage {
  const { promptTokens, generatedTokens } = result.usage
  // cachedPromptTokens: prompt tokens the prefix cache served (0 where the engine has none).
  const cached = (result.usage as { cachedPromptTokens?: number }).cachedPromptTokens ?? 0
  return {
    prompt_tokens: promptTokens,
    completion_tokens: generatedTokens,
    total_tokens: promptTokens + generatedTokens,
    prompt_tokens_details: { cached_tokens: cached },
  }
}

/** An engine error at the start of a turn, as the API reports it. */
export function apiErrorOf(error: unknown): ApiError {
  if (error instanceof ApiError) return error
  if (error instanceof OrtexError) {
    const code = error.code.toLowerCase()
    switch (error.code) {
      case 'INVALID_ARGUMENT':
      case 'CHAT_TEMPLATE_RAISED':
      case 'CHAT_TEMPLATE_FAILED':
        return new ApiError(400, error.message, 'invalid_request_error', null, code)
      case 'CHAT_TEMPLATE_MISSING':
      case 'CHAT_TEMPLATE_INVALID':
      case 'CHAT_CONFIG_INVALID':
        return new ApiError(400, `this model cannot chat: ${error.message}`, 'invalid_request_error', 'messages', code)
      case 'CAPACITY_EXHAUSTED':
        return new ApiError(429, error.message, 'engine_overloaded_error', null, code)
      case 'ENGINE_CLOSED':
      case 'ENGINE_UNHEALTHY':
        return new ApiError(503, error.message, 'server_error', null, code)
    }
    return new ApiError(500, error.message, 'server_error', null, code)
  }
  return new ApiError(500, 'internal error', 'server_error')
}

/** A chat turn renders its template off the JS thread (engine.chatAsync), so a large request
 *  does not hold the server's other requests. */
async function startTurn(context: CompletionContext, job: CompletionJob): Promise<Turn> {
  const { engine } = context
  if (job.kind === 'chat') {
    const turn = { ...job.turn }
    if (turn.maxGeneratedTokens === undefined && context.defaultMaxTokens !== undefined) {
      turn.maxGeneratedTokens = context.defaultMaxTokens
    }
    const options = job.tools === null ? turn : { ...turn, ...job.tools }
    return engine.chatAsync(job.messages!, job.templateVariables === undefined ? options : { ...options, variables: job.templateVariables })
  }
  return engine.generate(job.prompt!, job.turn)
}

/**
 * The response's outgoing side, bounded by FlowLimits: a write that leaves maxBufferedBytes or
 * more waiting resolves only once the client has read them (its 'drain'), and a client that
 * stays above for sendStallMs is dropped; the response's 'close' then cancels the turn. Once the
 * client is gone, writes take nothing.
 */
class ResponseSink {
  constructor(
    readonly res: ServerResponse,
    private readonly flow: FlowLimits,
  ) {}

  /** The client went away (or was dropped): nothing more is written or formatted for it. */
  get gone(): boolean {
    return this.res.destroyed
  }

  write(data: string): Promise<void> | void {
    if (this.gone || this.res.writableEnded) return
    this.res.write(data)
    // writableNeedDrain: a 'drain' will come (a write was refused by the socket's own mark).
    if (this.res.writableLength < this.flow.maxBufferedBytes || !this.res.writableNeedDrain) return
    return this.drained()
  }

  /** The last bytes; a client that then takes nothing for sendStallMs is dropped. */
  end(data: string): void {
    if (this.gone || this.res.writableEnded) return
    this.res.end(data)
    if (!this.res.writableFinished) this.watchUntilFinished()
  }

  json(status: number, body: unknown): void {
    const text = JSON.stringify(body)
    this.res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) })
    this.end(text)
  }

  private drained(): Promise<void> {
    const res = this.res
    return new Promise<void>((resolve) => {
      const stall = new StallTimer(this.flow.sendStallMs, () => res.destroy())
      const done = (): void => {
        stall.clear()
        res.off('drain', done)
        res.off('close', done)
        resolve()
      }
      res.on('drain', done)
      res.on('close', done)
      stall.start()
    })
  }

  /** After end(): dropped when a whole sendStallMs passes in which the client read nothing. */
  private watchUntilFinished(): void {
    const res = this.res
    let waiting = res.writableLength
    const timer = setInterval(() => {
      const now = res.writableLength
      if (now > 0 && now >= waiting) res.destroy()
      waiting = now
    }, this.flow.sendStallMs)
    timer.unref()
    res.once('close', () => clearInterval(timer))
  }
}

interface Shape {
  id: string
  created: number
  model: string
  object: string
}

function shapeOf(context: CompletionContext, job: CompletionJob, stream: boolean): Shape {
  const chat = job.kind === 'chat'
  return {
    id: `${chat ? 'chatcmpl' : 'cmpl'}-${randomBytes(12).toString('hex')}`,
    created: Math.floor(Date.now() / 1000),
    model: context.modelName,
    object: chat ? (stream ? 'chat.completion.chunk' : 'chat.completion') : 'text_completion',
  }
}

/** Token log-probabilities in OpenAI's shapes: chat's `{ content: [...] }`, completions'
 *  parallel lists. Each token's text is its own detokenization (the core's, with the entry). */
class LogprobWriter {
  private textOffset = 0

  constructor(private readonly job: CompletionJob) {}

  shape(entries: TokenLogprob[]): object | null {
    if (this.job.logprobs === null) return null
    if (this.job.kind === 'chat') {
      const item = (text: string, logprob: number) => ({ token: text, logprob, bytes: Array.from(Buffer.from(text, 'utf8')) })
      return {
        content: entries.map((e) => ({ ...item(e.text, e.logprob), top_logprobs: e.top.map((t) => item(t.text, t.logprob)) })),
        refusal: null,
      }
    }
    const tokens = entries.map((e) => e.text)
    const offsets = tokens.map((t) => {
      const at = this.textOffset
      this.textOffset += t.length
      return at
    })
    return {
      tokens,
      token_logprobs: entries.map((e) => e.logprob),
      top_logprobs: entries.map((e) => Object.fromEntries(e.top.map((t) => [t.text, t.logprob]))),
      text_offset: offsets,
    }
  }
}

function choiceDelta(
  job: CompletionJob,
  text: string | null,
  role: boolean,
  finish: OpenAiFinishReason | null,
  logprobs: object | null = null,
  calls: ToolCallDelta[] = [],
  reasoning = '',
): object {
  if (job.kind === 'completion') return { index: 0, text: text ?? '', logprobs, finish_reason: finish }
  const delta: Record<string, unknown> = {}
  if (role) delta.role = 'assistant'
  if (reasoning.length > 0) delta.reasoning_content = reasoning
  if (text !== null) delta.content = text
  if (calls.length > 0) delta.tool_calls = calls.map(toolCallDelta)
  return { index: 0, delta, logprobs, finish_reason: finish }
}

/** A call's streamed change as OpenAI sends it: the first with its id, type and name. */
function toolCallDelta(d: ToolCallDelta): object {
  if (d.id === undefined) return { index: d.index, function: { arguments: d.arguments } }
  return { index: d.index, id: d.id, type: 'function', function: { name: d.name, arguments: d.arguments } }
}

/** Runs the job; resolves with the status code sent once the response has ended. */
export async function complete(context: CompletionContext, job: CompletionJob, res: ServerResponse): Promise<number> {
  let turn: Turn
  try {
    turn = await startTurn(context, job)
  } catch (error) {
    context.tracker.end(0, 0)
    throw startError(context, job, error)
  }
  // The client went away: cancel now, not when the next write fails (it may have gone while the
  // template rendered).
  const cancel = (): void => void turn.cancel()
  res.on('close', cancel)
  if (res.destroyed) cancel()
  const sink = new ResponseSink(res, context.flow)
  try {
    return job.stream ? await streamTurn(context, job, turn, sink) : await answerTurn(context, job, turn, sink)
  } catch (error) {
    turn.cancel() // whatever went wrong here, the turn stops generating for nobody
    throw error
  } finally {
    res.off('close', cancel)
    const result = await turn.done
    context.tracker.end(result.usage.promptTokens, result.usage.generatedTokens)
  }
}

/** The parameter that holds the prompt: OpenAI names `messages` (chat) or `prompt`. */
function promptParam(job: CompletionJob): string {
  return job.kind === 'chat' ? 'messages' : 'prompt'
}

/** The prompt's length in tokens as the turn would have it; null when it cannot be told. */
function promptTokenCount(engine: Engine, job: CompletionJob): number | null {
  try {
    if (job.kind === 'chat') return engine.tokenize(engine.applyChatTemplate(job.messages!)).length
    return typeof job.prompt === 'string' ? engine.tokenize(job.prompt).length : job.prompt!.length
  } catch {
    return null
  }
}

/** A turn that could not start. A prompt that leaves no room to generate under the model's
 *  context (the core's INVALID_ARGUMENT) is OpenAI's 400 `context_length_exceeded` on the
 *  prompt's parameter; it is told by counting the prompt, only on this error path. */
function startError(context: CompletionContext, job: CompletionJob, error: unknown): ApiError {
  if (error instanceof OrtexError && error.code === 'INVALID_ARGUMENT') {
    const limit = context.engine.config.maxLength
    const tokens = promptTokenCount(context.engine, job)
    if (tokens !== null && tokens >= limit) {
      const message =
        `This model's maximum context length is ${limit} tokens. However, your ${promptParam(job)} resulted in ` +
        `${tokens} tokens, which leaves no room to generate. Please reduce the length of the ${promptParam(job)}.`
      return new ApiError(400, message, 'invalid_request_error', promptParam(job), 'context_length_exceeded')
    }
    const param = optionParam(error.message, job)
    if (param !== null) return new ApiError(400, error.message, 'invalid_request_error', param, 'invalid_argument')
  }
  return apiErrorOf(error)
}

/** The request field behind a refused chat option (the engine names its own options; a
 *  constraint the core cannot compile is the tools' own when the request has tools). */
function optionParam(message: string, job: CompletionJob): string | null {
  if (message.startsWith('options.constraint cannot be combined with tools')) return 'response_format'
  if (message.startsWith('constraint')) {
    const own = job.turn.constraint?.type
    if (own === 'regex' || own === 'lark') return 'structured_outputs'
    return job.tools !== null ? 'tools' : 'response_format'
  }
  for (const [option, param] of [
    ['options.toolChoice', 'tool_choice'],
    ['options.parallelToolCalls', 'parallel_tool_calls'],
    ['options.tools', 'tools'],
    ['options.constraint', 'response_format'],
  ] as const) {
    if (message.startsWith(option)) return param
  }
  return null
}

/** A failed turn as the API reports it. `request-unserviceable` (the context can never fit the
 *  KV pool, however long one waits) is the caller's to change: a 400 `context_length_exceeded`,
 *  on the prompt when nothing was generated, else on max_tokens. Other failures are the server's. */
function turnFailed(context: CompletionContext, job: CompletionJob, result: TurnResult): ApiError {
  if (result.errorCode === 'request-unserviceable') {
    const { numBlocks, blockSize } = context.engine.config
    const generated = result.usage.generatedTokens
    const held = `${result.usage.promptTokens} prompt tokens${generated > 0 ? ` and ${generated} generated` : ''}`
    const message = `the ${held} can never fit this server's KV cache of ${numBlocks * blockSize} token positions; shorten the ${generated > 0 ? 'completion (max_tokens)' : promptParam(job)}`
    return new ApiError(400, message, 'invalid_request_error', generated > 0 ? 'max_tokens' : promptParam(job), 'context_length_exceeded')
  }
  return new ApiError(500, `the turn failed (${result.errorCode})`, 'server_error', null, result.errorCode)
}

async function answerTurn(context: CompletionContext, job: CompletionJob, turn: Turn, sink: ResponseSink): Promise<number> {
  await countTokens(context, turn, sink)
  const result = await turn.done
  if (sink.gone) return 499
  if (result.finishReason === 'failed') throw turnFailed(context, job, result)
  const shape = shapeOf(context, job, false)
  const calls = result.toolCalls ?? []
  const finish = finishReasonOf(result.finishReason, calls.length > 0)
  const logprobs = new LogprobWriter(job).shape(result.logprobs ?? [])
  const message: Record<string, unknown> = { role: 'assistant', content: result.content === undefined ? result.text : result.content, refusal: null }
  // A template whose model thinks between tags: the thinking apart, as vLLM's reasoning parsers
  // give it (null when the turn did not think).
  if (result.reasoning !== undefined) message.reasoning_content = result.reasoning
  if (calls.length > 0) message.tool_calls = calls
  const choice = job.kind === 'chat' ? { index: 0, message, logprobs, finish_reason: finish } : { index: 0, text: result.text, logprobs, finish_reason: finish }
  sink.json(200, { ...shape, choices: [choice], usage: usageOf(result) })
  return 200
}

/** A non-streamed turn's tokens, counted as they arrive for the metrics' timings: one wake-up per
 *  run that brought some, no chunk read (the text comes whole with `done`). */
async function countTokens(context: CompletionContext, turn: Turn, sink: ResponseSink): Promise<void> {
  const state = turn._state
  let counted = 0
  while (!state.ended) {
    await state.wait()
    if (sink.gone) return // the close cancelled the turn: what it produced is nobody's
    const now = Date.now()
    for (; counted < state.count; counted++) context.tracker.token(now)
  }
}

/**
 * Server-sent events. The headers wait for the turn's first token, so that a turn that fails
 * before it (a prompt that can never fit the KV pool) is answered with its own status and error
 * body, as a non-streamed one. Each chunk is formatted only when it is about to be written: once
 * the client is gone, the chunks the turn produced meanwhile are dropped, not formatted.
 */
async function streamTurn(context: CompletionContext, job: CompletionJob, turn: Turn, sink: ResponseSink): Promise<number> {
  const chunks = turn[Symbol.asyncIterator]()
  let next = await chunks.next()
  if (next.done === true) {
    const result = await turn.done
    if (result.finishReason === 'failed' && !sink.gone) throw turnFailed(context, job, result)
  }
  if (sink.gone) {
    await chunks.return?.()
    return 499
  }
  const shape = shapeOf(context, job, true)
  const usage = job.includeUsage ? { usage: null } : {}
  const event = (choices: object[], extra: object = usage): string => `data: ${JSON.stringify({ ...shape, choices, ...extra })}\n\n`
  sink.res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' })
  if (job.kind === 'chat') await sink.write(event([choiceDelta(job, '', true, null)]))
  const logprobs = new LogprobWriter(job)
  // A token whose text is held back (part of a character, a possible stop string) sends its
  // log-probability with the next chunk that has text.
  let pending: TokenLogprob[] = []
  let sent = ''
  // A turn with tools, or whose template thinks between tags, streams what its text parses into:
  // reasoning, content, and each call's deltas.
  const plan = outputPlanOf(turn)
  const parser = plan === null ? null : new OutputParser(plan)
  const sendParsed = async (reasoning: string, content: string, calls: ToolCallDelta[]): Promise<void> => {
    if (reasoning.length === 0 && content.length === 0 && calls.length === 0) return
    await sink.write(event([choiceDelta(job, content.length > 0 ? content : null, false, null, logprobs.shape(pending), calls, reasoning)]))
    pending = []
  }
  const send = async (text: string): Promise<void> => {
    sent += text
    if (parser !== null) {
      const piece = parser.push(text)
      return sendParsed(piece.reasoning, piece.content, piece.calls)
    }
    await sink.write(event([choiceDelta(job, text, false, null, logprobs.shape(pending))]))
    pending = []
  }
  for (; next.done !== true; next = await chunks.next()) {
    if (sink.gone) break
    const chunk = next.value
    context.tracker.token(Date.now())
    if (chunk.logprob !== undefined) pending.push(chunk.logprob)
    if (chunk.text.length > 0) await send(chunk.text)
  }
  if (sink.gone) {
    await chunks.return?.()
    await turn.done
    return 499
  }
  const result = await turn.done
  // Text the turn's end released after its chunk was read (a held-back partial stop string).
  if (result.text.length > sent.length && result.text.startsWith(sent)) await send(result.text.slice(sent.length))
  if (parser !== null) {
    const last = parser.finish()
    await sendParsed(last.reasoning, last.content, last.calls)
  }
  const called = parser !== null && parser.result().toolCalls.length > 0
  if (result.finishReason === 'failed') {
    await sink.write(`data: ${JSON.stringify(turnFailed(context, job, result).body())}\n\n`)
  } else {
    const rest = pending.length > 0 ? logprobs.shape(pending) : null
    await sink.write(event([choiceDelta(job, job.kind === 'chat' ? null : '', false, finishReasonOf(result.finishReason, called), rest)]))
    if (job.includeUsage) await sink.write(event([], { usage: usageOf(result) }))
  }
  sink.end('data: [DONE]\n\n')
  return sink.gone ? 499 : 200
}
