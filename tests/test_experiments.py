"""Every shipped experiment stays runnable: all its cells compose and validate, and it runs as a sweep.

Each experiment runs through the real CLI on the tiny model with its sweep narrowed to one cell that the
tiny model supports (the full sweeps load the 135M model and take minutes to hours); smoke runs whole in
tests/test_mlflow_ui.py.
"""

from __future__ import annotations

import pytest
from conftest import ROOT

from harness.cli import baseline_problem
from harness.config import build, compose
from harness.sweep.settings import planned_cells, settings_from

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = ["model=tiny_random", "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0",
        "accuracy.max_tokens=200", "accuracy.context_length=64", "accuracy.stride=64"]
# one cell per experiment that the tiny model can run on CPU: a command-line value replaces the experiment's
# swept list (Hydra's basic sweeper lets the command line win), exactly as a user narrows a sweep
NARROW = {
    "smoke": ["quantizer=bf16"],
    "quant_sweep": ["quantizer=torchao_int8"],
    "batch_scaling": ["quantizer=int4", "strategy.batch_size=4"],
    "spec_decode": ["strategy.draft=prompt_lookup", "strategy.num_draft_tokens=2"],
    "llama_bench": ["engine=transformers", "workload=tg128"],  # llama.cpp needs a GGUF: tests/test_workloads.py
    "crossover": ["quantizer=int8", "strategy.batch_size=2", "measure.context_depth=16"],
    "task_accuracy": ["quantizer=bf16", "accuracy.task_limit=3"],  # the real task files: scripts/setup.sh --tasks
    "scaling": ["size=tiny", "format=int4"],  # the tiny preset of the random model (tests/test_random_model.py)
    "scaling_8b": ["size=tiny", "format=int4_eager"],
    # CUDA only: on a machine without a GPU the cell is SKIPPED ("needs CUDA") and the sweep exits 1
    "gpu_scaling": ["size=tiny", "gpu_format=int8"],
    "gpu_scaling_batch": ["size=tiny", "gpu_format=int4", "strategy.batch_size=4"],
    "serving": ["size=tiny", "format=int4,llama_cpp_q4_0", "load.profile=rates", "load.rates=[20,40]", "load.requests=4",
                "load.lengths=fixed:16/4", "load.warmup_requests=1"],
}


def test_the_issue_names_every_experiment():
    assert set(EXPERIMENTS) >= {"smoke", "quant_sweep", "batch_scaling", "spec_decode"}
    assert set(NARROW) == set(EXPERIMENTS), "add the new experiment to NARROW"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_cell_of_the_experiment_composes_and_validates(name):
    from hydra import compose as hydra_compose
    from omegaconf import open_dict

    cfg = compose([f"+experiment={name}"])
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        full = hydra_compose("config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    assert full.hydra.mode.name == "MULTIRUN" and cfg.name == name
    with open_dict(full):
        full.hydra.overrides.task = [f"+experiment={name}"]
    cells = planned_cells(full.hydra)
    assert len(cells) >= 3
    built = []
    for cell in cells:
        exp = build(compose(cell))  # the cell holds +experiment=<name> too; raises ConfigError listing every problem
        assert exp.name == name
        settings = settings_from(exp.config)
        built.append(exp)
    assert baseline_problem(settings.baseline, built) is None  # its sweep.baseline is a quantizer of its cells

# Running each experiment's narrowed cell through the CLI: tests/test_docs.py (docs/sweeps.md and
# docs/workloads.md show `python run.py +experiment=<name>` for every shipped experiment, run with NARROW).
