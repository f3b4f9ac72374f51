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

# The suite in two passes: every test not marked `serial` on TEST_WORKERS pytest-xdist workers (2 on 2 cores:
# ~8 min on a clean clone, measured on a Zen 4 host), then the `serial` tests (the CI gate on real
# commits, fault drills, cell timeouts) alone. The workers take whole modules, and tests/test_docs.py command by
# command (tests/conftest.py's scheduler). A pass that selects nothing (pytest's exit 5, e.g. under a PYTEST_ARGS -k) is fine; both: exit 5.
TEST_WORKERS ?= 2
test: setup-all
	@code1=0; code2=0; \
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not heavy and not serial" $(PYTEST_ARGS) || code1=$$?; \
	$(PY) -m pytest -p no:xdist -m "serial and not heavy" $(PYTEST_ARGS) || code2=$$?; \
	if [ $$code1 = 5 ] && [ $$code2 = 5 ]; then echo "make test: no test selected"; exit 5; fi; \
	for c in $$code1 $$code2; do [ $$c = 0 ] || [ $$c = 5 ] || exit $$c; done

# every shipped experiment, all cells, on the embedded model (narrowed sizes): by hand before a release
test-heavy: setup-all
	$(PY) -m pytest -m heavy $(PYTEST_ARGS)

# CI's regression gate (docs/gate.md): this checkout, uncommitted changes included, against the baseline revision
# BASE (default: the previous commit) on the smoke experiment: decode speed (each side measured by its own
# revision's pipeline, in a worker process of its own) and accuracy against results/baselines/smoke.json.
# The gate exits 0 pass, 1 regression, 2 error, but GNU make turns any failed recipe into its own exit 2
# (its last line says `Error 1` or `Error 2`), so the recipe also writes the gate's own code to
# results/gate-exit-code, and .ci/run exits with that. `make gate BASE=origin/main` compares with the branch a PR targets.
BASE ?= HEAD~1
GATE_SMOKE := +experiment=smoke measure.max_new_tokens=32 measure.repetitions=1 measure.threads=1
GATE_ARGS ?=
gate: setup
	@mkdir -p results; code=0; \
	$(PY) -m harness.gate --baseline "$(GATE_SMOKE)" --baseline-rev "$(BASE)" --candidate "$(GATE_SMOKE)" \
	  --budget 120 --accuracy-baseline results/baselines/smoke.json --summary results/gate-summary.md $(GATE_ARGS) \
	  || code=$$?; echo $$code > results/gate-exit-code; exit $$code

lint: setup
	$(PY) -m ruff check .

# MLflow UI on the local store, loopback only; prints a link to each experiment's runs table (harness/records/ui.py).
# `make ui UI_PORT=5001 UI_STORE=sqlite:////path/to/mlflow.db` serves another port or store.
UI_PORT ?= 5000
UI_STORE ?= sqlite:///$(CURDIR)/results/mlflow.db
ui: setup
	$(PY) -m harness.records.ui --backend-store-uri $(UI_STORE) --port $(UI_PORT)

clean-cache:
	rm -rf $${QUANTBENCH_CACHE:-$$HOME/.cache/quantbench}
