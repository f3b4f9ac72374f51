"""llama.cpp's `llama-server`, started and stopped by quantbench for one load run.

The binary is built once by `scripts/setup.sh --all` from the vendored llama.cpp of the pinned llama-cpp-python
0.3.36 sdist, in the same build as `engine=llama_cpp`'s shared libraries (scripts/llama_cpp.sh: one wheel, cached
per CPU); it runs from `llama_cpp/lib` beside them, linked as `.venv/bin/llama-server`; `QUANTBENCH_LLAMA_SERVER`
names another binary. It serves the GGUF of the format
under test with continuous batching (`--parallel N`) on a free loopback port; its log goes to the run's log.

No server outlives its run: it stays in the run's process group (a sweep cell killed by its timeout takes the
server with it: SIGKILL to the group), and the kernel kills it when the process that started it dies for any
reason (PR_SET_PDEATHSIG: a run ended by SIGTERM or SIGKILL); a normal end stops it with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.errors import QuantbenchError

ENV = "QUANTBENCH_LLAMA_SERVER"
BUILD_HINT = ("llama-server is not built: run `scripts/setup.sh --all` (builds it once from the pinned llama-cpp-python "
              f"0.3.36 source, cached per CPU), set {ENV}=/path/to/llama-server, or give a running server with "
              "load.url=http://host:port")
PR_SET_PDEATHSIG = 1


def binary() -> Path:
    """The llama-server to start; one line saying how to get it when there is none."""
    path = Path(os.environ.get(ENV) or Path(sys.executable).parent / "llama-server")
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise QuantbenchError(BUILD_HINT + (f" ({ENV}={path} is not an executable file)" if os.environ.get(ENV) else ""))
    return path


def version() -> str:
    """The build that runs, from `llama-server --version` ('0.5.0-dev (build 1, commit 0c1e570)'); '?' if unsaid."""
    try:
        out = subprocess.run([str(binary()), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = [ln.split(":", 1)[1].strip() for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version:")]
    return lines[0] if lines else "?"


def system_info_line() -> str:
    """The binary's CPU features as llama.cpp prints them ('CPU : SSE3 = 1 | AVX = 1 | ...'); '' if unsaid.

    llama-server prints its `system_info:` line only at verbosity 4, before it loads a model: a start at `-lv 4` on a
    file that does not exist prints it and exits (milliseconds), leaving the timed server at its default verbosity.
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(binary()), "-lv", "4", "-m", str(Path(tmp) / "absent.gguf"), "--host", "127.0.0.1",
               "--port", str(free_port())]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=30,
                                 stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        except (OSError, subprocess.TimeoutExpired):
            return ""
    lines = [ln.split("|", 1)[1] for ln in (out.stdout + out.stderr).splitlines() if "system_info:" in ln and "|" in ln]
    return lines[0].strip() if lines else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class LlamaServer:
    """One llama-server process (module docstring). `start()` returns once `/health` answers 200."""

    def __init__(self, gguf: Path, *, threads: int, parallel: int, ctx_per_slot: int, log_file: Path,
                 batch: int = 512, flash_attn: bool = False):
        self.gguf, self.threads, self.parallel, self.flash_attn = gguf, threads, parallel, flash_attn
        self.ctx = ctx_per_slot * parallel  # llama-server splits -c evenly over its slots
        self.batch, self.log_file = batch, log_file
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_start = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(binary()), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "--parallel", str(self.parallel), "-c", str(self.ctx), "-t", str(self.threads),
                "-tb", str(self.threads), "-b", str(self.batch), "-ub", str(self.batch), "--cont-batching",
                "-fa", "on" if self.flash_attn else "off",  # explicit: its default 'auto' differs from in-process
                "--no-webui", "--no-warmup"]

    def start(self, timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- llama-server: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)  # same process group: see module docstring
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (why := self.problem()):
                raise QuantbenchError(why.replace("mid-run", "while starting"))
            if self.health() == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise QuantbenchError(f"llama-server did not answer /health within {timeout_s:.0f} s; {self.tail()}")

    def health(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return 0
        finally:
            conn.close()

    def tail(self, lines: int = 3) -> str:
        """The last lines of this server's part of the log, on one line."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(self.log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return f"log {self.log_file} unreadable"
        last = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
        return f"log tail ({self.log_file}): " + " | ".join(last)

    def problem(self) -> str:
        """'' while the server runs; once it has exited, one line with its exit code and the tail of its log."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        code = self.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"llama-server died mid-run ({how}); {self.tail()}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
