# quantbench: `make run` (default experiment) and `make test` (whole suite) are all a new user needs.
PY := .venv/bin/python
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-all run test lint ui clean-cache

setup:
	@bash scripts/setup.sh

setup-all:
	@bash scripts/setup.sh --all

run: setup
	$(PY) run.py $(ARGS)

test: setup-all
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

# MLflow UI on the local store, loopback only
ui: setup
	$(PY) -m mlflow ui --backend-store-uri sqlite:///$(CURDIR)/results/mlflow.db --host 127.0.0.1 --port 5000

clean-cache:
	rm -rf $${QUANTBENCH_CACHE:-$$HOME/.cache/quantbench}
