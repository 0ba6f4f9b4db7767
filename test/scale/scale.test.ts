// Past one process, with the real parts on loopback (`npm run test:scale`): redis-server, three
// `ortex serve` processes with --session-store, and nginx with docs/scaling.md's configuration.
//
//   (a) 300 OpenAI requests, a process SIGKILLed in the middle: each completes or gets an error,
//       none hangs, and every later request succeeds.
//   (b) 20 duplex sessions through nginx, one process SIGKILLed: each of its clients resumes
//       through nginx and its next response is the one its whole conversation gives (checked
//       token for token against a reference server); 8 racing resumes on the processes: one wins.
//   (c) SIGTERM drains a process with streams in flight (tiny ONNX model): all complete, its
//       sessions move on through nginx, it exits 0.
//   (d) Redis restarted mid-run: turns begun meanwhile wait for it (a client hears of a commit
//       only once the store holds it) and complete after; a resume during the outage gets a
//       retryable error, and succeeds once Redis is back. Nothing the suite started outlives it.
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { Engine, type OrtexServer, startServer } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'
import { Cluster } from './cluster'
import { DuplexClient, type StreamOutcome, livingProcesses, responseTokens, sleep, streamCompletion, within } from './processes'

let root = ''
beforeAll(() => {
  root = mkdtempSync(path.join(tmpdir(), 'ortex-scale-'))
})
afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
  // After every cluster's stop: nothing this suite started (nginx's workers included) lives on.
  expect(livingProcesses()).toEqual([])
})

/** What `ortex serve --simulated` runs (ts/cli/serve.ts), for the reference server. */
const SERVE_SIMULATED = { seed: 0, eosProbability: 0.02 }
const SESSION_CONFIG = { type: 'session.update', session: { temperature: 0, max_output_tokens: 12 } }

/** One conversation through nginx, mirrored on a reference server that never fails over. */
class Conversation {
  client!: DuplexClient
  reference!: DuplexClient
  id = ''
  token = ''
  generation = 0
  turns = 0

  constructor(
    private readonly cluster: Cluster,
    readonly key: string,
  ) {}

  async open(referenceUrl: string): Promise<void> {
    this.client = await DuplexClient.connect(`${this.cluster.wsUrl}/sessions/${this.key}`)
    this.reference = await DuplexClient.connect(referenceUrl)
    for (const client of [this.client, this.reference]) {
      client.send(SESSION_CONFIG)
      await client.next((e) => e.type === 'session.updated')
    }
    const created = this.client.events.find((e) => e.type === 'session.created')
    this.id = created.session.id
    this.token = created.resume_token
  }

  /** A user turn on both; the responses must be the same tokens. */
  async turn(): Promise<number[]> {
    const text = `${this.key} says thing number ${++this.turns}.`
    const [got, expected] = await Promise.all([this.respond(this.client, text), this.respond(this.reference, text)])
    expect(got, `${this.key}, turn ${this.turns}`).toEqual(expected)
    expect(got.length).toBeGreaterThan(0)
    return got
  }

  /** Reconnects through nginx and resumes; returns the server's answer. */
  async resume(): Promise<any> {
    this.client = await DuplexClient.connect(`${this.cluster.wsUrl}/sessions/${this.key}`)
    this.client.send({ type: 'session.resume', session_id: this.id, resume_token: this.token, lease_generation: this.generation })
    const reply = await this.client.next((e) => e.type === 'session.resumed' || e.type === 'error')
    if (reply.type === 'session.resumed') this.generation = reply.session.lease_generation
    return reply
  }

  private async respond(client: DuplexClient, text: string): Promise<number[]> {
    const from = client.events.length
    client.send({ type: 'input_text.append', text, final: true })
    await client.next((e) => e.type === 'response.done', from)
    return responseTokens(client.events, from)
  }
}

interface RequestOutcome {
  ok: boolean
  hung: boolean
}

