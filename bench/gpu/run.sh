#!/usr/bin/env bash
# The GPU benchmark's entry point (bench/gpu/README.md):
#   on the H200, through the device kit:   bash .device/b/on-device.sh bash bench/gpu/run.sh [options]
#   the CPU dry run, here:                 bash bench/gpu/run.sh --quick --provider cpu [options]
# Options are bench/gpu/main.ts's (--help). This script finds the pieces each side needs and runs
# the bundle bench/out/gpu-bench.mjs (built here with esbuild when missing; the device has no
# esbuild, so pack it: README.md).
#
# cuda: onnxruntime-genai-cuda 0.18 comes as bench/out/genai-cuda.tar.xz (bench/gpu/pack.sh makes it
# from the wheel; it travels in the project) and is unpacked into /tmp/ortex-gpu/site; it loads ONNX Runtime through an importable `onnxruntime`
# package (<package>/capi/libonnxruntime.so*, CUDA provider beside it), so a shim package whose
# capi/ is the device kit's ONNX Runtime 1.31.1 folder (/tmp/ortex-gpu/ort) goes ahead of the
# machine's CPU onnxruntime on that process's PYTHONPATH only.
# cpu: transformers and onnxruntime-genai come from ~/.cache/ortex/venv-builder
# (bench/requirements-builder.txt; the scripts create it on first use, about 6 GB).
set -euo pipefail
cd "$(dirname "$0")/../.."
provider=cuda
for ((i = 1; i <= $#; i++)); do
  [[ ${!i} == --provider ]] && { j=$((i + 1)); provider=${!j}; }
  [[ ${!i} == --provider=* ]] && provider=${!i#--provider=}
done

bundle=bench/out/gpu-bench.mjs
# rebuilt where esbuild is (not on the device) when missing or older than its sources
if [[ -x node_modules/.bin/esbuild ]] &&
  [[ ! -f $bundle || -n ${GPU_BENCH_REBUNDLE:-} || -n $(find bench/gpu bench/throughput ts -name '*.ts' -newer $bundle | head -n 1) ]]; then
  npx esbuild bench/gpu/main.ts --bundle --platform=node --format=esm --external:ortex --external:onnxruntime-node --log-level=warning --outfile=$bundle
fi

extra=()
if [[ $provider == cuda ]]; then
  G=${ORTEX_GPU_DIR:-/tmp/ortex-gpu}
  genai=bench/out/genai-cuda.tar.xz
  if [[ -f $genai && -d $G/ort ]]; then
    [[ -d $G/site/onnxruntime_genai ]] || { mkdir -p "$G/site" && tar -xJf "$genai" -C "$G/site"; }
    mkdir -p "$G/ort-python/onnxruntime"
    echo '__version__ = "1.31.1"  # the device kit'"'"'s ONNX Runtime (CUDA 13), for onnxruntime-genai-cuda' >"$G/ort-python/onnxruntime/__init__.py"
    ln -sfn "$G/ort" "$G/ort-python/onnxruntime/capi"
    export GPU_BENCH_GENAI_PYTHONPATH=$G/site:$G/ort-python
  else
    echo "run.sh: onnxruntime-genai-cuda not set up (needs $genai from bench/gpu/pack.sh and $G/ort from on-device.sh): its rows will say why" >&2
  fi
else
  venv=$HOME/.cache/ortex/venv-builder/bin/python
  if [[ -x $venv ]]; then extra=(--python "$venv"); fi
fi
export PYTHONUNBUFFERED=1
exec node $bundle "${extra[@]}" "$@"
