"""GPTQ/RTN/AWQ settings that no gptqmodel kernel (or not the one that will run) can take are refused at config time
in one line that lists what is allowed, not after the model loaded and quantized (quantizers/gptq.py KERNELS).

The config-time checks use measure.device=cpu: with the default `auto` a CUDA machine would pick another kernel.
"""

from __future__ import annotations

import pytest
from conftest import FAST

from harness.config import build
from harness.errors import ConfigError, QuantbenchError, Unsupported
from quantizers import gpu_paths
from quantizers.gptq import GPTQModelQuantizer

CPU = [*FAST, "tracking.enabled=false", "measure.device=cpu"]
H100 = (9, 0)


def _build(compose, name: str, extra: list[str]):
    return build(compose([*CPU, f"quantizer={name}", *extra]))


def _refused(compose, name: str, extra: list[str], match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _build(compose, name, extra)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", ["gptq_int4", "rtn_int4"])
def test_bits_the_default_cpu_kernel_cannot_take_fail_at_config_time(compose, name):
    """bits=3 passed the old check (2, 3, 4, 8) but gptq_torch_int8, the CPU default, takes 2, 4, 8 only: the run
    failed in GPTQModel.load after quantizing. The line names the kernel and the one CPU kernel that takes 3 bits,
    which needs a 16-bit model (tiny_random is float32)."""
    line = _refused(compose, name, ["quantizer.bits=3"],
                    r"^quantizer\.bits=3 is not supported by gptq_torch_int8, the kernel quantizer\.kernel=auto picks "
                    r"on cpu \(it takes bits: 2, 4, 8\); choose one of those, or set quantizer\.kernel=gptq_torch "
                    r"\(with model\.dtype=float16 or bfloat16\)$")
    assert line.count("quantizer.bits") == 1
    _refused(compose, name, ["quantizer.bits=3", "model.dtype=bfloat16"],
             r"choose one of those, or set quantizer\.kernel=gptq_torch$")
    _refused(compose, name, ["quantizer.bits=3", "quantizer.kernel=gptq_torch"],  # float32: gptq_torch's dtype check
             r"^model\.dtype='float32' is not supported by quantizer\.kernel=gptq_torch \(it takes dtypes: float16, "
             r"bfloat16\)")
    for legal in (["quantizer.bits=4"], ["quantizer.bits=2"], ["quantizer.bits=8"],
                  ["quantizer.bits=3", "quantizer.kernel=gptq_torch", "model.dtype=bfloat16"]):
        assert _build(compose, name, legal).quantizer.bits in (2, 3, 4, 8)


def test_a_group_size_gptqmodel_does_not_take_fails_at_config_time(compose):
    """group_size=100 failed inside model.quantize (no kernel packs it); 256 passes gptqmodel but not the CPU
    default kernel (failed in GPTQModel.load)."""
    _refused(compose, "rtn_int4", ["quantizer.group_size=100"],
             r"^quantizer\.group_size=100 is not allowed; choose one of: -1, 16, 32, 64, 128, 256, 512, 1024$")
    _refused(compose, "awq_int4", ["quantizer.group_size=256"],  # no AWQ kernel takes more than 128
             r"^quantizer\.group_size=256 is not allowed; choose one of: -1, 16, 32, 64, 128$")
    _refused(compose, "gptq_int4", ["quantizer.group_size=256"],
             r"^quantizer\.group_size=256 is not supported by gptq_torch_int8, .*\(it takes group_size: -1, 16, 32, "
             r"64, 128\); choose one of those, or set quantizer\.kernel=gptq_torch")
    for legal in ("128", "64", "32", "-1"):
        assert _build(compose, "rtn_int4", [f"quantizer.group_size={legal}"]).quantizer.group_size == int(legal)
    assert _build(compose, "rtn_int4", ["quantizer.group_size=256", "quantizer.kernel=gptq_torch",
                                        "model.dtype=bfloat16"]).quantizer.group_size == 256


def test_an_unknown_kernel_fails_at_config_time(compose):
    """kernel=bogus was never checked: `'bogus' is not a valid BACKEND` after quantizing. Each method lists the
    kernels that load its format."""
    _refused(compose, "rtn_int4", ["quantizer.kernel=bogus"],
             r"^quantizer\.kernel='bogus' is not allowed; choose one of: auto, gptq_torch_int8, gptq_torch, "
             r"gptq_torch_fused, gptq_torch_aten, gptq_marlin, .*gptq_bitblas$")
    _refused(compose, "awq_int4", ["quantizer.kernel=gptq_torch"],
             r"^quantizer\.kernel='gptq_torch' is not allowed; choose one of: auto, awq_torch_int8, awq_torch, ")
    for legal in ("auto", "gptq_torch_int8", "gptq_torch_fused"):
        assert _build(compose, "gptq_int4", [f"quantizer.kernel={legal}"]).quantizer.kernel == legal
    assert _build(compose, "awq_int4", ["quantizer.kernel=awq_marlin"]).quantizer.kernel == "awq_marlin"


def test_an_explicit_kernel_is_checked_against_every_setting(compose):
    """Marlin is symmetric only; bitblas has no desc_act: refused whatever the device, with kernels that take them."""
    _refused(compose, "gptq_int4", ["quantizer.kernel=gptq_marlin", "quantizer.sym=false", "model.dtype=float16"],
             r"^quantizer\.sym=False is not supported by quantizer\.kernel=gptq_marlin \(it takes sym: True\); choose "
             r"one of those, or set quantizer\.kernel to one of: gptq_torch, gptq_machete, ")
    _refused(compose, "gptq_int4", ["quantizer.kernel=gptq_bitblas", "quantizer.desc_act=true", "model.dtype=float16"],
             r"^quantizer\.desc_act=True is not supported by quantizer\.kernel=gptq_bitblas \(it takes desc_act: "
             r"False\)")


def test_the_cli_precheck_answers_in_one_line(compose):
    """run.py's gate: this line is printed as `error: ...` and the command exits 2 before anything loads."""
    from harness.cli import precheck

    problem = precheck(["model=tiny_random", "quantizer=rtn_int4", "quantizer.bits=3", "measure.device=cpu"])
    assert problem is not None and problem.startswith("quantizer.bits=3 is not supported by gptq_torch_int8")
    assert "\n" not in problem and "2, 4, 8" in problem
    assert precheck(["model=tiny_random", "quantizer=rtn_int4", "measure.device=cpu"]) is None


def test_preflight_checks_the_kernel_of_this_device(monkeypatch):
    """On CUDA the GPU path table's kernel is only known in preflight (it needs the GPU's capability): gptq_marlin,
    symmetric only. A CUDA-only kernel on CPU is SKIPPED (Unsupported, like torchao's); a CPU-only one on CUDA is an
    error."""
    monkeypatch.setattr(gpu_paths, "device_capability", lambda device: H100 if device.startswith("cuda") else None)
    with pytest.raises(ConfigError, match=r"^quantizer\.sym=False is not supported by gptq_marlin, the kernel "
                                          r"quantizer\.kernel=auto picks on sm_90 \(it takes sym: True\)"):
        GPTQModelQuantizer(sym=False).preflight("cuda")
    GPTQModelQuantizer().preflight("cuda")  # the defaults: Marlin
    GPTQModelQuantizer(method="awq", sym=False).preflight("cuda")  # awq_marlin takes both
    with pytest.raises(Unsupported, match=r"^needs CUDA: quantizer gptq_int4 kernel=gptq_marlin runs on cuda only; "
                                          r"on cpu use quantizer\.kernel=auto or one of: gptq_torch_int8, "):
        GPTQModelQuantizer(kernel="gptq_marlin").preflight("cpu")
    with pytest.raises(QuantbenchError, match=r"kernel=gptq_torch_int8 runs on cpu only; on cuda use "):
        GPTQModelQuantizer(kernel="gptq_torch_int8").preflight("cuda")
    with pytest.raises(ConfigError, match=r"quantizer\.bits=3 is not supported by gptq_torch_int8"):
        GPTQModelQuantizer(bits=3).preflight("cpu")  # a sweep cell preflights without check_with's device


def test_the_kernel_table_matches_the_installed_gptqmodel():
    """KERNELS is hard-coded (importing gptqmodel takes ~6 s, too slow for config time): it must say what gptqmodel's
    own kernel classes say, for every kernel that loads the format each method saves."""
    pytest.importorskip("gptqmodel")
    from gptqmodel.quantization import FORMAT, METHOD
    from gptqmodel.quantization.config import _resolve_dynamic_group_size_error
    from gptqmodel.utils.backend import BACKEND
    from gptqmodel.utils.importer import BACKEND_TO_METHOD_FORMAT_MAPPING, get_kernel_for_backend

    from quantizers.gptq import AWQ_KERNELS, GPTQ_KERNELS

    left_out = {"mlx", "gptq_w4afp8", "gptq_w4a_nvfp4"}  # Apple MPS; W4A needs an activation policy (gptq.py)
    devices = {"all": ("cpu", "cuda"), "cpu": ("cpu",), "xpu": (), "cuda": ("cuda",), "rocm": (), "mps": ()}
    for table, method, fmt in ((GPTQ_KERNELS, METHOD.GPTQ, FORMAT.GPTQ), (AWQ_KERNELS, METHOD.AWQ, FORMAT.GEMM)):
        theirs = {}
        for backend in BACKEND_TO_METHOD_FORMAT_MAPPING[method][fmt]:
            if backend.value in left_out:
                continue
            cls = get_kernel_for_backend(backend, method, fmt)
            where = tuple(d for d in ("cpu", "cuda") if any(d in devices[x.value] for x in cls.SUPPORTS_DEVICES))
            theirs[backend.value] = (tuple(cls.SUPPORTS_BITS), tuple(cls.SUPPORTS_GROUP_SIZE), where,
                                     set(cls.SUPPORTS_SYM), set(cls.SUPPORTS_DESC_ACT),
                                     {str(d).removeprefix("torch.") for d in cls.SUPPORTS_DTYPES})
        ours = {k: (s.bits, s.group_size, s.devices, set(s.sym), set(s.desc_act), set(s.dtypes))
                for k, s in table.items()}
        assert ours == theirs, method
        assert set(table) <= {b.value for b in BACKEND}
    # the group sizes gptqmodel's QuantizeConfig names are the GPTQ kernels' together
    named = _resolve_dynamic_group_size_error().split("[", 1)[1].split("]", 1)[0]
    assert sorted({g for s in GPTQ_KERNELS.values() for g in s.group_size}) == [int(g) for g in named.split(",")]


def test_calibration_on_the_scored_corpus_skips_the_scored_tokens_however_it_is_named(compose, tmp_path):
    """Only an empty calibration_corpus skipped the scored tokens: `builtin` with the default accuracy.corpus=builtin
    (or one file named twice, here through a link) calibrated on exactly the tokens perplexity and KL score, untagged.
    Too short to skip them: samples from the start, tagged overlapping; another text: no skip, no tag."""
    from harness.analysis import corpus
    from harness.models import load_tokenizer

    text = tmp_path / "scored.txt"
    text.write_text(corpus.load("builtin"))
    (tmp_path / "link.txt").symlink_to(text)
    tok = ids = None
    for cal, acc, skipped, overlap in [("builtin", "builtin", True, False), ("''", "builtin", True, False),
                                       (str(corpus.BUILTIN_CORPUS), "builtin", True, False),
                                       (str(text), str(tmp_path / "link.txt"), True, False),
                                       (str(text), "builtin", False, False),  # the same words, but not the scored file
                                       ("builtin", "builtin", False, True)]:
        extra = ["accuracy.max_tokens=6000"] if overlap else []  # 7.4k tokens: 1.4k left after, 8 x 256 needed
        exp = _build(compose, "gptq_int4", ["quantizer.calibration_samples=8", f"quantizer.calibration_corpus={cal}",
                                            f"accuracy.corpus={acc}", *extra])
        tok = tok or load_tokenizer(exp.model)
        ids = ids or tok(corpus.load("builtin"), add_special_tokens=False)["input_ids"]
        samples, _, flagged = exp.quantizer.calibration(tok)
        first = samples[0]["input_ids"]
        assert (first == ids[300:556], first == ids[:256], flagged) == (skipped, not skipped, overlap), (cal, acc)
