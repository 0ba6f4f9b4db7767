// How long a GGUF file takes before its first token: `ortex import` with 1 and 2 (or more)
// conversion threads, Engine.load of the .gguf on first use (import and session) and once its
// import is cached, against llama.cpp's load of the same file (node-llama-cpp's prebuilt CPU
// binary: loadModel + createContext, as bench/llama-cpp/systems.ts loads it). The file is a random
// 1.07B-parameter Llama in llama.cpp's Q4_K_M layout (random-q4km.ts), which an int4 import keeps
// exactly where it is Q4_K and requantizes where it is Q6_K.
//
// Every measurement is a child process of its own (wall time from spawn to exit, its CPU time and
// peak resident memory, VmHWM, threads included, and the CPU the rest of the machine used
// meanwhile: threads only help where cores are free); the systems take turns round by round and
// the medians are reported. The file is read once before the first round, so every system starts
// from a warm page cache.
//
// Build first (npm run build:ts), then from the repository root:
//   npx esbuild bench/gguf-import/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --external:node-llama-cpp --external:yauzl \
//     --outfile=bench/out/gguf-import.mjs && node bench/out/gguf-import.mjs [--workers 1,2] [--rounds 2]
// Prints the table and writes bench/out/gguf-import.json.

import { spawn } from 'node:child_process'
import { createReadStream, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs'
import { availableParallelism, cpus } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'

import { cacheRoot, smolLM2Gguf } from '../../ts/modelkit/real-model'
import { q4kmParameters, randomQ4KM } from './random-q4km'

const HELP = `Usage: node bench/out/gguf-import.mjs [--workers 1,2] [--rounds 2] [--threads 2] [--out DIR]

ortex import (int4) of a random 1.07B-parameter Q4_K_M Llama with each worker count, Engine.load of
the .gguf on first use and from the cache, and llama.cpp's load of the same file, each a child
process, the systems taking turns; medians of the rounds. The first run writes the file (about a
minute, cached in ~/.cache/ortex/gguf-import-bench).

Options:
  --workers LIST  worker counts of 'ortex import' (default 1,2)
  --rounds N      rounds (default 2)
  --max-others C  refuse a sample during which the rest of the machine used more than C cores and
                  take it again, 3 times at most (default 0.2; the last try is kept, marked)
  --threads N     llama.cpp's threads and ortex's intra-op threads when loading (default 2)
  --out DIR       where to write gguf-import.json (default bench/out)
  -h, --help      show this help
`

const ROOT = fileURLToPath(new URL('../../', import.meta.url))
const CLI = join(ROOT, 'dist', 'cli.js')

interface Sample {
  system: string
  wallS: number
  peakMb: number
  /** The child's CPU time (user + system, every thread). */
  cpuS: number
  /** CPU time of everything else on the machine while the child ran, in cores (busy time from
   *  /proc/stat less the child's, over the wall time): what the child's threads competed with. */
  otherCores: number
  /** What the child said of itself (llama.cpp's phases, the import's summary). */
  detail: Record<string, unknown>
}

const log = (line: string) => process.stderr.write(`${line}\n`)

/** Tries of a sample during which other work used more than --max-others cores. */
const MAX_TRIES = 3

/** This process's CPU time so far, every thread, in seconds. */
function cpuSeconds(): number {
  const { user, system } = process.cpuUsage()
  return (user + system) / 1e6
}

/** VmHWM of this process, in MiB. */
function peakMb(): number {
  const m = /^VmHWM:\s+(\d+) kB/m.exec(readFileSync('/proc/self/status', 'utf8'))
  return m === null ? Number.NaN : Number(m[1]) / 1024
}

/** Busy CPU seconds of the whole machine so far (/proc/stat: user, nice, system, irq, softirq, steal). */
function machineBusyS(): number {
  const fields = readFileSync('/proc/stat', 'utf8').split('\n')[0]!.trim().split(/\s+/).slice(1).map(Number)
  const [user, nice, system, , , irq, softirq, steal] = fields
  return (user! + nice! + system! + irq! + softirq! + (steal ?? 0)) / 100
}

/** Runs a child; its last stdout line is its JSON result, merged with the wall time. */
function run(system: string, args: string[], env: Record<string, string> = {}): Promise<Sample> {
  const started = performance.now()
  const busyBefore = machineBusyS()
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, args, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (d) => (stdout += String(d)))
    child.stderr.on('data', (d) => (stderr += String(d)))
    child.on('error', reject)
    child.on('exit', (code) => {
      const wallS = (performance.now() - started) / 1000
      const busyS = machineBusyS() - busyBefore
      if (code !== 0) return reject(new Error(`${system} exited ${code}: ${stderr.trim().split('\n').slice(-3).join(' ')}`))
      const own = /^bench-own (\S+) (\S+)$/m.exec(stderr + stdout)
      const last = stdout.trim().split('\n').at(-1) ?? '{}'
      const detail = last.startsWith('{') ? (JSON.parse(last) as Record<string, unknown>) : { output: last }
      const peak = own ? Number(own[1]) : Number(detail.peakMb)
      const cpuS = own ? Number(own[2]) : Number(detail.cpuS)
      resolve({ system, wallS, peakMb: peak, cpuS, otherCores: Math.max(0, busyS - cpuS) / wallS, detail })
    })
  })
}

