"""Compile every split-matmul kernel for real GPUs without one, and report what the
compiler made of each autotune config: shared memory, registers, spills, and whether the
matmul reached the tensor cores, read from the SASS.

    python -m osdp_kernels.aot --arch sm_80,sm_90 [--json FILE] [--jobs N]
        [--quick | [--dtypes fp16,...] [--configs 0,7 | 64x64x64s4w4]] [--kernels addmm_slice,...]
        [--extra-config BM,BN,BK,STAGES,WARPS] [--cuda-so PATH | --no-cuda] [--cache-dir DIR]

For the Triton kernels, every kernel x autotune config x dtype (fp32, fp16, bf16) x
architecture is compiled with `triton.compile(ASTSource(...), target=GPUTarget(...))`
to PTX and a cubin; for the CUDA kernels (csrc/cuda) the cubins inside the built
`osdp_kernels/_cuda*.so` are read. Evidence per row, never assumed:

  smem     Triton's dynamic shared memory (compiled metadata) + the cubin's static
           shared memory (`cuobjdump -res-usage`); for the CUDA kernels the static one
  regs     registers per thread (`cuobjdump -res-usage` of the cubin)
  spills   spill stores / loads in bytes (`ptxas -v`, rerun on the same PTX with
           Triton's flags; its register count must agree with the cubin's), and the
           number of local-memory instructions (STL/LDL) in the SASS
  tensor   tensor-core opcodes in the SASS (`cuobjdump -sass`): HGMMA (wgmma) or HMMA
           (mma.sync), with counts

A row fails when its shared memory exceeds the architecture's opt-in limit, when it
spills, or (fp16/bf16) when the SASS lacks the architecture's tensor-core opcode
(`_configs.ARCH_LIMITS`). Rows the launch-time filter drops (`_configs.drop_reason`)
are still compiled and reported with the reason; only configs that can really be
launched make the exit status non-zero (see [Note: one source of truth for per-arch
configs] in _configs.py). Exit status: 0 all launchable configs pass, 1 some fail, 2
bad arguments or environment.

--quick compiles, per architecture, only what a launch there autotunes over: for each
kernel one dtype (`KernelSpec.quick_dtype`) and the configs its launch filter keeps for
that dtype on that architecture (about a tenth of the full report's compiles, most of
whose time goes to configs the filter drops).

Compiled kernels and their analysis are cached under --cache-dir (default
$OSDP_AOT_CACHE, else ~/.cache/osdp/aot), never inside the repository.
This is compile-time evidence only: nothing here runs on a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import triton

from . import _common as C
from . import _configs

# The package re-exports the ops under their modules' names (osdp_kernels.slice_dx is the
# function), so the kernel modules are fetched by module path.
_addmm = importlib.import_module(".addmm_slice", __package__)
_dx = importlib.import_module(".slice_dx", __package__)
_dw = importlib.import_module(".slice_dw", __package__)
_hce = importlib.import_module(".head_ce", __package__)

ANALYSIS_VERSION = 1  # bump when the cached analysis changes shape
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAME = {v: k for k, v in DTYPES.items()}
# Representative launch: every size and stride a multiple of 16 and unit inner strides
# (row-major activations and nn.Linear weights, hidden sizes that are multiples of 64),
# the case Triton specializes for in training. The slice starts at column EX_K.
EX_M = EX_N = EX_K = 1024


# ---------------------------------------------------------------------------------------
# The kernels: the one place that lists them
# ---------------------------------------------------------------------------------------
class KernelSpec(NamedTuple):
    """One Triton kernel as `aot` compiles it: the jit function, the autotuner whose
    config list is the one checked, and a representative launch (args, flags) made by
    the op's own `_triton_args`, with every optional epilogue feature on (the variant
    with the most live registers)."""

    name: str
    jit: object
    tuner: object
    example: Callable[[torch.dtype], tuple[tuple, dict]]
    variant: str
    # the dtype --quick compiles: fp32 (the FMA loop, rule 3b) for the kernels whose fp32
    # tiles spilled in issue 35, bf16 (tensor cores, rules 2 and 3a) for the others
    quick_dtype: str


def _e(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)


def _addmm_example(dtype):
    x = _e(EX_M, 2 * EX_K, dtype=dtype)
    return _addmm._triton_args(_e(EX_M, EX_N), x[:, EX_K:], _e(EX_N, EX_K, dtype=dtype),
                               _e(EX_N, dtype=dtype), _e(EX_M, EX_N, dtype=dtype))


def _dx_example(dtype):
    dx = _e(EX_M, 2 * EX_N, dtype=dtype)
    return _dx._triton_args(dx[:, EX_N:], _e(EX_M, EX_K, dtype=dtype), _e(EX_K, EX_N, dtype=dtype))


def _dw_example(dtype):
    x = _e(EX_K, 2 * EX_N, dtype=dtype)
    return _dw._triton_args(_e(EX_M, EX_N), _e(EX_K, EX_M, dtype=dtype), x[:, EX_N:], True)


def _hce_fwd_example(dtype):
    # the slice's rows start at EX_K in the vocabulary; int64 targets, fp32 m/s/target_logit;
    # the in-place variant (n_split = 1): it holds m/s reads on top of the loop's registers
    return _hce._fwd_triton_args(_e(EX_M, EX_K, dtype=dtype), _e(EX_N, EX_K, dtype=dtype), EX_K,
                                 torch.empty(EX_M, dtype=torch.int64), _e(EX_M), _e(EX_M), _e(EX_M))


def _hce_grad_example(dtype):
    return _hce._grad_triton_args(_e(EX_M, EX_N, dtype=dtype), _e(EX_M, EX_K, dtype=dtype),
                                  _e(EX_N, EX_K, dtype=dtype), EX_K, torch.empty(EX_M, dtype=torch.int64),
                                  _e(EX_M), _e(EX_M))


KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec("addmm_slice", _addmm._addmm_slice_kernel, _addmm._addmm_slice_tuned, _addmm_example,
               "bias + fp32 accumulate + cast copy", "fp32"),
    KernelSpec("slice_dx", _dx._slice_dx_kernel, _dx._slice_dx_tuned, _dx_example, "cast into dx block", "fp32"),
    KernelSpec("slice_dw", _dw._slice_dw_kernel, _dw._slice_dw_tuned, _dw_example, "accumulate into fp32 main grad",
               "bf16"),
    KernelSpec("head_ce_fwd", _hce._head_ce_fwd_kernel, _hce._head_ce_fwd_tuned, _hce_fwd_example,
               "online log-sum-exp over the slice + target logit", "bf16"),
    KernelSpec("head_ce_grad", _hce._head_ce_grad_kernel, _hce._head_ce_grad_tuned, _hce_grad_example,
               "softmax - onehot, scaled, cast", "fp32"),
)


# ---------------------------------------------------------------------------------------
# Tools shipped with triton
# ---------------------------------------------------------------------------------------
def _tool(name: str) -> str:
    from triton import knobs

    path = getattr(knobs.nvidia, name).path
    if not path or not Path(path).exists():
        raise FileNotFoundError(f"{name} not found (expected under triton/backends/nvidia/bin, got {path!r}); "
                                "reinstall triton or set TRITON_" + name.upper() + "_PATH")
    return path


def _run(cmd, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc.stdout + proc.stderr


_RES_RE = re.compile(r"Function (?P<name>[^:]+):\s*\n\s*REG:(?P<reg>\d+) STACK:(?P<stack>\d+) SHARED:(?P<shared>\d+) "
                     r"LOCAL:(?P<local>\d+)")
_SASS_OP_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)")


def res_usage(cubin_path: str) -> dict[str, dict[str, int]]:
    """{function (mangled): {regs, stack_bytes, static_smem_bytes, local_bytes}}."""
    out = _run([_tool("cuobjdump"), "-res-usage", cubin_path])
    return {m["name"].strip(): dict(regs=int(m["reg"]), stack_bytes=int(m["stack"]),
                                    static_smem_bytes=int(m["shared"]), local_bytes=int(m["local"]))
            for m in _RES_RE.finditer(out)}


def sass_opcodes(cubin_path: str) -> dict[str, Counter]:
    """{function (mangled): Counter of SASS opcodes (base names, modifiers stripped)}."""
    out = _run([_tool("cuobjdump"), "-sass", cubin_path])
    funcs: dict[str, Counter] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = funcs.setdefault(m.group(1), Counter())
            continue
        if current is not None:
            op = _SASS_OP_RE.search(line)
            if op:
                current[op.group(1)] += 1
    return funcs


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_info(ptx: str, sm: str, options) -> dict:
    """`ptxas -v` on Triton's PTX with the flags Triton's make_cubin uses."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    arch = int(re.sub(r"\D", "", sm))
    cmd = [get_ptxas(arch).path]
    cmd += ["-lineinfo", "-suppress-debug-info"] if knobs.compilation.disable_line_info else ["-lineinfo"]
    cmd += [] if options.enable_fp_fusion else ["--fmad=false"]
    cmd += ["-v", *(options.ptx_options.split(" ") if options.ptx_options else []),
            f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}"]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        log = _run([*cmd, str(src), "-o", str(Path(d) / "k.o")])
    regs, spill = _PTXAS_REGS.search(log), _PTXAS_SPILL.search(log)
    notes = [re.sub(r"\s+in the function '[^']*'", "", ln.split(":", 1)[1].strip()) for ln in log.splitlines()
             if ("ptxas warning" in ln or "Potential Performance Loss" in ln)]
    return dict(ptxas_regs=int(regs.group(1)) if regs else None,
                stack_frame_bytes=int(spill.group(1)) if spill else None,
                spill_store_bytes=int(spill.group(2)) if spill else None,
                spill_load_bytes=int(spill.group(3)) if spill else None,
                ptxas_notes=notes)


