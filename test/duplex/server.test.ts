// End to end: the real WebSocket server (startDuplexServer, what `ortex serve` runs) on
// 127.0.0.1, port 0, driven by real `ws` clients, over both backends. No timing assertions:
// waits are bounded by message counts and a generous safety timeout, and where a test needs a
// response to be mid-way it pauses the engine (engine.stop()) instead of racing it.
import WebSocket from 'ws'
import { afterEach, describe, expect, it } from 'vitest'
import { ortex, selectedBackends } from '../helpers/backends'
import { macrotask, refusedUpgrade } from '../helpers/util'

/** A safety net for a wait that should end quickly; a test never asserts on time. */
const WAIT_LIMIT_MS = 20_000

class Client {
  readonly messages: any[] = []
  private cursor = 0
  private waiters: (() => void)[] = []
  closeCode: number | null = null

  private constructor(readonly ws: WebSocket) {
    ws.on('message', (data) => {
      this.messages.push(JSON.parse(data.toString()))
      this.wake()
    })
    ws.on('close', (code) => {
      this.closeCode = code
      this.wake()
    })
    ws.on('error', () => {})
  }

  static async connect(url: string, protocols: string[] = [], options: WebSocket.ClientOptions = {}): Promise<Client> {
    const ws = new WebSocket(url, protocols, options)
    await new Promise<void>((resolve, reject) => {
      ws.once('open', () => resolve())
      ws.once('error', reject)
    })
    return new Client(ws)
  }

  send(event: unknown): void {
    this.ws.send(typeof event === 'string' ? event : JSON.stringify(event))
  }

  /** The next message (after the ones already taken) that matches; earlier ones are skipped. */
  async next(match: (m: any) => boolean, what: string): Promise<any> {
    const deadline = Date.now() + WAIT_LIMIT_MS
    for (;;) {
      while (this.cursor < this.messages.length) {
        const message = this.messages[this.cursor++]
        if (match(message)) return message
      }
      if (this.closeCode !== null) throw new Error(`connection closed (${this.closeCode}) while waiting for ${what}`)
      if (Date.now() > deadline) throw new Error(`no ${what} within the safety limit; got ${JSON.stringify(this.messages.slice(-5))}`)
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, 250)
        this.waiters.push(() => {
          clearTimeout(timer)
          resolve()
        })
      })
    }
  }

  type(type: string): Promise<any> {
    return this.next((m) => m.type === type, type)
  }

  async waitClosed(): Promise<number> {
    await this.next(() => false, 'close').catch(() => undefined)
    return this.closeCode ?? -1
  }

  close(): void {
    this.ws.close()
  }

  private wake(): void {
    const waiters = this.waiters
    this.waiters = []
    for (const wake of waiters) wake()
  }
}

function checkSeq(messages: any[]): void {
  messages.forEach((m, i) => expect(m.server_event_seq).toBe(i + 1))
}

function sameWireFence(a: any, b: any): boolean {
  return JSON.stringify(a) === JSON.stringify(b)
}

