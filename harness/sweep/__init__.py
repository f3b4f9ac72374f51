"""Sweeps that survive failures: one isolated child process per cell, resume, one MLflow parent run.

How a Hydra multirun becomes a sweep (any launcher: basic, submitit_local, ...):

- `callback.SweepCallback.on_multirun_start` (registered in conf/config.yaml under hydra.callbacks) runs
  once in the launching process (`parent.start_sweep`): it validates the sweep settings, takes the sweep
  folder's lock (one sweep per folder: `resume.hold_folder`), marks stale MLflow runs KILLED, opens (or
  re-opens, on resume) the sweep's MLflow parent run and writes `results/<sweep>/sweep.json`, the
  state every job reads (its path also goes to the jobs through $QUANTBENCH_SWEEP_STATE: `settings`).
- Each Hydra job calls `cell.run_cell(cfg)` (run.py does this in MULTIRUN mode). It never loads a
  model: it validates the cell, reuses an OK result for the same config hash and resume key (code
  version, CPU, library versions: `resume`), else runs `harness.run.runner.run` in a child process of its
  own with a timeout (`isolated`), classifies what happened (OK, FAILED, OOM, TIMEOUT, CRASHED, KILLED),
  writes `results/<sweep>/cells/<hash>.json` and logs a nested MLflow run under the parent. It never
  raises for a failed cell, so the sweep goes on.
- `callback.SweepCallback.on_multirun_end` (`parent.finish_sweep`) reads the cells of this invocation
  back from disk (so the result is the same whatever the launcher and wherever the jobs ran), runs the
  drift probe where `sweep.drift_probe` is set (the baseline cell again, speed only: `drift`), writes
  report.md / report.png, logs them to the parent run, ends it, and sets the exit code run.py returns
  (non-zero when any cell is not OK, or when none is OK: a sweep that measured nothing must not pass).

Warm cells: the child is forked from a `forkserver` that imported torch, transformers and the harness once
(`preload`), so a cell pays no interpreter start or imports (`sweep.start_method=spawn` gives each cell a
fresh interpreter instead). The server only imports, never computes, so every child starts from the same
clean state; the parent's environment and working directory are handed to each child.

Everything a job needs travels through files, never through in-process globals, and cells on this machine
measure one at a time under any launcher (a lock in the cache root: `isolated.measuring_turn`; `launchers` says which
launchers run cells here), which is what keeps results identical under hydra/launcher=submitit_local.
The in-process globals (`progress`, `parent`) only drive the progress bar and the exit code of the launching
process.

Test-only fault injection: $QUANTBENCH_TEST_FAULTS (JSON, e.g. '{"kill": {"measure.seed": 1}}') makes
the child of every matching cell SIGKILL itself ("kill"), hang ("hang") or raise MemoryError ("oom")
once it is ready (`isolated.fault_for`). It exists for the fault-drill tests; it is not a config field,
so it never changes a cell's config hash and a resume without it runs the same cells cleanly.

Modules, lowest first: settings (sweep settings, the state file, cell names), launchers (which run cells on
this machine, their job limits), resume (resume key, folder lock), progress (bar and terminal lines), isolated
(a cell's child process), cell (one Hydra job), parent (open and close a sweep), callback (the Hydra callback);
drift is the probe that measures the drift between cells; preload is what the forkserver imports.
"""
