// executionProvider 'cuda' with ONNX Runtime's real CUDA 13 build (onnxruntime-gpu 1.31.1), on a
// machine without a GPU. scripts/onnxruntime-gpu.sh downloads the wheel once (256 MB, 5-20 s here;
// 300 MB of libraries kept in ~/.cache/ortex/onnxruntime-gpu-1.31.1-l2/, reused by later runs) and
// scripts/package.sh --target linux-x64-gnu-cuda fills npm/linux-x64-gnu-cuda/ with them (hard
// links), where the facade finds the CUDA package in a checkout. Each case runs in a fresh node
// process, because a process's first model load opens its one ONNX Runtime:
//
// - 'cuda' first: the load fails with MODEL_LOAD naming what the host lacks (the NVIDIA driver,
//   the CUDA 13 runtime, cuDNN 9) and what it needs; a 'cpu' load in the same process then runs
//   on the GPU build, with the same tokens as the CPU build, every node on the CPU provider;
// - 'cpu' first, then 'cuda': refused (UNSUPPORTED) instead of running on the CPU library;
// - the packages as published (the CUDA one is a 232 MB tarball), installed in a user project: a
//   'cuda' load opens the installed CUDA package's library;
// - ORTEX_ORT_DYLIB wins: the facade then leaves the choice to it.
//
// A missing CUDA package is covered by test/packaging.test.ts (an installed project without it).
// Only a GPU machine shows a CUDA session itself and the nodes it places on the CPU
// (NodePlacement.cpuFallback): bench/gpu through ../shared/tools/device-kit.
import { spawnSync } from 'node:child_process'
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..')
const cudaLibrary = path.join(repo, 'npm', 'linux-x64-gnu-cuda', 'libonnxruntime.so.1')
const supported = process.platform === 'linux' && process.arch === 'x64'
// A machine with an NVIDIA driver would start the provider: these cases are for one without.
const hasDriver = ['/dev/nvidiactl', '/proc/driver/nvidia'].some((p) => existsSync(p))

let work: string
let model: string

interface LoadReport {
  ok?: { generated: number[]; placement: any }
  error?: { code: string; message: string }
}

/** Runs the loads in order in a fresh node process (each `[provider]`), reporting each and the
 *  ONNX Runtime library the process mapped. */
function loadsInFreshProcess(providers: string[], env: NodeJS.ProcessEnv = {}, project: string | null = null): { loads: LoadReport[]; ort: string | null } {
  // From the checkout's build, or as a user project requires it.
  const ortex = project === null ? path.join(repo, 'dist', 'index.js') : 'ortex'
  const script = `
    const { Engine } = require(${JSON.stringify(ortex)})
    ;(async () => {
      const loads = []
      for (const executionProvider of ${JSON.stringify(providers)}) {
        try {
          const engine = await Engine.load(${JSON.stringify(model)}, { executionProvider, maxBatchSize: 2 })
          const result = await engine.generate('The river', { maxGeneratedTokens: 6, ignoreEos: true }).done
          loads.push({ ok: { generated: Array.from(result.tokens), placement: engine.nodePlacement() } })
          await engine.close()
        } catch (e) {
          loads.push({ error: { code: e.code, message: e.message } })
        }
      }
      const maps = require('node:fs').readFileSync('/proc/self/maps', 'utf8').split('\\n')
      const ort = maps.map((l) => l.split(/\\s+/).at(-1)).find((f) => f && f.includes('libonnxruntime.so')) ?? null
      console.log(JSON.stringify({ loads, ort }))
    })()`
  const childEnv: NodeJS.ProcessEnv = { ...process.env, ...env }
  for (const key of ['ORTEX_ORT_DYLIB', 'ORT_DYLIB_PATH']) if (env[key] === undefined) delete childEnv[key]
  const run = spawnSync(process.execPath, ['-e', script], { cwd: project ?? repo, encoding: 'utf8', env: childEnv, timeout: 120_000 })
  if (run.status !== 0) throw new Error(`node exited ${run.status}:\n${run.stdout}\n${run.stderr}`)
  return JSON.parse(run.stdout.trim().split('\n').at(-1)!)
}

