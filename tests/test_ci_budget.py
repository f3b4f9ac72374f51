"""CI's budget and exit codes (issue #32): .ci/run's phase summary and warning line (scripts/ci_budget.sh), and
`make gate` keeping the gate's own exit code where .ci/run reads it, although make itself exits 2."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT

DURATIONS = """============================= slowest 30 durations =============================
96.13s call     tests/test_docs.py::test_documented_command_runs[README.md:276: python run.py quantizer=gptq_int4]
3.00s setup    tests/test_a.py::test_small
58.73s setup    tests/test_embedded_model.py::test_wikitext_perplexity_is_plausible
73.28s call     tests/test_embedded_model.py::test_greedy_output_is_coherent_and_identical_across_runs
========== 501 passed in 768.29s (0:12:48) ==========
"""


def summary(tmp_path, total: int, budget: int, *phases: str) -> list[str]:
    log = tmp_path / "tests.log"
    log.write_text(DURATIONS)
    script = f'source "{ROOT}/scripts/ci_budget.sh"; ci_summary {total} {budget} "{log}" ' + " ".join(
        f'"{p}"' for p in phases)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_within_budget_one_summary_line_and_no_warning(tmp_path):
    lines = summary(tmp_path, 800, 900, "89 setup", "690 tests", "21 gate")
    assert lines == ["ci: phases: 89 setup 690 tests 21 gate | total 13:20 (budget 15:00)"]


def test_over_budget_warns_once_naming_the_three_slowest_phases_and_tests(tmp_path):
    lines = summary(tmp_path, 1013, 900, "89 setup", "905 tests", "19 gate")
    assert len(lines) == 2 and lines[0].endswith("| total 16:53 (budget 15:00)")
    warning = lines[1]
    assert warning.startswith("ci: warning: 16:53 is over the 15:00 budget; slowest phases: tests 905s, setup 89s, "
                              "gate 19s; slowest tests: ")
    tests = warning.split("slowest tests: ")[1].split("; ")
    assert [t.rsplit(" ", 1)[1] for t in tests] == ["96.13s", "73.28s", "58.73s"]  # slowest first, 3 of 4
    assert tests[0].startswith("tests/test_docs.py::test_documented_command_runs[README.md:276: python run.py")



def test_over_budget_under_pipefail_warns_and_keeps_the_exit_code_of_the_run(tmp_path):
    """.ci/run sources the summary under `set -euo pipefail` in its EXIT trap. A `sort | head -3` there got SIGPIPE
    once sort's output outgrew what head read (a 22-minute cold CI on 2026-12-06 exited 141, no warning line): the
    summary must read the whole log and return the run's own code. 3,000 duration lines: far past a pipe's buffer."""
    log = tmp_path / "tests.log"
    log.write_text("".join(f"{i / 100:.2f}s call     tests/test_x.py::test_{i}[{'p' * 60}]\n" for i in range(3000)))
    script = (f'set -euo pipefail; source "{ROOT}/scripts/ci_budget.sh"; '
              f'ci_summary 1362 900 "{log}" "464 setup" "878 tests" "20 gate"; echo "rc=$?"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[-1] == "rc=0" and lines[1].startswith("ci: warning: 22:42 is over the 15:00 budget")
    assert [t.rsplit(" ", 1)[1] for t in lines[1].split("slowest tests: ")[1].split("; ")] == ["29.99s", "29.98s",
                                                                                              "29.97s"]

@pytest.mark.parametrize("log_text", [None, "ERROR collecting tests/test_x.py\n"])
@pytest.mark.parametrize("code", [1, 2])
def test_over_budget_with_no_duration_lines_still_warns_and_keeps_the_runs_code(tmp_path, log_text, code):
    """A collection error prints no durations, a failed setup leaves no log: grep exited 1 inside the EXIT trap
    under `set -euo pipefail`, which ended the trap before the warning and made grep's code CI's (2 read 1)."""
    log = tmp_path / "tests.log"
    if log_text is not None:
        log.write_text(log_text)
    script = (f'set -euo pipefail; source "{ROOT}/scripts/ci_budget.sh"; PHASES=("950 setup" "10 tests"); '
              f'summary() {{ local c=$?; ci_summary 990 900 "{log}" "${{PHASES[@]}}"; return "$c"; }}; '
              f'trap summary EXIT; exit {code}')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    assert proc.returncode == code and len(lines) == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[1].endswith("slowest tests: n/a")
    # and .ci/run's trap does not let the summary's own code replace the run's
    assert "ci_summary" in (line := next(ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
                                          if ln.strip().startswith("ci_summary"))) and "|| true" in line


@pytest.mark.parametrize("gate_code", [0, 1, 2])
def test_make_gate_exits_2_on_any_failure_but_keeps_the_gates_own_code(tmp_path, gate_code):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    fake = tmp_path / "fake-python"  # stands in for `python -m harness.gate ...`: exits with the gate's code
    fake.write_text(f"#!/bin/sh\nexit {gate_code}\n")
    fake.chmod(0o755)
    proc = subprocess.run(["make", "-o", "setup", "gate", f"PY={fake}"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == (0 if gate_code == 0 else 2), proc.stderr  # GNU make: a failed recipe is exit 2
    assert (tmp_path / "results" / "gate-exit-code").read_text().strip() == str(gate_code)


def test_ci_run_exits_with_the_gates_code_read_from_the_file():
    text = (ROOT / ".ci" / "run").read_text()
    assert 'exit "$(cat results/gate-exit-code' in text and "rm -f results/gate-exit-code" in text
    assert "phase setup" in text and "phase tests" in text and "phase gate" in text
