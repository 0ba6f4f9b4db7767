// Tool calls and structured output over the OpenAI-compatible API, spoken to by the official
// `openai` client on the simulated model (the generic tool format: ChatML has no tool support),
// on both backends: `tools` with each `tool_choice`, streamed `delta.tool_calls` that assemble
// into the non-streamed answer, a conversation that sends the calls and their results back, and
// `response_format` json_object / json_schema.
import Ajv from 'ajv'
import OpenAI from 'openai'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { BACKENDS, ortex } from '../helpers/backends'

const MODEL = 'ortex-simulated'
const TOOLS: OpenAI.Chat.Completions.ChatCompletionFunctionTool[] = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'The weather in a city.',
      parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'], additionalProperties: false },
    },
  },
  {
    type: 'function',
    function: { name: 'get_time', parameters: { type: 'object', properties: { zone: { type: 'integer', minimum: -12, maximum: 14 } }, required: ['zone'] } },
  },
]
const MESSAGES: OpenAI.Chat.Completions.ChatCompletionMessageParam[] = [{ role: 'user', content: 'Weather in Paris and the time in Tokyo?' }]

type Call = { id: string; type: string; function: { name: string; arguments: string } }

function expectValid(calls: Call[]): void {
  const ajv = new Ajv({ strict: false })
  for (const call of calls) {
    const tool = TOOLS.find((t) => t.function.name === call.function.name)
    expect(tool, call.function.name).toBeDefined()
    const validate = ajv.compile(tool!.function.parameters!)
    expect(validate(JSON.parse(call.function.arguments)), call.function.arguments).toBe(true)
  }
}

