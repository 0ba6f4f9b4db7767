// Reasoning over the OpenAI-compatible API, spoken to by the official `openai` client: a model
// whose template is Qwen 3's (the tiny ONNX model with the template transformers rendered the
// fixtures from) answers with its thinking in `reasoning_content`, apart from `content`, whole and
// streamed, as vLLM's reasoning parsers and llama.cpp's `--reasoning-format deepseek` give it;
// `chat_template_kwargs: { enable_thinking: false }` reaches the template. The tiny model's
// weights are random, so vLLM's `structured_outputs` spells what it writes.
import { cpSync, readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import OpenAI from 'openai'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { ortex } from '../helpers/backends'
import { useTinyModels } from '../helpers/tiny-models'

const { Engine, startServer } = ortex('native')
const FIXTURES = path.resolve(__dirname, '../../crates/ortex-chat/tests/fixtures')
const MODEL = 'qwen3-template'
const ASK: OpenAI.Chat.Completions.ChatCompletionMessageParam[] = [{ role: 'user', content: 'Weather in Paris?' }]
const THOUGHT = 'The user asks for the weather.\nI should call the tool.'
const OUTPUT = `<think>\n${THOUGHT}\n</think>\n\nIt is sunny in Paris.`
const CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
const TOOLS: OpenAI.Chat.Completions.ChatCompletionFunctionTool[] = [
  { type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } },
]

const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')
/** vLLM's extension fields, which the client sends as they are. */
const spelled = (text: string) => ({ structured_outputs: { regex: escape(text) } }) as object

type Delta = { content?: string | null; reasoning_content?: string; tool_calls?: { index: number; id?: string; function?: { name?: string; arguments?: string } }[] }

