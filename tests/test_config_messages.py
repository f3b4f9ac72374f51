"""Bad input the config checks used to miss or word badly, each refused in one line that says what to do, at config
time (in-process compose and validation, no model loads; each test well under 2 s): a required value left unset,
a name where a nested option goes, a key the option's YAML lacks, a sweep for another machine's cores, problems
that hid each other, values of the wrong type or range."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.cli import precheck, run_one
from harness.config import build
from harness.errors import ConfigError
from harness.measure import memory


def problems(compose, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build(compose(overrides))
    assert "\n" not in str(info.value)
    return info.value.problems


# --- a required value (`???`) left unset: one line naming it, not omegaconf's traceback ---------------------
@pytest.mark.parametrize("argv, expected", [
    (["model=gguf"], "model.path is required: model=gguf model.path=/path/to/model.gguf"),
    (["model=hf"], "model.name_or_path is required: model=hf model.name_or_path=/path/to/checkpoint"),
    (["model=random", "model.arch=???"], "model.arch is required (it has no default): add model.arch=<value>"),
])
def test_a_required_value_left_unset_is_named_with_an_example(argv, expected):
    assert precheck(argv) == expected


def test_run_one_refuses_a_missing_value_and_a_name_for_a_nested_option_with_exit_2(compose, capsys):
    for argv in (["model=gguf"], ["model=tiny_random", "strategy=speculative", "strategy.draft_model=tiny_random"]):
        assert run_one(compose(argv)) == 2, argv  # was a traceback (MissingMandatoryValue, AttributeError): exit 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


# --- a name where a nested option goes: the group@key override that picks it ------------------------------
@pytest.mark.parametrize("override, expected", [
    ("strategy.draft_model=tiny_random", "strategy.draft_model='tiny_random' is a name, not a model config: pick the "
                                         "option with +model@strategy.draft_model=tiny_random (one of: gguf, hf,"),
    ("strategy.draft_quantizer=int8", "pick the option with quantizer@strategy.draft_quantizer=int8 (one of: auto16,"),
    ("strategy.draft_quantizer=nosuch", "quantizer@strategy.draft_quantizer=<option> (one of: auto16,"),
])
def test_a_name_where_a_nested_option_goes_says_how_to_pick_it(compose, override, expected):
    found = problems(compose, ["model=tiny_random", "strategy=speculative", override])
    assert len(found) == 1 and expected in found[0], found


def test_a_missing_draft_model_is_refused_before_the_run_naming_its_own_key(compose, capsys):
    argv = ["model=tiny_random", "strategy=speculative", "+model@strategy.draft_model=hf",
            "strategy.draft_model.name_or_path=/no/such"]
    # was: precheck passed, then "[FAILED] ... model.name_or_path='/no/such': no such directory" (the target's key)
    assert precheck(argv) == "strategy.draft_model.name_or_path='/no/such': no such directory"
    assert run_one(compose(argv)) == 2
    assert capsys.readouterr().err == "error: strategy.draft_model.name_or_path='/no/such': no such directory\n"


def test_a_draft_models_error_renames_its_settings_not_the_paths_inside_it():
    from harness.errors import ConfigError, Unsupported
    from strategies.speculative import as_draft

    line = "model.path='/models/model.Q4_0.gguf': no such GGUF file (set model.path, or use model=hf); see (model.dtype)"
    assert str(as_draft(Unsupported(line))) == ("strategy.draft_model.path='/models/model.Q4_0.gguf': no such GGUF "
                                                "file (set strategy.draft_model.path, or use model=hf); see "
                                                "(strategy.draft_model.dtype)")
    assert isinstance(as_draft(Unsupported(line)), Unsupported)  # a sweep still records it SKIPPED
    assert as_draft(ConfigError(["model.name_or_path='/ckpt/my-model.v2': no such directory"])).problems == [
        "strategy.draft_model.name_or_path='/ckpt/my-model.v2': no such directory"]


def test_the_memory_refusal_leaves_an_unexpected_error_to_the_run():
    def broken(exp, device):
        raise AttributeError("'str' object has no attribute 'preflight'")

    exp = SimpleNamespace(measure=SimpleNamespace(device="cpu"), engine=SimpleNamespace(preflight=broken))
    assert memory.refusal(exp) is None  # was raised out of run.py: no run recorded


# --- unknown keys: the + a class's own key needs, no internal fields, no empty "allowed:" --------------------
@pytest.mark.parametrize("argv, expected", [
    (["quantizer=torchao_int8_dyn", "quantizer.head=int8"],
     "quantizer.head: the quantizer option does not set this key of TorchAoInt8; add it with a +: +quantizer.head=int8"),
    (["quantizer=bf16", "quantizer.bits=4"], "quantizer.bits (Dtype) is not a known key; allowed: dtype, prefill_matmul"),
    (["strategy=greedy", "strategy.batch_size=4"], "strategy.batch_size is not a known key: Greedy takes no options"),
    (["+engine.n_threads=2"], "engine.n_threads is not a known key: TransformersEngine takes no options"),
    (["quantizer=bf16", "+quantizer.devices=[tpu]"], "quantizer.devices (Dtype) is not a known key; allowed: dtype, "
                                                     "prefill_matmul"),
])
def test_an_unknown_key_says_what_the_option_takes(argv, expected):
    assert precheck(["model=tiny_random", *argv]) == expected


# --- a sweep run by another machine: checked against the cores a cell gets there ------------------------------
def test_a_slurm_sweep_checks_threads_against_the_cells_cores_not_this_hosts():
    sweep = ["-m", "model=tiny_random", "quantizer=bf16,fp16", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"]
    assert precheck([*sweep, "measure.threads=8"]) is None  # slurm.yaml: cpus_per_task 8, whatever this host has
    assert "measure.threads=9 is more than the 8 cores each cell gets (hydra.launcher.cpus_per_task)" in \
        precheck([*sweep, "measure.threads=9"])
    assert precheck([*sweep, "measure.threads=16", "hydra.launcher.cpus_per_task=16"]) is None
    assert "measure.threads=100000 is more than the" in precheck(["-m", "model=tiny_random", "quantizer=bf16,fp16",
                                                                  "measure.threads=100000"])  # local: this host


# --- problems that hid each other: all in one run, the root cause first ----------------------------------------
def test_text_prompts_on_random_weights_name_the_real_problem_first(compose):
    found = problems(compose, ["model=random", "measure.prompts=default"])
    assert found[0].startswith("model=random has no tokenizer: its workload is token ids"), found
    assert "measure.prompt_tokens=32 applies to measure.prompts=synthetic only" in found[1]


def test_independent_problems_are_reported_together(compose):
    found = problems(compose, ["model=random", "measure.prompts=default", "accuracy.enabled=true",
                               "measure.max_new_tokens=0"])
    assert any("perplexity and KL on them mean nothing" in p for p in found), found  # both from model=random
    assert any("has no tokenizer" in p for p in found) and "measure.max_new_tokens=0 must be > 0" in found, found
    found = problems(compose, ["tracking.retries=-1", "accuracy.context_length=100000", "accuracy.stride=100000"])
    assert len(found) == 2 and "beyond the model's context" in found[0], found  # was hidden by the tracking problem


# --- values: types (a bool is no integer), ranges, shapes that cannot load -------------------------------------
@pytest.mark.parametrize("overrides, expected", [
    (["model=tiny_random", "model.num_key_value_heads=3"],
     ["model.num_key_value_heads=3 must divide model.num_attention_heads=4; choose one of: 1, 2, 4"]),
    (["model=tiny_random", "model.hidden_size=abc"], ["model.hidden_size='abc' must be an integer"]),
    (["engine=llama_cpp", "engine.n_batch=true"], ["engine.n_batch=true must be an integer"]),
    (["model=tiny_random", "quantizer=gptq_int4", "quantizer.group_size=true", "quantizer.calibration_samples=true"],
     ["quantizer.group_size=true must be an integer", "quantizer.calibration_samples=true must be an integer"]),
    (["model=tiny_random", "strategy=continuous_batch", "strategy.num_blocks=true"],
     ["strategy.num_blocks=true must be an integer or null"]),
    (["model=tiny_random", "measure.cv_warn=-1"], ["measure.cv_warn=-1.0 must be >= 0"]),
])
def test_a_value_of_the_wrong_type_or_range_names_its_field(compose, overrides, expected):
    assert problems(compose, overrides) == expected


# --- the sweep section: refused in a single run as in a sweep (it was only read by -m) -------------------------
@pytest.mark.parametrize("override, expected", [
    ("sweep.timeout_s=true", "sweep.timeout_s=true must be a number"),
    ("sweep.drift_probe=bogus", "sweep.drift_probe='bogus' is not allowed; choose one of: all, baseline, none"),
    ("+sweep.nosuch=1", "sweep: SweepSettings.__init__() got an unexpected keyword argument 'nosuch'; allowed keys: "
                        "timeout_s, startup_timeout_s, resume, baseline, start_method, drift_probe, label"),
    ("sweep.nosuch=1", "sweep.nosuch is not a known key; allowed: timeout_s, startup_timeout_s, resume, baseline, "
                       "start_method, drift_probe, label"),
])
def test_a_bad_sweep_setting_is_refused_in_a_single_run_as_in_a_sweep(compose, capsys, monkeypatch, override,
                                                                       expected):
    argv = ["model=tiny_random", override]
    assert precheck(["-m", *argv]) == expected
    assert precheck(argv) == expected  # was None: a single run never read the section
    if not override.startswith("sweep.nosuch"):  # the unknown key without + fails composition itself
        monkeypatch.setattr("harness.cli.runner.run", lambda cfg: pytest.fail("the run started"))
        assert run_one(compose(argv)) == 2
        assert capsys.readouterr().err == f"error: {expected}\n"


# --- 0/1 for true/false: OmegaConf converts them for a bool field; an auto|true|false field refuses them ---------
@pytest.mark.parametrize("override", ["measure.compile=1", "measure.compile=0", "measure.compile_skip_guards=1"])
def test_an_integer_for_an_auto_true_false_setting_is_refused(compose, override):
    key, value = override.split("=")
    # was accepted (1 == True in Python) and then read as neither: `measure.compile is True` checks skipped it
    expected = f"{key}={value} is not allowed; choose one of: auto, true, false"
    assert precheck(["model=tiny_random", override]) == expected


def test_a_bool_field_takes_0_and_1_as_omegaconf_converts_them(compose):
    exp = build(compose(["model=tiny_random", "accuracy.enabled=0", "measure.compile_freezing=1",
                         "measure.path=freezing"]))
    assert exp.accuracy.enabled is False and exp.measure.compile_freezing is True


@pytest.mark.parametrize("sweep", [False, True])
def test_an_output_folder_hydra_cannot_write_is_one_line_before_anything_runs(tmp_path, sweep):
    """Hydra would fail there with a traceback (15-38 lines), a sweep after opening its MLflow parent run."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder below a file: not even root can make it
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    argv = ["-m", "quantizer=none,bf16"] if sweep else []
    problem = precheck([*argv, "model=tiny_random", f"{key}={blocked}/out"])
    assert problem == f"{key}={blocked}/out cannot be written (Not a directory); pick a folder you can write to"
    assert precheck([*argv, "model=tiny_random", f"{key}={tmp_path}/out/${{now:%H-%M-%S}}"]) is None
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())  # made as Hydra would, nothing in it