/** One /v1/completions request through nginx, streamed or not; never rejects. */
async function completion(base: string, i: number, stream: boolean): Promise<RequestOutcome> {
  const body = { model: 'ortex-simulated', prompt: `request ${i}`, max_tokens: 16, user: `user-${i % 12}` }
  const headers = { 'content-type': 'application/json', 'x-ortex-affinity': `user-${i % 12}` }
  const signal = AbortSignal.timeout(30_000)
  try {
    if (stream) {
      const outcome: StreamOutcome = await streamCompletion(base, body, headers, undefined, signal)
      return { ok: outcome.status === 200 && outcome.done && outcome.error === null, hung: signal.aborted }
    }
    const response = await fetch(`${base}/v1/completions`, { method: 'POST', headers, body: JSON.stringify(body), signal })
    const json = await response.json()
    return { ok: response.status === 200 && json.choices?.[0]?.finish_reason != null, hung: false }
  } catch {
    return { ok: false, hung: signal.aborted }
  }
}

describe('three simulated-model processes behind nginx, sessions in Redis', () => {
  let cluster: Cluster
  let reference: { server: OrtexServer; engine: Engine }

  beforeAll(async () => {
    cluster = await Cluster.start(path.join(root, 'sim'), ['--simulated'])
    const engine = Engine.simulated(SERVE_SIMULATED)
    reference = { engine, server: await startServer(engine, { port: 0 }) }
  })
  afterAll(async () => {
    await cluster?.stop()
    await reference?.server.close()
    await reference?.engine.close()
  })

  it('one user, one process: a prompt sent again with the same affinity key comes from the prefix cache', async () => {
    for (let user = 0; user < 8; user++) {
      const headers = { 'content-type': 'application/json', 'x-ortex-affinity': `cache-user-${user}` }
      const body = JSON.stringify({ model: 'ortex-simulated', prompt: `user ${user} `.repeat(40), max_tokens: 1 })
      const cached: number[] = []
      for (let send = 0; send < 2; send++) {
        const response = await fetch(`${cluster.url}/v1/completions`, { method: 'POST', headers, body })
        cached.push((await response.json()).usage.prompt_tokens_details.cached_tokens)
      }
      expect(cached[0]).toBe(0)
      // Three processes: without affinity, the second would miss two times in three.
      expect(cached[1]).toBeGreaterThan(0)
    }
  })

  it('(a) 300 OpenAI requests, a process killed in the middle: none hangs, later ones all succeed', async () => {
    const outcomes: RequestOutcome[] = []
    let next = 0
    let killed: Promise<void> | null = null
    const worker = async (): Promise<void> => {
      while (next < 300) {
        const i = next++
        outcomes.push(await completion(cluster.url, i, i % 2 === 0))
        if (outcomes.length === 100) killed = cluster.kill(1)
      }
    }
    await Promise.all(Array.from({ length: 16 }, worker))
    await killed
    expect(outcomes).toHaveLength(300)
    expect(outcomes.filter((o) => o.hung)).toHaveLength(0)
    // At most the requests in flight on the killed process fail.
    expect(outcomes.filter((o) => !o.ok).length).toBeLessThanOrEqual(16)
    const later = await Promise.all(Array.from({ length: 48 }, (_, i) => completion(cluster.url, 1000 + i, i % 2 === 0)))
    expect(later.filter((o) => !o.ok)).toHaveLength(0)
    await cluster.startBackend(1)
  })

  it('(b) 20 sessions, their owner killed: each resumes through nginx and goes on with its whole conversation', async () => {
    const referenceUrl = reference.server.url.replace('http', 'ws')
    const conversations = Array.from({ length: 20 }, (_, i) => new Conversation(cluster, `conversation-${i}`))
    await Promise.all(conversations.map((c) => c.open(referenceUrl)))
    for (let round = 0; round < 2; round++) await Promise.all(conversations.map((c) => c.turn()))

    // The process holding the most KV (so, sessions): whatever ports the hash ring got this run.
    const victim = await busiestBackend(cluster)
    await cluster.kill(victim)
    await sleep(200)
    const cut = conversations.filter((c) => c.client.closeCode !== null)
    expect(cut.length).toBeGreaterThan(0)
    expect(cut.length).toBeLessThan(20)
    for (const conversation of cut) {
      const reply = await conversation.resume()
      expect(reply).toMatchObject({ type: 'session.resumed', session: { lease_generation: 1 } })
      expect(reply.session.fence.incarnation).toBe(1)
    }
    await Promise.all(conversations.map((c) => c.turn()))

    // 8 racing resumes of one session, on the two live processes directly: one wins.
    const raced = cut[0]!
    raced.client.close()
    await raced.client.closed()
    const live = [0, 1, 2].filter((i) => i !== victim).map((i) => `ws://127.0.0.1:${cluster.ports[i]}`)
    const attempts = await Promise.all(
      Array.from({ length: 8 }, async (_, i) => {
        const client = await DuplexClient.connect(live[i % 2]!)
        client.send({ type: 'session.resume', session_id: raced.id, resume_token: raced.token, lease_generation: raced.generation })
        return { client, reply: await client.next((e) => e.type === 'session.resumed' || e.type === 'error') }
      }),
    )
    const winners = attempts.filter((a) => a.reply.type === 'session.resumed')
    expect(winners).toHaveLength(1)
    for (const loser of attempts.filter((a) => a.reply.type === 'error')) expect(loser.reply.error.code).toBe('LEASE_GENERATION_MISMATCH')
    raced.client = winners[0]!.client
    raced.generation = winners[0]!.reply.session.lease_generation
    await raced.turn()
    for (const conversation of conversations) conversation.client.close()
    await cluster.startBackend(victim)
  })

  it('(d) Redis restarted mid-run: turns wait for it and complete after; a resume meanwhile gets a retryable error', async () => {
    const referenceUrl = reference.server.url.replace('http', 'ws')
    const conversations = Array.from({ length: 6 }, (_, i) => new Conversation(cluster, `outage-${i}`))
    await Promise.all(conversations.map((c) => c.open(referenceUrl)))
    await Promise.all(conversations.map((c) => c.turn()))
    const resumed = conversations[0]!
    resumed.client.close()
    await resumed.client.closed()
    await sleep(200) // its detach is written before the outage
    await cluster.redis!.stop()
    // The owners run these turns; their clients hear of them once Redis is back.
    let back = false
    const heardEarly: string[] = []
    const during = conversations.slice(1).map((c) => c.turn().finally(() => back || heardEarly.push(c.key)))
    const refused = await resumed.resume()
    expect(refused.type).toBe('error')
    expect(refused.error).toMatchObject({ code: 'SESSION_STORE_UNAVAILABLE', retryable: true })
    await sleep(300)
    back = true
    await cluster.restartRedis()
    await Promise.all(during)
    expect(heardEarly, 'turns whose end reached the client while no store held it').toEqual([])
    const reply = await within(20_000, 'the resume to succeed after the outage', async () => {
      for (;;) {
        resumed.client.close()
        const attempt = await resumed.resume()
        if (attempt.type === 'session.resumed') return attempt
        expect(attempt.error.retryable || attempt.error.code === 'SESSION_CLOSED').toBe(true)
        await sleep(200)
      }
    })
    // The owner kept it: same life, next generation.
    expect(reply.session.fence.incarnation).toBe(0)
    await Promise.all(conversations.map((c) => c.turn()))
    for (const conversation of conversations) conversation.client.close()
  })
})

