"""The model's weights on 2 MiB pages (`measure.hugepages`: auto | on | off), CPU on Linux.

Why: a decode step streams every weight once. With 4 KiB pages that stream crosses a page every 4 KiB, and on
a virtual machine each TLB miss is a two-level page walk; 2 MiB pages cut the walks 512-fold. PyTorch's CPU
allocator asks for huge pages only when `THP_MEM_ALLOC_ENABLE=1` is set before it starts, process-wide, so a
run (and the gate's A/B, two configs in one process) could not choose it. llama.cpp maps its GGUF, where the
page cache may already hold the file in large folios (the `FilePmdMapped` line of its process's smaps).
Measured (AMD EPYC family 25 model 17, Zen 4, 2 threads, 2026-12-05): every Llama-3.2-1B weight matrix at one
row, ATen's GEMV, interleaved passes: fp16 65.5 -> 63.4 ms, bf16 67.5 -> 63.8 ms; the whole fp16 compiled step
against llama.cpp F16 in the paired gate went from -22.8% to -17.1%.

How: every CPU storage behind the model's parameters and buffers (a tensor subclass's inner tensors included,
e.g. torchao's packed int4) is copied into one anonymous private mapping advised `MADV_HUGEPAGE`, 2 MiB
aligned, and each tensor is pointed at its copy in place (`Tensor.set_`), so every reference sees the move and
small tensors share huge pages too. The kernel backs the mapping with huge pages at first touch when
transparent huge pages are `madvise` or `always` (/sys/kernel/mm/transparent_hugepage/enabled); the share of
the weight bytes that got them is read back from /proc/self/smaps and recorded (metric
`weights_hugepage_share`, tag `weights.hugepages`). `auto` is `on` on a Linux CPU run whose kernel allows it.
The default is `off`: placing the weights costs ~3.5-4.5 s per GB here (the kernel zeroes and compacts memory for
each huge page), for a ~1% decode gain; the scaling experiments, which measure decode at 1B-8B, set `auto`.
"""

from __future__ import annotations

import mmap
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.errors import QuantbenchError
from harness.measure import trim_heap

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line (AVX-512 loads, as the allocator gives)


@dataclass
class Moved:
    """What `move` did: `tag` for tag weights.hugepages, `share` of the weight bytes on huge pages (None: off)."""

    tag: str
    share: float | None = None
    arena: Any = None  # the mapping; its memory lives as long as any tensor on it (torch.frombuffer keeps it)


def thp_mode(path: Path = THP_MODE) -> str:
    """The kernel's transparent huge page mode: always | madvise | never | unavailable."""
    try:
        m = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return "unavailable"
    return m.group(1) if m else "unavailable"


def resolve(setting: str, device: str, mode: str | None = None) -> tuple[bool, str]:
    """(move?, why) for `measure.hugepages` on `device`; the why is the tag's text."""
    if setting == "off":
        return False, "off (measure.hugepages=off)"
    if device != "cpu" or not sys.platform.startswith("linux"):
        return False, f"off ({device} run)" if device != "cpu" else "off (not Linux)"
    mode = mode or thp_mode()
    if mode not in ("madvise", "always"):
        return False, f"off (transparent huge pages: {mode})"
    return True, f"on (transparent huge pages: {mode})"


def preflight(setting: str, device: str) -> None:
    """`measure.hugepages=on` where it cannot be done: one line, before anything loads."""
    on, why = resolve("auto", device)
    if setting == "on" and not on:
        raise QuantbenchError(f"measure.hugepages=on cannot be done here: {why.removeprefix('off (').rstrip(')')}; "
                              "use measure.hugepages=auto or off")


def tensors(model: Any) -> list[torch.Tensor]:
    """The plain tensors behind the model's parameters and buffers (a subclass is opened by its flatten)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(t: Any) -> None:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            return
        seen.add(id(t))
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            out.append(t)
        elif hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                visit(getattr(t, name))
        # other subclasses (bitsandbytes' Params4bit, ...) keep their memory

    for t in [*model.parameters(), *model.buffers()]:
        visit(t)
    return [t for t in out if t.device.type == "cpu" and t.numel() > 0]


def move(model: Any, setting: str, device: str) -> Moved:
    """Put the model's CPU weights on huge pages (module docstring); before compile, outside any timing."""
    on, why = resolve(setting, device)
    if not on:
        return Moved(why)
    groups: dict[int, list[torch.Tensor]] = {}  # storage -> the tensors on it (tied weights share one)
    for t in tensors(model):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {ptr: ts[0].untyped_storage().nbytes() for ptr, ts in groups.items()}
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    if total == 0:
        return Moved(why, 0.0)
    # whole huge pages (the last one too), plus room to align the start: < 4 MiB over the weights
    arena = mmap.mmap(-1, -(-total // HUGE) * HUGE + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copy below faults in huge pages
    base = torch.frombuffer(arena, dtype=torch.uint8)
    start = (-base.data_ptr()) % HUGE
    pos = start
    with torch.no_grad():
        for ptr, ts in groups.items():
            n = sizes[ptr]
            old = ts[0].untyped_storage()
            new = base[pos:pos + n]
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in ts:  # same offsets, sizes and strides on the copy
                t.set_(new.untyped_storage(), (pos + t.storage_offset() * t.element_size()) // t.element_size(),
                       t.size(), t.stride())
            pos += -(-n // ALIGN) * ALIGN
            del old
            trim_heap()  # the old storage is free now: back to the system, not kept beside the copy
    share = huge_share(base.data_ptr() + start, total)
    return Moved(why, share, arena)


def huge_share(addr: int, nbytes: int, smaps: Path = Path("/proc/self/smaps")) -> float | None:
    """Share of [addr, addr + nbytes) that the kernel backs with huge pages (AnonHugePages of its mapping)."""
    try:
        text = smaps.read_text()
    except OSError:
        return None
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= addr < hi:
            m = re.search(r"AnonHugePages:\s+(\d+) kB", block)
            return min(1.0, int(m.group(1)) * 1024 / nbytes) if m else 0.0
    return None
