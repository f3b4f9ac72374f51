"""Where results go and how people read them.

- `results`: the result JSON (the source of truth, written first and atomically), reading a sweep's cells back.
- `mlflow_runs`: one MLflow run per result, bounded retries, one writer at a time per SQLite store.
- `tracking`: `record()` (JSON, then MLflow) and `python -m harness.records.tracking upload` (re-send later).
- `server`: an MLflow tracking server on PostgreSQL (`python -m harness.records.server`).
- `ui`: the MLflow UI on the local store, with links to each experiment's runs table (`make ui`).
"""
