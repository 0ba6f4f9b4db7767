#!/usr/bin/env bash
# The GPU benchmark's CPU check, all three systems (outside `npm test`: it needs torch, transformers
# and onnxruntime-genai, from ~/.cache/ortex/venv-builder, which the scripts create on first use,
# about 6 GB). About 30 s once the venv is there. Run after `npm run build`:
#   bash bench/gpu/test-cpu.sh
# 1. the converter: transformers' logits on the tiny model's weights equal ONNX Runtime's on its folder
#    (bench/gpu/check_hf.py), on a float32 and a float16-KV folder;
# 2. `run.sh --quick --provider cpu --block-sizes 16,32` on the tiny model: every system at every
#    concurrency has numbers, every system's greedy tokens equal ortex's, the teacher-forced
#    agreement (both sides the CPU here) is 100%, both block sizes have numbers, every goal has a value.
# test/bench-gpu.test.ts (npm test) covers the report's arithmetic and ortex's side alone.
set -uo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
check() {
  local name=$1
  shift
  if "$@"; then passed=$((passed + 1)); echo "ok: $name"; else failed=$((failed + 1)); echo "FAILED: $name"; fi
}

node dist/cli.js make-model --out "$tmp/tiny" --size tiny >/dev/null
node dist/cli.js make-model --out "$tmp/tiny-fp16kv" --size tiny --kv fp16 >/dev/null
check 'converter, float32 folder' python3 bench/gpu/check_hf.py "$tmp/tiny"
check 'converter, float16-KV folder' python3 bench/gpu/check_hf.py "$tmp/tiny-fp16kv" --tolerance 2e-2

bash bench/gpu/run.sh --quick --provider cpu --size tiny --block-sizes 16,32 --out "$tmp/out" --models "$tmp/models" >"$tmp/stdout" 2>"$tmp/stderr"
check 'run.sh --quick --provider cpu exits 0' test $? -eq 0 || tail -20 "$tmp/stderr"
check 'the report says it is a CPU dry run' grep -q 'CPU DRY RUN' "$tmp/stdout"
check 'every system, every concurrency, greedy tokens equal, teacher-forced 100%, block sizes, every goal valued' node -e '
  const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"))
  const problems = []
  for (const system of ["ortex", "transformers", "genai"])
    for (const c of r.workload.concurrencies) {
      const row = r.rows.find((x) => x.system === system && x.concurrency === c)
      if (!row || row.error || !(row.tokensPerSecond > 0)) problems.push(`${system} c${c}: ${row ? row.error ?? "no rate" : "no row"}`)
    }
  if (r.agreement.length !== 2) problems.push(`agreement for ${r.agreement.length} systems`)
  for (const a of r.agreement) if (a.same !== a.of || a.of !== r.workload.generatedTokens) problems.push(`${a.system}: ${a.same} of ${a.of} tokens equal`)
  const tf = r.correctness[0]
  if (!tf || tf.error || tf.positions === 0 || tf.matches !== tf.positions) problems.push(`teacher-forced: ${tf ? tf.error ?? `${tf.matches} of ${tf.positions}` : "no entry"}`)
  for (const b of [16, 32])
    for (const c of [1, 64])
      if (!(r.blockSizes.find((x) => x.blockSize === b && x.concurrency === c)?.tokensPerSecond > 0)) problems.push(`block size ${b} c${c}: no rate`)
  for (const g of r.goals) if (g.value === null) problems.push(`goal ${g.name}: no value`)
  if (problems.length) { console.error(problems.join("\n")); process.exit(1) }
' "$tmp/out/gpu-bench.json"

echo "gpu-bench cpu: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
