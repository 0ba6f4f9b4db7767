// Constraints (TurnOptions.constraint, issue 31): on both backends (setup.ts), every kind ends
// valid with 'eos' on the simulated model, whatever the sampling mode; a malformed constraint
// throws INVALID_ARGUMENT naming what before anything runs; the same seed gives the same text on
// native and WebAssembly. The JSON-Schema-Test-Suite run is test/constraints/.
import { describe, expect, it } from 'vitest'
import { ortex } from '../helpers/backends'
import { describeContract } from './setup'

const PERSON = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 10 },
    age: { type: 'integer', minimum: 0, maximum: 130 },
    pets: { type: 'array', items: { enum: ['cat', 'dog'] }, maxItems: 3 },
  },
  required: ['name', 'age'],
  additionalProperties: false,
}

const MODES = [{}, { temperature: 1 }, { temperature: 0.8, topK: 4, topP: 0.9 }, { temperature: 1.2, minP: 0.1, repetitionPenalty: 1.5 }]

describeContract(({ make }) => {
  describe('constraints', () => {
    it('a json_schema turn ends eos with a valid object in every sampling mode', async () => {
      const engine = make({ seed: 3 })
      for (const [i, mode] of MODES.entries()) {
        for (const seed of [1, 2, 3]) {
          const done = await engine.generate('person: ', { ...mode, seed, constraint: { type: 'json_schema', schema: PERSON } }).done
          expect(done.finishReason, `${i}/${seed}: ${done.text}`).toBe('eos')
          const value = JSON.parse(done.text) as { name: string; age: number; pets?: string[] }
          expect(typeof value.name).toBe('string')
          expect(value.name.length).toBeLessThanOrEqual(10)
          expect(Number.isInteger(value.age) && value.age >= 0 && value.age <= 130).toBe(true)
          for (const pet of value.pets ?? []) expect(['cat', 'dog']).toContain(pet)
          expect(Object.keys(value).every((k) => ['name', 'age', 'pets'].includes(k))).toBe(true)
        }
      }
    })

    it('json, regex and lark constraints end valid; logprobs stay numbers', async () => {
      const engine = make({ seed: 8 })
      for (const seed of [1, 2, 3, 4]) {
        const json = await engine.generate('x', { temperature: 1, seed, logprobs: 2, constraint: { type: 'json' } }).done
        expect(json.finishReason).toBe('eos')
        expect(typeof JSON.parse(json.text)).toBe('object')
        for (const entry of json.logprobs!) expect(Number.isNaN(entry.logprob)).toBe(false)
        const code = await engine.generate('x', { temperature: 1, seed, constraint: { type: 'regex', pattern: '[A-Z]{2}[0-9]{3}' } }).text()
        expect(code).toMatch(/^[A-Z]{2}[0-9]{3}$/)
        const grammar = 'start: "yes" | "no" | "count: " NUMBER\nNUMBER: /[1-9][0-9]{0,2}/'
        const answer = await engine.generate('x', { temperature: 1, seed, constraint: { type: 'lark', grammar } }).text()
        expect(answer).toMatch(/^(yes|no|count: [1-9][0-9]{0,2})$/)
      }
    })

    it('a constrained turn that reaches maxGeneratedTokens finishes with that reason', async () => {
      const engine = make({ seed: 1 })
      const done = await engine.generate('x', { maxGeneratedTokens: 4, constraint: { type: 'regex', pattern: 'a{10}' } }).done
      expect([done.finishReason, done.text]).toEqual(['max-generated-tokens', 'aaaa'])
    })

    it('a malformed constraint throws INVALID_ARGUMENT naming what, and nothing runs', () => {
      const engine = make({ seed: 1 })
      const cases: Array<[unknown, RegExp]> = [
        [{ type: 'xml' }, /options\.constraint\.type/],
        ['json', /options\.constraint must be an object/],
        [{ type: 'regex' }, /options\.constraint\.pattern must be a string/],
        [{ type: 'json', schema: {} }, /options\.constraint\.schema is not an option of a 'json' constraint/],
        [{ type: 'json_schema', schema: 3 }, /options\.constraint\.schema must be a JSON Schema/],
        [{ type: 'regex', pattern: '(' }, /constraint \(regex\) cannot be compiled/],
        [{ type: 'lark', grammar: 'start: missing' }, /constraint \(lark\) cannot be compiled/],
        [{ type: 'json_schema', schema: { type: 'object', uniqueItems: true, properties: { a: { type: 'nope' } } } }, /constraint \(json_schema\)/],
      ]
      for (const [constraint, message] of cases) {
        let thrown: unknown
        try {
          engine.generate('x', { constraint } as never)
        } catch (error) {
          thrown = error
        }
        expect(thrown, JSON.stringify(constraint)).toBeInstanceOf(ortex('native').OrtexError)
        expect((thrown as { code: string }).code).toBe('INVALID_ARGUMENT')
        expect((thrown as Error).message).toMatch(message)
      }
      expect(() => engine.generate('x', { ignoreEos: true, constraint: { type: 'json' } })).toThrow(/ignoreEos/)
      expect(engine.stats().activeRequests).toBe(0)
    })
  })
})

describe('constraints across backends', () => {
  it('the same seed gives the same constrained text on native and WebAssembly', async () => {
    const texts: string[] = []
    for (const backend of ['native', 'wasm'] as const) {
      const engine = ortex(backend).Engine.simulated({ seed: 11 })
      const turns = [1, 2, 3, 4, 5].map((seed) =>
        engine.generate('p', { temperature: 1, seed, constraint: { type: 'json_schema', schema: PERSON } }).text(),
      )
      texts.push(JSON.stringify(await Promise.all(turns)))
      await engine.close()
    }
    expect(texts[1]).toBe(texts[0])
  })
})
