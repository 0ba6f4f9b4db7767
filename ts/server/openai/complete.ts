// One completion request, from its checked job to the HTTP response: a chat turn (the model's
// chat template) or a plain completion, answered as one JSON object or streamed as server-sent
// events. A client that goes away cancels its turn at once (its KV is freed in the next step).

import { randomBytes } from 'node:crypto'
import type { ServerResponse } from 'node:http'

import type { Engine } from '../../engine'
import { OrtexError } from '../../errors'
import type { Turn } from '../../turn'
import type { FinishReason, TurnResult } from '../../types'
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

function startTurn(context: CompletionContext, job: CompletionJob): Turn {
  const { engine } = context
  if (job.kind === 'chat') {
    const turn = { ...job.turn }
    if (turn.maxGeneratedTokens === undefined && context.defaultMaxTokens !== undefined) {
      turn.maxGeneratedTokens = context.defaultMaxTokens
    }
    return engine.chat(job.messages!, turn)
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

function choiceDelta(job: CompletionJob, text: string | null, role: boolean, finish: OpenAiFinishReason | null): object {
  if (job.kind === 'completion') return { index: 0, text: text ?? '', logprobs: null, finish_reason: finish }
  const delta: Record<string, string> = {}
  if (role) delta.role = 'assistant'
  if (text !== null) delta.content = text
  return { index: 0, delta, logprobs: null, finish_reason: finish }
}

/** Runs the job; resolves with the status code sent once the response has ended. */
export async function complete(context: CompletionContext, job: CompletionJob, res: ServerResponse): Promise<number> {
  let turn: Turn
  try {
    turn = startTurn(context, job)
  } catch (error) {
    context.tracker.end(0, 0)
    throw apiErrorOf(error)
  }
  // The client went away: cancel now, not when the next write fails.
  const cancel = (): void => void turn.cancel()
  res.on('close', cancel)
  try {
    return job.stream ? await streamTurn(context, job, turn, res) : await answerTurn(context, job, turn, res)
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
  const choice =
    job.kind === 'chat'
      ? { index: 0, message: { role: 'assistant', content: result.text, refusal: null }, logprobs: null, finish_reason: finish }
      : { index: 0, text: result.text, logprobs: null, finish_reason: finish }
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
  for await (const chunk of turn) {
    context.tracker.token(Date.now())
    if (chunk.text.length > 0) await write(res, event([choiceDelta(job, chunk.text, false, null)]))
  }
  const result = await turn.done
  if (res.destroyed) return 499
  if (result.finishReason === 'failed') {
    await write(res, `data: ${JSON.stringify(turnFailed(result).body())}\n\n`)
  } else {
    await write(res, event([choiceDelta(job, job.kind === 'chat' ? null : '', false, finishReasonOf(result.finishReason))]))
    if (job.includeUsage) await write(res, event([], { usage: usageOf(result) }))
  }
  await write(res, 'data: [DONE]\n\n')
  res.end()
  return 200
}
