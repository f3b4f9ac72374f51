"""One side of a regression gate: load a config once, then measure it on request.

`harness.gate` compares a baseline and a candidate by alternating fresh measurements of both (A B A B
...). Loading a model is far costlier than one measurement, so each side is loaded once and kept:

- `LoadedSide(overrides)` composes, validates and loads one config in this process; `measure()` runs
  one repetition (the side's `measure.repetitions` timed passes over its prompt set) and returns the
  decode tokens/s of that repetition; `accuracy()` returns the deterministic metrics the gate compares
  with a committed baseline file (perplexity, KL, top-1 agreement, greedy tokens of the fixed prompts).
- Run as a script (`python harness/gate_worker.py <project root>`), the same class serves requests
  for another checkout of the project (a git revision in a temporary worktree): one JSON request per
  line on stdin, one JSON reply per line on stdout. The script puts `<project root>` first on
  `sys.path`, so every `harness.*` / `quantizers.*` / `strategies.*` module comes from that revision,
  while this file (from the current checkout) only drives it. It therefore uses only long-standing
  interfaces (`compose`, `build`, `quantizer.load`, `strategy.generate`, `measure.summarize`,
  `accuracy.score`), imported lazily after `sys.path` is set.

Requests: {"cmd": "load", "overrides": [...]}, {"cmd": "measure"}, {"cmd": "accuracy"},
{"cmd": "quit"}. Replies: {"ok": true, ...} or {"ok": false, "error": "<one line>"}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


class LoadedSide:
    """A validated, loaded experiment that can be measured many times (see module docstring)."""

    def __init__(self, overrides: list[str]):
        import dataclasses

        import torch

        from harness import measure
        from harness.config import build, compose
        from harness.engines import encode_prompts
        from harness.models import load_tokenizer
        from harness.prompts import PROMPT_SETS
        from strategies.base import DecodeOptions

        self.overrides = list(overrides)
        self.exp = exp = build(compose(self.overrides))  # ConfigError lists every problem, nothing loaded yet
        m = exp.measure
        self.device = measure.resolve_device(m.device)
        exp.engine.preflight(exp, self.device)
        self.threads = measure.set_threads(m.threads)
        torch.manual_seed(m.seed)
        self.tokenizer = load_tokenizer(exp.model)
        self.model = exp.quantizer.load(exp.model, tokenizer=self.tokenizer, device=self.device, experiment=exp)
        exp.quantizer.audit(self.model)  # a silent no-op quantizer fails here, as in a normal run
        known = {f.name for f in dataclasses.fields(DecodeOptions)}
        wanted = dict(device=self.device, max_new_tokens=m.max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                      pad_token_id=self.tokenizer.pad_token_id, stop_at_eos=m.stop_at_eos,
                      inject_slowdown=m.inject_slowdown, cache=m.cache)
        self.opts = DecodeOptions(**{k: v for k, v in wanted.items() if k in known})
        exp.strategy.setup(model=self.model, tokenizer=self.tokenizer, opts=self.opts, experiment=exp)
        prompts = encode_prompts(self.tokenizer, PROMPT_SETS[m.prompts], m.chat_template)
        self.batches = exp.strategy.batches(prompts)
        if getattr(m, "compile", False):  # the compiled fast path (newer revisions only), set up as a run does
            from harness import fast_path

            fast_path.prepare(exp, self.model, self.opts, self.batches, fast_path.preflight(exp, self.device))
        for _ in range(m.warmup):
            self._pass()

    def _pass(self) -> list[Any]:
        return [self.exp.strategy.generate(self.model, batch, self.opts) for batch in self.batches]

    def info(self) -> dict[str, Any]:
        import torch

        return {"run_name": f"{self.exp.model.name}-{self.exp.quantizer.name}-{self.exp.strategy.name}".lower(),
                "device": self.device, "threads": self.threads, "torch": torch.__version__,
                "config": self.exp.config}

    def measure(self) -> dict[str, float]:
        """One repetition: `measure.repetitions` timed passes; the runner's metric over them."""
        import torch

        from harness import measure

        torch.set_num_threads(self.threads)  # the other side (same process) may use another count
        gens = []
        for _ in range(self.exp.measure.repetitions):
            gens.extend(self._pass())
        summary = measure.summarize(gens)
        return {"decode_tokens_per_s": float(summary["decode_tokens_per_s"]),
                "decode_tokens": float(sum(g.decode_tokens for g in gens)),
                "decode_s": float(sum(g.decode_s for g in gens)),
                "timed_generations": float(len(gens))}

    def accuracy(self) -> dict[str, Any]:
        """Deterministic metrics: perplexity (+ KL, top-1 agreement vs the reference) and greedy tokens."""
        import torch

        from harness import accuracy as acc

        torch.set_num_threads(self.threads)
        torch.manual_seed(self.exp.measure.seed)
        out: dict[str, Any] = {}
        cfg = self.exp.accuracy
        if cfg.enabled:
            reference = None
            if cfg.kl:
                reference, _ = acc.ensure_reference(self.exp.model, self.tokenizer, cfg, self.device)
            ids = acc.corpus_tokens(self.tokenizer, cfg.corpus, cfg.max_tokens)
            scores = acc.score(self.model, ids, cfg, self.device, reference=reference)
            out.update({k: float(v) for k, v in scores.items() if k != "record"})
        # greedy output of the fixed prompts, without the injected test slowdown (it changes no token)
        out["greedy_tokens"] = [list(map(int, seq)) for gen in self._pass() for seq in gen.sequences]
        return out

    def close(self) -> None:
        try:
            self.exp.strategy.teardown()
        finally:
            self.model = None


def serve(root: str, stdin: Any, reply: Any) -> None:
    """Answer requests (module docstring) until `quit` or end of input."""
    side: LoadedSide | None = None

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                send({"ok": True})
                break
            if cmd == "load":
                side = LoadedSide(req["overrides"])
                send({"ok": True, "info": side.info()})
            elif side is None:
                send({"ok": False, "error": f"{cmd!r} before 'load'"})
            elif cmd == "measure":
                send({"ok": True, "metrics": side.measure()})
            elif cmd == "accuracy":
                send({"ok": True, "metrics": side.accuracy()})
            else:
                send({"ok": False, "error": f"unknown request {cmd!r}; use load, measure, accuracy or quit"})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the gate as one line
            text = str(exc).splitlines()[0] if str(exc) else ""
            send({"ok": False, "error": f"{type(exc).__name__}: {text}" if text else type(exc).__name__,
                  "root": root})
    if side is not None:
        side.close()


def main() -> None:
    root = os.path.abspath(sys.argv[1])
    # sys.path[0] is this file's folder; the project modules must come from `root` (another revision)
    sys.path[:1] = [root]
    os.chdir(root)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the protocol owns the real stdout; anything a library prints goes to stderr instead
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        from harness import quiet_third_party

        quiet_third_party()
    except ImportError:
        pass
    serve(root, sys.stdin, reply)


if __name__ == "__main__":
    main()
