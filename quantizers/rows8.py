"""quantbench's one-row kernels, `measure.gemv=rows8`: a batch-1 decode step's bf16/fp16 and int8 matmuls on CPU.

Why kernels of our own: a batch-1 decode step streams every weight once, and on a few cores the stream is
limited by how many cache-line misses each core keeps in flight. ATen's GEMV and oneDNN read one weight row at
a time; quantizers/rows8.cpp reads 8 rows side by side (8 streams per core, fp32 sums, AVX-512; bf16 through
vdpbf16ps where the CPU has AVX512_BF16). llama.cpp's F16/BF16 matmuls stream at that rate, so without it the
16-bit rows of the scaling table compared kernels, not formats (issue #30). Measured (AMD EPYC family 25 model
17, Zen 4, 2 threads, 2026-12-05; every Llama-3.2-1B matrix once at one row on 2 MiB pages, 8 interleaved
rounds, GB/s median): bf16 rows8 45.5 vs ATen 38.6, fp16 rows8 44.8 vs ATen 39.1, int8 rows8 24.3 vs
`_weight_int8pack_mm` 21.7 (int8 is compute-bound: three ops per 16 weights to widen and multiply them).
int4 and int8 go through integer dot products instead where the CPU has AVX512_VNNI (`gemv4`, `gemv8t`;
quantizers/vnni.py says how the numerics stay at fp32's): same host and setup, int4 34.4 GB/s vs torchao's kernel
21.9, int8 34.7 vs gemv8 24.8 (docs/fast_path.md).

How it runs: `load()` builds quantizers/rows8.cpp once per torch version with torch's C++ extension builder
(g++, ~10-25 s; `scripts/setup.sh` builds it ahead) into the cache (`$QUANTBENCH_CACHE/ext`), and loads it as
the ops `torch.ops.quantbench.gemv16`, `.gemv16t`, `.gemv8`, `.gemv4` and `.gemv8t` (with fake kernels, so
torch.compile keeps each as one opaque call). Where the CPU has AVX512_BF16, bf16 linears become
`Bf16RowsLinear`: the matrix in tiles of 4 rows (`gemv16t`, one contiguous stream per thread: 45.5 GB/s against
37.6 for the 8 row-major rows on 14336 x 4096, Zen 4, 2 threads; rows8.cpp has the rest) for inputs of up to 64
rows. `install(model)` gives every other plain 16-bit `nn.Linear` on CPU a forward that sends one-row inputs
(a batch-1 decode step) to gemv16, and switches quantizers/int8pack.py's `Int8PackLinear` layers to gemv8 for
one row; more rows (prefill, scoring, batches) keep the layer's own path, oneDNN's GEMM, ATen's int8 op or
quantizers/dtype.py's fp32 upcast. With AVX512_VNNI, torchao's int4 linears become `Int4RowsLinear` and the
int8 ones `Int8RowsLinear` (gemv4 / gemv8t for every input width; quantizers/vnni.py). Other quantized layers
are left alone. It needs AVX-512 (`available`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import types
from pathlib import Path
from typing import Any

import torch

from harness import env  # env.cpu_info looked up per call: tests patch it
from harness.cache import cache_root
from harness.errors import QuantbenchError
from quantizers.int8pack import Int8PackLinear
from quantizers.vnni import swap_layers, to_int4rows, to_int8rows

SOURCE = Path(__file__).with_name("rows8.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma", "-fopenmp"]


def available(cpu: Any) -> tuple[bool, str]:
    """(usable?, why not) on `cpu` (harness.env.CpuInfo): the kernel is AVX-512 code."""
    if "avx512f" not in cpu.flags or "avx512bw" not in cpu.flags:
        return False, f"quantbench's rows8 kernel needs AVX-512 (this CPU: {cpu.isa})"
    return True, ""


def require(cpu: Any) -> None:
    """One line, before any model loads, where `cpu` cannot run the kernel."""
    ok, why = available(cpu)
    if not ok:
        raise QuantbenchError(f"measure.gemv=rows8 cannot run: {why}; use measure.gemv=auto or aten")


@functools.cache
def load() -> None:
    """Build (first use) and load the ops; one line on failure, before any model loads."""
    torch.ops.load_library(str(library()))
    torch.library.register_fake("quantbench::gemv16")(lambda x, w, dp=True: x.new_empty(w.shape[0]))
    torch.library.register_fake("quantbench::gemv8")(lambda x, q, scale: x.new_empty(q.shape[0]))
    torch.library.register_fake("quantbench::gemv4")(lambda x, w, gs: x.new_empty(*x.shape[:-1], w.shape[0] * 16))
    torch.library.register_fake("quantbench::gemv8t")(lambda x, w, s: x.new_empty(*x.shape[:-1], w.shape[0] * 16))
    torch.library.register_fake("quantbench::gemv16t")(lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0] * 4))


def library() -> Path:
    """The built kernel library, built here first if missing.

    Its folder is named by a hash of the source, the flags and torch's version, so a built library is loaded
    directly (milliseconds); torch's builder (it imports setuptools and runs ninja: seconds on 2 cores) only runs
    when the library is missing."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()
    where = cache_root() / "ext" / f"rows8-{key[:16]}"
    lib = where / "quantbench_rows8.so"
    if not lib.is_file():
        where.mkdir(parents=True, exist_ok=True)
        # our own lock, which the kernel drops if this process dies: torch's builder keeps a `lock` file while it
        # builds, and one left by a killed build makes every later build wait for it forever
        with open(where / ".build.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if not lib.is_file():
                (where / "lock").unlink(missing_ok=True)  # stale: no other quantbench build holds the flock
                _build(where)
    return lib


def _build(where: Path) -> None:
    from torch.utils.cpp_extension import load as build

    try:
        build("quantbench_rows8", [str(SOURCE)], extra_cflags=FLAGS, build_directory=str(where),
              is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - a compiler error is many lines; the run gets one
        lines = str(exc).splitlines()  # the compiler's first `error:` line, else the builder's own first line
        first = next((ln for ln in lines if "error:" in ln), next((ln for ln in lines if "error" in ln.lower()), lines[0]))
        raise QuantbenchError(f"measure.gemv=rows8: building {SOURCE.name} failed ({first.strip()[:200]}); "
                              "install g++ (scripts/setup.sh does) or use measure.gemv=aten") from exc


def gemv16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One row `x` (K values) times `w` [N, K] (bf16/fp16): N values in x's dtype, accumulated in fp32."""
    load()
    return torch.ops.quantbench.gemv16(x, w)


def gemv8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One row `x` times int8 rows `q` [N, K], each times its `scale` [N]: N values in x's dtype (fp32 sums)."""
    load()
    return torch.ops.quantbench.gemv8(x, q, scale)


def _one_row_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == x.shape[-1]:  # one row: a batch-1 decode step
        y = torch.ops.quantbench.gemv16(x, self.weight).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias
    return self.qb_wide_forward(x)


def relayout16(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> gemv16t's tiles of 4 rows, [N/4, K/32, 128] (rows8.cpp says why): written in place into
    the result, no temporary copy of the matrix."""
    n, k = w.shape
    out = torch.empty(n // 4, k // 32, 128, dtype=w.dtype)
    out.view(n // 4, k // 32, 4, 32).copy_(w.reshape(n // 4, 4, k // 32, 32).permute(0, 2, 1, 3))
    return out


def unpack16(packed: torch.Tensor) -> torch.Tensor:
    """gemv16t's tiles back to the [N, K] matrix."""
    t, c, _ = packed.shape
    return packed.reshape(t, c, 4, 32).permute(0, 2, 1, 3).reshape(t * 4, c * 32)


class Bf16RowsLinear(torch.nn.Module):
    """y = x @ W.T for a bf16 W held in gemv16t's tiles of 4 rows: the same values, one contiguous stream per
    thread. Inputs of up to WIDE rows (decode steps, batches, short prompts) run on the kernel; wider ones
    (perplexity windows, long prompts) on the unpacked matrix through torch's own matmul, where compute, not the
    stream, is the cost."""

    WIDE = 64

    def __init__(self, packed: torch.Tensor, bias: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = int(packed.shape[1]) * 32, int(packed.shape[0]) * 4
        self.register_buffer("packed", packed)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.numel() <= self.WIDE * self.in_features:
            y = torch.ops.quantbench.gemv16t(x, self.packed)
            return y if self.bias is None else y + self.bias
        return torch.nn.functional.linear(x, unpack16(self.packed).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def bf16_tiles(m: Any, cpu: Any) -> bool:
    """A plain bf16 CPU linear (its class's own forward) in a shape gemv16t takes, on a CPU with AVX512_BF16."""
    w = getattr(m, "weight", None)
    return ("avx512_bf16" in cpu.flags and type(m) is torch.nn.Linear and type(w) in (torch.Tensor, torch.nn.Parameter)
            and w.device.type == "cpu" and w.dtype == torch.bfloat16 and "forward" not in vars(m)
            and w.shape[0] % 4 == 0 and w.shape[1] % 32 == 0)


def to_bf16rows(model: Any, cpu: Any) -> int:
    """Swap every linear `bf16_tiles` takes for a Bf16RowsLinear; returns how many. A head tied to the input
    embedding gets its own tiled copy (the embedding keeps the table: +vocab x hidden x 2 bytes, in the memory
    estimate); an untied layer's old matrix is freed."""
    return swap_layers(model, lambda m: bf16_tiles(m, cpu),
                       lambda m: Bf16RowsLinear(relayout16(m.weight.detach()), m.bias))


def install(model: Any) -> int:
    """One-row inputs of the model's plain 16-bit CPU linears and int8 layers go to the kernels; bf16 linears
    become Bf16RowsLinear where the CPU has AVX512_BF16, and torchao's int4 layers Int4RowsLinear (every input,
    where the CPU has AVX512_VNNI); returns how many layers."""
    cpu = env.cpu_info()
    require(cpu)
    load()
    n = to_int4rows(model) + to_int8rows(model) if "avx512_vnni" in cpu.flags else 0
    n += to_bf16rows(model, cpu)
    for m in model.modules():
        if isinstance(m, Int8PackLinear):  # int8 rows + scales (quantizer int8 on CPU): the int8 kernel
            n += not m.one_row
            m.one_row = True
            continue
        w = getattr(m, "weight", None)
        if type(m) is torch.nn.Linear and type(w) in (torch.Tensor, torch.nn.Parameter) and w.device.type == "cpu" \
                and w.dtype in (torch.bfloat16, torch.float16) and w.is_contiguous() and "qb_wide_forward" not in vars(m):
            m.qb_wide_forward = m.forward  # the class's forward, or quantizers/dtype.py's upcast for many rows
            m.forward = types.MethodType(_one_row_forward, m)
            n += 1
    return n
