"""One side of a regression gate: load a config once, then measure it on request, block by block.

`harness.gate` compares a baseline and a candidate by alternating short blocks of decode steps of
both (A B B A ...; harness/gate/interleave.py). Loading a model is far costlier than a block, so each
side is loaded once and kept:

- `LoadedSide(overrides)` composes, validates and loads one config in this process (the gate holds
  two of them, each with its own model, KV cache and prompt state, when both sides run this code);
  `block(steps, warmup)` runs one block (`BlockDecoder`) and returns its step times;
  `accuracy()` returns the deterministic metrics the gate compares with a committed baseline file
  (perplexity, KL, top-1 agreement, greedy tokens of the fixed prompts).
- Run as a script (`python harness/gate_worker.py <project root>`), the same class serves requests
  for another checkout of the project (a git revision in a temporary worktree): one JSON request per
  line on stdin, one JSON reply per line on stdout. The gate asks its two sides in turn, so two such
  workers take turns block by block (the idle one waits on its stdin). The script puts
  `<project root>` first on `sys.path`, so every `harness.*` / `quantizers.*` / `strategies.*` module
  comes from that revision, while this file (from the current checkout) only drives it. It therefore
  uses only long-standing interfaces (`compose`, `build`, `quantizer.load`, `strategy.generate`,
  `strategies.decode.forward/left_pad/make_cache`, `measure.summarize`, `accuracy.score`), imported
  lazily after `sys.path` is set.

Requests: {"cmd": "load", "overrides": [...]}, {"cmd": "block", "steps": k, "warmup": w},
{"cmd": "measure"} (one whole repetition, the pre-block protocol), {"cmd": "accuracy"}, {"cmd": "quit"}.
Replies: {"ok": true, ...} or {"ok": false, "error": "<one line>"}; a block reply is
{"ok": true, "block": {"step_s": [...], "tokens": n}}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

STEPWISE = ("Greedy", "StaticBatch")  # strategies whose generate() is the plain greedy loop of strategies/decode.py


class BlockDecoder:
    """Greedy decoding of a side's prompt batches, a few steps at a time, resumable between calls.

    The gate alternates short blocks of two sides, so each side keeps its own decoding state here (the
    current batch, its KV cache, attention mask and last token) between `block()` calls. A prompt's
    prefill is untimed; every decode step is timed exactly as strategies/decode.py times it (from the
    forward to the token on the host, synchronized), with that module's own `forward`, `left_pad` and
    cache helpers and the test-only injected slowdowns. When a sequence has produced
    `max_new_tokens` tokens the next batch of the prompt set starts (cycling), so every block decodes
    at cache depths a normal run visits. Rows are decoded to the full length (no stop at EOS): a
    block measures the cost of a step, and every row of a step counts as a token.
    """

    def __init__(self, model, batches: list, opts):
        import torch

        from harness.measure import now, sync
        from strategies import decode

        try:
            from strategies.inject import injected_step
        except ImportError:  # a revision from before the injection helper: it had the spin-wait only
            injected_step = None
            if getattr(opts, "inject_slowdown", 0) or getattr(opts, "inject_work", 0):
                raise RuntimeError("this revision has no strategies/inject.py; the gate's block decoder cannot "
                                   "inject a slowdown into it") from None
        self.torch, self.decode, self.injected_step, self.now, self.sync = torch, decode, injected_step, now, sync
        self.model, self.batches, self.opts = model, batches, opts
        if opts.max_new_tokens < 2:
            raise RuntimeError("zero decode tokens per prompt (measure.max_new_tokens=1: only the prefill token); "
                               "use measure.max_new_tokens >= 2")
        self.batch = -1
        self.left = 0  # decode steps left in the current sequence
        self.tokens: list[list[int]] = []  # the current sequences (prefill token first), as a run would emit them
        self.finished: list[list[int]] = []  # the sequences of the last batch that reached max_new_tokens

    def _start(self) -> None:
        """Prefill the next batch (untimed) and keep its state."""
        torch, d, opts = self.torch, self.decode, self.opts
        self.batch = (self.batch + 1) % len(self.batches)
        ids, mask = d.left_pad(self.batches[self.batch], opts.pad_token_id, opts.device)
        bsz, width = ids.shape
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        fast = getattr(opts, "fast_path", None)
        size = width + opts.max_new_tokens
        self.cache = (fast.make_cache(self.model, bsz, size) if fast is not None
                      else d.make_cache(self.model, opts, bsz, size))
        self.step_fn = fast.step if fast is not None else d.forward
        logits = d.forward(self.model, ids, mask, pos, self.cache, torch.arange(width, device=opts.device))
        self.nxt = logits.argmax(-1)
        if self.left == 0 and self.tokens:
            self.finished = self.tokens
        self.tokens = [[t] for t in self.nxt.tolist()]
        self.mask, self.last_pos, self.width, self.done = mask, pos[:, -1:], width, 0
        self.left = opts.max_new_tokens - 1

    def _step(self) -> float:
        """One decode step of the current sequence; returns its timed duration."""
        torch, opts, device, now, sync = self.torch, self.opts, self.opts.device, self.now, self.sync
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        self.last_pos = self.last_pos + 1
        cpos = torch.tensor([self.width + self.done], device=device)
        sync(device)
        t = now()
        logits = self.step_fn(self.model, self.nxt[:, None], self.mask, self.last_pos, self.cache, cpos)
        self.nxt = logits.argmax(-1)
        tokens = self.nxt.tolist()  # the host copy a real decode loop makes (EOS test, streaming)
        sync(device)
        dt = now() - t
        if self.injected_step is not None and (opts.inject_slowdown > 0 or getattr(opts, "inject_work", 0) > 0):
            dt = self.injected_step(opts, t, dt)
        for row, tok in zip(self.tokens, tokens, strict=True):
            row.append(tok)
        self.done += 1
        self.left -= 1
        return dt

    def block(self, steps: int, warmup: int) -> dict:
        """`warmup` untimed steps, then `steps` timed ones; a step right after a prefill is untimed too."""
        torch = self.torch
        no_grad = getattr(self.model, "quantbench_grad_mode", "inference") == "no_grad"
        timed: list[float] = []
        skip = warmup
        start = time.time()
        with torch.no_grad() if no_grad else torch.inference_mode():
            while len(timed) < steps:
                if self.left == 0:
                    self._start()
                    skip = max(skip, 1)
                dt = self._step()
                if skip:
                    skip -= 1
                else:
                    timed.append(dt)
        # wall: when the block ran (epoch seconds), so a caller can check that two sides never overlapped
        return {"step_s": timed, "tokens": steps * int(self.nxt.shape[0]), "wall": [start, time.time()]}


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
                      inject_slowdown=m.inject_slowdown, inject_work=getattr(m, "inject_work", 0.0), cache=m.cache)
        self.opts = DecodeOptions(**{k: v for k, v in wanted.items() if k in known})
        exp.strategy.setup(model=self.model, tokenizer=self.tokenizer, opts=self.opts, experiment=exp)
        prompts = encode_prompts(self.tokenizer, PROMPT_SETS[m.prompts], m.chat_template)
        self.batches = exp.strategy.batches(prompts)
        if getattr(m, "compile", False):  # the compiled fast path (newer revisions only), set up as a run does
            from harness import fast_path

            fast_path.prepare(exp, self.model, self.opts, self.batches, fast_path.preflight(exp, self.device))
        for _ in range(m.warmup):
            self._pass()
        self.decoder = (BlockDecoder(self.model, self.batches, self.opts)
                        if type(exp.strategy).__name__ in STEPWISE else None)
        self._next_batch = 0

    def _pass(self) -> list[Any]:
        return [self.exp.strategy.generate(self.model, batch, self.opts) for batch in self.batches]

    def info(self) -> dict[str, Any]:
        import torch

        return {"run_name": f"{self.exp.model.name}-{self.exp.quantizer.name}-{self.exp.strategy.name}".lower(),
                "device": self.device, "threads": self.threads, "torch": torch.__version__,
                "config": self.exp.config}

    def block(self, steps: int, warmup: int = 1) -> dict:
        """One block: `steps` timed decode steps ({"step_s": [...], "tokens": n}).

        Strategies that are not the plain greedy loop (speculative, continuous batching) cannot be cut
        into steps from outside; for them a block is one whole `generate` call of the next batch.
        """
        import torch

        if torch.get_num_threads() != self.threads:  # the other side (same process) may use another count
            torch.set_num_threads(self.threads)
        if self.decoder is not None:
            return self.decoder.block(steps, warmup)
        batch = self.batches[self._next_batch % len(self.batches)]
        self._next_batch += 1
        start = time.time()
        gen = self.exp.strategy.generate(self.model, batch, self.opts)
        if not gen.decode_tokens:
            raise RuntimeError("zero decode tokens were generated; use measure.max_new_tokens >= 2")
        return {"step_s": [float(x) for x in gen.step_s], "tokens": int(gen.decode_tokens),
                "wall": [start, time.time()]}

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
            elif cmd == "block":
                send({"ok": True, "block": side.block(int(req["steps"]), int(req.get("warmup", 1)))})
            elif cmd == "measure":
                send({"ok": True, "metrics": side.measure()})
            elif cmd == "accuracy":
                send({"ok": True, "metrics": side.accuracy()})
            else:
                send({"ok": False, "error": f"unknown request {cmd!r}; use load, block, measure, accuracy or quit"})
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
