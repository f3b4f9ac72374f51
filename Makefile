# quantbench: `make run` (default experiment) and `make test` (whole suite) are all a new user needs.
PY := .venv/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-all run test test-heavy lint ui clean-cache

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

lint: setup
	$(PY) -m ruff check .

# MLflow UI on the local store, loopback only; prints a link to each experiment's runs table (harness/ui.py)
ui: setup
	$(PY) -m harness.ui --backend-store-uri sqlite:///$(CURDIR)/results/mlflow.db --port 5000

clean-cache:
	rm -rf $${QUANTBENCH_CACHE:-$$HOME/.cache/quantbench}
