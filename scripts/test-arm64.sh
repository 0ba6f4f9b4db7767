#!/usr/bin/env bash
# The linux-arm64-gnu packages, installed and used the way a user on an ARM server would, on this
# x64 machine: an arm64 Debian root file system (debootstrap, Debian's arm64 nodejs and npm) run
# under qemu-user emulation (binfmt_misc), with no Rust and no compiler in it.
#
#   bash scripts/test-arm64.sh      (npm run test:arm64; slow, so neither npm test nor CI runs it)
#
# 1. builds: the host addon (the x64 reference), the cross-built arm64 addon, wasm and the facade,
#    then packs ortex-linux-arm64-gnu and ortex (scripts/package.sh --target linux-arm64-gnu);
# 2. makes the root file system once (Debian trixie: nodejs 20.19, which satisfies engines
#    >=20.17; bookworm's is 18) and caches it, with the downloads, under
#    ${XDG_CACHE_HOME:-~/.cache}/ortex/arm64 (ORTEX_ARM64_CACHE overrides): later runs reuse it;
# 3. in a fresh project inside it, as root of the chroot with a PATH whose cargo, rustc, cc, gcc
#    and wasm-pack record any call and fail: `npm install --offline` of the two tarballs (and ws,
#    the root's one dependency, packed from the host's npm cache), no install script run; ESM and
#    CommonJS imports of ortex and ortex/wasm with a simulated generation; `npx ortex make-model`,
#    compared byte for byte with the x64 build's, and `npx ortex generate --model` on it; greedy
#    tokens from the x64 build's folder, compared with the x64 build's for that folder.
# Runs as root (debootstrap, chroot, mount); installs Debian's qemu-user-static and debootstrap when
# missing. Prints how long each emulated step took.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ORTEX_ROOT"

PLATFORM=linux-arm64-gnu
SUITE=trixie
MIRROR="${ORTEX_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${ORTEX_ARM64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ortex/arm64}"
ROOTFS="$CACHE/rootfs-$SUITE"
# Inside the root file system: the user's project, made afresh each run.
GUEST_WORK=/tmp/ortex-arm64
WORK="$ROOTFS$GUEST_WORK"
FAKE_TOOLS=(cargo rustc rustup cc gcc c++ g++ make wasm-pack node-gyp)

started=$SECONDS
elapsed() { printf '%ss' "$((SECONDS - started))"; }
step() { log "arm64 [$(elapsed)]: $*"; }
fail() { die "arm64: $*"; }

[ "$(uname -m)" = x86_64 ] || fail "this script cross-builds on x64 and emulates arm64; on an arm64 machine run npm test"
[ "$(id -u)" -eq 0 ] || fail "run it as root: debootstrap, chroot and mount need it"

setup_host_tools() {
  local missing=() package
  for package in qemu-user-static debootstrap; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return
  step "apt-get install ${missing[*]}"
  apt-get update
  env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
}

# binfmt_misc runs arm64 ELF files through qemu-aarch64-static. The F flag (Debian's entry has it)
# opens the interpreter when it is registered, so it works inside the chroot without a copy there.
setup_binfmt() {
  local dir=/proc/sys/fs/binfmt_misc
  if [ ! -e "$dir/register" ]; then
    step "mount binfmt_misc"
    mount -t binfmt_misc binfmt_misc "$dir" ||
      fail "binfmt_misc is not mounted and cannot be (a container without it cannot run arm64 binaries)"
  fi
  if [ ! -e "$dir/qemu-aarch64" ]; then
    step "register qemu-aarch64 with binfmt_misc (/usr/lib/binfmt.d/qemu-aarch64.conf)"
    sh -c "cat /usr/lib/binfmt.d/qemu-aarch64.conf > $dir/register" || fail "cannot register qemu-aarch64"
  fi
  grep -q '^enabled' "$dir/qemu-aarch64" || fail "$dir/qemu-aarch64 is disabled"
}

