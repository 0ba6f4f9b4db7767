// Wrong calls, table-driven, on both backends. Each case asserts the exact OrtexError code (and
// `instanceof OrtexError`), then proves the engine still works: a short generation succeeds on a
// fresh request, and the case's own request, if still unused, begins turn 1 (a refused call
// consumed no turn id). Cases that close or break the engine by design check that close() still
// works and that a fresh engine works.
import { afterEach, describe, expect, it } from 'vitest'
import { BACKENDS, ortex, type BackendName, type OrtexModule } from './helpers/backends'
import { drain, expectCode, expectCodeAsync, expectRejects, macrotask, smokeGeneration, type Engine, type EventBuffer, type Request } from './helpers/util'

interface Ctx {
  mod: OrtexModule
  engine: Engine
  /** A second engine (for cross-engine misuse). */
  other: Engine
  request: Request
  buffer: EventBuffer
}

interface Case {
  name: string
  code: string
  /** Options for ctx.engine (default { seed: 1 }). */
  engine?: Record<string, unknown>
  setup?: (ctx: Ctx) => void | Promise<void>
  call: (ctx: Ctx) => unknown
  /** The call returns a promise: accept a synchronous throw or a rejection. */
  async?: 'throw-or-reject' | 'reject'
  /** The case leaves ctx.engine closed or unhealthy on purpose. */
  dead?: boolean
  /** Runs before the smoke generation (to release what the case held on purpose). */
  beforeSmoke?: (ctx: Ctx) => void
  /** Only on this backend. */
  only?: BackendName
  /** The case may leave the engine driven (start() or generate()): stop() it before the smoke. */
  driven?: boolean
}

const any = (v: unknown) => v as any

/** Runs `call`, which must throw, and checks the message names `option` before rethrowing. */
function expectNamed(call: () => unknown, ...parts: string[]): never {
  try {
    call()
  } catch (error) {
    for (const part of parts) expect((error as Error).message).toContain(part)
    throw error
  }
  throw new Error(`${parts.join(', ')}: the call did not throw`)
}

/** `leaf` inside `depth` arrays. */
function nested(depth: number, leaf: unknown = 'x'): unknown {
  let value = leaf
  for (let i = 0; i < depth; i++) value = [value]
  return value
}

/** A message that contains itself. */
function selfContaining(): Record<string, unknown> {
  const message: Record<string, unknown> = { role: 'user', content: 'hi' }
  message.self = message
  return message
}

