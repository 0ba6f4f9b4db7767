// The native backend: the napi-rs addon (crates/ortex-napi). Its `run` executes the transaction
// off the JS thread (a model's on the engine's own step thread, the simulated model's on the libuv
// thread pool) and writes the events on the JS thread when it resolves.
// The addon is loaded on first use, so importing `ortex` never fails on a machine without it.

import { readFileSync, statSync } from 'node:fs'
import { createRequire } from 'node:module'
import os from 'node:os'
import path from 'node:path'

import type { NativeBinding, NativeCoreEngine } from './binding'
import type { Backend } from './backend'
import type { ModelOptionsInput } from './generated/boundary'
import { fromPackageRoot, packageRoot } from './backend'
import { OrtexError } from './errors'

/** The platforms ortex ships a prebuilt addon for (npm/<platform>/, package `ortex-<platform>`). */
export const SUPPORTED_PLATFORMS = ['linux-x64-gnu', 'linux-arm64-gnu'] as const

/** This machine as napi-rs names platforms: linux-x64-gnu, linux-x64-musl, darwin-arm64, ... */
export function currentPlatform(): string {
  const { platform, arch } = process
  let abi = ''
  if (platform === 'linux') abi = isMusl() ? '-musl' : '-gnu'
  else if (platform === 'win32') abi = '-msvc'
  return `${platform}-${arch}${abi}`
}

function isMusl(): boolean {
  try {
    const header = (process.report?.getReport() as { header?: { glibcVersionRuntime?: string } } | undefined)?.header
    return header?.glibcVersionRuntime === undefined
  } catch {
    return false
  }
}

/** The npm package that holds the addon for a platform (napi-rs: `<packageName>-<platform>`). */
export function platformPackageName(platform: string = currentPlatform()): string {
  return `ortex-${platform}`
}

/** A development build of the addon, relative to the package root (scripts/build.sh writes it;
 *  the published package never contains native/). */
export function devAddonPath(platform: string = currentPlatform()): string {
  return `native/ortex.${platform}.node`
}

/** Where the addon was found: its file, and the folder that may hold libonnxruntime.so.1 too. */
interface AddonLocation {
  file: string
  source: 'development build' | 'platform package'
}

let binding: NativeBinding | null = null
let addonLocation: AddonLocation | null = null

/**
 * Finds the addon the way napi-rs's generated loaders do: a local build beside the package first
 * (native/ in a checkout: a fresh `npm run build` must win over an installed copy), then the
 * installed platform package `ortex-<platform>` (an optionalDependency of `ortex`, so npm installs
 * only the one matching the user's os/cpu/libc). Throws UNSUPPORTED naming the package to install.
 */
function locateAddon(): AddonLocation {
  const platform = currentPlatform()
  const dev = fromPackageRoot(devAddonPath(platform))
  if (stat(dev)?.isFile() === true) return { file: dev, source: 'development build' }
  const name = platformPackageName(platform)
  if (!(SUPPORTED_PLATFORMS as readonly string[]).includes(platform)) {
    throw new OrtexError(
      'UNSUPPORTED',
      `ortex has no native addon for ${platform} (prebuilt: ${SUPPORTED_PLATFORMS.map((p) => platformPackageName(p)).join(', ')}); ` +
        `use the WebAssembly build instead: import { Engine } from 'ortex/wasm' (simulated engines only)`,
    )
  }
  const root = packageRoot()
  let manifest: string
  try {
    manifest = createRequire(path.join(root, 'package.json')).resolve(`${name}/package.json`)
  } catch (error) {
    throw new OrtexError(
      'UNSUPPORTED',
      `the native ortex addon for ${platform} is missing: the package ${name} is not installed. ` +
        `Install it with \`npm install ${name}@${ownVersion()}\` (ortex lists it in optionalDependencies; ` +
        `an install with --omit=optional or --no-optional leaves it out), or use import { Engine } from 'ortex/wasm' ` +
        `(in a checkout of ortex, \`npm run build\` builds ${devAddonPath(platform)} instead)`,
      { cause: error },
    )
  }
  const dir = path.dirname(manifest)
  const pkg = readJson(manifest)
  const version = ownVersion()
  if (version !== 'unknown' && pkg?.version !== version) {
    throw new OrtexError(
      'UNSUPPORTED',
      `${name}@${String(pkg?.version)} does not match ortex@${version}: install ${name}@${version} ` +
        `(\`npm install ${name}@${version}\`)`,
    )
  }
  const file = path.join(dir, typeof pkg?.main === 'string' ? pkg.main : `ortex.${platform}.node`)
  if (stat(file)?.isFile() !== true) {
    throw new OrtexError('UNSUPPORTED', `${name} at ${dir} has no addon (${path.basename(file)}): reinstall ${name}@${version}`)
  }
  return { file, source: 'platform package' }
}

