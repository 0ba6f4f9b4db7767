#!/usr/bin/env bash
# Fills the platform package npm/<platform>/ (napi-rs layout: `napi create-npm-dirs` names it
# <packageName>-<platform>, `napi artifacts` puts <binaryName>.<platform>.node in it) with the built
# addon and the CPU ONNX Runtime it loads, stages the root package as published, and optionally
# packs both tarballs.
#
#   bash scripts/package.sh [--no-build] [--target PLATFORM] [--pack DIR]
#                                           (npm run package -- [--target PLATFORM] [--pack DIR])
#
#   --no-build   use what is built (native/, wasm-pkg/, dist/); default: scripts/build.sh first
#   --target PLATFORM
#                the platform package to fill: this machine's (default, linux-x64-gnu here) or
#                linux-arm64-gnu, whose addon scripts/build.sh cross-builds (native:linux-arm64-gnu)
#                only when asked for here; the root package is the same for every platform.
#                linux-x64-gnu-cuda: the CUDA package only (nothing is built, the root is not staged)
#   --pack DIR   then `npm pack` the platform package and the root package into DIR and print the
#                two tarball paths on stdout (platform first); `npm publish` them in that order
#
# What ships where (users install `ortex`: nothing is downloaded but these, no install script runs):
#   ortex                    dist/ (the facade and the CLI), wasm-pkg/ (ortex/wasm), docs/, README,
#                            LICENSE; optionalDependencies: ortex-<platform> at the same version
#   ortex-linux-x64-gnu      ortex.linux-x64-gnu.node, libonnxruntime.so.1 (copied from
#                            onnxruntime-node, MIT: LICENSE-onnxruntime), LICENSE
#   ortex-linux-arm64-gnu    the same for Linux arm64 (onnxruntime-node ships its arm64 library too)
#   ortex-linux-x64-gnu-cuda libonnxruntime.so.1, libonnxruntime_providers_cuda.so and
#                            libonnxruntime_providers_shared.so of onnxruntime-gpu 1.31.1 (CUDA 13,
#                            MIT; scripts/onnxruntime-gpu.sh fetches them), LICENSE: not a
#                            dependency of ortex (about 300 MB): users install it beside ortex for
#                            executionProvider 'cuda' (the facade opens its library then)
# npm/<platform>/'s package.json, README.md and LICENSE-onnxruntime are committed; the copied
# files are git-ignored. The staged root package lives in .cache/package/ortex (git-ignored).
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ORTEX_ROOT"

build=1
pack_dir=""
platform="$(native_platform)"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    --pack)
      [ $# -ge 2 ] || die "--pack needs a folder"
      pack_dir=$2
      shift
      ;;
    --target)
      [ $# -ge 2 ] || die "--target needs a platform (linux-x64-gnu, linux-arm64-gnu, linux-x64-gnu-cuda)"
      platform=$2
      shift
      ;;
    *) die "unknown argument '$1' (--no-build, --target PLATFORM, --pack DIR)" ;;
  esac
  shift
done

# The CUDA package: ONNX Runtime's CUDA build only (the addon stays in ortex-<platform>).
package_cuda() {
  local pkg_dir="$ORTEX_ROOT/npm/$platform" ort_dir file
  node "$ORTEX_ROOT/scripts/package-manifest.cjs" check "$platform" ||
    die "npm/$platform/package.json does not match package.json (see above)"
  ort_dir="$(bash "$ORTEX_ROOT/scripts/onnxruntime-gpu.sh")" || die "cannot fetch onnxruntime-gpu"
  log "package: npm/$platform <- $ort_dir"
  for file in libonnxruntime.so.1 libonnxruntime_providers_cuda.so libonnxruntime_providers_shared.so ThirdPartyNotices.txt; do
    # A hard link where the cache shares the file system: 300 MB not written twice.
    ln -f "$ort_dir/$file" "$pkg_dir/$file" 2>/dev/null || cp -f "$ort_dir/$file" "$pkg_dir/$file"
  done
  cp -f LICENSE "$pkg_dir/LICENSE"
  if [ -n "$pack_dir" ]; then
    mkdir -p "$pack_dir"
    pack_dir="$(cd "$pack_dir" && pwd)"
    file="$(cd "$pkg_dir" && npm pack --ignore-scripts --silent --pack-destination "$pack_dir" | tail -n 1)"
    [ -f "$pack_dir/$file" ] || die "npm pack in $pkg_dir produced no tarball"
    log "package: $pack_dir/$file ($(du -h "$pack_dir/$file" | cut -f1))"
    printf '%s\n' "$pack_dir/$file"
  fi
}
if [ "$platform" = linux-x64-gnu-cuda ]; then
  package_cuda
  exit 0
fi

