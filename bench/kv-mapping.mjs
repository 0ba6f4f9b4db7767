// What the paged-KV mapping costs on CPU: the ONNX executor's time gathering each row's past out of
// the engine's blocks, inside ONNX Runtime, and scattering the new keys/values back, per step, in
// three modes: `shared` (the default: gqa decodes bind one buffer as past and present, mha carries
// present over as past), `carry` (ORTEX_SHARE_PAST=0: gqa carries present too) and `off`
// (ORTEX_CARRY_PRESENT=0: every step gathers from the blocks). See docs/performance.md.
//
//   node dist/cli.js make-model --out .cache/models/bench-gqa --size bench --attention gqa
//   node bench/kv-mapping.mjs .cache/models/bench-gqa [--concurrency 1,4,16] [--tokens 128] [--repeats 3] [--threads 2]
//
// Prints one line per (concurrency, mode) with per-step medians and writes bench/out/kv-mapping.json.
import { Engine } from '../dist/index.mjs'
import { PROMPT, parseModelArgs, writeReport } from './model-bench.mjs'

const { dir, values } = parseModelArgs('kv-mapping.mjs', { concurrency: '1,4,16', tokens: '128', repeats: '3', threads: '2' })

const MODES = {
  shared: {},
  carry: { ORTEX_SHARE_PAST: '0' },
  off: { ORTEX_CARRY_PRESENT: '0' },
}

async function once(concurrency, tokens, threads, mode) {
  const env = MODES[mode]
  Object.assign(process.env, env)
  const engine = await Engine.load(dir, { intraOpThreads: threads, maxBatchSize: Math.max(16, concurrency) }).finally(() => {
    for (const key of Object.keys(env)) delete process.env[key]
  })
  try {
    const prompt = engine.tokenize(PROMPT)
    const started = performance.now()
    const turns = Array.from({ length: concurrency }, () =>
      engine.generate(prompt, { maxGeneratedTokens: tokens, ignoreEos: true }),
    )
    await Promise.all(turns.map((t) => t.done))
    const wallUs = (performance.now() - started) * 1000
    return { wallUs, ...engine.executorStats() }
  } finally {
    await engine.close()
  }
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]
const rows = []
for (const concurrency of values.concurrency.split(',').map(Number)) {
  const runs = { shared: [], carry: [], off: [] }
  for (let r = 0; r < Number(values.repeats); r++) {
    for (const mode of Object.keys(MODES)) {
      runs[mode].push(await once(concurrency, Number(values.tokens), Number(values.threads), mode))
    }
  }
  for (const mode of Object.keys(MODES)) {
    const perStep = (key) => median(runs[mode].map((s) => s[key] / s.steps / 1000))
    const row = {
      concurrency,
      mode,
      steps: runs[mode][0].steps,
      carried: runs[mode][0].carried,
      runMs: perStep('runUs'),
      gatherMs: perStep('gatherUs'),
      scatterMs: perStep('scatterUs'),
      stepMs: perStep('wallUs'),
    }
    row.mappingPctOfRun = (100 * (row.gatherMs + row.scatterMs)) / row.runMs
    row.outsideRunPctOfStep = (100 * (row.stepMs - row.runMs)) / row.stepMs
    rows.push(row)
    console.log(
      `concurrency ${String(concurrency).padStart(2)} ${mode.padEnd(6)}: per step run ${row.runMs.toFixed(2)} ms, ` +
        `gather ${row.gatherMs.toFixed(2)} ms, scatter ${row.scatterMs.toFixed(2)} ms ` +
        `(mapping ${row.mappingPctOfRun.toFixed(1)}% of run; outside the run ${row.outsideRunPctOfStep.toFixed(1)}% of the step)`,
    )
  }
}
writeReport('kv-mapping.json', { dir, ...values, rows })
