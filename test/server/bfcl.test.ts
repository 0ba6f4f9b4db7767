// The Berkeley Function Calling Leaderboard's simple, multiple and parallel questions (test/helpers/
// bfcl.ts: its wheel's data, fetched once) asked of SmolLM2-135M-Instruct through the official
// `openai` client against `ortex serve` (a child process). SmolLM2's template has no tool support, so the calls take
// the generic format, constrained by a JSON Schema built from the functions: every call the
// server returns must name one of the request's functions and carry arguments that an independent
// validator (ajv) accepts against that function's parameters. Whether the calls are the right
// ones (BFCL's answers, judged in outline) is reported, not asserted: a 135M model is not there
// for its accuracy. A fixed sample of each category keeps the run short.
//
// Skipped, with a line saying why, where pip or the registry is unavailable.

import Ajv from 'ajv'
import OpenAI from 'openai'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { RealModelUnavailable, smolLM2Folder } from '../../ts/modelkit/real-model'
import { type ServeProcess, startServe } from '../scale/processes'
import { type BfclCase, type BfclCategory, bfclCases, bfclCorrect, jsonSchema, openAiName } from '../helpers/bfcl'

/** Cases per category: every (size / SAMPLE)-th, so the sample is fixed and spread out. */
const SAMPLE = 20
const CONCURRENCY = 8
const MAX_TOKENS = 256

async function prepare(): Promise<{ dir: string; cases: Record<BfclCategory, BfclCase[]> } | string> {
  try {
    const dir = (await smolLM2Folder('fp32')).dir
    const cases = {} as Record<BfclCategory, BfclCase[]>
    for (const category of ['simple_python', 'multiple', 'parallel'] as const) {
      const all = bfclCases(category)
      const step = Math.max(1, Math.floor(all.length / SAMPLE))
      cases[category] = all.filter((_, i) => i % step === 0).slice(0, SAMPLE)
    }
    return { dir, cases }
  } catch (error) {
    if (error instanceof RealModelUnavailable) return error.message
    throw error
  }
}

const prepared = await prepare()
if (typeof prepared === 'string') console.warn(`[bfcl] suite skipped: ${prepared}`)
const ready = typeof prepared === 'string' ? undefined : prepared

function toolsOf(c: BfclCase): OpenAI.Chat.Completions.ChatCompletionFunctionTool[] {
  return c.functions.map((f) => ({
    type: 'function' as const,
    function: { name: openAiName(f.name), description: f.description, parameters: jsonSchema(f.parameters) as Record<string, unknown> },
  }))
}

async function inPool<T, R>(items: T[], width: number, fn: (item: T) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length)
  let next = 0
  const worker = async (): Promise<void> => {
    while (next < items.length) {
      const at = next++
      out[at] = await fn(items[at]!)
    }
  }
  await Promise.all(Array.from({ length: width }, worker))
  return out
}

interface Outcome {
  calls: { name: string; arguments: Record<string, unknown> }[]
  cut: boolean
  correct: boolean
}

