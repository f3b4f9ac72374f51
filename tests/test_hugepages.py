"""The weights on 2 MiB pages (measure.hugepages, harness/measure/hugepages.py).

The move is checked where it could go wrong: every tensor behind the model (tied weights, buffers, a tensor
subclass's packed inner tensors) must point into the one new mapping, keep its values and its ties, and the
model must decode the same tokens after it. Whether the kernel grants huge pages depends on the host, so the
share is checked by its reader on a written smaps file, and a run records what this host's kernel allows.
"""

from __future__ import annotations

import pytest
import torch

from harness.config import build, compose
from harness.errors import QuantbenchError
from harness.measure import hugepages
from harness.models import load_tokenizer
from strategies.base import DecodeOptions
from strategies.decode import greedy_generate


def test_auto_is_on_only_where_the_kernel_allows_and_on_is_refused_elsewhere(monkeypatch):
    assert hugepages.resolve("off", "cpu", "madvise") == (False, "off (measure.hugepages=off)")
    assert hugepages.resolve("auto", "cuda", "madvise") == (False, "off (cuda run)")
    assert hugepages.resolve("auto", "cpu", "never") == (False, "off (transparent huge pages: never)")
    assert hugepages.resolve("auto", "cpu", "always") == (True, "on (transparent huge pages: always)")
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    hugepages.preflight("auto", "cpu")  # auto just stays off
    with pytest.raises(QuantbenchError, match=r"measure.hugepages=on cannot be done here: transparent huge pages: "
                                              r"never; use measure.hugepages=auto or off"):
        hugepages.preflight("on", "cpu")


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") == "unavailable"


def test_huge_share_reads_the_mapping_that_holds_the_address(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text("00400000-00600000 r-xp 00000000 fd:00 1 /bin/x\nAnonHugePages:         0 kB\n"
                     "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \nRss:  8192 kB\nAnonHugePages:      4096 kB\n")
    assert hugepages.huge_share(0x7F0000000000, 8 << 20, smaps) == 0.5
    assert hugepages.huge_share(0x00400000, 1 << 20, smaps) == 0.0
    assert hugepages.huge_share(0x10, 1 << 20, smaps) is None  # not mapped


def _inside(model, moved) -> bool:
    """Every parameter and buffer (a subclass opened by its flatten) in the arena: listed here, not with
    hugepages.tensors, the list the move itself walks (a tensor it skipped was neither moved nor checked)."""
    lo = torch.frombuffer(moved.arena, dtype=torch.uint8).data_ptr()
    hi = lo + len(moved.arena)
    plain, todo = [], [*model.parameters(), *model.buffers()]
    while todo:
        t = todo.pop()
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            plain.append(t)
        else:
            todo += [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return all(lo <= t.data_ptr() < hi for t in plain if t.numel() > 0)


def test_move_points_every_weight_into_one_mapping_keeping_values_and_ties(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")  # the move itself does not depend on the host
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    ids = [[5, 6, 7, 8]]
    tokens = greedy_generate(model, ids, DecodeOptions(max_new_tokens=6)).sequences
    moved = hugepages.move(model, "auto", "cpu")
    assert moved.tag == "on (transparent huge pages: madvise)" and 0.0 <= moved.share <= 1.0
    assert _inside(model, moved) and len(list(model.buffers())) > 0  # buffers too (RoPE's inv_freq)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: one storage, moved once
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert greedy_generate(model, ids, DecodeOptions(max_new_tokens=6)).sequences == tokens
    off = hugepages.move(model, "off", "cpu")
    assert (off.tag, off.share, off.arena) == ("off (measure.hugepages=off)", None, None)


def test_a_packed_int4_model_moves_its_inner_tensors_and_decodes_the_same(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    exp = build(compose(["model=tiny_random", "quantizer=int4", "tracking.enabled=false", "accuracy.enabled=false"]))
    exp.quantizer.preflight("cpu")
    model = exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    inner = hugepages.tensors(model)
    assert any(t.dtype in (torch.int32, torch.uint8) for t in inner)  # torchao's packed int4, opened by its flatten
    ids = [[5, 6, 7, 8]]
    tokens = greedy_generate(model, ids, DecodeOptions(max_new_tokens=6)).sequences
    moved = hugepages.move(model, "auto", "cpu")
    assert _inside(model, moved)
    assert greedy_generate(model, ids, DecodeOptions(max_new_tokens=6)).sequences == tokens
