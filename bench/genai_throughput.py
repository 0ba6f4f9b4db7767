#!/usr/bin/env python3
"""onnxruntime-genai's side of the throughput benchmark (bench/throughput.ts, ts/bench/throughput.ts).

    python3 bench/genai_throughput.py --spec SPEC.json [--out RESULT.json]

Not meant to be run by hand: the throughput benchmark writes the spec (the model folder, the prompts
as token ids, the generated tokens per request, the concurrency, the requests, the arrival stagger,
the intra-op threads) and reads the result, so both sides run exactly the same workload. Progress
goes to stderr; the result (JSON) to --out, else stdout. Without onnxruntime_genai importable, the
script creates .cache/genai-venv (pip install -r bench/requirements.txt) and re-runs itself there,
as bench/check_genai.py does.

What onnxruntime-genai 0.18's Python API offers for concurrency, and what is measured:

- `engine`: og.Engine / og.Request / Request.begin_turn / Engine.run(event buffer), the request API.
  Its dynamic (continuous) batching needs a paged-KV model: block tables and a paged attention
  kernel, which ONNX Runtime has on CUDA only (configured with engine.dynamic_batching, 0.18 ends
  every request on our models with ENGINE_EXECUTION_FAILURE; its library's messages include "Dynamic
  batching requires at least one paged_kv decoder layer"). A past/present model runs with static batching
  (config `engine.static_batching.max_batch_size`): the waiting requests form a batch when the engine
  is idle, and the batch runs until all its requests finish; a request that arrives meanwhile waits
  for the whole batch. Measured with the benchmark's staggered closed-loop arrivals, as a server
  would see them. EOS is suppressed with a per-turn minimum (set_min_generated_tokens = the maximum).
- `generator`: og.Generator. At concurrency 1 the plain per-request loop (append_tokens, then
  generate_next_token until done). Above 1, batch-of-prompts generation: the requests' prompts,
  left-padded with pad_token_id to one length, in one Generator with search batch_size = the batch;
  the batch starts when its last prompt has arrived (a batch-of-prompts server must wait for it).
  `min_length = max_length` keeps every row going for exactly the generated tokens.

Latencies are measured from each request's scheduled arrival: the first requests of the C clients
arrive stagger_ms apart from t = 0, and a client's next request arrives when its previous one
finishes (its last token). TTFT = first token - arrival; inter-token latency = the gaps between a
request's successive tokens, pooled over all requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from genai_venv import ensure_genai

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"genai_throughput: {message}", file=sys.stderr, flush=True)


OUT_PATH: Path | None = None


def emit(result: dict) -> None:
    text = json.dumps(result, indent=1)
    if OUT_PATH is None:
        print(text)
    else:
        OUT_PATH.write_text(text)


def fail(message: str) -> None:
    """Reports a failure as a result (the benchmark prints it in place of numbers) and exits 3."""
    emit({"ok": False, "error": message})
    log(message)
    sys.exit(3)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile, as ts/bench/stats.ts computes it."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, -(-len(s) * p // 100))  # ceil(n p / 100), at least 1
    return s[int(rank) - 1]


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0


class Record:
    """One request: its prompt, scheduled arrival and token times (ms since the run's start)."""

    def __init__(self, index: int, prompt: list[int], arrival_ms: float) -> None:
        self.index = index
        self.prompt = prompt
        self.arrival_ms = arrival_ms
        self.token_ms: list[float] = []


def summarize(records: list[Record], wall_ms: float, tokens_per_request: int) -> dict:
    tokens = sum(len(r.token_ms) for r in records)
    bad = [r.index for r in records if len(r.token_ms) != tokens_per_request]
    if bad:
        raise RuntimeError(f"requests {bad} generated a different number of tokens than {tokens_per_request}")
    ttft = [r.token_ms[0] - r.arrival_ms for r in records]
    itl = [b - a for r in records for a, b in zip(r.token_ms, r.token_ms[1:])]
    return {
        "requests": len(records),
        "tokens": tokens,
        "wallMs": wall_ms,
        "tokensPerSecond": tokens * 1000.0 / wall_ms,
        "ttftMs": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "itlMs": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
    }


def load_model(og, spec: dict, overlay: dict):
    config = og.Config(spec["modelDir"])
    config.overlay(json.dumps(overlay))
    return og.Model(config)


def session_overlay(spec: dict) -> dict:
    return {"model": {"decoder": {"session_options": {"intra_op_num_threads": spec["intraOpThreads"]}}}}


def prompt_of(spec: dict, index: int) -> list[int]:
    prompts = spec["prompts"]
    return prompts[index % len(prompts)]


def run_engine(og, np, spec: dict, concurrency: int, requests: int) -> dict:
    """og.Engine with static batching, staggered closed-loop arrivals."""
    n = spec["generatedTokens"]
    max_prompt = max(len(p) for p in spec["prompts"])
    overlay = session_overlay(spec)
    overlay["engine"] = {"static_batching": {"max_batch_size": spec["maxBatchSize"]}}
    overlay["search"] = {"max_length": max_prompt + n}
    model = load_model(og, spec, overlay)
    engine = og.Engine(model)
    buffer = engine.create_event_buffer(max(64, 4 * spec["maxBatchSize"]))

    def begin(prompt: list[int]):
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(n)
        options.set_min_generated_tokens(n)
        request.begin_turn(np.array(prompt, np.int32), options)
        return request

    # Warm-up: one short request (the first runs allocate).
    warm = begin(prompt_of(spec, 0)[:8])
    while engine.has_pending_requests():
        engine.run(buffer)
    warm.close()

    stagger = spec["staggerMs"]
    clock = Clock()
    # (arrival_ms, client, request index) of each client's next request
    arrivals = [(k * stagger, k, k) for k in range(min(concurrency, requests))]
    live: dict[int, tuple[object, Record, int]] = {}
    records: list[Record] = []
    finished = 0
    while finished < requests:
        now = clock.ms()
        for arrival in [a for a in arrivals if a[0] <= now]:
            arrivals.remove(arrival)
            at, client, index = arrival
            record = Record(index, prompt_of(spec, index), at)
            records.append(record)
            request = begin(record.prompt)
            live[id(request)] = (request, record, client)
        if not engine.has_pending_requests():
            if arrivals:
                time.sleep(max(0.0, (min(a[0] for a in arrivals) - clock.ms()) / 1000.0))
            continue
        engine.run(buffer)
        now = clock.ms()
        for i in range(len(buffer)):
            event = buffer[i]
            entry = live.get(id(event.request))
            if entry is None or entry[0] is not event.request:
                raise RuntimeError("an event for an unknown request")
            request, record, client = entry
            if event.error_code != og.EngineErrorCode.NONE:
                raise RuntimeError(f"request {record.index}: engine error {event.error_code}")
            if event.token is not None:
                record.token_ms.append(now)
            if event.finish_reason != og.FinishReason.NONE:
                finished += 1
                del live[id(request)]
                request.close()
                next_index = record.index + concurrency
                if next_index < requests:
                    arrivals.append((now, client, next_index))
    wall = max(r.token_ms[-1] for r in records)
    return summarize(records, wall, n)


def run_generator(og, np, spec: dict, concurrency: int, requests: int) -> dict:
    """og.Generator: one request at a time (concurrency 1), else batch-of-prompts."""
    n = spec["generatedTokens"]
    pad = spec["padTokenId"]
    model = load_model(og, spec, session_overlay(spec))

    def generate(prompts: list[list[int]], on_step) -> None:
        width = max(len(p) for p in prompts)
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=len(prompts), max_length=width + n, min_length=width + n,
                                  do_sample=False)
        generator = og.Generator(model, params)
        ids = np.array([[pad] * (width - len(p)) + p for p in prompts], np.int32)
        generator.append_tokens(ids)
        while not generator.is_done():
            generator.generate_next_token()
            generator.get_next_tokens()
            on_step()
        del generator

    generate([prompt_of(spec, 0)[:8]], lambda: None)  # warm-up

    stagger = spec["staggerMs"]
    clock = Clock()
    records: list[Record] = []
    batch = min(concurrency, requests)
    ready_ms = 0.0  # when the previous batch finished
    for first in range(0, requests, batch):
        group = [Record(i, prompt_of(spec, i), (i - first) * stagger if first == 0 else ready_ms)
                 for i in range(first, min(requests, first + batch))]
        records.extend(group)
        start = max(r.arrival_ms for r in group)
        delay = (start - clock.ms()) / 1000.0
        if delay > 0:
            time.sleep(delay)

        def on_step() -> None:
            now = clock.ms()
            for r in group:
                r.token_ms.append(now)

        generate([r.prompt for r in group], on_step)
        ready_ms = clock.ms()
    wall = max(r.token_ms[-1] for r in records)
    return summarize(records, wall, n)


