// What the model suites share: tiny model folders made once per file (each with its reference
// session, released and removed after the file), and deterministic prompts of the tiny
// vocabulary.

import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Engine, OrtexError } from 'ortex'
import { afterAll, beforeAll, expect } from 'vitest'
import { makeModel, type MakeModelOptions } from '../../ts/modelkit/make-model'
import { ReferenceModel } from '../reference/reference'

export interface TinyModels<Name extends string> {
  /** Each variant's folder (valid from the file's beforeAll on). */
  dirs: Record<Name, string>
  /** Each variant's plain onnxruntime-node session. */
  references: Record<Name, ReferenceModel>
  /** The temporary folder they live in. */
  root: () => string
}

/** Makes a tiny folder per variant before the file's tests (`options` beyond outDir and size). */
export function useTinyModels<Name extends string>(
  tag: string,
  variants: Record<Name, Omit<MakeModelOptions, 'outDir' | 'size'>>,
): TinyModels<Name> {
  const dirs = {} as Record<Name, string>
  const references = {} as Record<Name, ReferenceModel>
  let root = ''
  beforeAll(async () => {
    root = mkdtempSync(join(tmpdir(), `ortex-${tag}-`))
    for (const [name, options] of Object.entries(variants) as [Name, MakeModelOptions][]) {
      dirs[name] = join(root, name.replaceAll(' ', '-'))
      await makeModel({ ...options, outDir: dirs[name], size: 'tiny' })
      references[name] = await ReferenceModel.load(dirs[name])
    }
  })
  afterAll(async () => {
    for (const model of Object.values(references) as ReferenceModel[]) await model.release()
    if (root) rmSync(root, { recursive: true, force: true })
  })
  return { dirs, references, root: () => root }
}

/** Deterministic prompts of mixed lengths (token ids of the tiny vocabulary, 3..511). */
export function tinyPrompt(length: number, salt: number): number[] {
  let x = (salt * 2654435761 + 12345) >>> 0
  return Array.from({ length }, () => {
    x = (Math.imul(x ^ (x >>> 15), 2246822519) + 0x9e3779b9) >>> 0
    return 3 + (x % 509)
  })
}

/** `Engine.load(dir, options)` must fail with MODEL_LOAD, its message naming every string in
 *  `named`; returns the error. */
export async function expectModelLoad(dir: string, options: object, ...named: string[]): Promise<OrtexError> {
  const error = (await Engine.load(dir, options as never).then(
    async (engine) => {
      await engine.close()
      throw new Error('the folder loaded')
    },
    (e: unknown) => e,
  )) as OrtexError
  expect(error).toBeInstanceOf(OrtexError)
  expect(error.code).toBe('MODEL_LOAD')
  for (const name of named) expect(error.message).toContain(name)
  return error
}

/** A copy of folder `from` at `to`, its genai_config.json changed by `edit`; returns `to`. */
export function copyWithConfig(from: string, to: string, edit: (config: any) => void): string {
  cpSync(from, to, { recursive: true })
  const file = join(to, 'genai_config.json')
  const config = JSON.parse(readFileSync(file, 'utf8'))
  edit(config)
  writeFileSync(file, JSON.stringify(config))
  return to
}
