"""Why a GPU format is slow at batch 1, in one run: one decoder layer's linears per weight path, compiled the way
quantizers/gpu_paths.py says, timed as CUDA-graph replays, with the kernels that ran and dynamo's graph breaks.

    python benchmarks/gpu_paths_probe.py [--out DIR] [--shape llama-3.1-8b] [--only fp16,int8_fused] [--budget-s 300]
    python benchmarks/gpu_paths_probe.py --smoke   # the code on CPU: tiny shape, eager, fp16 and int8 (seconds)

Issue #29 measured whole decode steps (H200, Llama-3.1-8B shape): int4 tinygemm 0.78x fp16, int8 weight-only
0.69x, where torchao's H100 table has 1.90x and 1.57x. A whole step mixes attention, the 16-bit head, graph
breaks and the linear kernels; this probe isolates the linears. Per variant: the seven linears of one layer of
`--shape` (q, k, v, o, gate, up, down; harness/data/arch/<shape>.json) at one row, fed as the decode step feeds
them ([batch 1, 1 token, K]: torchao's preshuffled int4 passes that 3-D input to its kernel unreshaped), compiled as
one function with the variant's mode and inductor flags, after 3 warm calls (compile, graph record, replay) timed over `--iters`
replays in 5 blocks, each by the wall clock up to a device synchronize: us per layer (the median block) and the
spread between blocks, weight GB/s (bytes really stored / time), ratio to fp16; graph breaks and graphs dynamo made; the top kernels by device time
(as tag kernel.linear would name them); errors as one line, so one broken variant does not stop the rest.

Reading it: if `int8_fused` reaches ~2x fp16's GB/s-normalised speed but whole-step int8 is still slow, the cause
is outside the linears (graph breaks, the head); if `int8_gptfast` (plain int8 tensors, no torchao subclass) is
fast and `int8_fused` is not, the subclass is; if `int8_noflags` equals `int8_fused`, the flags do nothing (then
look at the kernel names: a `triton_poi_fused__to_copy` kernel plus a cuBLAS gemv is the unfused dequantize).
`int4_*` the same against `int4_tinygemm_g64`; `fp16_cdt` says whether the Triton one-row reduction beats cuBLAS.
Adding a variant: a function in VARIANTS returning (module, mode, flags); its name documents what it isolates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.measure import compile_diag, cuda_kernels, sync  # noqa: E402
from quantizers import fake_ops, gpu_paths  # noqa: E402
from quantizers.base import module_bytes  # noqa: E402

RO = "reduce-overhead"


def shape(name: str) -> dict[str, tuple[int, int]]:
    """(out, in) features of one decoder layer's linears for an arch preset."""
    c = json.loads((ROOT / "harness" / "data" / "arch" / f"{name}.json").read_text())
    h, i, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads) * c.get("head_dim", h // heads)
    return {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "gate": (i, h), "up": (i, h), "down": (h, i)}


class Layer(torch.nn.Module):
    """The linears of one decoder layer, all run in one call (o and down get inputs of their own width)."""

    def __init__(self, dims: dict[str, tuple[int, int]], dtype: torch.dtype, device: str):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(0)
        for name, (n, k) in dims.items():
            lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device=device)
            lin.weight.data.copy_((torch.randn(n, k, generator=g) * 0.02).to(dtype))
            setattr(self, name, lin)
        self.names = list(dims)

    def forward(self, x: torch.Tensor, xi: torch.Tensor) -> list[torch.Tensor]:
        return [getattr(self, n)(xi if n == "down" else x) for n in self.names]


