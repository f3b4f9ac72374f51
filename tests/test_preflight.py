"""Bad input is refused before anything runs: a corpus or hub model that cannot be had offline (one line,
exit 2, before any timing), and a `_target_` that names code outside the allowed classes (refused from its
dotted path alone, before any import)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from harness.analysis import corpus
from harness.cli import precheck
from harness.config import build
from harness.errors import ConfigError, QuantbenchError

NO_SUCH_DATASET = "quantbench-no-such-org/no-such-corpus:raw:test"
NO_SUCH_MODEL = "quantbench-no-such-org/no-such-model"


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache and the hub switched off (as on a machine without internet, e.g. this one)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = importlib.import_module("harness.models.hub") if importlib.util.find_spec("harness.models.hub") else None
    if hub:
        hub.clear_cache()  # probes are remembered per process
    yield tmp_path / "hf"
    if hub:
        hub.clear_cache()


# --- item 3: corpus and hub model, checked before the model loads -------------------------------------------
@pytest.mark.parametrize("argv, needles", [
    ([f"accuracy.corpus={NO_SUCH_DATASET}"],
     ["accuracy.corpus='quantbench-no-such-org/no-such-corpus:raw:test'", "not in the local HF datasets cache",
      "local text file"]),
    (["accuracy.corpus=wikitxt"], ["accuracy.corpus='wikitxt'", "not in the local HF datasets cache"]),
    (["model=hf", f"model.name_or_path={NO_SUCH_MODEL}"],
     [f"model.name_or_path='{NO_SUCH_MODEL}'", "not in the local HF cache", "local directory"]),
])
def test_a_corpus_or_hub_model_that_cannot_be_had_offline_fails_the_precheck(offline_hub, argv, needles):
    problem = precheck(argv)
    assert problem is not None and "\n" not in problem, problem
    assert all(n in problem for n in needles), problem


def test_a_cached_dataset_and_a_cached_hub_model_pass(offline_hub):
    # what `datasets.load_dataset` leaves behind (<cache>/<owner>___<name>/<config>/<version>/<hash>) and
    # what `snapshot_download` leaves behind (<hub>/models--owner--name/refs/main -> snapshots/<sha>)
    (offline_hub / "datasets" / "owner___corpus" / "raw" / "0.0.0" / "abc123").mkdir(parents=True)
    snap = offline_hub / "hub" / "models--owner--model" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    (offline_hub / "hub" / "models--owner--model" / "refs").mkdir()
    (offline_hub / "hub" / "models--owner--model" / "refs" / "main").write_text("0" * 40)
    assert precheck(["accuracy.corpus=owner/corpus:raw:test"]) is None
    assert precheck(["model=hf", "model.name_or_path=owner/model"]) is None
    assert precheck(["accuracy.corpus=builtin"]) is None
    assert precheck(["accuracy.enabled=false", f"accuracy.corpus={NO_SUCH_DATASET}"]) is None  # not read at all


def test_a_cached_dataset_without_the_config_or_split_asked_for_fails_the_precheck(offline_hub):
    """Offline, load_dataset reads only the cached copies: <config>/<version>/<hash> with its splits in
    dataset_info.json. A config or split that is not there used to pass and fail after the timing."""
    copy = offline_hub / "datasets" / "owner___corpus" / "raw" / "0.0.0" / "abc123"
    copy.mkdir(parents=True)
    (copy / "dataset_info.json").write_text(json.dumps({"config_name": "raw", "splits": {"test": {"name": "test"}}}))
    assert precheck(["accuracy.corpus=owner/corpus:raw:test"]) is None
    assert precheck(["accuracy.corpus=owner/corpus"]) is None  # the one cached config, split test
    for spec, needle in (("owner/corpus:other", "holds owner/corpus only in config(s) raw, not 'other'"),
                         ("owner/corpus:raw:train", "holds owner/corpus:raw only with split(s) test, not 'train'")):
        problem = precheck([f"accuracy.corpus={spec}"])
        assert problem is not None and "\n" not in problem, problem
        assert problem.startswith(f"accuracy.corpus='{spec}': the local HF datasets cache (") and needle in problem


def test_a_corpus_file_that_is_not_utf8_is_refused_at_validation(compose, tmp_path):
    """Only its existence was checked: a Latin-1 file failed with UnicodeDecodeError after all the timing."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("a café au lait".encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"accuracy.corpus='{latin1}' is not UTF-8 text (byte 0xe9 at "
                                                    "offset 5: invalid continuation byte)")):
        build(compose(["model=tiny_random", f"accuracy.corpus={latin1}"]))
    # the offset counts across read blocks, through a character cut in two by a block's end
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"a" * ((1 << 20) - 1) + "é".encode() + b"\xff")
    assert "byte 0xff at offset 1048577:" in corpus.file_problem("accuracy.corpus", str(cut))
    cut.write_bytes(b"a" * 10 + "é".encode()[:1])  # a file cut inside its last character
    assert "byte 0xc3 at offset 10: unexpected end of data" in corpus.file_problem("accuracy.corpus", str(cut))


