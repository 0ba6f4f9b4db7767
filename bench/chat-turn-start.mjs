// How long a chat turn takes to start: from the call to a Turn in hand (engine.chat returns it;
// engine.chatAsync's promise settles with it), on the simulated model, native and WebAssembly, for
// a short conversation and a long one. Beside them, in the same run, the same turn begun the way
// engine.chat began it before issue 29 item 3 (render, tokenize, begin: three crossings), spelled
// with public calls: generate(tokenize(applyChatTemplate(messages))). And a conversation's send
// (engine.createChat) seeded with the same messages, each send timed from the call to its Turn.
// Medians of microseconds per start; the turns' generation (one token each) is awaited outside the
// timing.
//
//   npm run build && node bench/chat-turn-start.mjs [--dist DIR] [--against DIR] [--rounds 5]
//
// --dist: the built facade to measure (default: this checkout's dist/), e.g. another checkout's, to
// compare commits. --against: another built facade (with its own native/ and wasm-pkg/ beside
// it) whose sends are measured in the same process, alternating with --dist's, as the row
// "send (against)". Prints a table and writes bench/out/chat-turn-start.json.
import { mkdirSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { parseArgs } from 'node:util'
import { pathToFileURL } from 'node:url'

const { values } = parseArgs({ options: { dist: { type: 'string' }, against: { type: 'string' }, rounds: { type: 'string', default: '5' } } })
const dist = path.resolve(values.dist ?? path.join(import.meta.dirname, '../dist'))
const against = values.against === undefined ? null : path.resolve(values.against)
const rounds = Number(values.rounds)

const CONVERSATIONS = {
  short: { turns: 400, messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'What is a river delta?' }] },
  long: {
    turns: 40,
    messages: Array.from({ length: 200 }, (_, i) => ({ role: i % 2 === 0 ? 'user' : 'assistant', content: `message ${i} `.repeat(20) })),
  },
}
const OPTIONS = { maxGeneratedTokens: 1 }

const WAYS = {
  'three calls (before)': (engine, messages) => engine.generate(engine.tokenize(engine.applyChatTemplate(messages)), OPTIONS),
  chat: (engine, messages) => engine.chat(messages, OPTIONS),
  chatAsync: (engine, messages) => engine.chatAsync(messages, OPTIONS),
  send: null, // measureSends
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.floor(sorted.length / 2)]
}

/** Sends on one conversation before a fresh one is seeded: its history grows by two messages a
 *  send, and the rows compare sends on about the history the other ways render. */
const SENDS_PER_CONVERSATION = 20

/** A conversation holding `messages` (each sent, its one-token reply awaited: untimed). */
async function seededConversation(engine, messages) {
  const conversation = engine.createChat()
  for (const message of messages) await conversation.send(message, OPTIONS).done
  return conversation
}

/** Microseconds per send on a conversation seeded with `messages`, median over `turns` sends. */
async function measureSends(engine, { turns, messages }) {
  const samples = []
  let conversation = null
  for (let i = 0; i < turns; i++) {
    if (i % SENDS_PER_CONVERSATION === 0) {
      conversation?.close()
      conversation = await seededConversation(engine, messages)
    }
    const started = performance.now()
    const turn = conversation.send(`question ${i}`, OPTIONS)
    samples.push((performance.now() - started) * 1000)
    await turn.done
  }
  conversation?.close()
  return median(samples)
}

/** Microseconds per start, median over `turns` starts. */
async function measure(engine, way, { turns, messages }) {
  if (way === 'send') return measureSends(engine, { turns, messages })
  const samples = []
  for (let i = 0; i < turns; i++) {
    const started = performance.now()
    const turn = await WAYS[way](engine, messages)
    samples.push((performance.now() - started) * 1000)
    await turn.done
  }
  return median(samples)
}

async function simulated(facade, entry) {
  const { Engine } = await import(pathToFileURL(path.join(facade, entry)).href)
  return Engine.simulated({ seed: 1, maxLength: 1 << 16 })
}

async function backend(entry) {
  const engine = await simulated(dist, entry)
  const other = against === null ? null : await simulated(against, entry)
  const rows = {}
  try {
    for (const [name, conversation] of Object.entries(CONVERSATIONS)) {
      for (const way of Object.keys(WAYS)) rows[`${name}, ${way}`] = []
      if (other !== null) rows[`${name}, send (against)`] = []
      for (let round = 0; round < rounds; round++) {
        // Ways alternate inside each round, so a slower stretch of the machine hits them alike.
        for (const way of Object.keys(WAYS)) rows[`${name}, ${way}`].push(await measure(engine, way, conversation))
        if (other !== null) rows[`${name}, send (against)`].push(await measure(other, 'send', conversation))
      }
    }
  } finally {
    await engine.close()
    await other?.close()
  }
  return Object.fromEntries(Object.entries(rows).map(([key, samples]) => [key, median(samples)]))
}

const report = { dist, against, rounds, results: {} }
for (const [name, entry] of [['native', 'index.mjs'], ['wasm', 'wasm.mjs']]) {
  try {
    report.results[name] = await backend(entry)
  } catch (error) {
    console.log(`${name}: not measured (${error.message.split('\n')[0]})`)
  }
}
console.log('| backend | conversation, way | start (µs, median) | against three calls |')
console.log('|---|---|---:|---:|')
for (const [name, rows] of Object.entries(report.results)) {
  for (const [key, us] of Object.entries(rows)) {
    const base = rows[`${key.split(',')[0]}, three calls (before)`]
    console.log(`| ${name} | ${key} | ${us.toFixed(1)} | ${(us / base).toFixed(2)}x |`)
  }
}
mkdirSync(path.join(import.meta.dirname, 'out'), { recursive: true })
writeFileSync(path.join(import.meta.dirname, 'out/chat-turn-start.json'), JSON.stringify(report, null, 2))