class Int8GptFast(torch.nn.Module):
    """gpt-fast's int8 weight-only linear: plain int8 rows and scales, no tensor subclass."""

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        w = lin.weight.data.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.register_buffer("w8", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(lin.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w8.to(x.dtype)) * self.scale


def torchao(config: Callable[[], object]) -> Callable[[Layer], Layer]:
    def apply(layer: Layer) -> Layer:
        from torchao.quantization import quantize_

        quantize_(layer, config())
        return layer
    return apply


def int4(packing: str, group: int) -> Callable[[Layer], Layer]:
    def config():
        from torchao.quantization import Int4WeightOnlyConfig

        if packing in ("preshuffled", "plain"):  # mslk 1.1.0 lacks the shape rule: no graph break per linear
            fake_ops.ensure_mslk_fakes()
        return Int4WeightOnlyConfig(group_size=group, int4_packing_format=packing, set_inductor_config=False)
    return torchao(config)


def int8_config():
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig(set_inductor_config=False)


def gemlite_config():
    from torchao.prototype.quantization.quant_api import UIntxWeightOnlyConfig

    return UIntxWeightOnlyConfig(group_size=64, bit_width=4, set_inductor_config=False)


def gptfast(layer: Layer) -> Layer:
    for n in layer.names:
        setattr(layer, n, Int8GptFast(getattr(layer, n)))
    return layer


def nf4(layer: Layer) -> Layer:
    import bitsandbytes as bnb

    for n in layer.names:
        lin = getattr(layer, n)
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=lin.weight.dtype,
                              quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4")
        setattr(layer, n, q.to(lin.weight.device))
    return layer


def same(layer: Layer) -> Layer:
    return layer


FLAGS = gpu_paths.TORCHAO_INDUCTOR
# name -> (dtype, transform, compile mode or "" for eager, inductor flags, package needed). The mslk and gemlite
# kernels run last: an illegal memory access in a kernel new to this image poisons the CUDA context for every later one
VARIANTS: dict[str, tuple[torch.dtype, Callable[[Layer], Layer], str, dict, str]] = {
    "fp16": (torch.float16, same, RO, {}, ""),
    "int8_fused": (torch.float16, torchao(int8_config), RO, FLAGS, "torchao"),
    "int8_noflags": (torch.float16, torchao(int8_config), RO, {}, "torchao"),
    "int8_gptfast": (torch.float16, gptfast, RO, FLAGS, ""),
    "int4_tinygemm_g64": (torch.bfloat16, int4("tile_packed_to_4d", 64), RO, FLAGS, "torchao"),
    "fp16_cdt": (torch.float16, same, RO, {"coordinate_descent_tuning": True}, ""),
    "bf16": (torch.bfloat16, same, RO, {}, ""),
    "int8_eager": (torch.float16, torchao(int8_config), "", {}, "torchao"),
    "int4_tinygemm_g128": (torch.bfloat16, int4("tile_packed_to_4d", 128), RO, FLAGS, "torchao"),
    "nf4": (torch.float16, nf4, RO, {}, "bitsandbytes"),
    "int4_preshuffled_g128": (torch.bfloat16, int4("preshuffled", 128), RO, FLAGS, "mslk"),
    "int4_plain_g128": (torch.bfloat16, int4("plain", 128), RO, FLAGS, "mslk"),
    "int4_gemlite_g64": (torch.float16, torchao(gemlite_config), RO, FLAGS, "gemlite"),
}


BLOCKS = 5  # --iters split into this many timed blocks: the median block and the spread between blocks


def counters() -> tuple[int, int]:
    """(graph breaks, graphs) dynamo has made so far in this process (harness/measure/compile_diag.py)."""
    from torch._dynamo.utils import counters as c

    return sum(compile_diag.graph_breaks().values()), int(c["stats"]["unique_graphs"])


def top_kernels(fn: Callable[[], object], device: str, n: int = 3) -> list[str]:
    """The kernels with the most device time over a few calls (CPU ops on a CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            fn()
        sync(device)
    cuda = device.startswith("cuda")
    rows = [e for e in prof.key_averages() if (str(e.device_type).endswith("CUDA")) == cuda]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows.sort(key=lambda e: -float(getattr(e, key, 0.0) or 0.0))
    name = cuda_kernels.kernel_name if cuda else str  # the readable name kernel.linear would give
    return [f"{name(e.key)[:80]} ({float(getattr(e, key, 0.0)) / 5:.1f} us)" for e in rows[:n]]


def inputs(dims: dict, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's activations as the model feeds its linears: [batch 1, 1 token, K] (3-D, not a 2-D row: a
    library may treat the two differently, as torchao's preshuffled int4 does), for the hidden and the MLP width."""
    return (torch.randn(1, 1, dims["q"][1], dtype=dtype, device=device),
            torch.randn(1, 1, dims["down"][1], dtype=dtype, device=device))


def run_variant(name: str, dims: dict, device: str, iters: int, eager: bool) -> dict:
    dtype, transform, mode, flags, _ = VARIANTS[name]
    torch._dynamo.reset()
    layer = transform(Layer(dims, dtype, device)).eval()
    stored = module_bytes(layer, set())
    x, xi = inputs(dims, dtype, device)
    mode = "" if eager else mode
    breaks0, graphs0 = counters()
    import torch._inductor.config as inductor

    with torch.no_grad(), inductor.patch(flags):
        f = torch.compile(layer, mode=mode, dynamic=False) if mode else layer
        graphs = mode == RO and device.startswith("cuda")

        def call():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            return f(x, xi)

        t0 = time.perf_counter()
        for _ in range(3):  # compiles, records the CUDA graph, replays
            call()
        sync(device)
        compile_s = time.perf_counter() - t0
        breaks, made = (a - b for a, b in zip(counters(), (breaks0, graphs0), strict=True))
        per = max(1, iters // BLOCKS)  # blocks, not single calls: a sync per call would add its own ~10 us
        blocks = []
        for _ in range(BLOCKS):
            t0 = time.perf_counter()
            for _ in range(per):
                call()
            sync(device)
            blocks.append((time.perf_counter() - t0) / per * 1e6)
        us = sorted(blocks)[len(blocks) // 2]
        kernels = top_kernels(call, device)
    return {"variant": name, "status": "OK", "us": round(us, 2), "spread_us": round(max(blocks) - min(blocks), 2),
            "GB/s": round(stored / us / 1e3, 1),
            "MB": round(stored / 1e6, 1), "compile_s": round(compile_s, 1), "graph_breaks": breaks, "graphs": made,
            "mode": mode or "eager", "flags": gpu_paths.inductor_tag(flags), "kernels": kernels,
            "input": [list(x.shape), list(xi.shape)]}


def environment(device: str) -> dict:
    cap = gpu_paths.device_capability(device)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
           "name": torch.cuda.get_device_name() if cap else "", "capability": cap, "gpu.arch": gpu_paths.gpu_arch(cap),
           "packages": {p: gpu_paths.importable(p) for p in ("torchao", "mslk", "gemlite", "bitsandbytes", "gptqmodel")}}
    env["table"] = {f: gpu_paths.path_for(f, cap).tags() for f in gpu_paths.FORMATS}
    return env


def table(rows: list[dict]) -> str:
    base = next((r["us"] for r in rows if r["variant"] == "fp16" and r["status"] == "OK"), None)
    out = ["| variant | status | us/layer (median block) | spread us | vs fp16 | GB/s | MB | breaks | graphs | compile s "
           "| top kernels |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "OK":
            out.append(f"| {r['variant']} | {r['status']} | | | | | | | | | {r.get('error', '')} |")
            continue
        ratio = f"{base / r['us']:.2f}x" if base else "-"
        out.append(f"| {r['variant']} | OK | {r['us']} | {r['spread_us']} | {ratio} | {r['GB/s']} | {r['MB']} | {r['graph_breaks']} | "
                   f"{r['graphs']} | {r['compile_s']} | {'; '.join(r['kernels'])} |")
    return "\n".join(out) + "\n"


def write(out: Path, env: dict, shape_name: str, device: str, rows: list[dict]) -> None:
    (out / "probe.json").write_text(json.dumps({"environment": env, "shape": shape_name, "rows": rows}, indent=1))
    (out / "probe.md").write_text(f"# GPU paths probe: {shape_name}, one row, {env['name'] or device}\n\n" + table(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_paths_probe.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/gpu_paths_probe")
    ap.add_argument("--shape", default="llama-3.1-8b", help="an arch preset of harness/data/arch/")
    ap.add_argument("--only", default="", help="comma-separated variants of: " + ", ".join(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no variant after this many seconds")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (a smoke run of the code)")
    ap.add_argument("--smoke", action="store_true", help="--device cpu --shape tiny --eager --iters 5, fp16 and int8")
    a = ap.parse_args(argv)
    if a.smoke:
        a.device, a.shape, a.eager, a.iters, a.only = "cpu", "tiny", True, 5, a.only or "fp16,int8_eager"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible; use --device cpu --eager for a smoke run", file=sys.stderr)
        return 2
    names = [n for n in a.only.split(",") if n] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from: {', '.join(VARIANTS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.device.startswith("cuda"):
        cuda_kernels.init_profiler_for_cuda_graphs()  # before any capture: the kernel profile replays captured graphs
    env, rows, t0 = environment(a.device), [], time.perf_counter()
    print(json.dumps(env, indent=1), flush=True)
    dims = shape(a.shape)
    for name in names:
        package = VARIANTS[name][4]
        if time.perf_counter() - t0 > a.budget_s:
            rows.append({"variant": name, "status": "SKIPPED", "error": f"--budget-s {a.budget_s:g} spent"})
        elif package and not gpu_paths.importable(package):
            rows.append({"variant": name, "status": "SKIPPED", "error": f"{package} not installed"})
        else:
            try:
                rows.append(run_variant(name, dims, a.device, a.iters, a.eager))
            except Exception as exc:  # one broken variant is a row, the others still run
                rows.append({"variant": name, "status": "FAILED",
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
        print(json.dumps(rows[-1]), flush=True)
        write(out, env, a.shape, a.device, rows)  # after every variant: a crash or a kill keeps the rows so far
    write(out, env, a.shape, a.device, rows)
    print(table(rows))
    return 0 if all(r["status"] != "FAILED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