function loadBinding(): NativeBinding {
  if (binding !== null) return binding
  const location = locateAddon()
  try {
    const require = createRequire(location.file)
    binding = require(location.file) as NativeBinding
  } catch (error) {
    throw new OrtexError(
      'UNSUPPORTED',
      `the native ortex addon (${location.source}, ${location.file}) does not load on ${currentPlatform()}: ` +
        `${(error as Error)?.message?.split('\n')[0] ?? String(error)}; ` +
        `use the WebAssembly build instead: import { Engine } from 'ortex/wasm'`,
      { cause: error },
    )
  }
  addonLocation = location
  return binding
}

function readJson(file: string): Record<string, unknown> | undefined {
  try {
    return JSON.parse(readFileSync(file, 'utf8')) as Record<string, unknown>
  } catch {
    return undefined
  }
}

function ownVersion(): string {
  const version = readJson(fromPackageRoot('package.json'))?.version
  return typeof version === 'string' ? version : 'unknown'
}

/** The checks that do not need ONNX Runtime: the folder exists and has a genai_config.json. */
function checkModelFolder(modelDir: string): void {
  const dir = path.resolve(modelDir)
  const stats = stat(dir)
  if (stats === undefined) {
    throw new OrtexError('MODEL_LOAD', `model folder ${JSON.stringify(modelDir)} does not exist (Engine.load takes a model folder or a GGUF file)`)
  }
  if (!stats.isDirectory()) {
    throw new OrtexError('MODEL_LOAD', `${JSON.stringify(modelDir)} is neither a model folder nor a GGUF file (a .gguf name, or the bytes "GGUF" first)`)
  }
  if (stat(path.join(dir, 'genai_config.json'))?.isFile() !== true) {
    throw new OrtexError('MODEL_LOAD', `${JSON.stringify(modelDir)} is not a model folder: it has no genai_config.json`)
  }
}

function stat(file: string): ReturnType<typeof statSync> | undefined {
  try {
    return statSync(file, { throwIfNoEntry: false })
  } catch {
    return undefined // unreadable counts as missing
  }
}

/**
 * The ONNX Runtime library the addon opens: a `libonnxruntime.so.1` beside the addon (the
 * platform package ships one), else the one the npm package onnxruntime-node ships (a development
 * checkout, where it is a devDependency). ORTEX_ORT_DYLIB (or ORT_DYLIB_PATH) overrides either
 * inside the addon. Null when none is found: the addon then explains what to install.
 */
export function ortLibraryPath(): string | null {
  const addon = addonLocation?.file ?? safeLocateAddon()
  if (addon !== null) {
    const beside = path.join(path.dirname(addon), 'libonnxruntime.so.1')
    if (stat(beside)?.isFile() === true) return beside
  }
  try {
    const require = createRequire(fromPackageRoot('package.json'))
    const root = path.dirname(require.resolve('onnxruntime-node/package.json'))
    const file = path.join(root, 'bin', 'napi-v6', process.platform, process.arch, 'libonnxruntime.so.1')
    if (stat(file)?.isFile() === true) return file
  } catch {
    // onnxruntime-node is not installed (it never is in users' installs)
  }
  return null
}

function safeLocateAddon(): string | null {
  try {
    return locateAddon().file
  } catch {
    return null
  }
}

/** The platforms with a CUDA package (`ortex-<platform>-cuda`: onnxruntime-gpu's CUDA 13 build). */
export const CUDA_PLATFORMS = ['linux-x64-gnu'] as const

/** The optional package with ONNX Runtime's CUDA build for a platform. */
export function cudaPackageName(platform: string = currentPlatform()): string {
  return `${platformPackageName(platform)}-cuda`
}

/** Set by the environment, the library every load opens (the addon reads them; the device kit
 *  sets ORTEX_ORT_DYLIB). */
function libraryFromEnvironment(): string | null {
  return process.env.ORTEX_ORT_DYLIB || process.env.ORT_DYLIB_PATH || null
}

/**
 * The ONNX Runtime library for an `executionProvider: 'cuda'` load: the installed package
 * `ortex-<platform>-cuda`'s, else, in a checkout, npm/<platform>-cuda/'s (scripts/package.sh
 * --target <platform>-cuda fills it). One process has one ONNX Runtime and its first load opens
 * it (the CUDA build runs CPU sessions too): a CUDA load after the process opened another library
 * is refused instead of running on the CPU. ORTEX_ORT_DYLIB / ORT_DYLIB_PATH win over all of it.
 * Throws UNSUPPORTED naming what to install, or what to do.
 */
