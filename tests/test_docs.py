"""The docs are tests: every command shown in README.md and docs/*.md runs, as a user would type it.

Commands are read from the fenced code blocks of the docs (shell blocks, and the `run:` lines of the CI
snippets in yaml blocks): `python run.py ...`, `python -m harness.* ...`, `python benchmarks/*.py ...`
and `make ...`, continuation lines joined, `flock ...` prefixes and `.venv/bin/` dropped. Each one is a
test case named after its file and line, so a documented command that breaks fails CI by name.

The commands stay in the docs exactly as users type them; this file only *adds* narrowing:
- run.py: few tokens, one repetition, a short accuracy pass, results into a temporary folder
  (`NARROW_RUN`); sweeps also get a temporary sweep folder. Placeholders are filled in (`PLACEHOLDERS`).
- benchmarks: `--smoke` (every benchmark script accepts it: tiny sizes, seconds).
- a few commands cannot run on this machine (a SLURM cluster, a remote host, the test suite itself):
  they are listed in `NOT_HERE` with the reason, and the list is checked to name only commands that
  really are in the docs. Commands that need CUDA are run and must end SKIPPED with a one-line reason (no GPU here).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm
from conftest import ROOT, SHARED_DATA
from test_experiments import NARROW as NARROW_SWEEP

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```\s*([\w-]*)")
SHELL = {"", "bash", "sh", "shell", "console"}
STARTS = ("python ", "python3 ", "make ", "bash ")
INLINE = re.compile(r"`((?:\.venv/bin/)?(?:python3?|make|bash) [^`]+)`")  # a command in a prose code span


@dataclass(frozen=True)
class DocCommand:
    doc: str  # path relative to the repo
    line: int  # 1-based line of the command's first line
    text: str  # the command as shown (continuations joined, comment removed)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}: {self.text[:70]}"


def _strip_comment(line: str) -> str:
    """Drop a trailing `# comment` that is outside quotes."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _normalize(text: str) -> str:
    text = re.sub(r"^flock\s+(-\w+\s+)*\S+\s+", "", text)  # the lock is for humans sharing a machine
    text = re.sub(r"^(\./)?\.venv/bin/", "", text)
    return text


def doc_commands(paths: list[Path] = DOCS) -> list[DocCommand]:
    """Every command in the fenced blocks of `paths` (see module docstring)."""
    out: list[DocCommand] = []
    for path in paths:
        lang, pending, start, env = None, "", 0, {}
        for n, raw in enumerate(path.read_text().splitlines(), 1):
            fence = FENCE.match(raw)
            if fence:
                lang = None if lang is not None else fence.group(1).lower()
                pending = ""
                continue
            if lang is None:
                for name, value in re.findall(r"`([A-Z_]+)=\"([^\"]*)\"`", raw):  # prose: `SMOKE="..."`
                    env[name] = value
                for code in INLINE.findall(raw):  # prose: `python run.py quantizer=gptq_int4`
                    text = _normalize(code.strip())
                    if text.startswith(STARTS) and "..." not in text:
                        doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
                        out.append(DocCommand(doc, n, text))
                continue
            line = raw.strip()
            if lang == "yaml":
                line = re.sub(r"^(-\s*)?run:\s*", "", line)
                if line in ("|", ">"):
                    continue
            elif lang not in SHELL:
                continue
            if not pending:
                start = n
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            text = _strip_comment(pending + line).strip()
            pending = ""
            assign = re.fullmatch(r"([A-Z_]+)=\"([^\"]*)\"", text)
            if assign:
                env[assign.group(1)] = assign.group(2)
                continue
            text = _normalize(text)
            if not text.startswith(STARTS):
                continue
            for name, value in env.items():
                text = text.replace(f'"${name}"', f'"{value}"').replace(f"${name}", value)
            doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            out.append(DocCommand(doc, start, text))
    return out


