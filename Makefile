# quantbench: `make run` (default experiment) and `make test` (whole suite) are all a new user needs.
PY := .venv/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-all run test test-heavy gate lint ui clean-cache

setup:
	@bash scripts/setup.sh

setup-all:
	@bash scripts/setup.sh --all

run: setup
	$(PY) run.py $(ARGS)

test: setup-all
	$(PY) -m pytest $(PYTEST_ARGS)

# every shipped experiment, all cells, on the embedded model (narrowed sizes): by hand before a release
test-heavy: setup-all
	$(PY) -m pytest -m heavy $(PYTEST_ARGS)

# CI's regression gate (docs/gate.md): this checkout, uncommitted changes included, against the baseline revision
# BASE (default: the previous commit) on the smoke experiment: decode speed (each side measured by its own
# revision's pipeline, in a worker process of its own) and accuracy against results/baselines/smoke.json.
# Exit 0 pass, 1 regression, 2 error. `make gate BASE=origin/main` compares with the branch a PR targets.
BASE ?= HEAD~1
GATE_SMOKE := +experiment=smoke measure.max_new_tokens=32 measure.repetitions=1 measure.threads=1
GATE_ARGS ?=
gate: setup
	$(PY) -m harness.gate --baseline "$(GATE_SMOKE)" --baseline-rev "$(BASE)" --candidate "$(GATE_SMOKE)" \
	  --budget 120 --accuracy-baseline results/baselines/smoke.json --summary results/gate-summary.md $(GATE_ARGS)

lint: setup
	$(PY) -m ruff check .

# MLflow UI on the local store, loopback only; prints a link to each experiment's runs table (harness/records/ui.py)
ui: setup
	$(PY) -m harness.records.ui --backend-store-uri sqlite:///$(CURDIR)/results/mlflow.db --port 5000

clean-cache:
	rm -rf $${QUANTBENCH_CACHE:-$$HOME/.cache/quantbench}
