"""The CUDA runner's Triton kernels compiled for the boards' GPUs without a GPU: Triton's own compiler and the ptxas
its wheel ships, for each architecture, model shape and KV mode, with the registers, spills and shared memory of
each kernel against the architecture's limits.

Each kernel is launched through its real wrapper (``write_kv``, ``decode_attention``, ``prefill_attention``, the
quantized linears) on host tensors of the shape's head size and GQA group; the launch is caught before it runs and
compiled the way Triton's ``JITFunction.run`` does (its binder specializes the arguments, ``triton.compile`` builds
the cubin for the chosen architecture), and ``cuobjdump -res-usage`` reads the cubin's resources. Nothing runs on a
GPU: this says every kernel compiles for Orin (sm_87), Ada (sm_89), Hopper (sm_90) and Thor (sm_101: the bundled
ptxas is CUDA 12.9's, which names Thor sm_101; CUDA 13 renamed it sm_110), and where Triton refuses a mode (fp8
below sm_89) in its own words; the speed is ``scripts/gpu_check.sh``'s to measure.

Limits per compute capability: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (255
registers per thread; shared memory per block 163 KB on 8.0 and 8.7, 99 KB on 8.6 and 8.9, 227 KB on 9.0 and 10.x).
Run it in a process where Triton was imported without ``TRITON_INTERPRET`` (interpreted kernels are not compiled).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from cabinllm.benchmarks.gpu_check import SHAPES, shape_config
from cabinllm.builders.targets import CUDA_KV_DTYPES
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kernels import triton as triton_kernels
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.cuda import CUDA_KV_MODES

ARCHS = {87: "Orin", 89: "Ada", 90: "Hopper (H100)", 101: "Thor"}
SHARED_LIMIT = {87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 101: 227 * 1024}  # bytes per block, opt-in maximum
MAX_REGISTERS = 255
DECODE_CONTEXTS = (512, 16384)  # one split and the most splits: each split count is a kernel of its own
PREFILL_CHUNK = 128
TOKENS_PER_BLOCK = 16
DTYPE = torch.float16  # the runner's compute dtype
ATTENTION_KERNELS = ("_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")
LINEAR_KERNELS = ("_w8_kernel", "_g32_kernel", "_awq_kernel")


@dataclass
class Launch:
    """One kernel launch as its wrapper made it: the JIT function and its arguments."""

    kernel: object
    args: tuple
    kwargs: dict


class _Catch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch instead of running it."""

    def __init__(self, kernel: object, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def caught(module: ModuleType, names: tuple[str, ...], run) -> list[Launch]:
    """The launches ``run()`` makes of ``module``'s kernels ``names`` (none of them runs)."""
    launches: list[Launch] = []
    kept = {name: getattr(module, name) for name in names}
    try:
        for name, kernel in kept.items():
            setattr(module, name, _Catch(kernel, launches))
        run()
    finally:
        for name, kernel in kept.items():
            setattr(module, name, kernel)
    return launches


def attention_launches(config: ModelConfig, mode_name: str) -> list[Launch]:
    """The KV write, decode (one split and the most) and prefill launches of one layer of ``config`` in a KV mode."""
    kernels = triton_kernels.load()
    heads, kv_heads, head = config.num_attention_heads, config.num_key_value_heads, config.head_size
    blocks = -(-max(DECODE_CONTEXTS) // TOKENS_PER_BLOCK)
    storage = kv_mode(mode_name)(KVLayout(1, kv_heads, head), blocks, TOKENS_PER_BLOCK, KVScales([0.02], [0.02]))
    pools = storage.stored_kv(0, torch.zeros(1, dtype=torch.long), 0)
    table = kernels.block_tables([list(range(blocks))], "cpu")

    def run() -> None:
        rows = torch.zeros(PREFILL_CHUNK, kv_heads, head, dtype=DTYPE)
        kernels.write_kv(rows, rows, torch.arange(PREFILL_CHUNK), pools)
        for context in DECODE_CONTEXTS:
            kernels.decode_attention(torch.zeros(1, heads, head, dtype=DTYPE), pools, table,
                                     torch.tensor([context], dtype=torch.int32), head ** -0.5)
        kernels.prefill_attention(torch.zeros(PREFILL_CHUNK, heads, head, dtype=DTYPE), pools, table,
                                  [PREFILL_CHUNK], [4 * PREFILL_CHUNK], head ** -0.5)

    return caught(kernels, ATTENTION_KERNELS, run)


def linear_launches(config: ModelConfig) -> list[Launch]:
    """The quantized linears' launches at the shape's MLP projection (W8A16, int4-g32, W4A16-AWQ group 128)."""
    kernels = triton_kernels.load(triton_kernels.LINEAR_MODULE)
    n, k = config.intermediate_size, config.hidden_size
    x = torch.zeros(1, k, dtype=DTYPE)

    def run() -> None:
        kernels.int8_linear(x, torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, dtype=torch.float32))
        kernels.int4_g32_linear(x, torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=DTYPE),
                                torch.zeros(n, k // 32, dtype=DTYPE))
        kernels.int4_awq_linear(x, torch.zeros(n // 2, k, dtype=torch.int8),
                                torch.zeros(n, k // 128, dtype=torch.float32), 128)

    return caught(kernels, LINEAR_KERNELS, run)


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile a caught launch for ``arch`` as ``JITFunction.run`` would: its resources, or Triton's refusal."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    started = time.perf_counter()
    try:
        bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(
            *launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as refused:  # Triton's own words: what this architecture cannot compile
        return {"compiled": False, "error": str(refused).strip().splitlines()[-1][:300]}
    usage = resource_usage(compiled.asm["cubin"])
    shared = compiled.metadata.shared + usage["SHARED"]
    return {"compiled": True, "seconds": round(time.perf_counter() - started, 2), "registers": usage["REG"],
            "spill_bytes": usage["LOCAL"] + usage["STACK"], "shared_bytes": shared,
            "warps": compiled.metadata.num_warps,
            "within_limits": usage["REG"] <= MAX_REGISTERS and shared <= SHARED_LIMIT[arch]}


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL of a cubin's one kernel, as ``cuobjdump -res-usage`` prints them."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        printed = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", file.name], capture_output=True,
                                 text=True, check=True).stdout
    line = next(line for line in printed.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split())
    return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


def run(archs: list[int], shapes: dict[str, ModelConfig], modes: list[str]) -> dict:
    """Every kernel of every shape and mode compiled for every arch (the quantized linears once per shape)."""
    rows = []
    for shape, config in shapes.items():
        cases = [(mode, launch) for mode in modes for launch in attention_launches(config, mode)]
        cases += [("-", launch) for launch in linear_launches(config)]
        for mode, launch in cases:
            constexprs = {k: v for k, v in launch.kwargs.items() if k in ("SPLITS", "GROUP", "HEAD")}
            for arch in archs:
                rows.append({"shape": shape, "kv_mode": mode, "kernel": launch.kernel.__name__.strip("_"),
                             "arch": arch, **constexprs, **compile_launch(launch, arch)})
    import triton
    return {"triton": triton.__version__, "torch": torch.__version__, "dtype": str(DTYPE).removeprefix("torch."),
            "archs": {str(a): ARCHS[a] for a in archs}, "rows": rows}


def table(results: dict) -> str:
    """A short text table: a line per shape, KV mode and kernel, a column per arch (registers, spilled bytes, KiB of
    shared memory), Triton's refusals below it."""
    archs = [int(a) for a in results["archs"]]
    lines = [f"Triton {results['triton']}, {results['dtype']}; compiled without a GPU (nothing ran). Each arch: "
             "registers / spilled bytes / shared KiB per block",
             f"{'shape':13} {'kv':12} {'kernel':24}" + "".join(f" {f'sm_{a} {ARCHS[a]}':>20}" for a in archs)]
    cells: dict[tuple, dict[int, str]] = {}
    refusals = {}
    for r in results["rows"]:
        kernel = r["kernel"].removesuffix("_kernel") + (f", {r['SPLITS']} splits" if "SPLITS" in r else "")
        if r["compiled"]:
            cell = f"{r['registers']} / {r['spill_bytes']} / {r['shared_bytes'] / 1024:.1f}"
            cell += "" if r["within_limits"] else " OVER"
        else:
            cell = "refused"
            refusals.setdefault(r["error"], set()).add(f"sm_{r['arch']}")
        cells.setdefault((r["shape"], r["kv_mode"], kernel), {})[r["arch"]] = cell
    for (shape, mode, kernel), by_arch in cells.items():
        lines.append(f"{shape:13} {mode:12} {kernel:24}" + "".join(f" {by_arch.get(a, '-'):>20}" for a in archs))
    lines += [f"refused on {', '.join(sorted(where))}: {error}" for error, where in refusals.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: compile, print the table, write ``kernel_compile.json`` and ``kernel_compile.txt`` into --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for kernel_compile.json and .txt")
    parser.add_argument("--arch", default=",".join(map(str, ARCHS)),
                        help=f"compute capabilities x 10, of {', '.join(f'{a} ({n})' for a, n in ARCHS.items())} "
                             "(default: all)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--kv", default=",".join(CUDA_KV_DTYPES),
                        help=f"of the KV modes the CUDA runner stores ({', '.join(CUDA_KV_MODES)}); default: those a "
                             f"plan offers, {','.join(CUDA_KV_DTYPES)}")
    args = parser.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in ARCHS] + [s for s in args.shapes.split(",") if s not in SHAPES]
    unknown += [m for m in args.kv.split(",") if m not in CUDA_KV_MODES]
    if unknown:
        parser.error(f"unknown {', '.join(map(str, unknown))}: see --help for the choices")
    results = run(archs, {name: shape_config(name) for name in args.shapes.split(",")}, args.kv.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_compile.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results)
    (args.out / "kernel_compile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
