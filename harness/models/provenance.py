"""What a model's "unquantized reference" was stored as: the run tag `reference.source`.

The reference (KL, top-1, task answers) is the model loaded in `accuracy.reference_dtype`, but the weights it
loads may themselves be quantized: the default model is SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to floats,
so every KL and task Δ for it is a distance from that Q4_1 model. The tag says so: `gguf:Q4_1+Q8_0` (the ggml
types of the GGUF's matrices, most elements first), `hf:BF16` (the safetensors dtypes of a checkpoint, with its
`quantization_config` method if any), `random` (random weights).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from harness import gguf_meta


def gguf(path: str | Path) -> str:
    return "gguf:" + ("+".join(gguf_meta.matrix_types(path)) or "unknown")


def hf(directory: Path) -> str:
    """`hf:` + the stored dtypes of the checkpoint's tensors, most elements first (headers only, no tensor data)."""
    elements: dict[str, int] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info.get("shape", []):
                    n *= d
                elements[info["dtype"]] = elements.get(info["dtype"], 0) + n
    out = "hf:" + ("+".join(sorted(elements, key=lambda k: -elements[k])) or "unknown")
    try:
        method = (json.loads((directory / "config.json").read_text()).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        method = None
    return f"{out} ({method})" if method else out
