"""Hand the calling thread's OpenMP workers back before another thread computes: `free_omp_pool()`.

Why: PyTorch's CPU build runs its intra-op parallelism on GNU OpenMP (libgomp). libgomp keeps a pool of
worker threads per thread that ever started a parallel region, and counts every worker of every pool; once
that count exceeds the CPUs it can use, it "throttles": a worker waiting at a barrier spins ~100 iterations
instead of ~300,000 and then sleeps on a futex, so every parallel op pays a wake-up. transformers' continuous
batching decodes on its own thread (`generate_batch`, `init_continuous_batching`), a second OpenMP master
next to the main thread, which loaded the model with its own pool. On 2 cores at 2 threads that is 3-4
threads counted for 2 CPUs, and every op of the batcher's thread ran ~2x slower than the same op on the main
thread (AMD EPYC family 25 model 17, Zen 4, 2026-12-07: a one-row bf16 576x1536 linear 64-90 us on the main
thread, 134-143 us on a second thread; 64-91 us there once the main thread's pool was freed;
benchmarks/omp_pool.py times the whole batcher). No environment variable lifts the throttle (GOMP_SPINCOUNT
only lowers it), but OpenMP 5.0's `omp_pause_resource_all` frees the caller's pool: its workers exit, the
count drops, and the main thread's next parallel op starts a fresh pool.

Call it on the thread that will wait (the main thread) right before the other thread starts computing, and
do no parallel torch work on it until that thread is done (that would start a new pool). A no-op, returning
False, where PyTorch loaded no libgomp (another OpenMP runtime, macOS) or the runtime lacks the call.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: soft keeps nothing of a pool on the host anyway (libgomp)


@functools.cache
def _pause_calls() -> tuple[Any, ...]:
    """`omp_pause_resource_all` of every libgomp this process loaded (torch's own copy; llama.cpp's ggml may
    bring another), each with its own pools."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return ()
    calls = []
    for path in sorted(paths):
        try:
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)  # loaded: dlopen returns that copy
        except OSError:
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            calls.append(fn)
    return tuple(calls)


def free_omp_pool() -> bool:
    """Free the calling thread's OpenMP worker pools (module docstring); True when a runtime did."""
    import torch  # noqa: F401 - loads torch's libgomp before the lookup (cached) reads the process's libraries

    return [fn(OMP_PAUSE_SOFT) for fn in _pause_calls()].count(0) > 0