describe('reasoning over the OpenAI API (a model with Qwen 3\'s template)', () => {
  const models = useTinyModels('openai-reasoning', { plain: {} })
  let engine: Awaited<ReturnType<typeof Engine.load>>
  let server: Awaited<ReturnType<typeof startServer>>
  let client: OpenAI

  beforeAll(async () => {
    const fixture = JSON.parse(readFileSync(path.join(FIXTURES, 'qwen3.json'), 'utf8')) as { template: string; eos_token: string }
    const dir = path.join(models.root(), MODEL)
    cpSync(models.dirs.plain, dir, { recursive: true })
    writeFileSync(path.join(dir, 'chat_template.jinja'), fixture.template)
    engine = await Engine.load(dir, { intraOpThreads: 1 })
    server = await startServer(engine, { port: 0 })
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
  })
  afterAll(async () => {
    await server.close()
    await engine.close()
  })

  const create = (extra: object) => client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 300, ...extra } as never) as Promise<OpenAI.Chat.Completions.ChatCompletion>

  /** A streamed request's deltas, in order, and its finish reason. */
  async function streamed(extra: object): Promise<{ deltas: Delta[]; finish: string | null }> {
    const stream = (await client.chat.completions.create({ model: MODEL, messages: ASK, max_tokens: 300, stream: true, ...extra } as never)) as unknown as AsyncIterable<OpenAI.Chat.Completions.ChatCompletionChunk>
    const deltas: Delta[] = []
    let finish: string | null = null
    for await (const chunk of stream) {
      const choice = chunk.choices[0]
      if (choice === undefined) continue
      deltas.push(choice.delta as Delta)
      finish = choice.finish_reason ?? finish
    }
    return { deltas, finish }
  }

  it('a whole response gives the thinking as reasoning_content and the answer without it as content', async () => {
    const answer = await create(spelled(OUTPUT))
    const message = answer.choices[0]!.message as OpenAI.Chat.Completions.ChatCompletionMessage & { reasoning_content?: string | null }
    expect(message.reasoning_content).toBe(THOUGHT)
    expect(message.content).toBe('It is sunny in Paris.')
    expect(answer.choices[0]!.finish_reason).toBe('stop')
  })

  it('a streamed response sends reasoning_content deltas, then content deltas, adding up to the whole response', async () => {
    const { deltas, finish } = await streamed(spelled(OUTPUT))
    const reasoning = deltas.map((d) => d.reasoning_content ?? '').join('')
    const content = deltas.map((d) => d.content ?? '').join('')
    expect(reasoning).toBe(THOUGHT)
    expect(content).toBe('It is sunny in Paris.')
    // The thinking comes first, in several chunks (a token or so each), and never beside content.
    const kinds = deltas.filter((d) => (d.reasoning_content ?? '') + (d.content ?? '') !== '').map((d) => (d.reasoning_content ? 'reasoning' : 'content'))
    expect(kinds.indexOf('content')).toBe(kinds.lastIndexOf('reasoning') + 1)
    expect(kinds.filter((k) => k === 'reasoning').length).toBeGreaterThan(3)
    expect(deltas.some((d) => d.reasoning_content && d.content)).toBe(false)
    expect(finish).toBe('stop')
  })

  it('a model that never closes the block gives all its text as reasoning, with finish_reason length', async () => {
    const answer = await create({ ...spelled(OUTPUT), max_tokens: 12 })
    const message = answer.choices[0]!.message as OpenAI.Chat.Completions.ChatCompletionMessage & { reasoning_content?: string | null }
    expect(answer.choices[0]!.finish_reason).toBe('length')
    expect(message.content).toBeNull()
    expect(THOUGHT.startsWith(message.reasoning_content!)).toBe(true)
    expect(message.reasoning_content!.length).toBeGreaterThan(0)
    const { deltas, finish } = await streamed({ ...spelled(OUTPUT), max_tokens: 12 })
    expect(finish).toBe('length')
    expect(deltas.map((d) => d.reasoning_content ?? '').join('')).toBe(message.reasoning_content)
    expect(deltas.every((d) => !d.content)).toBe(true)
  })

  it('chat_template_kwargs enable_thinking false reaches the template: the prompt closes the block, the answer is content', async () => {
    const on = await create({ structured_outputs: { regex: 'Sunny\\.' } })
    const off = await create({ structured_outputs: { regex: 'Sunny\\.' }, chat_template_kwargs: { enable_thinking: false } })
    // "<think>\n\n</think>\n\n" more in the prompt.
    expect(off.usage!.prompt_tokens).toBe(on.usage!.prompt_tokens + engine.tokenize('<think>\n\n</think>\n\n').length)
    const message = off.choices[0]!.message as OpenAI.Chat.Completions.ChatCompletionMessage & { reasoning_content?: string | null }
    expect([message.reasoning_content, message.content]).toEqual([null, 'Sunny.'])
  })

  it('a call after the block parses as tool_calls, whole and streamed; the thinking stays apart', async () => {
    const answer = await create({ tools: TOOLS, ...spelled(`<think>\n${THOUGHT}\n</think>\n\n${CALL}`) })
    const choice = answer.choices[0]!
    expect(choice.finish_reason).toBe('tool_calls')
    expect((choice.message as { reasoning_content?: string }).reasoning_content).toBe(THOUGHT)
    expect(choice.message.content).toBeNull()
    const call = choice.message.tool_calls![0] as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall
    expect([call.function.name, JSON.parse(call.function.arguments)]).toEqual(['get_weather', { city: 'Paris' }])

    const { deltas, finish } = await streamed({ tools: TOOLS, ...spelled(`<think>\n${THOUGHT}\n</think>\n\n${CALL}`) })
    expect(finish).toBe('tool_calls')
    expect(deltas.map((d) => d.reasoning_content ?? '').join('')).toBe(THOUGHT)
    const calls = deltas.flatMap((d) => d.tool_calls ?? [])
    expect(calls[0]!.function!.name).toBe('get_weather')
    expect(calls.map((c) => c.function?.arguments ?? '').join('')).toBe(call.function.arguments)

    // The reply goes back with its reasoning and its call; the tool's result follows.
    const followUp = await create({
      tools: TOOLS,
      messages: [...ASK, { ...choice.message, content: null }, { role: 'tool', tool_call_id: call.id, content: '21 C, sunny' }],
      ...spelled('It is 21 C.'),
    })
    expect(followUp.choices[0]!.message.content).toBe('It is 21 C.')
  })

  it('refuses malformed chat_template_kwargs, structured_outputs and reasoning_content naming the field', async () => {
    const refused = async (body: object, param: string) => {
      const response = await fetch(`${server.url}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: MODEL, messages: ASK, ...body }) })
      expect(response.status).toBe(400)
      expect(((await response.json()) as { error: { param: string } }).error.param).toBe(param)
    }
    await refused({ chat_template_kwargs: 'enable_thinking=false' }, 'chat_template_kwargs')
    await refused({ structured_outputs: { choice: ['a', 'b'] } }, 'structured_outputs.choice')
    await refused({ structured_outputs: { regex: 'a', grammar: 'start: "a"' } }, 'structured_outputs')
    await refused({ structured_outputs: { regex: 'a' }, response_format: { type: 'json_object' } }, 'structured_outputs')
    await refused({ structured_outputs: { regex: '(' } }, 'structured_outputs')
    await refused({ messages: [...ASK, { role: 'assistant', content: 'x', reasoning_content: 7 }, ...ASK] }, 'messages[1].reasoning_content')
  })
})