# ---------------------------------------------------------------------------------------
# Triton: compile one (kernel, config, dtype, arch)
# ---------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    if os.environ.get("OSDP_AOT_CACHE"):
        return Path(os.environ["OSDP_AOT_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "osdp" / "aot"


@contextlib.contextmanager
def _triton_cache(cache_dir: Path):
    from triton import knobs

    old = knobs.cache.dir
    knobs.cache.dir = str(cache_dir / "triton")
    try:
        yield
    finally:
        knobs.cache.dir = old


def _specialize(spec: KernelSpec, target, args, kwargs):
    """(signature, constexprs, attrs, options) exactly as the JIT launcher derives them
    from these arguments on a GPU of `target` (its binder and _pack_args)."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(spec.jit.signature, spec.jit.params, backend)
    bound, specialization, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = spec.jit._pack_args(backend, kwargs, bound, specialization, opts)
    return signature, constexprs, attrs, options


def compile_triton(spec: KernelSpec, config, dtype: torch.dtype, arch: str, cache_dir: Path) -> dict:
    """Compile one kernel config for `arch` and return its measured facts (cached)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lim = _configs.arch_limits(arch)
    target = GPUTarget("cuda", lim.capability, 32)
    args, flags = spec.example(dtype)
    kwargs = {**flags, **config.all_kwargs()}
    signature, constexprs, attrs, options = _specialize(spec, target, args, kwargs)
    t0 = time.perf_counter()
    with _triton_cache(cache_dir):
        kernel = triton.compile(ASTSource(spec.jit, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
    compile_s = time.perf_counter() - t0
    files = {Path(p).suffix[1:]: str(p) for p in kernel.metadata_group.values()}
    where = dict(compile_s=round(compile_s, 2), cubin_path=files.get("cubin"), ptx_path=files.get("ptx"))
    cached = cache_dir / "analysis" / f"{kernel.hash}-v{ANALYSIS_VERSION}.json"
    if cached.exists():
        return {**json.loads(cached.read_text()), **where}
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = next(iter(res_usage(str(cubin)).values()))
        ops = next(iter(sass_opcodes(str(cubin)).values()))
    facts = dict(
        sm=kernel.metadata.arch, dynamic_smem_bytes=kernel.metadata.shared, **usage,
        **ptxas_info(kernel.asm["ptx"], kernel.metadata.arch, options),
        tensor_core_ops={op: ops[op] for op in _configs.TENSOR_CORE_OPCODES if ops[op]},
        local_mem_ops={op: ops[op] for op in ("STL", "LDL") if ops[op]},
        ffma=ops["FFMA"], hash=kernel.hash,
    )
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(facts))
    return {**facts, **where}


def check_triton(facts: dict, config, dtype: torch.dtype, arch: str, precision: str) -> list[str]:
    """What is wrong with a compiled config on `arch` (empty: nothing)."""
    lim = _configs.arch_limits(arch)
    problems = []
    smem = facts["dynamic_smem_bytes"] + facts["static_smem_bytes"]
    if smem > lim.max_smem_per_block_bytes:
        problems.append(f"shared memory {smem} B > {lim.max_smem_per_block_bytes} B ({lim.arch} opt-in limit)")
    estimate = _configs.smem_estimate_bytes(config, arch, dtype, precision)
    if smem > estimate:
        problems.append(f"shared memory {smem} B is above the launch filter's estimate {estimate} B: "
                        "fix _configs.smem_estimate_bytes (Triton's layout changed?)")
    if facts["spill_store_bytes"] or facts["spill_load_bytes"]:
        problems.append(f"spills {facts['spill_store_bytes']} B stores / {facts['spill_load_bytes']} B loads "
                        f"at {facts['regs']} registers; needs a smaller tile or more warps")
    elif facts["spill_store_bytes"] is None:
        problems.append("ptxas -v printed no spill line; cannot tell whether it spills")
    if facts["ptxas_regs"] is not None and facts["ptxas_regs"] != facts["regs"]:
        problems.append(f"ptxas -v rerun used {facts['ptxas_regs']} registers but the cubin has {facts['regs']}: "
                        "the rerun's flags differ from Triton's")
    if dtype != torch.float32 and not facts["tensor_core_ops"].get(lim.triton_tc_opcode):
        found = ", ".join(facts["tensor_core_ops"]) or "no tensor-core opcode"
        problems.append(f"no {lim.triton_tc_opcode} in the SASS ({found}); {DTYPE_NAME[dtype]} on {lim.arch} "
                        f"should use {lim.triton_tc_opcode}")
    return problems


def _triton_row(task) -> dict:
    kname, cfg_index, extra, dtype_name, arch, cache_dir, apply_filter = task
    spec = next(s for s in KERNELS if s.name == kname)
    config = extra if extra is not None else spec.tuner.configs[cfg_index]
    dtype = DTYPES[dtype_name]
    precision = spec.example(dtype)[1]["PRECISION"]
    pruner = spec.tuner.early_config_prune  # the kernel's own launch-time filter
    row = dict(kind="triton", kernel=kname, arch=arch, dtype=dtype_name, config=_configs.config_label(config),
               config_index=cfg_index, extra=extra is not None, variant=spec.variant, precision=precision,
               smem_estimate_bytes=_configs.smem_estimate_bytes(config, arch, dtype, precision),
               drop_reason=pruner.drop_reason(config, arch, dtype, precision))
    try:
        facts = compile_triton(spec, config, dtype, arch, Path(cache_dir))
    except Exception as e:  # a config the compiler rejects is a finding, not a crash
        row.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
                   problems=[f"does not compile: {type(e).__name__}"])
    else:
        row.update(facts, smem_bytes=facts["dynamic_smem_bytes"] + facts["static_smem_bytes"],
                   problems=check_triton(facts, config, dtype, arch, precision))
    row["status"] = "dropped" if row["drop_reason"] and apply_filter else ("FAIL" if row["problems"] else "ok")
    # a dropped config that compiled clean: the filter's rule is conservative there
    row["dropped_but_clean"] = bool(row["drop_reason"]) and not row["problems"]
    return row


# ---------------------------------------------------------------------------------------
# CUDA kernels: the cubins inside osdp_kernels/_cuda*.so
# ---------------------------------------------------------------------------------------
STATIC_SMEM_LIMIT = 48 * 1024  # static __shared__ per block, every architecture


def find_cuda_so() -> Path | None:
    """Where the build put the module: CMake writes it next to the package sources
    (OSDP_KERNELS_OUTPUT_DIR = osdp_kernels/ for editable installs, see setup.py)."""
    hits = sorted(Path(__file__).resolve().parent.glob("_cuda*.so"))
    return hits[0] if hits else None


def _demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def _short_cuda_name(demangled: str) -> str:
    """'void osdp::(anonymous namespace)::gemm_kernel<__half, true, false>(osdp::GemmParams)'
    -> 'gemm_kernel<__half, true, false>' (template flags: A_KMAJOR, B_KMAJOR)."""
    name = demangled.removeprefix("void ").replace("osdp::(anonymous namespace)::", "")
    return re.sub(r"\(osdp::GemmParams\)$", "", name)


def _cuda_dtype(name: str) -> str:
    # the template's first argument: gemm_kernel<__half, ...> / I6__half (mangled)
    for key, dt in (("bfloat16", "bf16"), ("half", "fp16"), ("<float", "fp32"), ("If", "fp32")):
        if key in name:
            return dt
    return "?"


def cuda_rows(so_path: Path, archs) -> list[dict]:
    cuobjdump = _tool("cuobjdump")
    listing = _run([cuobjdump, "--list-elf", str(so_path)])
    rows = []
    with tempfile.TemporaryDirectory() as d:
        _run([cuobjdump, "-xelf", "all", str(so_path)], cwd=d)
        cubins = {}  # "sm_90" -> extracted file (names like split_matmul.sm_90.cubin)
        for path in sorted(Path(d).glob("*.cubin")):
            m = re.search(r"sm_(\d+)", path.name)
            if m:
                cubins.setdefault(f"sm_{m.group(1)}", path)
        for arch in archs:
            lim = _configs.arch_limits(arch)
            if arch not in cubins:
                present = " ".join(re.findall(r"sm_\d+\w*", listing)) or "none"
                rows.append(dict(kind="cuda", arch=arch, kernel="(none)", status="FAIL", problems=[
                    f"{so_path.name} has no {arch} cubin (cuobjdump --list-elf: {present}); rebuild with "
                    f"CMAKE_CUDA_ARCHITECTURES including {arch[3:]}"]))
                continue
            usage, ops = res_usage(str(cubins[arch])), sass_opcodes(str(cubins[arch]))
            names = _demangle(sorted(usage))
            for mangled in sorted(usage, key=lambda n: names[n]):
                u, op = usage[mangled], ops.get(mangled, Counter())
                dtype = _cuda_dtype(names[mangled])
                tc = {o: op[o] for o in _configs.TENSOR_CORE_OPCODES if op[o]}
                local = {o: op[o] for o in ("STL", "LDL") if op[o]}
                problems = []
                if u["static_smem_bytes"] > min(STATIC_SMEM_LIMIT, lim.max_smem_per_block_bytes):
                    problems.append(f"static shared memory {u['static_smem_bytes']} B > {STATIC_SMEM_LIMIT} B")
                if u["stack_bytes"] or local:
                    problems.append(f"stack frame {u['stack_bytes']} B, local-memory ops {local or 0}: "
                                    "spills or local arrays")
                if dtype in ("fp16", "bf16") and not tc:
                    problems.append(f"no tensor-core opcode (HMMA/HGMMA) in the SASS for {dtype}")
                rows.append(dict(kind="cuda", arch=arch, kernel=_short_cuda_name(names[mangled]),
                                 mangled=mangled, dtype=dtype,
                                 **u, tensor_core_ops=tc, local_mem_ops=local, ffma=op["FFMA"],
                                 smem_bytes=u["static_smem_bytes"], problems=problems,
                                 status="FAIL" if problems else "ok"))
    return rows


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
def _kib(b):
    return f"{b / 1024:.0f}K" if b is not None else "-"


def _ops(d):
    return ",".join(f"{k}:{v}" for k, v in d.items()) or "-"


def _rule(reason: str) -> str:
    """Short name of a `drop_reason` (rule 1/2/3 of the Note in _configs.py)."""
    return "smem" if reason.startswith("shared memory") else "warps" if "warp-group" in reason else "regs"


def _measured(problems: list[str]) -> str:
    """Short names of what the compiled config showed wrong."""
    short = []
    for p in problems:
        short.append("smem>limit" if " > " in p and p.startswith("shared memory") else
                     "est<smem" if "estimate" in p else "spills" if p.startswith("spills") else
                     "no " + p.split()[1] if p.startswith("no ") else p.split(":")[0])
    return ",".join(short) or "clean"


def format_triton_table(rows, arch) -> str:
    """One line per compiled config; reasons in full for failing rows, in the footer for
    dropped ones."""
    lim = _configs.arch_limits(arch)
    head = (f"Triton kernels, {arch} ({lim.example_gpu}; smem limit {lim.max_smem_per_block_bytes // 1024} KiB, "
            f"16-bit matmul must use {lim.triton_tc_opcode})")
    cols = (f"{'kernel':<12} {'dtype':<5} {'config':<17} {'smem':>5} {'est':>5} {'regs':>4} {'spill st/ld':>11} "
            f"{'STL/LDL':>7} {'tensor cores':<13} {'launch':<13} compiled")
    lines = [head, cols, "-" * (len(cols) + 6)]
    rules, notes = {}, {}
    for r in rows:
        launch = "FAIL" if r["status"] == "FAIL" else ("dropped:" + _rule(r["drop_reason"])) if r["drop_reason"] else "kept"
        if r["drop_reason"]:
            rules.setdefault(_rule(r["drop_reason"]), r["drop_reason"])
        label = r["config"] + ("*" if r["extra"] else "")
        if r.get("error"):
            lines.append(f"{r['kernel']:<12} {r['dtype']:<5} {label:<17} {'':>5} {_kib(r['smem_estimate_bytes']):>5} "
                         f"compile error: {r['error']}  {launch}")
            continue
        spill = f"{r['spill_store_bytes']}/{r['spill_load_bytes']}"
        local = f"{r['local_mem_ops'].get('STL', 0)}/{r['local_mem_ops'].get('LDL', 0)}"
        lines.append(f"{r['kernel']:<12} {r['dtype']:<5} {label:<17} {_kib(r['smem_bytes']):>5} "
                     f"{_kib(r['smem_estimate_bytes']):>5} {r['regs']:>4} {spill:>11} {local:>7} "
                     f"{_ops(r['tensor_core_ops']):<13} {launch:<13} {_measured(r['problems'])}"
                     + (" [ptxas note]" if r["ptxas_notes"] else ""))
        for n in r["ptxas_notes"]:
            notes.setdefault(n, []).append(f"{r['kernel']} {r['dtype']} {r['config']}")
        if r["status"] == "FAIL":
            lines += [f"{'':<12}   x {p}" for p in r["problems"]]
    lines.append("smem: compiled dynamic + static shared memory; est: the launch filter's estimate; "
                 "* = --extra-config (not in the autotune list)")
    for key, example in rules.items():
        lines.append(f"dropped:{key} e.g. {example}")
    for note, where in notes.items():
        lines.append(f"[ptxas note] {note} ({'; '.join(where)})")
    return "\n".join(lines)


def format_cuda_table(rows, arch, so_path) -> str:
    lim = _configs.arch_limits(arch)
    head = f"CUDA kernels ({so_path.name}), {arch} cubin ({lim.example_gpu})"
    cols = f"{'kernel':<46} {'dtype':<5} {'smem':>5} {'regs':>4} {'stack':>5} {'STL/LDL':>7} {'tensor cores':<12} status"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        if r["kernel"] == "(none)":
            lines.append(f"(no cubin) FAIL: {r['problems'][0]}")
            continue
        local = f"{r['local_mem_ops'].get('STL', 0)}/{r['local_mem_ops'].get('LDL', 0)}"
        lines.append(f"{r['kernel']:<46} {r['dtype']:<5} {_kib(r['smem_bytes']):>5} {r['regs']:>4} "
                     f"{r['stack_bytes']:>5} {local:>7} {_ops(r['tensor_core_ops']):<12} {r['status']}")
        lines += [f"{'':<46}   x {p}" for p in r["problems"]]
    return "\n".join(lines)


def parse_extra_config(text: str) -> triton.Config:
    try:
        bm, bn, bk, stages, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--extra-config wants BM,BN,BK,STAGES,WARPS (e.g. 256,256,128,3,4), "
                                         f"got {text!r}") from None
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_stages=stages, num_warps=warps)


