// Constraints against material nobody here wrote (issue 31, item 4): every schema of the
// JSON-Schema-Test-Suite, draft 2020-12 (test/helpers/json-schema-suite.ts fetches it once into
// the cache), compiled as a turn's `json_schema` constraint on both backends:
//
// - compiled or refused as test/fixtures/json-schema-suite.json says: a schema refused that the
//   baseline has compiling fails; the refused list may only shrink (a schema that now compiles is
//   reported, and ORTEX_WRITE_BASELINE=1 rewrites the file);
// - every output sampled under a compiled schema (the simulated model, several seeds, temperature
//   1) validates with ajv, an independent validator; so does every output of the tiny ONNX model
//   that finished (native only: ONNX Runtime has no WebAssembly build here);
// - the same seed gives the same constrained text on native and WebAssembly.
//
// Skipped, with a line saying why, where pip or the registry is unavailable.

import { readFileSync, writeFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import Ajv2020 from 'ajv/dist/2020'
import { Engine as NativeEngine, OrtexError } from 'ortex'
import { afterAll, describe, expect, it } from 'vitest'
import { BACKENDS, ortex, type BackendName } from '../helpers/backends'
import { SuiteUnavailable, draft2020Folder, suiteGroups, type SuiteGroup } from '../helpers/json-schema-suite'
import { tinyPrompt, useTinyModels } from '../helpers/tiny-models'

const BASELINE_FILE = join(dirname(fileURLToPath(import.meta.url)), '..', 'fixtures', 'json-schema-suite.json')
const SIM_SEEDS = [1, 2, 3]
const TINY_SEEDS = [1, 2]

interface Baseline {
  suite: string
  /** Group ids (`file.json#index`) whose schema llguidance refuses, with its reason. */
  refused: Record<string, string>
}

function loadGroups(): SuiteGroup[] | string {
  try {
    return suiteGroups(draft2020Folder())
  } catch (error) {
    if (error instanceof SuiteUnavailable) return error.message
    throw error
  }
}

const groups = loadGroups()
if (typeof groups === 'string') console.warn(`[json-schema-suite] skipped: ${groups}`)
const ready = typeof groups === 'string' ? [] : groups
const baseline = JSON.parse(readFileSync(BASELINE_FILE, 'utf8')) as Baseline

/** ajv's validator for a schema, or null where ajv itself refuses it (a remote reference, say).
 *  Formats are not asserted (draft 2020-12 makes them annotations). `multipleOfPrecision`: ajv's
 *  default multipleOf test compares `x / d` with `parseInt(x / d)`, which reads 4.3e79 as 4, so a
 *  sampled 80-digit even integer would fail `multipleOf: 2`; the tolerance compares with Math.round. */
function validatorFor(schema: unknown): ((data: unknown) => boolean) | null {
  const ajv = new Ajv2020({ strict: false, validateFormats: false, allErrors: false, multipleOfPrecision: 9 })
  try {
    const validate = ajv.compile(schema as object | boolean)
    return (data) => validate(data) as boolean
  } catch {
    return null
  }
}

interface Outcome {
  refused: Record<string, string>
  /** `id@seed` -> [finishReason, text]. */
  outputs: Map<string, [string, string]>
}

type AnyEngine = { generate: NativeEngine['generate']; close(): Promise<void> }

/** Begins one constrained turn per (compiled group, seed) on `engine`, all at once. */
async function sampleAll(engine: AnyEngine, prompt: string | number[], seeds: number[], maxGeneratedTokens: number): Promise<Outcome> {
  const refused: Record<string, string> = {}
  const pending: Array<Promise<[string, [string, string]]>> = []
  for (const group of ready) {
    for (const seed of seeds) {
      let turn
      try {
        turn = engine.generate(prompt, {
          temperature: 1,
          seed,
          maxGeneratedTokens,
          constraint: { type: 'json_schema', schema: group.schema as Record<string, unknown> | boolean },
        })
      } catch (error) {
        expect(error).toBeInstanceOf(OrtexError)
        expect((error as OrtexError).code).toBe('INVALID_ARGUMENT')
        refused[group.id] = (error as Error).message.replace(/\s+/g, ' ').slice(0, 200)
        break
      }
      pending.push(turn.done.then((done) => [`${group.id}@${seed}`, [done.finishReason, done.text]]))
    }
  }
  return { refused, outputs: new Map(await Promise.all(pending)) }
}

/** Every finished output parses and validates; returns how many were checked. */
function expectValid(outcome: Outcome, label: string): { checked: number; unfinished: number; ajvRefused: number } {
  let checked = 0
  let unfinished = 0
  let ajvRefused = 0
  for (const group of ready) {
    if (group.id in outcome.refused) continue
    const validate = validatorFor(group.schema)
    if (validate === null) ajvRefused++
    for (const [key, [finish, text]] of outcome.outputs) {
      if (!key.startsWith(`${group.id}@`)) continue
      if (finish !== 'eos') {
        unfinished++
        continue
      }
      let data: unknown
      expect(() => (data = JSON.parse(text)), `${label} ${key} (${group.description}): ${JSON.stringify(text)}`).not.toThrow()
      if (validate !== null) expect(validate(data), `${label} ${key} (${group.description}): ${text}`).toBe(true)
      checked++
    }
  }
  return { checked, unfinished, ajvRefused }
}

function expectBaseline(refused: Record<string, string>): void {
  if (process.env.ORTEX_WRITE_BASELINE === '1') {
    writeFileSync(BASELINE_FILE, `${JSON.stringify({ suite: baseline.suite, refused }, null, 2)}\n`)
    return
  }
  const newlyRefused = Object.keys(refused).filter((id) => !(id in baseline.refused))
  expect(newlyRefused.map((id) => `${id}: ${refused[id]}`), 'schemas the baseline has compiling are refused').toEqual([])
  const nowCompiled = Object.keys(baseline.refused).filter((id) => !(id in refused))
  if (nowCompiled.length > 0) {
    console.warn(`[json-schema-suite] now compiled (shrink the baseline with ORTEX_WRITE_BASELINE=1): ${nowCompiled.join(', ')}`)
  }
}

const simOutputs = new Map<BackendName, Map<string, [string, string]>>()

describe.skipIf(ready.length === 0)('JSON-Schema-Test-Suite draft 2020-12', () => {
  for (const backend of BACKENDS) {
    it(`compiles as the baseline says, and every simulated output validates (${backend})`, async () => {
      const engine = ortex(backend).Engine.simulated({ seed: 5, maxBatchSize: 256, maxLength: 4096 })
      try {
        const outcome = await sampleAll(engine, 'JSON: ', SIM_SEEDS, 2048)
        expectBaseline(outcome.refused)
        const counts = expectValid(outcome, backend)
        expect(counts.unfinished, 'the simulated model finishes every constrained turn').toBe(0)
        expect(counts.checked).toBeGreaterThan(ready.length)
        simOutputs.set(backend, outcome.outputs)
        console.log(
          `[json-schema-suite] ${backend}: ${ready.length} schemas, ${Object.keys(outcome.refused).length} refused, ` +
            `${counts.checked} outputs validated (${counts.ajvRefused} schemas ajv itself refuses: parsed only)`,
        )
      } finally {
        await engine.close()
      }
    }, 120_000)
  }

  it('native and WebAssembly give the same constrained text for the same seed', () => {
    const [native, wasm] = [simOutputs.get('native'), simOutputs.get('wasm')]
    expect(native && wasm, 'both backends ran').toBeTruthy()
    expect(Object.fromEntries(wasm!)).toEqual(Object.fromEntries(native!))
  })

  describe('the tiny ONNX model (native)', () => {
    const models = useTinyModels('json-schema-suite', { plain: {} })
    let engine: NativeEngine | undefined
    afterAll(async () => engine?.close())

    it('every finished output validates', async () => {
      engine = await NativeEngine.load(models.dirs.plain, { maxBatchSize: 128 })
      const prompt = tinyPrompt(8, 1)
      const outcome = await sampleAll(engine, prompt, TINY_SEEDS, 96)
      expectBaseline(outcome.refused)
      const counts = expectValid(outcome, 'tiny')
      console.log(
        `[json-schema-suite] tiny ONNX model: ${counts.checked} finished outputs validated, ${counts.unfinished} cut at 96 tokens`,
      )
    }, 120_000)
  })
})