function cudaOrtLibraryPath(binding: NativeBinding): string | null {
  if (libraryFromEnvironment() !== null) return null
  const platform = currentPlatform()
  const name = cudaPackageName(platform)
  if (!(CUDA_PLATFORMS as readonly string[]).includes(platform)) {
    throw new OrtexError('UNSUPPORTED', `executionProvider 'cuda' has no ONNX Runtime build for ${platform} (${CUDA_PLATFORMS.map((p) => cudaPackageName(p)).join(', ')} only); use executionProvider 'cpu'`)
  }
  const library = installedCudaLibrary(name) ?? checkoutCudaLibrary(platform)
  if (library === null) {
    throw new OrtexError(
      'UNSUPPORTED',
      `executionProvider 'cuda' needs ONNX Runtime's CUDA build, the package ${name}, which is not installed: ` +
        `\`npm install ${name}@${ownVersion()}\` beside ortex (about 300 MB; the host also needs an NVIDIA driver for CUDA 13, ` +
        `the CUDA 13 runtime libraries and cuDNN 9: see the README, "GPU (CUDA)"), or set ORTEX_ORT_DYLIB to onnxruntime-gpu 1.31's libonnxruntime.so.1`,
    )
  }
  const opened = binding.CoreEngine.loadedOrtLibrary()
  if (opened !== null && path.resolve(opened) !== path.resolve(library)) {
    throw new OrtexError(
      'UNSUPPORTED',
      `executionProvider 'cuda' needs ${library}, but this process already opened the ONNX Runtime library ${opened} ` +
        `for an earlier model load, and one process has one ONNX Runtime: make the process's first Engine.load the 'cuda' ` +
        `one (the CUDA build runs executionProvider 'cpu' models too), or load the CUDA model in a process of its own`,
    )
  }
  return library
}

/** The installed CUDA package's library; throws UNSUPPORTED for one of another version. */
function installedCudaLibrary(name: string): string | null {
  let manifest: string
  try {
    manifest = createRequire(path.join(packageRoot(), 'package.json')).resolve(`${name}/package.json`)
  } catch {
    return null
  }
  const version = ownVersion()
  const found = readJson(manifest)?.version
  if (version !== 'unknown' && found !== version) {
    throw new OrtexError('UNSUPPORTED', `${name}@${String(found)} does not match ortex@${version}: \`npm install ${name}@${version}\``)
  }
  const library = path.join(path.dirname(manifest), 'libonnxruntime.so.1')
  if (stat(library)?.isFile() !== true) {
    throw new OrtexError('UNSUPPORTED', `${name} at ${path.dirname(manifest)} has no libonnxruntime.so.1: reinstall ${name}@${version}`)
  }
  return library
}

/** In a checkout: the CUDA package folder scripts/package.sh filled (never published from here). */
function checkoutCudaLibrary(platform: string): string | null {
  const library = fromPackageRoot(`npm/${platform}-cuda/libonnxruntime.so.1`)
  return stat(library)?.isFile() === true ? library : null
}

/** A CUDA engine whose session runs nodes on the CPU says so (NodePlacement.cpuFallback). */
function warnOfCpuFallback(modelDir: string, cpuFallback: string | null): void {
  if (cpuFallback === null) return
  process.emitWarning(
    `${modelDir}: ${cpuFallback} (ONNX Runtime keeps shape arithmetic on the CPU on purpose; other ops there may lack a CUDA kernel ` +
      `for their types; engine.nodePlacement() counts every provider's nodes)`,
    { type: 'OrtexWarning', code: 'ORTEX_CUDA_CPU_FALLBACK' },
  )
}

/** Under CUDA a paged-attention folder's pool is device memory, whose size ONNX Runtime does not
 *  tell: 4 GiB fits beside the weights of a small model on any 8 GB GPU and holds the bench
 *  model's float16 KV for 256 rows of its whole context (docs/api.md, kvCacheBytes). */
const CUDA_KV_BUDGET_BYTES = 4 * 2 ** 30

/** A model's default KV pool is held to a quarter of the machine's memory (under CUDA, to at
 *  most CUDA_KV_BUDGET_BYTES too), so that a long context does not make it reserve more than the
 *  machine has (options naming the pool's size or budget are kept as they are). */
function withKvBudget(options: ModelOptionsInput): ModelOptionsInput {
  if (options.numBlocks !== undefined || options.kvCacheBytes !== undefined) return options
  const host = Math.floor(os.totalmem() / 4)
  return { ...options, kvCacheBytes: options.executionProvider === 'cuda' ? Math.min(host, CUDA_KV_BUDGET_BYTES) : host }
}

export const nativeBackend: Backend = {
  kind: 'native',
  simulated(options) {
    return loadBinding().CoreEngine.simulated(options)
  },
  /** Loading runs on the libuv thread pool (config, tokenizer, ONNX Runtime session). */
  async load(modelDir, options) {
    checkModelFolder(modelDir)
    const binding = loadBinding()
    const library = options.executionProvider === 'cuda' ? cudaOrtLibraryPath(binding) : (binding.CoreEngine.loadedOrtLibrary() ?? ortLibraryPath())
    const core = await binding.CoreEngine.load(path.resolve(modelDir), withKvBudget(options), library)
    warnOfCpuFallback(modelDir, core.nodePlacement()?.cpuFallback ?? null)
    return core
  },
  chat(files, controls) {
    const factory = loadBinding().CoreChat
    return files === null ? factory.chatml(controls) : factory.fromFiles(files, controls)
  },
  run(core, events, capacity) {
    return (core as NativeCoreEngine).run(events, capacity)
  },
}
