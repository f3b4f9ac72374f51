"""Shape-only ("fake") kernels for the mslk int4 matmuls that torchao's CUDA int4 layouts call, where mslk lacks one.

Why: torch.compile traces a step with fake tensors, so every op in it needs a kernel that gives the output's shape
without running. mslk-cuda 1.1.0 (the release for torch 2.11) registers the Meta kernel of `bf16i4bf16_shuffled`,
the op of torchao's `preshuffled` int4 layout, under a misspelled name (`bf116i4bf16_shuffled`, csrc/gemm/
gemm_ops.cpp; the string is in the wheel's mslk.so), and its Python files register no fake for it. Dynamo then
breaks the graph at every such linear instead of failing: a compiled 8B step becomes hundreds of graph pieces with
eager code between them, launch-bound, and would read as "preshuffled is slow". `register_missing_fakes` gives each
listed op the shape of what mslk's CUDA kernel returns ([M, N]: `int4_linear_fake`), and only where no Meta kernel
exists, so a fixed mslk keeps its own. Tag `quantizer.fake_ops` says what was registered.
"""

from __future__ import annotations

import math
from typing import Any

# torchao 0.18's int4 linears on CUDA: preshuffled (Int4PreshuffledTensor) and plain (Int4Tensor); both take
# (X bf16 [..., K], W int4 packed [N, K/2], group scale, group zero) and return bf16 [M, N], M = the product of X's
# leading dims: always 2-D (mslk csrc/gemm/cutlass/bf16i4bf16.cu, bf16i4bf16_dispatch: `at::empty({M, N})`). torchao
# reshapes the result to [..., N] itself; its preshuffled linear passes the decode step's 3-D [B, 1, K] unreshaped
MSLK_INT4_LINEAR_OPS = ("bf16i4bf16_shuffled", "bf16i4bf16_rowwise")
REGISTERED: list[str] = []  # qualified names this process gave a fake (a second load finds them registered)


def int4_linear_fake(x: Any, w: Any, scale: Any, zero: Any) -> Any:
    """What mslk's CUDA kernel returns: X of 2 or 3 dims times W [N, K/2] gives [M, N] in bf16, M = the product of
    X's leading dims, 2-D even for a 3-D X. Not X's leading dims + [N] (mslk's own `bf16i4bf16_rowwise_meta` of a 3-D
    X): inductor checks a compiled call's output against the fake's shape, and a 3-D fake for the kernel's 2-D
    output fails the first compiled int4 step ("wrong number of dimensions"), sending the cell to eager."""
    import torch

    if x.dim() not in (2, 3) or w.dim() != 2:
        raise RuntimeError(f"The dim of XQ must be 2 or 3, and dim of WQ must be 2 (got {x.dim()} and {w.dim()})")
    return x.new_empty((math.prod(x.shape[:-1]), w.shape[0]), dtype=torch.bfloat16)


def register_missing_fakes(namespace: str = "mslk", ops: tuple[str, ...] = MSLK_INT4_LINEAR_OPS) -> list[str]:
    """Register `int4_linear_fake` for each op of `namespace` that is defined and has no Meta kernel; returns the
    ones registered (none on a second call: the fake is then the Meta kernel). The op library must be loaded."""
    import torch

    done = []
    for op in ops:
        qualname = f"{namespace}::{op}"
        if not hasattr(getattr(torch.ops, namespace), op):
            continue  # not in this build of the library
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
            continue  # the library's own shape rule
        torch.library.register_fake(qualname)(int4_linear_fake)
        REGISTERED.append(qualname)
        done.append(op)
    return done


def ensure_mslk_fakes() -> str:
    """Load mslk and register what it lacks (module docstring); the tag value `quantizer.fake_ops`."""
    import mslk  # noqa: F401 - defines the torch.ops.mslk ops (torchao also imports it when it is installed)

    register_missing_fakes()
    ours = [q for q in REGISTERED if q.startswith("mslk::")]
    return ("registered for " + ", ".join(ours) + " (mslk has no Meta kernel for them)" if ours
            else "none needed (mslk's own Meta kernels)")
