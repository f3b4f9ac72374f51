"""`make ui`: the MLflow UI over the local store, loopback only, with a link to each experiment's runs.

    python -m harness.records.ui                 # results/mlflow.db on http://127.0.0.1:5000 (what `make ui` runs)
    python -m harness.records.ui --links         # only print the links (for a UI that already runs)

Why the links: MLflow 3.17 opens an experiment on its GenAI overview ("Traces 0, No data available")
until "Model training" is picked at the top of its sidebar, and its UI decides that from the browser's
remembered choice, not from the experiment's `mlflow.experimentKind` tag (which quantbench still sets;
see harness/records/mlflow_runs.py). A link with `workflowType=machine_learning` opens the runs table directly.
"""

from __future__ import annotations

import argparse
import os
import sys

from harness.config import TrackingConfig
from harness.records.mlflow_runs import bounded_db, runs_url
from harness.records.server import SERVER_ENV, backend_uri_for
from harness.records.sqlite_seed import missing_store
from harness.secret_uri import has_password, redact

HOST = "127.0.0.1"  # loopback only: the UI can change and delete runs


def experiment_links(store_uri: str, base_url: str) -> list[tuple[str, str]]:
    """(name, runs-table link) of every active experiment in the store that holds a run."""
    if missing_store(store_uri):
        return []  # nothing recorded yet; do not create the store just to list it
    from mlflow.tracking import MlflowClient  # heavy (seconds): only when listing, after the cheap check above

    c = MlflowClient(tracking_uri=backend_uri_for(store_uri))
    return [(e.name, runs_url(base_url, e.experiment_id)) for e in c.search_experiments()
            if c.search_runs([e.experiment_id], max_results=1)]


def ui_launch(store_uri: str, port: int, workers: int) -> tuple[list[str], dict[str, str]]:
    """The `mlflow ui` command line and environment: loopback only, MLflow's job runner off as for
    harness/records/server.py's server (SERVER_ENV)."""
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", backend_uri_for(store_uri),
           "--host", HOST, "--port", str(port)]
    if workers:
        cmd += ["--workers", str(workers)]
    return cmd, {**os.environ, **SERVER_ENV}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.records.ui", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend-store-uri", default=TrackingConfig().resolved_uri(),
                    help="MLflow store (default: results/mlflow.db under the current folder)")
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=1,
                    help="server worker processes (default 1: one person on loopback; MLflow's own default, 4, "
                         "starts 4 servers)")
    ap.add_argument("--links", action="store_true", help="print the links and exit, without starting the UI")
    args = ap.parse_args(argv)
    if has_password(args.backend_store_uri):  # `ps` shows a command line to everyone
        print(f"error: --backend-store-uri {redact(args.backend_store_uri)!r} holds a password, which `ps` shows to "
              "every user; give the URI without it and put the password in ~/.pgpass (or PGPASSFILE)", file=sys.stderr)
        return 2
    base = f"http://{HOST}:{args.port}"
    try:  # one attempt at a database store, not MLflow's ~100 s of retries before a traceback
        with bounded_db(TrackingConfig(uri=args.backend_store_uri)):
            links = experiment_links(args.backend_store_uri, base)
    except Exception as exc:  # noqa: BLE001 - a store that cannot be read (down, refused, not a store): one line
        why = f"cannot read {redact(args.backend_store_uri)}: {type(exc).__name__}: {str(exc).strip()}"
        why = " ".join(why.split("\n", 1)[0].split())[:300]
        if args.links:
            print(f"error: {why}", file=sys.stderr)
            return 2
        print(f"warning: {why}; starting the UI without the links", file=sys.stderr)
        links = None
    print(f"MLflow UI on {base} over {args.backend_store_uri}")
    if links:
        width = max(len(name) for name, _ in links)
        print("the runs of each experiment (a plain experiment link opens MLflow's GenAI overview):")
        for name, url in links:
            print(f"  {name:<{width}}  {url}")
    elif links is not None:
        print("no runs recorded yet (python run.py records one); in the UI pick 'Model training' at the top "
              "of the sidebar to see runs")
    sys.stdout.flush()
    if args.links:
        return 0
    cmd, env = ui_launch(args.backend_store_uri, args.port, args.workers)
    os.execve(sys.executable, cmd, env)  # the server takes this process over: Ctrl-C and its PID stop it
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
