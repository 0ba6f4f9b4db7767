// Sessions that outlive their process through a real redis-server (Debian's; `npm run
// test:scale` installs it when missing): in-process servers over simulated engines with one seed
// share a store. A session moved to another server continues its conversation token for token;
// of racing resumes exactly one wins; the old owner is fenced out; while Redis is away the owners
// keep working and a resume gets a retryable error. On both backends (the store's part is the
// facade's; the engine under it is the native addon or WebAssembly).
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

async function resume(server: OrtexServer, id: string, token: string, generation: number): Promise<{ client: DuplexClient; reply: any }> {
  const client = await DuplexClient.connect(wsUrl(server))
  client.send({ type: 'session.resume', session_id: id, resume_token: token, lease_generation: generation })
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

  it('while Redis is away: owners keep working, a resume gets a retryable error; after, all is well', async () => {
    const [a, b] = [await serverWithStore(), await serverWithStore()]
    const session = await openSession(a)
    const quiet = await openSession(a)
    await turn(session.client, 'before the outage')
    await turn(quiet.client, 'before the outage')
    quiet.client.close()
    await quiet.client.closed()
    await settle() // its detach is written before the outage: nothing of it fails during it
    await redis.stop()
    expect(await turn(session.client, 'during the outage')).not.toHaveLength(0)
    const during = await resume(b, session.id, session.token, 0)
    expect(during.reply.type).toBe('error')
    expect(during.reply.error).toMatchObject({ code: 'SESSION_STORE_UNAVAILABLE', retryable: true })
    // A fresh Redis, empty: the owner writes its records again, at the next commit or retry.
    redis = await startRedis(redis.port)
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
