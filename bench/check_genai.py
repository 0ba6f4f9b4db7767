#!/usr/bin/env python3
"""Checks that onnxruntime-genai (from PyPI) loads and runs a model folder made by `ortex make-model`,
and that its greedy tokens equal ortex's reference loop.

    python3 bench/check_genai.py MODEL_DIR [--text TEXT | --tokens 1,2,3] [--max-new 16]
                                 [--expect 4,5,6 | --expect-file FILE] [--no-node]

Not part of `npm test`. Without onnxruntime_genai importable, the script creates a virtual environment
in .cache/genai-venv (pip install -r bench/requirements.txt) and re-runs itself there.

What it does:
 1. loads the folder with onnxruntime_genai (Model, Tokenizer) and prints the config it read;
 2. tokenizer: encodes the prompt text, checks decode(encode(text)) == text, and that the Hugging Face
    `tokenizers` library (the Rust crate ortex uses) loads tokenizer.json and encodes the same ids;
 3. generates --max-new tokens greedily (stopping after an EOS token, like the reference loop);
 4. runs the same plain loop on onnxruntime's Python API (batch 1, present fed back as past);
 5. compares with ortex's JS reference loop (test/reference/reference.ts): the tokens given by --expect /
    --expect-file, else computed by bundling test/reference/cli.ts with esbuild and running it
    in node (skipped with --no-node); also compares the JS tokenizer's encoding of the text.
Exit status 0 when everything that ran agrees, 1 on a mismatch, 2 on a usage or load error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from genai_venv import ensure_genai

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = "The river starts as a thin line of water"


def parse_tokens(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def genai_generate(og, model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_new, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out: list[int] = []
    while len(out) < max_new and not gen.is_done():
        gen.generate_next_token()
        tok = int(gen.get_next_tokens()[0])
        out.append(tok)
        if tok in eos:
            break
    return out


def ort_generate(model_dir: Path, cfg: dict, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """The plain loop of test/reference/reference.ts (naiveGenerate) on onnxruntime's Python API."""
    import numpy as np
    import onnxruntime as ort

    dec = cfg["model"]["decoder"]
    inputs, outputs = dec["inputs"], dec["outputs"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model_dir / dec["filename"]), opts, providers=["CPUExecutionProvider"])
    layers, kvh, hs = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
    past = {}
    for l in range(layers):
        past[inputs["past_key_names"] % l] = np.zeros((1, kvh, 0, hs), np.float32)
        past[inputs["past_value_names"] % l] = np.zeros((1, kvh, 0, hs), np.float32)
    past_len, step, out = 0, list(prompt), []
    out_names = [outputs["logits"]] + [n for l in range(layers)
                                       for n in (outputs["present_key_names"] % l, outputs["present_value_names"] % l)]
    while len(out) < max_new:
        s = len(step)
        feeds = dict(past)
        feeds[inputs["input_ids"]] = np.array([step], np.int64)
        feeds[inputs["attention_mask"]] = np.ones((1, past_len + s), np.int64)
        if "position_ids" in inputs:
            feeds[inputs["position_ids"]] = np.arange(past_len, past_len + s, dtype=np.int64)[None, :]
        res = dict(zip(out_names, sess.run(out_names, feeds)))
        tok = int(np.argmax(res[outputs["logits"]][0, -1]))  # first index on ties, like the JS loop
        for l in range(layers):
            past[inputs["past_key_names"] % l] = res[outputs["present_key_names"] % l]
            past[inputs["past_value_names"] % l] = res[outputs["present_value_names"] % l]
        past_len += s
        out.append(tok)
        if tok in eos:
            break
        step = [tok]
    return out


