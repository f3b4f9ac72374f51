"""Can a Hugging Face hub id be had? Answered before anything loads (preflight), offline when possible.

A hub model (`model=hf`) or dataset (`accuracy.corpus=owner/name`) is usable when it is already in the
local cache (what `snapshot_download` / `datasets.load_dataset` left there: no network needed), or when
the hub answers for it. Without this, a mistyped id or a machine without internet is found only when the
tokenizer loads or, for a corpus, after all the timing, whose numbers are then thrown away.

The cache folders are read from the environment at call time (HF_HOME, HF_HUB_CACHE, HF_DATASETS_CACHE,
as huggingface_hub and datasets resolve them), and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are honoured
without asking the network. A probe's answer is remembered for the process (a sweep checks each cell).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from harness.errors import QuantbenchError

PROBE_TIMEOUT_S = 5.0  # a hub that does not answer in this time counts as unreachable


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    return _flag("HF_HUB_OFFLINE") or _flag("HF_DATASETS_OFFLINE") or _flag("TRANSFORMERS_OFFLINE")


def hf_home() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.environ.get("HF_HOME") or default).expanduser()


def hub_cache() -> Path:
    return Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or hf_home() / "hub")


def datasets_cache() -> Path:
    return Path(os.environ.get("HF_DATASETS_CACHE") or hf_home() / "datasets").expanduser()


def cached_snapshot(repo_id: str, repo_type: str = "model", revision: str = "main") -> Path | None:
    """The local snapshot folder of a hub repo, or None (no network: `local_files_only`)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=hub_cache(),
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, a malformed id: either way not usable offline
        return None


def dataset_cached(name: str) -> bool:
    """Whether `datasets.load_dataset(name)` finds a prepared copy offline (<cache>/<owner>___<name>/...)."""
    root = datasets_cache() / name.replace("/", "___")
    return root.is_dir() and any(p.is_dir() for p in root.glob("*/*/*"))


def cached_dataset_splits(name: str) -> dict[str, list[str] | None]:
    """Config -> splits of the prepared copies of dataset `name` in the local cache ({} if none; splits None where
    the copy has no dataset_info.json). Offline `load_dataset` reads only these: the config is the folder name."""
    out: dict[str, list[str] | None] = {}
    for folder in sorted(p for p in (datasets_cache() / name.replace("/", "___")).glob("*/*/*") if p.is_dir()):
        try:
            splits = list(json.loads((folder / "dataset_info.json").read_text(encoding="utf-8")).get("splits") or {})
        except (OSError, ValueError, AttributeError):
            splits = None
        known = out.get(folder.parts[-3], [])  # the union over copies; unknown if any copy cannot say
        out[folder.parts[-3]] = None if splits is None or known is None else sorted({*known, *splits})
    return out


@functools.lru_cache(maxsize=64)
def probe(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str:
    """Ask the hub about a repo: "ok", "missing" (no such repo or revision, or gated) or "unreachable: why"."""
    if offline():
        return "unreachable: HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        return "unreachable: huggingface_hub is not installed"
    api = HfApi()
    info = api.dataset_info if repo_type == "dataset" else api.model_info
    try:
        info(repo_id, revision=revision, timeout=PROBE_TIMEOUT_S)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return "missing"
    except Exception as exc:  # noqa: BLE001 - DNS, refused, timeout, proxy: the hub cannot be reached
        return f"unreachable: {type(exc).__name__}"
    return "ok"


def require(repo_id: str, repo_type: str, *, setting: str, fix: str, revision: str | None = None) -> None:
    """Raise a one-line QuantbenchError unless the hub answers for a repo that is not in the local cache.

    `setting` names what the user wrote (`accuracy.corpus='owner/name'`), `fix` what to do instead (`pass a
    local directory`); the message says whether the hub lacks the repo or cannot be reached.
    """
    answer = probe(repo_id, repo_type, revision)
    if answer == "ok":
        return
    if answer == "missing":
        rev = f" (revision {revision!r})" if revision else ""
        raise QuantbenchError(f"{setting}: the hub has no {repo_type} {repo_id!r}{rev}, or it is gated; check the "
                              f"id, or {fix}")
    cache = f"HF datasets cache ({datasets_cache()})" if repo_type == "dataset" else f"HF cache ({hub_cache()})"
    raise QuantbenchError(f"{setting} is not in the local {cache} and the hub is unreachable "
                          f"({answer.split(': ', 1)[-1]}); {fix}, or fetch it once where the hub is reachable")


def clear_cache() -> None:
    """Forget remembered probes (tests change the environment between calls)."""
    probe.cache_clear()
