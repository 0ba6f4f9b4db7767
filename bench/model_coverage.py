#!/usr/bin/env python3
"""Model coverage: every decoder architecture onnxruntime-genai's builder converts for the CPU,
in each precision, run by ortex, onnxruntime-genai and Hugging Face transformers.

    python3 bench/model_coverage.py [--arch llama,gemma2] [--precision fp32,int4,fp16] [--new 40]
                                    [--work DIR] [--out bench/out/model-coverage.json]

Not part of `npm test`; build first (`npm run build`). Without torch, transformers and
onnxruntime_genai importable, the script creates ~/.cache/ortex/venv-builder (pip install -r
bench/requirements-builder.txt, about 6 GB with torch's CUDA libraries) and re-runs itself there.

For each architecture (ARCHITECTURES below):
 1. a random-weight Hugging Face model (2 layers, hidden 64, 4 heads, 2 KV heads where the
    architecture has grouped KV heads, context 256, a 300-token byte-level BPE tokenizer), saved
    under --work (default ~/.cache/ortex/model-coverage); the lm_head rows of the special tokens
    are zero, so that EOS never wins and every system generates the full length; sliding-window
    architectures get a 16-position window, so 40 new tokens go well past it;
 2. `python -m onnxruntime_genai.models.builder -i HF -o OUT -p PRECISION -e cpu` per precision;
 3. greedy tokens of 8 prompts (lengths 1 to 29): transformers (float32; the reference for fp32
    and, as the float32 model the others approximate, shown for int4/fp16), onnxruntime-genai
    (og.Generator, one prompt at a time), and ortex alone, 8 concurrent, and 8 concurrent with
    chunked prefill (bench/model-coverage-ortex.mjs);
 4. a table of architectures x precisions: `=` when ortex equals onnxruntime-genai (fp32: and
    transformers) on every prompt in all three ways, otherwise what differs or who refused.

Exit status 0 when every fp32 and int4 cell agrees (a refusal with a reason counts as agreeing
for a folder onnxruntime-genai cannot run either), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from check_genai import genai_generate
from genai_venv import ROOT, ensure_venv

VENV = Path.home() / ".cache" / "ortex" / "venv-builder"
WORK = Path(os.environ.get("ORTEX_CACHE_DIR", Path.home() / ".cache" / "ortex")) / "model-coverage"
WINDOW = 16

# name -> (transformers model_type, config overrides). Dims shared by all are in COMMON.
COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "phi3": ("phi3", {"num_key_value_heads": 4, "original_max_position_embeddings": 256}),
    # head 32: the rotary half (16) gives cos/sin tables of 8 columns, which GroupQueryAttention
    # needs to be a multiple of 8.
    "phi2": ("phi", {"num_key_value_heads": 4, "partial_rotary_factor": 0.5, "hidden_size": 128, "head_dim": 32,
                     "intermediate_size": 256}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "query_pre_attn_scalar": 16}),
    "granite": ("granite", {}),
    "olmo": ("olmo", {"num_key_value_heads": 4}),
    "smollm3": ("smollm3", {}),
    "nemotron": ("nemotron", {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}),  # partial rotary, as phi2
}
PRECISIONS = ["fp32", "int4", "fp16"]


def log(message: str) -> None:
    print(f"model_coverage: {message}", file=sys.stderr, flush=True)


def prompts() -> list[list[int]]:
    lengths = [1, 3, 5, 8, 12, 17, 23, 29]
    return [[1] + [3 + (i * 37 + k * 101) % 509 for k in range(n - 1)] for i, n in enumerate(lengths)]


def make_hf_model(arch: str, out: Path) -> None:
    """A random-weight model of `arch` with a tokenizer, saved to `out` (once)."""
    if (out / "config.json").exists():
        return
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    model_type, overrides = ARCHITECTURES[arch]
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the river starts as a thin line of water that runs to the sea"] * 8, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>").save_pretrained(out)
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    torch.manual_seed(sum(map(ord, arch)))
    model = AutoModelForCausalLM.from_config(config).eval()
    gemma_norms = model_type.startswith("gemma")  # Gemma's RMSNorm scales by (1 + weight)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                # Wide enough that attention and context matter, so greedy outputs vary.
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
            elif "norm" in name and "bias" not in name and not gemma_norms:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
        model.get_output_embeddings().weight[:3].zero_()  # <pad>, <s>, </s> never win
    model.save_pretrained(out)


def convert(hf: Path, out: Path, precision: str) -> str | None:
    """The builder's folder for `precision` (once); None, or the builder's last error line."""
    if (out / "genai_config.json").exists():
        return None
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / "builder-cache")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not (out / "genai_config.json").exists():
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        return "builder failed: " + (lines[-1] if lines else f"exit {run.returncode}")
    return None


def hf_tokens(hf: Path, ps: list[list[int]], new: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in ps:
            # The plain greedy loop (generate() would stop at or suppress EOS).
            step = model(input_ids=torch.tensor([p]), use_cache=True)
            tokens = [int(torch.argmax(step.logits[0, -1]))]
            while len(tokens) < new:
                step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True)
                tokens.append(int(torch.argmax(step.logits[0, -1])))
            out.append(tokens)
    return out


def genai_tokens(folder: Path, ps: list[list[int]], new: int) -> list[list[int]] | str:
    import onnxruntime_genai as og

    try:
        model = og.Model(str(folder))
        return [genai_generate(og, model, p, new, eos=set()) for p in ps]
    except Exception as e:  # noqa: BLE001 - reported in the table
        return "onnxruntime-genai failed: " + " ".join(str(e).split())[:400]


def ortex_tokens(folder: Path, ps: list[list[int]], new: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        json.dump({"dir": str(folder), "prompts": ps, "maxNew": new}, spec)
    try:
        run = subprocess.run(["node", str(ROOT / "bench" / "model-coverage-ortex.mjs"), spec.name],
                             capture_output=True, text=True, cwd=ROOT)
    finally:
        os.unlink(spec.name)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "error": "node failed: " + run.stderr.strip()[-300:]}
    return json.loads(lines[-1])


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first token index where any prompt differs, None when all are equal."""
    at = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None if len(p) == len(q) else min(len(p), len(q)))
          for p, q in zip(a, b)]
    found = [i for i in at if i is not None]
    return min(found) if found else None


