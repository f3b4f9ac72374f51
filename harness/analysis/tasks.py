"""BIG-bench multiple-choice tasks, offline: fetched once from PyPI, read from the cache.

The `bigbench` 1.0.0 source distribution on PyPI (Apache-2.0, ~360 MB) ships every JSON task as
`bigbench/benchmark_tasks/<task>[/<subtask>]/task.json`. `python -m harness.analysis.tasks fetch` (run by
`scripts/setup.sh --tasks` and `--all`) downloads it from the package registry, checks its sha256 against the pinned
`ARCHIVE_SHA256`, and writes into `$QUANTBENCH_CACHE/bigbench-1.0.0/` (or `$QUANTBENCH_TASKS_DIR`, a task cache kept
elsewhere: a shared one, or the test suite's stand-in):

- `index.json`: every task of the archive (1,041 task files, plus the 42 programmatic `task.py` tasks) with
  its kind (multiple_choice, generative, group, programmatic), example and choice counts, and chance;
- `tasks/<task>.json.gz`: the task file of each multiple-choice task (320 of them; ~290 MB compressed,
  1.4 GB raw), with the sha256 of the raw file in the index, checked whenever a task is read.

Only multiple-choice tasks (every example has `target_scores`) are extracted: they are the ones
`accuracy.tasks` can score. The archive itself is not kept. Config validation reads only the index, so an
unknown name, a generative task or a missing fetch is one line before any model loads.

Since 2026-12-05 the registry this project reaches lists only bigbench 0.0.1, so the download fails there with
one line that says so; `fetch --archive bigbench-1.0.0.tar.gz` builds the cache from a copy of the sdist got
elsewhere (its sha256 is checked against the same pin), or QUANTBENCH_TASKS_DIR points at a cache built on another
machine. The test suite never needs the real files: tests/standin_tasks.py builds a stand-in cache.

An example's correct answers are the choices with the highest target score (BIG-bench's
multiple_choice_grade gives the chosen choice's score; every shipped default task scores 0/1).
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import json
import os
import random
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.cache import cache_root
from harness.errors import QuantbenchError

VERSION = "1.0.0"
ARCHIVE = f"bigbench-{VERSION}.tar.gz"
ARCHIVE_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
INDEX_FORMAT = "1"
FETCH_COMMAND = "scripts/setup.sh --tasks"  # or: python -m harness.analysis.tasks fetch
# SmolLM2-135M in fp32 is measurably above chance on these, zero-shot (docs/accuracy.md has the table)
DEFAULT_TASKS = ("general_knowledge", "timedial", "social_iqa", "emoji_movie", "strategyqa")
DEFAULT_ALIAS = "default"  # accuracy.tasks=[default] means DEFAULT_TASKS
_PREFIX = "bigbench/benchmark_tasks/"


TASKS_DIR_ENV = "QUANTBENCH_TASKS_DIR"


def data_dir() -> Path:
    """The task cache: $QUANTBENCH_TASKS_DIR when set, else bigbench-1.0.0/ in the quantbench cache."""
    override = os.environ.get(TASKS_DIR_ENV)
    return Path(override) if override else cache_root() / f"bigbench-{VERSION}"


@dataclass(frozen=True)
class Example:
    input: str
    choices: tuple[str, ...]
    gold: tuple[int, ...]  # indices of the choices with the highest target score


@dataclass
class Task:
    name: str
    examples: list[Example]
    sha256: str  # of the raw task.json

    @property
    def chance(self) -> float:
        """Expected accuracy of a uniform random pick."""
        return sum(len(e.gold) / len(e.choices) for e in self.examples) / len(self.examples)


# ------------------------------------------------------------------------------------- parsing a task file


def kind_of(data: dict) -> str:
    examples = data.get("examples")
    if not examples:
        return "group"  # a parent of subtasks: its task.json has no examples
    if all(isinstance(e.get("target_scores"), dict) and len(e["target_scores"]) >= 2 for e in examples):
        return "multiple_choice"
    return "generative"


def _examples(data: dict) -> list[Example]:
    out = []
    for e in data["examples"]:
        choices, scores = list(e["target_scores"]), list(e["target_scores"].values())
        best = max(scores)
        out.append(Example(input=str(e["input"]), choices=tuple(str(c) for c in choices),
                           gold=tuple(i for i, s in enumerate(scores) if s == best)))
    return out


def parse(name: str, raw: bytes) -> Task:
    data = json.loads(raw)
    if kind_of(data) != "multiple_choice":
        raise QuantbenchError(f"task {name!r} is not multiple choice (its examples have no target_scores)")
    return Task(name=name, examples=_examples(data), sha256=hashlib.sha256(raw).hexdigest())


def entry(data: dict, raw: bytes) -> dict:
    """A task's line in the index (a group's subtasks are added once every name is known)."""
    kind = kind_of(data)
    out: dict = {"kind": kind, "examples": len(data.get("examples") or [])}
    if kind == "multiple_choice":
        counts = [len(e["target_scores"]) for e in data["examples"]]
        out.update(choices_min=min(counts), choices_max=max(counts), sha256=hashlib.sha256(raw).hexdigest(),
                   chance=Task("", _examples(data), "").chance)
    return out


# ---------------------------------------------------------------------------------------- the cache


def build_cache(members: Iterable[tuple[str, bytes | None]], root: Path, archive_sha256: str) -> dict:
    """Write the index and the multiple-choice task files from (task name, raw task.json or None for a
    programmatic task) pairs into `root` (replaced as a whole: a reader never sees half a cache). Streams: one
    task file in memory at a time (the archive holds 1.7 GB of them)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp", dir=root.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        tasks: dict[str, dict] = {}
        for name, raw in members:
            if raw is None:
                tasks[name] = {"kind": "programmatic", "examples": 0}
                continue
            tasks[name] = entry(json.loads(raw), raw)
            if tasks[name]["kind"] == "multiple_choice":
                path = tmp / "tasks" / f"{name}.json.gz"
                path.parent.mkdir(parents=True, exist_ok=True)
                with gzip.open(path, "wb", compresslevel=1) as f:  # level 1: 4.7x smaller, seconds for all
                    f.write(raw)
        for name, info in tasks.items():
            if info["kind"] == "group":
                info["subtasks"] = sorted(n for n in tasks if n.startswith(name + "/"))
        index = {"format": INDEX_FORMAT, "version": VERSION, "archive_sha256": archive_sha256, "tasks": tasks}
        (tmp / "index.json").write_text(json.dumps(index, indent=0, sort_keys=True))
        old = root.with_name(root.name + f".old{os.getpid()}")
        if root.exists():
            os.rename(root, old)
        os.rename(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


def archive_members(archive: Path) -> Iterator[tuple[str, bytes | None]]:
    """(task name, raw task.json) for every task file of the archive; None for a task.py-only task."""
    py_only: set[str] = set()
    seen: set[str] = set()
    with tarfile.open(archive) as tf:
        for m in tf:
            _, _, rel = m.name.partition(_PREFIX)
            if not rel or not m.isfile():
                continue
            folder, _, file = rel.rpartition("/")
            if file == "task.json":
                seen.add(folder)
                yield folder, tf.extractfile(m).read()  # type: ignore[union-attr]
            elif file == "task.py" and "/" not in folder:
                py_only.add(folder)
    yield from ((name, None) for name in sorted(py_only - seen))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(dest: Path) -> Path:
    """The sdist from the package registry's simple index (PEP 691 JSON; $PIP_INDEX_URL or PyPI).

    Not `pip download`: pip 24+ prepares the sdist's metadata first and then refuses it, because bigbench
    declares a direct-URL dependency (bleurt @ file://...). Only the file is needed, so it is fetched as is.
    """
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    out = dest / ARCHIVE
    try:
        req = urllib.request.Request(f"{index}/bigbench/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            files = json.loads(resp.read())["files"]
        url = next((f["url"] for f in files if f["filename"] == ARCHIVE), None)
        if url is None:
            listed = sorted({f["filename"] for f in files}) or ["nothing"]
            raise QuantbenchError(f"the registry {index} no longer lists {ARCHIVE} (it lists {', '.join(listed)}); get "
                                  f"the file elsewhere and run: python -m harness.analysis.tasks fetch --archive {ARCHIVE}"
                                  f", or point {TASKS_DIR_ENV} at a task cache built on another machine")
        with urllib.request.urlopen(urllib.parse.urljoin(f"{index}/bigbench/", url), timeout=60) as resp, \
                open(out, "wb") as f:
            shutil.copyfileobj(resp, f, 1 << 20)
    except (OSError, ValueError, KeyError) as exc:
        raise QuantbenchError(f"could not download {ARCHIVE} from {index} ({type(exc).__name__}: {exc}); get the "
                              f"file elsewhere and run: python -m harness.analysis.tasks fetch --archive {ARCHIVE}") from exc
    return out


def fetch(archive: Path | None = None, force: bool = False) -> Path:
    """Download (unless `archive` is given), verify and extract; returns the cache folder."""
    root = data_dir()
    if not force and read_index(root) is not None:
        return root
    with tempfile.TemporaryDirectory(prefix="qb-bigbench-") as tmp:
        path = archive or download(Path(tmp))
        digest = sha256_file(path)
        if digest != ARCHIVE_SHA256:
            raise QuantbenchError(f"{path} has sha256 {digest}, not the pinned {ARCHIVE_SHA256} of {ARCHIVE}: another "
                                  "or a damaged file; fetch again (without --archive it is downloaded)")
        build_cache(archive_members(path), root, digest)
    return root


def source(root: Path | None = None) -> str:
    """Where the task cache came from, as a run's tag `tasks.source`: the pinned sdist, or what else built it."""
    index = read_index(root) or {}
    digest = str(index.get("archive_sha256", "?"))
    return f"{ARCHIVE} (sha256 pinned)" if digest == ARCHIVE_SHA256 else f"not the pinned {ARCHIVE}: {digest}"


def read_index(root: Path | None = None) -> dict | None:
    path = (root or data_dir()) / "index.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if index.get("format") == INDEX_FORMAT else None


# ------------------------------------------------------------------------------- names, validation, loading


def expand(names: Iterable[str]) -> list[str]:
    """`default` becomes DEFAULT_TASKS; duplicates dropped, order kept."""
    out: list[str] = []
    for n in names:
        for name in (DEFAULT_TASKS if n == DEFAULT_ALIAS else (n,)):
            if name not in out:
                out.append(name)
    return out


def problems(names: list[str]) -> list[str]:
    """One line per task name that cannot be scored (config validation: reads only the index)."""
    if not names:
        return []
    index = read_index()
    if index is None:
        return [f"accuracy.tasks needs BIG-bench's task files, which are not in {data_dir()}: fetch them once "
                f"with `{FETCH_COMMAND}` (or python -m harness.analysis.tasks fetch)"]
    known, out = index["tasks"], []
    for name in expand(names):
        info = known.get(name)
        if info is None:
            close = difflib.get_close_matches(name, [n for n, i in known.items() if i["kind"] == "multiple_choice"], 3)
            out.append(f"accuracy.tasks: unknown task {name!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                                                  "; list them with: python -m harness.analysis.tasks list"))
        elif info["kind"] == "group":
            out.append(f"accuracy.tasks: {name!r} is a group of subtasks; name one of: {', '.join(info['subtasks'])}")
        elif info["kind"] != "multiple_choice":
            out.append(f"accuracy.tasks: {name!r} is not multiple choice ({info['kind']}); choose a multiple-choice "
                       "task: python -m harness.analysis.tasks list")
    return out


def load(name: str) -> Task:
    """A multiple-choice task from the cache, its bytes checked against the index."""
    if (err := problems([name])):
        raise QuantbenchError(err[0])
    info = read_index()["tasks"][name]  # type: ignore[index]
    path = data_dir() / "tasks" / f"{name}.json.gz"
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise QuantbenchError(f"task file {path} is unreadable ({exc}); fetch again: "
                              "python -m harness.analysis.tasks fetch --force") from exc
    if hashlib.sha256(raw).hexdigest() != info["sha256"]:
        raise QuantbenchError(f"task file {path} does not match its checksum in the index; fetch again: "
                              "python -m harness.analysis.tasks fetch --force")
    return parse(name, raw)


def subset(n: int, limit: int | None, seed: int) -> list[int]:
    """`limit` example indices out of `n`, seeded and in file order; all of them when limit is None or >= n."""
    if limit is None or limit >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), limit))


