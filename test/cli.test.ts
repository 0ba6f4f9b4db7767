// The `ortex` command line as built (dist/cli.js): every command's --help, and one line on stderr
// plus a non-zero exit status for wrong invocations (2: usage, 1: a runtime failure).
import { spawnSync } from 'node:child_process'
import { mkdtempSync, readFileSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { afterAll, describe, expect, it } from 'vitest'
import { ARCHITECTURES, ARCHITECTURE_NOTES, SUPPORTED_TYPES } from '../ts/modelkit/gguf/architecture'
import { int4Treatment } from '../ts/modelkit/gguf/supported'

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const CLI = path.join(repo, 'dist', 'cli.js')
const scratch = mkdtempSync(path.join(tmpdir(), 'ortex-cli-'))

afterAll(() => rmSync(scratch, { recursive: true, force: true }))

function ortex(...args: string[]): { status: number | null; stdout: string; stderr: string } {
  return ortexWith({}, ...args)
}

/** The CLI with `extra` added to its environment. */
function ortexWith(extra: Record<string, string>, ...args: string[]): { status: number | null; stdout: string; stderr: string } {
  const env: Record<string, string | undefined> = { ...process.env, ...extra }
  delete env.ORTEX_ORT_DYLIB
  delete env.ORT_DYLIB_PATH
  const result = spawnSync(process.execPath, [CLI, ...args], { cwd: scratch, env, encoding: 'utf8', timeout: 30_000 })
  return { status: result.status, stdout: result.stdout, stderr: result.stderr }
}

const mainHelp = ortex('--help').stdout
/** The commands `ortex --help` lists. */
const listed = new Set([...mainHelp.matchAll(/^ {2}ortex ([a-z-]+)/gm)].map((m) => m[1]!))

describe('ortex --help', () => {
  it('prints the usage of every command and exits 0, also without arguments', () => {
    for (const args of [['--help'], ['-h'], ['help'], []]) {
      const run = ortex(...args)
      expect(run.status).toBe(0)
      expect(run.stderr).toBe('')
      expect(run.stdout).toContain('Usage:')
    }
    expect([...listed].sort()).toEqual(['generate', 'import', 'make-model', 'serve'])
  })

  it('prints the version', () => {
    const run = ortex('--version')
    expect(run.status).toBe(0)
    expect(run.stdout.trim()).toBe(JSON.parse(readFileSync(path.join(repo, 'package.json'), 'utf8')).version)
  })

  for (const command of ['generate', 'serve', 'import', 'make-model']) {
    it(`${command} --help prints its usage and exits 0`, () => {
      for (const flag of ['--help', '-h']) {
        const run = ortex(command, flag)
        expect(run.status).toBe(0)
        expect(run.stderr).toBe('')
        expect(run.stdout).toMatch(new RegExp(`^Usage: ortex ${command} `))
        expect(run.stdout).toMatch(/--help/)
      }
    })
  }
})

describe('ortex import --help', () => {
  it("lists every architecture and tensor type of the importer's own tables", () => {
    const lines = ortex('import', '--help').stdout.split('\n')
    for (const architecture of ARCHITECTURES) {
      const line = lines.find((l) => l.startsWith(`  ${architecture} `) || l === `  ${architecture}`)
      expect(line, architecture).toBeDefined()
      expect(line!.endsWith(ARCHITECTURE_NOTES[architecture] ?? architecture)).toBe(true)
    }
    for (const type of SUPPORTED_TYPES) {
      const line = lines.find((l) => l.startsWith('  ') && l.trim().split(/,? +/).includes(type))
      expect(line, type).toBeDefined()
      expect(line!.endsWith(`  ${int4Treatment(type)}`)).toBe(true)
    }
  })

  it("and docs/model-format.md's table of architectures lists the same ones", () => {
    const doc = readFileSync(path.join(repo, 'docs', 'model-format.md'), 'utf8')
    const section = doc.split('### Supported architectures and tensor types')[1]!.split('\n### ')[0]!
    const rows = [...section.matchAll(/^\| `([a-z0-9_]+)` \|/gm)].map((m) => m[1])
    expect(rows).toEqual([...ARCHITECTURES])
  })
})

describe('wrong invocations: one line on stderr, a non-zero exit status', () => {
  const missing = path.join(scratch, 'no-such-model')
  const cases: Array<{ args: string[]; status: number; message: RegExp }> = [
    { args: ['frobnicate'], status: 2, message: /unknown command "frobnicate"; see ortex --help/ },
    { args: ['--frobnicate'], status: 2, message: /unknown command "--frobnicate"/ },
    { args: ['generate', '--frob'], status: 2, message: /Unknown option '--frob'; see ortex generate --help/ },
    { args: ['generate'], status: 2, message: /give --model DIR or --simulated/ },
    { args: ['generate', '--simulated', 'extra'], status: 2, message: /Unexpected argument 'extra'/ },
    { args: ['generate', '--model', missing], status: 1, message: /MODEL_LOAD: model folder ".*no-such-model" does not exist/ },
    { args: ['generate', '--model', scratch], status: 1, message: /MODEL_LOAD: .* has no genai_config\.json/ },
    { args: ['generate', '--simulated', '--max-tokens', 'abc'], status: 2, message: /--max-tokens must be an integer in \[1, \d+\], got "abc"/ },
    { args: ['generate', '--simulated', '--max-tokens', '0'], status: 2, message: /--max-tokens must be an integer in \[1, \d+\], got "0"/ },
    { args: ['generate', '--simulated', '--concurrency', '1e3'], status: 2, message: /--concurrency must be an integer/ },
    { args: ['generate', '--simulated', '--concurrency', '-1'], status: 2, message: /'--concurrency' argument is ambiguous/ },
    { args: ['generate', '--simulated', '--temperature=-1'], status: 2, message: /--temperature must be a number >= 0/ },
    { args: ['generate', '--simulated', '--backend', 'gpu'], status: 2, message: /--backend must be 'native' or 'wasm'/ },
    { args: ['generate', '--model', missing, '--backend', 'wasm'], status: 1, message: /^ortex: (MODEL_LOAD|UNSUPPORTED): / },
    { args: ['make-model'], status: 2, message: /give --out DIR/ },
    { args: ['make-model', '--out', missing, '--size', 'huge'], status: 2, message: /--size must be 'tiny' or 'bench', got "huge"/ },
    { args: ['make-model', '--out', missing, '--seed', '5000000000'], status: 2, message: /--seed must be an integer in \[0, 4294967295\]/ },
    { args: ['make-model', '--out', missing, '--layers', '3'], status: 2, message: /Unknown option '--layers'; see ortex make-model --help/ },
    { args: ['make-model', '--out', missing, '--attention', 'paged', '--paged-kernel', 'gpu'], status: 2, message: /--paged-kernel must be 'cuda' or 'reference', got "gpu"/ },
    { args: ['make-model', '--out', missing, '--attention', 'paged'], status: 1, message: /the cuda paged kernel needs float16 \(--dtype fp16\)/ },
    { args: ['make-model', '--out', missing, '--block-size', '8'], status: 1, message: /a paged kernel or block size needs the paged attention form/ },
    { args: ['import', '--out', missing], status: 2, message: /give one GGUF file: ortex import <file\.gguf> --out DIR/ },
    { args: ['import', 'a.gguf', 'b.gguf', '--out', missing], status: 2, message: /give one GGUF file/ },
    { args: ['import', 'model.gguf'], status: 2, message: /give --out DIR/ },
    { args: ['import', 'model.gguf', '--out', missing, '--weights', 'q8'], status: 2, message: /--weights must be 'fp32' or 'int4', got "q8"/ },
    { args: ['import', 'model.gguf', '--out', missing, '--workers', '0'], status: 2, message: /--workers must be an integer in \[1, 256\], got "0"/ },
    { args: ['import', 'model.gguf', '--out', missing, '--attention', 'mha'], status: 2, message: /--attention must be 'gqa' or 'paged', got "mha"/ },
    { args: ['import', 'model.gguf', '--out', missing, '--attention', 'paged'], status: 1, message: /INVALID_ARGUMENT: the cuda paged kernel needs float16 \(dtype fp16\)/ },
    { args: ['import', 'model.gguf', '--out', missing, '--dtype', 'fp16', '--kv', 'fp32'], status: 1, message: /INVALID_ARGUMENT: float16 weights \(dtype fp16\) keep float16 KV/ },
    { args: ['import', path.join(scratch, 'none.gguf'), '--out', missing], status: 1, message: /MODEL_LOAD: .*none\.gguf: cannot open the file/ },
    { args: ['serve', '--bogus'], status: 2, message: /Unknown option '--bogus'; see ortex serve --help/ },
    { args: ['serve', '--simulated', '--port', '99999'], status: 2, message: /--port must be an integer in \[0, 65535\]/ },
    { args: ['serve'], status: 2, message: /give --model DIR or --simulated/ },
    // An empty key would start a server that lets everyone in.
    { args: ['serve', '--simulated', '--port', '0', '--api-key', ''], status: 2, message: /^ortex: --api-key must not be empty$/ },
    { args: ['serve', '--simulated', '--port', '0', '--api-key='], status: 2, message: /^ortex: --api-key must not be empty$/ },
    { args: ['serve', '--simulated', '--port', '0', '--drain-timeout-ms', 'soon'], status: 2, message: /--drain-timeout-ms must be an integer in \[0, / },
    { args: ['serve', '--simulated', '--port', '0', '--session-store', 'http://x'], status: 1, message: /INVALID_ARGUMENT: a session store is a redis:\/\/ URL, got "http:\/\/x"/ },
    // Port 1 on loopback refuses at once: a store that cannot be reached fails the start.
    { args: ['serve', '--simulated', '--port', '0', '--session-store', 'redis://127.0.0.1:1'], status: 1, message: /cannot reach the session store at redis:\/\/127\.0\.0\.1:1: .*ECONNREFUSED/ },
  ]
  for (const { args, status, message } of cases) {
    it(`ortex ${args.map((a) => a.replace(scratch, '$TMP')).join(' ')}`, () => {
      const run = ortex(...args)
      expect(run.status).toBe(status)
      expect(run.stdout).toBe('')
      const lines = run.stderr.split('\n')
      expect(lines.at(-1)).toBe('') // ends with a newline
      expect(lines.slice(0, -1)).toHaveLength(1)
      expect(lines[0]).toMatch(/^ortex: /)
      expect(lines[0]).toMatch(message)
    })
  }
})

describe('ortex serve with ORTEX_API_KEY set but empty', () => {
  it('refuses to start: one line on stderr, exit status 2', () => {
    const run = ortexWith({ ORTEX_API_KEY: '' }, 'serve', '--simulated', '--port', '0')
    expect(run.status).toBe(2)
    expect(run.stdout).toBe('')
    expect(run.stderr).toBe('ortex: ORTEX_API_KEY is set but empty; unset it or give a key\n')
  })
})

describe('ortex generate --simulated', () => {
  for (const backend of ['native', 'wasm']) {
    it(`streams and reports tokens per second (${backend})`, () => {
      const run = ortex('generate', '--simulated', '--backend', backend, '--max-tokens', '5', '--prompt', 'a', '--prompt', 'b')
      expect(run.status, run.stderr).toBe(0)
      expect(run.stderr).toBe('') // no terminal: no progress drawing
      expect(run.stdout).toMatch(/^\[r1\] /m)
      expect(run.stdout).toMatch(/^\[r2\] /m)
      expect(run.stdout).toMatch(new RegExp(`^total: 10 tokens from 2 requests in [\\d.]+ ms: [\\d.]+ tok/s \\(${backend}\\)$`, 'm'))
    })
  }

  it('--chat renders each prompt as a user message with the chat template', () => {
    const answer = (run: { stdout: string }) => run.stdout.match(/^\[r1\] (.*)$/m)?.[1]
    const chat = ortex('generate', '--simulated', '--chat', '--max-tokens', '6', '--prompt', 'Hi there')
    const raw = ortex('generate', '--simulated', '--max-tokens', '6', '--prompt', '<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n')
    const plain = ortex('generate', '--simulated', '--max-tokens', '6', '--prompt', 'Hi there')
    expect(chat.status, chat.stderr).toBe(0)
    expect(answer(chat)).toBeDefined()
    expect(answer(chat)).toBe(answer(raw))
    expect(answer(chat)).not.toBe(answer(plain))
    const withSystem = ortex('generate', '--simulated', '--chat', '--system', 'Be brief.', '--max-tokens', '6', '--prompt', 'Hi there')
    const rawSystem = ortex('generate', '--simulated', '--max-tokens', '6', '--prompt', '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n')
    expect(answer(withSystem)).toBe(answer(rawSystem))
    const usage = ortex('generate', '--simulated', '--system', 'Be brief.')
    expect([usage.status, usage.stderr.trim()]).toEqual([2, 'ortex: --system needs --chat'])
  })
})
