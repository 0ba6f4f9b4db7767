// Failover under fire, seeded: conversations on three `ortex serve --simulated --session-store`
// processes while their processes are SIGKILLed (at random, and aimed: a few milliseconds after a
// client sent an append or saw a response created, while the commit's write is on its way to the
// store or its answer on its way back; right after a client saw an append acknowledged or a
// response done) and redis-server is killed and started again. Each client does
// what a client should: on a dropped connection it resumes (on any live process) with its lease
// generation and the last response it saw done, and sends again every step it has not seen
// finish, appends with their operation ids. Every turn must then be, token for token, the turn
// the same conversation gives on one process that never fails: nothing lost, doubled or changed.
//
//   npm run test:scale                                  seeds 1..2 (part of `npm test`)
//   CHAOS_SEEDS=20 npx vitest run --config vitest.scale.config.ts test/scale/chaos.test.ts
//   CHAOS_SEED=7 ...                                    replays seed 7
//   CHAOS_TURNS=16 ...                                  longer conversations (default 8)
//
// The processes reach Redis through a proxy that holds each way STORE_DELAY_MS (a store some way
// off): that widens the moments between a commit and its write enough for a kill to land there.
// Redis keeps an append-only file (fsync always), so its restart loses nothing it acknowledged.
// A failure names its seed.
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { Engine, type OrtexServer, startServer } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Cluster } from './cluster'
import { DuplexClient, livingProcesses, sleep, within } from './processes'

const single = process.env.CHAOS_SEED !== undefined ? Number(process.env.CHAOS_SEED) : undefined
const count = Number(process.env.CHAOS_SEEDS ?? 2)
const TURNS = Number(process.env.CHAOS_TURNS ?? 8)
for (const [name, value] of [['CHAOS_SEED', single ?? 1], ['CHAOS_SEEDS', count], ['CHAOS_TURNS', TURNS]] as const) {
  if (!Number.isInteger(value) || value < 0) throw new Error(`${name} must be a non-negative integer, got ${value}`)
}
const SEEDS = single !== undefined ? [single] : Array.from({ length: count }, (_, i) => i + 1)

const SESSIONS = 10
const STORE_DELAY_MS = 25
/** What `ortex serve --simulated` runs (ts/cli/serve.ts), for the reference server. */
const SERVE_SIMULATED = { seed: 0, eosProbability: 0.02 }
const SESSION_CONFIG = { temperature: 0, max_output_tokens: 12 }
/** The longest one seed may take. */
const SEED_LIMIT_MS = 90_000

