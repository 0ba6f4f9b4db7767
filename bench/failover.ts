// What a failover costs a duplex session (docs/scaling.md): the time from session.resume to the
// first token of the next response, when the resume reaches the process that holds the session
// ("kept": the KV is there) and when it reaches another one that takes the session over from the
// Redis session store ("moved": the stored conversation is prefilled first), against the
// conversation's length. Two servers in this process over the same model folder share a
// redis-server started here (Debian's; `npm run test:scale` installs it).
//
// Build first (npm run build), then:
//   npx esbuild bench/failover.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --outfile=bench/out/failover.mjs && node bench/out/failover.mjs [--model DIR] [--quick]
// Default model: SmolLM2-135M-Instruct as `npm run demo` imports it (~/.cache/ortex/models/smollm2-0.1.2-fp32-i2).
// Prints a table and writes bench/out/failover.json.
import { existsSync, mkdirSync, writeFileSync } from 'node:fs'
import * as os from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import { Engine, type OrtexServer, startServer } from 'ortex'
import { DuplexClient, freePort, startRedis } from '../test/scale/processes'

const quick = process.argv.includes('--quick')
const modelArg = process.argv.indexOf('--model')
const MODEL = modelArg === -1 ? join(os.homedir(), '.cache/ortex/models/smollm2-0.1.2-fp32-i2') : process.argv[modelArg + 1]!
const LENGTHS = quick ? [128, 1024] : [128, 512, 1024, 2048]
const REPEATS = quick ? 1 : 3
const MAX_OUTPUT_TOKENS = 4

interface Row {
  conversationTokens: number
  /** The conversation's first response: its final append -> first token (a cold prefill). */
  coldMs: number
  keptMs: number
  movedMs: number
}

/** Text of about `tokens` tokens of `engine`'s tokenizer. */
function textOf(engine: Engine, tokens: number, salt: number): string {
  const words = ['river', 'stone', 'window', 'garden', 'letter', 'morning', 'engine', 'silver', 'harbor', 'candle']
  let text = ''
  for (let i = 0; engine.tokenize(text).length < tokens; i++) text += `${words[(i * 7 + salt) % words.length]} ${i % 97} `
  return text
}

interface Opened {
  id: string
  token: string
  generation: number
  coldMs: number
}

async function openWithConversation(server: OrtexServer, text: string): Promise<Opened> {
  const client = await DuplexClient.connect(server.url.replace('http', 'ws'))
  client.send({ type: 'session.update', session: { temperature: 0, max_output_tokens: MAX_OUTPUT_TOKENS } })
  await client.next((e) => e.type === 'session.updated')
  const started = performance.now()
  client.send({ type: 'input_text.append', text, final: true })
  await client.next((e) => e.type === 'response.output_text.delta', 0, 600_000)
  const coldMs = performance.now() - started
  const created = await client.next((e) => e.type === 'session.created', 0, 600_000)
  await client.next((e) => e.type === 'response.done', 0, 600_000)
  client.close()
  await client.closed()
  return { id: created.session.id, token: created.resume_token, generation: 0, coldMs }
}

/** Milliseconds from session.resume to the first token of the next response. */
async function resumeToFirstToken(server: OrtexServer, session: { id: string; token: string; generation: number }): Promise<number> {
  const client = await DuplexClient.connect(server.url.replace('http', 'ws'))
  const started = performance.now()
  client.send({ type: 'session.resume', session_id: session.id, resume_token: session.token, lease_generation: session.generation })
  client.send({ type: 'input_text.append', text: ' Go on.', final: true })
  const resumed = await client.next((e) => e.type === 'session.resumed' || e.type === 'error', 0, 600_000)
  if (resumed.type === 'error') throw new Error(`resume refused: ${resumed.error.code}`)
  await client.next((e) => e.type === 'response.output_text.delta', 0, 600_000)
  const elapsed = performance.now() - started
  await client.next((e) => e.type === 'response.done', 0, 600_000)
  session.generation = resumed.session.lease_generation
  client.close()
  await client.closed()
  return elapsed
}

const median = (values: number[]): number => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

async function main(): Promise<void> {
  if (!existsSync(join(MODEL, 'genai_config.json'))) {
    throw new Error(`no model folder at ${MODEL}: run \`npm run demo\` (it imports SmolLM2) or pass --model DIR`)
  }
  const redis = await startRedis(await freePort())
  const options = { kvCacheBytes: 256 << 20 }
  const engines = [await Engine.load(MODEL, options), await Engine.load(MODEL, options)]
  const [a, b] = await Promise.all(engines.map((engine) => startServer(engine, { port: 0, duplex: { sessionStore: redis.url } })))
  const rows: Row[] = []
  try {
    for (const length of LENGTHS.filter((n) => n < engines[0]!.config.maxLength - 64)) {
      const cold: number[] = []
      const kept: number[] = []
      const moved: number[] = []
      for (let repeat = 0; repeat < REPEATS; repeat++) {
        const session = await openWithConversation(a!, textOf(engines[0]!, length, repeat))
        cold.push(session.coldMs)
        kept.push(await resumeToFirstToken(a!, session))
        // The session moves to B (a resume that reaches another process, as after A died).
        moved.push(await resumeToFirstToken(b!, session))
      }
      const row = { conversationTokens: length, coldMs: median(cold), keptMs: median(kept), movedMs: median(moved) }
      rows.push(row)
      process.stderr.write(`${length} tokens: cold ${row.coldMs.toFixed(0)} ms, kept ${row.keptMs.toFixed(0)} ms, moved ${row.movedMs.toFixed(0)} ms\n`)
    }
  } finally {
    await Promise.all([a!.close(), b!.close()])
    for (const engine of engines) await engine.close()
    await redis.stop()
  }
  console.log(`\nresume -> first token (median of ${REPEATS}), ${MODEL}, ${os.cpus().length} cores`)
  console.log('| conversation tokens | first response, cold prefill (ms) | resume, kept (ms) | resume, moved (ms) | moved / cold |')
  console.log('|---|---|---|---|---|')
  for (const row of rows) {
    const cells = [row.conversationTokens, row.coldMs.toFixed(0), row.keptMs.toFixed(0), row.movedMs.toFixed(0), (row.movedMs / row.coldMs).toFixed(2)]
    console.log(`| ${cells.join(' | ')} |`)
  }
  const out = resolve(dirname(fileURLToPath(import.meta.url)))
  mkdirSync(out, { recursive: true })
  writeFileSync(join(out, 'failover.json'), JSON.stringify({ model: MODEL, cores: os.cpus().length, repeats: REPEATS, rows }, null, 2))
}

await main()
