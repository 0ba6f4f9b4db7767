#!/usr/bin/env bash
# `npm run demo`: build what is missing, make the tiny random-weight model under .cache/models/tiny
# if it is absent (a second, deterministic), then stream several concurrent generations from it
# with per-request and total tokens per second. Extra arguments go to `ortex generate`
# (`npm run demo -- --max-tokens 200`, `--model DIR` for another folder, `--simulated`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
MODEL_DIR=.cache/models/tiny
if [ ! -f "$MODEL_DIR/genai_config.json" ]; then
  node dist/cli.js make-model --out "$MODEL_DIR" --size tiny --attention gqa --seed 0 >&2
fi
model=(--model "$MODEL_DIR")
for arg in "$@"; do
  case "$arg" in --model | --model=* | --simulated) model=() ;; esac
done
exec node dist/cli.js generate "${model[@]}" --concurrency 6 --max-tokens 48 \
  --prompt "The river starts as a thin line of water" --prompt "In the morning the air is" \
  --prompt "Once upon a time" --prompt "The old road to the village" "$@"
