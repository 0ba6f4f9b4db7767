// Reasoning apart from the answer: the parser over every split of a model's output (a tag cut
// across pieces, as tokens cut it), with tool calls after (and inside) a think block; the
// reasoning format and the tool family told from real templates (the fixtures of crates/ortex-chat,
// rendered by transformers); Phi-4-mini's tool format; and chat turns on the tiny ONNX model with
// Qwen 3's and QwQ's templates, whose output a constraint spells.
import { describe, expect, it } from 'vitest'
import { detectFamily, promptMessages, toolConstraint, type ToolPlan } from '../../ts/tools/format'
import { OutputParser, type OutputPlan } from '../../ts/tools/output'
import { ToolCallParser, type ToolCallDelta } from '../../ts/tools/parse'
import { type ReasoningPlan, ReasoningParser, detectReasoning, promptBlock } from '../../ts/tools/reasoning'
import type { ChatMessage } from '../../ts/types'
import { ortex } from '../helpers/backends'
import { templateFixture as fixture, useTemplateFolders } from '../helpers/template-fixtures'
import { useTinyModels } from '../helpers/tiny-models'

const THINK = { start: '<think>', end: '</think>' }
const SPLITS = [[1], [2, 3], [4], [7, 1, 13], [1000]]

/** `text` in pieces of `sizes` (cycled). */
function pieces(text: string, sizes: number[]): string[] {
  const out: string[] = []
  for (let at = 0, i = 0; at < text.length; i++) {
    const size = Math.max(1, sizes[i % sizes.length]!)
    out.push(text.slice(at, at + size))
    at += size
  }
  return out
}

/** Streams `text` through an OutputParser; returns what the stream sent and the result. */
function stream(plan: OutputPlan, text: string, sizes: number[]) {
  const parser = new OutputParser(plan)
  let reasoning = ''
  let content = ''
  const calls: ToolCallDelta[] = []
  for (const piece of [...pieces(text, sizes).map((p) => parser.push(p)), parser.finish()]) {
    reasoning += piece.reasoning
    content += piece.content
    calls.push(...piece.calls)
  }
  return { reasoning, content, calls, result: parser.result() }
}

const plain = (open = false): OutputPlan => ({ tools: null, reasoning: { format: THINK, prompt: open ? 'open' : 'none' } })

describe('the reasoning parser', () => {
  const CASES: Array<{ name: string; text: string; open?: boolean; reasoning: string | null; content: string | null }> = [
    { name: 'a block, then the answer', text: '<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! 👋', reasoning: 'The user greets me.\nI greet back.', content: 'Hello! 👋' },
    { name: 'leading whitespace before the block', text: '\n <think>a</think>b', reasoning: 'a', content: 'b' },
    { name: 'no block: all content, as written', text: '  Hello <think> is text here', reasoning: null, content: '  Hello <think> is text here' },
    { name: 'a block never closed: all reasoning', text: '<think>\nStill thinking about </thi', reasoning: 'Still thinking about </thi', content: null },
    { name: 'an empty block (thinking switched off)', text: '<think>\n\n</think>\n\nParis.', reasoning: '', content: 'Paris.' },
    { name: 'the prompt opened the block', text: 'Add them.\n</think>\n\n4', open: true, reasoning: 'Add them.', content: '4' },
    { name: 'opened, never closed', text: 'Add them and', open: true, reasoning: 'Add them and', content: null },
    { name: 'a tag-like text inside the thought', text: '<think>a < b and </thinker> too</think>ok', reasoning: 'a < b and </thinker> too', content: 'ok' },
    { name: 'a second block is content', text: '<think>x</think>y<think>z</think>', reasoning: 'x', content: 'y<think>z</think>' },
  ]
  for (const c of CASES) {
    it(`${c.name}, in any split of its text (a tag cut across pieces)`, () => {
      for (const sizes of SPLITS) {
        const { reasoning, content, result } = stream(plain(c.open), c.text, sizes)
        expect(result.reasoning, `split ${sizes}`).toBe(c.reasoning)
        expect(result.content, `split ${sizes}`).toBe(c.content)
        // What a stream sends adds up to the result.
        expect(reasoning).toBe(c.reasoning ?? '')
        expect(content).toBe(c.content ?? '')
      }
    })
  }

  it('sends reasoning as it comes, holding back only what may be the closing tag or trimmed whitespace', () => {
    const parser = new ReasoningParser({ format: THINK, prompt: 'none' })
    expect(parser.push('<thi')).toEqual({ reasoning: '', content: '' })
    expect(parser.push('nk>\nOne')).toEqual({ reasoning: 'One', content: '' })
    expect(parser.push(' two \n</')).toEqual({ reasoning: ' two', content: '' })
    expect(parser.push('think>\n\n')).toEqual({ reasoning: '', content: '' })
    expect(parser.push('Three')).toEqual({ reasoning: '', content: 'Three' })
    expect(parser.finish()).toEqual({ reasoning: '', content: '' })
  })

  it('tool calls after the block parse; a call written inside it is thought', () => {
    const plan: OutputPlan = {
      tools: { family: 'hermes', functions: [], tools: [], mode: { kind: 'auto' }, parallel: true },
      reasoning: { format: THINK, prompt: 'none' },
    }
    const text =
      '<think>\nI could write <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> but I think first.\n</think>\n\n' +
      'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for (const sizes of SPLITS) {
      const { reasoning, content, calls, result } = stream(plan, text, sizes)
      expect(result.reasoning).toBe('I could write <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> but I think first.')
      expect(result.content).toBe('Let me check.')
      expect(result.toolCalls.map((c) => [c.function.name, JSON.parse(c.function.arguments)])).toEqual([['get_weather', { city: 'Paris' }]])
      expect(reasoning).toBe(result.reasoning)
      expect(content.trim()).toBe(result.content)
      expect(calls.filter((d) => d.name !== undefined).map((d) => d.name)).toEqual(['get_weather'])
    }
  })
})



