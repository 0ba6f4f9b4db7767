#!/usr/bin/env bash
# Packs the GPU benchmark for the H200 machine (bench/gpu/README.md): the bundle
# (bench/out/gpu-bench.mjs), onnxruntime-genai-cuda 0.18 as a compressed package
# (bench/out/genai-cuda.tar.xz), then the device kit's pack.sh with the benchmark's files as extra
# paths; prints what each of the two runs will carry against the 64 MiB a transfer may hold.
# usage (in the project's root, after `npm run build`): bash bench/gpu/pack.sh [EXTRA_PATH...]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
kit=${DEVICE_KIT:-../shared/tools/device-kit}
genai_version=0.18.0
mkdir -p bench/out

rm -rf bench/gpu/__pycache__  # the kit tars bench/gpu as it is
npx esbuild bench/gpu/main.ts --bundle --platform=node --format=esm --external:ortex --external:onnxruntime-node \
  --log-level=warning --outfile=bench/out/gpu-bench.mjs

# The wheel is 17 MB (zip); its libraries, xz-compressed without the model builder's Python files
# and the license notices, are 12 MB: enough room beside .device/b in the second transfer.
if [[ ! -f bench/out/genai-cuda.tar.xz ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" "onnxruntime-genai-cuda==$genai_version"
  (cd "$tmp" && unzip -q -o ./*.whl 'onnxruntime_genai/*' -x 'onnxruntime_genai/models/*' 'onnxruntime_genai/ThirdPartyNotices.txt')
  tar -C "$tmp" -cJf bench/out/genai-cuda.tar.xz.part onnxruntime_genai && mv bench/out/genai-cuda.tar.xz.part bench/out/genai-cuda.tar.xz
  rm -rf "$tmp"
fi

bash "$kit/pack.sh" bench/gpu bench/genai_throughput.py bench/genai_venv.py bench/out/gpu-bench.mjs bench/out/genai-cuda.tar.xz "$@"

tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -n 1 | cut -f1)
for part in a b; do
  bytes=$(du -cb .device/$part | tail -n 1 | cut -f1)
  total=$((bytes + tracked + ${untracked:-0}))
  verdict=$([[ $total -lt $((62 * 1024 * 1024)) ]] && echo ok || echo 'TOO CLOSE to 64 MiB: carry less')
  printf 'gpu-bench pack: run carrying .device/%s: %.1f MiB (with the working tree) %s\n' $part "$(echo "$total / 1048576" | bc -l)" "$verdict" >&2
done
