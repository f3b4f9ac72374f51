"""int8 weight-only linears on `aten::_weight_int8pack_mm`, eager and compiled (torchao_int8 `kernel=int8pack`).

torchao quantizes (symmetric, one scale per output row); `to_int8pack` then moves each layer's int8 rows
and scales out of torchao's tensor subclass into a plain module that calls the stock ATen op. Why, and
the measurements behind `INT8_UPCAST_ROWS`: quantizers/torchao.py and docs/fast_path.md.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.errors import QuantbenchError
from quantizers.common import release

# Rows (tokens x batch) from which Int8PackLinear dequantizes to fp32 where bf16 is emulated. Whole SmolLM2
# body on Zen 3, 2 threads: 64 rows int8pack 213 ms vs fp32 257 ms (fresh buffer), 200 rows 792 vs 670.
INT8_UPCAST_ROWS = 128
_SCRATCH: dict[tuple[int, ...], Any] = {}  # one fp32 weight buffer per shape, shared by the layers of that shape


class Int8PackLinear(torch.nn.Module):
    """int8 weights, one scale per output row: y = (x @ q.T) * scale via aten::_weight_int8pack_mm.

    `qdata` [out, in] int8 and `scale` [out] are torchao's (Int8Tensor.qdata / .scale), so the
    quantization is torchao's; only the matmul call differs (see module docstring).
    """

    def __init__(self, qdata: Any, scale: Any, bias: Any, upcast_rows: int) -> None:
        super().__init__()
        self.out_features, self.in_features = int(qdata.shape[0]), int(qdata.shape[1])
        self.register_buffer("qdata", qdata.contiguous())
        self.register_buffer("scale", scale.reshape(-1).contiguous())
        self.bias = bias
        self.upcast_rows = upcast_rows  # 0: never (CPUs with native bf16)
        self.one_row = False  # measure.gemv=rows8: one-row inputs take quantbench's kernel (quantizers/rows8.py)

    def forward(self, x: Any) -> Any:
        x2 = x.reshape(-1, self.in_features)
        if self.upcast_rows and x2.shape[0] >= self.upcast_rows and not torch.compiler.is_compiling():
            buf = _SCRATCH.get(tuple(self.qdata.shape))
            if buf is None:
                with torch.inference_mode(False):  # writable outside inference mode too (scoring)
                    buf = _SCRATCH[tuple(self.qdata.shape)] = torch.empty(self.qdata.shape, dtype=torch.float32)
            torch.mul(self.qdata, self.scale.float()[:, None], out=buf)
            y = torch.nn.functional.linear(x2.float(), buf).to(x.dtype)
        elif self.one_row and x2.shape[0] == 1:
            y = torch.ops.quantbench.gemv8(x2, self.qdata, self.scale).view(1, -1)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qdata, self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, upcast_rows={self.upcast_rows}"


def to_int8pack(model: Any, upcast_rows: int) -> int:
    """Swap every nn.Linear holding a per-row torchao Int8Tensor for an Int8PackLinear; returns how many."""
    swaps = []
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m) is torch.nn.Linear and type(w).__name__ == "Int8Tensor":
            asym = w.zero_point is not None and bool(w.zero_point.any())  # torchao stores zeros for symmetric too
            if w.act_quant_kwargs is not None or asym or w.block_size[-1] != w.qdata.shape[-1]:
                raise QuantbenchError(f"quantizer torchao_int8 kernel=int8pack needs symmetric per-row int8 weights; "
                                      f"{name} is not (use quantizer.kernel=torchao)")
            swaps.append((name, Int8PackLinear(w.qdata, w.scale.to(torch.bfloat16), m.bias, upcast_rows)))
    for name, new in swaps:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        release(getattr(owner, leaf))  # its int8 rows must go with it once the kernel re-lays them (common.release)
        setattr(owner, leaf, new)
    return len(swaps)


def int8_head(model: Any, upcast_rows: int, chunk: int = 16384) -> int:
    """`quantizer.head=int8`: the output projection as symmetric per-row int8 in an Int8PackLinear, as
    llama.cpp's Q8_0 files store it (Q4_0 files: Q6_K). A tied embedding keeps its 16-bit table for the
    lookup; the head gets its own int8 copy. Returns the rows quantized (chunked: no fp32 copy of the whole
    head, ~2 GB at 8B)."""
    head = model.get_output_embeddings()
    w = head.weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.bfloat16)
    for i in range(0, w.shape[0], chunk):
        part = w[i:i + chunk].float()
        # the layer keeps bf16 scales: rounding with the fp32 one put values up to 0.79 steps off, not 0.5
        s = (part.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16).float()
        q[i:i + chunk] = torch.round(part / s[:, None]).clamp(-127, 127).to(torch.int8)
        scale[i:i + chunk] = s
    model.set_output_embeddings(Int8PackLinear(q, scale, head.bias, upcast_rows))
    return int(w.shape[0])
