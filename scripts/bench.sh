#!/usr/bin/env bash
# `npm run bench`: every benchmark; each prints a table and writes a JSON report to bench/out/.
# The numbers and the commands behind them are recorded in docs/performance.md. Pass --quick for a
# short run of the facade and throughput benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
mkdir -p bench/out
esbuild() { npx esbuild "$1" --bundle --platform=node --format=esm --log-level=warning \
  --external:ortex --external:onnxruntime-node --outfile="$2" "${@:3}"; }
echo "== engine overhead (ortex-core, simulated model at zero cost)"
cargo bench -p ortex-core --bench engine_overhead
echo "== facade events per second"
esbuild bench/facade-events.ts bench/out/facade-events.mjs && node bench/out/facade-events.mjs "$@"
echo "== text-streamed turns and the OpenAI server at concurrency 64 (simulated model)"
esbuild bench/turn-stream.ts bench/out/turn-stream.mjs && node bench/out/turn-stream.mjs
echo "== prefix caching under KV pressure (simulated model, cache on vs off)"
esbuild bench/prefix-cache/pressure.ts bench/out/prefix-cache-pressure.mjs && node bench/out/prefix-cache-pressure.mjs
echo "== full-duplex latency"
esbuild bench/duplex-latency.ts bench/out/duplex-latency.mjs && node bench/out/duplex-latency.mjs
echo "== throughput on a real model (ortex vs naive onnxruntime-node loop vs onnxruntime-genai)"
esbuild bench/throughput/main.ts bench/out/throughput.mjs && node bench/out/throughput.mjs "$@"
echo "== prefix caching on a real model (cache on vs off vs onnxruntime-genai)"
esbuild bench/prefix-cache/main.ts bench/out/prefix-cache.mjs && node bench/out/prefix-cache.mjs "$@"
echo "== ortex against llama.cpp (node-llama-cpp) on the same GGUF files"
esbuild bench/llama-cpp/main.ts bench/out/llama-cpp.mjs --external:node-llama-cpp --external:yauzl \
  && node bench/out/llama-cpp.mjs "$@"
echo "== a GGUF file's import (1 and 2 workers) and first load against llama.cpp's load"
esbuild bench/gguf-import/main.ts bench/out/gguf-import.mjs --external:node-llama-cpp --external:yauzl \
  && node bench/out/gguf-import.mjs
echo "== faithfulness: KL divergence against the float32 import, ortex's imports and llama.cpp"
esbuild bench/quality/main.ts bench/out/quality.mjs --external:node-llama-cpp --external:yauzl \
  && node bench/out/quality.mjs
echo "== failover: a duplex session resumed on its process vs taken over by another (Redis store)"
bash scripts/setup.sh scale >&2
esbuild bench/failover.ts bench/out/failover.mjs --external:ws && node bench/out/failover.mjs