def node_reference(model_dir: Path, prompt: list[int], text: str, max_new: int) -> dict | None:
    bundle = ROOT / ".cache" / "reference-cli.mjs"
    esbuild = ROOT / "node_modules" / ".bin" / "esbuild"
    if not esbuild.exists():
        print("  (node_modules/.bin/esbuild missing: run npm install; skipping the JS reference)")
        return None
    bundle.parent.mkdir(parents=True, exist_ok=True)
    subprocess.check_call([str(esbuild), str(ROOT / "test" / "reference" / "cli.ts"), "--bundle", "--platform=node",
                           "--format=esm", "--external:onnxruntime-node", "--log-level=warning",
                           f"--outfile={bundle}"], cwd=ROOT)
    res = subprocess.run(["node", str(bundle), str(model_dir), "--tokens", ",".join(map(str, prompt)),
                          "--text", text, "--max-new", str(max_new)],
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        print("  JS reference failed: " + res.stderr.strip())
        return None
    return json.loads(res.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="prompt text (encoded with the folder's tokenizer)")
    ap.add_argument("--tokens", help="prompt token ids, comma-separated (instead of the text's encoding)")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--expect", help="the JS reference loop's tokens, comma-separated")
    ap.add_argument("--expect-file", help="JSON file: a list of tokens or an object with a 'tokens' list")
    ap.add_argument("--no-node", action="store_true", help="do not run the JS reference loop")
    args = ap.parse_args()

    ensure_genai(__file__, fail=lambda message: sys.exit(f"check_genai: {message}"),
                 log=lambda message: print(f"check_genai: {message}", file=sys.stderr))
    import onnxruntime_genai as og

    model_dir = Path(args.model_dir).resolve()
    try:
        cfg = json.loads((model_dir / "genai_config.json").read_text())
        model = og.Model(str(model_dir))
        tokenizer = og.Tokenizer(model)
    except Exception as e:  # noqa: BLE001
        print(f"LOAD FAILED: {e}")
        return 2
    m = cfg["model"]
    d = m["decoder"]
    eos_cfg = m["eos_token_id"]
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg])
    print(f"onnxruntime-genai {getattr(og, '__version__', '?')} loaded {model_dir}")
    print(f"  type={m['type']} vocab={m['vocab_size']} layers={d['num_hidden_layers']} heads={d['num_attention_heads']}"
          f" kv_heads={d['num_key_value_heads']} head_size={d['head_size']} inputs={sorted(d['inputs'])}"
          f" share_buffer={cfg['search'].get('past_present_share_buffer')}")

    ok = True
    encoded = [int(t) for t in tokenizer.encode(args.text)]
    decoded = tokenizer.decode(encoded)
    print(f"tokenizer: {len(encoded)} tokens for {args.text!r}: {encoded}")
    if decoded == args.text:
        print("  round trip: ok")
    else:
        print(f"  round trip: MISMATCH, decoded {decoded!r}")
        ok = False

    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        HfTokenizer = None
    if HfTokenizer is None:
        print("  (the tokenizers package is missing: skipping the Hugging Face tokenizers check)")
    else:
        hf = HfTokenizer.from_file(str(model_dir / "tokenizer.json"))
        hf_ids = hf.encode(args.text, add_special_tokens=True).ids
        same = hf_ids == encoded and hf.decode(hf_ids, skip_special_tokens=False) == args.text
        same &= hf.get_vocab_size(with_added_tokens=True) == m["vocab_size"]
        ok &= same
        print(f"  Hugging Face tokenizers: vocab {hf.get_vocab_size(with_added_tokens=True)}, encoding and round trip"
              f" [{'same' if same else 'MISMATCH'}]")

    prompt = parse_tokens(args.tokens) if args.tokens else encoded
    genai_tokens = genai_generate(og, model, prompt, args.max_new, eos)
    print(f"onnxruntime-genai greedy ({len(genai_tokens)}): {genai_tokens}")
    print(f"  text: {tokenizer.decode(genai_tokens)!r}")

    ort_tokens = ort_generate(model_dir, cfg, prompt, args.max_new, eos)
    same = ort_tokens == genai_tokens
    ok &= same
    print(f"onnxruntime plain loop ({len(ort_tokens)}): {ort_tokens}  [{'same' if same else 'MISMATCH'}]")

    expected = None
    if args.expect:
        expected = parse_tokens(args.expect)
    elif args.expect_file:
        data = json.loads(Path(args.expect_file).read_text())
        expected = data["tokens"] if isinstance(data, dict) else data
    elif not args.no_node:
        js = node_reference(model_dir, prompt, args.text, args.max_new)
        if js is not None:
            expected = js["tokens"]
            enc_same = js.get("encoded") == encoded
            ok &= enc_same
            print(f"JS tokenizer encoding: {js.get('encoded')}  [{'same' if enc_same else 'MISMATCH'}]")
            print(f"  JS decoded: {js.get('decoded')!r}")
    if expected is not None:
        same = expected == genai_tokens
        ok &= same
        print(f"ortex reference loop ({len(expected)}): {expected}  [{'same' if same else 'MISMATCH'}]")
    print("RESULT: " + ("ok" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
