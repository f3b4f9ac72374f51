"""What machine and software a number was measured on (recorded as tags on every run)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import cgroup

# torch is imported where used: env is read by CLI paths (report, sweep resume keys) that never load a model
# (tests/test_layout.py, LAZY_OK).

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


# x86 flags (as /proc/cpuinfo spells them) that decide which CPU kernels run fast, weakest first.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products in hardware; without them bf16 is emulated


@dataclass(frozen=True)
class CpuInfo:
    """What the CPU can compute natively (the instruction sets that pick kernels), from /proc/cpuinfo."""

    vendor: str = ""
    family: str = ""
    model: str = ""
    model_name: str = ""
    flags: frozenset[str] = frozenset()
    torch_capability: str = ""  # torch.backends.cpu.get_cpu_capability(): the kernels ATen dispatches to

    @property
    def isa(self) -> str:
        """The highest tier: amx > avx512_bf16 > avx512 > avx2 > baseline (tag `cpu.isa`)."""
        if "amx_tile" in self.flags:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if "avx512f" in self.flags:
            return "avx512"
        if "avx2" in self.flags:
            return "avx2"
        return "baseline"

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in NATIVE_BF16_FLAGS)

    @property
    def uarch(self) -> str:
        """AMD Zen generation from family/model (AMD's published numbering); '' when not known."""
        if self.vendor != "AuthenticAMD" or not self.family.isdigit():
            return ""
        fam, model = int(self.family), int(self.model) if self.model.isdigit() else -1
        if fam == 23:
            return "zen/zen2"
        if fam == 25:  # 0x19: Zen 4 is models 0x10-0x1F (Genoa), 0x60-0x7F (Raphael, Phoenix), 0xA0-0xAF (Bergamo,
            # Siena); the rest Zen 3 (Milan, Vermeer, Cezanne). By model, not AVX-512: a VM may hide Zen 4's flags
            zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
            return "zen4" if zen4 else "zen3"
        if fam == 26:  # 0x1a
            return "zen5"
        return ""

    def tags(self) -> dict[str, str]:
        """Tags recorded on every run, so results from different CPUs are never compared by mistake."""
        tags = {"cpu.isa": self.isa, "cpu.vendor": self.vendor, "cpu.family": self.family, "cpu.model": self.model,
                "cpu.flags": ",".join(f for f in ISA_FLAGS if f in self.flags) or "none",
                "cpu.bf16": "native" if self.native_bf16 else "emulated",
                "cpu.torch_capability": self.torch_capability}
        if self.uarch:
            tags["cpu.uarch"] = self.uarch
        return tags

    def key(self) -> str:
        """'AMD EPYC ... (AuthenticAMD family 26 model 2, avx512_bf16)': what tells CPUs apart where the model name
        does not (VMs report one marketing name across generations). Keys the sweep's resume and the host caches."""
        return f"{self.model_name or '?'} ({self.vendor} family {self.family} model {self.model}, {self.isa})"

    def describe(self) -> str:
        """One line for reports: 'AMD EPYC ... (zen3, family 25 model 1): avx2, bf16 emulated'."""
        where = ", ".join(x for x in (self.uarch, f"family {self.family} model {self.model}" if self.family else "") if x)
        return (f"{self.model_name or 'unknown CPU'}" + (f" ({where})" if where else "")
                + f": {self.isa}, bf16 {'native' if self.native_bf16 else 'emulated'}"
                + (f", torch kernels {self.torch_capability}" if self.torch_capability else ""))


def parse_cpuinfo(text: str, torch_capability: str = "") -> CpuInfo:
    """CpuInfo from the text of /proc/cpuinfo (first processor block; all cores of a VM report the same)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return CpuInfo(vendor=fields.get("vendor_id", ""), family=fields.get("cpu family", ""),
                   model=fields.get("model", ""), model_name=fields.get("model name", ""),
                   flags=frozenset(fields.get("flags", "").split()), torch_capability=torch_capability)


@functools.lru_cache(maxsize=2)
def cpu_info(with_torch: bool = True) -> CpuInfo:
    """This machine's CpuInfo (the torch capability is read only when torch is importable and `with_torch`:
    a process that never needs torch, such as the gate's parent, names its CPU without a 2 s import)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    capability = ""
    try:
        if with_torch:
            import torch

            capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - torch missing or too old: the flags alone still decide
        capability = ""
    info = parse_cpuinfo(text, capability)
    if not info.model_name:
        info = CpuInfo(**{**info.__dict__, "model_name": platform.processor() or platform.machine()})
    return info


def cxx_compiler() -> str | None:
    """A C++ compiler on PATH ($CXX, g++ or clang++), or None: torch inductor's CPU kernels and the C++ extensions
    (quantizers/rows8.py, quanto's quanto_cpp) are built with it."""
    return next((c for c in (os.environ.get("CXX", "g++"), "g++", "clang++") if shutil.which(c)), None)


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


def failure_tags(exp: Any) -> dict[str, str]:
    """machine_tags for a run that ended before it measured (FAILED, OOM, SKIPPED): where it was tried and with what
    libraries, so a failure reads like the OK runs beside it. `exp` is None when the config itself was refused."""
    threads = (exp.measure.threads if exp is not None else 0) or cgroup.usable_cpus()  # as set_threads sets it
    tags = machine_tags("cpu", threads)  # the host; no GPU is asked (a "needs CUDA" cell has none to name)
    if exp is not None:
        tags["device"] = str(exp.measure.device)  # as asked (auto: not resolved)
    return tags


def machine_tags(device: str, threads: int) -> dict[str, str]:
    tags = {f"version.{k}": v for k, v in versions().items()}
    tags.update({
        "git_commit": git_commit(), "device": device, "device_name": device_name(device),
        "cpu_model": cpu_model(), "threads": str(threads), "hostname": platform.node(),
        "python": platform.python_version(), "cpu_count": str(os.cpu_count()),
    })
    tags.update(cpu_info().tags())  # the host CPU's ISA, also on GPU runs (it drives the CPU-side work)
    return tags
