// The OpenAI-compatible HTTP API, spoken to by the official `openai` client over real HTTP: chat
// and completions, streamed and not, stop strings, seeds, 16 concurrent streams batched together,
// a client that aborts mid-stream, every error case, /metrics parsed as Prometheus text, and the
// WebSocket sessions still on the same port. On the simulated model (deterministic) and on the
// tiny ONNX model.
import { cpSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import OpenAI from 'openai'
import parsePrometheusTextFormat from 'parse-prometheus-text-format'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import WebSocket from 'ws'
import { ortex } from '../helpers/backends'
import { refusedUpgrade } from '../helpers/util'
import { useTinyModels } from '../helpers/tiny-models'

const { Engine, startServer } = ortex('native')
type Server = Awaited<ReturnType<typeof startServer>>
type EngineT = ReturnType<typeof Engine.simulated>

const MODEL = 'ortex-simulated'
const messages = [
  { role: 'system' as const, content: 'You are terse.' },
  { role: 'user' as const, content: 'Tell me about rivers.' },
]

async function until(condition: () => boolean, what: string, timeoutMs = 5000): Promise<void> {
  const start = Date.now()
  while (!condition()) {
    if (Date.now() - start > timeoutMs) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 5))
  }
}

async function raw(server: Server, route: string, init: RequestInit & { json?: unknown } = {}): Promise<{ status: number; body: any }> {
  const headers: Record<string, string> = { ...(init.headers as Record<string, string>) }
  let body = init.body
  if (init.json !== undefined) {
    body = JSON.stringify(init.json)
    headers['content-type'] ??= 'application/json'
  }
  const response = await fetch(`${server.url}${route}`, { ...init, headers, body })
  const text = await response.text()
  let parsed: unknown = text
  try {
    parsed = JSON.parse(text)
  } catch {
    // not JSON (metrics)
  }
  return { status: response.status, body: parsed }
}

function expectOpenAiError(result: { status: number; body: any }, status: number, param?: string): void {
  expect(result.status, JSON.stringify(result.body)).toBe(status)
  expect(typeof result.body.error.message).toBe('string')
  expect(typeof result.body.error.type).toBe('string')
  expect(result.body.error).toHaveProperty('param')
  expect(result.body.error).toHaveProperty('code')
  if (param !== undefined) expect(result.body.error.param).toBe(param)
}

