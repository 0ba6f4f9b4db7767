# Shared helpers for scripts/*.sh; source it: . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck shell=bash

set -euo pipefail

ORTEX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Tool versions. The wasm-bindgen CLI must equal the `wasm-bindgen` crate pinned in
# crates/ortex-wasm/Cargo.toml, or wasm-pack refuses to use it.
WASM_PACK_VERSION=0.15.1
WASM_BINDGEN_VERSION=0.2.130
# Debian's Rust with its library source (for -Zbuild-std) and the wasm linker.
DEBIAN_PACKAGES=(rustc-web cargo-web rust-web-src lld-19)
DEBIAN_RUSTC=/usr/bin/rustc
DEBIAN_CARGO=/usr/bin/cargo
# The real load balancer and session store of the scale suite (npm run test:scale).
SCALE_PACKAGES=(nginx-light redis-server)

# Cross builds of the addon (scripts/build.sh native:PLATFORM): napi-rs's platform name -> Rust
# target, and the target's linker (Debian's cross gcc, package CROSS_PACKAGES[triple]).
declare -A CROSS_TRIPLES=([linux-arm64-gnu]=aarch64-unknown-linux-gnu)
declare -A CROSS_LINKERS=([aarch64-unknown-linux-gnu]=aarch64-linux-gnu-gcc)
declare -A CROSS_PACKAGES=([aarch64-unknown-linux-gnu]=gcc-aarch64-linux-gnu)

# Output locations (the TypeScript facade loads these).
NATIVE_DIR="$ORTEX_ROOT/native"       # native/ortex.<platform>.node, e.g. ortex.linux-x64-gnu.node
WASM_PKG_DIR="$ORTEX_ROOT/wasm-pkg"   # wasm-pkg/ortex_wasm.js (CommonJS) + ortex_wasm_bg.wasm
WASM_TARGET_DIR="$ORTEX_ROOT/target-wasm"
# Build stamps (.cache/ is git-ignored): one per build step, dated when that step's build began.
STAMP_DIR="$ORTEX_ROOT/.cache/build"

# rustup's cargo (the native addon, the tests) and the CLIs `cargo install` puts there come first.
if [ -d "$HOME/.cargo/bin" ]; then
  PATH="$HOME/.cargo/bin:$PATH"
fi
export PATH

log() { printf '[ortex] %s\n' "$*" >&2; }

die() {
  log "error: $*"
  exit 1
}

# Runs a command as root: directly when root, through sudo otherwise.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# is_fresh OUTPUT INPUT...: true when OUTPUT exists and no file or folder under the INPUTs is
# newer than it (a folder's time changes when an entry is added or removed).
is_fresh() {
  local output=$1
  shift
  [ -e "$output" ] || return 1
  [ -z "$(find "$@" -newer "$output" -not -path '*/node_modules/*' -print -quit 2>/dev/null)" ]
}

# up_to_date STEP ARTIFACT INPUT...: the step's last successful build began after every change
# to its INPUTs and its ARTIFACT is still there (ORTEX_FORCE_BUILD=1: never up to date).
up_to_date() {
  local step=$1 artifact=$2
  shift 2
  [ "${ORTEX_FORCE_BUILD:-0}" != 1 ] && [ -e "$artifact" ] && is_fresh "$STAMP_DIR/$step.stamp" "$@"
}

# begin_stamp STEP / commit_stamp STEP: bracket a build, so that the stamp carries the time the
# build began; a file edited while it ran is newer than the stamp and triggers the next build.
begin_stamp() {
  mkdir -p "$STAMP_DIR"
  touch "$STAMP_DIR/$1.stamp.new"
}

commit_stamp() {
  mv -f "$STAMP_DIR/$1.stamp.new" "$STAMP_DIR/$1.stamp"
}

# Everything a Rust build reads.
rust_inputs() {
  printf '%s\n' "$ORTEX_ROOT/crates" "$ORTEX_ROOT/Cargo.toml" "$ORTEX_ROOT/Cargo.lock" "$ORTEX_ROOT/.cargo"
}

cross_triple() {
  [ -n "${CROSS_TRIPLES[$1]:-}" ] || return 1
  printf '%s\n' "${CROSS_TRIPLES[$1]}"
}

# setup_cross TRIPLE: rustup's standard library for TRIPLE and Debian's cross linker, each only
# when missing (a second run checks and returns in well under a second).
setup_cross() {
  local triple=$1 package=${CROSS_PACKAGES[$1]}
  if ! rustup target list --installed | grep -qx "$triple"; then
    log "setup: rustup target add $triple"
    rustup target add "$triple"
  fi
  if ! command -v "${CROSS_LINKERS[$triple]}" >/dev/null; then
    log "setup: apt-get install $package"
    as_root apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "$package"
  fi
}

# The platform suffix @napi-rs/cli gives the addon on this machine (linux-x64-gnu here).
native_platform() {
  node -e '
    const { platform, arch } = process
    let abi = ""
    if (platform === "linux") abi = process.report.getReport().header.glibcVersionRuntime ? "-gnu" : "-musl"
    else if (platform === "win32") abi = "-msvc"
    process.stdout.write(`${platform}-${arch}${abi}`)'
}
