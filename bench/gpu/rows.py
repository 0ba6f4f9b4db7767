"""The JSON-lines protocol both Python sides of the GPU benchmark (hf_bench.py, genai_bench.py)
speak to bench/gpu/python.ts: progress on stderr, one JSON object a line on stdout, `{"info": ...}`
once loaded, `{"row": ...}` per concurrency, `{"done": true}` at the end."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable


class Protocol:
    def __init__(self, name: str) -> None:
        self.name = name

    def log(self, message: str) -> None:
        print(f"{self.name}: {message}", file=sys.stderr, flush=True)

    def emit(self, message: dict) -> None:
        print(json.dumps(message), flush=True)

    def fail(self, message: str):
        self.log(message)
        sys.exit(3)

    def rows(self, workload: dict, deadline: float | None, tokens_per_request: int, run: Callable[[int, int], dict]) -> None:
        """`run(concurrency, requests)` for each of the workload's concurrencies, a row each (an
        exception becomes the row's error), then done. With a deadline, a concurrency whose time,
        estimated from the last row's tokens/s per concurrent request, would pass it is skipped:
        a batched step costs about the same at any batch size on a GPU, so tokens/s grows with C."""
        per_request = None
        for c in workload["concurrencies"]:
            requests = int(workload["requestsByConcurrency"][str(c)])
            if deadline is not None and per_request:
                estimate = requests * tokens_per_request / (per_request * min(c, requests))
                if time.perf_counter() + estimate > deadline:
                    self.emit({"row": {"concurrency": c, "error": f"skipped: about {estimate:.0f} s, more than the time left"}})
                    continue
            try:
                row = run(c, requests)
                per_request = row["tokensPerSecond"] / min(c, requests)
                self.emit({"row": {"concurrency": c, **row}})
            except Exception as e:  # noqa: BLE001 -- reported as the row's error
                self.emit({"row": {"concurrency": c, "error": f"{type(e).__name__}: {e}"}})
        self.emit({"done": True})
