"""A GGUF file to the cached float32 safetensors directory, one tensor at a time.

transformers' own GGUF load (`from_pretrained(..., gguf_file=...)`) dequantizes every tensor into a float32 state
dict, builds the model beside it, and `save_pretrained` serializes it once more: ~7 bytes per parameter at peak
(+0.94 GB for SmolLM2-135M; ~56 GB for an 8B model), which no memory estimate of the later run covers.
`convert` writes the same cache with the same per-tensor steps of transformers' legacy GGUF loader (ggml
dequantization, the architecture's `TensorProcessor`: llama's q/k row order, ...; the GGUF -> HF name map of a
model built on the meta device) but streams each float32 tensor straight into `model.safetensors`: the peak is the
tokenizer's parse plus one tensor (~3 float32 copies of the largest, the embedding), the GGUF itself mapped.
The tensors are the loader's bytes exactly (tests/test_gguf_convert.py compares them with `from_pretrained`'s).

Where the stream cannot vouch for that, the whole-model save of before runs (`first_conversion_bytes` gives
either peak to the memory estimate, as a phase before the run): architectures transformers 5 loads through its newer GGUF path (`is_gguf_arch_supported`: qwen3.5,
lfm2), and any file whose tensors do not cover every parameter of the model in its shapes. A file that leaves a
parameter without a tensor is refused there (QuantbenchError, nothing cached): transformers would fill it with random
values.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from harness import gguf_meta
from harness.cache import cache_root, file_key, short_hash
from harness.errors import QuantbenchError

# torch, transformers and gguf are imported where used: only a GGUF model's first load converts (tests/test_layout.py,
# LAZY_OK).

HEADER_ROOM = 256  # bytes reserved per tensor for its safetensors header entry, beyond its name
SLAB_BYTES = 4 << 20  # of a GGUF tensor's blocks dequantized at once
STREAM_COPIES = 2.0  # float32 copies of one tensor at once: dequantized, reordered (llama's q/k rows)
WHOLE_MODEL_BYTES = 8.0  # per parameter: the float32 state dict, the model, the serializer's buffer (measured ~7)


def _newer_path(arch: str) -> bool:
    """transformers loads this architecture through its own GGUF reader (packed blocks), not the legacy loader."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:
        return False
    return bool(is_gguf_arch_supported(arch))


def streams(gguf: Path) -> bool:
    """Whether `convert` writes this file tensor by tensor (else: the whole model at once)."""
    try:
        arch = str(gguf_meta.read(gguf).fields["general.architecture"].contents())
    except (KeyError, *gguf_meta.HEADER_ERRORS):
        return False
    return not _newer_path(arch)


def tokenizer_problem(gguf: Path) -> str | None:
    """Why the tokenizer cannot be built from the file's metadata (transformers raises a ValueError only at the end
    of the conversion); None: it can, or gguf-py is not here to read the metadata (the conversion needs it anyway)."""
    try:
        fields = gguf_meta.read(gguf).fields  # parsed once per process: the memory estimate reads the same
    except (ImportError, *gguf_meta.HEADER_ERRORS):  # the conversion meets it; here only the tokenizer is checked
        return None
    if "tokenizer.ggml.model" in fields:
        return None
    return ("has no tokenizer in its metadata (no tokenizer.ggml.model key), and quantbench tokenizes the prompts "
            "with it; use a GGUF written with its vocabulary (llama.cpp's convert_hf_to_gguf.py writes one)")


def cached_dir(gguf: Path) -> Path:
    """Where the conversion of `gguf` is cached (keyed by the file's content and the transformers that wrote it)."""
    return cache_root() / "models" / f"{gguf.stem}-{short_hash(file_key(gguf), version('transformers'))}"


def first_conversion_bytes(gguf: Path, params: float, largest_tensor: float) -> float:
    """What converting `gguf` holds at peak beside the process (the memory estimate's phase); 0 once cached."""
    if cached_dir(gguf).exists():
        return 0.0
    return largest_tensor * 4 * STREAM_COPIES if streams(gguf) else params * WHOLE_MODEL_BYTES


