#!/usr/bin/env bash
# Builds everything: setup, the native addon, the WebAssembly package, then the TypeScript
# (`npm run build:ts` when package.json has it). Incremental: a step whose last build began
# after every change to its inputs is skipped, so a build with nothing changed takes seconds.
#
#   bash scripts/build.sh [native] [wasm] [ts]     (default: all three; ORTEX_FORCE_BUILD=1 rebuilds)
#   bash scripts/build.sh native:linux-arm64-gnu   the addon for another platform, cross-built here
#                                                  (only when asked: never part of the default)
#
# Outputs (the TypeScript facade loads them from the package root):
#   native/ortex.<platform>.node   the Node-API addon: native/ortex.linux-x64-gnu.node on Linux x64
#                                  (native/ortex.linux-arm64-gnu.node: the cross-built one, which
#                                  scripts/package.sh --target linux-arm64-gnu packages)
#   wasm-pkg/ortex_wasm.js         the WebAssembly package's CommonJS entry (+ ortex_wasm_bg.wasm)
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ORTEX_ROOT"

build_native() {
  local addon
  addon="$NATIVE_DIR/ortex.$(native_platform).node"
  # shellcheck disable=SC2046
  if up_to_date native "$addon" $(rust_inputs); then
    log "native: up to date (${addon#"$ORTEX_ROOT"/})"
    return
  fi
  log "native: napi build --release (rustup's cargo) -> ${addon#"$ORTEX_ROOT"/}"
  begin_stamp native
  # The release profile keeps panic=unwind: the addon catches panics and reports them as errors.
  # package.json's "napi" key names the binary (ortex) and the targets (scripts/package.sh puts
  # the addon into npm/<platform>/); --no-js: the facade loads the .node itself.
  node_modules/.bin/napi build --platform --release \
    --manifest-path crates/ortex-napi/Cargo.toml \
    --package-json-path package.json \
    --output-dir native --no-js --dts ortex.d.ts
  [ -f "$addon" ] || die "napi build did not produce $addon"
  commit_stamp native
}

# build_native_cross PLATFORM: the addon for a platform this machine cannot run, with rustup's
# target standard library and a cross linker from Debian (gcc-aarch64-linux-gnu), in cargo's
# per-target folder (target/<triple>/), so the host build is neither rebuilt nor disturbed.
build_native_cross() {
  local platform=$1 triple addon
  triple="$(cross_triple "$platform")" || die "no cross build known for $platform (known: ${!CROSS_TRIPLES[*]})"
  addon="$NATIVE_DIR/ortex.$platform.node"
  # shellcheck disable=SC2046
  if up_to_date "native-$platform" "$addon" $(rust_inputs); then
    log "native ($platform): up to date (${addon#"$ORTEX_ROOT"/})"
    return
  fi
  setup_cross "$triple"
  log "native ($platform): napi build --release --target $triple (linker ${CROSS_LINKERS[$triple]}) -> ${addon#"$ORTEX_ROOT"/}"
  begin_stamp "native-$platform"
  local var
  var="CARGO_TARGET_$(printf '%s' "$triple" | tr 'a-z-' 'A-Z_')_LINKER"
  env "$var=${CROSS_LINKERS[$triple]}" "CC_${triple//-/_}=${CROSS_LINKERS[$triple]}" \
    node_modules/.bin/napi build --platform --release --target "$triple" \
    --manifest-path crates/ortex-napi/Cargo.toml \
    --package-json-path package.json \
    --output-dir native --no-js --dts "ortex.$platform.d.ts"
  rm -f "$NATIVE_DIR/ortex.$platform.d.ts" # the host build's ortex.d.ts is the one the facade checks against
  [ -f "$addon" ] || die "napi build did not produce $addon"
  commit_stamp "native-$platform"
}

build_wasm() {
  local entry="$WASM_PKG_DIR/ortex_wasm.js"
  # shellcheck disable=SC2046
  if up_to_date wasm "$WASM_PKG_DIR/ortex_wasm_bg.wasm" $(rust_inputs); then
    log "wasm: up to date (${entry#"$ORTEX_ROOT"/})"
    return
  fi
  log "wasm: wasm-pack build (Debian's rustc, -Zbuild-std, wasm-ld-19, panic=abort) -> ${entry#"$ORTEX_ROOT"/}"
  begin_stamp wasm
  # Debian's rustc and cargo build this (their std source matches them; rustup has no wasm32
  # target here), in their own target folder; wasm-pack runs `cargo` from PATH, hence /usr/bin
  # first. panic=abort comes from .cargo/config.toml, which RUSTFLAGS would override.
  env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS \
    PATH="/usr/bin:$PATH" RUSTC="$DEBIAN_RUSTC" CARGO="$DEBIAN_CARGO" RUSTC_BOOTSTRAP=1 \
    CARGO_TARGET_DIR="$WASM_TARGET_DIR" \
    wasm-pack build crates/ortex-wasm --mode force --no-opt --release --target nodejs \
    --out-dir "$WASM_PKG_DIR" --out-name ortex_wasm \
    -- -Zbuild-std=std,panic_abort
  [ -f "$entry" ] || die "wasm-pack did not produce $entry"
  # wasm-pack writes a `*` .gitignore there; npm would read it as an ignore list and leave the
  # package out of the tarball (package.json "files" lists wasm-pkg). The root .gitignore
  # already keeps wasm-pkg/ out of git.
  rm -f "$WASM_PKG_DIR/.gitignore"
  commit_stamp wasm
}

build_ts() {
  if [ -z "$(node -p 'require("./package.json").scripts?.["build:ts"] ?? ""')" ]; then
    log "ts: no build:ts script yet, skipped"
    return
  fi
  if up_to_date ts "$ORTEX_ROOT/dist" ts package.json tsconfig.json tsup.config.ts; then
    log "ts: up to date (dist/)"
    return
  fi
  log "ts: npm run build:ts"
  begin_stamp ts
  npm run --silent build:ts
  commit_stamp ts
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(native wasm ts)

bash "$ORTEX_ROOT/scripts/setup.sh" "${steps[@]}"
for step in "${steps[@]}"; do
  case "$step" in
    native) build_native ;;
    native:*) build_native_cross "${step#native:}" ;;
    wasm) build_wasm ;;
    ts) build_ts ;;
    *) die "unknown build step '$step' (native, wasm, ts, native:PLATFORM)" ;;
  esac
done
log "build: done"
