// Structured output on a real model (issue 31, item 5): SmolLM2-135M-Instruct (int4) at
// concurrency 1 and 16, tokens/s of turns under a JSON Schema constraint against the same turns
// unconstrained, and unconstrained turns of this build against another build's (`--before`, the
// dist/index.mjs of a checkout without constraints), all in one run. Each measurement is a child
// process (one engine, one warm-up round, then one timed round); the configurations alternate
// round by round, each round starting with the next one, so that drift on a shared machine falls
// on all of them alike; each reports the median of its rounds. Every turn generates exactly
// TOKENS tokens: unconstrained ones with ignoreEos, constrained ones under a schema whose string
// cannot close sooner (minLength).
//
// The mask's own time per token is crates/ortex-core/examples/mask_bench.rs (same schema family).
//
// Build first (npm run build), then:
//   npx esbuild bench/constraints.ts --bundle --platform=node --format=esm --packages=external \
//     --outfile=bench/out/constraints.mjs
//   node bench/out/constraints.mjs [--before /path/to/other/dist/index.mjs] [--rounds 3]
import { spawnSync } from 'node:child_process'
import { pathToFileURL } from 'node:url'
import { parseArgs } from 'node:util'
import { performance } from 'node:perf_hooks'
import { chatPrompt, smolLM2Folder } from '../ts/modelkit/real-model'

const TOKENS = 64
const SCHEMA = {
  type: 'object',
  properties: { story: { type: 'string', minLength: 400 } },
  required: ['story'],
  additionalProperties: false,
}
const QUESTION = 'Write a long story about a lighthouse keeper, as JSON: {"story": "..."}'

const { values } = parseArgs({
  options: {
    child: { type: 'boolean', default: false },
    module: { type: 'string' },
    constrained: { type: 'boolean', default: false },
    concurrency: { type: 'string', default: '1' },
    before: { type: 'string' },
    rounds: { type: 'string', default: '3' },
  },
})

/** One child's measurement: a warm-up round, then one timed round; prints tokens/s as JSON. */
async function child(): Promise<void> {
  const mod = (await import(values.module!)) as typeof import('ortex')
  const dir = (await smolLM2Folder('int4')).dir
  const engine = await mod.Engine.load(dir, { intraOpThreads: 2, maxBatchSize: 16 })
  const concurrency = Number(values.concurrency)
  const prompt = chatPrompt(QUESTION)
  const round = async (): Promise<number> => {
    const turns = Array.from({ length: concurrency }, (_, i) =>
      engine.generate(prompt, {
        maxGeneratedTokens: TOKENS,
        temperature: 0.7,
        seed: i,
        ...(values.constrained ? { constraint: { type: 'json_schema', schema: SCHEMA } } : { ignoreEos: true }),
      } as never).done,
    )
    const results = await Promise.all(turns)
    for (const r of results) {
      if (r.usage.generatedTokens !== TOKENS) throw new Error(`a turn generated ${r.usage.generatedTokens} tokens (${r.finishReason})`)
    }
    return results.length * TOKENS
  }
  await round()
  const started = performance.now()
  const tokens = await round()
  const seconds = (performance.now() - started) / 1000
  await engine.close()
  console.log(JSON.stringify({ tokensPerSecond: tokens / seconds }))
}

function measure(module: string, constrained: boolean, concurrency: number): number {
  const args = [process.argv[1]!, '--child', '--module', module, '--concurrency', String(concurrency)]
  if (constrained) args.push('--constrained')
  const run = spawnSync(process.execPath, args, { encoding: 'utf8', timeout: 300_000 })
  if (run.status !== 0) throw new Error(`child failed: ${run.stderr}`)
  return (JSON.parse(run.stdout.trim().split('\n').pop()!) as { tokensPerSecond: number }).tokensPerSecond
}

const median = (xs: number[]): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!

async function main(): Promise<void> {
  const after = import.meta.resolve('ortex')
  const configs: Array<{ name: string; module: string; constrained: boolean }> = [
    { name: 'unconstrained', module: after, constrained: false },
    { name: 'json_schema', module: after, constrained: true },
  ]
  if (values.before) configs.push({ name: 'unconstrained (before)', module: pathToFileURL(values.before).href, constrained: false })
  const rounds = Number(values.rounds)
  console.log(`SmolLM2-135M-Instruct int4, ${TOKENS} tokens per turn, temperature 0.7, median of ${rounds} rounds`)
  for (const concurrency of [1, 16]) {
    const samples = new Map(configs.map((c) => [c.name, [] as number[]]))
    for (let r = 0; r < rounds; r++) {
      // Each round starts with a different configuration, so none always runs first.
      const order = configs.map((_, i) => configs[(i + r) % configs.length]!)
      for (const c of order) samples.get(c.name)!.push(measure(c.module, c.constrained, concurrency))
    }
    const base = median(samples.get('unconstrained')!)
    for (const c of configs) {
      const xs = samples.get(c.name)!
      const m = median(xs)
      console.log(
        `  concurrency ${String(concurrency).padStart(2)}  ${c.name.padEnd(24)} ${m.toFixed(1).padStart(7)} tokens/s  ` +
          `(${(m / base).toFixed(2)}x; rounds ${xs.map((x) => x.toFixed(1)).join(' / ')})`,
      )
    }
  }
}

await (values.child ? child() : main())
