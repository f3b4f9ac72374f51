"""The memory check (harness/measure/memory.py): what is compared with the memory available, and which models it
can count before anything loads."""

from __future__ import annotations

import json

import pytest

from harness.config import build
from harness.measure import memory
from harness.models import HFModel


def test_the_process_is_not_counted_twice_against_what_is_available(compose, monkeypatch):
    """MemAvailable (a cgroup's limit minus usage, free GPU memory) already excludes the process: the estimate's
    runtime (its RSS now) compared with it too refused runs that fit."""
    monkeypatch.setattr(memory, "runtime_bytes", lambda device: 4e9)  # a process already holding 4 GB
    exp = build(compose(["model=tiny_random", "quantizer=fp32", "accuracy.enabled=false"]))
    exp.engine.preflight(exp, "cpu")
    est = memory.transformers_estimate(exp, "cpu")
    run = est.total - est.parts["runtime"]
    monkeypatch.setattr(memory, "available_bytes", lambda device: (run * 1.5, "MemAvailable"))
    fits = memory.check(exp, "cpu")
    assert fits is not None and fits.total == est.total  # the reported estimate (mem_estimate_mb) keeps the runtime
    monkeypatch.setattr(memory, "available_bytes", lambda device: (run * 0.5, "MemAvailable"))
    with pytest.raises(memory.DoesNotFit, match=r"GB is available \(MemAvailable\)"):
        memory.check(exp, "cpu")


def test_a_hub_id_in_the_local_cache_is_counted_from_its_snapshot(tmp_path, monkeypatch):
    """quantizers/base.py reads a cached hub id's config; the memory check did not (None: check skipped, an
    impossible run started)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 300,
           "tie_word_embeddings": False}
    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    counts = memory.model_counts(HFModel(name_or_path="acme/tiny", dtype="float32"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert counts is not None and counts.params == sum(p.numel() for p in model.parameters())
    assert counts.layers == 3 and counts.vocab == 300
    assert memory.model_counts(HFModel(name_or_path="acme/not-cached", dtype="float32")) is None