/** mulberry32: a small seeded generator, so that a seed's choices are the same on every run. */
function generator(seed: number): () => number {
  let state = seed >>> 0
  return () => {
    state = (state + 0x6d2b79f5) >>> 0
    let t = state
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

const WORDS = ['river', 'stone', 'window', 'garden', 'letter', 'morning', 'engine', 'silver', 'harbor', 'candle', 'north', 'quiet']

/** The user's text of each turn of each session, from the seed. */
function scripts(seed: number): string[][] {
  const random = generator(seed * 7919)
  return Array.from({ length: SESSIONS }, (_, s) =>
    Array.from({ length: TURNS }, (_, t) => {
      const words = Array.from({ length: 2 + Math.floor(random() * 6) }, () => WORDS[Math.floor(random() * WORDS.length)]!)
      return `seed ${seed} session ${s} turn ${t}: ${words.join(' ')}.`
    }),
  )
}

/** Where a client's events come from: the process, and a callback for each event (the aimed kills). */
interface Backends {
  /** A live process to connect to (the client's choice among those up), or null when none is. */
  pick(random: () => number): { index: number; url: string } | null
  /** Every event a client receives or sends, with the process at the other end. */
  observe(index: number, event: any): void
  /** A resume is in flight on `index` (+1) or answered (-1): a kill then would lose its answer. */
  resuming(index: number, delta: number): void
  /** Conversation `name` is now driven through process `index`. */
  attached(name: string, index: number): void
}

interface Link {
  client: DuplexClient
  backend: number
}

/** What one seed's clients saw, besides their turns. */
interface Tally {
  moves: number
  replays: number
  storeUnavailable: number
  /** The fence counters a moved session came back with, against what its client had seen. */
  counterChecks: string[]
}

/** The connection was lost (the process died): the step is sent again on the next one. */
class Dropped extends Error {}

/** One conversation, as a careful client drives it. */
class Conversation {
  id = ''
  private token = ''
  private generation = 0
  private incarnation = 0
  /** The latest response_seq whose response.done this client received. */
  private lastResponseSeq = 0
  /** Final appends acknowledged: the turn_id the session must be at, at least. */
  private acknowledged = 0
  /** Responses that ended failed for this client (on a move), and which it asked for again. */
  failedResponses = 0
  private link: Link | null = null
  readonly turns: number[][] = []

  constructor(
    private readonly name: string,
    private readonly texts: string[],
    private readonly backends: Backends,
    private readonly random: () => number,
    private readonly tally: Tally,
    private readonly think: () => number,
  ) {}

  async run(): Promise<void> {
    for (let turn = 0; turn < this.texts.length; turn++) {
      this.turns.push(await this.turn(turn))
      await sleep(this.think())
    }
    this.link?.client.close()
  }

  /** One user turn: its append (acknowledged once, whatever the moves), then its response. */
  private async turn(turn: number): Promise<number[]> {
    const operationId = `${this.name}:${turn}`
    /** The response this client waits for: its fence, once created; 'ask' when it must ask. */
    let awaited: { incarnation: number; responseSeq: number } | 'ask' | null = null
    for (;;) {
      const link = await this.connected()
      try {
        if (awaited === null) {
          const from = link.client.events.length
          const append = { type: 'input_text.append', event_id: operationId, text: this.texts[turn], final: true, operation_id: operationId }
          link.client.send(append)
          this.backends.observe(link.backend, append)
          const committed = await this.expect(link, from, (e) => e.type === 'input.committed' && e.operation_id === operationId, operationId)
          this.acknowledged++
          if (committed.replayed) {
            // Applied before, by a process that is gone: the response it started went with it.
            this.tally.replays++
            awaited = 'ask'
          } else {
            awaited = { incarnation: committed.fence.incarnation, responseSeq: committed.fence.response_seq }
          }
        }
        if (awaited === 'ask') {
          const from = link.client.events.length
          link.client.send({ type: 'response.create', event_id: `${operationId}:respond` })
          const created = await this.expect(link, from, (e) => e.type === 'response.created' && e.fence.incarnation === this.incarnation, `${operationId}:respond`)
          awaited = { incarnation: created.fence.incarnation, responseSeq: created.fence.response_seq }
        }
        const { incarnation, responseSeq } = awaited
        const done = await this.expect(link, 0, (e) => e.type === 'response.done' && e.fence.incarnation === incarnation && e.fence.response_seq === responseSeq, null)
        this.lastResponseSeq = Math.max(this.lastResponseSeq, responseSeq)
        if (done.status !== 'completed') throw new Error(`${this.name} turn ${turn}: response ${responseSeq} ended ${done.status} on a live process`)
        return link.client.events
          .filter((e) => e.type === 'response.output_text.delta' && e.token !== null && e.fence.incarnation === incarnation && e.fence.response_seq === responseSeq)
          .map((e) => e.token as number)
      } catch (error) {
        if (!(error instanceof Dropped)) throw error
        // A move: a response of the older life that this client did not see done is gone.
        if (awaited !== null && awaited !== 'ask') this.failedResponses++
        if (awaited !== null) awaited = 'ask'
      }
    }
  }

  /** The first event from `from` that `match` accepts; an error event naming `eventId` fails the
   *  test; a closed connection is Dropped. */
  private async expect(link: Link, from: number, match: (event: any) => boolean, eventId: string | null): Promise<any> {
    let event: any
    try {
      event = await link.client.next((e) => match(e) || (eventId !== null && e.type === 'error' && e.error.event_id === eventId), from, 30_000)
    } catch (error) {
      if (link.client.closeCode !== null) {
        this.link = null
        throw new Dropped()
      }
      throw new Error(`${this.name}: ${(error as Error).message}`)
    }
    if (event.type === 'error') throw new Error(`${this.name}: ${JSON.stringify(event.error)}`)
    return event
  }

  /** The live connection to the session: the one held, else a new session or a resume. */
  private async connected(): Promise<Link> {
    if (this.link !== null && this.link.client.closeCode === null) return this.link
    this.link = null
    for (;;) {
      const target = this.backends.pick(this.random)
      if (target === null) {
        await sleep(50)
        continue
      }
      let client: DuplexClient
      try {
        client = await DuplexClient.connect(target.url)
      } catch {
        await sleep(50) // it died, or is not up again yet
        continue
      }
      client.ws.on('message', (data) => this.backends.observe(target.index, JSON.parse(data.toString())))
      const link = { client, backend: target.index }
      const ready = this.id === '' ? await this.open(link) : await this.resume(link)
      if (ready) {
        this.link = link
        this.backends.attached(this.name, link.backend)
        return link
      }
      client.close()
    }
  }

  /** A new session with its configuration; false when the process died before both were answered. */
  private async open(link: Link): Promise<boolean> {
    link.client.send({ type: 'session.update', session: SESSION_CONFIG })
    try {
      const created = await link.client.next((e) => e.type === 'session.created', 0, 30_000)
      await link.client.next((e) => e.type === 'session.updated', 0, 30_000)
      this.id = created.session.id
      this.token = created.resume_token
      this.incarnation = created.session.fence.incarnation
      return true
    } catch (error) {
      if (link.client.closeCode !== null) return false // a session the store may hold, never used again
      throw error
    }
  }

  /** session.resume; false when it must be tried again (the process died, the store is away). */
  private async resume(link: Link): Promise<boolean> {
    const resume = { type: 'session.resume', session_id: this.id, resume_token: this.token, lease_generation: this.generation, last_response_seq: this.lastResponseSeq }
    this.backends.resuming(link.backend, +1)
    let reply: any
    try {
      link.client.send(resume)
      reply = await link.client.next((e) => e.type === 'session.resumed' || e.type === 'error', 0, 30_000)
    } catch (error) {
      if (link.client.closeCode !== null) return false
      throw error
    } finally {
      this.backends.resuming(link.backend, -1)
    }
    if (reply.type === 'error') {
      if (reply.error.code === 'SESSION_STORE_UNAVAILABLE') this.tally.storeUnavailable++
      if (!reply.error.retryable) throw new Error(`${this.name}: resume refused: ${JSON.stringify(reply.error)}`)
      await sleep(100)
      return false
    }
    const fence = reply.session.fence
    // The counters carry on from what this client saw: never back at 0 after a move.
    if (fence.turn_id < this.acknowledged || fence.response_seq < this.lastResponseSeq) {
      this.tally.counterChecks.push(
        `${this.name}: moved with turn_id ${fence.turn_id} and response_seq ${fence.response_seq}, after ${this.acknowledged} acknowledged turns and response ${this.lastResponseSeq} done`,
      )
    }
    if (fence.incarnation !== this.incarnation) this.tally.moves++
    this.incarnation = fence.incarnation
    this.generation = reply.session.lease_generation
    return true
  }
}

/** The processes, the kills and the outage of one seed. */
class Chaos implements Backends {
  readonly log: string[] = []
  kills = 0
  aimedKills = 0
  /** The next event of this type, received or sent by any client, kills the process at the
   *  other end `delayMs` later. */
  private armed: { type: string; delayMs: number } | null = null
  private readonly inFlightResumes = new Map<number, number>()
  private readonly owners = new Map<string, number>()
  private readonly restarts: Promise<unknown>[] = []
  private stopped = false

  constructor(
    private readonly cluster: Cluster,
    private readonly random: () => number,
    private readonly started: number,
  ) {}

  pick(random: () => number): { index: number; url: string } | null {
    const live = this.live()
    if (live.length === 0) return null
    const index = live[Math.floor(random() * live.length)]!
    return { index, url: `ws://127.0.0.1:${this.cluster.ports[index]}` }
  }

  observe(index: number, event: any): void {
    if (this.armed === null || event.type !== this.armed.type) return
    const { type, delayMs } = this.armed
    this.armed = null
    const why = delayMs === 0 ? `right after ${type}` : `${delayMs} ms after ${type}`
    const aimed = (): void => {
      if (this.kill(index, why)) this.aimedKills++
    }
    if (delayMs === 0) aimed()
    else setTimeout(aimed, delayMs)
  }

  resuming(index: number, delta: number): void {
    this.inFlightResumes.set(index, (this.inFlightResumes.get(index) ?? 0) + delta)
  }

  attached(name: string, index: number): void {
    this.owners.set(name, index)
  }

  /** Kills (random or aimed) every 0.8-1.6 s, and one Redis outage, until stop(). */
  async run(): Promise<void> {
    let round = 0
    while (!this.stopped) {
      await sleep(800 + this.random() * 800)
      if (this.stopped) break
      round++
      if (round === 3) {
        await this.outage()
        continue
      }
      const choice = this.random()
      // While a write is on its way (the proxy holds it STORE_DELAY_MS each way).
      const inFlight = Math.round(5 + this.random() * 2.4 * STORE_DELAY_MS)
      if (choice < 0.2) {
        const victim = this.pick(this.random)
        if (victim !== null) this.kill(victim.index, 'at random')
      } else if (choice < 0.4) {
        this.armed = { type: 'input_text.append', delayMs: inFlight }
      } else if (choice < 0.6) {
        this.armed = { type: 'input.committed', delayMs: 0 }
      } else if (choice < 0.8) {
        this.armed = { type: 'response.created', delayMs: inFlight }
      } else {
        this.armed = { type: 'response.done', delayMs: 0 }
      }
    }
    this.armed = null
    await Promise.all(this.restarts)
  }

  stop(): void {
    this.stopped = true
  }

  /** Redis killed; a process killed while it is away (its clients' resumes find no store); Redis
   *  back (its append-only file holds everything it acknowledged). */
  private async outage(): Promise<void> {
    this.log.push(`${this.at()} redis-server killed`)
    await this.cluster.redis!.stop()
    await sleep(200)
    // The process driving the most conversations, so that some clients must resume meanwhile.
    const driven = [0, 1, 2].map((i) => [...this.owners.values()].filter((owner) => owner === i).length)
    this.kill(driven.indexOf(Math.max(...driven)), 'during the store outage')
    await sleep(600 + this.random() * 600)
    await this.cluster.restartRedis()
    this.log.push(`${this.at()} redis-server started again`)
  }

  /** Kills process `index` (and starts it again soon); false when it is not up, has a resume in
   *  flight, or is the last one up. */
  private kill(index: number, why: string): boolean {
    // Killing a process whose resume is in flight would lose the resume's answer, and with it the
    // session's new lease generation (docs/scaling.md): not a moment this test aims at.
    if (this.cluster.backends[index] === null || (this.inFlightResumes.get(index) ?? 0) > 0 || this.live().length < 2) return false
    this.kills++
    this.log.push(`${this.at()} process ${index} killed ${why}`)
    void this.cluster.kill(index)
    this.restarts.push(sleep(200 + this.random() * 300).then(() => this.restart(index)))
    return true
  }

  /** Starts process `index` again; `ortex serve` refuses to start while its store is away, so
   *  it is tried again until the store is back. */
  private async restart(index: number): Promise<void> {
    for (let attempt = 1; ; attempt++) {
      try {
        await this.cluster.startBackend(index)
        return
      } catch (error) {
        if (attempt === 40) throw error
        await sleep(250)
      }
    }
  }

  private live(): number[] {
    return [0, 1, 2].filter((i) => this.cluster.backends[i] !== null)
  }

  private at(): string {
    return `${((performance.now() - this.started) / 1000).toFixed(2)}s`
  }
}

/** The conversations on one server that never fails: the turns they must give. */
async function controlTurns(server: OrtexServer, texts: string[][]): Promise<number[][][]> {
  const url = server.url.replace('http', 'ws')
  const backends: Backends = { pick: () => ({ index: 0, url }), observe: () => {}, resuming: () => {}, attached: () => {} }
  const tally: Tally = { moves: 0, replays: 0, storeUnavailable: 0, counterChecks: [] }
  const conversations = texts.map((script, i) => new Conversation(`control-${i}`, script, backends, Math.random, tally, () => 0))
  await Promise.all(conversations.map((c) => c.run()))
  return conversations.map((c) => c.turns)
}

let root = ''
beforeAll(() => {
  root = mkdtempSync(path.join(tmpdir(), 'ortex-chaos-'))
})
afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
  expect(livingProcesses()).toEqual([])
})