def convert(gguf: Path, out: Path) -> None:
    """Write `out`: config, generation config, model.safetensors (float32) and the tokenizer of `gguf`."""
    from transformers import AutoTokenizer

    if not (streams(gguf) and write_weights(gguf, out)):
        _whole_model(gguf, out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


def _whole_model(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                       output_loading_info=True)
    # a parameter the file lacks is filled with fresh random values (said only in transformers' console report):
    # cached, every later number would be another model's. A tied head has no tensor of its own.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = sorted(k for k in info.get("missing_keys", ()) if not (tied and k == "lm_head.weight"))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise QuantbenchError(f"{gguf} lacks tensors {type(model).__name__} needs ({shown}): an incomplete or "
                              "mis-converted file; convert or fetch it again")
    # transformers marks GGUF-loaded models as "quantized" and refuses to save them; the weights are
    # plain floats after dequantization, so drop the marker (the reload is bit-identical).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)


def _dequantized(src: Any, tensor: Any) -> Any:
    """One tensor in float32, dequantized a slab of rows at a time into its result (ggml blocks never span two
    rows, so the values are `gguf.dequantize`'s of the whole tensor), read with file reads rather than through the
    reader's memory map, whose pages would stay resident (and counted) to the end."""
    from gguf import dequantize

    raw_shape, width = tensor.data.shape, tensor.data.dtype.itemsize
    src.seek(tensor.data_offset)
    rows = int(np.prod(raw_shape[:-1])) if len(raw_shape) > 1 else 1
    row_bytes = tensor.data.size * width // max(rows, 1)
    out = None
    step = max(1, SLAB_BYTES // max(row_bytes, 1))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part = np.fromfile(src, dtype=tensor.data.dtype, count=n * row_bytes // width)
        values = dequantize(part.reshape(n, -1) if len(raw_shape) > 1 else part, tensor.tensor_type)
        if out is None:
            out = np.empty((rows, values.size // n), dtype=np.float32)
        out[start:start + n] = values.reshape(n, -1)
    return out.reshape(*raw_shape[:-1], -1) if len(raw_shape) > 1 else out.reshape(-1)


def write_weights(gguf: Path, out: Path) -> bool:
    """The tensors streamed into out/model.safetensors and the configs saved; False (nothing kept) where the
    file's tensors do not make the model's parameters one for one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = gguf_meta.read(gguf)
    arch = str(reader.fields["general.architecture"].contents())
    # the config as the loader parses it (its tokenizer fields dropped at once: tens of MB for a 128k vocabulary)
    parsed = {"config": load_gguf_checkpoint(str(gguf), return_tensors=False)["config"], "tensors": {}}
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    params = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}  # a tied parameter is saved once, under its first name (as save_pretrained does)
    for name, p in params.items():
        first.setdefault(id(p), name)
    saved = set(first.values())
    room = (1024 + sum(HEADER_ROOM + len(n) for n in saved)) // 8 * 8  # data 8-byte aligned, as safetensors keeps it
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    path = out / "model.safetensors"
    offset = 0
    with open(path, "wb") as fh, open(gguf, "rb") as src:
        fh.seek(8 + room)

        def put(name: str, array: Any) -> bool:
            """Write one tensor; False where it does not fit its parameter (the stream is then abandoned)."""
            nonlocal offset
            if name not in saved or name in header:  # a tied parameter's other name, or nothing of the model's
                return True
            if tuple(params[name].shape) != tuple(array.shape):
                return False
            data = np.ascontiguousarray(array, dtype=np.float32)
            fh.write(memoryview(data).cast("B"))
            header[name] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
            offset += data.nbytes
            return True

        for tensor in reader.tensors:
            # read, not the reader's memory map: mapped pages would stay resident (and counted) to the end
            result = processor.process(weights=_dequantized(src, tensor), name=tensor.name,
                                       tensor_key_mapping=names, parsed_parameters=parsed)
            if result.name in names and not put(names[result.name], result.weights):
                break
        else:  # the tensors some processors gather themselves (MoE experts), already under their HF names
            for name, t in parsed["tensors"].items():
                if not put(name, t.to(torch.float32).numpy()):
                    break
        text = json.dumps(header, separators=(",", ":")).encode()
        fits = set(header) - {"__metadata__"} == saved and len(text) <= room
        if fits:  # the header, padded with spaces as safetensors itself pads it
            fh.seek(0)
            fh.write(room.to_bytes(8, "little") + text + b" " * (room - len(text)))
    if not fits:
        os.remove(path)
        return False
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out))
    if model.can_generate():
        model.generation_config.save_pretrained(str(out))
    return True