def main() -> int:
    global OUT_PATH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the workload, written by the throughput benchmark")
    ap.add_argument("--out", help="where to write the result (default: stdout)")
    args = ap.parse_args()
    OUT_PATH = Path(args.out) if args.out else None
    ensure_genai(__file__, fail=fail, log=log)
    import numpy as np
    import onnxruntime_genai as og

    spec = json.loads(Path(args.spec).read_text())
    result: dict = {"ok": True, "version": getattr(og, "__version__", "?"), "runs": []}
    try:
        import onnxruntime

        result["onnxruntimeVersion"] = onnxruntime.__version__
    except ImportError:
        pass
    for mode in spec["modes"]:
        for concurrency in spec["concurrencies"]:
            requests = spec["requestsByConcurrency"][str(concurrency)]
            log(f"{mode} concurrency {concurrency} ({requests} requests x {spec['generatedTokens']} tokens)")
            try:
                run = run_engine if mode == "engine" else run_generator
                summary = run(og, np, spec, concurrency, requests)
            except Exception as e:  # noqa: BLE001 -- reported in the result, per configuration
                result["runs"].append({"mode": mode, "concurrency": concurrency, "error": str(e)})
                log(f"{mode} concurrency {concurrency} failed: {e}")
                continue
            result["runs"].append({"mode": mode, "concurrency": concurrency, **summary})
            log(f"  {summary['tokensPerSecond']:.1f} tokens/s")
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
