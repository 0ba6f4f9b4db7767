#!/usr/bin/env bash
# `npm run demo`: build what is missing, then stream a few concurrent generations.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
exec node dist/cli.js generate --simulated --concurrency 4 --max-tokens 48 \
  --prompt "The engine schedules" --prompt "Paged attention keeps" \
  --prompt "A full-duplex session" --prompt "Continuous batching means" "$@"
