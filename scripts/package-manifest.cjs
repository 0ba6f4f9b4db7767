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

function check(platform) {
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
