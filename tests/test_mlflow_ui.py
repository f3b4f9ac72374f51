"""The MLflow UI as a person checks a sweep: the smoke sweep, `make ui`'s server (`python -m harness.records.ui`) on
127.0.0.1, headless Chromium opening the link it prints for the experiment.

What a person must see first is the runs table with the sweep's parent run and its cells, not MLflow 3.17's
GenAI overview ("Traces 0, No data available") that a plain experiment link opens (harness/records/ui.py says why).
Needs Debian's chromium + chromium-driver and the selenium package (scripts/setup.sh --all installs them).
The screenshot is saved to results/ui/mlflow_sweep.png (and the test's tmp folder) for a person to look at.
Then a store it cannot read: `--links` exits 2 in one line within seconds, and the UI still starts without links.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import warm
from conftest import ROOT

from harness.records import mlflow_runs, ui
from harness.sweep.settings import FAULT_ENV, STATE_ENV

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
METRIC = "decode_tokens_per_s"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(fn, timeout: float, what: str):
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what} ({last})")


def test_make_ui_link_opens_the_sweep_on_its_runs_table_with_child_runs_and_a_metric_column(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("selenium"), "selenium missing: run scripts/setup.sh --all"
    assert Path(CHROMIUM).exists() and Path(DRIVER).exists(), "chromium missing: run scripts/setup.sh --all"
    from mlflow.tracking import MlflowClient
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    done = warm.run(["run.py", "+experiment=smoke", f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra",
                     "tracking.experiment=ui_smoke", "accuracy.max_tokens=200"], ROOT, env, tmp_path / "procs", timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    labels = ["quantizer=none", "quantizer=bf16", "quantizer=fp16"]

    port = free_port()
    store = f"sqlite:///{tmp_path}/mlflow.db"
    exp = MlflowClient(store).get_experiment_by_name("ui_smoke")
    assert exp.tags.get(mlflow_runs.EXPERIMENT_KIND_TAG) == "custom_model_development"
    ui_log = tmp_path / "ui.log"
    # README's `make ui`, on a free port and this test's store; harness.records.ui becomes mlflow ui: the group
    # started here holds make, the server and its workers
    server = subprocess.Popen(["make", "ui", f"UI_PORT={port}", f"UI_STORE={store}"], cwd=ROOT, env=env,
                              stdout=open(ui_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    driver = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: urllib.request.urlopen(f"{url}/health", timeout=2).status == 200, 120, "mlflow ui")
        link = re.search(r"^\s+ui_smoke\s+(\S+)$", ui_log.read_text(), re.M)
        assert link, ui_log.read_text()[-2000:]
        assert link.group(1) == mlflow_runs.runs_url(url, exp.experiment_id)
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-dev-shm-usage", "--window-size=1600,1000"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
        driver.get(link.group(1))  # as a person does: the link `make ui` printed for the experiment
        # the landing page is the runs table with the sweep's parent run, not the GenAI overview
        wait_for(lambda: driver.find_element(By.XPATH, "//*[text()='sweep:smoke']"), 60, "the sweep's parent run")
        assert f"/experiments/{exp.experiment_id}/runs" in driver.current_url, driver.current_url
        assert driver.find_element(By.XPATH, "//*[@role='columnheader']//*[text()='Run Name']").is_displayed()
        landing = driver.find_element(By.TAG_NAME, "body").text
        assert "No data available" not in landing and "Usage" not in landing, landing[:500]
        driver.save_screenshot(str(tmp_path / "landing.png"))
        for b in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
            b.click()  # the assistant side panel hides columns
        driver.find_element(By.CSS_SELECTOR, "button[data-component-id*='runnamecellrenderer']").click()
        for label in labels:
            wait_for(lambda label=label: driver.find_element(By.XPATH, f"//a/span[text()='{label}']"), 30,
                     f"child run {label}")
        # add the decode tokens/s metric column through the Columns menu, as a person does
        driver.find_element(By.CSS_SELECTOR, "[data-testid=column-selection-dropdown]").click()
        box = wait_for(lambda: driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search columns']"), 20,
                       "the column search")
        box.send_keys(METRIC)
        wait_for(lambda: driver.find_element(By.XPATH, f"//*[text()='{METRIC}']"), 20, "the metric option").click()
        box.send_keys(Keys.ESCAPE)
        header = wait_for(lambda: driver.find_element(By.XPATH, f"//*[@role='columnheader']//*[text()='{METRIC}']"),
                          20, "the metric column")
        assert header.is_displayed()
        time.sleep(1)
        shot = tmp_path / "mlflow_sweep.png"
        driver.save_screenshot(str(shot))
        out = ROOT / "results" / "ui"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / "mlflow_sweep.png")
        # the metric cells hold the runs' values as MLflow shows them: in full (3.17 does), or rounded (a rounded form
        # alone misses a value such as 844.9995690995439, which rounds to 845.000 and 844.9996, both absent)
        runs = {r.info.run_name: r for r in MlflowClient(url).search_runs([exp.experiment_id])}
        body = driver.find_element(By.TAG_NAME, "body").text
        for label in labels:
            assert label in body
            value = runs[label].data.metrics[METRIC]
            shown = [repr(value)] + [f"{value:.{n}f}" for n in range(1, 6)]
            assert any(s in body for s in shown), (label, value)
    finally:
        if driver is not None:
            driver.quit()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


class StoreDown(Exception):
    """What SQLAlchemy raises for a database store that refuses connections: a message of several lines."""


def _store_down(store_uri, base_url):
    raise StoreDown('(psycopg2.OperationalError) connection to server at "127.0.0.1", port 9 failed: Connection '
                    "refused\n\tIs the server running on that host and accepting TCP/IP connections?")


def test_links_from_a_store_that_cannot_be_read_are_one_error_line_and_exit_2(monkeypatch, capsys):
    """experiment_links() ran unguarded: a down database store cost MLflow's ~100 s of retries, then a traceback."""
    monkeypatch.setattr(ui, "experiment_links", _store_down)
    monkeypatch.setattr(ui.os, "execve", lambda *a: pytest.fail("--links must not start the UI"))
    assert ui.main(["--backend-store-uri", "postgresql://qb@127.0.0.1:9/x", "--links"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: cannot read postgresql://qb@127.0.0.1:9/x: StoreDown: ") and err.count("\n") == 1
    assert "Connection refused" in err and not out


def test_the_ui_starts_without_links_when_the_store_cannot_be_read_for_them(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(ui, "experiment_links", _store_down)
    monkeypatch.setattr(ui.os, "execve", lambda exe, cmd, env: started.append(cmd))
    assert ui.main(["--backend-store-uri", "postgresql://qb@127.0.0.1:9/x", "--port", "5099"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("warning: cannot read postgresql://qb@127.0.0.1:9/x: StoreDown: ") and err.count("\n") == 1
    assert "starting the UI without the links" in err and "no runs recorded yet" not in out
    assert started and started[0][started[0].index("--port") + 1] == "5099"


def test_links_from_a_down_database_store_fail_in_seconds_not_after_mlflows_retries():
    """MLflow makes a database store's engine in up to 10 attempts (~100 s of sleeps): one attempt here."""
    # psycopg2-binary is a core dependency (pyproject.toml): the driver is there, the server is not
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "harness.records.ui", "--backend-store-uri",
                          f"postgresql://qb@127.0.0.1:{free_port()}/x", "--links"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: cannot read postgresql://qb@127.0.0.1:"), out.stderr
    assert out.stderr.count("\n") == 1 and time.monotonic() - t0 < 30