describe('the OpenAI-compatible API on the simulated model', () => {
  let engine: EngineT
  let server: Server
  let client: OpenAI

  beforeAll(async () => {
    engine = Engine.simulated({ seed: 11, maxBatchSize: 32 })
    server = await startServer(engine, { port: 0 })
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
  })
  afterAll(async () => {
    await server.close()
    await engine.close()
  })

  it('lists its model and answers /health', async () => {
    const models = await client.models.list()
    expect(models.data.map((m) => m.id)).toEqual([MODEL])
    expect(await raw(server, '/health')).toEqual({ status: 200, body: { status: 'ok' } })
  })

  it('a chat completion is the in-process chat turn, with OpenAI usage and finish_reason', async () => {
    const completion = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 12 })
    const turn = await engine.chat(messages, { maxGeneratedTokens: 12 }).done
    expect(completion.object).toBe('chat.completion')
    expect(completion.model).toBe(MODEL)
    expect(completion.choices).toHaveLength(1)
    expect(completion.choices[0]!.message).toMatchObject({ role: 'assistant', content: turn.text })
    expect(completion.choices[0]!.finish_reason).toBe('length')
    const promptTokens = engine.tokenize(engine.applyChatTemplate(messages)).length
    expect(completion.usage).toMatchObject({
      prompt_tokens: promptTokens,
      completion_tokens: 12,
      total_tokens: promptTokens + 12,
    })
    // The in-process turn ran second on the same prompt: the prefix cache served its full blocks,
    // and a repeated HTTP request reports them as OpenAI's cached_tokens.
    expect(completion.usage!.prompt_tokens_details!.cached_tokens).toBe(0)
    const again = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 12 })
    const cached = again.usage!.prompt_tokens_details!.cached_tokens!
    expect(cached).toBe(turn.usage.cachedPromptTokens)
    expect(cached).toBeGreaterThan(0)
    expect(cached % engine.config.blockSize).toBe(0)
    expect(again.choices[0]!.message.content).toBe(turn.text)
  })

  it('streams the same text as server-sent events, with usage when asked', async () => {
    const whole = await client.chat.completions.create({ model: MODEL, messages, max_completion_tokens: 20 })
    const stream = await client.chat.completions.create({
      model: MODEL,
      messages,
      max_completion_tokens: 20,
      stream: true,
      stream_options: { include_usage: true },
    })
    let text = ''
    let role: string | undefined
    const finishes: (string | null)[] = []
    let usage: OpenAI.CompletionUsage | null | undefined
    for await (const chunk of stream) {
      expect(chunk.object).toBe('chat.completion.chunk')
      if (chunk.choices.length === 0) {
        usage = chunk.usage
        continue
      }
      role ??= chunk.choices[0]!.delta.role
      text += chunk.choices[0]!.delta.content ?? ''
      finishes.push(chunk.choices[0]!.finish_reason)
    }
    expect(role).toBe('assistant')
    expect(text).toBe(whole.choices[0]!.message.content)
    expect(finishes.at(-1)).toBe('length')
    expect(finishes.slice(0, -1).every((f) => f === null)).toBe(true)
    expect(usage).toMatchObject({ completion_tokens: 20, prompt_tokens: whole.usage!.prompt_tokens })
  })

  it('completions: a raw prompt, OpenAI default of 16 tokens, streamed and not', async () => {
    const completion = await client.completions.create({ model: MODEL, prompt: 'Once upon a time' })
    const turn = await engine.generate('Once upon a time', { maxGeneratedTokens: 16 }).done
    expect(completion.object).toBe('text_completion')
    expect(completion.choices[0]).toMatchObject({ text: turn.text, finish_reason: 'length', index: 0 })
    expect(completion.usage).toMatchObject({ prompt_tokens: turn.usage.promptTokens, completion_tokens: 16 })
    const stream = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', stream: true })
    let text = ''
    for await (const chunk of stream) text += chunk.choices[0]?.text ?? ''
    expect(text).toBe(turn.text)
    const tokens = await client.completions.create({ model: MODEL, prompt: Array.from(engine.tokenize('Once upon a time')), max_tokens: 16 })
    expect(tokens.choices[0]!.text).toBe(turn.text)
  })

  it('a stop string ends the text before it, with finish_reason stop', async () => {
    const full = (await client.chat.completions.create({ model: MODEL, messages, max_tokens: 24 })).choices[0]!.message.content!
    const word = full.trim().split(' ')[3]!
    for (const stop of [word, [word, 'zzzz']]) {
      const stopped = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 24, stop })
      const content = stopped.choices[0]!.message.content!
      expect(stopped.choices[0]!.finish_reason).toBe('stop')
      expect(full.startsWith(content)).toBe(true)
      expect(content.includes(word)).toBe(false)
    }
  })

  it('a seed makes sampling reproducible; penalties and extensions pass through', async () => {
    const body = { model: MODEL, messages, max_tokens: 16, temperature: 1.2, top_p: 0.9, seed: 42 }
    const [a, b] = await Promise.all([client.chat.completions.create(body), client.chat.completions.create(body)])
    expect(a.choices[0]!.message.content).toBe(b.choices[0]!.message.content)
    const other = await client.chat.completions.create({ ...body, seed: 43 })
    expect(other.choices[0]!.message.content).not.toBe(a.choices[0]!.message.content)
    const inProcess = await engine.chat(messages, { maxGeneratedTokens: 16, temperature: 1.2, topP: 0.9, seed: 42 }).done
    expect(a.choices[0]!.message.content).toBe(inProcess.text)
    const penalized = { ...body, presence_penalty: 1.5, frequency_penalty: 0.5 }
    const viaHttp = await client.chat.completions.create(penalized)
    const direct = await engine.chat(messages, { maxGeneratedTokens: 16, temperature: 1.2, topP: 0.9, seed: 42, presencePenalty: 1.5, frequencyPenalty: 0.5 }).done
    expect(viaHttp.choices[0]!.message.content).toBe(direct.text)
    const extended = await raw(server, '/v1/chat/completions', {
      method: 'POST',
      json: { model: MODEL, messages, max_tokens: 8, temperature: 1, seed: 3, min_p: 0.9, top_k: 4, repetition_penalty: 1.3 },
    })
    const directExtended = await engine.chat(messages, { maxGeneratedTokens: 8, temperature: 1, seed: 3, minP: 0.9, topK: 4, repetitionPenalty: 1.3 }).done
    expect(extended.body.choices[0].message.content).toBe(directExtended.text)
  })

  it('logprobs: the sampled token and its top alternatives, per token, streamed and not', async () => {
    const completion = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 6, logprobs: true, top_logprobs: 3 })
    const turn = await engine.chat(messages, { maxGeneratedTokens: 6, logprobs: 3 }).done
    const content = completion.choices[0]!.logprobs!.content!
    expect(content).toHaveLength(6)
    content.forEach((entry, i) => {
      const expected = turn.logprobs![i]!
      expect(entry.logprob).toBe(expected.logprob)
      expect(entry.token).toBe(engine.detokenize([expected.token]))
      expect(entry.bytes).toEqual(Array.from(Buffer.from(entry.token, 'utf8')))
      expect(entry.top_logprobs.map((t) => t.logprob)).toEqual(expected.top.map((t) => t.logprob))
    })
    expect(content.map((e) => e.token).join('')).toBe(completion.choices[0]!.message.content)
    const stream = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 6, logprobs: true, stream: true })
    const streamed: number[] = []
    for await (const chunk of stream) {
      for (const entry of chunk.choices[0]?.logprobs?.content ?? []) {
        expect(entry.top_logprobs).toEqual([])
        streamed.push(entry.logprob)
      }
    }
    expect(streamed).toEqual(turn.logprobs!.map((e) => e.logprob))
    const plain = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 2 })
    expect(plain.choices[0]!.logprobs).toBeNull()
    const legacy = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 5, logprobs: 2 })
    const legacyTurn = await engine.generate('Once upon a time', { maxGeneratedTokens: 5, logprobs: 2 }).done
    const lp = legacy.choices[0]!.logprobs!
    expect(lp.token_logprobs).toEqual(legacyTurn.logprobs!.map((e) => e.logprob))
    expect(lp.tokens!.join('')).toBe(legacy.choices[0]!.text)
    expect(lp.top_logprobs!.every((t) => Object.keys(t).length <= 2)).toBe(true)
    expect(lp.text_offset![0]).toBe(0)
  })

  it('16 concurrent streams are batched together and each gets its own text', async () => {
    const stepsBefore = engine.stats().steps
    const prompts = Array.from({ length: 16 }, (_, i) => [{ role: 'user' as const, content: `question number ${i}` }])
    const streamed = await Promise.all(
      prompts.map(async (m) => {
        const stream = await client.chat.completions.create({ model: MODEL, messages: m, max_tokens: 32, stream: true })
        let text = ''
        for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? ''
        return text
      }),
    )
    const steps = engine.stats().steps - stepsBefore
    // One at a time would take at least 16 x 32 decode steps.
    expect(steps).toBeLessThan(16 * 32 / 2)
    for (let i = 0; i < 16; i++) {
      expect(streamed[i]).toBe(await engine.chat(prompts[i]!, { maxGeneratedTokens: 32 }).text())
    }
    await until(() => engine.stats().activeRequests === 0, 'requests to close')
  })

  it('a client aborting mid-stream cancels its turn and frees its request', async () => {
    const controller = new AbortController()
    const stream = await client.chat.completions.create(
      { model: MODEL, messages, max_tokens: 100_000, stream: true },
      { signal: controller.signal },
    )
    let chunks = 0
    try {
      for await (const chunk of stream) {
        void chunk
        if (++chunks === 5) controller.abort()
      }
    } catch {
      // The client may end the iteration quietly or with an abort error.
    }
    expect(chunks).toBeGreaterThanOrEqual(5)
    expect(chunks).toBeLessThan(1000)
    await until(() => engine.stats().activeRequests === 0, 'the aborted turn to free its request')
    // Its KV blocks are back (blocks only the prefix cache holds count as free).
    expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
    const generated = engine.stats().generatedTokens
    await new Promise((resolve) => setTimeout(resolve, 50))
    expect(engine.stats().generatedTokens).toBe(generated)
  })

  it('refuses what it does not support in OpenAI error shape, through the client too', async () => {
    for (const [extra, param] of [
      [{ n: 2 }, 'n'],
      [{ functions: [{ name: 'f', parameters: {} }] }, 'functions'],
      [{ tools: [{ type: 'function', function: { name: 'not a name' } }] }, 'tools[0].function.name'],
      [{ tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: { type: 'function', function: { name: 'g' } } }, 'tool_choice'],
      [{ tool_choice: 'required' }, 'tool_choice'],
      [{ response_format: { type: 'xml' } }, 'response_format.type'],
      [{ response_format: { type: 'json_schema', json_schema: { schema: {} } } }, 'response_format.json_schema.name'],
      [{ top_logprobs: 2 }, 'top_logprobs'],
      [{ logprobs: true, top_logprobs: 21 }, 'top_logprobs'],
      [{ logit_bias: { '5': 1 } }, 'logit_bias'],
    ] as const) {
      const error = await client.chat.completions.create({ model: MODEL, messages, ...(extra as object) } as never).catch((e: unknown) => e)
      expect(error).toBeInstanceOf(OpenAI.BadRequestError)
      expect((error as InstanceType<typeof OpenAI.BadRequestError>).param).toBe(param)
    }
    const missing = await client.chat.completions.create({ model: 'gpt-4o', messages }).catch((e: unknown) => e)
    expect(missing).toBeInstanceOf(OpenAI.NotFoundError)
    expect((missing as InstanceType<typeof OpenAI.NotFoundError>).code).toBe('model_not_found')
  })

  it('answers every malformed request with a 4xx in OpenAI error shape and keeps serving', async () => {
    const post = (body: string | undefined, headers: Record<string, string> = { 'content-type': 'application/json' }) =>
      raw(server, '/v1/chat/completions', { method: 'POST', body, headers })
    expectOpenAiError(await post('{"model": '), 400)
    expectOpenAiError(await post('[]'), 400, 'body')
    expectOpenAiError(await post('null'), 400, 'body')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, max_tokenz: 3 })), 400, 'max_tokenz')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, temperature: 'hot' })), 400, 'temperature')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, temperature: 3 })), 400, 'temperature')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, top_p: 0 })), 400, 'top_p')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, max_tokens: 0 })), 400, 'max_tokens')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, max_tokens: 1.5 })), 400, 'max_tokens')
    // Each field is checked when sent, also when another one would take its place.
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, max_tokens: 'garbage', max_completion_tokens: 4 })), 400, 'max_tokens')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, max_tokens: 4, max_completion_tokens: 0 })), 400, 'max_completion_tokens')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, seed: 'x' })), 400, 'seed')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, stop: ['a', 'b', 'c', 'd', 'e'] })), 400, 'stop')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, stop: 5 })), 400, 'stop')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, presence_penalty: -3 })), 400, 'presence_penalty')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, stream: 'yes' })), 400, 'stream')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, stream_options: { include_usage: true } })), 400, 'stream_options')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, stream: true, stream_options: { foo: 1 } })), 400, 'stream_options.foo')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL })), 400, 'messages')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages: [] })), 400, 'messages')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages: [{ role: 'wizard', content: 'x' }] })), 400, 'messages[0].role')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: [{ type: 'image_url' }] }] })), 400, 'messages[0].content[0]')
    expectOpenAiError(await post(JSON.stringify({ messages })), 400, 'model')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, user: 5 })), 400, 'user')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages, logprobs: 'yes' })), 400, 'logprobs')
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages }), { 'content-type': 'text/plain' }), 415)
    expectOpenAiError(await post(JSON.stringify({ model: MODEL, messages }), {}), 415)
    expectOpenAiError(await post('x'.repeat((1 << 20) + 1)), 413)
    const completions = (json: unknown) => raw(server, '/v1/completions', { method: 'POST', json })
    expectOpenAiError(await completions({ model: MODEL }), 400, 'prompt')
    expectOpenAiError(await completions({ model: MODEL, prompt: '' }), 400, 'prompt')
    expectOpenAiError(await completions({ model: MODEL, prompt: ['a', 'b'] }), 400, 'prompt')
    expectOpenAiError(await completions({ model: MODEL, prompt: 'x', echo: true }), 400, 'echo')
    expectOpenAiError(await completions({ model: MODEL, prompt: 'x', logprobs: 6 }), 400, 'logprobs')
    expectOpenAiError(await completions({ model: MODEL, prompt: 'x', logprobs: true }), 400, 'logprobs')
    expectOpenAiError(await completions({ model: MODEL, prompt: [engine.config.vocabSize] }), 400)
    expectOpenAiError(await raw(server, '/v1/chat/completions'), 405)
    expectOpenAiError(await raw(server, '/v1/models', { method: 'POST', json: {} }), 405)
    expectOpenAiError(await raw(server, '/v2/nothing'), 404)
    // Still serving.
    const ok = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 2 })
    expect(ok.choices[0]!.finish_reason).toBe('length')
  })

  it('refuses sampling options by the rules the library applies: same code, the field named', async () => {
    const post = (json: unknown) => raw(server, '/v1/chat/completions', { method: 'POST', json })
    const cases: Array<[string, string, number]> = [
      ['top_p', 'topP', 0],
      ['top_p', 'topP', 1.5],
      ['min_p', 'minP', 1.5],
      ['repetition_penalty', 'repetitionPenalty', 0],
      ['repetition_penalty', 'repetitionPenalty', 101],
      ['presence_penalty', 'presencePenalty', -3],
      ['frequency_penalty', 'frequencyPenalty', 2.5],
    ]
    const before = engine.stats().activeRequests
    for (const [field, option, value] of cases) {
      let library: (Error & { code?: string }) | null = null
      try {
        engine.chat(messages, { [option]: value, maxGeneratedTokens: 1 })
      } catch (error) {
        library = error as Error & { code?: string }
      }
      expect(library?.code, `${option} ${value}`).toBe('INVALID_ARGUMENT')
      expect(library!.message.startsWith(`${option} `), library!.message).toBe(true)
      const answer = await post({ model: MODEL, messages, max_tokens: 1, [field]: value })
      expectOpenAiError(answer, 400, field)
      expect(answer.body.error).toMatchObject({ code: 'invalid_value', type: 'invalid_request_error' })
      // The core's message, naming the request's field instead of the option.
      expect(answer.body.error.message).toBe(field + library!.message.slice(option.length))
    }
    expect(engine.stats().activeRequests).toBe(before)
    const accepted = await post({ model: MODEL, messages, max_tokens: 1, top_p: 1, min_p: 0, repetition_penalty: 100 })
    expect(accepted.status).toBe(200)
  })

  it('a client that hangs up mid-body or mid-headers is forgotten, and the server keeps serving', async () => {
    const { connect } = await import('node:net')
    for (const bytes of [
      `POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model":`,
      'POST /v1/chat/completions HTTP/1.1\r\ncontent-ty',
      'GARBAGE\r\n\r\n',
    ]) {
      const socket = connect(server.port, server.host)
      await new Promise((resolve) => socket.once('connect', resolve))
      socket.write(bytes)
      await new Promise((resolve) => setTimeout(resolve, 20))
      socket.destroy()
    }
    await new Promise((resolve) => setTimeout(resolve, 20))
    const ok = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 2 })
    expect(ok.choices[0]!.finish_reason).toBe('length')
  })

  it('/metrics parses as Prometheus text and counts what was served', async () => {
    const before = await scrape(server)
    const completion = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 7 })
    const after = await scrape(server)
    expect(value(after, 'ortex_generation_tokens_total') - value(before, 'ortex_generation_tokens_total')).toBe(7)
    expect(value(after, 'ortex_prompt_tokens_total') - value(before, 'ortex_prompt_tokens_total')).toBe(completion.usage!.prompt_tokens)
    const requests = after.find((m) => m.name === 'ortex_http_requests_total')!
    expect(requests.type).toBe('COUNTER')
    const ok = requests.metrics.find((m: any) => m.labels.route === '/v1/chat/completions' && m.labels.status === '200')
    expect(Number(ok.value)).toBeGreaterThan(0)
    const bad = requests.metrics.find((m: any) => m.labels.route === '/v1/chat/completions' && m.labels.status === '400')
    expect(Number(bad.value)).toBeGreaterThan(0)
    for (const name of ['ortex_time_to_first_token_seconds', 'ortex_inter_token_latency_seconds']) {
      const histogram = after.find((m) => m.name === name)!
      expect(histogram.type).toBe('HISTOGRAM')
      expect(Number(histogram.metrics[0].count)).toBeGreaterThan(0)
    }
    expect(value(after, 'ortex_requests_running')).toBe(0)
    expect(value(after, 'ortex_requests_waiting')).toBe(0)
    expect(value(after, 'ortex_kv_blocks_total')).toBe(engine.stats().totalBlocks)
    expect(value(after, 'ortex_kv_blocks_used')).toBe(engine.stats().totalBlocks - engine.stats().freeBlocks)
    expect(after.some((m) => m.name === 'ortex_kv_blocks_cached')).toBe(true)
  })

  it('WebSocket sessions share the port', async () => {
    const ws = new WebSocket(server.url.replace('http://', 'ws://'))
    const events: any[] = []
    await new Promise<void>((resolve, reject) => {
      ws.on('open', () => ws.send(JSON.stringify({ type: 'input_text.append', text: 'hi', final: true })))
      ws.on('message', (data) => {
        events.push(JSON.parse(String(data)))
        if (events.some((e) => e.type === 'session.created')) resolve()
      })
      ws.on('error', reject)
    })
    ws.close()
    expect(events[0].type).toBe('session.created')
  })
})