describe('three tiny-ONNX-model processes behind nginx, sessions in Redis', () => {
  let cluster: Cluster

  beforeAll(async () => {
    const modelDir = path.join(root, 'tiny')
    await makeModel({ outDir: modelDir, size: 'tiny' })
    cluster = await Cluster.start(path.join(root, 'onnx'), ['--model', modelDir, '--drain-timeout-ms', '60000'])
  })
  afterAll(async () => {
    await cluster?.stop()
  })

  it('(c) SIGTERM drains a process with streams in flight: all complete, its sessions move on', async () => {
    const sessions = await Promise.all(
      Array.from({ length: 6 }, async (_, i) => {
        const client = await DuplexClient.connect(`${cluster.wsUrl}/sessions/drain-${i}`)
        client.send({ type: 'input_text.append', text: `hello ${i}`, final: true })
        const created = await client.next((e) => e.type === 'session.created')
        await client.next((e) => e.type === 'response.done')
        return { client, key: `drain-${i}`, id: created.session.id, token: created.resume_token }
      }),
    )
    // 16 streams through nginx, and 8 straight to the process that will drain (so that it has
    // some for certain).
    // The process holding the most sessions (by its KV) drains.
    const drained = cluster.backends[await busiestBackend(cluster)]!
    let started = 0
    let allStarted!: () => void
    const startedAll = new Promise<void>((resolve) => (allStarted = resolve))
    const streams = Array.from({ length: 24 }, (_, i) => {
      let first = true
      const base = i < 16 ? cluster.url : drained.url
      const headers = { 'x-ortex-affinity': `drain-user-${i}` }
      return streamCompletion(base, { model: 'tiny', prompt: `stream ${i}`, max_tokens: 1200 }, headers, () => {
        if (first && ++started === 24) allStarted()
        first = false
      })
    })
    await within(30_000, 'every stream to start', () => startedAll)
    const runningOnDrained = 8 - (await countSettled(streams.slice(16)))
    drained.child.kill('SIGTERM')
    const outcomes = await Promise.all(streams)
    for (const outcome of outcomes) {
      expect(outcome).toMatchObject({ status: 200, done: true, error: null })
      expect(['length', 'stop']).toContain(outcome.finishReason)
    }
    expect(runningOnDrained).toBeGreaterThan(0)
    expect(await within(30_000, 'the drained process to exit', () => drained.exited)).toBe(0)
    // Its sessions were closed with 1012; they resume through nginx on the other processes.
    const moved = sessions.filter((s) => s.client.closeCode === 1012)
    expect(moved.length).toBeGreaterThan(0)
    for (const session of moved) {
      const client = await DuplexClient.connect(`${cluster.wsUrl}/sessions/${session.key}`)
      client.send({ type: 'session.resume', session_id: session.id, resume_token: session.token, lease_generation: 0 })
      const reply = await client.next((e) => e.type === 'session.resumed' || e.type === 'error')
      expect(reply).toMatchObject({ type: 'session.resumed', session: { lease_generation: 1, fence: { incarnation: 1 } } })
      const from = client.events.length
      client.send({ type: 'input_text.append', text: 'and again', final: true })
      const done = await client.next((e) => e.type === 'response.done', from)
      expect(done.status).toBe('completed')
      expect(done.usage.output_tokens).toBeGreaterThan(0)
      client.close()
    }
    for (const session of sessions) session.client.close()
  })
})

/** The index of the backend whose engine holds the most KV blocks (ortex_kv_blocks_used). */
async function busiestBackend(cluster: Cluster): Promise<number> {
  const used = await Promise.all(
    cluster.backends.map(async (backend) => {
      const text = await (await fetch(`${backend!.url}/metrics`)).text()
      return Number(/^ortex_kv_blocks_used (\d+)/m.exec(text)?.[1] ?? 0)
    }),
  )
  return used.indexOf(Math.max(...used))
}

/** How many of `promises` have settled by now. */
async function countSettled(promises: Promise<unknown>[]): Promise<number> {
  const pending = Symbol('pending')
  const states = await Promise.all(promises.map((p) => Promise.race([p, Promise.resolve(pending)])))
  return states.filter((state) => state !== pending).length
}
