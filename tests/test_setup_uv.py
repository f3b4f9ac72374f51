"""scripts/setup.sh installs through uv under pip's own settings (scripts/pip_to_uv.py), and through pip where uv
cannot: the translation of `pip config list`, a setting uv cannot take, and setup's fallback, each with fake
installers (no package is installed here; CI's setup phase is the real install)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SPEC = importlib.util.spec_from_file_location("pip_to_uv", ROOT / "scripts" / "pip_to_uv.py")
pip_to_uv = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pip_to_uv)

# `pip config list` on the machine this was written on: a config file and PIP_* variables
LISTING = """:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/other-wheels'
download.find-links='/not/for/install'
"""


def test_pip_settings_take_the_environment_over_install_over_global():
    got = pip_to_uv.pip_settings(LISTING + "install.constraint='/c/install.txt'\n")
    assert got["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS replaces the config file's value, as in pip
    assert got["constraint"] == "/c/install.txt"  # [install] over [global]
    assert got["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert "/not/for/install" not in got.values()  # another command's section


def test_uv_command_hands_over_every_index_constraint_and_the_certificate():
    cmd, env = pip_to_uv.uv_command("uv", "/venv/bin/python", pip_to_uv.pip_settings(LISTING), ["-q", "torch==2.13.0"])
    assert cmd[:5] == ["uv", "pip", "install", "--python", "/venv/bin/python"]
    assert cmd[-2:] == ["-q", "torch==2.13.0"]
    pairs = list(zip(cmd, cmd[1:], strict=False))
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--find-links", "/opt/wheels") in pairs and ("--find-links", "/opt/other-wheels") not in pairs
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert ("--index-strategy", "unsafe-best-match") in pairs and "--compile-bytecode" in cmd
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_the_commands_own_index_replaces_the_configured_one():
    settings = {"index-url": "https://mirror/simple", "no-index": "false"}
    own = ["torch", "--index-url", "https://download.pytorch.org/whl/cpu"]
    cmd, _ = pip_to_uv.uv_command("uv", "py", settings, own)
    assert "https://mirror/simple" not in cmd and cmd.count("--index-url") == 1 and "--no-index" not in cmd
    cmd, _ = pip_to_uv.uv_command("uv", "py", {"index-url": "https://mirror/simple", "no-index": "true"}, ["x"])
    assert ("--index-url", "https://mirror/simple") in list(zip(cmd, cmd[1:], strict=False)) and "--no-index" in cmd


def _fake(path: Path, body: str) -> str:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_setting_uv_cannot_take_exits_3_in_one_line_and_runs_nothing(tmp_path):
    uv = _fake(tmp_path / "uv", f'echo "$@" > {tmp_path}/uv-ran')
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "/opt/wheels", "PIP_PROXY": "http://p:3128"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pip_to_uv.py"), uv, "-q", "x"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and not (tmp_path / "uv-ran").exists(), proc.stderr
    assert proc.stderr.strip().splitlines() == ["setup: pip's setting `proxy` has no uv equivalent here; "
                                                "installing with pip"]
    env.pop("PIP_PROXY")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pip_to_uv.py"), uv, "-q", "x"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ran = (tmp_path / "uv-ran").read_text().split()
    assert ran[:4] == ["pip", "install", "--python", sys.executable]
    assert "/opt/wheels" in ran and ran[-2:] == ["-q", "x"]


def _setup_install(tmp_path: Path, uv_exit: int | None) -> tuple[subprocess.CompletedProcess, str]:
    """setup.sh's own `install` function, run with a fake pip and a fake uv that exits `uv_exit` (None: no uv)."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    func = re.search(r"^install\(\) \{.*?^\}$", text, re.S | re.M)
    assert func, "scripts/setup.sh has no install() function"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _fake(venv / "bin" / "python", f'echo "python $@" >> {tmp_path}/log; exit {uv_exit or 0}')
    pip = _fake(tmp_path / "pip", f'echo "pip $@" >> {tmp_path}/log')
    uv = "" if uv_exit is None else "/fake/uv"
    script = (f'set -euo pipefail\nVENV={venv}\nPIP={pip}\nUV="{uv}"\n{func.group(0)}\n'
              "install -c c.txt torch==2.13.0\ninstall x\n")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    return proc, (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""


@pytest.mark.parametrize("uv_exit", [0, 1, 3, None])
def test_setup_installs_through_uv_and_falls_back_to_pip(tmp_path, uv_exit):
    proc, log = _setup_install(tmp_path, uv_exit)
    assert proc.returncode == 0, proc.stderr
    through_uv = "python scripts/pip_to_uv.py /fake/uv -q -c c.txt torch==2.13.0"
    assert (through_uv in log) == (uv_exit is not None), log
    assert ("pip install -q -c c.txt torch==2.13.0" in log) == (uv_exit != 0), log  # pip only where uv did not install
    # after uv failed or refused once, the next install goes to pip at once (one line in all, not one per install)
    assert ("python scripts/pip_to_uv.py /fake/uv -q x" in log) == (uv_exit == 0), log
    assert ("pip install -q x" in log) == (uv_exit != 0), log
    warned = [ln for ln in proc.stderr.splitlines() if "warning" in ln]
    # a failed uv says so in one line; a refused setting said so itself (exit 3); no uv: setup said so earlier
    assert len(warned) == (1 if uv_exit == 1 else 0), proc.stderr