describe.skipIf(!ready)('BFCL through the OpenAI API on SmolLM2 (generic tool format)', () => {
  let server: ServeProcess | null = null
  let model = ''
  let client: OpenAI
  const ajv = new Ajv({ strict: false, allErrors: true, validateFormats: false })
  const report: string[] = []

  beforeAll(async () => {
    server = await startServe(['--model', ready!.dir])
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 })
    model = (await client.models.list()).data[0]!.id
  })
  afterAll(async () => {
    if (server !== null && server.child.exitCode === null) {
      server.child.kill('SIGTERM')
      await server.exited
    }
    if (report.length > 0) console.log(`[bfcl] SmolLM2-135M-Instruct fp32, greedy, tool_choice required, ${SAMPLE} per category:\n${report.join('\n')}`)
  })

  /** Asks one case; every call it returns must validate. */
  async function ask(c: BfclCase, parallel: boolean): Promise<Outcome> {
    const tools = toolsOf(c)
    const response = await client.chat.completions.create({
      model,
      messages: c.messages as OpenAI.Chat.Completions.ChatCompletionMessageParam[],
      tools,
      tool_choice: 'required',
      parallel_tool_calls: parallel,
      temperature: 0,
      max_tokens: MAX_TOKENS,
    })
    const choice = response.choices[0]!
    const cut = choice.finish_reason === 'length'
    const calls = (choice.message.tool_calls ?? []).map((call) => {
      expect(call.type).toBe('function')
      const fn = (call as { function: { name: string; arguments: string } }).function
      const tool = tools.find((t) => t.function.name === fn.name)
      expect(tool, `${c.id}: ${fn.name} is one of the request's functions`).toBeDefined()
      const args = JSON.parse(fn.arguments) as Record<string, unknown>
      const validate = ajv.compile(tool!.function.parameters!)
      expect(validate(args), `${c.id}: ${fn.arguments} against ${fn.name}: ${ajv.errorsText(validate.errors)}`).toBe(true)
      return { name: fn.name, arguments: args }
    })
    // A required call that the length limit did not cut short is there.
    if (!cut) {
      expect(choice.finish_reason, c.id).toBe('tool_calls')
      expect(calls.length, c.id).toBeGreaterThan(0)
      if (!parallel) expect(calls.length, c.id).toBe(1)
    }
    return { calls, cut, correct: bfclCorrect(c, calls) }
  }

  for (const category of ['simple_python', 'multiple', 'parallel'] as const) {
    it(`${category}: every call names a function and validates against its parameters`, { timeout: 600_000 }, async () => {
      const cases = ready!.cases[category]
      const started = Date.now()
      const outcomes = await inPool(cases, CONCURRENCY, (c) => ask(c, category === 'parallel'))
      const calls = outcomes.reduce((n, o) => n + o.calls.length, 0)
      const correct = outcomes.filter((o) => o.correct).length
      const cut = outcomes.filter((o) => o.cut).length
      report.push(
        `  ${category}: ${correct}/${cases.length} right (${((100 * correct) / cases.length).toFixed(0)}%), ${calls} calls all valid, ` +
          `${cut} cut by max_tokens ${MAX_TOKENS}, ${((Date.now() - started) / 1000).toFixed(1)} s`,
      )
      expect(calls).toBeGreaterThan(0)
    })
  }

  it('streamed calls assemble into the same calls as the answer (delta.tool_calls)', { timeout: 300_000 }, async () => {
    const c = ready!.cases.parallel[0]!
    const request = {
      model,
      messages: c.messages as OpenAI.Chat.Completions.ChatCompletionMessageParam[],
      tools: toolsOf(c),
      tool_choice: 'required' as const,
      temperature: 0,
      max_tokens: MAX_TOKENS,
    }
    const answer = await client.chat.completions.create(request)
    const stream = await client.chat.completions.create({ ...request, stream: true })
    const assembled: { id: string; name: string; arguments: string }[] = []
    let finish: string | null = null
    for await (const chunk of stream) {
      const choice = chunk.choices[0]
      if (choice === undefined) continue
      for (const d of choice.delta.tool_calls ?? []) {
        if (d.id !== undefined) assembled[d.index] = { id: d.id, name: d.function!.name!, arguments: '' }
        assembled[d.index]!.arguments += d.function?.arguments ?? ''
      }
      finish = choice.finish_reason ?? finish
    }
    const expected = (answer.choices[0]!.message.tool_calls ?? []).map((t) => {
      const fn = (t as { function: { name: string; arguments: string } }).function
      return [fn.name, fn.arguments]
    })
    expect(assembled.map((t) => [t.name, t.arguments])).toEqual(expected)
    expect(finish).toBe(answer.choices[0]!.finish_reason)
  })
})