describe.each(selectedBackends())('duplex server end to end (%s)', (backend) => {
  const mod = ortex(backend)
  let cleanups: (() => Promise<void> | void)[] = []

  async function start(options: Record<string, unknown> = {}, engineOptions: Record<string, unknown> = {}) {
    const engine = mod.Engine.simulated({ seed: 3, ...engineOptions })
    const server = await mod.startDuplexServer(engine, { port: 0, host: '127.0.0.1', sweepIntervalMs: 0, ...options })
    const clients: Client[] = []
    cleanups.push(async () => {
      for (const client of clients) client.ws.terminate()
      await server.close()
      await engine.close()
    })
    const connect = async (protocols: string[] = [], options: WebSocket.ClientOptions = {}) => {
      const client = await Client.connect(server.url, protocols, options)
      clients.push(client)
      return client
    }
    return { engine, server, connect }
  }

  afterEach(async () => {
    for (const cleanup of cleanups.reverse()) await cleanup()
    cleanups = []
  })

  it('with apiKey, an upgrade needs the key (header or subprotocol); without it HTTP 401 before any WebSocket', async () => {
    const { engine, server, connect } = await start({ apiKey: 'sk-duplex' })
    for (const [protocols, options] of [
      [[], {}],
      [[], { headers: { authorization: 'Bearer sk-other' } }],
      [['ortex', 'ortex-api-key.sk-other'], {}],
      [['ortex', 'ortex-api-key.'], {}],
    ] as const) {
      expect(await refusedUpgrade(server.url, [...protocols], options)).toEqual({ status: 401, authenticate: 'Bearer' })
    }
    expect(server.stats().connections).toBe(0)
    expect(engine.stats().generatedTokens).toBe(0)
    const byHeader = await connect([], { headers: { authorization: 'Bearer sk-duplex' } })
    // A browser's form: the key as an offered subprotocol; the server selects `ortex`, never the key.
    const byProtocol = await connect(['ortex-api-key.sk-duplex', 'ortex'])
    expect(byProtocol.ws.protocol).toBe('ortex')
    for (const client of [byHeader, byProtocol]) {
      client.send({ type: 'session.update', session: { max_output_tokens: 3 } })
      client.send({ type: 'input_text.append', text: 'hi', final: true })
      expect(await client.type('response.done')).toMatchObject({ status: 'completed', usage: { output_tokens: 3 } })
    }
    await expect(mod.startDuplexServer(engine, { port: 0, apiKey: '' })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
  })

  it('barge-in mid-response: response.done cancelled, nothing of it afterwards, the next response runs', async () => {
    const { engine, connect } = await start({ turn: { maxGeneratedTokens: 1000 } })
    const client = await connect()
    client.send({ type: 'input_text.append', text: 'tell me everything', final: true })
    const created = await client.type('session.created')
    expect(created.session.fence.epoch).toBe(0)
    expect(typeof created.resume_token).toBe('string')
    const response = await client.type('response.created')
    for (let i = 0; i < 3; i++) await client.type('response.output_text.delta')
    // Hold the engine so the barge-in lands mid-response for certain.
    await engine.stop()
    client.send({ type: 'barge_in', played_tokens: 2 })
    const cancelled = await client.type('response.cancelled')
    expect(cancelled.fence.epoch).toBe(1)
    const done = await client.next((m) => m.type === 'response.done', 'response.done')
    expect(done.status).toBe('cancelled')
    expect(sameWireFence(done.fence, response.fence)).toBe(true)
    engine.start()
    client.send({ type: 'session.update', session: { max_output_tokens: 4 } })
    await client.type('session.updated')
    client.send({ type: 'input_text.append', text: 'stop, what time is it?', final: true })
    const next = await client.type('response.created')
    expect(next.fence.epoch).toBe(1)
    const nextDone = await client.type('response.done')
    expect(nextDone).toMatchObject({ status: 'completed', finish_reason: 'max-generated-tokens' })
    expect(nextDone.usage.output_tokens).toBe(4)
    const afterDone = client.messages.slice(client.messages.indexOf(done) + 1)
    expect(afterDone.filter((m) => m.fence !== undefined && sameWireFence(m.fence, response.fence))).toEqual([])
    checkSeq(client.messages)
  })

  it('resume after a drop returns the same session; after the grace it expires and its KV is freed', async () => {
    let clock = 10_000
    const { engine, server, connect } = await start({ disconnectGraceMs: 5_000, now: () => clock, turn: { maxGeneratedTokens: 30 } })
    const total = engine.stats().totalBlocks
    const first = await connect()
    first.send({ type: 'session.update', session: { respond: 'on-final' } })
    const created = await first.type('session.created')
    const { id } = created.session
    const token = created.resume_token
    first.send({ type: 'input_text.append', text: 'remember this', final: true })
    await first.type('response.created')
    first.ws.terminate()
    const session = server.manager.get(id)!
    for (let i = 0; i < 10_000 && session.state !== 'detached'; i++) await macrotask()
    expect(session.state).toBe('detached')

    const second = await connect()
    second.send({ type: 'session.resume', session_id: id, resume_token: `${token}x`, lease_generation: 0 })
    expect((await second.type('error')).error.code).toBe('INVALID_RESUME_TOKEN')
    second.send({ type: 'session.resume', session_id: id, resume_token: token, lease_generation: 7 })
    expect((await second.type('error')).error.code).toBe('LEASE_GENERATION_MISMATCH')
    second.send({ type: 'session.resume', session_id: id, resume_token: token, lease_generation: 0 })
    const resumed = await second.type('session.resumed')
    expect(resumed.session.id).toBe(id)
    expect(resumed.session.lease_generation).toBe(1)
    // What the session produced meanwhile is delivered here.
    const done = await second.type('response.done')
    expect(done.status).toBe('completed')
    second.send({ type: 'input_text.append', text: 'and now?', final: true })
    expect((await second.type('response.done')).status).toBe('completed')
    checkSeq(second.messages)

    second.ws.terminate()
    for (let i = 0; i < 10_000 && session.state !== 'detached'; i++) await macrotask()
    clock += 4_999
    expect(server.collectExpired()).toBe(0)
    clock += 1
    expect(server.collectExpired()).toBe(1)
    expect(server.manager.get(id)).toBeUndefined()
    expect(engine.stats().activeRequests).toBe(0)
    for (let i = 0; i < 1000 && engine.stats().freeBlocks !== total; i++) await macrotask()
    expect(engine.stats().freeBlocks).toBe(total)
    const third = await connect()
    third.send({ type: 'session.resume', session_id: id, resume_token: token, lease_generation: 1 })
    expect((await third.type('error')).error).toMatchObject({ code: 'SESSION_CLOSED', type: 'session_error' })
  })

  it('idempotent retry: the same operation_id returns the first result with replayed: true', async () => {
    const { connect } = await start({ turn: { maxGeneratedTokens: 3 } })
    const client = await connect()
    client.send({ type: 'input_text.append', text: 'part one ', operation_id: 'op-1' })
    const first = await client.type('input.committed')
    expect(first).toMatchObject({ seq: 1, turn_seq: 1, replayed: false, operation_id: 'op-1' })
    client.send({ type: 'input_text.append', text: 'part one ', operation_id: 'op-1' })
    const retry = await client.type('input.committed')
    expect(retry).toMatchObject({ seq: 1, turn_seq: 1, replayed: true, operation_id: 'op-1' })
    client.send({ type: 'input_text.append', text: 'other text', operation_id: 'op-1' })
    expect((await client.type('error')).error.code).toBe('OPERATION_REUSED')
    client.send({ type: 'input_text.append', text: 'part two', final: true, operation_id: 'op-2' })
    const end = await client.type('input.committed')
    expect(end.seq).toBe(2)
    client.send({ type: 'input_text.append', text: 'part two', final: true, operation_id: 'op-2' })
    expect((await client.type('input.committed')).replayed).toBe(true)
    await client.type('response.done')
    expect(client.messages.filter((m) => m.type === 'response.created')).toHaveLength(1)
    // A stale fence (before a cancel) is refused; the connection keeps working.
    client.send({ type: 'response.cancel' })
    await client.type('response.cancelled')
    client.send({ type: 'input_text.append', text: 'late', fence: end.fence })
    expect((await client.type('error')).error.code).toBe('FENCE_MISMATCH')
    client.send({ type: 'input.commit' })
    expect((await client.type('input.committed')).seq).toBe(end.seq + 1)
    checkSeq(client.messages)
  })

  it('capacity: a session beyond max sessions gets a retryable error; a freed slot is reused', async () => {
    const { server, connect } = await start({ maxSessions: 2 })
    const a = await connect()
    const b = await connect()
    a.send({ type: 'session.update' })
    b.send({ type: 'session.update' })
    await a.type('session.created')
    await b.type('session.created')
    const c = await connect()
    c.send({ type: 'input_text.append', text: 'me too' })
    const refused = await c.type('error')
    expect(refused.error).toMatchObject({ type: 'capacity_error', code: 'CAPACITY_EXHAUSTED', retryable: true, event_type: 'input_text.append' })
    a.send({ type: 'session.close' })
    expect((await a.type('session.closed')).reason).toBe('client_close')
    expect(server.sessionCount).toBe(1)
    c.send({ type: 'input_text.append', text: 'me too' })
    await c.type('session.created')
    await c.type('input.committed')
  })

  it('serves 20 concurrent sessions to the end of their responses', async () => {
    const { engine, server, connect } = await start({ turn: { maxGeneratedTokens: 12 } })
    const clients = await Promise.all(Array.from({ length: 20 }, () => connect()))
    clients.forEach((client, i) => {
      client.send({ type: 'input_text.append', text: `question number ${i} ` })
      client.send({ type: 'input_text.append', text: 'please answer', final: true })
    })
    const dones = await Promise.all(clients.map((client) => client.type('response.done')))
    const ids = new Set<string>()
    for (const [i, client] of clients.entries()) {
      expect(dones[i]).toMatchObject({ status: 'completed', usage: { output_tokens: 12 } })
      const deltas = client.messages.filter((m) => m.type === 'response.output_text.delta' && m.token !== null)
      expect(deltas.map((d) => d.index)).toEqual([...Array(12).keys()])
      ids.add(client.messages.find((m) => m.type === 'session.created').session.id)
      checkSeq(client.messages)
    }
    expect(ids.size).toBe(20)
    expect(server.sessionCount).toBe(20)
    for (const client of clients) client.send({ type: 'session.close', reason: 'done' })
    await Promise.all(clients.map((client) => client.type('session.closed')))
    expect(server.sessionCount).toBe(0)
    expect(engine.stats().activeRequests).toBe(0)
  })

  it('malformed JSON, unknown types, bad fields and oversize messages get errors; everything keeps working', async () => {
    const { connect } = await start({ maxMessageBytes: 1024, turn: { maxGeneratedTokens: 5 } })
    const bystander = await connect()
    bystander.send({ type: 'input_text.append', text: 'I am unaffected', final: true })
    const client = await connect()
    const bad: [unknown, string][] = [
      ['{"type": "input_text.append", "text": ', 'INVALID_JSON'],
      ['[1, 2, 3]', 'INVALID_EVENT'],
      [{ type: 'conversation.item.create' }, 'UNKNOWN_EVENT'],
      [{ text: 'no type' }, 'INVALID_EVENT'],
      [{ type: 'input_text.append', text: 42 }, 'INVALID_EVENT'],
      [{ type: 'input_text.append', text: 'x', colour: 'red' }, 'INVALID_EVENT'],
      [{ type: 'input_text.append', text: 'x'.repeat(2000) }, 'MESSAGE_TOO_LARGE'],
      [{ type: 'session.heartbeat' }, 'NO_SESSION'],
      [{ type: 'response.truncate', played_tokens: -1 }, 'INVALID_EVENT'],
      [{ type: 'session.update', session: { max_output_tokens: -3 } }, 'INVALID_ARGUMENT'],
    ]
    for (const [message, code] of bad) {
      client.send(message)
      const error = await client.type('error')
      expect(error.error.code, JSON.stringify(message).slice(0, 80)).toBe(code)
    }
    client.ws.send(Buffer.from([1, 2, 3]), { binary: true })
    expect((await client.type('error')).error.code).toBe('INVALID_EVENT')
    // The refused session.update needed a session, so the connection has one now.
    expect(client.messages.filter((m) => m.type === 'session.created')).toHaveLength(1)
    client.send({ type: 'input_text.append', text: 'still here', final: true, event_id: 'e1' })
    expect((await client.type('input.committed')).seq).toBe(1)
    expect((await client.type('response.done')).status).toBe('completed')
    client.send({ type: 'response.truncate', played_tokens: 2 })
    await client.type('response.truncated')
    checkSeq(client.messages)
    // A frame beyond the WebSocket layer's own limit ends that connection only (close 1009).
    const reckless = await connect()
    reckless.send({ type: 'input_text.append', text: 'y'.repeat(2 << 20) })
    expect(await reckless.waitClosed()).toBe(1009)
    expect((await bystander.type('response.done')).status).toBe('completed')
    bystander.send({ type: 'session.heartbeat' })
    bystander.send({ type: 'input.commit' })
    expect((await bystander.type('input.committed')).final).toBe(true)
  })

  // ----- hostile clients (issue 15) -----

  it('echoes event_id on every error about a JSON object that carries one', async () => {
    const { connect } = await start()
    const client = await connect()
    const cases: [unknown, string][] = [
      [{ type: 'nope', event_id: 'abc' }, 'UNKNOWN_EVENT'],
      [{ event_id: 'no-type' }, 'INVALID_EVENT'],
      [{ type: 'input_text.append', text: 42, event_id: 'bad-text' }, 'INVALID_EVENT'],
      [{ type: 'input_text.append', text: 'x', colour: 'red', event_id: 'extra' }, 'INVALID_EVENT'],
      [{ type: 'session.heartbeat', event_id: 'no-session' }, 'NO_SESSION'],
    ]
    for (const [message, code] of cases) {
      client.send(message)
      const error = (await client.type('error')).error
      expect(error.code).toBe(code)
      expect(error.event_id).toBe((message as { event_id: string }).event_id)
    }
    client.send({ type: 'nope', event_id: 17 })
    expect((await client.type('error')).error.event_id).toBe(null)
    checkSeq(client.messages)
  })

  it('limits strings in characters and refuses lone surrogates', async () => {
    const { connect } = await start()
    const client = await connect()
    client.send({ type: 'input_text.append', text: 'hello', operation_id: 'é'.repeat(200), event_id: 'é'.repeat(256) })
    expect((await client.type('input.committed')).operation_id).toBe('é'.repeat(200))
    client.send({ type: 'input_text.append', text: 'x', operation_id: 'é'.repeat(257) })
    expect((await client.type('error')).error.code).toBe('INVALID_ARGUMENT')
    client.send('{"type":"input_text.append","text":"x","operation_id":"op-\\ud83d"}')
    expect((await client.type('error')).error.code).toBe('INVALID_EVENT')
    client.send({ type: 'session.close', reason: 'é'.repeat(200) })
    expect((await client.type('session.closed')).reason).toBe('é'.repeat(200))
  })

  it('checks the session id limit (128 characters) before any lookup: a longer id is INVALID_EVENT, not a closed session', async () => {
    const { connect } = await start()
    const first = await connect()
    first.send({ type: 'session.update', session: { respond: 'manual' } })
    const created = await first.type('session.created')
    const fence = created.session.fence
    const long = 'é'.repeat(129)
    const resumer = await connect()
    resumer.send({ type: 'session.resume', session_id: long, resume_token: created.resume_token, lease_generation: 0, event_id: 'r1' })
    const tooLong = (await resumer.type('error')).error
    expect(tooLong).toMatchObject({ code: 'INVALID_EVENT', event_id: 'r1' })
    expect(tooLong.message).toContain('128')
    // At the limit the id is a well-formed one that no session has.
    resumer.send({ type: 'session.resume', session_id: 'é'.repeat(128), resume_token: created.resume_token, lease_generation: 0 })
    expect((await resumer.type('error')).error.code).toBe('SESSION_CLOSED')
    // A fence names a session too.
    first.send({ type: 'response.cancel', fence: { ...fence, session_id: long } })
    expect((await first.type('error')).error.code).toBe('INVALID_EVENT')
    first.send({ type: 'response.cancel', fence })
    expect((await first.type('response.cancelled')).fence.session_id).toBe(fence.session_id)
  })

  it('bounds what it buffers for a client that floods and never reads, stops reading it, then closes it (1008)', async () => {
    const maxBufferedBytes = 64 * 1024
    const sendStallMs = 300
    const { server, connect } = await start({ maxBufferedBytes, sendStallMs, pingIntervalMs: 0 })
    const client = await connect()
    // The client stops reading: everything the server sends piles up on the server's side.
    const socket = (client.ws as unknown as { _socket: import('node:net').Socket })._socket
    socket.pause()
    let maxSeen = 0
    let sawPaused = false
    const sample = (): void => {
      const stats = server.stats()
      maxSeen = Math.max(maxSeen, stats.maxConnectionBufferedBytes)
      sawPaused ||= stats.pausedConnections === 1
    }
    const frame = JSON.stringify({ type: 'nope', event_id: 'e'.repeat(200) })
    for (let i = 0; i < 100_000; i++) {
      client.ws.send(frame)
      if (i % 500 === 0) {
        await macrotask()
        sample()
      }
    }
    sample()
    expect(sawPaused).toBe(true)
    // One socket read's worth of replies may land beyond the bound; nothing more.
    expect(maxSeen).toBeLessThan(maxBufferedBytes + (1 << 20))
    // Still not reading after sendStallMs: the server closes the connection.
    await new Promise((resolve) => setTimeout(resolve, 3 * sendStallMs))
    expect(server.stats().pausedConnections).toBe(0)
    socket.resume()
    expect(await client.waitClosed()).toBe(1008)
    const other = await connect()
    other.send({ type: 'input.commit' })
    expect((await other.type('error')).error.code).toBe('INVALID_ARGUMENT')
  })

  it('pings its connections and drops one that stops answering: its session detaches', async () => {
    const { server, connect } = await start({ pingIntervalMs: 50, disconnectGraceMs: 60_000 })
    const client = await connect()
    client.send({ type: 'session.update' })
    const created = await client.type('session.created')
    const healthy = await connect()
    healthy.send({ type: 'session.update' })
    await healthy.type('session.created')
    // A half-open connection: the client is there but answers nothing (not even pings).
    ;(client.ws as unknown as { _socket: import('node:net').Socket })._socket.pause()
    const session = server.manager.get(created.session.id)!
    for (let i = 0; i < 400 && session.state !== 'detached'; i++) await new Promise((resolve) => setTimeout(resolve, 10))
    expect(session.state).toBe('detached')
    healthy.send({ type: 'session.heartbeat' })
    healthy.send({ type: 'input.commit' })
    expect((await healthy.type('error')).error.code).toBe('INVALID_ARGUMENT')
    expect(server.stats().connections).toBe(1)
  })

  it('closing the engine under a running server closes its sessions with engine_closed', async () => {
    const { engine, connect } = await start({ turn: { maxGeneratedTokens: 100_000 } })
    const client = await connect()
    client.send({ type: 'input_text.append', text: 'go on forever', final: true })
    await client.type('response.output_text.delta')
    await engine.close()
    expect((await client.type('response.done')).status).toBe('cancelled')
    expect((await client.type('session.closed')).reason).toBe('engine_closed')
    client.send({ type: 'input_text.append', text: 'anyone?' })
    expect((await client.type('error')).error.code).toBe('ENGINE_CLOSED')
  })
})
