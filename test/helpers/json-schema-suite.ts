// The JSON-Schema-Test-Suite (draft 2020-12), as the `jsonschema` package's source distribution on
// PyPI ships it: downloaded with pip once and unpacked into the cache outside the checkout, beside
// SmolLM2 (ts/modelkit/real-model.ts), so a second run downloads nothing:
//
//   ${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ortex}/jsonschema-4.26.0/draft2020-12/*.json
//
// The unpacking writes into a private name and renames it into place (concurrent runs never see
// half a folder). Where pip or the registry is unavailable, SuiteUnavailable says so.

import { spawnSync } from 'node:child_process'
import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync } from 'node:fs'
import { join } from 'node:path'
import { cacheRoot } from '../../ts/modelkit/real-model'

export const JSONSCHEMA_SDIST = { package: 'jsonschema', version: '4.26.0' } as const

export class SuiteUnavailable extends Error {}

/** One group of the suite: a schema and the instances it is tested with. */
export interface SuiteGroup {
  /** `file.json#index`: stable across runs (the baseline's key). */
  id: string
  description: string
  schema: unknown
  /** The suite's own instances with their expected validity. */
  tests: Array<{ data: unknown; valid: boolean }>
}

/** The folder of draft 2020-12's required tests (not `optional/`), fetched on first use. */
export function draft2020Folder(): string {
  const root = join(cacheRoot(), `${JSONSCHEMA_SDIST.package}-${JSONSCHEMA_SDIST.version}`)
  const folder = join(root, 'draft2020-12')
  if (existsSync(folder)) return folder
  mkdirSync(root, { recursive: true })
  const work = join(root, `tmp-${process.pid}-${Date.now()}`)
  try {
    const sdist = pipDownload(work)
    const inside = `${JSONSCHEMA_SDIST.package}-${JSONSCHEMA_SDIST.version}/json/tests/draft2020-12`
    const untar = spawnSync('tar', ['-xzf', sdist, '-C', work, inside], { encoding: 'utf8' })
    if (untar.status !== 0) throw new SuiteUnavailable(`cannot unpack ${sdist}: ${untar.stderr.trim()}`)
    try {
      renameSync(join(work, inside), folder)
    } catch (error) {
      if (!existsSync(folder)) throw error // a racing run put its identical copy in place first
    }
  } finally {
    rmSync(work, { recursive: true, force: true })
  }
  return folder
}

function pipDownload(into: string): string {
  const spec = `${JSONSCHEMA_SDIST.package}==${JSONSCHEMA_SDIST.version}`
  const args = ['-m', 'pip', 'download', spec, '--no-deps', '--no-binary', ':all:', '-d', into, '--quiet', '--timeout', '30']
  for (const python of ['python3', 'python']) {
    const run = spawnSync(python, args, { encoding: 'utf8', timeout: 600_000 })
    if (run.error && (run.error as NodeJS.ErrnoException).code === 'ENOENT') continue
    if (run.status !== 0) {
      const reason = (run.stderr || run.stdout || String(run.error ?? '')).trim().split('\n').slice(-2).join(' ')
      throw new SuiteUnavailable(`pip could not download ${spec}: ${reason}`)
    }
    const sdist = join(into, `${JSONSCHEMA_SDIST.package}-${JSONSCHEMA_SDIST.version}.tar.gz`)
    if (!existsSync(sdist)) throw new SuiteUnavailable(`pip downloaded ${spec} but ${sdist} is not there`)
    return sdist
  }
  throw new SuiteUnavailable(`no Python with pip to download ${spec}`)
}

/** Every group of every file in `folder`, in file-name order. */
export function suiteGroups(folder: string): SuiteGroup[] {
  const groups: SuiteGroup[] = []
  for (const file of readdirSync(folder).filter((f) => f.endsWith('.json')).sort()) {
    const parsed = JSON.parse(readFileSync(join(folder, file), 'utf8')) as Array<Omit<SuiteGroup, 'id'>>
    parsed.forEach((group, index) => groups.push({ ...group, id: `${file}#${index}` }))
  }
  return groups
}
