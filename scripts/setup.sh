#!/usr/bin/env bash
# Installs what the build needs, skipping whatever is already present, so a second run takes
# about a second: the npm dependencies; with the step `scale` (`bash scripts/setup.sh scale`, as
# scripts/test-scale.sh runs it), Debian's nginx-light and redis-server for the scale suite
# (about 10 s the first time); and, only when the WebAssembly build is among the steps
# (`bash scripts/setup.sh wasm`, as scripts/build.sh passes its steps), Debian's Rust for
# WebAssembly (rustc-web, cargo-web, rust-web-src, lld-19) and wasm-pack and the wasm-bindgen CLI
# (cargo install, pinned: about 11 minutes on 2 cores the first time). The demo builds only the
# native addon and the TypeScript, so it never waits for the WebAssembly toolchain.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ORTEX_ROOT"

# install_debian_packages WHAT PACKAGE...: apt-get install the PACKAGEs not installed yet.
install_debian_packages() {
  local what=$1 missing=() package
  shift
  for package in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed'; then
      missing+=("$package")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "setup: $what present ($*)"
    return
  fi
  log "setup: apt-get install ${missing[*]}"
  as_root apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

setup_debian_rust() {
  install_debian_packages "Debian Rust for wasm" "${DEBIAN_PACKAGES[@]}"
}

# cargo_install_pinned CRATE VERSION BINARY: `cargo install` unless BINARY reports VERSION.
cargo_install_pinned() {
  local crate=$1 version=$2 binary=$3 installed
  installed="$("$binary" --version 2>/dev/null | awk '{print $2}' || true)"
  if [ "$installed" = "$version" ]; then
    log "setup: $binary $version present"
    return
  fi
  log "setup: cargo install $crate --version =$version (found: ${installed:-none}; takes minutes)"
  # Not --locked: the crates' own lockfiles name a webpki-roots version crates.io no longer has.
  cargo install "$crate" --version "=$version"
}

setup_npm() {
  local stamp=node_modules/.package-lock.json
  if [ -f "$stamp" ] && ! [ package.json -nt "$stamp" ] && ! { [ -f package-lock.json ] && [ package-lock.json -nt "$stamp" ]; }; then
    log "setup: node_modules up to date"
    return
  fi
  log "setup: npm install"
  # node-llama-cpp (a devDependency for bench/llama-cpp) runs on its prebuilt binary; should an npm
  # run its postinstall, it must never download or build llama.cpp.
  NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-audit --no-fund
}

setup_wasm_toolchain() {
  setup_debian_rust
  cargo_install_pinned wasm-pack "$WASM_PACK_VERSION" wasm-pack
  cargo_install_pinned wasm-bindgen-cli "$WASM_BINDGEN_VERSION" wasm-bindgen
}

# Steps: the build steps that will run (native, wasm, ts, native:PLATFORM); none: all of them.
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(native wasm ts)
for step in "${steps[@]}"; do
  if [ "$step" = wasm ]; then setup_wasm_toolchain; fi
  if [ "$step" = scale ]; then install_debian_packages "nginx and redis-server for test:scale" "${SCALE_PACKAGES[@]}"; fi
done
setup_npm
