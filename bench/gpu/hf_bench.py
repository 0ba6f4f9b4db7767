#!/usr/bin/env python3
"""Hugging Face transformers' side of the GPU benchmark (bench/gpu/, run by bench/gpu/main.ts).

    python3 bench/gpu/hf_bench.py --workload W.json --model DIR [--device cuda|cpu] [--dtype float16|float32]
                                  [--compile] [--budget-s S]

A LlamaForCausalLM with the folder's own weights (bench/gpu/hf_llama.py: the converter, checked
against ONNX Runtime's logits on the folder by bench/gpu/check_hf.py) generates the workload's
requests: the same prompts as token ids, greedy, exactly `generatedTokens` new tokens each (EOS
ignored: min_new_tokens = max_new_tokens), with a static KV cache. At concurrency C the requests
run in batches of C (a closed loop of C clients against a static batch: all of a batch's requests
arrive together, at t = 0 for the first batch and when the previous batch ends for the next),
left-padded to the batch's longest prompt. Each step's time is taken when generate hands the step's
tokens to the streamer (generate synchronizes with the device there: its stopping check reads the
tokens), so TTFT and inter-token latency are per step, as every row of a batch sees them.

transformers compiles the forward pass of a static-cache generate on CUDA by itself; that takes
minutes per batch shape, more than the benchmark's whole device budget, so it is off unless
--compile asks for it (the report says which).

Output: JSON lines on stdout, `{"info": {...}}` once loaded (versions, device, memory after the load),
then `{"row": {...}}` per concurrency (requests, tokens, wallMs, tokensPerSecond, ttftMs, itlMs
p50/p99, memory), `{"done": true}` at the end; the info's firstTokens are request 0's
generated ids, run alone (the report compares them with ortex's). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # bench/: genai_throughput's arithmetic

from rows import Protocol  # noqa: E402  (bench/gpu/, the script's own folder)
from genai_throughput import Record, rss_mb, summarize  # noqa: E402
from genai_venv import ROOT, ensure_venv  # noqa: E402

# bench/model_coverage.py's comparison environment (torch, transformers, onnx, onnxruntime-genai)
VENV = Path.home() / ".cache" / "ortex" / "venv-builder"


PROTOCOL = Protocol("hf")
log, emit, fail = PROTOCOL.log, PROTOCOL.emit, PROTOCOL.fail


class StepClock:
    """A streamer for generate: the first put is the prompt, every later one a step's new tokens."""

    def __init__(self, records: list[Record], t0: float) -> None:
        self.records = records
        self.t0 = t0
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = (time.perf_counter() - self.t0) * 1000.0
        tokens = value.reshape(-1).tolist()
        for record, token in zip(self.records, tokens):
            record.token_ms.append(now)
            record.text.append(int(token))  # the ids, where the CPU benchmark keeps text

    def end(self) -> None:
        pass


class Hf:
    def __init__(self, args, workload: dict) -> None:
        import torch

        from hf_llama import load_llama

        self.torch = torch
        self.device = args.device
        self.n = int(workload["generatedTokens"])
        self.prompts = workload["prompts"]
        self.compile = args.compile
        self.pad = int(workload.get("padTokenId", 0))
        started = time.perf_counter()
        self.model, self.config = load_llama(args.model, args.dtype, args.device)
        self.load_s = time.perf_counter() - started

    def memory(self) -> dict:
        torch = self.torch
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            return {"gpuUsedMb": (total - free) / 2**20, "gpuPeakAllocatedMb": torch.cuda.max_memory_allocated() / 2**20,
                    "rssMb": rss_mb()}
        return {"rssMb": rss_mb()}

    def generate(self, batch: list[Record], t0: float) -> None:
        torch = self.torch
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[self.pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=self.device)
        kwargs = dict(max_new_tokens=self.n, min_new_tokens=self.n, do_sample=False, cache_implementation="static",
                      pad_token_id=self.pad, streamer=StepClock(batch, t0))
        if not self.compile:
            kwargs["disable_compile"] = True
        with torch.no_grad():
            self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    def first_tokens(self) -> list[int]:
        """Request 0 alone: its generated ids (the report compares them across systems); also the warm-up."""
        record = Record(0, self.prompts[0], 0.0)
        self.generate([record], time.perf_counter())
        return record.text

    def run(self, concurrency: int, requests: int) -> dict:
        torch = self.torch
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        records: list[Record] = []
        ready_ms = 0.0
        for start in range(0, requests, concurrency):
            batch = [Record(i, self.prompts[i % len(self.prompts)], ready_ms) for i in range(start, min(requests, start + concurrency))]
            records.extend(batch)
            self.generate(batch, t0)
            ready_ms = (time.perf_counter() - t0) * 1000.0
        summary = summarize(records, max(r.token_ms[-1] for r in records), self.n)
        return {**summary, "memory": self.memory()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["float16", "float32", "bfloat16"],
                    help="default: float16 on cuda, float32 on cpu")
    ap.add_argument("--compile", action="store_true", help="let generate compile the static-cache forward (minutes)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip a concurrency whose estimated time exceeds what is left")
    args = ap.parse_args()
    # where torch or transformers is missing (the CPU dry run), re-run in the builder venv
    ensure_venv(__file__, VENV, ROOT / "bench" / "requirements-builder.txt", ["torch", "transformers", "onnx"], fail, log)
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    workload = json.loads(Path(args.workload).read_text())
    deadline = time.perf_counter() + args.budget_s if args.budget_s > 0 else None
    import torch
    import transformers

    if args.device == "cpu":
        torch.set_num_threads(int(workload.get("threads", os.cpu_count() or 1)))
    hf = Hf(args, workload)
    first = hf.first_tokens()
    emit({"info": {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
                   "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "dtype": args.dtype,
                   "compile": args.compile, "loadS": hf.load_s, "memory": hf.memory(), "firstTokens": first}})
    log(f"loaded {args.model} ({args.dtype} on {args.device}, compile {'on' if args.compile else 'off'}) in {hf.load_s:.1f} s")
    PROTOCOL.rows(workload, deadline, hf.n, hf.run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
