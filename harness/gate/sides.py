"""The two sides of a gate: a config measured in this process, or a git revision measured by a worker.

Both kinds answer the same calls, so the interleaving (harness/gate/interleave.py) does not care which
it drives:

- `validate()`: every config problem before anything loads (returns the plain config, or {});
- `load()`: load the model once (returns info: run name, device, threads, torch, config);
- `block(steps, warmup)`: one block of `steps` timed decode steps, `{"step_s": [...], "tokens": n}`;
- `accuracy()`: the deterministic metrics (perplexity, KL, top-1 agreement, greedy tokens);
- `close()`: free the model; for a revision, stop the worker and remove its worktree.

`InProcessSide` holds a `harness.gate_worker.LoadedSide` (its own model, KV cache and prompt state), so
two config sides share this process and alternate block by block. `WorktreeSide` checks a revision out
into a temporary `git worktree` and starts `harness/gate_worker.py` there, speaking JSON lines over
its stdin/stdout; two revision sides are two such workers, taking turns because the gate asks them one
at a time.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from harness.gate.errors import GateError

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "harness" / "gate_worker.py"


class InProcessSide:
    """A side measured in this process (current checkout)."""

    def __init__(self, label: str, overrides: list[str]):
        self.label, self.overrides, self.rev = label, overrides, ""
        self._side: Any = None

    def validate(self) -> dict:
        """Compose + build without loading (every config problem at once); returns the plain config."""
        from harness.config import build, compose

        exp = build(compose(self.overrides))
        exp.model.preflight()
        exp.accuracy.preflight()
        return exp.config

    def load(self) -> dict:
        from harness.gate_worker import LoadedSide

        self._side = LoadedSide(self.overrides)
        return self._side.info()

    def block(self, steps: int, warmup: int) -> dict:
        return self._side.block(steps, warmup)

    def accuracy(self) -> dict:
        return self._side.accuracy()

    def close(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None


class WorktreeSide:
    """A side measured by a worker process running a git revision's code from a temporary worktree."""

    def __init__(self, label: str, overrides: list[str], rev: str, timeout_s: float):
        self.label, self.overrides, self.rev, self.timeout_s = label, overrides, rev, timeout_s
        self.sha = ""
        self.tmp: Path | None = None
        self.root: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_path: Path | None = None

    def validate(self) -> dict:
        sha = _git("rev-parse", "--verify", "--quiet", f"{self.rev}^{{commit}}")
        if not sha:
            raise GateError(f"--{self.label}-rev {self.rev!r} is not a commit in {REPO}; give a branch, tag or sha")
        self.sha = sha
        return {}

    def load(self) -> dict:
        self.tmp = Path(tempfile.mkdtemp(prefix="qb-gate-"))
        self.root = self.tmp / "tree"
        out = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.root), self.sha],
                             capture_output=True, text=True)
        if out.returncode:
            raise GateError(f"git worktree add {self.rev} failed: {out.stderr.strip().splitlines()[-1:]}")
        self.stderr_path = self.tmp / "worker.log"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTHONPATH", None)
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), str(self.root)], cwd=self.root, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        return self._ask({"cmd": "load", "overrides": self.overrides})["info"]

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _ask(self, request: dict) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        where = f"{self.label} at {self.rev}"
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty as exc:
            raise GateError(f"{where}: no answer to {request['cmd']!r} within {self.timeout_s:.0f} s; raise "
                            "--timeout") from exc
        except OSError:
            line = None
        if line is None:
            raise GateError(f"{where}: worker exited ({self._tail()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise GateError(f"{where}: {reply.get('error', 'failed')}")
        return reply

    def _tail(self) -> str:
        try:
            lines = [x for x in (self.stderr_path.read_text().splitlines() if self.stderr_path else []) if x.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    def block(self, steps: int, warmup: int) -> dict:
        return self._ask({"cmd": "block", "steps": steps, "warmup": warmup})["block"]

    def accuracy(self) -> dict:
        return self._ask({"cmd": "accuracy"})["metrics"]

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.poll() is None:
                    self._ask({"cmd": "quit"})
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stuck worker is killed, the gate's verdict stands
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.root is not None:
            out = subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.root)],
                                 capture_output=True, text=True)
            if out.returncode:
                shutil.rmtree(self.root, ignore_errors=True)
                subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
            self.root = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def make_side(label: str, overrides: list[str], rev: str, timeout_s: float):
    return WorktreeSide(label, overrides, rev, timeout_s) if rev else InProcessSide(label, overrides)
