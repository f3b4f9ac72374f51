"""The GGUF -> float32 safetensors cache, written tensor by tensor (harness/models/gguf_convert.py): the same bytes
as transformers' whole-model load, a fraction of its memory. Tiny GGUFs written here; no model package needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from harness.config import build
from harness.measure import memory
from harness.models import gguf_convert
from harness.models.gguf_export import write_gguf
from harness.models.random_model import RandomModel


@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2"])
def test_the_streamed_cache_is_the_whole_model_loads_bytes(arch, tmp_path, monkeypatch):
    """Names (the GGUF -> HF map), llama's q/k row order, F32 and BF16 tensors, a tied head saved once: every
    tensor equals what `from_pretrained(gguf_file=...)` holds in float32, bit for bit, and the directory loads."""
    monkeypatch.setattr(gguf_convert, "SLAB_BYTES", 4096)  # many slabs per matrix: the slab joins are checked too
    gguf = write_gguf(RandomModel(arch=arch, dtype="float32"), tmp_path / f"{arch}.gguf")
    out = tmp_path / "out"
    out.mkdir()
    assert gguf_convert.streams(gguf) and gguf_convert.write_weights(gguf, out)
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32)
    expected = {k: v for k, v in whole.state_dict().items()
                if not (whole.config.tie_word_embeddings and k == "lm_head.weight")}
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == np.float32 and got[name].tobytes() == t.numpy().tobytes(), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in whole.state_dict().items())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_dequantized_in_slabs_equals_gguf_dequantize(kind, tmp_path, monkeypatch):
    """Quantized blocks (SmolLM2's Q4_1 layers and Q8_0 embedding), a slab of rows at a time: the same floats."""
    monkeypatch.setattr(gguf_convert, "SLAB_BYTES", 1000)
    qtype = GGMLQuantizationType[kind]
    values = np.random.default_rng(0).standard_normal((37, 256)).astype(np.float32)
    w = GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    w.add_tensor("m", quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    with open(tmp_path / "q.gguf", "rb") as src:
        got = gguf_convert._dequantized(src, tensor)
    assert got.dtype == np.float32 and got.tobytes() == dequantize(tensor.data, qtype).tobytes()


def test_a_first_load_of_a_gguf_is_a_phase_of_the_memory_estimate(compose, tmp_path, monkeypatch):
    """Streamed: two float32 copies of the largest tensor; where the whole model is saved: ~7 bytes a parameter,
    more than the run itself for a bf16 model. Once cached: nothing."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(RandomModel(arch="tiny", dtype="float32"), tmp_path / "tiny.gguf")
    exp = build(compose(["model=gguf", f"model.path={gguf}", "accuracy.enabled=false"]))
    counts = memory.model_counts(exp.model)
    est = memory.transformers_estimate(exp, "cpu")
    assert est.phases["GGUF conversion"] == counts.largest_tensor * 4 * gguf_convert.STREAM_COPIES
    monkeypatch.setattr(gguf_convert, "streams", lambda path: False)  # e.g. an architecture of transformers' new path
    whole = memory.transformers_estimate(exp, "cpu")
    assert whole.phases["GGUF conversion"] == counts.params * gguf_convert.WHOLE_MODEL_BYTES
    # the phase is the peak where it is the larger: (a tiny model's ~7 bytes a parameter are not; runtime is the
    # process's RSS, read at each estimate, so totals of two estimates are compared without it)
    monkeypatch.setattr(gguf_convert, "WHOLE_MODEL_BYTES", 1e4)
    huge = memory.transformers_estimate(exp, "cpu")
    assert huge.total - huge.parts["runtime"] == huge.phases["GGUF conversion"] == counts.params * 1e4
    assert est.total - est.parts["runtime"] < huge.phases["GGUF conversion"]
    gguf_convert.cached_dir(gguf).mkdir(parents=True)
    assert memory.transformers_estimate(exp, "cpu").phases["GGUF conversion"] == 0.0


def test_rope_settings_are_read_from_either_config_layout_and_an_unwritable_rope_is_refused():
    """A config saved by transformers 5 keeps rope_theta and its scaling in `rope_parameters`: the export read only
    `rope_theta` / `rope_scaling`, so such a GGUF got a base of 10000 and no llama3 factors (llama.cpp then decoded
    another model than transformers, silently)."""
    from harness.errors import QuantbenchError
    from harness.models.gguf_export import llama3_rope_factors, rope

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = {"rope_theta": 500000.0, "rope_scaling": llama3, "hidden_size": 64, "num_attention_heads": 4}
    new = {"rope_parameters": {"rope_theta": 500000.0, **llama3}, "hidden_size": 64, "num_attention_heads": 4}
    assert rope(old)[0] == rope(new)[0] == 500000.0
    assert llama3_rope_factors(new) == llama3_rope_factors(old) is not None
    assert rope({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}) == (100000.0, {})
    with pytest.raises(QuantbenchError, match="RoPE type 'yarn' has no GGUF export"):
        rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("arch,drop", [("tiny", "blk.1.ffn_down.weight"), ("tiny-qwen2", None)])
def test_a_gguf_missing_a_tensor_is_refused_not_filled_with_random_values(arch, drop, tmp_path, monkeypatch):
    """The stream gives up on a file that lacks a parameter; transformers' whole-model load then filled it with
    fresh random values, silently, and the cache kept them. Refused, nothing cached; a tied head (no output.weight
    of its own, tiny-qwen2) still converts."""
    from harness.errors import QuantbenchError
    from harness.models import GGUFFile, gguf_export

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    full = gguf_export.plan
    monkeypatch.setattr(gguf_export, "plan", lambda src: [t for t in full(src) if t[1] != drop])
    gguf = write_gguf(RandomModel(arch=arch, dtype="float32"), tmp_path / f"{arch}.gguf")
    source = GGUFFile(path=str(gguf), dtype="float32")
    if drop is None:
        monkeypatch.setattr(gguf_convert, "streams", lambda path: False)  # the whole-model load, as for a newer arch
        assert (source.local_dir() / "model.safetensors").is_file()
        return
    with pytest.raises(QuantbenchError, match=r"tiny.gguf lacks tensors LlamaForCausalLM needs \("
                                              r"model\.layers\.1\.mlp\.down_proj\.weight\)"):
        source.local_dir()
    assert not gguf_convert.cached_dir(gguf).exists()


def test_a_gguf_without_a_tokenizer_is_refused_by_preflight_before_any_conversion(tmp_path, monkeypatch):
    """No `tokenizer.ggml.model`: transformers' ValueError came out of run.py as a traceback, after the whole
    conversion had run inside the config check (the prompts measured against a 128-position context)."""
    from gguf import GGUFWriter

    from harness.cli import precheck

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "novocab.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    problem = precheck(["model=gguf", f"model.path={path}", "accuracy.enabled=false"])  # run.py: this line, exit 2
    assert problem is not None and "\n" not in problem
    assert (f"model.path='{path}' has no tokenizer in its metadata (no tokenizer.ggml.model key), and quantbench "
            "tokenizes the prompts with it; use a GGUF written with its vocabulary") in problem
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
