"""One side of a regression gate, measured by its own revision's code (gate protocol `PROTOCOL`).

    cd <a checkout or worktree of some revision> && python -m harness.gate.worker

The gate (harness/gate/sides.py) starts one worker per side, with the working directory at that side's
checkout: `python -m` puts that folder first on `sys.path`, so every module the worker runs, the
measurement pipeline (harness/run/pipeline.py) and the decode loop included, is the revision's own. The
worker measures exactly what `python run.py <same overrides>` measures there: one block is one or more
`Pipeline.generate(i)` calls of the next prompt batches, and its speed is decode tokens / decode wall
clock, the definition of run.py's `decode_tokens_per_s`.

Protocol (JSON lines: one request per line on stdin, one reply per line on stdout; any error is
`{"ok": false, "error": "<one line>"}`). A change to any request or reply raises `PROTOCOL`, and a
gate refuses a worker that speaks another number (harness/gate/sides.py names the first revision that
speaks its own).

- `{"cmd": "hello"}` -> `{"ok": true, "protocol": 1, "root": "<the checkout its code was imported from>"}`
- `{"cmd": "check", "overrides": [...]}` -> `{"ok": true, "config": {...}}`: compose, validate and
  preflight the config; nothing loads (the gate checks both sides before either loads)
- `{"cmd": "load"}` -> `{"ok": true, "info": {...}}` (`Pipeline.info()`): load, quantize, warm up
- `{"cmd": "block", "min_tokens": k}` -> `{"ok": true, "block": {"decode_tokens": n, "decode_wall_s": s,
  "generations": c, "wall": [start, end]}}`: generate calls until at least k decode tokens
- `{"cmd": "accuracy"}` -> `{"ok": true, "metrics": {...}}`: `Pipeline.accuracy()` plus `greedy_tokens`
- `{"cmd": "quit"}` -> `{"ok": true}`, then the worker exits
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from harness import measure, quiet_third_party
from harness.config import build, compose, group_choice_problem
from harness.errors import ConfigError, QuantbenchError
from harness.run.pipeline import Pipeline

PROTOCOL = 1


def gate_problem(exp: Any) -> str:
    """Why the gate cannot measure this config as run.py does ('' when it can)."""
    if exp.measure.max_new_tokens < 2:
        return (f"measure.max_new_tokens={exp.measure.max_new_tokens} has no decode phase (zero decode tokens: the "
                "first token comes from the prefill), so there is no decode tokens/s to compare; use >= 2")
    return ""


class Worker:
    """The state of one side between requests: its config, then its loaded pipeline."""

    def __init__(self, make_pipeline: Callable[[Any, str], Any] = Pipeline):
        self.make_pipeline = make_pipeline
        self.pipe: Any = None
        self.loaded = False
        self.next_batch = 0

    def check(self, overrides: list[str]) -> dict:
        if self.pipe is not None:
            raise RuntimeError("'check' after 'load': one worker measures one config")
        if problem := group_choice_problem(list(overrides)):  # one line, not Hydra's MissingConfigException
            raise ConfigError([problem])
        exp = build(compose(list(overrides)))  # ConfigError lists every problem; nothing loaded yet
        if problem := gate_problem(exp):
            raise ConfigError([problem])
        self.pipe = self.make_pipeline(exp, measure.resolve_device(exp.measure.device))
        self.pipe.preflight()
        return exp.config

    def load(self) -> dict:
        self.pipe.load()
        self.loaded = True
        return self.pipe.info()

    def block(self, min_tokens: int) -> dict:
        """Generate calls of the next batches (cycling) until at least `min_tokens` decode tokens."""
        tokens, wall, calls = 0, 0.0, 0
        start = time.time()
        while tokens < max(1, min_tokens):
            gen = self.pipe.generate(self.next_batch)
            self.next_batch += 1
            calls += 1
            if gen.decode_tokens <= 0:
                raise RuntimeError(f"generate call {calls} of a block gave zero decode tokens (every row stopped at "
                                   "its first token?); the gate needs decode steps to time")
            tokens += int(gen.decode_tokens)
            wall += float(gen.decode_s)  # decode_wall_s where the loop records it, as run.py's metric uses
        return {"decode_tokens": tokens, "decode_wall_s": wall, "generations": calls, "wall": [start, time.time()]}

    def accuracy(self) -> dict:
        out = {k: v for k, v in self.pipe.accuracy().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out["greedy_tokens"] = [[int(t) for t in seq] for seq in self.pipe.greedy_tokens()]
        return out

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None


def answer(worker: Worker, req: dict) -> dict:
    """The reply to one request (module docstring); raises on a failed one."""
    cmd = req.get("cmd")
    if cmd == "hello":
        return {"ok": True, "protocol": PROTOCOL, "root": str(Path(__file__).resolve().parents[2])}  # its code
    if cmd == "check":
        return {"ok": True, "config": worker.check(req["overrides"])}
    if cmd in ("load", "block", "accuracy") and worker.pipe is None:
        return {"ok": False, "error": f"{cmd!r} before 'check'"}
    if cmd in ("block", "accuracy") and not worker.loaded:
        return {"ok": False, "error": f"{cmd!r} before 'load'"}
    if cmd == "load":
        return {"ok": True, "info": worker.load()}
    if cmd == "block":
        return {"ok": True, "block": worker.block(int(req["min_tokens"]))}
    if cmd == "accuracy":
        return {"ok": True, "metrics": worker.accuracy()}
    return {"ok": False, "error": f"unknown request {cmd!r}; use hello, check, load, block, accuracy or quit"}


def serve(stdin: TextIO, reply: TextIO, worker: Worker | None = None) -> None:
    """Answer requests until `quit` or the end of the input."""
    worker = worker or Worker()

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        for line in stdin:
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                if req.get("cmd") == "quit":
                    send({"ok": True})
                    break
                send(answer(worker, req))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the gate as one line
                text = str(exc).splitlines()[0] if str(exc) else ""
                if not isinstance(exc, QuantbenchError):  # a user-facing error is its own line; others name their type
                    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
                send({"ok": False, "error": text})
    finally:
        worker.close()


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the protocol owns the real stdout; anything a library prints goes to stderr (the gate's worker log)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    quiet_third_party()
    with measure.own_heap():  # the pipeline's collections scan what it made, not every imported module
        serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