def test_a_dataset_that_fails_to_load_says_why(monkeypatch):
    """The hint blamed an unreachable hub for any failure, a missing config or split included."""
    datasets = pytest.importorskip("datasets")

    def refuse(*a, **k):
        raise ValueError("Couldn't find cache for owner/corpus for config 'other'\nAvailable configs in the cache: "
                         "['raw']")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(QuantbenchError) as info:
        corpus.load("owner/corpus:other")
    assert str(info.value) == ("accuracy.corpus='owner/corpus:other' could not be loaded (ValueError: Couldn't find "
                               "cache for owner/corpus for config 'other'); check the name, config and split, or pass "
                               "a local text file")


def test_run_py_refuses_an_unloadable_corpus_in_one_line_before_any_timing(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env = {**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_DATASETS_CACHE")}, **env}
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "run.py", "model=tiny_random", "accuracy.corpus=wikitxt",  # a typo
                           "tracking.enabled=false", f"tracking.results_dir={results}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: accuracy.corpus='wikitxt'"), proc.stderr[-2000:]
    assert not results.exists()  # nothing ran: no run, no timing thrown away


def test_the_runner_checks_the_corpus_before_the_engine_runs(compose, offline_hub, results_overrides, monkeypatch):
    """A run that skips run.py's precheck (a sweep cell, the gate, a test) still fails before anything loads."""
    from harness.run.engines import TransformersEngine
    from harness.run.runner import run

    def open_session(self, exp, device, threads):
        raise AssertionError("the engine ran (tokenizer, model, timing) before the corpus was checked")

    monkeypatch.setattr(TransformersEngine, "open", open_session)
    res = run(compose(["model=tiny_random", "accuracy.corpus=wikitxt", "accuracy.kl=false",
                       *results_overrides, "tracking.enabled=false"]))
    assert res.status == "FAILED" and "not in the local HF datasets cache" in res.error, res.error
    assert res.tags["cpu.family"] and res.tags["version.torch"] and res.tags["threads"]  # like an OK run's


# --- item 6: `_target_` refused from its dotted path, before any import -----------------------------------
@pytest.mark.parametrize("target", ["harness.gate.__main__.X", "harness.gate.__main__", "quantizers.__main__.Y",
                                    "harness._secret.X", "harness.gate.__main__.__class__", "harness.nope.sub.X"])
def test_target_is_refused_from_its_dotted_path_before_any_import(compose, monkeypatch, target):
    real = importlib.import_module
    imported: list[str] = []

    def recording(name, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", recording)
    sys.modules.pop("harness.gate.__main__", None)
    with pytest.raises(ConfigError, match=r"model._target_=.* is not allowed"):
        build(compose([f"model._target_={target}"]))
    module = target.rsplit(".", 1)[0]
    assert not [m for m in imported if m.startswith(module) or "__main__" in m], imported
    assert "harness.gate.__main__" not in sys.modules  # the gate's CLI never ran


def test_an_unknown_key_beside_a_bad_target_imports_nothing_either(monkeypatch):
    """The one-line message for an unknown key lists the keys of the class the section's `_target_` names:
    that lookup must pass the same check before it imports anything."""
    sys.modules.pop("harness.gate.__main__", None)
    problem = precheck(["model._target_=harness.gate.__main__.X", "model.foo=1"])
    assert problem is not None and "model.foo" in problem and "\n" not in problem, problem
    assert "harness.gate.__main__" not in sys.modules  # the gate's CLI never ran


def test_project_targets_still_build(compose):
    exp = build(compose(["model=tiny_random", "quantizer=bf16", "strategy=speculative"]))
    assert type(exp.model).__name__ == "TinyRandom" and type(exp.engine).__name__ == "TransformersEngine"


@pytest.mark.parametrize("argv, expected", [
    (["strategy.requests=2"], "strategy.requests=2 is fewer than the workload's 4 prompts"),
    (["strategy.requests=2", "measure.prompts=synthetic:3", "measure.prompt_tokens=8"],
     "strategy.requests=2 is fewer than the workload's 3 prompts"),
    (["-m", "strategy.requests=2,4"], "sweep cell strategy.requests=2: strategy.requests=2 is fewer than the "
                                      "workload's 4 prompts"),
    (["strategy.requests=2", "measure.prompts=synthetic:2", "measure.prompt_tokens=8"], None),
    (["strategy.requests=8"], None),
])
def test_continuous_batch_requests_below_the_prompt_count_are_refused_at_config_time(argv, expected):
    """The prompt count of a named set, synthetic:N or a file is known without a tokenizer: too few requests were
    refused only inside the run (harness/run/pipeline.py), a FAILED cell of a sweep and exit 1 for a single run."""
    problem = precheck(["model=tiny_random", "strategy=continuous_batch", *argv])
    assert problem == expected if expected is None else (problem or "").startswith(expected), problem