def test_the_docs_show_commands_and_the_extractor_reads_them(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text('Use `V="a b"` for it.\n```bash\nflock /tmp/l python run.py \\\n  quantizer=bf16  # c\n'
                   'ls\n.venv/bin/python -m harness.gate --baseline "$V"\n```\n```\npython not-in-a-shell-fence\n'
                   '```\n```yaml\n      - run: make test\n        run: |\n          .venv/bin/python -m x "$V"\n```\n')
    got = [c.text for c in doc_commands([doc])]
    # a plain ``` block counts as shell: layout trees and sample output never start with python/make
    assert got == ["python run.py quantizer=bf16", 'python -m harness.gate --baseline "a b"',
                   "python not-in-a-shell-fence", "make test", 'python -m x "a b"']
    assert len(doc_commands()) >= 40  # README and docs/ show dozens of commands


COMMANDS = doc_commands()


# ----------------------------------------------------------------------------- how each command runs here

NOT_HERE = {  # command (as extracted) -> why it cannot run on this machine; checked to be in the docs
    "make test": "is this test suite itself: CI runs it through .ci/run",
    "make ui": "runs in tests/test_mlflow_ui.py (on a free port and that test's store), which opens the link it "
               "prints in a browser",
    **dict.fromkeys(("make gate", "make gate BASE=origin/main",
                     "make gate BASE=origin/$GITHUB_BASE_REF", "make gate GATE_ARGS=--no-mlflow"),
                    "is CI's gate step: .ci/run runs it right after this suite, and tests/test_gate_ci.py runs it on "
                    "a throwaway pair of commits (an unchanged one passes, one with more work per step fails)"),
    'python -m pytest -m "not slow and not heavy"': "is (part of) this test suite itself",
    "make test-heavy": "is the heavy tier of this suite (tests/test_experiments_embedded.py, ~16 min), run by hand",
    "bash benchmarks/gpu_check.sh --bundle": "downloads CUDA wheels from a package registry; "
                                             "tests/test_gpu_check.py checks the bundle logic offline",
    "python run.py -m quantizer=bf16,fp16 hydra/launcher=slurm hydra.launcher.partition=gpu "
    "tracking.uri=http://mlflow-host:5000": "needs a SLURM cluster and an MLflow host; tests/test_launchers.py "
                                            "renders its sbatch script without a cluster",
    "python -m harness.records.server --backend-store-uri postgresql://mlflow@dbhost:5432/mlflow":
        "needs an existing PostgreSQL server; tests/test_tracking_server.py runs harness.records.server on a local one",
}
# run.py: what every documented run gets appended (later overrides win in Hydra): few tokens, one pass,
# a short accuracy pass. The documented options themselves are kept.
NARROW_RUN = ["measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0", "accuracy.max_tokens=128",
              "accuracy.context_length=64", "accuracy.stride=64", "accuracy.task_limit=10"]
SERVER_MODULES = ("harness.records.server",)


def _experiment_is_sweep(args: list[str]) -> bool:
    for a in args:
        if a.startswith("+experiment="):
            path = ROOT / "conf" / "experiment" / f"{a.split('=', 1)[1]}.yaml"
            return path.is_file() and "mode: MULTIRUN" in path.read_text()
    return False


WORKDIR = Path(os.environ.get("TMPDIR", "/tmp"))  # set to the module's folder by the `work` fixture


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    global WORKDIR
    WORKDIR = tmp_path_factory.mktemp("docs")
    return WORKDIR


def _env() -> dict[str, str]:
    from harness.sweep.settings import FAULT_ENV, STATE_ENV

    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _placeholders(text: str, work: Path) -> str:
    """Fill in what the docs leave to the reader (a path of your own, a branch name, a sweep name)."""
    from harness.models import EmbeddedGGUF, TinyRandom

    subs = {
        "/path/to/model.gguf": lambda: str(EmbeddedGGUF()._path()),
        "/path/to/checkpoint": lambda: str(TinyRandom().local_dir()),
        "/path/to/draft": lambda: str(TinyRandom().local_dir()),  # the target is narrowed to the tiny model too
        "+experiment=<name>": lambda: "+experiment=smoke",
        "path/to/prompts.jsonl": lambda: str(ROOT / "docs" / "examples" / "prompts.jsonl"),
        "results/<sweep>": lambda: "results/quant_sweep",
        "quantizer=<name>": lambda: "quantizer=bf16",
        "<wikitext-2>": lambda: str(SHARED_DATA),
        "../shared/data/wikitext-2": lambda: str(SHARED_DATA),  # beside the checkout; a clone finds it elsewhere
        "$OUT": lambda: str(work / "gpu_out"),
    }
    for key, value in subs.items():
        if key in text:
            text = text.replace(key, value())
    text, revs = re.subn(r"--(candidate|baseline)-rev\s+\S+", r"--\1-rev HEAD", text)
    if revs and "--allow-same" not in text:  # HEAD on a clean clone is the candidate's own code: an A/A on purpose
        text += " --allow-same"
    text = re.sub(r"^make gate\b(?:\s+BASE=\S+)?", "make gate BASE=HEAD", text)  # a base that exists, same code
    return text.replace("results/", f"{work}/results/")


def _run(argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """`python ...` forked warm from a pre-imported server (tests/warm.py); anything else as a subprocess."""
    if argv[0] == sys.executable:
        return warm.run(argv[1:], ROOT, _env(), WORKDIR / "procs", timeout)
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _python(args: list[str]) -> list[str]:
    return [sys.executable, *args[1:]]


def run_py(args: list[str], work: Path) -> list[str]:
    """A documented run.py command, narrowed and routed to the test's folders."""
    out = [*args, *NARROW_RUN, f"tracking.results_dir={work}/results", f"hydra.run.dir={work}/hydra/run"]
    if not any(a.startswith("tracking.uri=") for a in args):
        out.append(f"tracking.uri=sqlite:///{work}/mlflow.db")
    if "-m" in args or "--multirun" in args or _experiment_is_sweep(args):
        out.append(f"hydra.sweep.dir={work}/hydra/sweep-{time.monotonic_ns()}")
    if any(a in args for a in ("quantizer=gptq_int4", "quantizer=rtn_int4")):  # calibration: 2 x 64 tokens
        out += ["quantizer.calibration_samples=2", "quantizer.calibration_length=64"]
    # GPTQ runs on the tiny model too (10 s, not 44 s on the embedded one): gptqmodel on a real-shaped model is
    # tests/test_gpu_paths.py's random Llama shape, and on SmolLM2-135M the heavy tier's test_gptq_beats_rtn...
    keeps_model = any(a.startswith(("model", "engine=", "quantizer=rtn", "quantizer=awq", "+experiment="))
                      for a in args[2:])
    sweep_run = "-m" in args or "--multirun" in args or _experiment_is_sweep(args)
    if not sweep_run and "accuracy." not in " ".join(args):  # speed commands: no accuracy pass (tests of its own)
        out.append("accuracy.enabled=false")
    if not sweep_run and "tracking." not in " ".join(args):  # result JSON only (MLflow logging: tests of its own)
        out.append("tracking.enabled=false")
    if not keeps_model:  # the tiny model: seconds instead of tens of seconds (`make run` runs the embedded one)
        out.append("model=tiny_random")
    for a in args:  # a shipped sweep runs one cell the tiny model supports (all cells: tests/test_experiments.py)
        if a.startswith("+experiment=") and a.split("=", 1)[1] in NARROW_SWEEP:
            narrow = NARROW_SWEEP[a.split("=", 1)[1]]  # a size=<preset> cell brings its own (tiny) model
            out += [*([] if any(n.startswith("size=") for n in narrow) else ["model=tiny_random"]), *narrow]
    if "model=random" in args:  # published 1B-8B shapes: the same code path on the tiny preset, in seconds
        out.append("model.arch=tiny")
    if any(a.startswith("load.profile=") and a != "load.profile=off" for a in out):  # a load run refuses what it
        out = [a for a in out if a not in ("measure.repetitions=1", "measure.warmup=0")]  # does not read (load.*)
    return _python(out)


def profile_failures(results: Path, since: float) -> list[str]:
    """The kernel profiles that failed in the results written since `since` (their tag; the run itself passes)."""
    import json

    out = []
    for path in results.rglob("*.json") if results.is_dir() else []:
        if path.stat().st_mtime >= since and "mlartifacts" not in path.parts:
            try:
                tag = str((json.loads(path.read_text()).get("tags") or {}).get("kernel.linear", ""))
            except (ValueError, OSError, AttributeError):
                continue
            if tag.startswith("profile failed"):
                out.append(f"{path.name}: {tag}")
    return out


def serve_and_check(argv: list[str], url: str, timeout: float = 120) -> None:
    """Start a documented server, wait until it answers on `url`, stop it."""
    import urllib.request

    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert proc.poll() is None, f"{argv} exited {proc.returncode}: {proc.stdout.read()[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    assert resp.status == 200
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{argv} did not answer on {url} within {timeout:.0f} s")
    finally:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module")
def baselines(work) -> Path:
    """A copy of results/baselines/ for commands that read or rewrite a committed gate baseline."""
    import shutil

    dst = work / "results" / "baselines"
    if not dst.exists():
        shutil.copytree(ROOT / "results" / "baselines", dst)
    return dst


@pytest.fixture(scope="module")
def live_mlflow(work):
    """An MLflow server on a free loopback port, for commands that log to http://127.0.0.1:5000."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{work}/server.db", "--workers", "1"],
                            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    end = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert time.monotonic() < end and proc.poll() is None, "mlflow server did not start"
            time.sleep(0.5)
    yield url
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:  # uvicorn's graceful stop waits on idle connections: ~9 s of nothing
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# benchmarks whose `--smoke` (what a documented benchmark command runs here) ignores the other options
SMOKE_IGNORES_ARGS = ("benchmarks/gate_calibration.py", "benchmarks/warm_cells.py")


def effective(text: str) -> tuple:
    """What a documented run.py command runs once narrowed: its options, the last value of each key winning
    (as in Hydra). Two commands that differ only in what the narrowing overrides run the same thing."""
    args = shlex.split(_placeholders(text, Path("/work")))
    if len(args) >= 2 and args[1] in SMOKE_IGNORES_ARGS:  # its --smoke runs one fixed check, whatever else is given
        return (args[1], "--smoke")
    if len(args) < 2 or args[1] != "run.py":
        return tuple(args)  # placeholders filled in: `results/<sweep>` is the `results/quant_sweep` shown elsewhere
    narrowed = run_py(args, Path("/work"))[2:]
    opts = {a.split("=", 1)[0]: a for a in narrowed if "=" in a and not a.startswith(("hydra.sweep.dir", "hydra.run"))}
    return ("run.py", *sorted(a for a in narrowed if "=" not in a), *sorted(opts.values()))


def _runnable() -> list[DocCommand]:
    """Each documented command once: the same text, or the same effective run (`effective`), runs one time."""
    out, seen = [], set()
    for c in COMMANDS:
        if c.text in NOT_HERE:
            continue
        key = effective(c.text)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


RUNNABLE = _runnable()


def test_every_command_the_docs_cannot_run_here_is_in_the_docs_and_says_why():
    shown = {c.text for c in COMMANDS}
    for text, why in NOT_HERE.items():
        assert text in shown, f"NOT_HERE names a command the docs no longer show: {text}"
        assert len(why) > 20


def _marks(cmd: DocCommand) -> list:
    """`serial` for a `make gate` that must pass: an A/A gate's verdict must not share the cores with another test
    (`make test` runs the serial tests after the parallel pass; the port-5000 commands: tests/conftest.py)."""
    return [pytest.mark.serial] if cmd.text.startswith("make gate") else []


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c)) for c in RUNNABLE], ids=[c.id for c in RUNNABLE])
def test_documented_command_runs(cmd: DocCommand, work: Path, baselines: Path, request):
    text = _placeholders(cmd.text, work)
    if "http://127.0.0.1:5000" in text and "harness.records.server" not in text:
        text = text.replace("http://127.0.0.1:5000", request.getfixturevalue("live_mlflow"))
    args = shlex.split(text)

    if args[0] == "bash" and args[1] == "benchmarks/gpu_check.sh":
        proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
        if "--dry-run" in args:
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return
        import torch

        if not torch.cuda.is_available():  # no GPU here: it must refuse in one line before any setup
            return _one_line_error(proc, "CUDA")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return

    if args[0] == "make":
        narrow = " ".join(run_py(["python", "run.py"], work)[2:])
        proc = _run(["make", *args[1:], f"ARGS={narrow}"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return

    if args[1] == "run.py":
        since = time.time()
        proc = _run(run_py(args, work))
        failed = profile_failures(work / "results", since)  # a side measurement that broke says so only in a tag
        assert not failed, failed
        if "measure.device=cuda" in args:  # no GPU here: recorded SKIPPED with its one-line reason, exit 1
            import torch

            if not torch.cuda.is_available():
                assert proc.returncode == 1 and "[SKIPPED]" in proc.stdout and "needs CUDA" in proc.stdout, \
                    proc.stdout[-3000:] + proc.stderr[-3000:]
                return
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return

    if args[1] == "-m":
        module = args[2]
        if module == "harness.records.server":
            pg = Path(__import__("tempfile").mkdtemp(prefix="qb-pg-"))
            pg.chmod(0o755)  # PostgreSQL runs as the `postgres` user when we are root: it must reach the folder
            argv = [a if not a.startswith(f"{work}/results/postgres") else str(pg / "data") for a in args]
            return serve_and_check(_python(argv), "http://127.0.0.1:5000/health", timeout=180)
        if module == "harness.gate":  # a short speed budget; a verdict either way (0 pass, 1 regression) is fine
            if not re.search(r"\bmodel=|\+experiment=", text):  # the embedded model compiles for minutes
                args = [f"{a} model=tiny_random" if prev in ("--baseline", "--candidate") else a
                        for prev, a in zip(["", *args[:-1]], args, strict=True)]
            # 2 s of measuring: the command's wiring is what runs here; the gate's power is tests/test_gate_ci.py's
            args = [*args, "--output", f"{work}/gate-{cmd.line}.json", "--no-mlflow", "--budget", "2",
                    "--min-blocks", "8"]
            proc = _run(_python(args))
            assert proc.returncode in (0, 1) and "quantbench gate:" in proc.stdout, \
                proc.stdout[-3000:] + proc.stderr[-3000:]
            return
        if module in ("harness.report", "harness.records.report") and "--frontier" in args and "--sweep" in args:
            # the frontier of the named sweep in MLflow: that sweep, narrowed to two formats on the tiny model
            name = args[args.index("--sweep") + 1]
            tag = args[args.index("--tag") + 1] if "--tag" in args else ""
            label = [f"sweep.label={tag.split('=', 1)[1]}"] if tag.startswith("quantbench.label=") else []
            made = _run(run_py(["python", "run.py", "-m", "model=tiny_random", "quantizer=none,bf16", f"name={name}",
                                *label], work))
            assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
            proc = _run(_python([*args, "--tracking-uri", f"sqlite:///{work}/mlflow.db", "--out", f"{work}/frontier"]))
            assert proc.returncode == 0 and (work / "frontier" / "frontier.png").is_file(), \
                proc.stdout[-3000:] + proc.stderr[-3000:]
            return
        if module in ("harness.report", "harness.records.report") and "--mlflow-experiment" in args:
            made = _run(run_py(["python", "run.py", "+experiment=smoke"], work))  # a sweep in MLflow to report on
            assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
            args = [*args, "--tracking-uri", f"sqlite:///{work}/mlflow.db", "--out", f"{work}/report-mlflow"]
        if module in ("harness.report", "harness.records.report") and len(args) > 3 and not args[3].startswith("-"):
            folder = Path(args[3])
            if not folder.is_dir():  # the sweep the docs showed before this command: run it (narrowed)
                made = _run(run_py(["python", "run.py", f"+experiment={folder.name}"], work))
                assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
        proc = _run(_python(args))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return

    if args[1].startswith("benchmarks/"):
        proc = _run(_python([*args, "--smoke"]))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return

    raise AssertionError(f"no rule to run this documented command; teach tests/test_docs.py: {cmd.text}")