# -------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.analysis.tasks", description="BIG-bench task files for accuracy.tasks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"download bigbench=={VERSION} once, verify it, extract the multiple-choice tasks")
    f.add_argument("--archive", type=Path, help=f"use this local {ARCHIVE} instead of downloading")
    f.add_argument("--force", action="store_true", help="fetch again even when the cache is complete")
    ls = sub.add_parser("list", help="the multiple-choice tasks (name, examples, choices, chance)")
    ls.add_argument("--all", action="store_true", help="every task, with its kind")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            root = fetch(args.archive, args.force)
            n = sum(1 for i in read_index(root)["tasks"].values() if i["kind"] == "multiple_choice")  # type: ignore[index]
            print(f"bigbench {VERSION}: {n} multiple-choice tasks in {root}")
            return 0
        index = read_index()
        if index is None:
            raise QuantbenchError(f"no BIG-bench task files in {data_dir()}; fetch them with `{FETCH_COMMAND}`")
        for name, info in sorted(index["tasks"].items()):
            if info["kind"] == "multiple_choice":
                mark = " (default)" if name in DEFAULT_TASKS else ""
                print(f"{name}\t{info['examples']} examples\t{info['choices_min']}-{info['choices_max']} choices\t"
                      f"chance {info['chance']:.3f}{mark}")
            elif args.all:
                print(f"{name}\t{info['kind']}")
    except QuantbenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