describe('Phi-4-mini tool calls', () => {
  const PLAN: ToolPlan = {
    family: 'phi4',
    functions: [{ name: 'get_weather', description: 'The weather.', parameters: { type: 'object', properties: { city: { type: 'string' } } } }],
    tools: [],
    mode: { kind: 'auto' },
    parallel: true,
  }

  it('parse as its model writes them, in any split', () => {
    const text = 'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Zürich"}}, {"name": "get_time", "arguments": {"zone": 1}}]<|/tool_call|>'
    for (const sizes of SPLITS) {
      let n = 0
      const parser = new ToolCallParser('phi4', () => `id${n++}`)
      let content = ''
      for (const piece of [...pieces(text, sizes).map((p) => parser.push(p)), parser.finish()]) content += piece.content
      const result = parser.result()
      expect(result.content).toBe('Sure.')
      expect(content).toBe('Sure.')
      expect(result.toolCalls.map((c) => [c.function.name, JSON.parse(c.function.arguments)])).toEqual([
        ['get_weather', { city: 'Zürich' }],
        ['get_time', { zone: 1 }],
      ])
    }
    const none = new ToolCallParser('phi4', () => 'x')
    none.push('No <|tool_ here.')
    none.finish()
    expect(none.result()).toEqual({ content: 'No <|tool_ here.', toolCalls: [] })
  })

  it('the tools go into the system message and earlier calls into the content, as its template takes them', () => {
    const conversation = [
      { role: 'user', content: 'Weather in Zürich?' },
      { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Zürich"}' } }] },
      { role: 'tool', tool_call_id: 'c1', content: { temperature: 21.5 } },
    ] as ChatMessage[]
    const out = promptMessages(PLAN, conversation)
    expect(out[0]).toEqual({
      role: 'system',
      content: 'You are a helpful assistant with some tools.',
      tools: '[{"name":"get_weather","description":"The weather.","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}]',
    })
    expect(out[2]).toEqual({ role: 'assistant', content: '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Zürich"}}]<|/tool_call|>' })
    expect(out[3]).toEqual({ role: 'tool', tool_call_id: 'c1', content: '{"temperature":21.5}' })
    const withSystem = promptMessages(PLAN, [{ role: 'system', content: 'Be brief.' }, ...conversation.slice(0, 1)])
    expect(withSystem[0]!.content).toBe('Be brief.')
    expect(typeof withSystem[0]!.tools).toBe('string')
  })

  it("the constraint spells the tags as tokens where the vocabulary has them, and lets a thinking template think first", () => {
    const asTokens = toolConstraint({ ...PLAN, mode: { kind: 'required' } }, undefined, (text) => (text === '<|tool_call|>' ? 200025 : text === '<|/tool_call|>' ? 200026 : null))
    expect(asTokens).toMatchObject({ type: 'lark' })
    expect((asTokens as { grammar: string }).grammar).toMatch(/^start: calls\ncalls: <\[200025\]> %json .* <\[200026\]>\n$/)
    const thinking: ReasoningPlan = { format: THINK, prompt: 'none' }
    const hermes = toolConstraint({ ...PLAN, family: 'hermes', mode: { kind: 'required' } }, undefined, () => null, thinking) as { grammar: string }
    expect(hermes.grammar).toMatch(/^start: "<think>" thought GAP\? answer \| answer\nthought\[stop="<\/think>"\]/)
    expect(hermes.grammar).toContain('answer: call')
    const opened = toolConstraint({ ...PLAN, family: 'generic', mode: { kind: 'required' } }, undefined, () => null, { ...thinking, prompt: 'open' }) as { grammar: string }
    expect(opened.grammar).toMatch(/^start: thought GAP\? answer\n/)
    expect(opened.grammar).toContain('answer: %json {')
    // Thinking switched off: the answer's own constraint.
    expect(toolConstraint({ ...PLAN, family: 'generic', mode: { kind: 'required' } }, undefined, () => null, { ...thinking, prompt: 'closed' }).type).toBe('json_schema')
  })
})

describe('formats told from real templates (native, the tiny ONNX model)', () => {
  const models = useTinyModels('reasoning', { plain: {} })
  const { Engine } = ortex('native')
  const folders = useTemplateFolders(models)
  const folderWith = folders.fixture

  const FORMATS: Record<string, { reasoning: boolean; family: string }> = {
    qwen3: { reasoning: true, family: 'hermes' },
    qwq: { reasoning: true, family: 'hermes' },
    gemma3: { reasoning: false, family: 'generic' },
    phi3_5: { reasoning: false, family: 'generic' },
    phi4_mini: { reasoning: false, family: 'phi4' },
    llama3_2: { reasoning: false, family: 'llama3' },
    smollm2: { reasoning: false, family: 'generic' },
  }
  for (const [name, expected] of Object.entries(FORMATS)) {
    it(`${name}: ${expected.reasoning ? '<think> reasoning' : 'no reasoning'}, tool family ${expected.family}; a tool round renders through it`, async () => {
      const engine = await Engine.load(folderWith(name), { intraOpThreads: 1 })
      try {
        const render = (messages: object[], options: object = {}) => engine.applyChatTemplate(messages as never, options)
        expect(detectReasoning((messages) => render(messages, { addGenerationPrompt: false }))).toEqual(expected.reasoning ? THINK : null)
        const family = detectFamily((messages, tools) => render(messages, { tools }))
        expect(family).toBe(expected.family)
        const tools = [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }]
        const plan: ToolPlan = { family, functions: [{ name: 'get_weather', parameters: tools[0]!.function.parameters }], tools, mode: { kind: 'auto' }, parallel: true }
        const conversation = [
          { role: 'user', content: 'Weather in Paris?' },
          { role: 'assistant', content: '', tool_calls: [{ id: 'abcDEF123', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
          { role: 'tool', tool_call_id: 'abcDEF123', content: '21 C, sunny' },
        ]
        const text = render(promptMessages(plan, conversation), { tools: family === 'generic' || family === 'phi4' ? undefined : tools })
        expect(text).toContain('get_weather')
        expect(text).toMatch(/"city": ?"Paris"/)
        expect(text).toContain('21 C, sunny')
      } finally {
        await engine.close()
      }
    })
  }

  it("QwQ's generation prompt opens the block, Qwen 3's leaves it to the model; both close it when thinking is off", async () => {
    const user = [{ role: 'user', content: 'Hi' }]
    const qwq = await Engine.load(folderWith('qwq'), { intraOpThreads: 1 })
    const qwen = await Engine.load(folderWith('qwen3'), { intraOpThreads: 1 })
    try {
      const block = (engine: typeof qwq, enable_thinking: boolean) => promptBlock(THINK, engine.applyChatTemplate(user, { variables: { enable_thinking } }))
      expect([block(qwq, true), block(qwq, false)]).toEqual(['open', 'closed'])
      expect([block(qwen, true), block(qwen, false)]).toEqual(['none', 'closed'])
    } finally {
      await qwq.close()
      await qwen.close()
    }
  })

  // The tiny model's weights are random: a constraint spells what the model writes.
  const THOUGHT = '<think>\nThe user asks for the weather.\n</think>\n\n'
  const CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
  const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')

  it('Qwen 3: engine.chat and a conversation give the reasoning apart; enable_thinking reaches the template', async () => {
    const engine = await Engine.load(folderWith('qwen3'), { intraOpThreads: 1 })
    try {
      const ask = [{ role: 'user', content: 'Weather in Paris?' }]
      const answer = await engine.chat(ask, { constraint: { type: 'regex', pattern: escape(`${THOUGHT}It is sunny.`) }, maxGeneratedTokens: 200 }).done
      expect(answer.text).toBe(`${THOUGHT}It is sunny.`)
      expect(answer.reasoning).toBe('The user asks for the weather.')
      expect(answer.content).toBe('It is sunny.')

      const off = engine.chat(ask, { variables: { enable_thinking: false }, constraint: { type: 'regex', pattern: 'Sunny\\.' }, maxGeneratedTokens: 20 })
      expect(engine.detokenize(off.request.tokens())).toMatch(/<\|im_start\|>assistant\n<think>\n\n<\/think>\n\n$/)
      const offResult = await off.done
      expect([offResult.reasoning, offResult.content]).toEqual([null, 'Sunny.'])

      const tools = [{ type: 'function' as const, function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }]
      const called = await engine.chat(ask, { tools, constraint: { type: 'regex', pattern: escape(THOUGHT + CALL) }, maxGeneratedTokens: 300 }).done
      expect(called.reasoning).toBe('The user asks for the weather.')
      expect(called.content).toBeNull()
      expect(called.toolCalls!.map((c) => [c.function.name, JSON.parse(c.function.arguments)])).toEqual([['get_weather', { city: 'Paris' }]])

      const chat = engine.createChat({ system: 'Be brief.' })
      const first = await chat.send('2+2?', { constraint: { type: 'regex', pattern: escape('<think>\nAdd.\n</think>\n\n4') }, maxGeneratedTokens: 60 }).done
      expect([first.reasoning, first.content]).toEqual(['Add.', '4'])
      expect(chat.messages.at(-1)).toEqual({ role: 'assistant', content: '4', reasoning_content: 'Add.' })
      const second = chat.send('3+3?', { constraint: { type: 'regex', pattern: '6' }, maxGeneratedTokens: 10 })
      // Qwen 3's template drops the earlier turn's thinking from the prompt.
      expect(engine.detokenize(second.request.tokens())).toContain('<|im_start|>assistant\n4<|im_end|>')
      expect((await second.done).content).toBe('6')
      chat.close()
    } finally {
      await engine.close()
    }
  })

  it("QwQ: the prompt opened the block, so the output's first text is reasoning", async () => {
    const engine = await Engine.load(folderWith('qwq'), { intraOpThreads: 1 })
    try {
      const opened = await engine.chat([{ role: 'user', content: '2+2?' }], { variables: { enable_thinking: true }, constraint: { type: 'regex', pattern: escape('Two and two.\n</think>\n\n4') }, maxGeneratedTokens: 60 }).done
      expect([opened.reasoning, opened.content]).toEqual(['Two and two.', '4'])
      // Cut by the length limit inside the block: all reasoning, as vLLM gives it.
      const cut = await engine.chat([{ role: 'user', content: '2+2?' }], { variables: { enable_thinking: true }, constraint: { type: 'regex', pattern: escape('Two and two make four, which') }, maxGeneratedTokens: 8 }).done
      expect(cut.finishReason).toBe('max-generated-tokens')
      expect(cut.content).toBeNull()
      expect(cut.text.startsWith(cut.reasoning!)).toBe(true)
    } finally {
      await engine.close()
    }
  })

  it('tool_choice required on a thinking template: the constraint lets the model think, then call (at once with thinking off)', async () => {
    const engine = await Engine.load(folderWith('qwen3'), { intraOpThreads: 1 })
    try {
      const tools = [{ type: 'function' as const, function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 8 } }, required: ['city'], additionalProperties: false } } }]
      for (let seed = 0; seed < 3; seed++) {
        const result = await engine.chat([{ role: 'user', content: 'Weather?' }], { tools, toolChoice: 'required', temperature: 1, seed, maxGeneratedTokens: 300 }).done
        // The random model either thinks (and may run out of room inside the block) or calls.
        if (result.finishReason === 'eos') expect(result.toolCalls!.map((c) => c.function.name)).toEqual(['get_weather'])
        else expect(result.text.startsWith('<think>')).toBe(true)
        const off = await engine.chat([{ role: 'user', content: 'Weather?' }], { tools, toolChoice: 'required', parallelToolCalls: false, variables: { enable_thinking: false }, temperature: 1, seed, maxGeneratedTokens: 300 }).done
        expect(off.text).toMatch(/^<tool_call>\n\{"name": "get_weather"/)
        expect(off.finishReason).toBe('eos')
      }
    } finally {
      await engine.close()
    }
  })

  it('Phi-4-mini: a call in its tags parses; the tools reach its system message', async () => {
    const engine = await Engine.load(folderWith('phi4_mini'), { intraOpThreads: 1 })
    try {
      const tools = [{ type: 'function' as const, function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 8 } }, required: ['city'], additionalProperties: false } } }]
      const turn = engine.chat([{ role: 'user', content: 'Weather in Paris?' }], { tools, toolChoice: 'required', temperature: 1, seed: 1, maxGeneratedTokens: 200 })
      expect(engine.detokenize(turn.request.tokens())).toContain('<|system|>You are a helpful assistant with some tools.<|tool|>[{"name":"get_weather"')
      const result = await turn.done
      expect(result.text).toMatch(/^<\|tool_call\|>\[\{"name": "get_weather", "arguments": \{"city": ".*"\}\}\]<\|\/tool_call\|>$/)
      expect(result.toolCalls!.map((c) => c.function.name)).toEqual(['get_weather'])
      expect(result.content).toBeNull()
    } finally {
      await engine.close()
    }
  })
})