def _select_configs(spec: KernelSpec, wanted: list[str] | None) -> list[int]:
    configs = spec.tuner.configs
    if not wanted:
        return list(range(len(configs)))
    if wanted == ["none"]:  # only --extra-config
        return []
    labels = [_configs.config_label(c).replace(" ", "") for c in configs]
    picked = []
    for w in wanted:
        if w.isdigit() and int(w) < len(configs):
            picked.append(int(w))
        elif w.replace(" ", "") in labels:
            picked.append(labels.index(w.replace(" ", "")))
        else:
            raise ValueError(f"--configs: {w!r} is neither an index < {len(configs)} nor one of {labels}")
    return picked


def _kept_on(spec: KernelSpec, arch: str, dtype_name: str) -> list[int]:
    """Indices of the configs the kernel's launch filter keeps on `arch` (--quick)."""
    dtype = DTYPES[dtype_name]
    configs = spec.tuner.configs
    kept = spec.tuner.early_config_prune.kept(configs, arch, dtype, spec.example(dtype)[1]["PRECISION"])
    return [i for i, c in enumerate(configs) if any(c is k for k in kept)]


def _tasks(archs, specs, dtype_names, configs, extra_configs, quick, cache_dir, apply_filter) -> list[tuple]:
    """One (kernel, config index | -1, extra config, dtype, arch, ...) per compile, grouped
    by arch, kernel, config (the table's order)."""
    def picked(spec, arch):  # [(config index, dtype)]
        if quick:
            return [(i, spec.quick_dtype) for i in _kept_on(spec, arch, spec.quick_dtype)]
        return [(i, d) for i in _select_configs(spec, configs) for d in dtype_names]

    common = (str(cache_dir), apply_filter)
    tasks = [(s.name, i, None, d, a, *common) for a in archs for s in specs for i, d in picked(s, a)]
    return tasks + [(s.name, -1, c, d, a, *common) for a in archs for s in specs for c in extra_configs
                    for d in ([s.quick_dtype] if quick else dtype_names)]


