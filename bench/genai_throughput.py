#!/usr/bin/env python3
"""onnxruntime-genai's side of the throughput benchmark (bench/throughput/).

    python3 bench/genai_throughput.py --spec SPEC.json

Not meant to be run by hand: the throughput benchmark writes the spec (the model folder, the prompts
as token ids, the generated tokens per request, the arrival stagger, the intra-op threads), starts
this script once and sends it commands, so both sides run exactly the same workload and the
onnxruntime-genai runs can be interleaved with ortex's request by request. Without
onnxruntime_genai importable, the script creates .cache/genai-venv (pip install -r
bench/requirements.txt) and re-runs itself there, as bench/check_genai.py does.

Protocol: JSON lines. The script loads both systems' models, warms them up and writes
`{"ok": true, "ready": true, "version": ..., "onnxruntimeVersion": ...}` (or `{"ok": false,
"error": ...}` and exits 3); then, for each line on stdin, one reply line on stdout:

- `{"run": "request", "mode": "engine" | "generator", "index": i}`: one request alone (prompt i),
  `{"ok": true, "tokenMs": [...]}` with its token times in ms from its start.
- `{"run": "closed-loop", "mode": ..., "concurrency": c, "requests": r}`: the closed-loop workload
  below, `{"ok": true, "requests", "tokens", "wallMs", "tokensPerSecond", "ttftMs", "itlMs", "memory"}`
  (memory: VmRSS in MiB at the run's start and its peak, sampled after every step, with the live
  tokens, prompt + generated of the requests in flight, at the peak and at most).

The ready line also carries `memory` (VmRSS before and after the Engine's model loaded, and after
the Generator's model and the warm-ups) and, when the spec has `promptText` and `promptIds` (the
benchmark's text and ortex's ids for it), `tokenizerCheck`: whether this folder's tokenizer gives
the same ids (the benchmark refuses to compare when it does not; the prompts are token ids).

With `profilePrefix` in the spec, the Generator's session writes ONNX Runtime's profile (session
option enable_profiling; a Chrome trace per operator) to PREFIX_<date>.json when the script ends
(bench/step-profile.ts reads it).

A failed command replies `{"ok": false, "error": ...}`. Progress goes to stderr, and so does
anything a library prints once the script runs (stdout carries only the protocol lines). EOF on stdin ends the script.

Both systems stream text, as a server built on them would and as ortex's side does (its `for await`
chunks carry each token's text): every request decodes each new token with its own
og.TokenizerStream, and the text is kept with the request.

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
import os
import sys
import time
from pathlib import Path

from genai_venv import ensure_genai

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"genai_throughput: {message}", file=sys.stderr, flush=True)


# The protocol's stream: the original stdout. Set up by main(), which points fd 1 at stderr so that
# nothing a library prints can corrupt it.
PROTOCOL = sys.stdout


def reply(message: dict) -> None:
    PROTOCOL.write(json.dumps(message) + "\n")
    PROTOCOL.flush()


def fail(message: str) -> None:
    """Reports a failure in place of the ready line (the benchmark prints it) and exits 3."""
    reply({"ok": False, "error": message})
    log(message)
    sys.exit(3)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile, as bench/throughput/stats.ts computes it."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, -(-len(s) * p // 100))  # ceil(n p / 100), at least 1
    return s[int(rank) - 1]


def rss_mb() -> float:
    """This process's resident memory (VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class Memory:
    """Resident memory over one run: at its start, its peak (sampled after every engine step or
    generated token), the live tokens (prompt + generated of the requests in flight) at that peak
    and their maximum."""

    def __init__(self) -> None:
        self.start = rss_mb()
        self.peak = self.start
        self.live_at_peak = 0
        self.live_max = 0

    def sample(self, live: int) -> None:
        rss = rss_mb()
        self.live_max = max(self.live_max, live)
        if rss >= self.peak:
            self.peak, self.live_at_peak = rss, live

    def report(self) -> dict:
        return {"rssStartMb": self.start, "rssPeakMb": self.peak, "liveTokensAtPeak": self.live_at_peak,
                "liveTokensMax": self.live_max}


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0


class Record:
    """One request: its prompt, scheduled arrival, token times (ms since the run's start) and the
    text its tokens streamed."""

    def __init__(self, index: int, prompt: list[int], arrival_ms: float) -> None:
        self.index = index
        self.prompt = prompt
        self.arrival_ms = arrival_ms
        self.token_ms: list[float] = []
        self.text: list[str] = []


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