async function scrape(server: Server): Promise<any[]> {
  const response = await fetch(`${server.url}/metrics`)
  expect(response.headers.get('content-type')).toContain('text/plain')
  return parsePrometheusTextFormat(await response.text()) as any[]
}

function value(metrics: any[], name: string): number {
  const metric = metrics.find((m) => m.name === name)
  if (metric === undefined) throw new Error(`no metric ${name}`)
  return Number(metric.metrics[0].value)
}

/** A session that asks for two tokens: the protocol the server selected and its response.done. */
async function wsSession(url: string, protocols: string[] = [], options: WebSocket.ClientOptions = {}): Promise<{ protocol: string; done: any }> {
  const ws = new WebSocket(url, protocols, options)
  const done = await new Promise<any>((resolve, reject) => {
    ws.on('open', () => {
      ws.send(JSON.stringify({ type: 'session.update', session: { max_output_tokens: 2 } }))
      ws.send(JSON.stringify({ type: 'input_text.append', text: 'hi', final: true }))
    })
    ws.on('message', (data) => {
      const event = JSON.parse(String(data))
      if (event.type === 'response.done') resolve(event)
    })
    ws.on('error', reject)
  })
  const protocol = ws.protocol
  ws.close()
  return { protocol, done }
}

describe('OpenAI error shapes', () => {
  const post = (server: Server, route: string, json: unknown) => raw(server, route, { method: 'POST', json })
  const longText = 'word '.repeat(100)

  it('a prompt longer than the context: 400 context_length_exceeded on messages / prompt', async () => {
    const engine = Engine.simulated({ seed: 1, maxLength: 64 })
    const server = await startServer(engine, { port: 0 })
    try {
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
      const error = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: longText }] }).catch((e: unknown) => e)
      expect(error).toBeInstanceOf(OpenAI.BadRequestError)
      expect(error).toMatchObject({ status: 400, code: 'context_length_exceeded', param: 'messages', type: 'invalid_request_error' })
      expect((error as Error).message).toMatch(/maximum context length is 64 tokens/)
      const completion = await post(server, '/v1/completions', { model: MODEL, prompt: longText })
      expectOpenAiError(completion, 400, 'prompt')
      expect(completion.body.error).toMatchObject({ code: 'context_length_exceeded', type: 'invalid_request_error' })
      const streamed = await post(server, '/v1/completions', { model: MODEL, prompt: longText, stream: true })
      expectOpenAiError(streamed, 400, 'prompt')
      // Other invalid arguments keep their own code.
      const outside = await post(server, '/v1/completions', { model: MODEL, prompt: [engine.config.vocabSize] })
      expect(outside.body.error).toMatchObject({ code: 'invalid_argument', param: null })
    } finally {
      await server.close()
      await engine.close()
    }
  })

  it('a prompt that can never fit the KV pool: 400 context_length_exceeded, streamed or not, not a 500', async () => {
    const engine = Engine.simulated({ seed: 1, numBlocks: 8 })
    const server = await startServer(engine, { port: 0 })
    try {
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
      for (const stream of [false, true]) {
        const error = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: longText }], stream }).catch((e: unknown) => e)
        expect(error).toBeInstanceOf(OpenAI.BadRequestError)
        expect(error).toMatchObject({ status: 400, code: 'context_length_exceeded', param: 'messages' })
        expect((error as Error).message).toMatch(/KV cache of 128 token positions/)
        const completion = await post(server, '/v1/completions', { model: MODEL, prompt: longText, stream })
        expectOpenAiError(completion, 400, 'prompt')
        expect(completion.body.error.code).toBe('context_length_exceeded')
      }
      // What fits still streams.
      const ok = await client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 3, stream: true })
      let chunks = 0
      for await (const chunk of ok) chunks += chunk.choices.length
      expect(chunks).toBeGreaterThan(1)
    } finally {
      await server.close()
      await engine.close()
    }
  })

  it('429 at capacity carries Retry-After: 1', async () => {
    const engine = Engine.simulated({ seed: 1, maxRequests: 1, maxLength: 1 << 16 })
    const server = await startServer(engine, { port: 0 })
    const controller = new AbortController()
    try {
      const holding = await fetch(`${server.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model: MODEL, prompt: 'hold', max_tokens: 60_000, stream: true }),
        signal: controller.signal,
      })
      expect(holding.status).toBe(200)
      const response = await fetch(`${server.url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model: MODEL, prompt: 'x' }),
      })
      expect(response.status).toBe(429)
      expect(response.headers.get('retry-after')).toBe('1')
      expect((await response.json()).error.code).toBe('capacity_exhausted')
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
      const error = await client.completions.create({ model: MODEL, prompt: 'x' }).catch((e: unknown) => e)
      expect(error).toBeInstanceOf(OpenAI.RateLimitError)
      expect((error as InstanceType<typeof OpenAI.RateLimitError>).headers?.get('retry-after')).toBe('1')
    } finally {
      controller.abort()
      await server.close()
      await engine.close()
    }
  })
})