/** Runs a command; its stdout, or an error with both outputs. */
function shell(command: string, args: string[], cwd: string): string {
  const run = spawnSync(command, args, { cwd, encoding: 'utf8', timeout: 180_000 })
  if (run.status !== 0) throw new Error(`${command} ${args.join(' ')} exited ${run.status}:\n${run.stdout}\n${run.stderr}`)
  return run.stdout
}

/** The library folder, fetched on first use; a reason to skip where pip or PyPI is unavailable
 *  (as the real-model suite does). */
function fetchOnnxruntimeGpu(): string | null {
  if (!supported || hasDriver) return null
  const fetched = spawnSync('bash', ['scripts/onnxruntime-gpu.sh'], { cwd: repo, encoding: 'utf8', timeout: 600_000 })
  if (fetched.status === 0) return null
  return (fetched.stderr || String(fetched.error ?? '')).trim().split('\n').slice(-2).join(' ')
}

const unavailable = fetchOnnxruntimeGpu()
if (unavailable !== null) console.warn(`[cuda-runtime] skipped: ${unavailable}`)

describe.skipIf(!supported || hasDriver || unavailable !== null)("executionProvider 'cuda' with onnxruntime-gpu 1.31.1, on a machine without a GPU", () => {
  beforeAll(async () => {
    const packaged = spawnSync('bash', ['scripts/package.sh', '--target', 'linux-x64-gnu-cuda'], { cwd: repo, encoding: 'utf8', timeout: 600_000 })
    if (packaged.status !== 0) throw new Error(`scripts/package.sh --target linux-x64-gnu-cuda:\n${packaged.stderr}`)
    work = mkdtempSync(path.join(tmpdir(), 'ortex-cuda-'))
    model = path.join(work, 'tiny')
    await makeModel({ outDir: model, size: 'tiny' })
  }, 600_000)

  afterAll(() => {
    if (work !== undefined) rmSync(work, { recursive: true, force: true })
  })

  it("fails a 'cuda' load naming what the host lacks, then runs 'cpu' on the GPU build", () => {
    const { loads, ort } = loadsInFreshProcess(['cuda', 'cpu'])
    expect(ort).toBe(cudaLibrary) // the CUDA package's library, opened by the first ('cuda') load
    const failure = loads[0].error!
    expect(failure.code).toBe('MODEL_LOAD')
    // What is missing: here the whole CUDA stack (the provider itself loaded: it is beside the library).
    expect(failure.message).toMatch(/^executionProvider 'cuda' is unavailable: the dynamic loader cannot find /)
    for (const missing of ['libcuda.so.1 (NVIDIA driver)', 'libcudart.so.13 (CUDA 13 runtime)', 'libcublasLt.so.13 (CUDA 13 cuBLAS)', 'libcudnn.so.9 (cuDNN 9)']) {
      expect(failure.message).toContain(missing)
    }
    // What the host needs, and ONNX Runtime's own words.
    expect(failure.message).toContain('needs an NVIDIA GPU and driver for CUDA 13 (580 or newer)')
    expect(failure.message).toContain('LD_LIBRARY_PATH')
    expect(failure.message).toMatch(/ONNX Runtime said: .*Failed to load library .*libonnxruntime_providers_cuda\.so.*cannot open shared object file/)

    // The GPU build runs CPU sessions: same greedy tokens as the CPU build, every node on the CPU.
    const onGpuBuild = loads[1].ok!
    const cpuBuild = loadsInFreshProcess(['cpu'])
    expect(cpuBuild.ort).not.toBe(cudaLibrary)
    expect(onGpuBuild.generated).toHaveLength(6)
    expect(onGpuBuild.generated).toEqual(cpuBuild.loads[0].ok!.generated)
    expect(onGpuBuild.placement.executionProvider).toBe('cpu')
    expect(Object.keys(onGpuBuild.placement.providers)).toEqual(['CPUExecutionProvider'])
    expect(onGpuBuild.placement.providers.CPUExecutionProvider.MatMul).toBeGreaterThan(0)
    expect(onGpuBuild.placement.cpuFallback).toBeNull()
    expect(onGpuBuild.placement).toEqual(cpuBuild.loads[0].ok!.placement)
  })

  it("refuses a 'cuda' load after the process opened the CPU library, instead of running it on the CPU", () => {
    const { loads, ort } = loadsInFreshProcess(['cpu', 'cuda'])
    expect(ort).not.toBe(cudaLibrary)
    expect(loads[0].ok!.generated).toHaveLength(6)
    expect(loads[1].error!.code).toBe('UNSUPPORTED')
    expect(loads[1].error!.message).toContain(`executionProvider 'cuda' needs ${cudaLibrary}, but this process already opened the ONNX Runtime library ${ort}`)
    expect(loads[1].error!.message).toContain("make the process's first Engine.load the 'cuda' one")
  })

  it('opens the installed package ortex-linux-x64-gnu-cuda in a user project', () => {
    // The three packages as published (scripts/package.sh --pack), installed offline in a fresh
    // project (the root's runtime dependencies from the npm cache, as in test/packaging.test.ts).
    const tarballs = path.join(work, 'tarballs')
    const project = path.join(work, 'project')
    const pack = (args: string[]) => shell('bash', ['scripts/package.sh', ...args, '--pack', tarballs], repo).trim().split('\n')
    const [platformTarball, rootTarball] = pack(['--no-build']).slice(-2)
    const [cudaTarball] = pack(['--target', 'linux-x64-gnu-cuda']).slice(-1)
    mkdirSync(project)
    writeFileSync(path.join(project, 'package.json'), JSON.stringify({ name: 'user-project', version: '1.0.0', private: true }))
    const rootDeps = JSON.parse(shell('tar', ['xzf', rootTarball, '-O', 'package/package.json'], work)).dependencies ?? {}
    for (const [name, version] of Object.entries(rootDeps)) shell('npm', ['cache', 'add', `${name}@${version}`, '--prefer-offline'], project)
    shell('npm', ['install', '--offline', '--no-audit', '--no-fund', '--ignore-scripts', platformTarball, rootTarball, cudaTarball], project)

    const { loads, ort } = loadsInFreshProcess(['cuda', 'cpu'], {}, project)
    expect(ort).toBe(path.join(project, 'node_modules', 'ortex-linux-x64-gnu-cuda', 'libonnxruntime.so.1'))
    expect(loads[0].error!.code).toBe('MODEL_LOAD')
    expect(loads[0].error!.message).toMatch(/^executionProvider 'cuda' is unavailable: the dynamic loader cannot find libcuda\.so\.1 \(NVIDIA driver\)/)
    expect(loads[1].ok!.generated).toHaveLength(6)
  }, 240_000)

  it('leaves the choice to ORTEX_ORT_DYLIB when it is set', () => {
    // The CPU build named: the CUDA load reaches ONNX Runtime, which has no CUDA provider there.
    const cpuBuild = loadsInFreshProcess(['cpu']).ort!
    const { loads, ort } = loadsInFreshProcess(['cpu', 'cuda'], { ORTEX_ORT_DYLIB: cpuBuild })
    expect(ort).toBe(cpuBuild)
    expect(loads[1].error!.code).toBe('MODEL_LOAD')
    expect(loads[1].error!.message).toContain(`${cpuBuild} is a build without the CUDA provider`)
    expect(loads[1].error!.message).toContain('install the package ortex-linux-x64-gnu-cuda beside ortex')
  })
})
