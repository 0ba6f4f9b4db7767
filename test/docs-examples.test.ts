// Every ```ts block marked `<!-- runnable -->` in README.md and docs/api.md runs against the built
// package, the way a user would paste it into an ES module: imported by the names `ortex` and
// `ortex/wasm` from a scratch project whose node_modules links to this repository (dist/ through
// package.json "exports") and to `ws`. The blocks are type-checked together against the built
// declarations (dist/*.d.mts), then each one runs in its own Node process and must exit 0.
// Real-model examples find a tiny model at models/tiny (made here with `ortex make-model`).
//
// Needs the build (npm test runs scripts/build.sh first).
import { spawnSync } from 'node:child_process'
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import ts from 'typescript'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const DOCUMENTS = ['README.md', 'docs/api.md']
const MARKER = '<!-- runnable -->'

interface Example {
  document: string
  line: number
  code: string
  name: string
}

/** The ```ts blocks right after a runnable marker (blank lines may separate them). */
function extract(document: string): Example[] {
  const lines = readFileSync(path.join(repo, document), 'utf8').split('\n')
  const examples: Example[] = []
  for (let i = 0; i < lines.length; i++) {
    if (lines[i]!.trim() !== MARKER) continue
    let start = i + 1
    while (start < lines.length && lines[start]!.trim() === '') start++
    if (!/^```(ts|typescript)\s*$/.test(lines[start] ?? '')) {
      throw new Error(`${document}:${i + 1}: ${MARKER} is not followed by a \`\`\`ts block`)
    }
    let end = start + 1
    while (end < lines.length && !/^```\s*$/.test(lines[end]!)) end++
    if (end === lines.length) throw new Error(`${document}:${start + 1}: the block never closes`)
    const name = `${document.replace(/[^a-z0-9]+/gi, '-')}-${start + 2}`
    examples.push({ document, line: start + 2, code: lines.slice(start + 1, end).join('\n'), name })
    i = end
  }
  return examples
}

const examples = DOCUMENTS.flatMap(extract)
let project: string

beforeAll(() => {
  project = mkdtempSync(path.join(tmpdir(), 'ortex-docs-'))
  const modules = path.join(project, 'node_modules')
  mkdirSync(modules)
  symlinkSync(repo, path.join(modules, 'ortex'), 'dir')
  symlinkSync(path.join(repo, 'node_modules', 'ws'), path.join(modules, 'ws'), 'dir')
  symlinkSync(path.join(repo, 'node_modules', '@types'), path.join(modules, '@types'), 'dir')
  writeFileSync(path.join(project, 'package.json'), JSON.stringify({ name: 'docs-examples', private: true, type: 'module' }))
  const made = spawnSync(process.execPath, [path.join(repo, 'dist', 'cli.js'), 'make-model', '--out', 'models/tiny'], {
    cwd: project,
    encoding: 'utf8',
  })
  if (made.status !== 0) throw new Error(`make-model failed: ${made.stderr}`)
  for (const example of examples) writeFileSync(path.join(project, `${example.name}.ts`), `${example.code}\n`)
}, 60_000)

afterAll(() => {
  if (project !== undefined) rmSync(project, { recursive: true, force: true })
})

describe('documentation examples', () => {
  it('finds the runnable examples of README.md and docs/api.md', () => {
    const per = (doc: string) => examples.filter((e) => e.document === doc).length
    expect(per('README.md')).toBeGreaterThanOrEqual(6)
    expect(per('docs/api.md')).toBeGreaterThanOrEqual(10)
  })

  it('type-checks them against the built declarations', () => {
    const options: ts.CompilerOptions = {
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.ESNext,
      moduleResolution: ts.ModuleResolutionKind.Bundler,
      strict: true,
      noEmit: true,
      skipLibCheck: true,
      types: ['node'],
      // `ortex` resolves through node_modules/ortex (this repository) and its "exports" "types".
      typeRoots: [path.join(project, 'node_modules', '@types')],
    }
    const files = examples.map((e) => path.join(project, `${e.name}.ts`))
    const program = ts.createProgram(files, options)
    const problems = ts.getPreEmitDiagnostics(program).map((d) => {
      const where = d.file ? `${path.basename(d.file.fileName)}:${d.file.getLineAndCharacterOfPosition(d.start ?? 0).line + 1}` : ''
      const example = examples.find((e) => where.startsWith(`${e.name}.ts:`))
      const at = example ? `${example.document}:${example.line + Number(where.split(':')[1]) - 1}` : where
      return `${at}: ${ts.flattenDiagnosticMessageText(d.messageText, '\n')}`
    })
    expect(problems).toEqual([])
  }, 60_000)

  for (const example of examples) {
    it(`runs ${example.document}:${example.line}`, () => {
      const js = ts.transpileModule(example.code, {
        compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, verbatimModuleSyntax: false },
        fileName: `${example.name}.ts`,
      }).outputText
      const file = path.join(project, `${example.name}.mjs`)
      writeFileSync(file, js)
      const env = { ...process.env }
      delete env.ORTEX_ORT_DYLIB
      delete env.NODE_OPTIONS
      const run = spawnSync(process.execPath, [file], { cwd: project, env, encoding: 'utf8', timeout: 30_000 })
      if (run.status !== 0) {
        throw new Error(
          `${example.document}:${example.line} exited ${run.status}${run.signal ? ` (${run.signal})` : ''}\n` +
            `--- stdout\n${run.stdout}\n--- stderr\n${run.stderr}`,
        )
      }
    })
  }
})