# The root file system, made once: debootstrap into a .partial folder, renamed when complete, so
# an interrupted run starts it again instead of using half of one.
setup_rootfs() {
  if [ -f "$ROOTFS/.ortex-ready" ]; then
    step "root file system cached: $ROOTFS ($(cat "$ROOTFS/.ortex-ready"))"
    return
  fi
  local partial="$ROOTFS.partial" begun=$SECONDS
  # Never remove a folder with something mounted inside (a bound /dev would go with it).
  ! grep -q " $partial/" /proc/mounts || fail "$partial has mounts inside: umount them first"
  rm -rf "$partial"
  mkdir -p "$CACHE/debs"
  step "debootstrap $SUITE arm64 (minbase) into $partial: downloads, then unpacks and configures under emulation (minutes)"
  # --cache-dir keeps the .deb files, so a remade root file system downloads nothing.
  background "$CACHE/debootstrap.log" debootstrap --arch=arm64 --variant=minbase --cache-dir="$CACHE/debs" \
    "$SUITE" "$partial" "$MIRROR" || fail "debootstrap failed: see $CACHE/debootstrap.log"
  # nodejs and npm with apt inside it: debootstrap's own resolver cannot install npm (--include=npm
  # leaves npm's dependencies node-cssesc, node-color-support, ... out and fails configuring it).
  step "apt-get install nodejs npm inside the root file system (under emulation, minutes)"
  mkdir -p "$partial/var/cache/apt/archives"
  mount --bind "$CACHE/debs" "$partial/var/cache/apt/archives"
  mount -t proc proc "$partial/proc"
  local rc=0
  background "$CACHE/apt.log" chroot "$partial" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    DEBIAN_FRONTEND=noninteractive /bin/sh -c \
    'apt-get update -q && apt-get install -y -q --no-install-recommends nodejs npm' || rc=$?
  umount "$partial/proc" "$partial/var/cache/apt/archives"
  [ "$rc" -eq 0 ] || fail "apt-get install nodejs npm failed: see $CACHE/apt.log"
  local version
  version="$(chroot "$partial" /usr/bin/node --version)" || fail "Debian's arm64 node does not run under qemu"
  node -e 'const [a, b] = process.argv[1].slice(1).split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 17) ? 0 : 1)' "$version" ||
    fail "Debian $SUITE's nodejs is $version; ortex needs >= 20.17"
  printf 'Debian %s arm64, node %s, npm %s, made in %ss\n' "$SUITE" "$version" \
    "$(chroot "$partial" /usr/bin/npm --version)" "$((SECONDS - begun))" | tee "$partial/.ortex-ready" >/dev/null
  mv "$partial" "$ROOTFS"
  step "root file system ready: $(cat "$ROOTFS/.ortex-ready")"
}

# background LOG COMMAND...: runs a long COMMAND with its output in LOG, printing LOG's last line
# every 20 s; returns COMMAND's status.
background() {
  local log_file=$1 pid rc=0
  shift
  "$@" >"$log_file" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 20
    step "${1##*/}: $(grep -v '^ *$' "$log_file" | tail -n 1 | cut -c1-100)"
  done
  wait "$pid" || rc=$?
  return "$rc"
}

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT

# /proc (node's process.report, /proc/self/maps) and /dev. Not /sys: there it describes the x64
# host's processors, and ONNX Runtime's arm64 cpuinfo, reading those beside qemu's /proc/cpuinfo,
# crashes (SIGSEGV) loading a model; without /sys it prints "Error in cpuinfo: failed to parse
# the list of possible processors" and runs with its defaults. A real arm64 machine has neither
# problem.
mount_guest() {
  local what
  for what in proc dev; do
    if ! mountpoint -q "$ROOTFS/$what"; then
      case "$what" in
        proc) mount -t proc proc "$ROOTFS/proc" ;;
        *) mount --rbind "/$what" "$ROOTFS/$what" ;;
      esac
      mounted+=("$ROOTFS/$what")
    fi
  done
}

# guest COMMAND...: runs in the project folder inside the root file system under a user's
# environment: nothing of this shell's, the recording tools first on PATH, offline npm.
guest() {
  chroot "$ROOTFS" /usr/bin/env -i \
    HOME="$GUEST_WORK/home" PATH="$GUEST_WORK/fake-bin:/usr/local/bin:/usr/bin:/bin" LANG=C.UTF-8 \
    npm_config_update_notifier=false npm_config_fund=false npm_config_audit=false \
    /bin/sh -c 'cd "$0/user-project" && exec "$@"' "$GUEST_WORK" "$@"
}

