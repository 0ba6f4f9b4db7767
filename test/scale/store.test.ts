// Sessions that outlive their process through a real redis-server (Debian's; `npm run
// test:scale` installs it when missing): in-process servers over simulated engines with one seed
// share a store. A session moved to another server continues its conversation token for token,
// its fence counters and its completed appends with it (a retried append is a replay there); a
// client hears of a commit only once the store holds it, and one that resumes elsewhere without
// having seen a response end has that response taken back; of racing resumes exactly one wins;
// the old owner is fenced out; while Redis is away a commit's acknowledgement waits and a resume
// gets a retryable error. On both backends (the store's part is the facade's; the engine under
// it is the native addon or WebAssembly).
import type { OrtexServer } from 'ortex'
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest'
import { type OrtexModule, ortex, selectedBackends } from '../helpers/backends'
import { DuplexClient, type RedisProcess, freePort, livingProcesses, responseTokens, sleep, startRedis, within } from './processes'

type Engine = ReturnType<OrtexModule['Engine']['simulated']>
let redis: RedisProcess
const servers: { server: OrtexServer; engine: Engine }[] = []

beforeAll(async () => {
  redis = await startRedis(await freePort())
})
afterAll(async () => {
  await redis?.stop()
  expect(livingProcesses()).toEqual([])
})
afterEach(async () => {
  for (const { server, engine } of servers.splice(0)) {
    await server.close()
    await engine.close()
  }
})

let mod: OrtexModule

/** Lets the store's writes in flight land. */
async function settle(): Promise<void> {
  await sleep(100)
}

async function serverWithStore(): Promise<OrtexServer> {
  const engine = mod.Engine.simulated({ seed: 5, eosProbability: 0.05 })
  const server = await mod.startServer(engine, { port: 0, duplex: { sessionStore: redis.url } })
  servers.push({ server, engine })
  return server
}

const wsUrl = (server: OrtexServer): string => server.url.replace('http', 'ws')
const CONFIG = { type: 'session.update', session: { temperature: 0, max_output_tokens: 12 } }

/** Sends a final append and returns the tokens of the response it starts. */
async function turn(client: DuplexClient, text: string): Promise<number[]> {
  const from = client.events.length
  client.send({ type: 'input_text.append', text, final: true })
  await client.next((e) => e.type === 'response.done', from)
  return responseTokens(client.events, from)
}

async function openSession(server: OrtexServer): Promise<{ client: DuplexClient; id: string; token: string }> {
  const client = await DuplexClient.connect(wsUrl(server))
  client.send(CONFIG)
  const created = await client.next((e) => e.type === 'session.created')
  await client.next((e) => e.type === 'session.updated')
  return { client, id: created.session.id, token: created.resume_token }
}

async function resume(
  server: OrtexServer,
  id: string,
  token: string,
  generation: number,
  lastResponseSeq?: number,
): Promise<{ client: DuplexClient; reply: any }> {
  const client = await DuplexClient.connect(wsUrl(server))
  client.send({ type: 'session.resume', session_id: id, resume_token: token, lease_generation: generation, last_response_seq: lastResponseSeq })
  const reply = await client.next((e) => e.type === 'session.resumed' || e.type === 'error')
  return { client, reply }
}

