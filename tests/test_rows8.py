"""quantbench's one-row 16-bit kernel (measure.gemv=rows8, quantizers/rows8.py).

Its numerics are checked against an fp32 matmul on shapes that are not multiples of its 8-row blocks or its
32-value steps; `install` must send one-row inputs (batch-1 decode) to it and leave every wider input on the
layer's own path, bit for bit; a run records the kernel it took. The kernel is AVX-512 code: on a CPU without
AVX-512 the same tests check the one-line refusal instead. Which kernel is faster is benchmarks/cpu_kernels.py's
business (--one-row), never a test's.
"""

from __future__ import annotations

import pytest
import torch
from test_paths import ZEN3, ZEN4

from harness import env
from harness.config import build, compose
from harness.errors import QuantbenchError
from harness.measure import paths
from harness.run import runner
from quantizers import rows8

HERE = rows8.available(env.cpu_info())[0]


def _refused_here() -> None:
    """On a CPU without AVX-512: the kernel refuses in one line, at preflight and at install."""
    with pytest.raises(QuantbenchError, match=r"^measure.gemv=rows8 cannot run: .* needs AVX-512"):
        paths.settle(build(compose(["model=tiny_random", "measure.gemv=rows8"])), "cpu")
    with pytest.raises(QuantbenchError, match=r"needs AVX-512"):
        rows8.install(torch.nn.Linear(4, 4).to(torch.bfloat16))


def test_rows8_needs_avx512_and_is_refused_in_one_line_without_it(monkeypatch):
    assert rows8.available(ZEN4) == (True, "")
    ok, why = rows8.available(ZEN3)
    assert not ok and why == "quantbench's rows8 kernel needs AVX-512 (this CPU: avx2)"
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: ZEN3)
    _refused_here()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_an_fp32_matmul_on_ragged_shapes(dtype):
    if not HERE:  # this CPU cannot run it: asking for it is refused in one line before loading
        return _refused_here()
    torch.manual_seed(0)
    for n, k in ((13, 70), (8, 32), (2051, 2085), (1, 5)):
        w, x = torch.randn(n, k, dtype=dtype), torch.randn(1, 1, k, dtype=dtype)
        ref = (x.float() @ w.float().t()).view(-1)
        y = rows8.gemv16(x, w)
        assert y.dtype == dtype and y.shape == (n,)
        tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10  # one rounding of the output
        assert torch.allclose(y.float(), ref, rtol=2 * tol, atol=2 * tol * ref.abs().max().item()), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_install_sends_one_row_to_the_kernel_and_keeps_wider_inputs_on_the_layer(dtype):
    """fp16 (and bf16 without AVX512_BF16): one row to gemv16, wider inputs on the layer's own forward, bit for bit.
    bf16 with AVX512_BF16: every linear becomes a Bf16RowsLinear (gemv16t's tiles, the same values): one row
    gives gemv16's very sums, up to WIDE rows run on the kernel, wider ones on the unpacked matrix, bit for bit."""
    if not HERE:
        return _refused_here()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    tiles = dtype == torch.bfloat16 and "avx512_bf16" in env.cpu_info().flags
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    long = torch.arange(rows8.Bf16RowsLinear.WIDE + 6)[None] % 96
    with torch.inference_mode():
        wide, one, longest = model(ids).logits, model(ids[:, :1]).logits, model(long).logits
        one_gemv16 = None
        if tiles:  # what gemv16 (row-major rows, the same sums) gives for one row, to compare the tiles with
            rows8.load()
            head = model.lm_head
            x = torch.randn(1, 1, 64, dtype=dtype)
            one_gemv16 = (x, torch.ops.quantbench.gemv16(x, head.weight))
        assert rows8.install(model) == 2 * 7 + 1  # q k v o gate up down per layer + the head
        assert rows8.install(model) == 0  # installed once
        with torch.profiler.profile() as prof:
            one_after = model(ids[:, :1]).logits
        assert torch.equal(model(long).logits, longest)  # over WIDE rows: the layer's own matmul, unchanged
        if tiles:
            assert isinstance(model.lm_head, rows8.Bf16RowsLinear)
            assert model.model.embed_tokens.weight.shape == (96, 64)  # the tied table stays for the embedding
            x, want = one_gemv16
            assert torch.equal(model.lm_head(x).view(-1), want)  # the same sums as gemv16's 8 rows
            five = model(ids).logits  # 5 rows on the kernel: each row as if alone
            assert torch.equal(five[:, :1], one_after)
            assert torch.allclose(five.float(), wide.float(), atol=0.05, rtol=0.05)
        else:
            assert torch.equal(model(ids).logits, wide)  # 5 rows: the layer's own forward, unchanged
    names = {e.key for e in prof.key_averages()}
    assert ("quantbench::gemv16t" if tiles else "quantbench::gemv16") in names
    assert torch.allclose(one_after.float(), one.float(), atol=0.05, rtol=0.05)


