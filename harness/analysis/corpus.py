"""Text corpora (`accuracy.corpus`, `quantizer.calibration_corpus`): what a spec names, reading it, and
checking, before anything loads, that it can be read.

A spec is `builtin` (harness/data/corpus.txt), a local text file, or an HF datasets id
`name[:config[:split]]` (`name` is `dataset` or `owner/dataset`, as on the hub). Perplexity is scored
after all the timing, so a corpus that cannot be read must be refused at validation (a file path) or at
preflight (a dataset id: in the local datasets cache, or `datasets` installed and the hub answering),
never after the numbers it would have come with.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from harness.errors import QuantbenchError
from harness.models import hub

BUILTIN_CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"
# the hub's repo id form: name or owner/name (letters, digits, - _ .), then optional :config:split
_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(:[\w.-]*){0,2}")
_TEXT_SUFFIXES = (".txt", ".text", ".md", ".raw", ".tokens")


def kind(spec: str) -> str:
    """`builtin`, `file` (a path, existing or not) or `dataset` (an HF datasets id)."""
    if spec == "builtin":
        return "builtin"
    path = os.path.expanduser(spec)
    if (os.path.isfile(path) or spec.startswith(("/", ".", "~")) or spec.lower().endswith(_TEXT_SUFFIXES)
            or not _DATASET_ID.fullmatch(spec)):
        return "file"
    return "dataset"


def file_problem(field: str, spec: str) -> str | None:
    """A missing local file (cheap: config validation calls it for every build)."""
    if kind(spec) == "file" and not os.path.isfile(os.path.expanduser(spec)):
        return (f"{field}={spec!r}: no such file; give a text file, 'builtin', or an HF datasets id "
                "name[:config[:split]]")
    return None


def _split(spec: str) -> tuple[str, str | None, str]:
    name, _, rest = spec.partition(":")
    config, _, split = rest.partition(":")
    return name, config or None, split or "test"


def check(spec: str, field: str = "accuracy.corpus") -> None:
    """Raise a one-line QuantbenchError unless `spec` can be read (see module docstring); no download."""
    if (problem := file_problem(field, spec)):
        raise QuantbenchError(problem)
    if kind(spec) != "dataset":
        return
    name = _split(spec)[0]
    if hub.dataset_cached(name):
        return
    fix = f"give a local text file ({field}=/path/to/text.txt) or 'builtin'"
    if importlib.util.find_spec("datasets") is None:
        raise QuantbenchError(f"{field}={spec!r} looks like an HF datasets id but 'datasets' is not installed; "
                              f"pip install datasets, or {fix}")
    hub.require(name, "dataset", setting=f"{field}={spec!r}", fix=fix)


def load(spec: str) -> str:
    """The corpus text (see module docstring)."""
    if spec == "builtin":
        return BUILTIN_CORPUS.read_text(encoding="utf-8")
    if kind(spec) == "file":
        path = Path(os.path.expanduser(spec))
        if not path.is_file():
            raise QuantbenchError(f"accuracy.corpus={spec!r}: no such file; give a text file path or 'builtin'")
        return path.read_text(encoding="utf-8")
    try:
        import datasets  # optional: only for hub corpora
    except ImportError as exc:
        raise QuantbenchError(f"accuracy.corpus={spec!r} looks like an HF datasets id but 'datasets' is not "
                              "installed; pip install datasets, or pass a local text file") from exc
    name, config, split = _split(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - offline or unknown id
        raise QuantbenchError(f"accuracy.corpus={spec!r} could not be loaded ({type(exc).__name__}); "
                              "use a local text file where the hub is unreachable") from exc
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(ds[column])