describe('/health', () => {
  it('answers 503 with the reason once the engine failed, and once it is closed', async () => {
    const engine = Engine.simulated({ seed: 2, faults: { fatalSteps: [0] } })
    const server = await startServer(engine, { port: 0 })
    try {
      expect(await raw(server, '/health')).toEqual({ status: 200, body: { status: 'ok' } })
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
      const failed = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 4 }).catch((e: unknown) => e)
      expect(failed).toBeInstanceOf(OpenAI.APIError)
      expect(engine.healthy).toBe(false)
      expect(engine.failureCode).toBe('engine-execution-failure')
      expect(await raw(server, '/health')).toEqual({
        status: 503,
        body: { status: 'unavailable', reason: 'the engine failed (engine-execution-failure)' },
      })
    } finally {
      await server.close()
      await engine.close()
    }
    const healthy = Engine.simulated({ seed: 3 })
    const closing = await startServer(healthy, { port: 0 })
    try {
      await healthy.close()
      expect(healthy.healthy).toBe(false)
      expect(await raw(closing, '/health')).toEqual({ status: 503, body: { status: 'unavailable', reason: 'the engine is closed' } })
    } finally {
      await closing.close()
    }
  })
})

describe('bearer auth', () => {
  it('needs the key on /v1 (compared in constant time), not on /health and /metrics', async () => {
    const engine = Engine.simulated({ seed: 1 })
    const server = await startServer(engine, { port: 0, apiKey: 'sk-right' })
    try {
      const wrong = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'sk-wrong', maxRetries: 0 })
      expect(await wrong.models.list().catch((e: unknown) => e)).toBeInstanceOf(OpenAI.AuthenticationError)
      expect((await raw(server, '/v1/models')).status).toBe(401)
      const right = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'sk-right', maxRetries: 0 })
      expect((await right.models.list()).data).toHaveLength(1)
      expect((await raw(server, '/health')).status).toBe(200)
      expect((await raw(server, '/metrics')).status).toBe(200)
      expect(server.host).toBe('127.0.0.1')
    } finally {
      await server.close()
      await engine.close()
    }
  })

  it('needs the key on WebSocket upgrades too: 401 before the WebSocket opens, the header or the subprotocol form', async () => {
    const engine = Engine.simulated({ seed: 1 })
    const server = await startServer(engine, { port: 0, apiKey: 'sk-right' })
    const url = server.url.replace('http://', 'ws://')
    try {
      for (const [protocols, options] of [
        [[], {}],
        [[], { headers: { authorization: 'Bearer sk-wrong' } }],
        [['ortex', 'ortex-api-key.sk-wrong'], {}],
      ] as const) {
        expect((await refusedUpgrade(url, [...protocols], options)).status).toBe(401)
      }
      expect(engine.stats().generatedTokens).toBe(0)
      expect(server.duplex.stats().connections).toBe(0)
      const byHeader = await wsSession(url, [], { headers: { authorization: 'Bearer sk-right' } })
      expect(byHeader.protocol).toBe('')
      const byProtocol = await wsSession(url, ['ortex', 'ortex-api-key.sk-right'])
      // Selected: `ortex`, never the entry that carries the key.
      expect(byProtocol.protocol).toBe('ortex')
      for (const done of [byHeader.done, byProtocol.done]) expect(done).toMatchObject({ status: 'completed', usage: { output_tokens: 2 } })
      // The HTTP API as before.
      expect((await raw(server, '/v1/models')).status).toBe(401)
      const right = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'sk-right', maxRetries: 0 })
      expect((await right.chat.completions.create({ model: MODEL, messages, max_tokens: 2 })).usage!.completion_tokens).toBe(2)
    } finally {
      await server.close()
      await engine.close()
    }
  })

  it('refuses bad server options', async () => {
    const engine = Engine.simulated()
    try {
      for (const options of [
        { port: -1 },
        { apiKey: '' },
        { apiKey: 5 },
        { maxBodyBytes: 1 },
        { nope: 1 },
        { modelName: '' },
        { duplex: { apiKey: 'k' } },
        { maxBufferedBytes: 1 },
        { sendStallMs: 0 },
      ]) {
        await expect(startServer(engine, options as never)).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
      }
    } finally {
      await engine.close()
    }
  })
})