def test_bf16_tiles_give_each_row_the_same_sums_at_every_width_and_leave_other_shapes():
    import dataclasses

    cpu = env.cpu_info()
    bf16 = dataclasses.replace(cpu, flags=frozenset(cpu.flags | {"avx512_bf16"}))
    no_bf16 = dataclasses.replace(cpu, flags=frozenset(cpu.flags - {"avx512_bf16"}))
    assert rows8.bf16_tiles(torch.nn.Linear(64, 64, dtype=torch.bfloat16), bf16)
    assert not rows8.bf16_tiles(torch.nn.Linear(64, 64, dtype=torch.bfloat16), no_bf16)  # gemv16 keeps it
    assert not rows8.bf16_tiles(torch.nn.Linear(70, 13, dtype=torch.bfloat16), bf16)  # not 4 rows x 32 columns
    assert not rows8.bf16_tiles(torch.nn.Linear(64, 64, dtype=torch.float16), bf16)
    patched = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    patched.forward = patched.forward  # quantizers/dtype.py's upcast (a forward of its own): left alone
    assert not rows8.bf16_tiles(patched, bf16)
    if not HERE or "avx512_bf16" not in cpu.flags:
        return  # the kernel cannot run on this CPU, and install does not ask it to (bf16_tiles, above)
    rows8.load()
    torch.manual_seed(0)
    for n, k in ((8, 32), (516, 2080), (12, 96)):
        w = torch.randn(n, k, dtype=torch.bfloat16)
        packed = rows8.relayout16(w)
        assert packed.shape == (n // 4, k // 32, 128) and torch.equal(rows8.unpack16(packed), w)
        x = torch.randn(9, k, dtype=torch.bfloat16)
        alone = torch.stack([torch.ops.quantbench.gemv16(x[i], w) for i in range(9)])
        for m in (1, 2, 3, 4, 5, 9):  # 4 rows per pass, and the 3/2/1-row tails
            assert torch.equal(torch.ops.quantbench.gemv16t(x[:m], packed), alone[:m]), (n, k, m)
        ref = x.double() @ w.double().t()
        assert (alone.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # one bf16 rounding of the output


def test_a_failed_build_is_one_line(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as ext

    def broken(*a, **k):
        raise RuntimeError("Error building extension 'quantbench_rows8'\nx.cpp:1:1: error: no compiler\nmore")

    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))  # nothing built there: the builder runs (and fails)
    with pytest.raises(QuantbenchError, match=r"^measure.gemv=rows8: building rows8.cpp failed \(x.cpp:1:1: error: "
                                              r"no compiler\); install g\+\+"):  # the compiler's line
        rows8.load.__wrapped__()


@pytest.mark.parametrize("quantizer,kernel", [("bf16", "quantbench::gemv16t"), ("int4", "quantbench::gemv4")])
def test_a_run_records_the_kernel_it_took(results_overrides, quantizer, kernel):
    exp = build(compose(["model=tiny_random", f"quantizer={quantizer}", "measure.gemv=rows8", "measure.max_new_tokens=4",
                         "measure.repetitions=1", "measure.warmup=0", "accuracy.enabled=false", *results_overrides]))
    if not HERE:
        return _refused_here()
    if quantizer == "int4" and "avx512_vnni" not in env.cpu_info().flags:
        kernel = "aten::_weight_int4pack_mm_for_cpu"  # AVX-512 without VNNI: torchao's int4 layers stay
    if quantizer == "bf16" and "avx512_bf16" not in env.cpu_info().flags:
        kernel = "quantbench::gemv16"  # AVX-512 without BF16: row-major rows, no tiles
    result = runner.execute(exp)
    assert result.status == "OK", result.error
    t = result.tags
    assert t["kernel.gemv"] == "rows8" and int(t["kernel.gemv_layers"]) > 0
    assert t["kernel.linear"] == kernel  # profiled in the decode steps, not assumed


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    seen = {}

    def fake_build(where):
        seen["stale lock still there"] = (where / "lock").exists()
        (where / "quantbench_rows8.so").write_bytes(b"built")

    monkeypatch.setattr(rows8, "_build", fake_build)
    first = rows8.library()  # built into the cache, in the folder named by the source's hash
    assert tmp_path / "ext" in first.parents
    first.unlink()
    (first.parent / "lock").write_text("")  # a killed build left torch's `lock` file there
    lib = rows8.library()  # builds again instead of waiting for that lock forever
    assert lib == first and lib.read_bytes() == b"built" and seen == {"stale lock still there": False}


def _int4_linear(n: int, k: int, gs: int) -> torch.nn.Sequential:
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    seq = torch.nn.Sequential(lin)
    quantize_(seq, PrototypeInt4WeightOnlyConfig(group_size=gs))
    return seq


def test_int4_layers_keep_torchaos_values_and_match_its_kernel_at_every_width():
    from quantizers import vnni

    if not HERE:
        return _refused_here()
    if "avx512_vnni" not in env.cpu_info().flags:  # AVX-512 without VNNI: install leaves torchao's int4 alone
        seq = _int4_linear(64, 64, 32)
        rows8.install(seq)
        assert type(seq[0]) is torch.nn.Linear
        return
    torch.manual_seed(0)
    for n, k, gs in ((128, 256, 32), (192, 512, 64), (64, 384, 128)):
        seq = _int4_linear(n, k, gs)
        w = seq[0].weight
        q, scale, zero, g = vnni.unpack(w)
        assert g == gs and q.shape == (n, k) and int(q.max()) <= 15
        # the unpacking is exact: packing the values again gives torchao's bytes
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1).view(torch.uint8),
                           w.qdata.view(torch.uint8))
        deq = (q.float() - 8) * scale.float().t().repeat_interleave(gs, 1) + zero.float().t().repeat_interleave(gs, 1)
        xs = [torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(2, 7, k, dtype=torch.bfloat16)]  # decode, prompt
        with torch.inference_mode():
            theirs = [seq(x) for x in xs]
            assert rows8.install(seq) == 1 and isinstance(seq[0], vnni.Int4RowsLinear)
            ours = [seq(x) for x in xs]
        for x, a, b in zip(xs, theirs, ours, strict=True):
            ref = x.double() @ deq.double().t()
            assert b.shape == a.shape and b.dtype == torch.bfloat16
            err, bf16_err = (b.double() - ref).abs().max(), (a.double() - ref).abs().max()
            # no worse than torchao's own kernel, whose error is the bf16 rounding of its output
            assert err <= 1.01 * bf16_err + 1e-6, (n, k, gs, float(err), float(bf16_err))
            # before that rounding: x as 24-bit fixed point, fp32 sums (~3e-7 here; 15 bits gave 3e-5)
            exact = torch.ops.quantbench.gemv4(x.float(), seq[0].packed, gs).double()
            assert (exact - ref).abs().max() <= 2e-6 * ref.abs().max(), (n, k, gs)


