// The Berkeley Function Calling Leaderboard's data (the `bfcl-eval` wheel on PyPI, Apache-2.0):
// downloaded with pip once, its question and answer files unzipped (not installed) into a cache
// outside the checkout, reused by every later run:
//
//   ${ORTEX_CACHE_DIR:-~/.cache/ortex}/bfcl-eval-2026.3.23/{BFCL_v4_simple_python.json, ...}
//
// Each line of a question file is one case: the conversation and the functions (in BFCL's own
// schema dialect: `dict`, `float`, `tuple`, `any`); each line of an answer file, the calls that
// count as right (per parameter, the values accepted; "" where leaving it out is right too).

import { spawnSync } from 'node:child_process'
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync } from 'node:fs'
import { join } from 'node:path'
import { RealModelUnavailable, cacheRoot } from '../../ts/modelkit/real-model'

export const BFCL = { package: 'bfcl-eval', version: '2026.3.23' } as const

export type BfclCategory = 'simple_python' | 'multiple' | 'parallel'

export interface BfclFunction {
  name: string
  description: string
  parameters: Record<string, unknown>
}

export interface BfclCase {
  id: string
  messages: { role: string; content: string }[]
  functions: BfclFunction[]
  /** Per expected call: the function's name and, per parameter, the values accepted. */
  answers: Record<string, Record<string, unknown[]>>[]
}

function python(args: string[], what: string): void {
  for (const exe of ['python3', 'python']) {
    const run = spawnSync(exe, args, { encoding: 'utf8', timeout: 600_000 })
    if (run.error && (run.error as NodeJS.ErrnoException).code === 'ENOENT') continue
    if (run.status !== 0) {
      const reason = (run.stderr || run.stdout || String(run.error ?? '')).trim().split('\n').slice(-2).join(' ')
      throw new RealModelUnavailable(`${what}: ${reason || `exit status ${run.status}`}`)
    }
    return
  }
  throw new RealModelUnavailable(`${what}: no Python`)
}

/** The folder with the data files, fetched on first use. */
export function bfclData(): string {
  const dir = join(cacheRoot(), `${BFCL.package}-${BFCL.version}`)
  if (existsSync(join(dir, 'complete'))) return dir
  const tmp = `${dir}.tmp-${process.pid}-${Date.now()}`
  mkdirSync(tmp, { recursive: true })
  try {
    const spec = `${BFCL.package}==${BFCL.version}`
    python(['-m', 'pip', 'download', spec, '--no-deps', '--only-binary', ':all:', '-d', tmp, '--quiet', '--timeout', '30', '--retries', '2'], `pip could not download ${spec}`)
    const wheel = join(tmp, `${BFCL.package.replace(/-/g, '_')}-${BFCL.version}-py3-none-any.whl`)
    // Only the data files; nothing of the package is installed or run.
    const script = [
      'import sys, zipfile, os',
      'z = zipfile.ZipFile(sys.argv[1])',
      'for n in z.namelist():',
      '    if n.startswith("bfcl_eval/data/") and n.endswith(".json") and "unused" not in n:',
      '        out = os.path.join(sys.argv[2], n[len("bfcl_eval/data/"):].replace("/", "__"))',
      '        open(out, "wb").write(z.read(n))',
      'open(os.path.join(sys.argv[2], "complete"), "w").close()',
      'os.remove(sys.argv[1])',
    ].join('\n')
    python(['-c', script, wheel, tmp], `cannot unzip ${wheel}`)
    try {
      renameSync(tmp, dir)
    } catch (error) {
      if (!existsSync(join(dir, 'complete'))) throw error
    }
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
  return dir
}

function lines(file: string): Record<string, unknown>[] {
  return readFileSync(file, 'utf8')
    .split('\n')
    .filter((line) => line.trim().length > 0)
    .map((line) => JSON.parse(line) as Record<string, unknown>)
}

/** The cases of a category, in the file's order. */
export function bfclCases(category: BfclCategory): BfclCase[] {
  const dir = bfclData()
  const questions = lines(join(dir, `BFCL_v4_${category}.json`))
  const answers = new Map(lines(join(dir, `possible_answer__BFCL_v4_${category}.json`)).map((a) => [a.id as string, a.ground_truth]))
  return questions.map((q) => ({
    id: q.id as string,
    messages: (q.question as { role: string; content: string }[][])[0]!,
    functions: q.function as BfclFunction[],
    answers: (answers.get(q.id as string) ?? []) as BfclCase['answers'],
  }))
}

/** BFCL's function names may hold dots, which OpenAI's names may not: its own OpenAI handler
 *  writes them as underscores, as here. */
export function openAiName(name: string): string {
  return name.replace(/\./g, '_')
}

/** BFCL's schema dialect as JSON Schema (its `dict`, `float`, `tuple`, `any`), as its OpenAI
 *  handler converts it. */
export function jsonSchema(schema: unknown): unknown {
  if (Array.isArray(schema)) return schema.map(jsonSchema)
  if (typeof schema !== 'object' || schema === null) return schema
  const out: Record<string, unknown> = {}
  for (const [key, value] of Object.entries(schema as Record<string, unknown>)) {
    if (key === 'type' && typeof value === 'string') {
      const mapped = { dict: 'object', float: 'number', tuple: 'array', any: undefined }[value] ?? value
      if (mapped !== undefined) out.type = mapped
    } else if (key === 'optional') {
      // BFCL's own marker, not JSON Schema.
    } else if (key === 'properties' && typeof value === 'object' && value !== null) {
      out.properties = Object.fromEntries(Object.entries(value as Record<string, unknown>).map(([k, v]) => [k, jsonSchema(v)]))
    } else {
      out[key] = jsonSchema(value)
    }
  }
  return out
}

/** Whether `calls` are the case's answer, as BFCL's AST checker judges in outline: the same
 *  number of calls, each matched (in any order) by an expected call of the same function whose
 *  every parameter the call sets is accepted, and whose parameters without "" are all set. */
export function bfclCorrect(c: BfclCase, calls: { name: string; arguments: Record<string, unknown> }[]): boolean {
  if (calls.length !== c.answers.length) return false
  const open = [...c.answers]
  for (const call of calls) {
    const at = open.findIndex((answer) => {
      const [name, params] = Object.entries(answer)[0]!
      return openAiName(name) === call.name && paramsMatch(params, call.arguments)
    })
    if (at < 0) return false
    open.splice(at, 1)
  }
  return true
}

function paramsMatch(expected: Record<string, unknown[]>, actual: Record<string, unknown>): boolean {
  for (const key of Object.keys(actual)) if (!(key in expected)) return false
  for (const [key, accepted] of Object.entries(expected)) {
    if (!(key in actual)) {
      if (!accepted.includes('')) return false
      continue
    }
    if (!accepted.some((value) => same(value, actual[key]))) return false
  }
  return true
}

function same(expected: unknown, actual: unknown): boolean {
  if (typeof expected === 'string' && typeof actual === 'string') return normalize(expected) === normalize(actual)
  if (typeof expected === 'number' && typeof actual === 'number') return expected === actual
  return JSON.stringify(expected) === JSON.stringify(actual)
}

/** BFCL compares strings without case, spaces and most punctuation. */
function normalize(text: string): string {
  return text.toLowerCase().replace(/[ ,./\-_*^]/g, '')
}
