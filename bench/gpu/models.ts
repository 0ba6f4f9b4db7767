// The GPU benchmark's model folders (bench/gpu/): the bench model made by `ortex make-model`, SmolLM2
// imported from its GGUF by `ortex import`, each in the folder form asked for. Both run the built
// CLI (dist/cli.js) as a child process, so a form the CLI does not offer yet is told by its usage
// error, and the benchmark falls back to the form every build has (gqa fp32), saying so.

import { spawnSync } from 'node:child_process'
import { existsSync, readFileSync, rmSync } from 'node:fs'
import { join } from 'node:path'

import type { ModelEntry } from './report'

/** paged-fp16: PagedAttention, float16 weights and KV (the CUDA form, issue 32 items 1-2);
 *  gqa-fp32: GroupQueryAttention, float32 (every build has it); gqa-fp16kv: the same with a float16 KV. */
export const FOLDER_FORMS = ['paged-fp16', 'gqa-fp32', 'gqa-fp16kv'] as const
export type FolderForm = (typeof FOLDER_FORMS)[number]
export const FALLBACK_FORM: FolderForm = 'gqa-fp32'

const MAKE_FLAGS: Readonly<Record<FolderForm, string[]>> = {
  'paged-fp16': ['--attention', 'paged', '--dtype', 'fp16'],
  'gqa-fp32': ['--attention', 'gqa'],
  'gqa-fp16kv': ['--attention', 'gqa', '--kv', 'fp16'],
}
const IMPORT_FLAGS: Readonly<Record<FolderForm, string[]>> = {
  'paged-fp16': ['--attention', 'paged', '--dtype', 'fp16'],
  'gqa-fp32': ['--weights', 'fp32', '--kv', 'fp32'],
  'gqa-fp16kv': ['--weights', 'fp32', '--kv', 'fp16'],
}

export interface ModelSource {
  /** The report's name: 'bench' (goals are stated for it), 'tiny', 'smollm2', or a folder's name. */
  name: string
  /** make-model's --size, an imported GGUF, or an existing folder used as it is. */
  kind: { make: 'tiny' | 'bench' } | { gguf: string } | { folder: string }
}

/** Whether a form's folder fixes the KV block size (a paged one) rather than leaving it to the engine. */
export function formFixesBlockSize(form: string): boolean {
  return form.startsWith('paged')
}

/** The folder for `source` in `form` under `dir` (made once, reused while its genai_config.json is
 *  there); falls back to FALLBACK_FORM where the CLI cannot make `form`. `blockSize` makes a paged
 *  folder with that KV block size (`--block-size`; its own directory); other forms ignore it. */
export function prepareModel(root: string, dir: string, source: ModelSource, form: FolderForm, progress: (line: string) => void, blockSize?: number): ModelEntry {
  if ('folder' in source.kind) return { name: source.name, dir: source.kind.folder, form: describeFolder(source.kind.folder) }
  const attempt = (f: FolderForm): { out: string; error: string | null } => {
    const sized = blockSize !== undefined && formFixesBlockSize(f)
    const out = join(dir, `${source.name}-${f}${sized ? `-bs${blockSize}` : ''}`)
    if (existsSync(join(out, 'genai_config.json'))) return { out, error: null }
    const kind = source.kind as { make: string } | { gguf: string }
    const flags = [...('make' in kind ? MAKE_FLAGS[f] : IMPORT_FLAGS[f]), ...(sized ? ['--block-size', String(blockSize)] : [])]
    const args = 'make' in kind ? ['make-model', '--out', out, '--size', kind.make, ...flags] : ['import', kind.gguf, '--out', out, ...flags]
    progress(`ortex ${args.join(' ')}`)
    const result = spawnSync(process.execPath, [join(root, 'dist', 'cli.js'), ...args], { encoding: 'utf8' })
    if (result.status === 0) return { out, error: null }
    rmSync(out, { recursive: true, force: true })
    const why = `${result.stderr ?? ''}${result.stdout ?? ''}`.trim().split('\n')[0] ?? `exit ${result.status}`
    return { out, error: why }
  }
  const first = attempt(form)
  if (first.error === null) return { name: source.name, dir: first.out, form }
  if (form === FALLBACK_FORM) throw new Error(`${source.name}: ${first.error}`)
  const note = `the ${form} form could not be made (${first.error}): fell back to ${FALLBACK_FORM}`
  progress(`${source.name}: ${note}`)
  const second = attempt(FALLBACK_FORM)
  if (second.error !== null) throw new Error(`${source.name}: ${second.error}`)
  return { name: source.name, dir: second.out, form: FALLBACK_FORM, note }
}

interface GenaiConfigFile {
  model?: { decoder?: { inputs?: Record<string, string> } }
  engine?: { dynamic_batching?: { block_size?: number } }
}

function readConfig(dir: string): GenaiConfigFile {
  return JSON.parse(readFileSync(join(dir, 'genai_config.json'), 'utf8')) as GenaiConfigFile
}

/** The KV block size a paged folder fixes (its engine must use it), else undefined. */
export function folderBlockSize(dir: string): number | undefined {
  return readConfig(dir).engine?.dynamic_batching?.block_size
}

/** A short description of an existing folder's form, from its genai_config.json. */
export function describeFolder(dir: string): string {
  const config = readConfig(dir)
  const paged = config.engine?.dynamic_batching !== undefined || config.model?.decoder?.inputs?.block_table !== undefined
  return paged ? 'paged (given folder)' : 'past/present (given folder)'
}
