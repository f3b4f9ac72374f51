"""optimum-quanto's int4: the group sizes it really chose are recorded (quanto picks them per layer, not the config),
and without a C++ compiler to build quanto_cpp the run is refused in one line before anything loads."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST

from harness.config import build, compose
from harness.errors import QuantbenchError
from harness.models import load_tokenizer
from quantizers import quanto


def test_group_sizes_are_quantos_own_choice_per_layer():
    """optimum-quanto 0.2.7: 128, stepped down by 32 until it divides K (96 at SmolLM2's K=576), per row at K <= 128."""
    from optimum.quanto import qint4, quantize

    model = torch.nn.Sequential(torch.nn.Linear(576, 32), torch.nn.Linear(576, 32), torch.nn.Linear(512, 32),
                                torch.nn.Linear(128, 32))
    quantize(model, weights=qint4)
    assert quanto.group_sizes(model) == "128 (1 layer), 96 (2 layers), per-row (1 layer)"


def test_a_quanto_int4_run_records_its_group_sizes():
    exp = build(compose([*FAST, "quantizer=quanto_int4", "tracking.enabled=false"]))
    exp.quantizer.preflight("cpu")
    exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    # the tiny model: q k v o gate up read 128 values (one scale per row), down_proj 256 (groups of 128)
    assert exp.quantizer.last_tags["quantizer.group_sizes"] == "128 (2 layers), per-row (12 layers)"


def test_quanto_int4_without_a_compiler_is_refused_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))  # no quanto_cpp built there
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / clang++ / $CXX
    monkeypatch.delenv("CXX", raising=False)
    q = build(compose(["model=tiny_random", "quantizer=quanto_int4"])).quantizer
    with pytest.raises(QuantbenchError) as err:
        q.preflight("cpu")
    assert str(err.value) == ("quanto_int4 needs a C++ compiler to build quanto_cpp (apt-get install g++), or use "
                              "quantizer=torchao_int4")
    build(compose(["model=tiny_random", "quantizer=quanto_int8"])).quantizer.preflight("cpu")  # int8 needs none