if [ "$build" = 1 ]; then
  if [ "$platform" = "$(native_platform)" ]; then
    bash scripts/build.sh
  else
    # The host's addon is not packaged then; the facade and the wasm package are the same.
    bash scripts/build.sh "native:$platform" wasm ts
  fi
fi

pkg_dir="$ORTEX_ROOT/npm/$platform"
addon="$NATIVE_DIR/ortex.$platform.node"
[ -f "$pkg_dir/package.json" ] || die "no platform package for $platform (npm/$platform/package.json); ortex ships linux-x64-gnu, linux-arm64-gnu"
if [ "$platform" = "$(native_platform)" ]; then
  [ -f "$addon" ] || die "${addon#"$ORTEX_ROOT"/} is missing: run \`npm run build\` first"
else
  [ -f "$addon" ] || die "${addon#"$ORTEX_ROOT"/} is missing: run \`bash scripts/build.sh native:$platform\` first"
fi
# The addon must be built for the platform it is packaged for (ELF e_machine, at byte 18): a
# host build copied by hand under the arm64 name would install, and fail only when loaded.
case "$platform" in
  linux-x64-gnu) machine="3e 00" ;;
  linux-arm64-gnu) machine="b7 00" ;;
  *) machine="" ;;
esac
found="$(od -An -tx1 -j18 -N2 "$addon" | xargs)"
[ -z "$machine" ] || [ "$found" = "$machine" ] ||
  die "${addon#"$ORTEX_ROOT"/} is not a $platform binary (ELF machine $found, expected $machine)"
for file in dist/index.js dist/index.mjs dist/wasm.js dist/wasm.mjs dist/cli.js wasm-pkg/ortex_wasm.js wasm-pkg/ortex_wasm_bg.wasm; do
  [ -f "$file" ] || die "$file is missing: run \`npm run build\` first"
done

# The committed template must match the root package and napi-rs's naming for this target, and
# neither package may have an install-time script.
node "$ORTEX_ROOT/scripts/package-manifest.cjs" check "$platform" ||
  die "npm/$platform/package.json does not match package.json (see above)"

# ONNX Runtime for the CPU, as onnxruntime-node (a devDependency) ships it for this platform.
ort_root="$(node -p 'require("node:path").dirname(require.resolve("onnxruntime-node/package.json"))')" ||
  die "onnxruntime-node is not installed: run \`npm install\`"
case "$platform" in
  linux-x64-gnu) ort_lib="$ort_root/bin/napi-v6/linux/x64/libonnxruntime.so.1" ;;
  linux-arm64-gnu) ort_lib="$ort_root/bin/napi-v6/linux/arm64/libonnxruntime.so.1" ;;
  *) die "no ONNX Runtime library known for $platform" ;;
esac
[ -f "$ort_lib" ] || die "$ort_lib is missing"

log "package: npm/$platform <- ${addon#"$ORTEX_ROOT"/}, libonnxruntime.so.1 of onnxruntime-node $(node -p 'require("onnxruntime-node/package.json").version')"
cp -f "$addon" "$pkg_dir/ortex.$platform.node"
cp -f "$ort_lib" "$pkg_dir/libonnxruntime.so.1"
cp -f LICENSE "$pkg_dir/LICENSE"

# The root package as published: what "files" lists, and a package.json that lists the platform
# package of every napi target in optionalDependencies at the root's version. Like
# `napi pre-publish`, this happens at release time only: in the repository an optionalDependency
# that is not published yet breaks `npm ci` ("Missing: ortex-linux-x64-gnu@ from lock file") and
# makes every `npm install` ask the registry for it.
stage="$ORTEX_ROOT/.cache/package/ortex"
rm -rf "$stage"
mkdir -p "$stage"
cp -a dist wasm-pkg docs README.md LICENSE "$stage/"
node "$ORTEX_ROOT/scripts/package-manifest.cjs" stage "$stage/package.json"
log "package: .cache/package/ortex (optionalDependencies: $(node -p "JSON.stringify(require('$stage/package.json').optionalDependencies)"))"

if [ -n "$pack_dir" ]; then
  mkdir -p "$pack_dir"
  pack_dir="$(cd "$pack_dir" && pwd)"
  # --ignore-scripts: neither package has pack-time scripts; this keeps it so.
  for dir in "$pkg_dir" "$stage"; do
    file="$(cd "$dir" && npm pack --ignore-scripts --silent --pack-destination "$pack_dir" | tail -n 1)"
    [ -f "$pack_dir/$file" ] || die "npm pack in $dir produced no tarball"
    log "package: $pack_dir/$file ($(du -h "$pack_dir/$file" | cut -f1))"
    printf '%s\n' "$pack_dir/$file"
  done
fi
