#!/usr/bin/env bash
# ONNX Runtime's CUDA 13 build for Linux x64, as the PyPI wheel onnxruntime-gpu ships it (MIT),
# fetched with pip once into a cache outside the checkout and reused by every later call:
#
#   ${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ortex}/onnxruntime-gpu-1.31.1-l2/
#     libonnxruntime.so.1                  (the wheel's libonnxruntime.so.1.31.1; its SONAME)
#     libonnxruntime_providers_cuda.so     (the CUDA provider, all GPU architectures: 284 MB)
#     libonnxruntime_providers_shared.so
#     ThirdPartyNotices.txt                (the notices of what the build includes)
#
#   bash scripts/onnxruntime-gpu.sh     prints the folder (stdout); the download is a 256 MB wheel
#
# scripts/package.sh --target linux-x64-gnu-cuda copies the folder into npm/linux-x64-gnu-cuda/;
# test/model/cuda-runtime.test.ts loads it. The wheel is unzipped into a private name and renamed
# into place, so concurrent callers never see half a folder; the wheel itself is not kept.
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ORT_GPU_VERSION=1.31.1
# The folder's layout; a change makes a new folder (the old one is left as it is).
ORT_GPU_LAYOUT=2
ORT_GPU_FILES=(libonnxruntime_providers_cuda.so libonnxruntime_providers_shared.so)

cache_root="${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ortex}"
dir="$cache_root/onnxruntime-gpu-$ORT_GPU_VERSION-l$ORT_GPU_LAYOUT"
if [ -f "$dir/complete" ]; then
  printf '%s\n' "$dir"
  exit 0
fi

command -v python3 >/dev/null || die "python3 with pip is needed to download onnxruntime-gpu==$ORT_GPU_VERSION"
tmp="$dir.tmp-$$"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp"
log "onnxruntime-gpu: downloading onnxruntime-gpu==$ORT_GPU_VERSION (a 256 MB wheel, once) into ${dir}"
# Only the binary wheel for Linux x64; --python-version pins one of its tags (its libraries are
# the same for every Python version).
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --no-cache-dir --timeout 30 --retries 2 -d "$tmp" "onnxruntime-gpu==$ORT_GPU_VERSION" >&2 ||
  die "pip could not download onnxruntime-gpu==$ORT_GPU_VERSION"
wheel=$(ls "$tmp"/onnxruntime_gpu-"$ORT_GPU_VERSION"-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || die "pip downloaded no onnxruntime-gpu wheel into $tmp"
python3 - "$wheel" "$tmp" "$ORT_GPU_VERSION" "${ORT_GPU_FILES[@]}" <<'PY' || die "cannot unzip $wheel"
import os, shutil, sys, zipfile
wheel, out, version, *files = sys.argv[1:]
names = {f"onnxruntime/capi/libonnxruntime.so.{version}": "libonnxruntime.so.1"}
names.update({f"onnxruntime/capi/{f}": f for f in files})
names["onnxruntime/ThirdPartyNotices.txt"] = "ThirdPartyNotices.txt"
with zipfile.ZipFile(wheel) as z:
    for entry, target in names.items():
        with z.open(entry) as src, open(os.path.join(out, target), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.chmod(os.path.join(out, target), 0o755)
os.remove(wheel)
open(os.path.join(out, "complete"), "w").close()
PY
if ! mv -T "$tmp" "$dir" 2>/dev/null; then
  [ -f "$dir/complete" ] || die "cannot move $tmp to $dir"
fi
trap - EXIT
rm -rf "$tmp"
log "onnxruntime-gpu: $(du -sh "$dir" | cut -f1) in $dir"
printf '%s\n' "$dir"