const cases: Case[] = [
  // ----- engine options -----
  { name: 'options: negative blockSize', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ blockSize: -1 }) },
  { name: 'options: prefixCaching not a boolean', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ prefixCaching: 1 as never }) },
  { name: 'options: prefixCaching as a string', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ prefixCaching: 'false' as never }) },
  { name: 'options: zero blockSize', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ blockSize: 0 }) },
  { name: 'options: fractional blockSize', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ blockSize: 2.5 }) },
  { name: 'options: blockSize above its maximum', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ blockSize: 4097 }) },
  { name: 'options: NaN numBlocks', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ numBlocks: NaN }) },
  { name: 'options: maxBatchSize past 2^31', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ maxBatchSize: 2 ** 31 }) },
  { name: 'options: unknown key', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any({ blocksize: 16 })) },
  { name: 'options: unknown batching mode', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any({ batching: 'sometimes' })) },
  { name: 'options: string maxScheduledTokens', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any({ maxScheduledTokens: '512' })) },
  { name: 'options: negative seed', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ seed: -1 }) },
  { name: 'options: vocabSize 1', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ vocabSize: 1 }) },
  { name: 'options: eosTokenId outside the vocabulary', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ eosTokenId: 32000 }) },
  { name: 'options: maxLength 0', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ maxLength: 0 }) },
  { name: 'options: eosProbability above 1', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated({ eosProbability: 1.5 }) },
  { name: 'options: negative fault rate', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any({ faults: { retryableRate: -0.5 } })) },
  { name: 'options: unknown fault key', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any({ faults: { sometimes: true } })) },
  { name: 'options: not an object', code: 'INVALID_ARGUMENT', call: ({ mod }) => mod.Engine.simulated(any('fast')) },

  // ----- requests -----
  { name: 'createRequest: maxSessionTokens above maxLength', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest({ maxSessionTokens: 2049 }) },
  { name: 'createRequest: negative maxSessionTokens', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest({ maxSessionTokens: -1 }) },
  { name: 'createRequest: fractional maxSessionTokens', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest({ maxSessionTokens: 1.5 }) },
  { name: 'createRequest: NaN maxSessionTokens', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest({ maxSessionTokens: NaN }) },
  { name: 'createRequest: unknown option', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest(any({ color: 'red' })) },
  { name: 'createRequest: options not an object', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createRequest(any(42)) },
  {
    name: 'createRequest: past maxRequests',
    code: 'CAPACITY_EXHAUSTED',
    engine: { maxRequests: 1 },
    call: ({ engine }) => engine.createRequest(),
    beforeSmoke: ({ request }) => request.close(),
  },

  // ----- event buffers -----
  { name: 'createEventBuffer: negative capacity', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createEventBuffer(-1) },
  { name: 'createEventBuffer: NaN capacity', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createEventBuffer(NaN) },
  { name: 'createEventBuffer: fractional capacity', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createEventBuffer(2.5) },
  { name: 'createEventBuffer: capacity past 2^31', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createEventBuffer(2 ** 31) },
  { name: 'createEventBuffer: string capacity', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.createEventBuffer(any('16')) },
  { name: 'EventBuffer.at(-1)', code: 'INVALID_ARGUMENT', call: ({ buffer }) => buffer.at(-1) },
  { name: 'EventBuffer.at(count)', code: 'INVALID_ARGUMENT', call: ({ buffer }) => buffer.at(buffer.count) },
  { name: 'EventBuffer.at(0.5)', code: 'INVALID_ARGUMENT', call: ({ buffer }) => buffer.at(0.5) },

  // ----- turn input -----
  { name: 'beginTurn: empty string', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('') },
  { name: 'beginTurn: empty array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([]) },
  { name: 'beginTurn: empty Int32Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Int32Array(0)) },
  { name: 'beginTurn: token outside the vocabulary', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([100, 32000]) },
  { name: 'beginTurn: negative token', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([-1]) },
  { name: 'beginTurn: fractional token', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([3.5]) },
  { name: 'beginTurn: NaN token', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([NaN]) },
  { name: 'beginTurn: token 2^31', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([2 ** 31]) },
  { name: 'beginTurn: token 2^32 + 5 (would wrap to 5)', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([2 ** 32 + 5]) },
  { name: 'beginTurn: string tokens', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(any(['a', 'b'])) },
  { name: 'beginTurn: array-like with holes', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(any({ length: 2 })) },
  { name: 'beginTurn: a number as input', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(any(12345)) },
  { name: 'beginTurn: null input', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(any(null)) },
  { name: 'beginTurn: input that leaves no room to generate', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Array(2048).fill(70)) },
  {
    name: 'beginTurn: input over the request maxSessionTokens',
    code: 'INVALID_ARGUMENT',
    setup: (ctx) => {
      ctx.request.close()
      ctx.request = ctx.engine.createRequest({ maxSessionTokens: 8 })
    },
    call: ({ request }) => request.beginTurn('12345678'),
  },

  // ----- turn options -----
  { name: 'turn: temperature -1', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: -1 }) },
  { name: 'turn: temperature NaN', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: NaN }) },
  { name: 'turn: topP 0', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, topP: 0 }) },
  { name: 'turn: topP above 1', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, topP: 1.5 }) },
  { name: 'turn: minP above 1', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, minP: 1.5 }) },
  { name: 'turn: negative minP', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { minP: -0.1 }) },
  { name: 'turn: repetitionPenalty 0', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { repetitionPenalty: 0 }) },
  { name: 'turn: repetitionPenalty Infinity', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { repetitionPenalty: Infinity }) },
  { name: 'turn: presencePenalty above 2', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { presencePenalty: 2.5 }) },
  { name: 'turn: frequencyPenalty below -2', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { frequencyPenalty: -3 }) },
  { name: 'turn: frequencyPenalty a string', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { frequencyPenalty: '1' as never }) },
  { name: 'turn: negative topK', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, topK: -1 }) },
  { name: 'turn: fractional topK', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, topK: 2.5 }) },
  { name: 'turn: negative maxGeneratedTokens', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { maxGeneratedTokens: -1 }) },
  { name: 'turn: maxGeneratedTokens 2^32', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { maxGeneratedTokens: 2 ** 32 }) },
  { name: 'turn: fractional maxGeneratedTokens', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { maxGeneratedTokens: 1.5 }) },
  { name: 'turn: empty stop sequence', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { stopTokenIds: [[]] }) },
  { name: 'turn: stop token outside the vocabulary', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { stopTokenIds: [[32000]] }) },
  { name: 'turn: stopTokenIds not nested', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any({ stopTokenIds: [5] })) },
  { name: 'turn: negative sampler seed', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, seed: -3 }) },
  { name: 'turn: fractional sampler seed', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', { temperature: 1, seed: 0.5 }) },
  { name: 'turn: ignoreEos not a boolean', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any({ ignoreEos: 'yes' })) },
  { name: 'turn: signal not an AbortSignal', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any({ signal: {} })) },
  { name: 'turn: stop not an array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any({ stop: 'END' })) },
  { name: 'turn: unknown option', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any({ surprise: 1 })) },
  { name: 'turn: options not an object', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn('x', any('greedy')) },

  // ----- prefill -----
  { name: 'prefill: empty input', code: 'INVALID_ARGUMENT', call: ({ request }) => request.prefill('') },
  { name: 'prefill: token outside the vocabulary', code: 'INVALID_ARGUMENT', call: ({ request }) => request.prefill([40000]) },

  // ----- turn state -----
  {
    name: 'beginTurn while a turn is queued',
    code: 'TURN_ACTIVE',
    setup: ({ request }) => void request.beginTurn('first', { maxGeneratedTokens: 2 }),
    call: ({ request }) => request.beginTurn('second'),
  },
  {
    name: 'prefill while a turn is queued',
    code: 'TURN_ACTIVE',
    setup: ({ request }) => void request.beginTurn('first', { maxGeneratedTokens: 2 }),
    call: ({ request }) => request.prefill('more'),
  },
  {
    name: 'beginTurn while the finish event is retained',
    code: 'EVENTS_PENDING',
    setup: (ctx) => {
      const second = ctx.engine.createRequest()
      ctx.request.beginTurn('aa', { maxGeneratedTokens: 1 })
      second.beginTurn('bb', { maxGeneratedTokens: 1 })
      const one = ctx.engine.createEventBuffer(1)
      expect(ctx.engine.runSync(one)).toBe(1)
      if (one.at(0).request === ctx.request) ctx.request = second
    },
    call: ({ request }) => request.beginTurn('cc', { maxGeneratedTokens: 1 }),
  },

  // ----- token ids: 0 <= id < vocabSize in every input form, on every entry point -----
  { name: 'beginTurn: a negative id in an Int32Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Int32Array([4, -9, 4])) },
  { name: 'beginTurn: -1 alone in an Int32Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Int32Array([-1])) },
  { name: 'beginTurn: a negative id in an array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn([4, -1]) },
  { name: 'beginTurn: an id past the vocabulary in a Uint16Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Uint16Array([5, 65535])) },
  { name: 'beginTurn: an id past the vocabulary in a Uint32Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Uint32Array([2 ** 32 - 1])) },
  { name: 'beginTurn: a fraction in a Float64Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Float64Array([1.5])) },
  { name: 'beginTurn: a negative id in an Int8Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.beginTurn(new Int8Array([7, -3])) },
  { name: 'prefill: a negative id in an Int32Array', code: 'INVALID_ARGUMENT', call: ({ request }) => request.prefill(new Int32Array([-2147483648])) },
  { name: 'prefill: an id past the vocabulary', code: 'INVALID_ARGUMENT', call: ({ request }) => request.prefill(new Int32Array([32000])) },
  {
    name: 'generate: a negative id in an Int32Array',
    code: 'INVALID_ARGUMENT',
    driven: true,
    call: ({ engine }) => engine.generate(new Int32Array([4, -9, 4])),
    beforeSmoke: ({ engine }) => expect(engine.stats().activeRequests).toBe(1),
  },
  {
    name: 'generate: an id past the vocabulary in a Uint32Array',
    code: 'INVALID_ARGUMENT',
    driven: true,
    call: ({ engine }) => engine.generate(new Uint32Array([40_000])),
    beforeSmoke: ({ engine }) => expect(engine.stats().activeRequests).toBe(1),
  },

  // ----- sizes: documented-valid sizes work; past the limit, INVALID_ARGUMENT names the option -----
  { name: 'options: numBlocks above 2^24', code: 'INVALID_ARGUMENT', call: ({ mod }) => expectNamed(() => mod.Engine.simulated({ numBlocks: 2 ** 24 + 1 }), 'numBlocks') },
  { name: 'options: maxLength above 2^24', code: 'INVALID_ARGUMENT', call: ({ mod }) => expectNamed(() => mod.Engine.simulated({ maxLength: 2 ** 24 + 1 }), 'maxLength') },
  {
    name: 'options: numBlocks x blockSize past the simulator\'s 2^28 slots',
    code: 'INVALID_ARGUMENT',
    call: ({ mod }) => expectNamed(() => mod.Engine.simulated({ numBlocks: 2 ** 24, blockSize: 32 }), 'numBlocks'),
  },

  // ----- cancellation -----
  { name: 'cancelTurn(1.5)', code: 'INVALID_ARGUMENT', call: ({ request }) => request.cancelTurn(1.5) },
  { name: 'cancelTurn(-1)', code: 'INVALID_ARGUMENT', call: ({ request }) => request.cancelTurn(-1) },
  { name: 'cancelTurn(NaN)', code: 'INVALID_ARGUMENT', call: ({ request }) => request.cancelTurn(NaN) },
  { name: 'cancelTurn(2^32)', code: 'INVALID_ARGUMENT', call: ({ request }) => request.cancelTurn(2 ** 32) },
  { name: "cancelTurn('1')", code: 'INVALID_ARGUMENT', call: ({ request }) => request.cancelTurn(any('1')) },

  // ----- run -----
  { name: 'runSync with a buffer from another engine', code: 'WRONG_ENGINE', call: ({ engine, other }) => engine.runSync(other.createEventBuffer(4)) },
  { name: 'run with a buffer from another engine', code: 'WRONG_ENGINE', async: 'throw-or-reject', call: ({ engine, other }) => engine.run(other.createEventBuffer(4)) },
  { name: 'runSync with a plain object', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.runSync(any({ capacity: 4, count: 0 })) },
  { name: 'runSync without a buffer', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.runSync(any(undefined)) },
  {
    name: 'runSync on a driven engine',
    code: 'ENGINE_DRIVEN',
    driven: true,
    setup: ({ engine }) => engine.start(),
    call: ({ engine, buffer }) => engine.runSync(buffer),
  },
  {
    name: 'run on a driven engine',
    code: 'ENGINE_DRIVEN',
    driven: true,
    async: 'throw-or-reject',
    setup: ({ engine }) => engine.start(),
    call: ({ engine, buffer }) => engine.run(buffer),
  },

  // ----- text -----
  { name: 'detokenize: id outside the vocabulary', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.detokenize([32000]) },
  { name: 'detokenize: negative id', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.detokenize([-5]) },
  { name: 'detokenize: a string', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.detokenize(any('abc')) },
  { name: 'tokenize: a number', code: 'INVALID_ARGUMENT', call: ({ engine }) => engine.tokenize(any(42)) },

  // ----- generate (its own request must not leak when refused) -----
  {
    name: 'generate: empty input',
    code: 'INVALID_ARGUMENT',
    driven: true,
    call: ({ engine }) => engine.generate(''),
    beforeSmoke: ({ engine }) => expect(engine.stats().activeRequests).toBe(1),
  },
  {
    name: 'generate: maxSessionTokens above maxLength',
    code: 'INVALID_ARGUMENT',
    driven: true,
    call: ({ engine }) => engine.generate('x', { maxSessionTokens: 5000 }),
    beforeSmoke: ({ engine }) => expect(engine.stats().activeRequests).toBe(1),
  },
  {
    name: 'generate: temperature -1',
    code: 'INVALID_ARGUMENT',
    driven: true,
    call: ({ engine }) => engine.generate('x', { temperature: -1 }),
    beforeSmoke: ({ engine }) => expect(engine.stats().activeRequests).toBe(1),
  },

  // ----- closed requests -----
  { name: 'beginTurn on a closed request', code: 'REQUEST_CLOSED', setup: ({ request }) => request.close(), call: ({ request }) => request.beginTurn('x') },
  { name: 'prefill on a closed request', code: 'REQUEST_CLOSED', setup: ({ request }) => request.close(), call: ({ request }) => request.prefill('x') },

  // ----- a closed engine -----
  { name: 'closed engine: createRequest', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine }) => engine.createRequest() },
  { name: 'closed engine: runSync', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine, buffer }) => engine.runSync(buffer) },
  {
    name: 'closed engine: run',
    code: 'ENGINE_CLOSED',
    dead: true,
    async: 'throw-or-reject',
    setup: ({ engine }) => engine.close(),
    call: ({ engine, buffer }) => engine.run(buffer),
  },
  { name: 'closed engine: beginTurn', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ request }) => request.beginTurn('x') },
  { name: 'closed engine: createEventBuffer', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine }) => engine.createEventBuffer(4) },
  { name: 'closed engine: tokenize', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine }) => engine.tokenize('x') },
  { name: 'closed engine: generate', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine }) => engine.generate('x') },
  { name: 'closed engine: start', code: 'ENGINE_CLOSED', dead: true, setup: ({ engine }) => engine.close(), call: ({ engine }) => engine.start() },

  // ----- an unhealthy engine -----
  {
    name: 'unhealthy engine: createRequest',
    code: 'ENGINE_UNHEALTHY',
    dead: true,
    engine: { faults: { fatalSteps: [0] } },
    setup: ({ engine, request, buffer }) => {
      request.beginTurn('x', { maxGeneratedTokens: 2 })
      expect(engine.runSync(buffer)).toBe(1)
      expect(buffer.at(0).errorCode).toBe('engine-execution-failure')
    },
    call: ({ engine }) => engine.createRequest(),
  },
  {
    name: 'unhealthy engine: runSync',
    code: 'ENGINE_UNHEALTHY',
    dead: true,
    engine: { faults: { fatalSteps: [0] } },
    setup: ({ engine, request, buffer }) => {
      request.beginTurn('x', { maxGeneratedTokens: 2 })
      engine.runSync(buffer)
    },
    call: ({ engine, buffer }) => engine.runSync(buffer),
  },

  // ----- loading models -----
  // ----- JSON-like arguments: checked before they cross (a deep one trapped the wasm instance) -----
  {
    name: 'applyChatTemplate: content nested 5,000 deep',
    code: 'INVALID_ARGUMENT',
    call: ({ engine }) => expectNamed(() => engine.applyChatTemplate([{ role: 'user', content: nested(5000) as never }]), 'messages[0].content[0]', 'more than 64'),
  },
  {
    name: 'applyChatTemplate: a message that contains itself',
    code: 'INVALID_ARGUMENT',
    call: ({ engine }) => expectNamed(() => engine.applyChatTemplate([selfContaining() as never]), 'messages[0].self refers back to messages[0]', 'cycle'),
  },
  {
    name: 'chat: tools nested 5,000 deep',
    code: 'INVALID_ARGUMENT',
    call: ({ engine }) => expectNamed(() => engine.chat([{ role: 'user', content: 'hi' }], { tools: [nested(5000)] }), 'options.tools[0][0]', 'more than 64'),
  },
  {
    name: 'createChat: a send of a message that contains itself',
    code: 'INVALID_ARGUMENT',
    call: ({ engine }) => expectNamed(() => engine.createChat().send(selfContaining() as never), 'content.self refers back to content'),
  },
  {
    name: 'applyChatTemplate: shared branches that expand past the value budget',
    code: 'INVALID_ARGUMENT',
    call: ({ engine }) => {
      let bomb: unknown = 'x'
      for (let i = 0; i < 40; i++) bomb = [bomb, bomb]
      return expectNamed(() => engine.applyChatTemplate([{ role: 'user', content: bomb as never }]), 'at most 500000')
    },
  },
  { name: 'applyChatTemplate: 64 levels is the limit, 65 is refused', code: 'INVALID_ARGUMENT', call: ({ engine }) => {
    // The messages array and the message are 2 levels: 62 arrays of content make 64.
    expect(engine.applyChatTemplate([{ role: 'user', content: nested(62) as never }])).toContain('<|im_start|>user')
    return engine.applyChatTemplate([{ role: 'user', content: nested(63) as never }])
  } },
  { name: 'Engine.load on wasm', code: 'UNSUPPORTED', only: 'wasm', async: 'reject', call: ({ mod }) => mod.Engine.load('/nonexistent/model') },
  { name: 'Engine.load of a missing folder', code: 'MODEL_LOAD', only: 'native', async: 'reject', call: ({ mod }) => mod.Engine.load('/nonexistent/model') },
]

