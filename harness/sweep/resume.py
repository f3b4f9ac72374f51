"""What lets a sweep resume safely: the resume key of a cell, and one sweep at a time per folder.

Resume key. A resumed sweep reuses a cell's OK result only when everything that decides its numbers is
the same as now, besides the config hash: the code as it ran (`code_version`: the commit plus a hash of
the uncommitted diff of tracked files and of untracked .py files), the CPU (model and instruction set), the
GPU model for a CUDA cell, and the versions of torch, of the quantizer's library (and of a speculative
draft's quantizer) and of the engine's (transformers or llama-cpp-python). The key is stored on the result (tag `resume.key`, JSON) by the sweep that recorded
it; a result without one, or a part that is `unknown` on either side, is never reused. `differences`
names what differs, so the sweep can say why it reruns.

Folder lock. Two sweeps resuming one folder at once would run the same cells twice and interleave
their manifests and parent run: `hold_folder` takes an exclusive `flock` on `<folder>/.lock` for the
life of the sweep process (the kernel drops it when the process dies, SIGKILL included, so a lock is
never stale) and refuses a second holder with one line naming the first.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import cgroup
from harness.env import REPO, parse_cpuinfo
from harness.errors import QuantbenchError

UNKNOWN = "unknown"
KEY_TAG = "resume.key"  # the key the result was recorded with (JSON)
REUSED_TAG = "resume.reused"  # on a reused result: which invocation reused it, and why
RERUN_TAG = "resume.rerun"  # on a rerun result: why the stored OK result was not reused
# Tracked files whose changes cannot move a number: left out of the diff hash, so editing docs keeps a resume
NOT_CODE = (":(exclude)*.md", ":(exclude)docs/**", ":(exclude)tests/**")
LOCK_NAME = ".lock"
# the distribution that runs each engine's model (its version is part of the key, beside torch's)
ENGINE_LIBRARIES = {"transformers": "transformers", "llama_cpp": "llama_cpp_python"}


# ------------------------------------------------------------------------------------------------ key
def _git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=30)
    if done.returncode != 0:
        raise OSError(done.stderr.decode(errors="replace").strip() or f"git {args[0]} failed")
    return done.stdout


def code_version(repo: Path = REPO) -> str:
    """`<sha12>` for a clean checkout, `<sha12>-dirty.<hash12>` with uncommitted code, `unknown` outside git.

    The hash covers `git diff HEAD` of tracked files (docs and tests left out) and the path and content
    of every untracked, not ignored .py file: two different uncommitted edits never share a version.
    """
    try:
        sha = _git(repo, "rev-parse", "--verify", "HEAD").decode().strip()
        diff = _git(repo, "diff", "HEAD", "--binary", "--no-ext-diff", "--", ".", *NOT_CODE)
        untracked = _git(repo, "ls-files", "--others", "--exclude-standard", "-z", "--", "*.py", *NOT_CODE)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    if not sha:
        return UNKNOWN
    files = sorted(p for p in untracked.decode().split("\0") if p)
    if not diff and not files:
        return sha[:12]
    h = hashlib.sha256(diff)
    for rel in files:
        h.update(b"\0" + rel.encode() + b"\0")
        try:
            h.update((Path(repo) / rel).read_bytes())
        except OSError:
            h.update(b"<unreadable>")
    return f"{sha[:12]}-dirty.{h.hexdigest()[:12]}"


def cpu_key(cpuinfo: str | None = None) -> str:
    """'AMD EPYC ... (AuthenticAMD family 26 model 2, avx512_bf16)': model and ISA tier, from /proc/cpuinfo
    (without importing torch: the sweep process stays light)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return UNKNOWN
    info = parse_cpuinfo(cpuinfo)
    if not info.model_name and not info.family:
        return UNKNOWN
    return info.key()


def _dist_version(*names: str) -> str:
    for name in names:
        if not name:
            continue
        try:
            return importlib.metadata.version(name)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    return UNKNOWN


def library_versions(quantizer: Any) -> dict[str, str]:
    """torch's version and those of the quantizer's library (after its preflight, for `auto`'s choice)."""
    out = {"torch": _dist_version("torch")}
    try:
        out.update(quantizer.versions() or {})
    except Exception:  # noqa: BLE001 - a quantizer that cannot say: its library is unknown, never reused
        out["quantizer library"] = UNKNOWN
    library = getattr(quantizer, "library", "")
    if library and not (set(out) - {"torch"}):  # e.g. import name optimum.quanto, distribution optimum-quanto
        out[library] = _dist_version(getattr(quantizer, "pip_name", ""), library, library.replace(".", "-"),
                                     library.replace("_", "-"))
    return out