describe('failover under kills and a store restart, seeded', () => {
  let reference: { server: OrtexServer; engine: Engine }

  beforeAll(async () => {
    const engine = Engine.simulated(SERVE_SIMULATED)
    reference = { engine, server: await startServer(engine, { port: 0 }) }
  })
  afterAll(async () => {
    await reference?.server.close()
    await reference?.engine.close()
  })

  it.each(SEEDS)('seed %i: no turn lost, doubled or changed', async (seed) => {
    const texts = scripts(seed)
    const expected = await controlTurns(reference.server, texts)
    const cluster = await Cluster.start(path.join(root, `seed-${seed}`), ['--simulated'], { nginx: false, durableRedis: true, storeDelayMs: STORE_DELAY_MS })
    const random = generator(seed)
    const chaos = new Chaos(cluster, generator(seed * 31 + 1), performance.now())
    const tally: Tally = { moves: 0, replays: 0, storeUnavailable: 0, counterChecks: [] }
    const conversations = texts.map((script, i) => new Conversation(`s${seed}-${i}`, script, chaos, generator(seed * 1000 + i), tally, () => 300 + random() * 600))
    const started = performance.now()
    try {
      const monkey = chaos.run()
      await within(SEED_LIMIT_MS, `seed ${seed}'s conversations`, () => Promise.all(conversations.map((c) => c.run())).finally(() => chaos.stop()))
      await monkey
    } finally {
      chaos.stop()
      await cluster.stop()
    }
    const failed = conversations.reduce((sum, c) => sum + c.failedResponses, 0)
    const summary =
      `seed ${seed}: ${((performance.now() - started) / 1000).toFixed(1)} s, ${chaos.kills} kills (${chaos.aimedKills} aimed), ` +
      `${tally.moves} moves, ${tally.replays} appends answered replayed, ${failed} responses lost in a move and asked again, ` +
      `${tally.storeUnavailable} resumes refused while the store was away`
    console.log(`${summary}\n  ${chaos.log.join('\n  ')}`)
    const problems: string[] = [...tally.counterChecks]
    conversations.forEach((conversation, i) => {
      conversation.turns.forEach((tokens, turn) => {
        if (JSON.stringify(tokens) !== JSON.stringify(expected[i]![turn])) {
          problems.push(`session ${i} turn ${turn}: got ${JSON.stringify(tokens)}, expected ${JSON.stringify(expected[i]![turn])}`)
        }
      })
    })
    expect(problems, `seed ${seed} (replay: CHAOS_SEED=${seed}): turns that differ from the same conversations on one process, and counters that went back`).toEqual([])
    expect(chaos.kills, summary).toBeGreaterThanOrEqual(3)
    expect(tally.moves, summary).toBeGreaterThan(0)
    expect(tally.storeUnavailable, summary).toBeGreaterThan(0)
  })
})
