"""What machine and software a number was measured on (recorded as tags on every run)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("torch", "transformers", "bitsandbytes", "torchao", "optimum-quanto", "optimum", "gptqmodel",
             "hqq", "llama_cpp_python", "accelerate", "mlflow", "hydra-core")


def wikitext_dir() -> Path:
    """The shared WikiText-2 folder, read in place (never copied into the project).

    Looked up as `$QUANTBENCH_WIKITEXT`, else `../shared/data/wikitext-2` beside this checkout, else the
    same beside the checkout this one was cloned from (a CI job cloning the repo elsewhere, e.g. /tmp).
    Returns the first that exists, or the `../shared` path (so an error names where it was expected).
    """
    tail = Path("shared") / "data" / "wikitext-2"
    candidates = [Path(os.environ["QUANTBENCH_WIKITEXT"])] if os.environ.get("QUANTBENCH_WIKITEXT") else []
    candidates.append(REPO.parent / tail)
    try:
        origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        origin = ""
    if origin and "://" not in origin and ":" not in origin.split("/")[0]:  # a local path, not a URL
        candidates.append(Path(origin).resolve().parent / tail)
    return next((c for c in candidates if c.is_dir()), REPO.parent / tail)


def versions() -> dict[str, str]:
    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(repo: Path = REPO) -> str:
    """HEAD commit, with '-dirty' when tracked files differ (results from uncommitted code say so)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_model()


def machine_tags(device: str, threads: int) -> dict[str, str]:
    tags = {f"version.{k}": v for k, v in versions().items()}
    tags.update({
        "git_commit": git_commit(), "device": device, "device_name": device_name(device),
        "cpu_model": cpu_model(), "threads": str(threads), "hostname": platform.node(),
        "python": platform.python_version(), "cpu_count": str(os.cpu_count()),
    })
    return tags
