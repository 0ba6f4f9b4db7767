#!/usr/bin/env python3
"""Checks that bench/gpu/hf_llama.py's LlamaForCausalLM is the folder's model (the GPU benchmark's
"same weights"): its float32 logits on a prompt equal ONNX Runtime's on the folder's model.onnx.

    python3 bench/gpu/check_hf.py FOLDER [--tokens N] [--tolerance T]

Prints the comparison as JSON and exits 1 when the largest difference exceeds T times the largest
logit (default 1e-3: float32 folders agree to about 1e-6 of it) or any position's argmax differs.
Runs in the builder venv (~/.cache/ortex/venv-builder, created on first use) where torch is missing.
bench/gpu/test-cpu.sh runs it on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from genai_venv import ROOT, ensure_venv  # noqa: E402


def fail(message: str):
    print(f"check_hf: {message}", file=sys.stderr)
    sys.exit(3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tolerance", type=float, default=1e-3)
    args = ap.parse_args()
    venv = Path.home() / ".cache" / "ortex" / "venv-builder"
    ensure_venv(__file__, venv, ROOT / "bench" / "requirements-builder.txt", ["torch", "transformers", "onnx", "onnxruntime"],
                fail, lambda m: print(f"check_hf: {m}", file=sys.stderr))
    import hf_llama

    config = json.loads((Path(args.folder) / "genai_config.json").read_text())["model"]
    vocab = int(config["vocab_size"])
    # ids spread over the vocabulary, deterministic, skipping the first few (special) ids
    ids = [3 + (i * 7919) % (vocab - 3) for i in range(args.tokens)]
    result = hf_llama.check(args.folder, ids)
    ok = result["maxAbsDiff"] <= args.tolerance * max(1.0, result["maxAbsLogit"]) and result["argmaxSame"] == len(ids)
    print(json.dumps({"folder": args.folder, "ok": ok, **result}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
