#!/usr/bin/env bash
# `npm test`: builds everything (scripts/build.sh installs the toolchains idempotently and builds
# the addon, the wasm package and the TypeScript facade), then runs the Rust tests and the vitest
# suites. Every stage runs even when an earlier test stage fails, so one run reports everything;
# the exit status is non-zero when anything failed. A failed build stops at once.
set -uo pipefail
cd "$(dirname "$0")/.."

declare -a names=() results=()
status=0

stage() {
  local name=$1
  shift
  echo
  echo "==> ${name}: $*"
  local start=$SECONDS
  "$@"
  local rc=$?
  local took=$((SECONDS - start))
  names+=("${name}")
  if [ "${rc}" -eq 0 ]; then
    results+=("ok (${took}s)")
  else
    results+=("FAILED with exit ${rc} (${took}s)")
    status=1
  fi
  return "${rc}"
}

summary() {
  echo
  echo "==> summary"
  for i in "${!names[@]}"; do
    printf '    %-12s %s\n' "${names[$i]}" "${results[$i]}"
  done
}

if ! stage build bash scripts/build.sh; then
  summary
  echo "build failed: not running the tests" >&2
  exit 1
fi

# The core's and the bindings' Rust tests; --no-fail-fast runs every test binary and reports all.
stage cargo cargo test --workspace --release --no-fail-fast

# The suites and the benchmark type-check against the built package's declarations (what users get).
stage types npx tsc -p test

# All vitest suites: contract and bad input on both backends, the seeded simulation, cross-target
# determinism. The workers get --expose-gc from vitest.config.ts.
stage vitest npx vitest run

# Past one process: real redis-server and nginx (installed here when missing) in front of three
# `ortex serve` processes (docs/scaling.md), and the seeded chaos test of failover. About 25 s, plus
# about 10 s once per machine to install.
stage scale bash scripts/test-scale.sh --no-build

summary
exit "${status}"
