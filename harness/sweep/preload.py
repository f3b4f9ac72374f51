"""What a sweep's forkserver imports once, so that every cell forked from it starts warm (harness/sweep/).

A cell's own process keeps it isolated (its memory, threads and any crash end with it), but a fresh
interpreter pays torch's and transformers' imports again for every cell (10-20 s on 2 loaded cores). The
sweep starts its cells with multiprocessing's `forkserver`: one server process imports this module, then
forks a child per cell, which finds everything below already imported. Only imports happen here, no
computation: the server never starts a thread pool, allocates a model or touches a device, so each fork
starts from clean state (a CUDA context, in particular, must never exist before a fork).

Optional libraries are imported when present; an import error leaves the cell to import (and report) it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging

from harness import quiet_third_party

quiet_third_party()  # before the imports: naming transformers' model classes imports torchao, which is noisy

# transformers imports its model classes lazily: naming them here is what loads them
import torch  # noqa: F401, E402
import transformers  # noqa: F401, E402
from transformers import (  # noqa: F401, E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    StaticCache,
)

import harness.analysis.accuracy  # noqa: F401, E402
import harness.analysis.roofline  # noqa: F401, E402
import harness.measure.fast_path  # noqa: F401, E402
import harness.measure.workloads  # noqa: F401, E402
import harness.models  # noqa: F401, E402
import harness.run.engines  # noqa: F401, E402
import harness.run.runner  # noqa: F401, E402
import harness.sweep.isolated  # noqa: F401, E402 - the cell's entry point (child_main)
import quantizers.auto  # noqa: F401, E402
import quantizers.dtype  # noqa: F401, E402
import strategies.greedy  # noqa: F401, E402
import strategies.static_batch  # noqa: F401, E402

# MLflow's client and SQL store: ~1 s of imports in every cell that records its run
OPTIONAL = ("torchao", "torchao.quantization", "safetensors.torch", "tokenizers", "jinja2", "hydra.utils",
            "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store")
for _name in OPTIONAL:
    with contextlib.suppress(Exception):  # a broken optional backend is the cell's to report, not the server's
        importlib.import_module(_name)
logging.getLogger("quantbench").debug("forkserver preload done")