// ---- children ----------------------------------------------------------------------------------

async function llamaChild(file: string, threads: number): Promise<void> {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  const t0 = performance.now()
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.warn, maxThreads: 0 })
  const t1 = performance.now()
  const model = await llama.loadModel({ modelPath: file })
  const t2 = performance.now()
  const context = await model.createContext({ sequences: 1, contextSize: 2048, threads })
  const t3 = performance.now()
  const peak = peakMb()
  await context.dispose()
  await model.dispose()
  await llama.dispose()
  const s = (ms: number) => Number((ms / 1000).toFixed(3))
  console.log(JSON.stringify({ getLlamaS: s(t1 - t0), loadModelS: s(t2 - t1), createContextS: s(t3 - t2), mmap: model.useMmap, peakMb: peak, cpuS: cpuSeconds() }))
}

async function ortexLoadChild(file: string, threads: number): Promise<void> {
  const { Engine } = await import('ortex')
  const kinds = new Set<string>()
  let summary: string | undefined
  const t0 = performance.now()
  const engine = await Engine.load(file, {
    intraOpThreads: threads,
    gguf: {
      onProgress: (e) => {
        kinds.add(e.kind)
        if (e.kind === 'imported') summary = e.summary
      },
    },
  })
  const loadS = (performance.now() - t0) / 1000
  const peak = peakMb()
  await engine.close()
  console.log(JSON.stringify({ loadS: Number(loadS.toFixed(3)), events: [...kinds], summary, peakMb: peak, cpuS: cpuSeconds() }))
}

// ---- the parent ----------------------------------------------------------------------------------

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 === 1 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2
}