class Genai:
    """Both systems, loaded and warmed up once; every command reuses them."""

    def __init__(self, og, np, spec: dict) -> None:
        self.og = og
        self.np = np
        self.spec = spec
        self.n = spec["generatedTokens"]
        max_prompt = max(len(p) for p in spec["prompts"])
        overlay = session_overlay(spec)
        overlay["engine"] = {"static_batching": {"max_batch_size": spec["maxBatchSize"]}}
        overlay["search"] = {"max_length": max_prompt + self.n}
        self.memory = {"rssBeforeLoadMb": rss_mb()}
        self.engine_model = load_model(og, spec, overlay)
        self.memory["rssAfterLoadMb"] = rss_mb()
        self.engine = og.Engine(self.engine_model)
        self.buffer = self.engine.create_event_buffer(max(64, 4 * spec["maxBatchSize"]))
        generator_overlay = session_overlay(spec)
        if spec.get("profilePrefix"):
            generator_overlay["model"]["decoder"]["session_options"]["enable_profiling"] = spec["profilePrefix"]
        self.generator_model = load_model(og, spec, generator_overlay)
        self.tokenizer = og.Tokenizer(self.engine_model)
        # Warm-ups: one short request each (the first runs allocate).
        warm = self.begin(prompt_of(spec, 0)[:8])
        while self.engine.has_pending_requests():
            self.engine.run(self.buffer)
        warm.close()
        self.generate([prompt_of(spec, 0)[:8]], lambda: None)
        self.memory["rssAfterAllLoadsMb"] = rss_mb()
        self.run_memory: Memory | None = None

    def begin(self, prompt: list[int]):
        og, n = self.og, self.n
        request = self.engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(n)
        options.set_min_generated_tokens(n)
        request.begin_turn(self.np.array(prompt, self.np.int32), options)
        return request

    def run_engine(self, concurrency: int, requests: int, first: int = 0) -> list[Record]:
        """og.Engine with static batching, staggered closed-loop arrivals; requests first, first + 1, ..."""
        og, engine, buffer = self.og, self.engine, self.buffer
        stagger = self.spec["staggerMs"]
        clock = Clock()
        # (arrival_ms, client, request index) of each client's next request
        arrivals = [(k * stagger, k, first + k) for k in range(min(concurrency, requests))]
        live: dict[int, tuple[object, Record, int]] = {}
        records: list[Record] = []
        finished = 0
        while finished < requests:
            now = clock.ms()
            for arrival in [a for a in arrivals if a[0] <= now]:
                arrivals.remove(arrival)
                at, client, index = arrival
                record = Record(index, prompt_of(self.spec, index), at)
                records.append(record)
                request = self.begin(record.prompt)
                live[id(request)] = (request, record, client, self.tokenizer.create_stream())
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
                request, record, client, stream = entry
                if event.error_code != og.EngineErrorCode.NONE:
                    raise RuntimeError(f"request {record.index}: engine error {event.error_code}")
                if event.token is not None:
                    record.token_ms.append(now)
                    record.text.append(stream.decode(event.token))
                if event.finish_reason != og.FinishReason.NONE:
                    finished += 1
                    del live[id(request)]
                    request.close()
                    next_index = record.index + concurrency
                    if next_index < first + requests:
                        arrivals.append((now, client, next_index))
            if self.run_memory is not None:
                # requests that finished in this step were live during it
                finished_now = [r for r in records if len(r.token_ms) == self.n and r.token_ms[-1] == now]
                in_flight = [entry[1] for entry in live.values()] + finished_now
                self.run_memory.sample(sum(len(r.prompt) + len(r.token_ms) for r in in_flight))
        return records

    def generate(self, prompts: list[list[int]], on_step) -> list[list[str]]:
        """Batch-of-prompts generation; calls on_step() after each step; returns each row's text."""
        og, np, n = self.og, self.np, self.n
        width = max(len(p) for p in prompts)
        params = og.GeneratorParams(self.generator_model)
        params.set_search_options(batch_size=len(prompts), max_length=width + n, min_length=width + n,
                                  do_sample=False)
        generator = og.Generator(self.generator_model, params)
        pad = self.spec["padTokenId"]
        ids = np.array([[pad] * (width - len(p)) + p for p in prompts], np.int32)
        generator.append_tokens(ids)
        streams = [self.tokenizer.create_stream() for _ in prompts]
        texts: list[list[str]] = [[] for _ in prompts]
        while not generator.is_done():
            generator.generate_next_token()
            tokens = generator.get_next_tokens()
            for row, stream in enumerate(streams):
                texts[row].append(stream.decode(int(tokens[row])))
            on_step()
        del generator
        return texts

    def run_generator(self, concurrency: int, requests: int, first: int = 0) -> list[Record]:
        """og.Generator: one request at a time (concurrency 1), else batch-of-prompts."""
        stagger = self.spec["staggerMs"]
        clock = Clock()
        records: list[Record] = []
        batch = min(concurrency, requests)
        ready_ms = 0.0  # when the previous batch finished
        for start in range(first, first + requests, batch):
            group = [Record(i, prompt_of(self.spec, i), (i - start) * stagger if start == first else ready_ms)
                     for i in range(start, min(first + requests, start + batch))]
            records.extend(group)
            delay = (max(r.arrival_ms for r in group) - clock.ms()) / 1000.0
            if delay > 0:
                time.sleep(delay)

            def on_step() -> None:
                now = clock.ms()
                for r in group:
                    r.token_ms.append(now)
                if self.run_memory is not None:
                    # the batch's rows are left-padded to its longest prompt
                    width = max(len(r.prompt) for r in group)
                    self.run_memory.sample(len(group) * (width + len(group[0].token_ms)))

            for record, text in zip(group, self.generate([r.prompt for r in group], on_step)):
                record.text = text
            ready_ms = clock.ms()
        return records

    def command(self, cmd: dict) -> dict:
        if cmd.get("mode") not in ("engine", "generator"):
            raise ValueError(f"unknown mode {cmd.get('mode')!r}")
        run = self.run_engine if cmd["mode"] == "engine" else self.run_generator
        if cmd.get("run") == "request":
            [record] = run(1, 1, int(cmd["index"]))
            if len(record.token_ms) != self.n:
                raise RuntimeError(f"request {record.index} generated {len(record.token_ms)} tokens, not {self.n}")
            return {"tokenMs": record.token_ms}
        if cmd.get("run") == "closed-loop":
            self.run_memory = Memory()
            try:
                records = run(int(cmd["concurrency"]), int(cmd["requests"]))
            finally:
                memory, self.run_memory = self.run_memory, None
            return {**summarize(records, max(r.token_ms[-1] for r in records), self.n), "memory": memory.report()}
        raise ValueError(f"unknown run {cmd.get('run')!r}")


