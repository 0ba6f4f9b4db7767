// The seeded whole-engine simulation (test/sim/driver.ts) over many seeds, on both backends.
//
//   npx vitest run test/sim                      seeds 1..2000 (the CI default) on native and wasm
//   SIM_SEEDS=20000 npx vitest run test/sim      seeds 1..20000
//   SIM_SEED=123 npx vitest run test/sim         replays seed 123 (longer trace on failure)
//   SIM_BACKEND=wasm ...                         one backend only
//
// Each seed has a faults phase and a liveness phase (driver.ts). A failure names its seed, its
// backend and the command that replays it, followed by the tail of the trace (actions, runs and
// events) that led to it.
import { describe, expect, it } from 'vitest'
import { ortex, selectedBackends } from '../helpers/backends'
import { runSimSeed, SimFailure, type SimSummary } from './driver'

const single = process.env.SIM_SEED !== undefined ? Number(process.env.SIM_SEED) : undefined
const count = Number(process.env.SIM_SEEDS ?? 2000)
if (single !== undefined && !Number.isInteger(single)) throw new Error(`SIM_SEED must be an integer, got ${process.env.SIM_SEED}`)
if (!Number.isInteger(count) || count < 1) throw new Error(`SIM_SEEDS must be a positive integer, got ${process.env.SIM_SEEDS}`)

const seeds = single !== undefined ? [single] : Array.from({ length: count }, (_, i) => i + 1)
const CHUNK = 250
const chunks: number[][] = []
for (let i = 0; i < seeds.length; i += CHUNK) chunks.push(seeds.slice(i, i + CHUNK))

const hasGc = typeof (globalThis as any).gc === 'function'
/** Dropping handles needs the collector; one seed in ten does it. */
const usesGc = (seed: number) => hasGc && seed % 10 === 0

function replayCommand(seed: number, backend: string): string {
  return `SIM_SEED=${seed} SIM_BACKEND=${backend} npx vitest run test/sim`
}

describe.each(selectedBackends())('simulation (%s)', (backend) => {
  const mod = ortex(backend)
  const totals: SimSummary = { seed: 0, runs: 0, turnsBegun: 0, turnsFinished: 0, events: 0, engineEvents: 0, cancelled: 0, dropped: 0, cachedPromptTokens: 0, fatal: false }
  let fatalSeeds = 0

  it.each(chunks.map((chunk) => [`${chunk[0]}..${chunk[chunk.length - 1]}`, chunk] as const))(
    'seeds %s',
    async (_label, chunk) => {
      const failures: SimFailure[] = []
      for (const seed of chunk) {
        try {
          const summary = await runSimSeed(mod, backend, seed, { gc: usesGc(seed), traceLines: single !== undefined ? 2000 : 60 })
          totals.runs += summary.runs
          totals.turnsBegun += summary.turnsBegun
          totals.turnsFinished += summary.turnsFinished
          totals.events += summary.events
          totals.engineEvents += summary.engineEvents
          totals.cancelled += summary.cancelled
          totals.dropped += summary.dropped
          totals.cachedPromptTokens += summary.cachedPromptTokens
          if (summary.fatal) fatalSeeds++
        } catch (error) {
          if (!(error instanceof SimFailure)) throw error
          failures.push(error)
        }
      }
      if (failures.length > 0) {
        const lines = [
          `${failures.length} of ${chunk.length} seeds failed on ${backend}:`,
          ...failures.slice(0, 10).map((f) => `  seed ${f.seed}: ${f.reason}\n    replay: ${replayCommand(f.seed, backend)}`),
        ]
        for (const f of failures.slice(0, process.env.SIM_TRACE === 'all' ? failures.length : 1)) {
          lines.push(`trace of seed ${f.seed} (last ${f.trace.length} lines):`, ...f.trace.map((line) => `  ${line}`))
        }
        if (failures.some((f) => usesGc(f.seed))) {
          lines.push('(seeds that drop handles depend on when the collector runs: a replay may take another path)')
        }
        expect.fail(lines.join('\n'))
      }
    },
    600_000,
  )

  it.runIf(single === undefined && seeds.length >= 500)('exercised every kind of event', () => {
    console.log(`[sim ${backend}] ${seeds.length} seeds: ${JSON.stringify({ ...totals, seed: undefined, fatal: undefined, fatalSeeds })}`)
    expect(totals.turnsFinished).toBeGreaterThan(seeds.length)
    expect(totals.cancelled).toBeGreaterThan(0)
    expect(totals.engineEvents).toBeGreaterThan(0)
    expect(totals.cachedPromptTokens).toBeGreaterThan(0)
    expect(fatalSeeds).toBeGreaterThan(0)
    if (hasGc) expect(totals.dropped).toBeGreaterThan(0)
  })
})
