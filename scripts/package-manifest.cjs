// The manifests of the published packages, for scripts/package.sh (run from the repository root).
//
//   node scripts/package-manifest.cjs check PLATFORM   checks npm/PLATFORM/package.json against
//                                                       package.json; exits 1 naming each problem
//   node scripts/package-manifest.cjs stage FILE       writes the root package.json as published:
//                                                       optionalDependencies gets the platform
//                                                       package of every napi target, no scripts
//   node scripts/package-manifest.cjs refuse-publish   fails with a hint (package.json's
//                                                       prepublishOnly: publish the staged package)
const { readFileSync, writeFileSync } = require('node:fs')

// napi-rs's platform names (npm/<name>/, <packageName>-<name>) of the targets ortex ships.
const PLATFORM_OF_TARGET = {
  'x86_64-unknown-linux-gnu': 'linux-x64-gnu',
  'aarch64-unknown-linux-gnu': 'linux-arm64-gnu',
}
const INSTALL_SCRIPTS = ['preinstall', 'install', 'postinstall', 'prepare']
// The CUDA packages (npm/<platform>-cuda/): ONNX Runtime's CUDA build, installed by the user beside
// ortex (not an optionalDependency: it is about 300 MB), for the napi platform it extends.
const CUDA_PACKAGES = { 'linux-x64-gnu-cuda': 'linux-x64-gnu' }
const CUDA_FILES = ['libonnxruntime.so.1', 'libonnxruntime_providers_cuda.so', 'libonnxruntime_providers_shared.so', 'LICENSE', 'LICENSE-onnxruntime', 'ThirdPartyNotices.txt']

const root = JSON.parse(readFileSync('package.json', 'utf8'))
const napi = root.napi ?? {}
const packageName = napi.packageName ?? root.name
const binaryName = napi.binaryName ?? 'index'

function platformPackages() {
  return (napi.targets ?? []).map((target) => {
    const platform = PLATFORM_OF_TARGET[target]
    if (platform === undefined) throw new Error(`no platform name known for the napi target ${target}`)
    return { platform, name: `${packageName}-${platform}` }
  })
}

function checkCuda(platform) {
  const problems = []
  const base = CUDA_PACKAGES[platform]
  const pkg = JSON.parse(readFileSync(`npm/${platform}/package.json`, 'utf8'))
  const basePkg = JSON.parse(readFileSync(`npm/${base}/package.json`, 'utf8'))
  if (pkg.name !== `${packageName}-${platform}`) problems.push(`name is ${pkg.name}, expected ${packageName}-${platform}`)
  if (pkg.version !== root.version) problems.push(`version is ${pkg.version}, expected ${root.version} (the root's)`)
  for (const key of ['os', 'cpu', 'libc', 'engines', 'license']) {
    if (JSON.stringify(pkg[key]) !== JSON.stringify(basePkg[key])) problems.push(`${key} differs from npm/${base}'s`)
  }
  for (const file of CUDA_FILES) if (!pkg.files?.includes(file)) problems.push(`files does not list ${file}`)
  if (pkg.main !== undefined) problems.push('has a main: it holds libraries only')
  for (const script of INSTALL_SCRIPTS) {
    if (pkg.scripts?.[script] !== undefined) problems.push(`npm/${platform}/package.json has an install-time script '${script}'`)
  }
  if (root.optionalDependencies?.[pkg.name] !== undefined) problems.push(`package.json must not depend on ${pkg.name}`)
  for (const problem of problems) console.error(`[ortex] package: ${problem}`)
  process.exit(problems.length > 0 ? 1 : 0)
}

function check(platform) {
  if (CUDA_PACKAGES[platform] !== undefined) return checkCuda(platform)
  const problems = []
  const expected = platformPackages().find((p) => p.platform === platform)
  if (expected === undefined) problems.push(`package.json's napi.targets has no target for ${platform}`)
  const pkg = JSON.parse(readFileSync(`npm/${platform}/package.json`, 'utf8'))
  const name = `${packageName}-${platform}`
  const binary = `${binaryName}.${platform}.node`
  if (pkg.name !== name) problems.push(`name is ${pkg.name}, expected ${name}`)
  if (pkg.version !== root.version) problems.push(`version is ${pkg.version}, expected ${root.version} (the root's)`)
  if (pkg.main !== binary) problems.push(`main is ${pkg.main}, expected ${binary}`)
  for (const file of [binary, 'libonnxruntime.so.1']) {
    if (!pkg.files?.includes(file)) problems.push(`files does not list ${file}`)
  }
  for (const [label, manifest] of [['package.json', root], [`npm/${platform}/package.json`, pkg]]) {
    for (const script of INSTALL_SCRIPTS) {
      if (manifest.scripts?.[script] !== undefined) problems.push(`${label} has an install-time script '${script}'`)
    }
  }
  for (const problem of problems) console.error(`[ortex] package: ${problem}`)
  process.exit(problems.length > 0 ? 1 : 0)
}

function stage(file) {
  const published = { ...root }
  // The repository's scripts name files that are not published; prepublishOnly refuses a publish
  // from the repository itself (its package.json lacks the optionalDependencies).
  delete published.scripts
  published.optionalDependencies = {
    ...root.optionalDependencies,
    ...Object.fromEntries(platformPackages().map((p) => [p.name, root.version])),
  }
  writeFileSync(file, `${JSON.stringify(published, null, 2)}\n`)
}

const [command, arg] = process.argv.slice(2)
if (command === 'check' && arg) check(arg)
else if (command === 'stage' && arg) stage(arg)
else if (command === 'refuse-publish') {
  console.error(
    'ortex: publish the packages scripts/package.sh stages, not the repository: ' +
      '`npm run package -- --pack DIR`, then `npm publish` npm/linux-x64-gnu and .cache/package/ortex (in that order)',
  )
  process.exit(1)
}
else {
  console.error('usage: node scripts/package-manifest.cjs (check PLATFORM | stage FILE)')
  process.exit(2)
}
