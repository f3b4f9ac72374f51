"""quantizers/fake_ops.py on CPU: an op with a CPU kernel and no shape rule breaks dynamo's graph at every call (what
mslk-cuda 1.1.0's `bf16i4bf16_shuffled` does to a compiled int4 step on a GPU); with the registered fake it does not.
The stand-in ops have mslk's schema; the real library is CUDA-only and absent here."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from quantizers import fake_ops
from quantizers.torchao import BF16OnCPU, TorchAoInt4

SCHEMA = "(Tensor X, Tensor W, Tensor w_scale_group, Tensor w_zero_group) -> Tensor"


def like_mslk(x, w, s, z):
    """A CPU stand-in for mslk's int4 linear (dequantize-free: X @ W.T in bf16), with the CUDA kernel's output shape:
    [M, N], M = the product of X's leading dims, 2-D even for a 3-D X (mslk csrc/gemm/cutlass/bf16i4bf16.cu)."""
    return (x.reshape(-1, x.shape[-1]).float() @ w.float().t()).to(torch.bfloat16)


def define(namespace: str, with_meta: tuple[str, ...] = ()) -> torch.library.Library:
    """The two mslk int4 linears in `namespace`: a CPU kernel each (`like_mslk`), a Meta kernel only for the ops in
    `with_meta`. The returned Library must stay referenced (it owns the ops)."""
    lib = torch.library.Library(namespace, "DEF")
    for op in fake_ops.MSLK_INT4_LINEAR_OPS:
        lib.define(op + SCHEMA)
        lib.impl(op, like_mslk, "CPU")
        if op in with_meta:
            lib.impl(op, lambda x, w, s, z: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16), "Meta")
    return lib


def breaks_when_compiled(op) -> tuple[int, torch.Tensor]:
    """(graph breaks, output) of a compiled two-linear function calling `op` (dynamo only: backend eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    w, s = torch.randn(16, 16), torch.ones(1)

    def two(x):
        return op(op(x, w, s, s), w, s, s) + 1

    out = torch.compile(two, backend="eager")(torch.randn(1, 16, dtype=torch.bfloat16))
    return sum(counters["graph_break"].values()), out


def test_a_missing_shape_rule_breaks_the_graph_and_the_fake_mends_it():
    lib = define("qbtest_fake_a")  # noqa: F841 - owns the ops
    op = torch.ops.qbtest_fake_a.bf16i4bf16_shuffled
    broken, want = breaks_when_compiled(op)
    assert broken >= 2  # one per call: what a compiled 8B step would do at each of its 224 linears
    assert fake_ops.register_missing_fakes("qbtest_fake_a") == list(fake_ops.MSLK_INT4_LINEAR_OPS)
    mended, got = breaks_when_compiled(op)
    assert mended == 0 and torch.equal(got, want)
    assert fake_ops.register_missing_fakes("qbtest_fake_a") == []  # the fake is now the Meta kernel: idempotent


def test_a_library_with_its_own_shape_rule_keeps_it():
    lib = define("qbtest_fake_b", with_meta=("bf16i4bf16_rowwise",))  # noqa: F841
    assert fake_ops.register_missing_fakes("qbtest_fake_b") == ["bf16i4bf16_shuffled"]
    assert fake_ops.register_missing_fakes("qbtest_fake_c") == []  # a namespace without the ops: nothing to do


def test_the_fake_follows_mslks_shape_rule():
    x2, x3, w = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ((5, 64), (2, 5, 64), (96, 32)))
    assert fake_ops.int4_linear_fake(x2, w, None, None).shape == (5, 96)
    assert fake_ops.int4_linear_fake(x3, w, None, None).shape == (10, 96)  # 2-D, as the CUDA kernel returns
    assert fake_ops.int4_linear_fake(x3, w, None, None).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="dim of XQ must be 2 or 3"):
        fake_ops.int4_linear_fake(torch.empty(64, device="meta"), w, None, None)


def test_inductor_compiles_a_3d_decode_input_through_the_fake():
    """torchao 0.18's preshuffled linear passes the decode step's [1, 1, K] input to mslk unreshaped and reshapes the
    [M, N] result itself. Inductor (not dynamo alone) checks the kernel's output against the fake's shape: a fake
    that gave [1, 1, N] failed the first compiled call ("wrong number of dimensions"), so the cell ran eager."""
    import torch._inductor.config as inductor

    lib = define("qbtest_fake_inductor")  # noqa: F841 - a namespace of its own: no other test's fake on it
    assert fake_ops.register_missing_fakes("qbtest_fake_inductor") == list(fake_ops.MSLK_INT4_LINEAR_OPS)
    op = torch.ops.qbtest_fake_inductor.bf16i4bf16_shuffled
    torch.manual_seed(0)
    w, s = torch.randn(24, 16, dtype=torch.bfloat16), torch.ones(1)

    def preshuffled_linear(x):  # int4_preshuffled_tensor.py's linear, minus the tensor subclass
        return op(x, w, s, s).reshape(*x.shape[:-1], w.shape[0]) + 1

    x = torch.randn(1, 1, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with inductor.patch(force_disable_caches=True):  # a cached graph from another fake would hide the check
        got = torch.compile(preshuffled_linear, backend="inductor", fullgraph=True)(x)
    assert got.shape == (1, 1, 24) and torch.equal(got, preshuffled_linear(x))


def test_an_mslk_int4_load_registers_the_fakes_and_tags_it(monkeypatch):
    """The real `ensure_mslk_fakes` and TorchAoInt4.load wiring, with a stand-in `mslk` module whose ops live in
    the `mslk` namespace (the real CUDA wheel is not installed here; its loading is all this replaces)."""
    lib = define("mslk")  # noqa: F841
    monkeypatch.setitem(sys.modules, "mslk", types.ModuleType("mslk"))
    monkeypatch.setattr(BF16OnCPU, "load", lambda self, *a, **k: (setattr(self, "last_tags", {}), "model")[1])
    q = TorchAoInt4(kernel="preshuffled", group_size=128)
    assert q.load(None, tokenizer=None, device="cuda", experiment=None) == "model"
    assert q.last_tags["quantizer.fake_ops"] == ("registered for mslk::bf16i4bf16_shuffled, mslk::bf16i4bf16_rowwise"
                                                 " (mslk has no Meta kernel for them)")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mslk::bf16i4bf16_shuffled", "Meta")
    q2 = TorchAoInt4(kernel="tinygemm")  # no mslk kernel: nothing registered, nothing tagged
    q2.load(None, tokenizer=None, device="cuda", experiment=None)
    assert "quantizer.fake_ops" not in q2.last_tags