describe.each(BACKENDS)('tools and response_format over the OpenAI API (%s)', (backend) => {
  const { Engine, startServer } = ortex(backend)
  let engine: ReturnType<typeof Engine.simulated>
  let server: Awaited<ReturnType<typeof startServer>>
  let client: OpenAI

  beforeAll(async () => {
    engine = Engine.simulated({ seed: 11, maxBatchSize: 16 })
    server = await startServer(engine, { port: 0 })
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
  })
  afterAll(async () => {
    await server.close()
    await engine.close()
  })

  const request = (extra: object = {}) => ({ model: MODEL, messages: MESSAGES, tools: TOOLS, temperature: 1, seed: 5, max_tokens: 512, ...extra })

  it('required and named calls come back valid in message.tool_calls with finish_reason tool_calls', async () => {
    for (const seed of [1, 2, 3]) {
      const answer = await client.chat.completions.create({ ...request({ seed }), tool_choice: 'required' })
      const choice = answer.choices[0]!
      expect(choice.finish_reason).toBe('tool_calls')
      expect(choice.message.content).toBeNull()
      const calls = choice.message.tool_calls as Call[]
      expect(calls.length).toBeGreaterThan(0)
      for (const call of calls) expect(call.id).toMatch(/^call_[0-9a-f]{24}$/)
      expectValid(calls)

      const named = await client.chat.completions.create({ ...request({ seed }), tool_choice: { type: 'function', function: { name: 'get_time' } }, parallel_tool_calls: false })
      const namedCalls = named.choices[0]!.message.tool_calls as Call[]
      expect(namedCalls.map((c) => c.function.name)).toEqual(['get_time'])
      expectValid(namedCalls)
    }
  })

  it('streamed delta.tool_calls assemble into the non-streamed calls', async () => {
    for (const tool_choice of ['required', 'auto'] as const) {
      const answer = await client.chat.completions.create({ ...request(), tool_choice })
      const stream = await client.chat.completions.create({ ...request(), tool_choice, stream: true })
      const calls: { name: string; arguments: string }[] = []
      let content = ''
      let finish: string | null = null
      for await (const chunk of stream) {
        const choice = chunk.choices[0]
        if (choice === undefined) continue
        content += choice.delta.content ?? ''
        for (const d of choice.delta.tool_calls ?? []) {
          if (d.id !== undefined) {
            expect(d.type).toBe('function')
            calls[d.index] = { name: d.function!.name!, arguments: '' }
          }
          calls[d.index]!.arguments += d.function?.arguments ?? ''
        }
        finish = choice.finish_reason ?? finish
      }
      const message = answer.choices[0]!.message
      expect(calls).toEqual(((message.tool_calls ?? []) as Call[]).map((c) => ({ name: c.function.name, arguments: c.function.arguments })))
      expect(content).toBe(message.content ?? '')
      expect(finish).toBe(answer.choices[0]!.finish_reason)
    }
  })

  it('a conversation sends calls and results back through the template', async () => {
    const first = await client.chat.completions.create({ ...request(), tool_choice: 'required', parallel_tool_calls: false })
    const call = first.choices[0]!.message.tool_calls![0] as Call
    const followUp = await client.chat.completions.create({
      ...request(),
      messages: [
        ...MESSAGES,
        { role: 'assistant', content: null, tool_calls: [call as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall] },
        { role: 'tool', tool_call_id: call.id, content: '{"temperature": 21}' },
      ],
    })
    expect(['stop', 'tool_calls']).toContain(followUp.choices[0]!.finish_reason)
    expect(followUp.usage!.prompt_tokens).toBeGreaterThan(first.usage!.prompt_tokens)
  })

  it('response_format json_object and json_schema give JSON, valid against the schema', async () => {
    const schema = { type: 'object', properties: { answer: { type: 'string', maxLength: 20 }, score: { type: 'number' } }, required: ['answer', 'score'], additionalProperties: false }
    const validate = new Ajv({ strict: false }).compile(schema)
    for (const seed of [1, 2]) {
      const object = await client.chat.completions.create({ model: MODEL, messages: MESSAGES, seed, temperature: 1, max_tokens: 512, response_format: { type: 'json_object' } })
      const parsed = JSON.parse(object.choices[0]!.message.content!) as unknown
      expect(typeof parsed).toBe('object')
      const shaped = await client.chat.completions.create({
        model: MODEL,
        messages: MESSAGES,
        seed,
        temperature: 1,
        max_tokens: 512,
        response_format: { type: 'json_schema', json_schema: { name: 'answer', schema, strict: true } },
      })
      expect(shaped.choices[0]!.finish_reason).toBe('stop')
      expect(validate(JSON.parse(shaped.choices[0]!.message.content!))).toBe(true)
    }
  })

  it('a schema the core cannot compile is a 400 naming the problem; malformed tool messages are 400s', async () => {
    const bad = await client.chat.completions
      .create({ model: MODEL, messages: MESSAGES, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', properties: 7 } as never } } })
      .catch((e: unknown) => e)
    expect(bad).toBeInstanceOf(OpenAI.BadRequestError)
    expect((bad as InstanceType<typeof OpenAI.BadRequestError>).param).toBe('response_format')
    expect((bad as Error).message).toContain('properties must be an object')
    const badTool = await client.chat.completions
      .create({ model: MODEL, messages: MESSAGES, tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: 7 } as never } }] })
      .catch((e: unknown) => e)
    expect((badTool as InstanceType<typeof OpenAI.BadRequestError>).param).toBe('tools')
    const noId = await client.chat.completions.create({ model: MODEL, messages: [...MESSAGES, { role: 'tool', content: 'x' } as never] }).catch((e: unknown) => e)
    expect(noId).toBeInstanceOf(OpenAI.BadRequestError)
    expect((noId as InstanceType<typeof OpenAI.BadRequestError>).param).toBe('messages[1].tool_call_id')
    const badCall = await client.chat.completions
      .create({ model: MODEL, messages: [...MESSAGES, { role: 'assistant', tool_calls: [{ id: 'x', type: 'function', function: { name: 'f' } }] } as never] })
      .catch((e: unknown) => e)
    expect((badCall as InstanceType<typeof OpenAI.BadRequestError>).param).toBe('messages[1].tool_calls[0].function')
  })
})
