"""The two sides of a gate: each a worker process (harness/gate/worker.py) on its own code.

Both sides are the same kind of process, so neither has an advantage the other lacks (its own
interpreter, allocator and thread pool; the idle one waits on its input while the other measures):

- a side without a revision runs `python -m harness.gate.worker` in this checkout, uncommitted changes
  included (what `make gate` measures as the candidate);
- a side with `--*-rev REV` runs it in a temporary `git worktree` of that revision, so every module,
  the measurement pipeline and the decode loop included, is the revision's own.

A side answers the calls the interleaving (harness/gate/interleave.py) makes:
`validate()` (git checks, nothing started), `start()` (the worker, and the protocol handshake),
`check()` (the config validated by the side's own code; nothing loads), `load()`, `block(min_tokens)`,
`accuracy()` and `close()` (stop the worker, remove the worktree).

A revision whose `harness/gate/worker.py` is missing or speaks another protocol is refused in one line
before anything starts, naming the first revision that speaks this gate's protocol.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.gate.errors import GateError

REPO = Path(__file__).resolve().parents[2]
WORKER_PATH = "harness/gate/worker.py"
PROTOCOL = 1  # the protocol this gate speaks: equal to harness/gate/worker.py's PROTOCOL (tested)
PROTOCOL_LINE = re.compile(r"^PROTOCOL\s*=\s*(\d+)\s*$", re.M)
WORKTREE_LOCK = threading.Lock()
QUIT_WAIT_S = 10.0  # a worker asked to quit exits in ~1.5 s; one that does not answer by then is killed


def git(*args: str, repo: Path | None = None) -> str:
    out = subprocess.run(["git", "-C", str(repo or REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def first_speaking(protocol: int = PROTOCOL, repo: Path | None = None) -> str:
    """'<sha> <subject>' of the first commit (in HEAD's history) whose worker speaks `protocol`, or ''."""
    log = git("log", "--reverse", "--format=%H %s", "HEAD", "--", WORKER_PATH, repo=repo)  # a few commits
    for line in log.splitlines():
        if revision_protocol(line.split(" ", 1)[0], repo) == protocol:
            return line
    return ""


def revision_protocol(sha: str, repo: Path | None = None) -> int | None:
    """The gate protocol of a revision's worker, read from the committed file (None: no worker)."""
    if subprocess.run(["git", "-C", str(repo or REPO), "cat-file", "-e", f"{sha}:{WORKER_PATH}"],
                      capture_output=True).returncode:
        return None
    found = PROTOCOL_LINE.search(git("show", f"{sha}:{WORKER_PATH}", repo=repo))
    return int(found.group(1)) if found else None


def protocol_problem(label: str, rev: str, sha: str, repo: Path | None = None) -> str:
    """One line when revision `sha` cannot be measured by this gate, else ''."""
    speaks = revision_protocol(sha, repo)
    if speaks == PROTOCOL:
        return ""
    first = first_speaking(PROTOCOL, repo) or "not yet committed"
    what = (f"predates gate protocol {PROTOCOL}" if speaks is None or speaks < PROTOCOL
            else f"speaks gate protocol {speaks}, this gate speaks {PROTOCOL}")
    return (f"--{label}-rev {rev} ({sha[:12]}) {what}; the first revision that speaks it is {first}; "
            "pick that or a later one")


class WorkerSide:
    """A side measured by a worker process on this checkout (`rev` empty) or on a revision's worktree."""

    def __init__(self, label: str, overrides: list[str], rev: str = "", timeout_s: float = 900.0,
                 repo: Path | None = None):
        self.label, self.overrides, self.rev, self.timeout_s = label, list(overrides), rev, timeout_s
        self.repo = repo or REPO
        self.sha = ""
        self.tmp: Path | None = None
        self.root: Path | None = None  # the worktree of a revision side
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log_path: Path | None = None
        self.stopping = threading.Event()  # `stop`: the gate was interrupted while a thread works this side

    @property
    def where(self) -> str:
        return f"{self.label} at {self.rev}" if self.rev else f"{self.label} (this checkout)"

    def validate(self) -> None:
        """Git checks only (nothing starts): the revision exists and its worker speaks this protocol."""
        if not self.rev:
            return
        sha = git("rev-parse", "--verify", "--quiet", f"{self.rev}^{{commit}}", repo=self.repo)
        if not sha:
            raise GateError(f"--{self.label}-rev {self.rev!r} is not a commit in {self.repo}; give a branch, tag "
                            "or sha (a CI checkout needs the history: fetch-depth: 0)")
        self.sha = sha
        if problem := protocol_problem(self.label, self.rev, sha, self.repo):
            raise GateError(problem)

    def stop(self) -> None:
        """Interrupted (Ctrl-C, SIGTERM) while a thread works this side: its request returns at once and nothing
        more starts, so the caller's `close` finds every folder, worktree and worker it has to remove."""
        self.stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def start(self) -> None:
        """Start the worker (in a temporary worktree for a revision) and check that it speaks PROTOCOL."""
        if self.stopping.is_set():
            raise GateError(f"{self.where}: stopped")
        self.tmp = Path(tempfile.mkdtemp(prefix="qb-gate-"))
        cwd = self.repo
        if self.rev:
            self.root = self.tmp / "tree"
            with WORKTREE_LOCK:  # the sides start at once (harness/gate/cli.py); git's worktree list takes one writer
                out = subprocess.run(["git", "-C", str(self.repo), "worktree", "add", "--detach", str(self.root),
                                      self.sha], capture_output=True, text=True)
            if out.returncode:
                self.root = None
                raise GateError(f"git worktree add {self.rev} failed: {(out.stderr.strip().splitlines() or [''])[-1]}")
            cwd = self.root
        if self.stopping.is_set():  # interrupted during the worktree: no worker after it
            raise GateError(f"{self.where}: stopped")
        self.log_path = self.tmp / "worker.log"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        # every module comes from the side's own checkout (cwd first on sys.path): PYTHONSAFEPATH would keep the cwd
        # off it, and the editable install would then serve this checkout's code to a revision side
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONSAFEPATH", None)
        with open(self.log_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.gate.worker"], cwd=cwd, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        hello = self.ask({"cmd": "hello"})
        if (speaks := hello.get("protocol")) != PROTOCOL:
            raise GateError(f"{self.where}: its worker speaks gate protocol {speaks}, this gate speaks {PROTOCOL}")
        # the worker says where its code came from (older revisions: their cwd): another checkout's code would
        # measure that code under this side's name
        if (root := hello.get("root")) and Path(root).resolve() != Path(cwd).resolve():
            raise GateError(f"{self.where}: its worker runs the code in {root}, not {cwd}; unset PYTHONPATH-like "
                            "settings that put another checkout first")

    def check(self) -> dict:
        """The config, validated and preflighted by the side's own code; nothing loads. Returns it (plain)."""
        return self.ask({"cmd": "check", "overrides": self.overrides})["config"]

    def load(self) -> dict:
        return self.ask({"cmd": "load"})["info"]

    def block(self, min_tokens: int) -> dict:
        return self.ask({"cmd": "block", "min_tokens": min_tokens})["block"]

    def accuracy(self) -> dict:
        return self.ask({"cmd": "accuracy"})["metrics"]

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _next_line(self) -> str | None:
        """The worker's next line within `timeout_s` (queue.Empty after it); None once it is stopped or gone."""
        deadline = time.monotonic() + self.timeout_s
        while not self.stopping.is_set():
            try:
                return self.lines.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise
        return None

    def ask(self, request: dict) -> dict:
        """Send one request, wait for its reply (at most `timeout_s`); a failed reply is a GateError."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self._next_line()
        except queue.Empty as exc:
            raise GateError(f"{self.where}: no answer to {request['cmd']!r} within {self.timeout_s:.0f} s; raise "
                            "--timeout") from exc
        except OSError:
            line = None
        if line is None:
            raise GateError(f"{self.where}: worker exited ({self._tail()})")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError as exc:
            raise GateError(f"{self.where}: not a protocol reply: {line.strip()[:200]!r}") from exc
        if not reply.get("ok"):
            raise GateError(f"{self.where}: {reply.get('error', 'failed')}")
        return reply

    def _tail(self) -> str:
        try:
            lines = [x for x in (self.log_path.read_text().splitlines() if self.log_path else []) if x.strip()]
        except OSError:
            lines = []
        return lines[-1][:300] if lines else "no output"

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.poll() is None:  # a worker that answers quits at once; a hung one is not waited for
                    self.timeout_s = min(self.timeout_s, QUIT_WAIT_S)  # again (it had its --timeout): killed
                    self.ask({"cmd": "quit"})
                self.proc.wait(timeout=QUIT_WAIT_S)
            except Exception:  # noqa: BLE001 - a stuck worker is killed, the gate's verdict stands
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.root is not None:
            out = subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.root)],
                                 capture_output=True, text=True)
            if out.returncode:
                shutil.rmtree(self.root, ignore_errors=True)
                subprocess.run(["git", "-C", str(self.repo), "worktree", "prune"], capture_output=True)
            self.root = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def code_of(side: WorkerSide) -> str:
    """The code a (validated) side runs: its revision's commit; for this checkout, its HEAD when nothing in it
    differs from HEAD (tracked changes and new untracked files count), else the checkout itself."""
    if side.rev:
        return side.sha
    if git("status", "--porcelain", repo=side.repo):
        return f"the uncommitted checkout {side.repo}"
    return git("rev-parse", "HEAD", repo=side.repo)


def same_config(a: list[str], b: list[str]) -> bool:
    """Two override lists that ask for the same run, as Hydra reads them: the last value of a key wins, and the
    order of different keys does not matter."""
    def last(overrides: list[str]) -> dict[str, str]:
        return {o.split("=", 1)[0]: o for o in overrides}

    return last(a) == last(b)


def self_comparison(base: WorkerSide, cand: WorkerSide) -> str:
    """One line when the two (validated) sides would run the same code on the same config, else ''. Such a gate
    cannot fail (the brief's "a CI gate that compares a commit with itself"): a push job whose BASE=origin/main is
    the pushed commit itself, `--baseline-rev HEAD` or `--candidate-rev HEAD` on a clean checkout, two sides of this
    checkout with one config (reordered or repeated overrides too), or `make gate BASE=` (no revision)."""
    if not same_config(base.overrides, cand.overrides) or (code := code_of(base)) != code_of(cand):
        return ""
    what = code[:12] if len(code) == 40 else code
    return (f"{base.where} and {cand.where} run the same code ({what}) on the same config: the gate would compare a "
            "commit with itself and could not fail; compare with the parent (BASE=HEAD~1) or the branch point "
            "(BASE=origin/main in a pull request), or pass --allow-same for an A/A noise check")


def make_side(label: str, overrides: list[str], rev: str, timeout_s: float, repo: Path | None = None) -> WorkerSide:
    return WorkerSide(label, overrides, rev, timeout_s, repo)
