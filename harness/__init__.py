"""quantbench harness: config, models, measurement, accuracy, tracking (see README)."""

import logging


def quiet_third_party() -> None:
    """Silence import-time noise that says nothing about the run (optional CUDA kernels of torchao on a
    CPU machine, torch pytree deprecations)."""
    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree", "mlflow.store.db.utils",
                 "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.ERROR)
