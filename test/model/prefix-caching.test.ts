// Prefix caching on real ONNX models: requests that share a system prompt, a conversation resent
// whole as a stateless chat client does, continuations and a truncation, with staggered arrivals
// and chunked prefill. With the cache on, the executor reads shared blocks as past it did not
// compute; the greedy tokens must equal those of the cache off and of the plain single-request
// loop (test/reference/reference.ts), for both attention forms.

import { Engine } from 'ortex'
import { describe, expect, it } from 'vitest'
import { tinyPrompt, useTinyModels } from '../helpers/tiny-models'
import { naiveGenerate, type ReferenceModel } from '../reference/reference'

const FORMS = ['mha', 'gqa'] as const
type Form = (typeof FORMS)[number]
type NativeEngine = Awaited<ReturnType<typeof Engine.load>>
type Turn = ReturnType<NativeEngine['generate']>

const models = useTinyModels('prefix-caching', { mha: { attention: 'mha', seed: 11 }, gqa: { attention: 'gqa', seed: 11 } })

const SYSTEM = tinyPrompt(45, 900)
const QUESTIONS = [3, 8, 1, 13, 6, 2]
/** Steps at which each request arrives: later ones while earlier ones still decode. */
const ARRIVAL_STEPS = [0, 1, 3, 6, 9, 14]
const MAX_NEW = 10
const CONTINUE_NEW = 5
const TRUNCATE_TO = SYSTEM.length + 2

interface Outcome {
  first: number[][]
  /** Continuation of request 0 after truncating it to TRUNCATE_TO tokens, of request 2 as is. */
  truncated: number[]
  continued: number[]
  /** A new request carrying request 1's whole conversation plus a new question. */
  resent: number[]
  cachedPromptTokens: number
}

const question = (i: number) => tinyPrompt(QUESTIONS[i]!, 300 + i)
const resentTail = tinyPrompt(4, 777)

/** Steps the engine (caller-driven) until `done` holds, checking invariants after every step. */
async function stepUntil(engine: NativeEngine, done: (step: number) => boolean, onStep: (step: number) => void = () => {}) {
  const buffer = engine.createEventBuffer(64)
  for (let step = 0; step < 10_000; step++) {
    onStep(step)
    if (done(step) && !engine.hasPendingWork()) return
    await engine.run(buffer)
    engine.checkInvariants()
  }
  throw new Error('the engine did not settle')
}

async function runWorkload(engine: NativeEngine): Promise<Outcome> {
  const requests = QUESTIONS.map(() => engine.createRequest())
  const first: (Turn | null)[] = QUESTIONS.map(() => null)
  await stepUntil(
    engine,
    () => first.every((t) => t !== null),
    (step) =>
      QUESTIONS.forEach((_, i) => {
        if (first[i] === null && ARRIVAL_STEPS[i]! <= step) {
          first[i] = requests[i]!.beginTurn([...SYSTEM, ...question(i)], { maxGeneratedTokens: MAX_NEW })
        }
      }),
  )
  const firstResults = await Promise.all(first.map((turn) => turn!.done))
  requests[0]!.truncate(TRUNCATE_TO)
  const truncated = requests[0]!.beginTurn(question(3), { maxGeneratedTokens: CONTINUE_NEW })
  const continued = requests[2]!.beginTurn(question(4), { maxGeneratedTokens: CONTINUE_NEW })
  const conversation = [...SYSTEM, ...question(1), ...firstResults[1]!.tokens, ...resentTail]
  const resent = engine.createRequest().beginTurn(conversation, { maxGeneratedTokens: CONTINUE_NEW })
  await stepUntil(engine, () => true)
  const later = await Promise.all([truncated.done, continued.done, resent.done])
  const cached = [...firstResults, ...later].reduce((sum, result) => sum + result.usage.cachedPromptTokens, 0)
  for (const request of requests) request.close()
  return {
    first: firstResults.map((result) => Array.from(result.tokens)),
    truncated: Array.from(later[0]!.tokens),
    continued: Array.from(later[1]!.tokens),
    resent: Array.from(later[2]!.tokens),
    cachedPromptTokens: cached,
  }
}

