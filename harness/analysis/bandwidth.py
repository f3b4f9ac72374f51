"""Memory bandwidth: the datasheet values of common accelerators, and this host's, measured once and cached.

CPU: a read-only pass (`sum(b)`, N bytes), torch copy and triad (`a = b + s*c`) over fp32 arrays of
max(256 MiB, 8 x last-level cache) each, best of 5, STREAM byte counting (copy moves 2N bytes, triad 3N;
write-allocate traffic is not counted, as in STREAM); the bound uses the fastest of the three. CUDA: a
device-to-device copy of 1 GiB timed with CUDA events, best of 10 (2N bytes). The cache key is the host
name, the CPU (vendor, family, model, ISA tier: `CpuInfo.key`, as the sweep's resume keys it; a VM's host name
and model name say "vm" / "AMD EPYC" on Zen 3, 4 and 5 alike) or GPU model and the thread count (`host_key`);
see harness/analysis/roofline.py for how the roofline uses it and why llama.cpp can read faster than torch
streams. A refresh keeps the higher of the old and new value only on the same boot of the same machine
(`boot_id`): contention can only lower a best-of measurement there, but a machine behind the same key after
a restart (another VM of the same CPU) may simply be slower, so there the new value replaces the old one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import env  # env.cpu_info looked up per call: tests patch it, and a name bound at import kept the patch
from harness.cache import cache_root, short_hash
from harness.env import device_name
from harness.errors import QuantbenchError

# Peak memory bandwidth (bytes/s) of common accelerators, from the vendors' datasheets.
DEVICES: dict[str, tuple[float, str]] = {
    "h200": (4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e (SXM)"),
    "h100": (3.35e12, "NVIDIA H100 datasheet: 3.35 TB/s HBM3 (SXM5)"),
    "h100-pcie": (2.0e12, "NVIDIA H100 datasheet: 2.0 TB/s HBM2e (PCIe)"),
    "a100-80gb": (2.039e12, "NVIDIA A100 datasheet: 2,039 GB/s HBM2e (80 GB SXM)"),
    "a100-40gb": (1.555e12, "NVIDIA A100 datasheet: 1,555 GB/s HBM2 (40 GB)"),
    "l4": (300e9, "NVIDIA L4 datasheet: 300 GB/s GDDR6"),
    "rtx4090": (1.008e12, "NVIDIA GeForce RTX 4090 specifications: 1,008 GB/s GDDR6X"),
    "m2-ultra": (800e9, "Apple M2 Ultra: 800 GB/s unified memory"),
}


# ----------------------------------------------------------------------------- bandwidth
@dataclass
class Bandwidth:
    bytes_per_s: float
    method: str
    measured_at: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_s / 1e9


def llc_bytes() -> int:
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 32 * 2**20


def measure_cpu(threads: int, repeats: int = 5) -> Bandwidth:
    """Read, copy and triad over fp32 arrays well past the last-level cache (module docstring)."""
    import torch  # heavy: only when a bandwidth is measured (the calculator and reports never need it)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n_bytes = max(256 * 2**20, 8 * llc_bytes())
        n = n_bytes // 4
        a, b, c = (torch.ones(n, dtype=torch.float32) for _ in range(3))  # touched: pages are mapped
        copy_t, triad_t, read_t = math.inf, math.inf, math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            b.sum()
            read_t = min(read_t, time.perf_counter() - t)
            t = time.perf_counter()
            a.copy_(b)
            copy_t = min(copy_t, time.perf_counter() - t)
            t = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            triad_t = min(triad_t, time.perf_counter() - t)
        copy_bw, triad_bw, read_bw = 2 * n * 4 / copy_t, 3 * n * 4 / triad_t, n * 4 / read_t
        del a, b, c
    finally:
        torch.set_num_threads(old)
    method = (f"cpu torch read+copy+triad, 3 x {n_bytes / 2**20:.0f} MiB fp32, {threads} threads, best of {repeats}, "
              f"STREAM counting; read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s, triad "
              f"{triad_bw / 1e9:.1f} GB/s; bound uses max; load average {os.getloadavg()[0]:.1f} while measured")
    return Bandwidth(max(copy_bw, triad_bw, read_bw), method, time.time())


def measure_cuda(repeats: int = 10) -> Bandwidth:
    """Device-to-device copy timed with CUDA events (asynchronous kernels: host clocks would lie)."""
    import torch  # heavy: see measure_cpu

    n_bytes = 2**30
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up: allocation and first launch
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    bw = 2 * n_bytes / best
    method = f"cuda device-to-device copy, 1 GiB, CUDA events, best of {repeats}, 2N bytes; {torch.cuda.get_device_name(0)}"
    return Bandwidth(bw, method, time.time())


def host_key(device: str, threads: int) -> str:
    """What keys a host's cached measurements: host name, machine, the CPU (`CpuInfo.key`: vendor, family, model,
    ISA tier) or GPU model, device kind, threads."""
    name = device_name(device) if device.startswith("cuda") else env.cpu_info(with_torch=False).key()
    return short_hash(socket.gethostname(), platform.machine(), name, device.split(":")[0], threads)


def boot_id() -> str:
    """This boot of this machine ('' where unknown): two measurements under one id are of the same hardware."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def host_bandwidth(device: str, threads: int, refresh: bool = False) -> Bandwidth:
    """The cached bandwidth of this host for `threads` threads (measured on the first call)."""
    path = cache_root() / "roofline" / f"bandwidth-{host_key(device, threads)}.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    if old is not None and not refresh:
        return Bandwidth(float(old["bytes_per_s"]), str(old["method"]), float(old.get("measured_at", 0)))
    if device.startswith("cuda"):
        import torch  # heavy: see measure_cpu

        if not torch.cuda.is_available():
            raise QuantbenchError("roofline: device cuda requested but no CUDA device is visible; use cpu")
        bw = measure_cuda()
    else:
        bw = measure_cpu(threads)
    # Contention (other jobs on a shared host) can only lower a best-of measurement, never raise it, so a
    # refresh on the same boot keeps the higher value: the bound stays an upper limit. Another boot may be
    # another machine behind the same key (module docstring): its own measurement replaces the old one.
    boot = boot_id()
    if old is not None and boot and old.get("boot_id") == boot and float(old["bytes_per_s"]) > bw.bytes_per_s:
        return Bandwidth(float(old["bytes_per_s"]), str(old["method"]), float(old.get("measured_at", 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**asdict(bw), "device": device, "threads": threads, "host": socket.gethostname(),
                               "cpu": env.cpu_info(with_torch=False).key(), "boot_id": boot}))
    os.replace(tmp, path)
    return bw