async function readThrough(file: string): Promise<void> {
  for await (const _ of createReadStream(file, { highWaterMark: 8 << 20 })) {
    // Only to have the file in the page cache.
  }
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    args: process.argv.slice(2),
    options: {
      workers: { type: 'string' },
      rounds: { type: 'string' },
      'max-others': { type: 'string' },
      threads: { type: 'string' },
      out: { type: 'string' },
      'child-llama': { type: 'string' },
      'child-load': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  const threads = Number(values.threads ?? 2)
  if (values['child-llama'] !== undefined) return llamaChild(values['child-llama'], threads)
  if (values['child-load'] !== undefined) return ortexLoadChild(values['child-load'], threads)
  if (values.help) {
    process.stdout.write(HELP)
    return
  }
  const workerCounts = (values.workers ?? '1,2').split(',').map(Number)
  const rounds = Number(values.rounds ?? 2)
  const maxOthers = Number(values['max-others'] ?? 0.2)
  const outDir = values.out ?? join(ROOT, 'bench', 'out')
  const benchRoot = join(cacheRoot(), 'gguf-import-bench')
  const file = randomQ4KM(benchRoot, await smolLM2Gguf(), log)
  log(`file: ${file} (${(statSync(file).size / 1e6).toFixed(1)} MB)`)
  await readThrough(file)
  mkdirSync(benchRoot, { recursive: true })
  const scratch = mkdtempSync(join(benchRoot, 'run-'))
  // Prints the process's peak memory and CPU time as it exits: the CLI reports through it.
  const preload = join(scratch, 'own.cjs')
  writeFileSync(
    preload,
    `process.on('exit', () => { const m = /^VmHWM:\\s+(\\d+) kB/m.exec(require('fs').readFileSync('/proc/self/status', 'utf8')); ` +
      `const c = process.cpuUsage(); process.stderr.write('bench-own ' + (m ? Number(m[1]) / 1024 : NaN) + ' ' + (c.user + c.system) / 1e6 + '\\n') })\n`,
  )
  const self = fileURLToPath(import.meta.url)
  const samples: Sample[] = []
  let refused = 0
  try {
    for (let round = 1; round <= rounds; round++) {
      const cache = join(scratch, `cache-${round}`)
      // Each step runs from the same state on every try: a first use from an empty cache.
      const steps: Array<() => Promise<Sample>> = [
        () => run('llama.cpp load', [self, '--child-llama', file, '--threads', String(threads)]),
        ...workerCounts.map((n) => async () => {
          const out = join(scratch, `import-${n}`)
          const sample = await run(`ortex import, ${n} worker${n === 1 ? '' : 's'}`, ['--require', preload, CLI, 'import', file, '--out', out, '--weights', 'int4', '--workers', String(n)])
          rmSync(out, { recursive: true, force: true })
          return sample
        }),
        () => {
          rmSync(cache, { recursive: true, force: true })
          return run(`Engine.load(.gguf), first use (${availableParallelism()} workers)`, [self, '--child-load', file, '--threads', String(threads)], { ORTEX_CACHE_DIR: cache })
        },
        () => run('Engine.load(.gguf), cached', [self, '--child-load', file, '--threads', String(threads)], { ORTEX_CACHE_DIR: cache }),
      ]
      for (const step of steps) {
        let sample = await step()
        for (let tries = 1; sample.otherCores > maxOthers && tries < MAX_TRIES; tries++) {
          log(`round ${round}: ${sample.system}: refused (other work used ${sample.otherCores.toFixed(2)} cores), again`)
          refused++
          sample = await step()
        }
        log(`round ${round}: ${sample.system}: ${sample.wallS.toFixed(2)} s (CPU ${sample.cpuS.toFixed(2)} s), peak ${sample.peakMb.toFixed(0)} MiB, other work ${sample.otherCores.toFixed(2)} cores ${JSON.stringify(sample.detail)}`)
        samples.push(sample)
      }
      rmSync(cache, { recursive: true, force: true })
    }
  } finally {
    rmSync(scratch, { recursive: true, force: true })
  }
  const systems = [...new Set(samples.map((s) => s.system))]
  // Medians of the undisturbed samples where there are any (other work at most --max-others cores).
  const rows = systems.map((system) => {
    const all = samples.filter((s) => s.system === system)
    const clean = all.filter((s) => s.otherCores <= maxOthers)
    const of = clean.length > 0 ? clean : all
    return {
      undisturbed: `${clean.length} of ${all.length}`,
      system,
      wallS: median(of.map((s) => s.wallS)),
      cpuS: median(of.map((s) => s.cpuS)),
      peakMb: median(of.map((s) => s.peakMb)),
      otherCores: median(of.map((s) => s.otherCores)),
      samples: of.map((s) => s.wallS),
    }
  })
  const llama = rows[0]!.wallS
  const lines = [
    `| what | wall (median) | vs llama.cpp load | CPU time | peak RSS | other work (cores of ${availableParallelism()}) | undisturbed samples |`,
    '|---|---:|---:|---:|---:|---:|---:|',
  ]
  for (const r of rows) {
    lines.push(
      `| ${r.system} | ${r.wallS.toFixed(2)} s | ${(r.wallS / llama).toFixed(1)}x | ${r.cpuS.toFixed(2)} s | ${r.peakMb.toFixed(0)} MiB | ${r.otherCores.toFixed(2)} | ${r.undisturbed} |`,
    )
  }
  const disturbed = samples.filter((x) => x.otherCores > maxOthers).length
  lines.push('', `${refused} samples refused and taken again; ${disturbed} of ${samples.length} kept with other work above ${maxOthers} cores (medians of the undisturbed ones where a row has any)`)
  process.stdout.write(`${lines.join('\n')}\n`)
  const report = {
    file,
    fileBytes: statSync(file).size,
    parameters: q4kmParameters(),
    cpu: cpus()[0]?.model,
    cores: availableParallelism(),
    threads,
    rounds,
    maxOthers,
    refused,
    rows,
    samples,
  }
  mkdirSync(outDir, { recursive: true })
  writeFileSync(join(outDir, 'gguf-import.json'), `${JSON.stringify(report, null, 2)}\n`)
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    log(`gguf-import: ${(error as Error)?.stack ?? String(error)}`)
    process.exit(1)
  },
)
