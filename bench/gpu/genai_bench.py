#!/usr/bin/env python3
"""onnxruntime-genai's side of the GPU benchmark (bench/gpu/, run by bench/gpu/main.ts).

    python3 bench/gpu/genai_bench.py --workload W.json --model DIR [--provider cuda|cpu] [--mode engine|generator]
                                     [--budget-s S]

The same folder as ortex's, the same prompts as token ids, greedy, exactly `generatedTokens` new
tokens per request (EOS suppressed), every request of a concurrency arriving at once:

- `engine` (the default): og.Engine. On a paged folder (genai_config.json has
  engine.dynamic_batching, as the builder writes it with use_paged_attention) it batches
  dynamically with the folder's block size; max_batch_size is raised to the largest concurrency and
  num_blocks set to the workload's `numBlocks` (ortex's pool) so that neither system holds more KV
  than the other. On a past/present folder it batches statically (a batch runs until all its
  requests finish).
- `generator`: og.Generator with batch-of-prompts generation, left-padded (0.18's CPU Generator
  refuses batches above 32: "batch_size (64) must be in [1, 32]").

The closed loops and their arithmetic are bench/genai_throughput.py's (the CPU benchmark's), reused
here through its Genai class with this script's models and provider.

On cuda, onnxruntime-genai-cuda 0.18 finds ONNX Runtime through an importable `onnxruntime`
package: it loads `<package>/capi/libonnxruntime.so*` and ONNX Runtime loads its CUDA provider
from beside that library. bench/gpu/run.sh makes such a package out of the device kit's ONNX
Runtime 1.31.1 (CUDA 13) files (see bench/gpu/README.md).

Output: JSON lines on stdout, `{"info": {...}}` once loaded, `{"row": {...}}` per concurrency,
`{"done": true}`; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # bench/

from rows import Protocol  # noqa: E402  (bench/gpu/, the script's own folder)
from genai_throughput import Genai, Memory, rss_mb, summarize  # noqa: E402
from genai_venv import ensure_genai  # noqa: E402


PROTOCOL = Protocol("genai")
log, emit, fail = PROTOCOL.log, PROTOCOL.emit, PROTOCOL.fail


def load(og, folder: str, provider: str, overlay: dict):
    config = og.Config(folder)
    config.clear_providers()
    if provider == "cuda":
        config.append_provider("cuda")
    config.overlay(json.dumps(overlay))
    return og.Model(config)


def engine_overlay(folder: str, workload: dict) -> tuple[dict, str]:
    """The Engine's config overlay and its batching ('dynamic' on a paged folder, else 'static')."""
    config = json.loads((Path(folder) / "genai_config.json").read_text())
    largest = max(workload["concurrencies"])
    longest = max(len(p) for p in workload["prompts"]) + int(workload["generatedTokens"])
    overlay: dict = {"search": {"max_length": longest}}
    dynamic = (config.get("engine") or {}).get("dynamic_batching")
    if dynamic is not None:
        overlay["engine"] = {"dynamic_batching": {"max_batch_size": largest}}
        if "numBlocks" in workload:
            overlay["engine"]["dynamic_batching"]["num_blocks"] = int(workload["numBlocks"])
        return overlay, "dynamic"
    overlay["engine"] = {"static_batching": {"max_batch_size": largest}}
    return overlay, "static"


class GpuGenai(Genai):
    """genai_throughput.Genai's closed loops over one system loaded on `provider`."""

    def __init__(self, og, np, workload: dict, folder: str, provider: str, mode: str) -> None:  # noqa: PLR0913
        self.og, self.np, self.n, self.mode = og, np, int(workload["generatedTokens"]), mode
        self.spec = {"modelDir": folder, "prompts": workload["prompts"], "staggerMs": 0,
                     "padTokenId": int(workload.get("padTokenId", 0))}
        self.run_memory: Memory | None = None
        started = time.perf_counter()
        if mode == "engine":
            overlay, self.batching = engine_overlay(folder, workload)
            self.engine_model = load(og, folder, provider, overlay)
            self.engine = og.Engine(self.engine_model)
            self.buffer = self.engine.create_event_buffer(max(64, 4 * max(workload["concurrencies"])))
            self.tokenizer = og.Tokenizer(self.engine_model)
        else:
            self.batching = "batch-of-prompts"
            self.generator_model = load(og, folder, provider, {})
            self.tokenizer = og.Tokenizer(self.generator_model)
        self.load_s = time.perf_counter() - started

    def first_tokens(self) -> list[int]:
        """Request 0 alone: its generated ids (the report compares them across systems)."""
        prompt = self.spec["prompts"][0]
        if self.mode == "generator":
            params = self.og.GeneratorParams(self.generator_model)
            length = len(prompt) + self.n
            params.set_search_options(batch_size=1, max_length=length, min_length=length, do_sample=False)
            generator = self.og.Generator(self.generator_model, params)
            generator.append_tokens(self.np.array([prompt], self.np.int32))
            tokens = []
            while not generator.is_done():
                generator.generate_next_token()
                tokens.append(int(generator.get_next_tokens()[0]))
            return tokens
        request = self.begin(prompt)
        tokens = []
        while self.engine.has_pending_requests():
            self.engine.run(self.buffer)
            for i in range(len(self.buffer)):
                event = self.buffer[i]
                if event.error_code != self.og.EngineErrorCode.NONE:
                    raise RuntimeError(f"engine error {event.error_code}")
                if event.token is not None:
                    tokens.append(int(event.token))
        request.close()
        return tokens

    def closed_loop(self, concurrency: int, requests: int) -> dict:
        self.run_memory = Memory()
        try:
            run = self.run_engine if self.mode == "engine" else self.run_generator
            records = run(concurrency, requests)
        finally:
            memory, self.run_memory = self.run_memory, None
        return {**summarize(records, max(r.token_ms[-1] for r in records), self.n), "memory": memory.report()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--mode", choices=["engine", "generator"], default="engine")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip a concurrency whose estimated time exceeds what is left")
    args = ap.parse_args()
    # where onnxruntime_genai is missing (a CPU dry run), re-run in .cache/genai-venv (bench/requirements.txt)
    ensure_genai(__file__, fail=fail, log=log)
    mode = args.mode
    workload = json.loads(Path(args.workload).read_text())
    deadline = time.perf_counter() + args.budget_s if args.budget_s > 0 else None
    import numpy as np
    import onnxruntime_genai as og

    genai = GpuGenai(og, np, workload, args.model, args.provider, mode)
    first = genai.first_tokens()  # also the warm-up
    ort_version = None
    try:
        import onnxruntime

        ort_version = getattr(onnxruntime, "__version__", None)
    except ImportError:
        pass
    emit({"info": {"version": og.__version__, "package": getattr(og, "__id__", "onnxruntime-genai"),
                   "onnxruntime": ort_version, "provider": args.provider, "mode": mode, "batching": genai.batching,
                   "loadS": genai.load_s, "rssMb": rss_mb(), "firstTokens": first}})
    log(f"loaded {args.model} ({mode}, {genai.batching} batching, {args.provider}) in {genai.load_s:.1f} s")
    PROTOCOL.rows(workload, deadline, genai.n, genai.closed_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