describe.each(selectedBackends())('a session store in Redis (%s)', (backend) => {
  beforeAll(() => {
    mod = ortex(backend)
  })

  it('moves a session to another server, which continues the conversation token for token', async () => {
    const [a, b, c] = [await serverWithStore(), await serverWithStore(), await serverWithStore()]
    const moved = await openSession(a)
    const reference = await openSession(c)
    for (const text of ['The first thing I said.', 'And a second, longer thing, said after the first reply.']) {
      expect(await turn(moved.client, text)).toEqual(await turn(reference.client, text))
    }
    // A's process ends (its records stay: a stop is no close of the sessions).
    moved.client.close()
    await a.close()
    const { client, reply } = await resume(b, moved.id, moved.token, 0)
    expect(reply.type).toBe('session.resumed')
    expect(reply.session.lease_generation).toBe(1)
    expect(reply.session.fence.incarnation).toBe(1)
    const after = await turn(client, 'What did I say?')
    expect(after.length).toBeGreaterThan(0)
    expect(after).toEqual(await turn(reference.client, 'What did I say?'))
    // A stale fence (the first life's) is refused by the new owner.
    client.send({ type: 'input_text.append', text: 'x', fence: { ...reply.session.fence, incarnation: 0 } })
    const refused = await client.next((e) => e.type === 'error')
    expect(refused.error.code).toBe('FENCE_MISMATCH')
  })

  it('carries the fence counters and the completed appends over: a retried append is a replay on the new owner', async () => {
    const [a, b, c] = [await serverWithStore(), await serverWithStore(), await serverWithStore()]
    const moved = await openSession(a)
    const reference = await openSession(c)
    const created = moved.client.events.find((e) => e.type === 'session.created')
    const append = { type: 'input_text.append', text: 'Remember this.', final: true, operation_id: 'op-1', fence: created.session.fence }
    moved.client.send(append)
    const first = await moved.client.next((e) => e.type === 'input.committed')
    const done = await moved.client.next((e) => e.type === 'response.done')
    expect(responseTokens(moved.client.events)).toEqual(await turn(reference.client, 'Remember this.'))
    moved.client.close()
    await a.close()
    const { client, reply } = await resume(b, moved.id, moved.token, 0)
    expect(reply.type).toBe('session.resumed')
    // The counters carry on from where the old owner left them; the life is the next one.
    expect(reply.session.fence).toMatchObject({ incarnation: 1, epoch: 0, turn_id: first.fence.turn_id, response_seq: done.fence.response_seq })
    // The retry, with the fence of its first attempt (the old life's) and without one: the first
    // result, and nothing appended, no response started.
    for (const retry of [append, { ...append, fence: undefined }]) {
      const from = client.events.length
      client.send(retry)
      const replay = await client.next((e) => e.type === 'input.committed', from)
      expect(replay).toMatchObject({ replayed: true, seq: first.seq, turn_seq: first.turn_seq, turn_id: first.turn_id, operation_id: 'op-1' })
    }
    // Other text under the same id is refused; the conversation holds the turn once.
    client.send({ ...append, text: 'Something else.' })
    expect((await client.next((e) => e.type === 'error')).error.code).toBe('OPERATION_REUSED')
    expect(await turn(client, 'What did I say?')).toEqual(await turn(reference.client, 'What did I say?'))
    const next = client.events.filter((e) => e.type === 'input.committed').at(-1)
    expect(next).toMatchObject({ seq: first.seq + 1, replayed: false, fence: { incarnation: 1, response_seq: done.fence.response_seq + 1 } })
  })

  it('tells a client of a commit only once the store holds it: the acknowledgement and the response.done wait', async () => {
    const store = await mod.RedisSessionStore.connect(redis.url, { keyPrefix: 'gated:' })
    // Writes wait while `holds` says so of their record.
    let holds: (record: any) => boolean = () => false
    const waiting: { record: any; go: () => void }[] = []
    const hold = (rule: (record: any) => boolean): void => {
      holds = rule
      for (const writer of waiting.splice(0)) {
        if (rule(writer.record)) waiting.push(writer)
        else writer.go()
      }
    }
    const gated = {
      commit: async (record: any, ttlMs: number) => {
        if (holds(record)) await new Promise<void>((go) => waiting.push({ record, go }))
        return store.commit(record, ttlMs)
      },
      claim: store.claim.bind(store),
      end: store.end.bind(store),
      touch: store.touch.bind(store),
      quit: store.quit.bind(store),
    }
    const engine = mod.Engine.simulated({ seed: 5 })
    const server = await mod.startServer(engine, { port: 0, duplex: { sessionStore: gated } })
    servers.push({ server, engine })
    const client = await DuplexClient.connect(wsUrl(server))
    client.send({ type: 'session.update', session: { max_output_tokens: 200, ignore_eos: true } })
    await client.next((e) => e.type === 'session.updated')
    hold(() => true)
    const from = client.events.length
    client.send({ type: 'input_text.append', text: 'Say a lot.', final: true, operation_id: 'a' })
    await sleep(300)
    expect(client.events.slice(from), 'nothing before the store holds the append').toEqual([])
    // The append's record goes through (its response is pending there); the response's end (a
    // record without a pending response) does not, for now.
    hold((record) => record.pendingResponses.length === 0)
    await client.next((e) => e.type === 'input.committed', from)
    await sleep(300)
    expect(client.events.slice(from).map((e) => e.type)).not.toContain('response.done')
    hold(() => false)
    const done = await client.next((e) => e.type === 'response.done', from)
    expect(done.usage.output_tokens).toBe(200)
    expect(responseTokens(client.events, from)).toHaveLength(200)
    client.close()
    await server.close()
    servers.pop()
    await engine.close()
    await store.quit()
  })

  it('bounds what waits for the store: past 1024 replies waiting, the server stops reading the client, and goes on after', async () => {
    const store = await mod.RedisSessionStore.connect(redis.url, { keyPrefix: 'bounded:' })
    let holding = false
    const waiting: (() => void)[] = []
    const gated = {
      commit: async (record: any, ttlMs: number) => {
        if (holding) await new Promise<void>((go) => waiting.push(go))
        return store.commit(record, ttlMs)
      },
      claim: store.claim.bind(store),
      end: store.end.bind(store),
      touch: store.touch.bind(store),
      quit: store.quit.bind(store),
    }
    const engine = mod.Engine.simulated({ seed: 5 })
    const server = await mod.startServer(engine, { port: 0, duplex: { sessionStore: gated } })
    servers.push({ server, engine })
    const client = await DuplexClient.connect(wsUrl(server))
    client.send({ type: 'session.update', session: { temperature: 0 } })
    await client.next((e) => e.type === 'session.updated')
    const session = server.duplex.manager.list()[0]!
    const commits = (): number => (server.duplex as any).persistence.commits(session)
    const before = commits()
    holding = true
    // Each update is a commit point and a reply that waits for its write.
    const updates = 5000
    for (let i = 0; i < updates; i++) client.send({ type: 'session.update', session: { temperature: 0 } })
    await sleep(500)
    const handled = commits() - before
    expect(handled, 'updates handled while their replies could not go out').toBeGreaterThan(1024)
    expect(handled).toBeLessThan(updates)
    holding = false
    for (const go of waiting.splice(0)) go()
    await within(30_000, 'every reply', async () => {
      while (client.events.filter((e) => e.type === 'session.updated').length < updates + 1) await sleep(50)
    })
    expect(commits() - before).toBe(updates)
    client.close()
    await server.close()
    servers.pop()
    await engine.close()
    await store.quit()
  })

  it('takes back a response that ended unseen: a client resuming elsewhere after the last one it saw end', async () => {
    const [a, b] = [await serverWithStore(), await serverWithStore()]
    const moved = await openSession(a)
    await turn(moved.client, 'First.')
    const seen = moved.client.events.filter((e) => e.type === 'response.done').at(-1)
    // The client's connection breaks before it sees the second response end (here it sees it,
    // and says it did not).
    const unseen = await turn(moved.client, ' Second.')
    const ended = moved.client.events.filter((e) => e.type === 'response.done').at(-1)
    moved.client.close()
    await a.close()
    const { client, reply } = await resume(b, moved.id, moved.token, 0, seen.fence.response_seq)
    expect(reply.type).toBe('session.resumed')
    const failed = await client.next((e) => e.type === 'response.done')
    expect(failed).toMatchObject({ status: 'failed', fence: ended.fence })
    // Its output is no longer in the conversation: asked again, the same context gives it again.
    const from = client.events.length
    client.send({ type: 'response.create' })
    await client.next((e) => e.type === 'response.done' && e.fence.incarnation === 1, from)
    expect(responseTokens(client.events, from)).toEqual(unseen)
  })

  it('a response in flight when its process stops ends failed on the new owner, without its output', async () => {
    const [a, b, c] = [await serverWithStore(), await serverWithStore(), await serverWithStore()]
    const moved = await openSession(a)
    const reference = await openSession(c)
    expect(await turn(moved.client, 'First.')).toEqual(await turn(reference.client, 'First.'))
    moved.client.close()
    await moved.client.closed()
    // In A: its engine no longer steps (caller-driven), a final append starts a response that
    // therefore stays in flight, and A stops. The record written for that commit (close()
    // flushes it) holds the input and the running response's fence, and none of its output.
    // (With A's engine still running, the simulated model's response could end before the write,
    // and a resume that raced the write could read the record before it: 1 run in 2 failed.)
    await servers.find((s) => s.server === a)!.engine.stop()
    const session = a.duplex.manager.list()[0]!
    session.append(' Second.', { final: true })
    const inFlight = session.fence
    await a.close()
    const { client, reply } = await resume(b, moved.id, moved.token, 0)
    expect(reply.type).toBe('session.resumed')
    const failed = await client.next((e) => e.type === 'response.done')
    expect(failed).toMatchObject({ status: 'failed', fence: { incarnation: 0, turn_id: inFlight.turnId, response_seq: inFlight.responseSeq } })
    // The reference: the same input, no response to it.
    reference.client.send({ type: 'input_text.append', text: ' Second.' })
    await reference.client.next((e) => e.type === 'input.committed' && e.seq === 2)
    expect(await turn(client, ' Third.')).toEqual(await turn(reference.client, ' Third.'))
  })

  it('a connection that drops while its resume waits for the store leaves the session detached, resumable', async () => {
    const [a, b] = [await serverWithStore(), await serverWithStore()]
    const session = await openSession(a)
    await turn(session.client, 'hello')
    session.client.close()
    await a.close()
    const client = await DuplexClient.connect(wsUrl(b))
    client.send({ type: 'session.resume', session_id: session.id, resume_token: session.token, lease_generation: 0 })
    client.ws.terminate()
    await within(5_000, 'the session to be taken over and detached', async () => {
      while (b.duplex.manager.list()[0]?.state !== 'detached') await sleep(10)
    })
    const { reply } = await resume(b, session.id, session.token, 1)
    expect(reply).toMatchObject({ type: 'session.resumed', session: { lease_generation: 2 } })
  })

  it('of 8 racing resumes on 4 servers exactly one wins', async () => {
    const all = [await serverWithStore(), await serverWithStore(), await serverWithStore(), await serverWithStore()]
    const session = await openSession(all[0]!)
    await turn(session.client, 'hello')
    session.client.close()
    const results = await Promise.all(Array.from({ length: 8 }, (_, i) => resume(all[i % 4]!, session.id, session.token, 0)))
    const won = results.filter((r) => r.reply.type === 'session.resumed')
    expect(won).toHaveLength(1)
    for (const lost of results.filter((r) => r.reply.type === 'error')) {
      expect(lost.reply.error.code).toBe('LEASE_GENERATION_MISMATCH')
    }
    expect(await turn(won[0]!.client, 'still there?')).not.toHaveLength(0)
  })

  it('fences the old owner out: its next commit finds the session moved and it drops its copy', async () => {
    const [a, b] = [await serverWithStore(), await serverWithStore()]
    const session = await openSession(a)
    await turn(session.client, 'hello')
    await settle() // the record is written after its commit point, not before response.done
    // A partition: the client resumes on B while its connection to A is still open.
    const { client, reply } = await resume(b, session.id, session.token, 0)
    expect(reply, JSON.stringify(reply)).toMatchObject({ type: 'session.resumed' })
    session.client.send({ type: 'input_text.append', text: 'stale', final: true })
    const closed = await session.client.next((e) => e.type === 'session.closed')
    expect(closed.reason).toBe('fenced_out')
    expect(a.duplex.sessionCount).toBe(0)
    expect(await turn(client, 'on B')).not.toHaveLength(0)
  })

  it('while Redis is away: a turn waits for it, a resume gets a retryable error; after, all is well', async () => {
    const [a, b] = [await serverWithStore(), await serverWithStore()]
    const session = await openSession(a)
    const quiet = await openSession(a)
    await turn(session.client, 'before the outage')
    await turn(quiet.client, 'before the outage')
    quiet.client.close()
    await quiet.client.closed()
    await settle() // its detach is written before the outage: nothing of it fails during it
    await redis.stop()
    // The owner runs the turn, but its client hears nothing of it while no store can hold it.
    const from = session.client.events.length
    session.client.send({ type: 'input_text.append', text: 'during the outage', final: true })
    const during = await resume(b, session.id, session.token, 0)
    expect(during.reply.type).toBe('error')
    expect(during.reply.error).toMatchObject({ code: 'SESSION_STORE_UNAVAILABLE', retryable: true })
    expect(session.client.events.slice(from)).toEqual([])
    // A fresh Redis, empty: the owner writes its records again (at once, and at each retry), and
    // the turn goes out.
    redis = await startRedis(redis.port)
    await session.client.next((e) => e.type === 'response.done', from)
    expect(responseTokens(session.client.events, from)).not.toHaveLength(0)
    const after = await within(15_000, 'the resume to succeed', async () => {
      for (;;) {
        const attempt = await resume(b, session.id, session.token, 0)
        if (attempt.reply.type === 'session.resumed') return attempt
        expect(attempt.reply.error.code).toMatch(/SESSION_STORE_UNAVAILABLE|SESSION_CLOSED/)
        attempt.client.close()
        await sleep(200)
      }
    })
    expect(after.reply.session.fence.incarnation).toBe(1)
    expect(await turn(after.client, 'after the outage')).not.toHaveLength(0)
    // A session without a commit during the outage: A wrote its record again when Redis came
    // back, so it moves to B too, rather than being SESSION_CLOSED there.
    const moved = await resume(b, quiet.id, quiet.token, 0)
    expect(moved.reply).toMatchObject({ type: 'session.resumed', session: { fence: { incarnation: 1 } } })
    expect(await turn(moved.client, 'after the outage')).not.toHaveLength(0)
  })

  it('a server without room refuses to claim (retryably), and the session stays claimable', async () => {
    const engine = mod.Engine.simulated({ seed: 5, eosProbability: 0.05 })
    const full = await mod.startServer(engine, { port: 0, duplex: { sessionStore: redis.url, maxSessions: 1 } })
    servers.push({ server: full, engine })
    const b = await serverWithStore()
    const occupant = await openSession(full)
    const session = await openSession(b)
    await turn(session.client, 'hello')
    session.client.close()
    const refused = await resume(full, session.id, session.token, 0)
    expect(refused.reply.error).toMatchObject({ code: 'CAPACITY_EXHAUSTED', retryable: true })
    const { reply } = await resume(b, session.id, session.token, 0)
    expect(reply).toMatchObject({ type: 'session.resumed', session: { lease_generation: 1, fence: { incarnation: 0 } } })
    occupant.client.close()
  })

  it('writes at commit points, never per token (a SessionStore object of your own works too)', async () => {
    const store = await mod.RedisSessionStore.connect(redis.url, { keyPrefix: 'counted:' })
    const commits: number[] = []
    const counted = {
      commit: (record: any, ttlMs: number) => {
        commits.push(record.tokens.length)
        return store.commit(record, ttlMs)
      },
      claim: store.claim.bind(store),
      end: store.end.bind(store),
      touch: store.touch.bind(store),
      quit: store.quit.bind(store),
    }
    const engine = mod.Engine.simulated({ seed: 5 })
    const server = await mod.startServer(engine, { port: 0, duplex: { sessionStore: counted } })
    servers.push({ server, engine })
    const client = await DuplexClient.connect(wsUrl(server))
    client.send({ type: 'session.update', session: { max_output_tokens: 300, ignore_eos: true } })
    await client.next((e) => e.type === 'session.updated')
    await settle()
    const before = commits.length
    expect(await turn(client, 'Talk for a while.')).toHaveLength(300)
    await settle()
    // The final append (the response starts) and the response's end: two commit points, at most
    // two writes, for 300 tokens.
    expect(commits.length - before).toBeGreaterThanOrEqual(1)
    expect(commits.length - before).toBeLessThanOrEqual(2)
    expect(commits.at(-1)).toBe(engine.tokenize('Talk for a while.').length + 300)
    client.close()
    await server.close()
    servers.pop()
    await engine.close()
    await store.quit()
  })

  it('refuses a store that is not a redis:// URL', async () => {
    const engine = mod.Engine.simulated({ seed: 1 })
    await expect(mod.startServer(engine, { port: 0, duplex: { sessionStore: 'http://nope' } })).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    await expect(mod.RedisSessionStore.connect('redis://127.0.0.1:1')).rejects.toThrow(/cannot reach the session store/)
    await engine.close()
  })
})
