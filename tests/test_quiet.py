"""Quiet by default: what a library prints while a model loads goes to the run's log file, not the terminal;
quantbench's own log lines still reach the terminal, and -v ($QUANTBENCH_VERBOSE) shows everything."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import pytest
from conftest import FAST

from harness import LOG_ENV, VERBOSE_ENV
from harness.config import build
from harness.run import runner
from quantizers.dtype import Dtype


@dataclass
class Noisy(Dtype):
    """A quantizer whose library is chatty by every route: print, native writes to fd 1 and 2, logging."""

    def load(self, *args, **kwargs):
        print("NOISE-print-stdout")
        print("NOISE-print-stderr", file=sys.stderr)
        os.write(1, b"NOISE-fd1\n")
        os.write(2, b"NOISE-fd2\n")
        logging.getLogger("somelib").warning("NOISE-logging")
        logging.getLogger("quantbench").warning("OURS-kept")
        return super().load(*args, **kwargs)


@pytest.fixture(autouse=True)
def console_logging(capfd):
    """What run.py sets up (basicConfig: a root handler on the console stream, here the captured one)."""
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    yield
    root.removeHandler(handler)


def _run(compose, tmp_path):
    exp = build(compose([*FAST, "accuracy.enabled=false", "measure.repetitions=1", "measure.warmup=0",
                         "measure.max_new_tokens=2", "tracking.enabled=false", f"tracking.results_dir={tmp_path}"]))
    exp.quantizer = Noisy(dtype="float32")
    return runner.execute(exp)


def test_library_output_goes_to_the_log_file_not_the_terminal(compose, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    log_file = tmp_path / "run.log"
    monkeypatch.setenv(LOG_ENV, str(log_file))  # what run.py sets: Hydra's job log
    result = _run(compose, tmp_path)
    out, err = capfd.readouterr()
    assert "NOISE" not in out + err, (out, err)
    assert "OURS-kept" in err  # our own warnings stay visible
    logged = log_file.read_text()
    for noise in ("NOISE-print-stdout", "NOISE-print-stderr", "NOISE-fd1", "NOISE-fd2", "NOISE-logging", "OURS-kept"):
        assert noise in logged, noise
    assert result.tags["log_file"] == str(log_file)
    print("after")  # the terminal is back once the load is done
    assert capfd.readouterr().out == "after\n"


def test_without_a_log_env_the_file_lands_under_results_and_verbose_shows_everything(compose, tmp_path, capfd,
                                                                                      monkeypatch):
    monkeypatch.delenv(LOG_ENV, raising=False)
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    result = _run(compose, tmp_path)
    assert "NOISE" not in "".join(capfd.readouterr())
    assert result.tags["log_file"].startswith(str(tmp_path / "logs"))
    assert "NOISE-fd2" in open(result.tags["log_file"]).read()

    monkeypatch.setenv(VERBOSE_ENV, "1")
    _run(compose, tmp_path)
    out, err = capfd.readouterr()
    assert "NOISE-print-stdout" in out and "NOISE-fd1" in out and "NOISE-fd2" in err


def test_the_kernel_profile_keeps_kineto_lines_off_the_terminal(compose, tmp_path, capfd, monkeypatch, caplog):
    """torch.profiler's kineto prints `USDT ... profiler_start/stop` from C++ straight to fd 2 at every start and
    stop: the kernel-tag profile runs with the library output redirected, while its own log line stays visible."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="quantbench")  # run.py logs at INFO: the profile's own line is one
    log_file = tmp_path / "run.log"
    monkeypatch.setenv(LOG_ENV, str(log_file))
    exp = build(compose([*FAST, "accuracy.enabled=false", "measure.repetitions=1", "measure.warmup=0",
                         "measure.max_new_tokens=6", "tracking.enabled=false", f"tracking.results_dir={tmp_path}"]))
    assert exp.measure.kernel_profile
    result = runner.execute(exp)
    out, err = capfd.readouterr()
    assert result.tags["kernel.linear"] not in ("none found", "") and "profile failed" not in result.tags["kernel.linear"]
    assert "USDT" not in out + err and "profiler_start" not in out + err, (out, err)
    assert "kernel.linear=" in err, err  # quantbench's own line about the profile still reaches the terminal
    logged = log_file.read_text()
    assert "profiler_start" in logged and "profiler_stop" in logged


def test_library_import_warnings_go_to_the_log_file(tmp_path):
    """torch's `_pytree` warnings about torchao's enums and torchao's missing CUDA kernels are printed when
    transformers first imports torchao, which a sweep's forkserver does while it pre-imports (harness/sweep/preload.py):
    they go to the run's log file, not the terminal."""
    import subprocess

    pytest.importorskip("torchao")
    from conftest import ROOT

    log_file = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    env.update({LOG_ENV: str(log_file), "PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, "-c", "import harness.sweep.preload"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "_pytree" not in proc.stderr and "Failed to load" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout == ""
    logged = log_file.read_text() if log_file.exists() else ""
    assert "is an Enum subclass" in logged, logged[-2000:]


def test_a_warning_logged_on_every_matmul_reaches_the_log_file_once_and_never_the_terminal(tmp_path, capfd,
                                                                                            monkeypatch):
    """bitsandbytes' LLM.int8 logs a cast warning on every matmul (215,880 terminal lines in one quant_sweep,
    inside the timed decode): after quiet_third_party it is written once to the run's log and nowhere else."""
    from harness import quiet_third_party

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    log_file = tmp_path / "run.log"
    monkeypatch.setenv(LOG_ENV, str(log_file))
    lib = logging.getLogger("bitsandbytes.autograd._functions")
    monkeypatch.setattr(lib, "handlers", [])
    monkeypatch.setattr(lib, "filters", [])
    monkeypatch.setattr(lib, "propagate", True)
    quiet_third_party()
    for _ in range(1000):
        lib.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.bfloat16")
    lib.warning("another message")
    out, err = capfd.readouterr()
    assert "MatMul8bitLt" not in out + err and "another message" not in out + err
    lines = log_file.read_text().splitlines()
    assert sum("MatMul8bitLt" in ln for ln in lines) == 1 and sum("another message" in ln for ln in lines) == 1