def test_a_sweep_baseline_that_is_no_quantizer_of_the_sweep_is_one_line_before_it_runs():
    """A typo (nnone) ran the whole sweep, exit 0, and its report had no speed ratio (drift_probe=baseline probed
    nothing). The default baseline is not checked: a sweep of quantized cells only is fine without ratios."""
    sweep = ["-m", "model=tiny_random", "quantizer=none,bf16"]
    assert precheck([*sweep, "sweep.baseline=nnone"]) == \
        "sweep.baseline='nnone' is no quantizer of this sweep's cells; choose one of: bf16, none"
    assert precheck([*sweep, "sweep.baseline=bf16"]) is None
    assert precheck(["-m", "model=tiny_random", "quantizer=bf16,fp16"]) is None  # default `none`, not among them
    # an experiment's own baseline, its cells narrowed to formats without it: a sweep without ratios, not a typo
    assert precheck(["+experiment=scaling", "size=tiny,tiny-qwen2", "format=int4"]) is None


# --- an interpolation in an override: ${hydra:...} resolves as in the run, any other that cannot is one line -------
@pytest.mark.parametrize("argv, expected", [
    (["tracking.run_name=run-${hydra:job.name}"], None),  # Hydra resolves it in the run: so does the precheck
    (["tracking.results_dir=${hydra:runtime.output_dir}/results"], None),
    (["-m", "quantizer=none,bf16", "tracking.run_name=cell-${hydra:job.num}"], None),
    (["measure.max_new_tokens=${oops}"],
     "measure.max_new_tokens does not resolve (Interpolation key 'oops' not found); give a plain value, or an "
     "interpolation that resolves"),
    (["tracking.run_name=${oc.env:QUANTBENCH_NO_SUCH_VAR}"], "tracking.run_name does not resolve (KeyError raised "
                                                            "while resolving interpolation: \"Environment variable"),
    (["sweep.label=${oops}"], "sweep.label does not resolve (Interpolation key 'oops' not found)"),
    (["-m", "quantizer=none,bf16", "sweep.label=${oops}"], "sweep cell quantizer=none: sweep.label does not resolve"),
])
def test_an_interpolation_in_an_override_resolves_as_hydra_would_or_is_one_line(argv, expected):
    # was: a 100-line InterpolationResolutionError traceback and exit 1 from run.py's precheck, for all of them
    problem = precheck([*argv, "model=tiny_random"])
    assert problem == expected if expected is None else (problem or "").startswith(expected), problem