def test_int8_layers_keep_their_values_and_match_at_every_width():
    from quantizers import vnni
    from quantizers.int8pack import Int8PackLinear

    if not HERE or "avx512_vnni" not in env.cpu_info().flags:  # the int8 rows stay on gemv8 / ATen's op there
        return
    torch.manual_seed(0)
    odd = torch.nn.Sequential(Int8PackLinear(torch.ones(64, 80, dtype=torch.int8), torch.ones(64), None, 0))
    assert rows8.install(odd) == 1 and type(odd[0]) is Int8PackLinear and odd[0].one_row  # 80 columns: gemv8
    for n, k in ((64, 128), (4096 + 16, 2048)):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = (torch.rand(n) * 0.01 + 1e-3).to(torch.bfloat16)
        seq = torch.nn.Sequential(Int8PackLinear(q, scale, None, upcast_rows=0))
        assert rows8.install(seq) == 1 and isinstance(seq[0], vnni.Int8RowsLinear)
        assert seq[0].packed.numel() == q.numel()  # the same bytes, re-laid
        deq = q.double() * scale.double()[:, None]
        for x in (torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(3, 5, k, dtype=torch.bfloat16)):
            ref = x.double() @ deq.t()
            with torch.inference_mode():
                y, exact = seq(x), torch.ops.quantbench.gemv8t(x.float(), seq[0].packed, seq[0].scale).double()
            assert y.shape == ref.shape and y.dtype == torch.bfloat16
            assert (exact - ref).abs().max() <= 2e-6 * ref.abs().max(), (n, k)  # 24-bit x, fp32 sums: ~3e-7
            assert (y.double() - ref).abs().max() <= 2 ** -8 * ref.abs().max()  # then one bf16 rounding