def main() -> int:
    global PROTOCOL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="the workload, written by the throughput benchmark")
    args = ap.parse_args()
    # Before the redirection: it may re-execute this script, which inherits fds 0-2 only (pip's own
    # output then reaches the benchmark's stdout, which reads only JSON lines).
    ensure_genai(__file__, fail=fail, log=log)
    PROTOCOL = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import numpy as np
    import onnxruntime_genai as og

    spec = json.loads(Path(args.spec).read_text())
    ready: dict = {"ok": True, "ready": True, "version": getattr(og, "__version__", "?")}
    try:
        import onnxruntime

        ready["onnxruntimeVersion"] = onnxruntime.__version__
    except ImportError:
        pass
    try:
        genai = Genai(og, np, spec)
    except Exception as e:  # noqa: BLE001 -- reported to the benchmark in place of numbers
        fail(f"loading {spec['modelDir']}: {e}")
    ready["memory"] = genai.memory
    if "promptText" in spec:
        ids = [int(t) for t in genai.tokenizer.encode(spec["promptText"])]
        theirs = [int(t) for t in spec["promptIds"]]
        same = ids == theirs
        check: dict = {"same": same, "tokens": len(ids)}
        if not same:
            first = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
            check.update(firstDifference=first, genai=ids[max(0, first - 3):first + 5],
                         ortex=theirs[max(0, first - 3):first + 5], genaiTokens=len(ids), ortexTokens=len(theirs))
        ready["tokenizerCheck"] = check
    reply(ready)
    for line in sys.stdin:
        if line.strip() == "":
            continue
        try:
            reply({"ok": True, **genai.command(json.loads(line))})
        except Exception as e:  # noqa: BLE001 -- reported per command
            reply({"ok": False, "error": str(e)})
    del genai  # its sessions end here: a profile is written as they do
    return 0


if __name__ == "__main__":
    sys.exit(main())