/** The same workload on the plain loop: every turn over its whole context, nothing shared. */
async function referenceWorkload(model: ReferenceModel): Promise<Omit<Outcome, 'cachedPromptTokens'>> {
  const first: number[][] = []
  for (let i = 0; i < QUESTIONS.length; i++) first.push(await naiveGenerate(model, [...SYSTEM, ...question(i)], MAX_NEW))
  const context0 = [...SYSTEM, ...question(0), ...first[0]!].slice(0, TRUNCATE_TO)
  return {
    first,
    truncated: await naiveGenerate(model, [...context0, ...question(3)], CONTINUE_NEW),
    continued: await naiveGenerate(model, [...SYSTEM, ...question(2), ...first[2]!, ...question(4)], CONTINUE_NEW),
    resent: await naiveGenerate(model, [...SYSTEM, ...question(1), ...first[1]!, ...resentTail], CONTINUE_NEW),
  }
}

describe.each(FORMS)('%s form', (form: Form) => {
  // blockSize 8 and a 16-token budget: prompts prefill in chunks, whole blocks are shared.
  const options = { blockSize: 8, maxScheduledTokens: 16, maxBatchSize: 4, intraOpThreads: 1 }

  it('greedy tokens with the prefix cache on equal the cache off and the plain loop', async () => {
    const outcomes: Outcome[] = []
    const hits: number[] = []
    for (const prefixCaching of [false, true]) {
      const engine = await Engine.load(models.dirs[form], { ...options, prefixCaching })
      try {
        expect(engine.config.prefixCaching).toBe(prefixCaching)
        outcomes.push(await runWorkload(engine))
        hits.push(engine.stats().prefixCacheHits)
      } finally {
        await engine.close()
      }
    }
    const [off, on] = outcomes as [Outcome, Outcome]
    const expected = await referenceWorkload(models.references[form])
    expect({ ...off, cachedPromptTokens: undefined }).toEqual({ ...expected, cachedPromptTokens: undefined })
    expect({ ...on, cachedPromptTokens: undefined }).toEqual({ ...expected, cachedPromptTokens: undefined })
    expect(off.cachedPromptTokens).toBe(0)
    expect(hits[0]).toBe(0)
    // Five later requests find the system prompt's five whole blocks (40 tokens) at least; the
    // truncated and the resent conversation find more.
    expect(on.cachedPromptTokens).toBeGreaterThanOrEqual(5 * 40)
    expect(hits[1]).toBeGreaterThanOrEqual(25)
  })

  it('a request admitted while the owner of its prefix is still decoding reads the same past', async () => {
    const engine = await Engine.load(models.dirs[form], options)
    try {
      const owner = engine.createRequest().beginTurn([...SYSTEM, ...question(0)], { maxGeneratedTokens: 30 })
      const buffer = engine.createEventBuffer(64)
      while (engine.stats().generatedTokens < 3) await engine.run(buffer)
      const follower = engine.createRequest().beginTurn([...SYSTEM, ...question(5)], { maxGeneratedTokens: MAX_NEW })
      while (engine.hasPendingWork()) await engine.run(buffer)
      const [ownerResult, followerResult] = await Promise.all([owner.done, follower.done])
      expect(followerResult.usage.cachedPromptTokens).toBe(40)
      const reference = models.references[form]
      expect(Array.from(ownerResult.tokens)).toEqual(await naiveGenerate(reference, [...SYSTEM, ...question(0)], 30))
      expect(Array.from(followerResult.tokens)).toEqual(await naiveGenerate(reference, [...SYSTEM, ...question(5)], MAX_NEW))
    } finally {
      await engine.close()
    }
  })
})