def test_a_swapped_layer_is_freed_at_once_even_with_methods_bound_to_itself():
    # torchao's quantize_ stores `extra_repr` as a method bound to the layer: a reference cycle that kept every
    # replaced layer alive until the cyclic collector ran (an 8B int4 model: 7.1 -> 10.1 GB through the swap)
    import gc
    import types
    import weakref

    from quantizers import vnni

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    old = model[0]
    old.extra_repr = types.MethodType(lambda self: "torchao-style", old)
    gone = weakref.ref(old)
    del old
    gc.disable()
    try:
        n = vnni.swap_layers(model, lambda m: isinstance(m, torch.nn.Linear) and m.in_features == 4,
                             lambda m: torch.nn.Identity())
        assert n == 2 and gone() is None  # freed by its reference count, no collection needed
    finally:
        gc.enable()


@pytest.mark.parametrize("quantizer", ["bf16", "int4"])
def test_a_run_records_the_model_rows8_left(quantizer, tmp_path):
    """After rows8.install the run records what is held and runs: weight_bytes counts the tied head's tiled copy
    beside the embedding, kernel_path names the new layers, quantizer.storage claims no kernel that no longer runs;
    the roofline reads the whole copy and one embedding row (tiny-qwen2: tied head)."""
    from harness.analysis import roofline
    from harness.models import load_tokenizer
    from harness.run.engines import TransformersSession
    from quantizers.base import tensor_bytes

    exp = build(compose(["model=random", "model.arch=tiny-qwen2", f"quantizer={quantizer}", "measure.gemv=rows8",
                         "tracking.enabled=false"]))
    if not HERE:
        return _refused_here()
    paths.settle(exp, "cpu")
    exp.quantizer.preflight("cpu")
    session = TransformersSession(exp, "cpu", 1)
    metrics, tags = session.load(load_tokenizer(exp.model), None, tmp_path / "log.txt")
    model = session.model
    held = sum(tensor_bytes(t, set()) for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    assert type(model.lm_head) is rows8.Bf16RowsLinear
    assert metrics["weight_bytes"] == held
    assert "Linear[Int4OpaqueTensor]" not in tags["kernel_path"] and "torch.Linear" not in tags["kernel_path"]
    assert "_weight_int4pack_mm_for_cpu" not in tags.get("quantizer.storage", "")
    shape = roofline.shape_from_torch(model)
    emb = model.get_input_embeddings().weight
    row = emb.shape[1] * emb.element_size()
    assert shape.weights_read(1) == held - emb.numel() * emb.element_size() + row
    assert shape.weight_bytes == metrics["weight_bytes"]


def test_a_speculative_draft_takes_the_same_one_row_kernel_as_its_target(results_overrides):
    """Under measure.gemv=rows8 the draft model's layers go to rows8 too (a draft left on ATen's GEMV would charge
    speculative decoding with a kernel gap); its bytes are counted after the swap (the tied head's tiled copy), and
    the output still equals plain greedy."""
    overrides = ["model=tiny_random", "quantizer=bf16", "strategy=speculative",
                 "quantizer@strategy.draft_quantizer=bf16", "measure.max_new_tokens=6", "measure.repetitions=1",
                 "measure.warmup=0", "accuracy.enabled=false", *results_overrides]
    exp = build(compose([*overrides, "measure.gemv=rows8"]))
    if not HERE:
        return _refused_here()
    result = runner.execute(exp)
    assert result.status == "OK", result.error
    m, t = result.metrics, result.tags
    assert t["kernel.gemv"] == "rows8" and m["greedy_match"] == 1.0
    assert m["draft_gemv_layers"] == int(t["kernel.gemv_layers"]) > 0  # same arch and format: every layer the target's
    assert m["draft_weight_bytes"] == m["weight_bytes"]  # counted after the swap, as the target's
    aten = runner.execute(build(compose([*overrides, "measure.gemv=aten"])))
    assert aten.status == "OK", aten.error
    assert "draft_gemv_layers" not in aten.metrics and aten.metrics["draft_weight_bytes"] == aten.metrics["weight_bytes"]