def gpu_key(visible: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3': the model of the CUDA device a cell runs on (the first of $CUDA_VISIBLE_DEVICES), from
    nvidia-smi: the sweep process creates no CUDA context (it would hold GPU memory beside every cell's)."""
    ident = (os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible).split(",")[0].strip()
    try:
        done = subprocess.run(["nvidia-smi", "-i", ident or "0", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    names = done.stdout.strip().splitlines()
    return names[0].strip() if done.returncode == 0 and names and names[0].strip() else UNKNOWN


def cell_key(code: str, quantizer: Any, engine: str = "", threads: int = 0, draft_quantizer: Any = None,
             cuda: bool = False) -> dict[str, str]:
    """The resume key of a cell run now, with `code` the sweep's `code_version()`, `engine` its name and `threads`
    its measure.threads (0: the cores this process may use now, capped by a cgroup CPU quota as set_threads caps it,
    so `taskset` changes the key too). `draft_quantizer`: the quantizer of a model the strategy loads beside the
    target (a speculative draft), whose library decides numbers too; `cuda`: the cell runs on a GPU, whose model
    (part `gpu`) decides them more than the host's CPU does."""
    key = {"code": code or UNKNOWN, "cpu": cpu_key(), "threads": str(threads or cgroup.usable_cpus()),
           **library_versions(quantizer)}
    if cuda:
        key["gpu"] = gpu_key()
    if draft_quantizer is not None:
        for library, version in library_versions(draft_quantizer).items():
            key.setdefault(library, version)
    if engine in ENGINE_LIBRARIES:
        dist = ENGINE_LIBRARIES[engine]
        key.setdefault(dist, _dist_version(dist, dist.replace("_", "-")))
    return key


def differences(stored_tags: dict, current: dict[str, str]) -> list[str]:
    """Why a stored result may not be reused for `current` (empty: it may). `unknown` never matches."""
    raw = stored_tags.get(KEY_TAG)
    try:
        stored = json.loads(raw) if raw else None
    except ValueError:
        stored = None
    if not isinstance(stored, dict):
        return ["the stored result has no resume key (recorded by an older quantbench)"]
    why = []
    for part in dict.fromkeys([*current, *stored]):  # current's order first, then parts only stored has
        was, now = str(stored.get(part, UNKNOWN)), str(current.get(part, UNKNOWN))
        if UNKNOWN in (was, now):
            hint = " (not a git checkout?)" if part == "code" else ""
            why.append(f"{part} version unknown{hint}: never reused" if part == "code" else
                       f"{part} unknown (stored {was}, now {now}): never reused")
        elif was != now:
            why.append(f"{part} differs (stored {was}, now {now})")
    return why


def describe(key: dict[str, str]) -> str:
    """'same code abc, CPU ..., torch 2.13.0, torchao 0.18.0': why a reused result is this run's."""
    rest = ", ".join(f"{k} {v}" for k, v in key.items() if k not in ("code", "cpu"))
    return f"same code {key.get('code')}, CPU {key.get('cpu')}" + (f", {rest}" if rest else "")


# ---------------------------------------------------------------------------------------------- lock
class FolderLock:
    """An exclusive hold on a sweep folder for this process (see the module docstring)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = -1


def hold_folder(folder: Path, name: str) -> FolderLock:
    """Take the sweep folder or raise QuantbenchError naming the sweep that holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (O_CLOEXEC by default)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
        raise QuantbenchError(f"sweep {name} is already running on {folder} (pid {holder.get('pid', '?')} on "
                              f"{holder.get('host', '?')}, since {since}): wait for it to finish, or stop it; "
                              "a sweep resumes by running it again") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
    return FolderLock(fd, path)


def remove_partial_writes(folder: Path) -> list[Path]:
    """Delete the temporary files of result writes that were interrupted (SIGKILL mid-write): never results.

    Called by a sweep that holds its folder, so no writer of this folder is alive."""
    removed = []
    for tmp in [*Path(folder).glob("*.tmp"), *Path(folder).glob("cells/*.tmp")]:
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            continue
    return removed
