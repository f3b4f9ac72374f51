"""Text corpora (`accuracy.corpus`, `quantizer.calibration_corpus`): what a spec names, reading it, and
checking, before anything loads, that it can be read.

A spec is `builtin` (harness/data/corpus.txt), a local text file, or an HF datasets id
`name[:config[:split]]` (`name` is `dataset` or `owner/dataset`, as on the hub). Perplexity is scored
after all the timing, so a corpus that cannot be read must be refused at validation (a file path: it exists
and decodes as UTF-8) or at preflight (a dataset id: in the local datasets cache with the config and split
asked for, or `datasets` installed and the hub answering), never after the numbers it would have come with.
"""

from __future__ import annotations

import codecs
import functools
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
    """A missing local file, or one that is not UTF-8 text (config validation calls it for every build: the
    decoding is remembered while the file is unchanged)."""
    if kind(spec) != "file":
        return None
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        return (f"{field}={spec!r}: no such file; give a text file, 'builtin', or an HF datasets id "
                "name[:config[:split]]")
    st = os.stat(path)
    if (why := _not_utf8(os.path.realpath(path), st.st_size, st.st_mtime_ns)):
        return f"{field}={spec!r} is not UTF-8 text ({why}); convert it to UTF-8, e.g. iconv -f <its encoding> -t utf-8"
    return None


@functools.lru_cache(maxsize=16)
def _not_utf8(path: str, size: int, mtime_ns: int) -> str | None:
    """Why the file does not decode as UTF-8 (the first bad byte and its offset), else None; read in 1 MiB blocks."""
    decoder, offset, pending = codecs.getincrementaldecoder("utf-8")(), 0, 0
    try:
        with open(path, "rb") as fh:
            while True:
                block = fh.read(1 << 20)
                pending = len(decoder.getstate()[0])  # bytes of a character the last block cut in two
                decoder.decode(block, final=not block)
                if not block:
                    return None
                offset += len(block)
    except UnicodeDecodeError as exc:
        return f"byte 0x{exc.object[exc.start]:02x} at offset {offset - pending + exc.start}: {exc.reason}"
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"


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
    name, config, split = _split(spec)
    fix = f"give a local text file ({field}=/path/to/text.txt) or 'builtin'"
    if (cached := hub.cached_dataset_splits(name)):
        if (problem := _cache_problem(name, cached, config, split)) is None:
            return
        # offline, load_dataset reads only these copies; a reachable hub may still have the config or split
        if hub.probe(name, "dataset") != "ok":
            raise QuantbenchError(f"{field}={spec!r}: {problem}, and the hub cannot be asked for more; name a "
                                  f"cached config and split, or {fix}")
        return
    if importlib.util.find_spec("datasets") is None:
        raise QuantbenchError(f"{field}={spec!r} looks like an HF datasets id but 'datasets' is not installed; "
                              f"pip install datasets, or {fix}")
    hub.require(name, "dataset", setting=f"{field}={spec!r}", fix=fix)


def _cache_problem(name: str, cached: dict[str, list[str] | None], config: str | None, split: str) -> str | None:
    """Why offline `load_dataset(name, config, split=split)` cannot read the cached copies, or None."""
    where = f"the local HF datasets cache ({hub.datasets_cache()}) holds {name}"
    if config is None and len(cached) > 1:
        return f"{where} in configs {', '.join(cached)} and none is named"
    if config is not None and config not in cached:
        return f"{where} only in config(s) {', '.join(cached)}, not {config!r}"
    config = config or next(iter(cached))
    if (splits := cached[config]) is not None and split not in splits:
        return f"{where}:{config} only with split(s) {', '.join(splits)}, not {split!r}"
    return None


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
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, config or split: datasets says which
        why = (str(exc).strip().splitlines() or [""])[0][:200]
        raise QuantbenchError(f"accuracy.corpus={spec!r} could not be loaded ({type(exc).__name__}: {why}); "
                              "check the name, config and split, or pass a local text file") from exc
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(ds[column])
