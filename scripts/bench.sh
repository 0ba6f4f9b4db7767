#!/usr/bin/env bash
# `npm run bench`: every benchmark; each prints a table and writes a JSON report to bench/out/.
# The numbers and the commands behind them are recorded in docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
mkdir -p bench/out
echo "== engine overhead (ortex-core, simulated model at zero cost)"
cargo bench -p ortex-core --bench engine_overhead
echo "== facade events per second"
npx esbuild bench/facade-events.ts --platform=node --format=esm --log-level=warning \
  --outfile=bench/out/facade-events.mjs
node bench/out/facade-events.mjs "$@"