describe('the OpenAI-compatible API on the tiny ONNX model', () => {
  const models = useTinyModels('openai', { plain: {} })
  let engine: EngineT
  let server: Server
  let client: OpenAI

  beforeAll(async () => {
    const dir = path.join(models.root(), 'chatml')
    cpSync(models.dirs.plain, dir, { recursive: true })
    writeFileSync(
      path.join(dir, 'chat_template.jinja'),
      "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}",
    )
    engine = await Engine.load(dir, { intraOpThreads: 1 })
    server = await startServer(engine, { port: 0 })
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
  })
  afterAll(async () => {
    await server.close()
    await engine.close()
  })

  it('serves chat and completions named after the folder, streamed and not, equal to in-process turns', async () => {
    expect((await client.models.list()).data[0]!.id).toBe('chatml')
    const chat = await client.chat.completions.create({ model: 'chatml', messages, max_tokens: 10 })
    const turn = await engine.chat(messages, { maxGeneratedTokens: 10 }).done
    expect(chat.choices[0]!.message.content).toBe(turn.text)
    expect(chat.usage!.completion_tokens).toBe(turn.usage.generatedTokens)
    const stream = await client.completions.create({ model: 'chatml', prompt: 'The river starts', max_tokens: 10, stream: true })
    let text = ''
    for await (const chunk of stream) text += chunk.choices[0]?.text ?? ''
    expect(text).toBe(await engine.generate('The river starts', { maxGeneratedTokens: 10 }).text())
  })

  it('a client that gives up on a non-streamed completion cancels it too', async () => {
    const generated = engine.stats().generatedTokens
    const controller = new AbortController()
    const request = client.chat.completions.create({ model: 'chatml', messages, max_tokens: 1_000_000 }, { signal: controller.signal })
    await until(() => engine.stats().generatedTokens > generated + 5, 'the completion to be generating')
    controller.abort()
    await expect(request).rejects.toThrow()
    await until(() => engine.stats().activeRequests === 0, 'the abandoned completion to be cancelled')
    expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
  })

  it('a folder without a chat template answers chat with a 400 naming it; completions still work', async () => {
    const plainEngine = await Engine.load(models.dirs.plain, { intraOpThreads: 1 })
    const plainServer = await startServer(plainEngine, { port: 0, modelName: 'plain' })
    try {
      const result = await raw(plainServer, '/v1/chat/completions', { method: 'POST', json: { model: 'plain', messages } })
      expectOpenAiError(result, 400, 'messages')
      expect(result.body.error.code).toBe('chat_template_missing')
      expect(result.body.error.message).toContain('chat_template')
      const plainClient = new OpenAI({ baseURL: `${plainServer.url}/v1`, apiKey: 'unused', maxRetries: 0 })
      const completion = await plainClient.completions.create({ model: 'plain', prompt: 'The river starts', max_tokens: 3 })
      expect(completion.usage!.completion_tokens).toBeGreaterThan(0)
    } finally {
      await plainServer.close()
      await plainEngine.close()
    }
  })

  it('16 concurrent streams share the model steps', async () => {
    const before = engine.executorStats()!
    const texts = await Promise.all(
      Array.from({ length: 16 }, async (_, i) => {
        const stream = await client.chat.completions.create({
          model: 'chatml',
          messages: [{ role: 'user', content: `river ${i}` }],
          max_tokens: 12,
          stream: true,
          stream_options: { include_usage: true },
        })
        let text = ''
        let tokens = 0
        for await (const chunk of stream) {
          text += chunk.choices[0]?.delta.content ?? ''
          if (chunk.usage) tokens = chunk.usage.completion_tokens
        }
        return { text, tokens }
      }),
    )
    const after = engine.executorStats()!
    const generated = texts.reduce((sum, t) => sum + t.tokens, 0)
    expect(generated).toBeGreaterThan(16)
    // Rows per model step: well above one when the streams decode together.
    expect((after.rows - before.rows) / (after.steps - before.steps)).toBeGreaterThan(4)
    await until(() => engine.stats().activeRequests === 0, 'the streams to close')
  })

  it('a seed reproduces a sampled completion on the real model', async () => {
    const body = { model: 'chatml', prompt: 'The river starts', max_tokens: 12, temperature: 1, seed: 9 }
    const [a, b] = await Promise.all([client.completions.create(body), client.completions.create(body)])
    expect(a.choices[0]!.text).toBe(b.choices[0]!.text)
  })
})

