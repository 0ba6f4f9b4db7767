// What waiting for the session store costs a duplex turn (docs/scaling.md): with a store, a client
// hears of a commit only once the store holds it, so a turn's final append is acknowledged (and
// its response's first token sent) one store write after the append, and its response.done one
// more write after the response ended. Three servers over the simulated engine (no model time to
// hide the store's) in this process: without a store, with a redis-server on loopback, and with
// that redis-server behind a proxy that holds each way --delay-ms (default 1: a store a network
// hop away). One conversation per server, the same turns, run in turn on each so that the
// machine's load falls on all three alike. Per turn: the final append to its input.committed, to
// the first delta and to response.done; medians over --turns turns (default 200; a new session
// every 20 turns, within the simulated model's context), and the median Redis round trip (PING)
// directly and through the proxy.
//
// Build first (npm run build), then:
//   npx esbuild bench/commit-cost.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --external:ws --external:ioredis --outfile=bench/out/commit-cost.mjs \
//     && node bench/out/commit-cost.mjs [--turns N] [--delay-ms MS]
// Prints a table and writes bench/out/commit-cost.json.
import { mkdirSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import Redis from 'ioredis'
import { Engine, type OrtexServer, startServer } from 'ortex'
import { DuplexClient, freePort, startDelayProxy, startRedis } from '../test/scale/processes'

const flag = (name: string, fallback: number): number => {
  const at = process.argv.indexOf(name)
  return at === -1 ? fallback : Number(process.argv[at + 1])
}
const TURNS = flag('--turns', 200)
const DELAY_MS = flag('--delay-ms', 1)
const MAX_OUTPUT_TOKENS = 12
const TURNS_PER_SESSION = 20

interface Times {
  committedMs: number
  firstTokenMs: number
  doneMs: number
}

interface Mode {
  name: string
  server: OrtexServer
  engine: Engine
  client: DuplexClient | null
  times: Times[]
}

async function mode(name: string, sessionStore?: string): Promise<Mode> {
  const engine = Engine.simulated({ seed: 0, eosProbability: 0 })
  const server = await startServer(engine, { port: 0, duplex: sessionStore === undefined ? {} : { sessionStore } })
  return { name, server, engine, client: null, times: [] }
}

/** A new session on `mode`'s server (the last one is closed). */
async function newSession(mode: Mode): Promise<DuplexClient> {
  mode.client?.close()
  const client = await DuplexClient.connect(mode.server.url.replace('http', 'ws'))
  client.send({ type: 'session.update', session: { temperature: 0, max_output_tokens: MAX_OUTPUT_TOKENS } })
  await client.next((e) => e.type === 'session.updated')
  mode.client = client
  return client
}

async function turn(mode: Mode, i: number): Promise<void> {
  const client = i % TURNS_PER_SESSION === 0 ? await newSession(mode) : mode.client!
  const from = client.events.length
  const started = performance.now()
  const at = (type: string): Promise<number> => client.next((e) => e.type === type, from).then(() => performance.now() - started)
  const waits = [at('input.committed'), at('response.output_text.delta'), at('response.done')]
  client.send({ type: 'input_text.append', text: `Turn ${i}: tell me more about the river.`, final: true })
  const [committedMs, firstTokenMs, doneMs] = (await Promise.all(waits)) as [number, number, number]
  mode.times.push({ committedMs, firstTokenMs, doneMs })
}

async function roundTripMs(url: string): Promise<number> {
  const redis = new Redis(url)
  const times: number[] = []
  for (let i = 0; i < 200; i++) {
    const started = performance.now()
    await redis.ping()
    times.push(performance.now() - started)
  }
  redis.disconnect()
  return median(times)
}

const median = (values: number[]): number => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

async function main(): Promise<void> {
  const redis = await startRedis(await freePort())
  const proxy = await startDelayProxy(redis.port, DELAY_MS)
  const proxied = `redis://127.0.0.1:${proxy.port}`
  const modes = [await mode('no store'), await mode('Redis, loopback', redis.url), await mode(`Redis, ${DELAY_MS} ms each way`, proxied)]
  let pingMs: number[] = []
  try {
    for (let i = 0; i < TURNS; i++) for (const m of modes) await turn(m, i)
    pingMs = [await roundTripMs(redis.url), await roundTripMs(proxied)]
  } finally {
    for (const m of modes) {
      m.client?.close()
      await m.server.close()
      await m.engine.close()
    }
    await proxy.close()
    await redis.stop()
  }
  const rows = modes.map((m) => ({
    mode: m.name,
    committedMs: median(m.times.map((t) => t.committedMs)),
    firstTokenMs: median(m.times.map((t) => t.firstTokenMs)),
    doneMs: median(m.times.map((t) => t.doneMs)),
  }))
  const base = rows[0]!
  console.log(`\nper turn (median of ${TURNS}; ${MAX_OUTPUT_TOKENS} tokens a response, simulated engine), ${os.cpus().length} cores`)
  console.log(`Redis PING round trip: ${pingMs[0]!.toFixed(2)} ms on loopback, ${pingMs[1]!.toFixed(2)} ms through the proxy`)
  console.log('| store | append -> input.committed (ms) | append -> first token (ms) | append -> response.done (ms) | turn cost over no store (ms) |')
  console.log('|---|---|---|---|---|')
  for (const row of rows) {
    const cells = [row.mode, row.committedMs.toFixed(2), row.firstTokenMs.toFixed(2), row.doneMs.toFixed(2), (row.doneMs - base.doneMs).toFixed(2)]
    console.log(`| ${cells.join(' | ')} |`)
  }
  const out = resolve(dirname(fileURLToPath(import.meta.url)))
  mkdirSync(out, { recursive: true })
  writeFileSync(join(out, 'commit-cost.json'), JSON.stringify({ turns: TURNS, delayMs: DELAY_MS, cores: os.cpus().length, pingMs, rows }, null, 2))
}

await main()
