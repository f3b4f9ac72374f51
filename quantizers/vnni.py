"""int4 and int8 layers on quantbench's integer-dot-product kernels (`measure.gemv=rows8`, quantizers/rows8.cpp's
`gemv4` and `gemv8t`; CPUs with AVX512_VNNI).

`to_int4rows(model)` swaps every linear whose weight is torchao's CPU int4 tensor (`Int4OpaqueTensor`, the
`int4` quantizer's `packed` kernel: int4 values plus a bf16 scale and zero per group) for an `Int4RowsLinear`;
`to_int8rows(model)` swaps quantizers/int8pack.py's `Int8PackLinear` (the `int8` quantizer and `head=int8`: int8
rows, one scale each) for an `Int8RowsLinear`. Each holds the same values, scales and zeros, re-laid in tiles of
16 rows for its kernel: the quantization is the quantizer's, bit for bit (tested), and the stored bytes are the
same. Only the multiplication differs: the kernels write each group of 32 x values as 24-bit fixed point (every
bf16 value down to 2^-15 of its group's largest exactly) and multiply with integer dot products, several times
fewer operations than widening the weights to fp32 (rows8.cpp says why that matters, and why 24 bits and not 15);
the outputs match an fp64 matmul of the dequantized weights to ~3e-7 of the largest, as an fp32 matmul does
(tested). Every input width runs on them, one row for a decode step and four at a time
for a prompt, so the quantizer's copy is not kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from harness.measure import trim_heap as trim
from quantizers.common import release
from quantizers.int8pack import Int8PackLinear


class Int4RowsLinear(torch.nn.Module):
    """y = x @ W.T with W = (q - 8) * scale + zero per group of `group_size` weights (torchao's int4)."""

    def __init__(self, packed: Any, group_size: int, in_features: int, bias: Any) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, int(packed.shape[0]) * 16, group_size
        # uint8 [N/16, K/group_size, group_size * 8 + 64]: per tile of 16 rows and group, the int4 values two per
        # byte, then the 16 rows' bf16 scales and zeros (rows8.cpp, gemv4, has the byte order)
        self.register_buffer("packed", packed)
        self.bias = bias

    def forward(self, x: Any) -> Any:
        y = torch.ops.quantbench.gemv4(x, self.packed, self.group_size)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8RowsLinear(torch.nn.Module):
    """y = (x @ q.T) * scale: int8 rows `q`, one bf16 scale per row (quantizers/int8pack.py's values)."""

    def __init__(self, packed: Any, scale: Any, in_features: int, bias: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, int(packed.shape[0]) * 16
        self.register_buffer("packed", packed)  # uint8 [N/16, K/4, 64]: q + 128, tiles of 16 rows (rows8.cpp)
        self.register_buffer("scale", scale)  # bf16 [N]
        self.bias = bias

    def forward(self, x: Any) -> Any:
        y = torch.ops.quantbench.gemv8t(x, self.packed, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def unpack(weight: Any) -> tuple[Any, Any, Any, int]:
    """(q uint8 [N, K] in 0..15, scale [G, N], zero [G, N], group size) of an `Int4OpaqueTensor`.

    ATen's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`) stores blocks of 64 rows column by column:
    for each k, 32 bytes whose low nibbles are rows 0-31 of the block and high nibbles rows 32-63."""
    n, k = weight.shape
    gs = int(weight.block_size[-1])
    packed = weight.qdata.view(torch.uint8).reshape(n // 64, k, 32)
    q = torch.cat([packed & 15, packed >> 4], dim=2).permute(0, 2, 1).reshape(n, k)
    sz = weight.scale_and_zero  # [G, N, 2]: scale, zero
    return q, sz[..., 0], sz[..., 1], gs


def relayout(q: Any, scale: Any, zero: Any, gs: int) -> Any:
    """The kernel's layout (rows8.cpp, gemv4): q [N, K] uint8, scale and zero [G, N] -> [N/16, G, gs * 8 + 64]."""
    n, k = q.shape
    t = q.reshape(n // 16, 16, k // 8, 8).permute(0, 2, 1, 3)  # [tile, chunk of 8 k, row, 8 k]
    chunks = (t[..., :4] | (t[..., 4:] << 4)).reshape(n // 16, k // gs, gs * 8)  # 64 bytes per chunk
    sz = [v.to(torch.bfloat16).reshape(k // gs, n // 16, 16).permute(1, 0, 2).contiguous().view(torch.uint8)
          for v in (scale, zero)]  # [tile, group, 32 bytes]
    return torch.cat([chunks, *sz], dim=2).contiguous()


def relayout8(q: Any, rows: int = 4096) -> Any:
    """q [N, K] int8 -> the kernel's uint8 [N/16, K/4, 64] (rows8.cpp, gemv8t): q + 128, 16 rows x 4 k per chunk.
    `rows` at a time: the temporaries (6 bytes per weight) stay ~100 MB, not 1.5 GB for an 8B model's head."""
    n, k = q.shape
    out = torch.empty(n // 16, k // 4, 64, dtype=torch.uint8)
    for r0 in range(0, n, rows):
        u = (q[r0:r0 + rows].to(torch.int16) + 128).to(torch.uint8)
        out[r0 // 16:(r0 + u.shape[0]) // 16] = u.reshape(-1, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, k // 4, 64)
    return out


def convertible(mod: Any) -> bool:
    """A plain linear holding torchao's weight-only CPU int4 tensor in a shape the kernel takes."""
    w = getattr(mod, "weight", None)
    if type(mod) is not torch.nn.Linear or type(w).__name__ != "Int4OpaqueTensor" or w.device.type != "cpu":
        return False
    if getattr(w, "act_mapping_type", None) is not None or getattr(w, "act_pre_scale", None) is not None:
        return False  # torchao's da8w4 or an activation pre-scale: another computation
    n, k = w.shape
    gs = int(w.block_size[-1])
    return n % 64 == 0 and gs % 16 == 0 and k % gs == 0


def swap_layers(model: Any, takes: Callable[[Any], bool], build: Callable[[Any], Any]) -> int:
    """Replace every child module that `takes` accepts with `build(child)`; returns how many. Only (parent, name)
    pairs are listed up front, and each old layer's memory goes back to the system as soon as it is replaced: a
    list of the old layers would hold every old matrix until the end, twice the weights at the peak (the 8B bf16
    cells were killed for memory that way)."""
    swaps = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if takes(child)]
    for parent, name in swaps:
        old = getattr(parent, name)
        setattr(parent, name, build(old))
        release(old)
        del old
        trim()
    return len(swaps)


def _int8rows(child: Any) -> Int8RowsLinear:
    return Int8RowsLinear(relayout8(child.qdata), child.scale.to(torch.bfloat16).contiguous(), child.in_features,
                          child.bias)


def _int4rows(child: Any) -> Int4RowsLinear:
    q, scale, zero, gs = unpack(child.weight)
    return Int4RowsLinear(relayout(q, scale, zero, gs), gs, int(child.in_features), child.bias)


def to_int8rows(model: Any) -> int:
    """Swap every Int8PackLinear whose shape the kernel takes (rows a multiple of 16, columns of 32) for an
    Int8RowsLinear (the kernel must be loaded); returns how many."""
    return swap_layers(model, lambda m: isinstance(m, Int8PackLinear) and m.out_features % 16 == 0
                       and m.in_features % 32 == 0, _int8rows)


def to_int4rows(model: Any) -> int:
    """Swap every convertible int4 linear for an Int4RowsLinear (the kernel must be loaded); returns how many."""
    return swap_layers(model, convertible, _int4rows)