def run(archs=("sm_80", "sm_90"), kernels=None, dtypes=None, configs=None, extra_configs=(),
        cuda_so: Path | None | str = "auto", cache_dir: Path | None = None, jobs: int = 1,
        apply_filter: bool = True, quick: bool = False, log=print) -> dict:
    """Compile and check; returns the report (what --json writes). With
    apply_filter=False every config counts as launched (judge a list before filtering);
    with quick=True only what the launch filter keeps, in each kernel's quick_dtype."""
    if C.INTERPRET:
        raise RuntimeError("osdp_kernels was imported with TRITON_INTERPRET=1, so its kernels are interpreter "
                           "functions that cannot be compiled; run `python -m osdp_kernels.aot` with "
                           "TRITON_INTERPRET unset")
    archs = [_configs.arch_limits(a).arch for a in archs]
    specs = [s for s in KERNELS if not kernels or s.name in kernels]
    if kernels and len(specs) != len(set(kernels)):
        raise ValueError(f"unknown kernel in {kernels}; known: {[s.name for s in KERNELS]}")
    dtype_names = list(dtypes or DTYPES)
    if any(d not in DTYPES for d in dtype_names):
        raise ValueError(f"unknown dtype in {dtype_names}; known: {list(DTYPES)}")
    if quick and (dtypes or configs):
        raise ValueError("--quick picks the dtype and configs itself; leave out --dtypes and --configs")
    cache_dir = Path(cache_dir or default_cache_dir())
    tasks = _tasks(archs, specs, dtype_names, configs, extra_configs, quick, cache_dir, apply_filter)
    t0, cpu0 = time.perf_counter(), time.process_time()
    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            rows = list(pool.map(_triton_row, tasks))
    else:
        rows = [_triton_row(t) for t in tasks]
    triton_s = time.perf_counter() - t0
    report = dict(triton_version=triton.__version__, torch_version=torch.__version__, archs=archs,
                  launch_filter_applied=apply_filter, quick=quick,
                  limits={a: _configs.arch_limits(a)._asdict() for a in archs},
                  representative_shape=dict(M=EX_M, N=EX_N, K=EX_K), triton=rows, cuda=[], cuda_so=None,
                  triton_compile_s=round(triton_s, 1), compiles=len(rows),
                  process_cpu_s=round(time.process_time() - cpu0, 1))
    for a in archs:
        log(format_triton_table([r for r in rows if r["arch"] == a], a))
        log("")
    so = find_cuda_so() if cuda_so == "auto" else (Path(cuda_so) if cuda_so else None)
    if so is not None and so.exists():
        report["cuda_so"] = str(so)
        report["cuda"] = cuda_rows(so, archs)
        sources = sorted((Path(__file__).resolve().parents[1] / "csrc" / "cuda").glob("*"))
        newer = [p.name for p in sources if p.stat().st_mtime > so.stat().st_mtime]
        report["cuda_so_older_than"] = newer
        if newer:
            log(f"warning: {so.name} is older than {', '.join(newer)}: the CUDA rows describe the last build, "
                "not the sources (rebuild with `OSDP_SKIP_CUDA=0 pip install -e .`)")
        for a in archs:
            log(format_cuda_table([r for r in report["cuda"] if r["arch"] == a], a, so))
            log("")
    elif cuda_so is not None:
        log(f"CUDA kernels: no built module ({'osdp_kernels/_cuda*.so' if cuda_so == 'auto' else cuda_so} not found); "
            "build it with `OSDP_SKIP_CUDA=0 pip install -e .` on a machine with nvcc")
        if cuda_so != "auto":
            report["cuda"] = [dict(kind="cuda", arch="-", kernel="(none)", status="FAIL",
                                   problems=[f"{cuda_so} not found"])]
    failing = [r for r in rows + report["cuda"] if r["status"] == "FAIL"]
    dropped = [r for r in rows if r["status"] == "dropped"]
    report.update(failures=len(failing), dropped=len(dropped), exit_status=1 if failing else 0)
    for r in failing:
        log(f"FAIL     {r['arch']} {r['kernel']} {r.get('dtype', '')} {r.get('config', '')}: {'; '.join(r['problems'])}")
    log(f"{'--quick (kept configs, one dtype per kernel): ' if quick else ''}"
        f"{len(rows)} Triton compiles in {triton_s:.0f} s ({report['process_cpu_s']:.0f} s CPU in this process), "
        f"{sum(r['kernel'] != '(none)' for r in report['cuda'])} CUDA kernels; {len(dropped)} dropped at launch, {len(failing)} failing "
        f"(compile-time evidence only, nothing ran on a GPU)")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m osdp_kernels.aot", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_80,sm_90", help="comma-separated, known: " + ",".join(_configs.ARCH_LIMITS))
    p.add_argument("--kernels", help="comma-separated subset of " + ",".join(s.name for s in KERNELS))
    p.add_argument("--dtypes", help="comma-separated subset of " + ",".join(DTYPES))
    p.add_argument("--configs", help="comma-separated config indices or labels like 64x64x64s4w4 (default all; "
                   "'none': only --extra-config)")
    p.add_argument("--quick", action="store_true",
                   help="per arch, only the configs the launch filter keeps, one dtype per kernel")
    p.add_argument("--extra-config", action="append", type=parse_extra_config, default=[],
                   metavar="BM,BN,BK,STAGES,WARPS", help="also check this config (not in any autotune list)")
    p.add_argument("--cuda-so", help="the built CUDA module (default: osdp_kernels/_cuda*.so if present)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels")
    p.add_argument("--cache-dir", type=Path, help="default $OSDP_AOT_CACHE or ~/.cache/osdp/aot")
    p.add_argument("--jobs", type=int, default=1, help="parallel compile processes (default 1)")
    p.add_argument("--no-filter", action="store_true",
                   help="judge every config as if launched (the launch filter's drops then fail too)")
    p.add_argument("--json", type=Path, help="write the machine-readable report here")
    a = p.parse_args(argv)
    split = lambda s: [v for v in s.split(",") if v] if s else None  # noqa: E731
    try:
        report = run(archs=split(a.arch), kernels=split(a.kernels), dtypes=split(a.dtypes),
                     configs=split(a.configs), extra_configs=a.extra_config,
                     cuda_so=None if a.no_cuda else (a.cuda_so or "auto"), cache_dir=a.cache_dir, jobs=a.jobs,
                     apply_filter=not a.no_filter, quick=a.quick)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"osdp_kernels.aot: {e}", file=sys.stderr)
        return 2
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {a.json}")
    return report["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