describe.each(BACKENDS)('bad input (%s)', (backend: BackendName) => {
  const mod = ortex(backend)
  const engines: Engine[] = []

  afterEach(async () => {
    for (const engine of engines.splice(0)) await engine.close()
  })

  function simulated(options?: Record<string, unknown>): Engine {
    const engine = mod.Engine.simulated(options as any)
    engines.push(engine)
    return engine
  }

  it('has at least 40 distinct cases on this backend', () => {
    const mine = cases.filter((c) => !c.only || c.only === backend)
    expect(mine.length).toBeGreaterThanOrEqual(40)
    expect(new Set(mine.map((c) => c.name)).size).toBe(mine.length)
  })

  it.each(cases.filter((c) => !c.only || c.only === backend).map((c) => [c.name, c] as const))('%s', async (_name, testCase) => {
    const engine = simulated({ seed: 1, ...testCase.engine })
    const ctx: Ctx = { mod, engine, other: simulated({ seed: 2 }), request: engine.createRequest(), buffer: engine.createEventBuffer(8) }
    await testCase.setup?.(ctx)

    if (testCase.async === 'reject') await expectRejects(mod, () => testCase.call(ctx), testCase.code)
    else if (testCase.async) await expectCodeAsync(mod, () => testCase.call(ctx), testCase.code)
    else expectCode(mod, () => testCase.call(ctx), testCase.code)

    if (testCase.dead) {
      // close() and Request.close() still work; a fresh engine works.
      ctx.request.close()
      await ctx.engine.close()
      smokeGeneration(simulated())
      return
    }
    if (testCase.driven) await ctx.engine.stop()
    testCase.beforeSmoke?.(ctx)
    ;(ctx.engine as any).checkInvariants()
    smokeGeneration(ctx.engine)
    if (ctx.request.state === 'created') {
      // The refused call consumed no turn id and left the request usable.
      expect(ctx.request.beginTurn('again', { maxGeneratedTokens: 1 }).id).toBe(1)
      drain(ctx.engine, ctx.buffer)
    }
    ;(ctx.engine as any).checkInvariants()
  })
})

