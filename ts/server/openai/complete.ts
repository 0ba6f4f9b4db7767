// One completion request, from its checked job to the HTTP response: a chat turn (the model's
// chat template) or a plain completion, answered as one JSON object or streamed as server-sent
// events. A client that goes away cancels its turn at once (its KV is freed in the next step).

import { randomBytes } from 'node:crypto'
import type { ServerResponse } from 'node:http'

import type { Engine } from '../../engine'
import { OrtexError } from '../../errors'
import type { Turn } from '../../turn'
import type { FinishReason, TokenLogprob, TurnResult } from '../../types'
import type { CompletionTracker } from '../metrics'
import { ApiError } from './errors'
import type { CompletionJob } from './parse'

export type OpenAiFinishReason = 'stop' | 'length'

export interface CompletionContext {
  engine: Engine
  /** The name /v1/models lists; requests name it as `model`. */
  modelName: string
  /** maxGeneratedTokens of a chat completion that sets neither max_tokens nor max_completion_tokens
   *  (undefined: until the session limit). */
  defaultMaxTokens: number | undefined
  tracker: CompletionTracker
}

interface Usage {
  prompt_tokens: number
  completion_tokens: number
  total_tokens: number
  prompt_tokens_details: { cached_tokens: number }
}

export function finishReasonOf(reason: FinishReason): OpenAiFinishReason {
  return reason === 'max-generated-tokens' || reason === 'max-session-tokens' ? 'length' : 'stop'
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
    return engine.chatAsync(job.messages!, turn)
  }
  return engine.generate(job.prompt!, job.turn)
}

/** Writes `data`, waiting while the socket's buffer is full; a closed response takes nothing. */
function write(res: ServerResponse, data: string): Promise<void> | void {
  if (res.destroyed || res.writableEnded) return
  if (res.write(data)) return
  return new Promise<void>((resolve) => {
    const done = (): void => {
      res.off('drain', done)
      res.off('close', done)
      resolve()
    }
    res.on('drain', done)
    res.on('close', done)
  })
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body)
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) })
  res.end(text)
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
 *  parallel lists. Each token's text is its own detokenization. */
class LogprobWriter {
  private textOffset = 0

  constructor(
    private readonly engine: Engine,
    private readonly job: CompletionJob,
  ) {}

  private text(token: number): string {
    try {
      return this.engine.detokenize([token])
    } catch {
      return ''
    }
  }

  shape(entries: TokenLogprob[]): object | null {
    if (this.job.logprobs === null) return null
    if (this.job.kind === 'chat') {
      const item = (token: number, logprob: number) => {
        const text = this.text(token)
        return { token: text, logprob, bytes: Array.from(Buffer.from(text, 'utf8')) }
      }
      return {
        content: entries.map((e) => ({ ...item(e.token, e.logprob), top_logprobs: e.top.map((t) => item(t.token, t.logprob)) })),
        refusal: null,
      }
    }
    const tokens = entries.map((e) => this.text(e.token))
    const offsets = tokens.map((t) => {
      const at = this.textOffset
      this.textOffset += t.length
      return at
    })
    return {
      tokens,
      token_logprobs: entries.map((e) => e.logprob),
      top_logprobs: entries.map((e) => Object.fromEntries(e.top.map((t) => [this.text(t.token), t.logprob]))),
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
): object {
  if (job.kind === 'completion') return { index: 0, text: text ?? '', logprobs, finish_reason: finish }
  const delta: Record<string, string> = {}
  if (role) delta.role = 'assistant'
  if (text !== null) delta.content = text
  return { index: 0, delta, logprobs, finish_reason: finish }
}

/** Runs the job; resolves with the status code sent once the response has ended. */
export async function complete(context: CompletionContext, job: CompletionJob, res: ServerResponse): Promise<number> {
  let turn: Turn
  try {
    turn = await startTurn(context, job)
  } catch (error) {
    context.tracker.end(0, 0)
    throw apiErrorOf(error)
  }
  // The client went away: cancel now, not when the next write fails (it may have gone while the
  // template rendered).
  const cancel = (): void => void turn.cancel()
  res.on('close', cancel)
  if (res.destroyed) cancel()
  try {
    return job.stream ? await streamTurn(context, job, turn, res) : await answerTurn(context, job, turn, res)
  } catch (error) {
    turn.cancel() // whatever went wrong here, the turn stops generating for nobody
    throw error
  } finally {
    res.off('close', cancel)
    const result = await turn.done
    context.tracker.end(result.usage.promptTokens, result.usage.generatedTokens)
  }
}

async function answerTurn(context: CompletionContext, job: CompletionJob, turn: Turn, res: ServerResponse): Promise<number> {
  for await (const chunk of turn) {
    void chunk
    context.tracker.token(Date.now())
  }
  const result = await turn.done
  if (result.finishReason === 'failed') throw turnFailed(result)
  if (res.destroyed) return 499
  const shape = shapeOf(context, job, false)
  const finish = finishReasonOf(result.finishReason)
  const logprobs = new LogprobWriter(context.engine, job).shape(result.logprobs ?? [])
  const choice =
    job.kind === 'chat'
      ? { index: 0, message: { role: 'assistant', content: result.text, refusal: null }, logprobs, finish_reason: finish }
      : { index: 0, text: result.text, logprobs, finish_reason: finish }
  sendJson(res, 200, { ...shape, choices: [choice], usage: usageOf(result) })
  return 200
}

function turnFailed(result: TurnResult): ApiError {
  return new ApiError(500, `the turn failed (${result.errorCode})`, 'server_error', null, result.errorCode)
}

async function streamTurn(context: CompletionContext, job: CompletionJob, turn: Turn, res: ServerResponse): Promise<number> {
  const shape = shapeOf(context, job, true)
  const usage = job.includeUsage ? { usage: null } : {}
  const event = (choices: object[], extra: object = usage): string => `data: ${JSON.stringify({ ...shape, choices, ...extra })}\n\n`
  res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache', connection: 'keep-alive' })
  if (job.kind === 'chat') await write(res, event([choiceDelta(job, '', true, null)]))
  const logprobs = new LogprobWriter(context.engine, job)
  // A token whose text is held back (part of a character, a possible stop string) sends its
  // log-probability with the next chunk that has text.
  let pending: TokenLogprob[] = []
  let sent = ''
  const send = async (text: string): Promise<void> => {
    await write(res, event([choiceDelta(job, text, false, null, logprobs.shape(pending))]))
    pending = []
    sent += text
  }
  for await (const chunk of turn) {
    context.tracker.token(Date.now())
    if (chunk.logprob !== undefined) pending.push(chunk.logprob)
    if (chunk.text.length > 0) await send(chunk.text)
  }
  const result = await turn.done
  if (res.destroyed) return 499
  // Text the turn's end released after its chunk was read (a held-back partial stop string).
  if (result.text.length > sent.length && result.text.startsWith(sent)) await send(result.text.slice(sent.length))
  if (result.finishReason === 'failed') {
    await write(res, `data: ${JSON.stringify(turnFailed(result).body())}\n\n`)
  } else {
    const rest = pending.length > 0 ? logprobs.shape(pending) : null
    await write(res, event([choiceDelta(job, job.kind === 'chat' ? null : '', false, finishReasonOf(result.finishReason), rest)]))
    if (job.includeUsage) await write(res, event([], { usage: usageOf(result) }))
  }
  await write(res, 'data: [DONE]\n\n')
  res.end()
  return 200
}
