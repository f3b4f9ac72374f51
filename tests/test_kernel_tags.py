"""The kernel tags of a profiled decode step (harness/measure/kernels.py): the output projection is told apart by
the tensors it holds, not by a rule on tile shapes that body layers also meet, and `kernel.linear` names the
innermost dispatcher op that every body layer calls, not a Python autograd wrapper or a helper around it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import FAST

from harness import env
from harness.config import build, compose
from harness.measure import kernels
from harness.models import load_tokenizer
from quantizers import rows8
from strategies.base import DecodeOptions
from strategies.greedy import Greedy


def _profile(overrides: list[str], gemv: bool = False) -> dict[str, str]:
    exp = build(compose([*overrides, "tracking.enabled=false"]))
    exp.quantizer.preflight("cpu")
    model = exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    if gemv:
        rows8.install(model)
    return kernels.profile_linear(Greedy(), model, [[5, 6, 7, 8]], DecodeOptions(max_new_tokens=6))[0]


def test_a_body_layer_of_a_quarter_of_the_vocabulary_is_not_the_head():
    """tiny-qwen2 (vocab 512, hidden 128, tied head) on rows8's bf16 tiles: q_proj and o_proj have 128 = 512 / 4 rows,
    so their tiles [32, 4, 128] met the old rule for gemv4/gemv8t tiles of the head ([vocab/16, ...])."""
    if not rows8.available(env.cpu_info())[0] or "avx512_bf16" not in env.cpu_info().flags:
        pytest.skip("needs rows8's bf16 tiles (AVX-512 with AVX512_BF16)")
    tags = _profile(["model=random", "model.arch=tiny-qwen2", "quantizer=bf16"], gemv=True)
    assert tags["kernel.linear"] == tags["kernel.lm_head"] == "quantbench::gemv16t", tags
    assert tags["kernel.linear_calls_per_step"] == "14" and tags["kernel.lm_head_calls_per_step"] == "1", tags


def test_held_shapes_tell_the_head_apart_from_same_tiled_body_layers():
    vocab, held = 512, frozenset({(128, 4, 128)})
    events = [("quantbench::gemv16t", 50.0, 4, [[1, 1, 128], [128, 4, 128]]),  # the head's own tiles
              ("quantbench::gemv16t", 300.0, 8, [[1, 1, 128], [32, 4, 128]]),  # q/o_proj: vocab / 4 rows
              ("quantbench::gemv16t", 400.0, 48, [[1, 1, 128], [64, 4, 128]])]
    got = kernels.dominant_linear(events, 4, vocab, held)
    assert got["kernel.linear_calls_per_step"] == "14" and got["kernel.lm_head_calls_per_step"] == "1"


def test_autograd_wrappers_and_helpers_never_name_the_kernel():
    """bitsandbytes int8 (tiny model, 2 x 7 body layers, 4 steps): MatMul8bitLt (a Python autograd.Function) and the
    bitsandbytes ops around aten::_int_mm took more self time than it, and one layer's outlier aten::addmm too."""
    ev = [("MatMul8bitLt", 1000.0, 56), ("bitsandbytes::int8_vectorwise_quant", 660.0, 56),
          ("bitsandbytes::int8_linear_matmul", 180.0, 56), ("bitsandbytes::int8_mm_dequant", 440.0, 56),
          ("aten::addmm", 500.0, 4), ("aten::_int_mm", 80.0, 56), ("WeightQBytesLinearFunction", 900.0, 56)]

    def node(name: str, *children: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(name=name, cpu_children=list(children))

    call = node("MatMul8bitLt", node("bitsandbytes::int8_linear_matmul", node("aten::_int_mm")), node("aten::mul"))
    wrappers = kernels.wrapper_names([call, *call.cpu_children, node("aten::addmm")])
    assert wrappers == frozenset({"bitsandbytes::int8_linear_matmul"})  # unnamespaced ones are never candidates
    got = kernels.dominant_linear(ev, 4, wrappers=wrappers, layers=14)
    assert got["kernel.linear"] == "aten::_int_mm" and got["kernel.linear_calls_per_step"] == "14", got


@pytest.mark.parametrize("quantizer,dtype", [("bnb_int8", "bfloat16"), ("bnb_int8", "float32"),
                                             ("quanto_int8", "float32")])
def test_the_profiled_kernel_is_a_dispatcher_op_every_body_layer_calls(quantizer, dtype):
    tags = _profile([*FAST, f"quantizer={quantizer}", f"model.dtype={dtype}"])
    assert "::" in tags["kernel.linear"], tags
    assert tags["kernel.linear_calls_per_step"] == "14", tags  # q k v o gate up down x 2 layers
    if quantizer == "bnb_int8":
        assert tags["kernel.linear"] == "aten::_int_mm", tags


def test_the_profile_decodes_no_longer_than_the_run():
    """A compiled path's static cache is sized for the run's prompts and max_new_tokens; the profile asked for
    PROFILE_TOKENS + 1 tokens, and a 4-token compiled run was tagged "profile failed: ... needs 37 cache slots but
    the compiled path was sized for 36"."""
    from harness.models import TinyRandom, load_pretrained

    seen = []

    class Spy(Greedy):
        def generate(self, model, batch, opts):
            seen.append(opts.max_new_tokens)
            return super().generate(model, batch, opts)

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    tags = kernels.profile_linear(Spy(), model, [[5, 6, 7]], DecodeOptions(max_new_tokens=3))[0]
    assert seen == [3] and tags["kernel.profiled"] == "2 decode steps", (seen, tags)
    assert not tags["kernel.linear"].startswith("profile failed"), tags