# timed LABEL COMMAND...: runs COMMAND, logging its duration (call it without $(...), which would
# lose the duration in a subshell; redirect its output instead).
declare -A durations=()
timed() {
  local label=$1 begun=$SECONDS
  shift
  "$@"
  durations[$label]=$((SECONDS - begun))
  step "$label: ${durations[$label]}s"
}

json() { node -e "$1" "${@:2}"; }

# ---------------------------------------------------------------------------------------------
setup_host_tools
setup_binfmt

step "build: the x64 addon (reference), the $PLATFORM addon (cross), wasm, the facade"
nice -n 10 bash scripts/build.sh native
nice -n 10 bash scripts/build.sh "native:$PLATFORM" wasm ts

setup_rootfs
mount_guest

step "fresh project in $WORK"
rm -rf "$WORK"
mkdir -p "$WORK/tarballs" "$WORK/fake-bin" "$WORK/home" "$WORK/user-project"
mapfile -t tarballs < <(bash scripts/package.sh --no-build --target "$PLATFORM" --pack "$WORK/tarballs")
[ ${#tarballs[@]} -eq 2 ] || fail "scripts/package.sh --pack printed ${#tarballs[@]} tarballs, expected 2"
# The root's runtime dependencies, packed from the host's npm cache (the repository's npm install
# put them there), so that the emulated install runs offline.
mapfile -t deps < <(tar xzf "${tarballs[1]}" -O package/package.json |
  node -e 'const p = JSON.parse(require("fs").readFileSync(0, "utf8")); for (const [n, v] of Object.entries(p.dependencies ?? {})) console.log(`${n}@${v}`)')
for dep in "${deps[@]}"; do
  tarballs+=("$WORK/tarballs/$(cd "$WORK/tarballs" && npm pack --prefer-offline --silent "$dep" | tail -n 1)")
done
guest_tarballs=()
for file in "${tarballs[@]}"; do
  step "tarball: ${file#"$ROOTFS"} ($(du -h "$file" | cut -f1))"
  guest_tarballs+=("${file#"$ROOTFS"}")
done
for tool in "${FAKE_TOOLS[@]}" script-shell; do
  printf '#!/bin/sh\necho "%s $*" >> %s/calls.log\necho "%s: called during a user'"'"'s install" >&2\nexit 1\n' \
    "$tool" "$GUEST_WORK" "$tool" >"$WORK/fake-bin/$tool"
  chmod 755 "$WORK/fake-bin/$tool"
done
cp test/arm64/report.cjs test/arm64/imports.mjs test/arm64/imports.cjs test/arm64/greedy.mjs "$WORK/user-project/"
printf '{ "name": "user-project", "version": "1.0.0", "private": true }\n' >"$WORK/user-project/package.json"

# The x64 side, on the host from the repository's build: the model folder both sides use, and
# the reference outputs.
step "x64: make-model and greedy tokens with the repository's build"
node dist/cli.js make-model --out "$WORK/tiny-x64" >/dev/null
x64_greedy="$(cd test/arm64 && node greedy.mjs "$WORK/tiny-x64")"
x64_sim="$(cd test/arm64 && node imports.mjs)"

emulated_begun=$SECONDS
step "arm64: no compiler in the root file system"
present="$(guest /bin/sh -c 'for t in cargo rustc cc gcc c++ g++ clang make; do for d in /usr/local/bin /usr/bin /bin; do [ -e "$d/$t" ] && echo "$d/$t"; done; done; true')"
[ -z "$present" ] || fail "the root file system has a toolchain: $present"
guest node --version >/dev/null

step "arm64: npm install --offline ${guest_tarballs[*]##*/}"
timed install guest npm install --offline --no-audit --no-fund --script-shell="$GUEST_WORK/fake-bin/script-shell" "${guest_tarballs[@]}" >&2
installed="$(cd "$WORK/user-project/node_modules" && ls)"
[ "$installed" = "$(printf '%s\n' ortex "ortex-$PLATFORM" ws)" ] || fail "installed: $(echo "$installed" | tr '\n' ' ') (expected ortex, ortex-$PLATFORM, ws)"
[ ! -e "$WORK/calls.log" ] || fail "the install called: $(cat "$WORK/calls.log")"
for file in "ortex.$PLATFORM.node" libonnxruntime.so.1 LICENSE LICENSE-onnxruntime; do
  [ -f "$WORK/user-project/node_modules/ortex-$PLATFORM/$file" ] || fail "ortex-$PLATFORM has no $file"
done

addon="$GUEST_WORK/user-project/node_modules/ortex-$PLATFORM/ortex.$PLATFORM.node"
for script in imports.mjs imports.cjs; do
  step "arm64: node $script (ortex and ortex/wasm, simulated)"
  timed "$script" guest node "$script" >"$WORK/$script.json"
  report="$(cat "$WORK/$script.json")"
  printf '%s\n' "$report" >&2
  json '
    const [r, x64, addon] = process.argv.slice(1).map((a, i) => (i < 2 ? JSON.parse(a) : a))
    const problems = []
    if (r.arch !== "arm64") problems.push(`arch ${r.arch}`)
    for (const label of ["native", "wasm"]) {
      const e = r[label]
      if (e.backend !== label || e.finishReason !== "max-generated-tokens" || e.generated !== 12 || !e.same || !e.sharedError)
        problems.push(`${label}: ${JSON.stringify(e)}`)
    }
    if (JSON.stringify(r.wasm.tokens) !== JSON.stringify(r.native.tokens)) problems.push("wasm tokens differ from native")
    if (JSON.stringify(r.native.tokens) !== JSON.stringify(x64.native.tokens)) problems.push("simulated tokens differ from x64")
    if (r.addon !== addon) problems.push(`addon ${r.addon}, expected ${addon}`)
    if (problems.length) { console.error(problems.join("\n")); process.exit(1) }' "$report" "$x64_sim" "$addon" ||
    fail "node $script"
done

step "arm64: npx ortex make-model (compared with the x64 build's, byte for byte)"
timed make-model guest npx ortex make-model --out "$GUEST_WORK/tiny-arm64" >&2
for file in genai_config.json model.onnx model.onnx.data tokenizer.json; do
  cmp "$WORK/tiny-arm64/$file" "$WORK/tiny-x64/$file" || fail "make-model on arm64 wrote another $file than on x64"
done

step "arm64: npx ortex generate --model (the command line, on the folder it made)"
timed generate guest npx ortex generate --model "$GUEST_WORK/tiny-arm64" --max-tokens 8 >"$WORK/generate.txt"
cat "$WORK/generate.txt" >&2
grep -Eq '^total: [1-8] tokens from 1 requests in [0-9.]+ ms: [0-9.]+ tok/s \(native\)$' "$WORK/generate.txt" ||
  fail "npx ortex generate printed no native total line"

step "arm64: greedy tokens from the x64 build's folder"
timed greedy guest node greedy.mjs "$GUEST_WORK/tiny-x64" >"$WORK/greedy.json"
arm64_greedy="$(cat "$WORK/greedy.json")"
[ ! -e "$WORK/calls.log" ] || fail "a toolchain was called: $(cat "$WORK/calls.log")"
emulated=$((SECONDS - emulated_begun))

printf 'x64:   %s\narm64: %s\n' "$x64_greedy" "$arm64_greedy" >&2
json '
  const [x64, arm64, ort] = process.argv.slice(1).map((a, i) => (i < 2 ? JSON.parse(a) : a))
  const problems = []
  if (arm64.arch !== "arm64" || x64.arch !== "x64") problems.push(`arch: x64 side ${x64.arch}, arm64 side ${arm64.arch}`)
  if (arm64.ort !== ort) problems.push(`ONNX Runtime ${arm64.ort}, expected ${ort}`)
  if (arm64.generated !== 24) problems.push(`arm64 generated ${arm64.generated} tokens`)
  if (JSON.stringify(arm64.tokens) !== JSON.stringify(x64.tokens)) problems.push("the greedy tokens differ")
  if (problems.length) { console.error(problems.join("\n")); process.exit(1) }
  console.log(`greedy tokens equal (${x64.tokens.length}): ${JSON.stringify(x64.tokens)}`)' \
  "$x64_greedy" "$arm64_greedy" "$GUEST_WORK/user-project/node_modules/ortex-$PLATFORM/libonnxruntime.so.1" ||
  fail "greedy tokens on arm64 differ from x64's"

summary=""
for label in install imports.mjs imports.cjs make-model generate greedy; do summary+=", $label ${durations[$label]:-?}s"; done
step "passed: emulated part ${emulated}s (${summary#, }), whole run $(elapsed); $(cat "$ROOTFS/.ortex-ready")"