// -----------------------------------------------------------------------------------------------
// Hostile JSON-like values through every public entry that takes them: each call either works or
// throws an OrtexError whose code is one of ERROR_CODES (napi-rs's own `InvalidArg` leaked here
// once), and a value JSON cannot hold is INVALID_ARGUMENT.
// -----------------------------------------------------------------------------------------------

/** Values JSON cannot hold, each made fresh (some are stateful). */
const HOSTILE: [string, () => unknown][] = [
  ['nested 5,000 deep', () => nested(5000)],
  ['an object that contains itself', () => selfContaining()],
  ['an array that contains itself', () => {
    const array: unknown[] = []
    array.push(array)
    return array
  }],
  ['shared branches expanding to 2^40 values', () => {
    let bomb: unknown = 'x'
    for (let i = 0; i < 40; i++) bomb = [bomb, bomb]
    return bomb
  }],
  ['a BigInt', () => 10n],
  ['NaN', () => Number.NaN],
  ['Infinity', () => Number.POSITIVE_INFINITY],
  ['-Infinity', () => Number.NEGATIVE_INFINITY],
  ['a function', () => () => 1],
  ['a symbol', () => Symbol('s')],
  ['undefined in an array', () => ['a', undefined]],
  ['a sparse array', () => {
    const array = ['a']
    array[3] = 'b'
    return array
  }],
  ['a sparse array of length 2^32 - 1', () => {
    const array: unknown[] = []
    array.length = 2 ** 32 - 1
    return array
  }],
  ['an object whose getter throws', () => ({ role: 'user', get content(): string { throw new Error('getter boom') } })],
  ['an object whose getter throws a non-Error', () => ({ get role(): string { throw Object.create(null) } })],
  ['a Proxy whose traps throw', () => {
    const boom = () => {
      throw new Error('trap boom')
    }
    return new Proxy({}, { get: boom, has: boom, ownKeys: boom, getPrototypeOf: boom, getOwnPropertyDescriptor: boom })
  }],
  ['a revoked Proxy', () => {
    const { proxy, revoke } = Proxy.revocable({}, {})
    revoke()
    return proxy
  }],
  ['a Proxy array that nests forever', () => {
    const deeper = (): unknown =>
      new Proxy([], {
        get: (target, key) => (key === 'length' ? 1 : key === '0' ? deeper() : Reflect.get(target, key)),
        has: (target, key) => key === '0' || Reflect.has(target, key),
      })
    return deeper()
  }],
  ['a Date', () => new Date(0)],
  ['a Map', () => new Map([['a', 1]])],
  ['an Int32Array', () => new Int32Array(2)],
]

