"""The reference's output layer for the exact KL record (harness/analysis/accuracy.py): where its weights are on
disk, reading them back checked by sha256, and whether `W h + b` is the model's logits at all.

A model may process its logits after the output layer (Gemma 2's final_logit_softcapping, Cohere's logit_scale,
Granite's logits_scaling): then `W h + b` is not its distribution and the record must be top-k. Such a model
is recognised from its config first, and the reference pass also compares the recomputed logits with the model's
own (`within_rounding`), which catches what the config does not name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from harness.errors import QuantbenchError

# config fields that transform the logits after the output layer, and the value that leaves them unchanged
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logits_soft_cap": None, "output_logit_soft_cap": None,
                    "logit_scale": 1.0, "logits_scaling": 1.0, "lm_head_multiplier": 1.0}


def logit_transform(config: Any) -> str:
    """'field=value' of the first logit-transforming setting of `config` (or its text config), else ''."""
    configs = [config]
    if callable(getattr(config, "get_text_config", None)):
        configs.append(config.get_text_config())
    for c in configs:
        for name, noop in LOGIT_TRANSFORMS.items():
            value = getattr(c, name, None)
            if value is not None and value != noop:
                return f"{name}={value}"
    return ""


def within_rounding(again: torch.Tensor, own: torch.Tensor, largest: float) -> float:
    """How far the recomputed logits `again` are from the model's `own`, in units of rounding (<= 1: a match).

    One ulp of each logit in its own dtype (eps x |logit| is at least one ulp): a differently blocked sum
    rounds to at most the neighbouring value. Plus a float32-level floor, 4 ulps of the largest logit, for the
    fp32 accumulation itself. Not eps x max|logit| in a 16-bit dtype: in bf16 that is 3% of the largest logit,
    enough to pass a softcap as exact and give the reference a non-zero KL against itself.
    """
    eps = torch.finfo(own.dtype).eps
    diff = (again.float() - own.float()).abs()
    tol = eps * own.float().abs() + 4 * torch.finfo(torch.float32).eps * max(1.0, largest)
    return float((diff / tol).max())


def ref_logits(hidden: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    weight, bias = head
    return torch.nn.functional.linear(hidden.to(weight.device, weight.dtype), weight, bias)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def read_tensor(path: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open  # safetensors: never unpickles

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


def locate_head(model: Any, local_dir: Path, dtype: torch.dtype) -> tuple[dict, str]:
    """Where the output layer's weights are on disk: (metadata, "") or ({}, why not)."""
    from safetensors import safe_open

    if (transform := logit_transform(getattr(model, "config", None))):
        return {}, f"the model config sets {transform}: its logits are not the output layer's"
    out = model.get_output_embeddings()
    if not isinstance(out, torch.nn.Linear):
        return {}, f"the output layer is a {type(out).__name__}, not a plain Linear"
    params = dict(model.named_parameters(remove_duplicate=False))
    meta = {"head_dtype": str(dtype).removeprefix("torch.")}
    for part, tensor in (("weight", out.weight), ("bias", out.bias)):
        if tensor is None:
            meta["head_bias"] = ""
            continue
        names = sorted(n for n, p in params.items() if p is tensor)  # tied: the input embedding's name too
        found = []
        for file in sorted(local_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                found += [(file.name, n) for n in names if n in f.keys()]
        if not found:
            return {}, f"no tensor named {' or '.join(names)} in {local_dir}"
        meta[f"head_file_{part}"], meta[f"head_{part}"] = found[0]
        on_disk = read_tensor(local_dir / found[0][0], found[0][1], dtype)
        if not torch.equal(on_disk, tensor.detach().cpu()):
            return {}, f"{found[0][1]} in {local_dir} differs from the loaded model's output layer"
        meta[f"head_sha256_{part}"] = sha256(on_disk)
    return meta, ""


def load_head(meta: dict, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's output layer from the model directory, checked against the record's sha256."""
    dtype = getattr(torch, meta["head_dtype"])
    parts = []
    for part in ("weight", "bias"):
        if not meta.get(f"head_{part}"):
            parts.append(None)
            continue
        path = Path(meta["model_dir"]) / meta[f"head_file_{part}"]
        tensor = read_tensor(path, meta[f"head_{part}"], dtype)
        if sha256(tensor) != meta[f"head_sha256_{part}"]:
            raise QuantbenchError(f"{meta[f'head_{part}']} in {path} is not the output layer the reference record "
                                  f"{meta.get('path')} was built with; delete that record to rebuild it")
        parts.append(tensor.to(device))
    return parts[0], parts[1]