describe('ortex serve', () => {
  it('serves the API with a key from --api-key and stops on SIGTERM', async () => {
    const { spawn } = await import('node:child_process')
    const cli = path.resolve(__dirname, '../../dist/cli.js')
    const child = spawn(process.execPath, [cli, 'serve', '--simulated', '--port', '0', '--api-key', 'sk-cli', '--max-output-tokens', '5'], {
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    try {
      const line = await new Promise<string>((resolve, reject) => {
        let out = ''
        child.stdout.on('data', (data) => {
          out += String(data)
          if (out.includes('\n')) resolve(out)
        })
        child.once('exit', (code) => reject(new Error(`serve exited ${code}`)))
      })
      const url = /listening on (http:\/\/[^ ]+) /.exec(line)![1]!
      expect(url.startsWith('http://127.0.0.1:')).toBe(true)
      const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'sk-cli', maxRetries: 0 })
      const completion = await client.chat.completions.create({ model: MODEL, messages })
      expect(completion.usage!.completion_tokens).toBe(5)
      const anonymous = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'nope', maxRetries: 0 })
      expect(await anonymous.models.list().catch((e: unknown) => e)).toBeInstanceOf(OpenAI.AuthenticationError)
    } finally {
      child.kill('SIGTERM')
      await new Promise((resolve) => child.once('exit', resolve))
    }
    expect(child.exitCode).toBe(0)
  })
})
