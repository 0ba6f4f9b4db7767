// Streamed responses to clients that never read, over raw sockets against the simulated model:
// generation is paced by the reader (a response stops pulling its turn while its client is above
// maxBufferedBytes, and the turn is then held in the engine), so what the server holds for them
// is bounded long before sendStallMs; a client that stays above for sendStallMs is dropped and
// its turn cancelled; and clients that go away take their turns with them at once, without the
// server formatting what those turns had made for nobody (which used to hold the event loop for
// seconds: /health answered after 12-25 s).
import { type Socket, connect } from 'node:net'
import { afterEach, describe, expect, it } from 'vitest'
import { ortex } from '../helpers/backends'

const { Engine, startServer } = ortex('native')
type Server = Awaited<ReturnType<typeof startServer>>
type EngineT = ReturnType<typeof Engine.simulated>

/** A safety net for waits that should end quickly. */
const WAIT_LIMIT_MS = 20_000

async function until(condition: () => boolean, what: string): Promise<void> {
  const start = Date.now()
  while (!condition()) {
    if (Date.now() - start > WAIT_LIMIT_MS) throw new Error(`timed out waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 5))
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/** Waits until the engine generated nothing for `quietMs`; returns how many tokens it had. */
async function untilGenerationStops(engine: EngineT, quietMs: number): Promise<number> {
  const start = Date.now()
  let last = -1
  for (;;) {
    const generated = engine.stats().generatedTokens
    if (generated === last) return generated
    if (Date.now() - start > WAIT_LIMIT_MS) throw new Error(`generation did not stop: ${generated} tokens`)
    last = generated
    await sleep(quietMs)
  }
}

/** Unpaced (before issue 30's pacing), four such clients made ~225,000 tokens in 5 s and kept
 *  going at ~50,000 a second, the server's RSS growing by ~240 MiB; paced, ~22,000 tokens (what
 *  the sockets' buffers took, plus 256 chunks a turn) and ~60 MiB, then nothing more. */
const PACED_TOKEN_BOUND = 4 * 15_000

/** The request: a long stream with 20 alternatives per token, the costliest chunks. */
const BODY = JSON.stringify({
  model: 'ortex-simulated',
  messages: [{ role: 'user', content: 'Tell me everything.' }],
  stream: true,
  max_tokens: 100_000,
  logprobs: true,
  top_logprobs: 20,
})

/** A client that sends the request and never reads a byte of the answer. */
function silentClient(server: Server): Socket {
  const socket = connect(server.port, server.host)
  socket.pause()
  socket.on('error', () => {})
  socket.write(
    `POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n` +
      `content-length: ${Buffer.byteLength(BODY)}\r\n\r\n${BODY}`,
  )
  return socket
}

/** Milliseconds /health takes to answer. */
async function healthMs(server: Server): Promise<number> {
  const start = performance.now()
  const response = await fetch(`${server.url}/health`)
  expect(response.status).toBe(200)
  await response.text()
  return performance.now() - start
}

describe('streaming clients that never read', () => {
  let engine: EngineT
  let server: Server
  let sockets: Socket[] = []

  async function start(options: Record<string, unknown>): Promise<void> {
    engine = Engine.simulated({ seed: 1, maxBatchSize: 32, maxLength: 200_000 })
    server = await startServer(engine, { port: 0, ...options })
    sockets = Array.from({ length: 4 }, () => silentClient(server))
    await until(() => engine.stats().activeRequests === 4, 'the four turns to start')
  }

  afterEach(async () => {
    for (const socket of sockets) socket.destroy()
    await server.close()
    await engine.close()
  })

  it('are dropped after sendStallMs and their turns cancelled: generation stops while they still do not read', async () => {
    await start({ maxBufferedBytes: 64 * 1024, sendStallMs: 200 })
    await until(() => engine.stats().activeRequests === 0, 'the stalled turns to be cancelled')
    const generated = engine.stats().generatedTokens
    // Bounded: far from the 4 x 100000 tokens the requests asked for.
    expect(generated).toBeLessThan(4 * 100_000)
    await sleep(300)
    expect(engine.stats().generatedTokens).toBe(generated)
    expect(engine.stats().freeBlocks).toBe(engine.stats().totalBlocks)
    expect(await healthMs(server)).toBeLessThan(1000)
  })

  it('pace their turns: generation stops while they do not read, long before sendStallMs', async () => {
    global.gc?.()
    const rss = process.memoryUsage().rss
    await start({}) // the default sendStallMs (30 s): only pacing stops these turns
    const generated = await untilGenerationStops(engine, 500)
    expect(generated).toBeLessThan(PACED_TOKEN_BOUND)
    await sleep(1000)
    expect(engine.stats().generatedTokens).toBe(generated)
    expect(engine.stats().activeRequests).toBe(4) // held, not dropped
    global.gc?.()
    expect(process.memoryUsage().rss - rss).toBeLessThan(160 * 2 ** 20)
    expect(await healthMs(server)).toBeLessThan(1000)
  })

  it('that go away cancel their turns at once, and what the turns made for them is dropped unformatted', async () => {
    // The stall bound is far away: only the clients' leaving ends the turns.
    await start({})
    // A backlog: chunks made for clients that do not read, as many as pacing lets them have.
    await untilGenerationStops(engine, 300)
    for (const socket of sockets) socket.destroy()
    expect(await healthMs(server)).toBeLessThan(1000)
    await until(() => engine.stats().activeRequests === 0, 'the abandoned turns to be cancelled')
    const generated = engine.stats().generatedTokens
    await sleep(100)
    expect(engine.stats().generatedTokens).toBe(generated)
  })
})