def short_reason(message: str) -> str:
    """The gist of ortex's refusal (its message names the file first)."""
    if "grouped KV heads" in message:
        return "float16 MultiHeadAttention with grouped KV heads, which ONNX Runtime's CPU kernels do not run"
    if "sliding_window" in message:
        return "a sliding window on MultiHeadAttention, which has none to set"
    return message.split(": ", 1)[-1][:200]


def cell(precision: str, hf: list[list[int]], genai: list[list[int]] | str, ortex: dict) -> tuple[str, bool]:
    """The table cell and whether it counts as agreeing."""
    if not ortex.get("ok"):
        refused = ortex.get("code") == "MODEL_LOAD"
        genai_note = "onnxruntime-genai fails too" if isinstance(genai, str) else "onnxruntime-genai runs it"
        # A refusal agrees when onnxruntime-genai cannot run the folder either.
        what = "refused" if refused else "failed"
        return (f"{what}: {short_reason(ortex.get('error', ''))} ({genai_note})", refused and isinstance(genai, str))
    ways = {k: ortex[k] for k in ("alone", "concurrent", "chunked")}
    inconsistent = [k for k, v in ways.items() if v != ortex["alone"]]
    if inconsistent:
        return (f"ortex {', '.join(inconsistent)} differs from alone", False)
    parts, ok = [], True
    if isinstance(genai, str):
        parts.append("onnxruntime-genai fails (" + genai.split("Status Message: ")[-1][:120] + ")")
    else:
        d = first_difference(ortex["alone"], genai)
        parts.append("= onnxruntime-genai" if d is None else f"onnxruntime-genai differs at token {d}")
        ok = ok and (d is None or precision == "fp16")
    d = first_difference(ortex["alone"], hf)
    if d is None:
        parts.append("= transformers")
    else:
        parts.append(f"transformers differs at token {d}")
        ok = ok and precision != "fp32"
    return ("; ".join(parts), ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=",".join(ARCHITECTURES))
    ap.add_argument("--precision", default=",".join(PRECISIONS))
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "model-coverage.json"))
    args = ap.parse_args()
    ensure_venv(__file__, VENV, ROOT / "bench" / "requirements-builder.txt",
                ["torch", "transformers", "onnxruntime_genai", "onnx_ir"],
                fail=lambda message: sys.exit(f"model_coverage: {message}"), log=log)
    if not (ROOT / "dist" / "index.js").exists():
        sys.exit("model_coverage: build first (npm run build)")
    work, ps = Path(args.work), prompts()
    results, all_ok = [], True
    for arch in args.arch.split(","):
        hf = work / arch / "hf"
        log(f"{arch}: Hugging Face model")
        make_hf_model(arch, hf)
        reference = hf_tokens(hf, ps, args.new)
        for precision in args.precision.split(","):
            folder = work / arch / precision
            log(f"{arch} {precision}: builder")
            failure = convert(hf, folder, precision)
            if failure:
                results.append({"arch": arch, "precision": precision, "cell": failure, "ok": True})
                continue
            genai = genai_tokens(folder, ps, args.new)
            ortex = ortex_tokens(folder, ps, args.new)
            text, ok = cell(precision, reference, genai, ortex)
            all_ok = all_ok and (ok or precision == "fp16")
            results.append({"arch": arch, "precision": precision, "cell": text, "ok": ok,
                            "kvPositionBytes": ortex.get("kvPositionBytes")})
            log(f"{arch} {precision}: {text}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"| architecture | {' | '.join(args.precision.split(','))} |")
    print(f"|---|{'---|' * len(args.precision.split(','))}")
    for arch in args.arch.split(","):
        cells = [next((r["cell"] for r in results if r["arch"] == arch and r["precision"] == p), "")
                 for p in args.precision.split(",")]
        print(f"| {arch} | {' | '.join(cells)} |")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