type Entry = (engine: Engine, mod: OrtexModule, value: unknown) => unknown

/** Where the value crosses as JSON every value above is refused; elsewhere (an options object, a
 *  token id list) some are fine (a Date as options has no keys, an Int32Array is token ids). */
const JSON_SLOT = /message|content|extra|tools|documents|variables|options\.system|\.stop\)|\.seed|sessionId/

const hi = [{ role: 'user', content: 'hi' }]
const one = { maxGeneratedTokens: 1 }

/** Every public entry that takes JSON-like values, with the hostile value at one place. */
const ENTRIES: [string, Entry][] = [
  ['applyChatTemplate(messages)', (engine, _mod, value) => engine.applyChatTemplate(value as never)],
  ['applyChatTemplate(messages[0])', (engine, _mod, value) => engine.applyChatTemplate([value] as never)],
  ['applyChatTemplate(messages[0].content)', (engine, _mod, value) => engine.applyChatTemplate([{ role: 'user', content: value }] as never)],
  ['applyChatTemplate(messages[0].extra)', (engine, _mod, value) => engine.applyChatTemplate([{ role: 'user', content: 'x', extra: value }] as never)],
  ['applyChatTemplate(options)', (engine, _mod, value) => engine.applyChatTemplate(hi, value as never)],
  ['applyChatTemplate(options.tools)', (engine, _mod, value) => engine.applyChatTemplate(hi, { tools: value as never })],
  ['applyChatTemplate(options.tools[0])', (engine, _mod, value) => engine.applyChatTemplate(hi, { tools: [value] })],
  ['applyChatTemplate(options.documents[0])', (engine, _mod, value) => engine.applyChatTemplate(hi, { documents: [{ text: value }] })],
  ['applyChatTemplate(options.variables)', (engine, _mod, value) => engine.applyChatTemplate(hi, { variables: value as never })],
  ['applyChatTemplate(options.variables.x)', (engine, _mod, value) => engine.applyChatTemplate(hi, { variables: { x: value } })],
  ['chat(messages[0].content)', (engine, _mod, value) => engine.chat([{ role: 'user', content: value }] as never, one)],
  ['chat(options.tools[0])', (engine, _mod, value) => engine.chat(hi, { ...one, tools: [value] })],
  ['chat(options.variables)', (engine, _mod, value) => engine.chat(hi, { ...one, variables: value as never })],
  ['chat(options.stop)', (engine, _mod, value) => engine.chat(hi, { ...one, stop: value as never })],
  ['createChat(options.tools[0])', (engine, _mod, value) => engine.createChat({ tools: [value] }).send('hi', one)],
  ['createChat(options.variables)', (engine, _mod, value) => engine.createChat({ variables: value as never }).send('hi', one)],
  ['createChat(options.system)', (engine, _mod, value) => engine.createChat({ system: value as never })],
  ['send(message)', (engine, _mod, value) => engine.createChat().send(value as never, one)],
  ['send(message.content)', (engine, _mod, value) => engine.createChat().send({ role: 'user', content: value } as never, one)],
  ['send(options)', (engine, _mod, value) => engine.createChat().send('hi', value as never)],
  ['send(options.stopTokenIds[0])', (engine, _mod, value) => engine.createChat().send('hi', { ...one, stopTokenIds: [value as never] })],
  ['DuplexSessionManager.open(options)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open(value as never)],
  ['DuplexSessionManager.open(options.turn)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open({ turn: value as never })],
  ['DuplexSessionManager.open(options.turn.stop)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open({ turn: { stop: value as never } })],
  ['DuplexSessionManager.open(options.turn.seed)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open({ turn: { seed: value as never } })],
  ['DuplexSessionManager.open(options.sessionId)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open({ sessionId: value as never })],
  ['session.update(config)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open().update(value as never)],
  ['session.update(config.turn)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open().update({ turn: value as never })],
  ['session.update(config.turn.stopTokenIds)', (engine, mod, value) => new mod.DuplexSessionManager(engine).open().update({ turn: { stopTokenIds: value as never } })],
]

describe.each(BACKENDS)('hostile JSON-like values (%s)', (backend: BackendName) => {
  const mod = ortex(backend)

  it.each(ENTRIES)('%s: every value JSON cannot hold is INVALID_ARGUMENT, and the engine still works', async (entry, call) => {
    const engine = mod.Engine.simulated({ seed: 1 })
    try {
      for (const [what, make] of HOSTILE) {
        let thrown: unknown = null
        try {
          call(engine, mod, make())
        } catch (error) {
          thrown = error
        }
        if (thrown === null) {
          expect(JSON_SLOT.test(entry), `${what}: the call returned`).toBe(false)
          continue
        }
        expect(thrown, `${what}: ${String(thrown)}`).toBeInstanceOf(mod.OrtexError)
        const { code } = thrown as { code: string }
        expect(mod.ERROR_CODES, `${what}: ${String(thrown)}`).toContain(code)
        expect(code, `${what}: ${String(thrown)}`).toBe('INVALID_ARGUMENT')
      }
      expect(engine.healthy).toBe(true)
      if (engine.hasPendingWork()) await engine.stop()
      ;(engine as any).checkInvariants()
      expect(engine.applyChatTemplate(hi)).toContain('hi')
      expect((await engine.chat(hi, { maxGeneratedTokens: 2 }).done).finishReason).toBe('max-generated-tokens')
    } finally {
      await engine.close()
    }
  })

  it.runIf(backend === 'native')('the addon itself answers INVALID_ARGUMENT, not napi-rs\'s InvalidArg, for what it cannot convert', () => {
    // Below the facade's check: what napi-rs's conversion refuses must still carry a known code.
    const backendImpl = (mod.Engine as any)._backend
    const template = backendImpl.chat(null, [])
    const core = backendImpl.simulated({})
    const cyclic: Record<string, unknown> = { role: 'user' }
    cyclic.self = cyclic
    // The binding throws plain errors with a `code` (the facade makes them OrtexErrors).
    const codeOf = (call: () => unknown): unknown => {
      try {
        call()
      } catch (error) {
        return (error as { code?: unknown }).code
      }
      return 'returned'
    }
    for (const value of [10n, Number.NaN, () => 1, Symbol('s'), [undefined], nested(200), cyclic]) {
      expect(codeOf(() => template.render({ messages: [{ role: 'user', content: value }] }))).toBe('INVALID_ARGUMENT')
      expect(codeOf(() => core.createRequest({ maxSessionTokens: value }))).toBe('INVALID_ARGUMENT')
      expect(codeOf(() => core.createSessions({ maxSessions: value }))).toBe('INVALID_ARGUMENT')
    }
    expect(template.render({ messages: [{ role: 'user', content: 'hi' }] })).toContain('hi')
    core.close()
  })

  it('a copy crosses, not the caller\'s value: a __proto__ key stays a key, and a getter is read once', () => {
    const engine = mod.Engine.simulated({ seed: 1 })
    let reads = 0
    const message = {
      role: 'user',
      get content() {
        reads++
        return reads === 1 ? 'first' : nested(5000)
      },
    }
    expect(engine.applyChatTemplate([message as never])).toContain('first')
    expect(reads).toBe(1)
    const variables = JSON.parse('{"__proto__": {"polluted": true}}') as Record<string, unknown>
    expect(engine.applyChatTemplate(hi, { variables })).toContain('hi')
    expect(({} as Record<string, unknown>).polluted).toBeUndefined()
    void engine.close()
  })
})

// -----------------------------------------------------------------------------------------------
// A trap poisons its WebAssembly instance, and only it. Every wasm engine lives in the memory of
// one instance; a trap leaves that memory unknown, so the engines on it fail, and the engines made
// afterwards get a fresh instance (before: every wasm engine in the process, old or new, threw).
// -----------------------------------------------------------------------------------------------

describe('a trap in the WebAssembly instance (wasm)', () => {
  const mod = ortex('wasm')

  /** Traps the instance under an engine with a turn and a session, checks they fail, closes it.
   *  Nothing it made stays reachable once it returns. */
  async function trapUnderAnEngine(): Promise<void> {
    const before = mod.Engine.simulated({ seed: 1 })
    const session = new mod.DuplexSessionManager(before).open()
    const events: string[] = []
    const reading = (async () => {
      for await (const event of session.events()) events.push(event.type)
    })()
    const request = before.createRequest()
    const turn = request.beginTurn('hello', { maxGeneratedTokens: 50 })
    // A real trap: the value the facade refuses, given to the binding through the backend (as the
    // facade would call it), overflows the wasm stack ("memory access out of bounds").
    const template = (mod.Engine as any)._backend.chat(null, [])
    expectCode(mod, () => template.render({ messages: [{ role: 'user', content: nested(5000) }] }), 'ENGINE_UNHEALTHY')
    await macrotask()
    // The engine on the trapped instance: unhealthy, its turn failed, its session closed.
    expect(before.healthy).toBe(false)
    expect((await turn.done).finishReason).toBe('failed')
    await reading
    expect(events).toEqual(['session.closed'])
    expectCode(mod, () => before.createRequest(), 'ENGINE_UNHEALTHY')
    expectCode(mod, () => before.tokenize('x'), 'ENGINE_UNHEALTHY')
    expectCode(mod, () => template.render({ messages: [{ role: 'user', content: 'x' }] }), 'ENGINE_UNHEALTHY')
    request.close()
    await before.close()
  }

  it('fails the engines on the trapped instance with ENGINE_UNHEALTHY; a new engine gets a fresh instance and works', async () => {
    await trapUnderAnEngine()
    // New engines: a fresh instance, everything works.
    const after = mod.Engine.simulated({ seed: 1 })
    smokeGeneration(after)
    expect(after.applyChatTemplate([{ role: 'user', content: 'hi' }])).toContain('hi')
    expect(new mod.DuplexSessionManager(after).open().append('more').seq).toBe(1)
    ;(after as any).checkInvariants()
    await after.close()
  })

  it('collecting what lived on a trapped instance runs nothing there (a free would trap in a finalizer)', async () => {
    // Nothing made here stays reachable once it returns.
    const trapUnreachably = async (): Promise<void> => {
      const engine = mod.Engine.simulated({ seed: 1 })
      engine.createRequest().beginTurn('hello', { maxGeneratedTokens: 5 })
      const template = (mod.Engine as any)._backend.chat(null, [])
      expectCode(mod, () => template.render({ messages: [{ role: 'user', content: nested(5000) }] }), 'ENGINE_UNHEALTHY')
      await engine.close()
    }
    await trapUnreachably()
    // wasm-bindgen's finalizers free what is collected; on the trapped memory a free traps, an
    // uncaught exception in a finalizer (vitest reports it; in a plain process it is fatal).
    for (let i = 0; i < 5; i++) {
      ;(globalThis as { gc?: () => void }).gc?.()
      await new Promise((resolve) => setTimeout(resolve, 10))
    }
    const fresh = mod.Engine.simulated({ seed: 2 })
    smokeGeneration(fresh)
    await fresh.close()
  })
})
