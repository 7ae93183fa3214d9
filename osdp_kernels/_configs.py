"""Which Triton tile configs a split-matmul kernel may run on which GPU: the autotune
list, the per-architecture limits, and the filter that drops what cannot run well there.

[Note: one source of truth for per-arch configs]
`ARCH_LIMITS` holds the per-architecture facts (opt-in shared memory per block, whether
the tensor cores are driven by 4-warp groups, the tensor-core opcode a 16-bit matmul must
reach). Two readers use them and nothing else:
  - at launch, each kernel's autotuner prunes its list with its `ArchPruner`, which asks
    `drop_reason(config, arch, dtype, epilogue_tiles)` before anything is compiled;
  - `python -m osdp_kernels.aot` compiles every config for every architecture without a
    GPU, measures the real shared memory, registers, spills and SASS, prints the same
    `drop_reason` beside the measurement (read from the kernel's own pruner), and fails
    when a config the filter keeps does not fit, spills or misses the tensor cores, or
    when the compiled shared memory is above the estimate the filter used.
The rules are predictions from the config alone; the report is what checks them against
the compiler. The shared-memory model is exact for Triton 3.6 (all 240 compiles of the
report); the register budgets are calibrated on the same report (below). A Triton
upgrade that breaks either shows up as a failing report, not as a slow or failing
launch on a GPU.

Rules (`drop_reason`):
  1. shared memory: pipeline buffers x (A tile + B tile) + Triton's static shared memory
     must fit the opt-in limit. Triton keeps `num_stages` buffers for warp-group MMA
     (wgmma) loops and `num_stages - 1` for mma.sync / FMA loops.
  2. warp groups: where the tensor cores are driven by 4-warp groups (sm_90 wgmma),
     num_warps must be a multiple of 4; a 16-bit tile with fewer warps falls back to
     mma.sync (HMMA), which does not reach Hopper's full tensor-core rate.
  3. registers, as budgets of fp32 values per thread. Every budget is for a thread that
     may hold 255 registers and shrinks in proportion when the block's threads share the
     register file more thinly (`thread_reg_limit`: above 8 warps, 65536 / threads).
     a. epilogue: the accumulators plus every output-shaped fp32 tile the epilogue reads
        back (`epilogue_tiles`: the addmm accumulator, slice_dw's main grad, head_ce's
        exp tile) within EPILOGUE_REG_BUDGET.
     b. fp32 operands (no tensor cores: an FMA loop whose operand fragments are
        registers too): at most FMA_ACC_REG_BUDGET accumulators, and at most
        FMA_STEP_BUDGET FMAs per K-step (accumulators x BLOCK_K: ptxas unrolls the step
        and hoists its shared-memory operand loads, so the fragments held grow with it).
  Calibration (`aot`: Triton 3.6 with its ptxas 12.8, fp32 with TF32 off; the shipped
  list and extra tiles, bench/results/aot_*sm80_sm90.txt). In an FMA loop with 64 fp32
  accumulators head_ce_fwd spills on both archs; the other kernels' 4-warp tiles use
  215-255 of the 255 registers (addmm_slice, slice_dw, head_ce_grad: 240-255), slice_dx
  spills at 2 warps on sm_90, and every kernel spills at BLOCK_K=128; the toolchain issue 35 ran spilled 13 such
  configs of addmm_slice, slice_dx and head_ce_grad at 255. With 32 and BLOCK_K <= 64
  every kernel compiles clean on both archs (head_ce_fwd at 254); at BLOCK_K=128
  head_ce_fwd and slice_dw spill, and so does head_ce_fwd at 16 warps (128 registers a
  thread). In 16-bit no config within the epilogue budget spills, and most of those
  beyond it do. The rules drop some configs that compiled clean here (the report's
  `dropped:regs ... clean` rows): that is the margin for another ptxas; none they keep
  may spill (the report fails otherwise).
fp32 is compiled by the report as torch runs it by default (TF32 off: PRECISION "ieee",
see _common.dot_precision); with TF32 on, rule 1 counts wgmma buffering and rule 3b
still applies, both the larger estimates, and the report does not cover that variant.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch
import triton


class ArchLimits(NamedTuple):
    """Facts about one GPU architecture that decide whether a tile config runs well."""

    arch: str                      # "sm_90"
    capability: int                # 90
    example_gpu: str               # where the hardware numbers come from
    max_smem_per_block_bytes: int  # opt-in maximum per block, static + dynamic
    warp_group_mma: bool           # tensor cores driven by 4-warp groups (wgmma)
    # SASS opcode a 16-bit Triton matmul must lower to: HMMA (mma.sync) on Ampere,
    # HGMMA (wgmma) on Hopper, where mma.sync does not reach the full tensor-core rate
    triton_tc_opcode: str
    # static shared memory in Triton's cubins beside the pipeline buffers (mbarriers),
    # read from the cubins by `aot` (Triton 3.6)
    triton_static_smem_bytes: int
    # 32-bit registers one block may hold (cudaDevAttrMaxRegistersPerBlock); a thread
    # holds at most 255 of them, fewer when the block has more than 256 threads
    max_regs_per_block: int


ARCH_LIMITS: dict[str, ArchLimits] = {
    # cudaDevAttrMaxSharedMemoryPerBlockOptin: A100 163 KiB, H100 227 KiB;
    # cudaDevAttrMaxRegistersPerBlock: 64 Ki on both
    "sm_80": ArchLimits("sm_80", 80, "A100", 163 * 1024, False, "HMMA", 0, 65536),
    "sm_90": ArchLimits("sm_90", 90, "H100", 227 * 1024, True, "HGMMA", 1024, 65536),
}
# Any of these SASS opcodes means the tensor cores did the matmul (wgmma, mma.sync).
TENSOR_CORE_OPCODES = ("HGMMA", "HMMA")
MAX_REGS_PER_THREAD = 255  # the ISA's limit; rule 3's budgets are for a thread that may use all of it
EPILOGUE_REG_BUDGET = 128  # fp32 values per thread: accumulators + tiles read back
FMA_ACC_REG_BUDGET = 32    # fp32 accumulators per thread when the loop is FMA (fp32 operands)
FMA_STEP_BUDGET = 2048     # FMAs per thread per K-step of an FMA loop (accumulators x BLOCK_K)


def arch_limits(arch: str | int) -> ArchLimits:
    """`ArchLimits` for "sm_80" / "sm80" / 80; raises naming the known architectures."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)", str(arch))
    key = f"sm_{m.group(1)}" if m else str(arch)
    if key not in ARCH_LIMITS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCH_LIMITS)} "
                         "(add its limits to osdp_kernels/_configs.py:ARCH_LIMITS)")
    return ARCH_LIMITS[key]


def autotune_configs() -> list[triton.Config]:
    """Portable (Ampere/Hopper) GEMM tiles. Each kernel prunes the list per architecture
    and dtype at launch (`ArchPruner`); `python -m osdp_kernels.aot` checks every entry."""
    tiles = [  # BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8),
        (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4), (64, 64, 32, 5, 2),
    ]
    return [
        triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in tiles
    ]


def config_label(config: triton.Config) -> str:
    k = config.kwargs
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{config.num_stages} w{config.num_warps}"


def smem_estimate_bytes(config: triton.Config, arch: str | int, dtype: torch.dtype,
                        precision: str | None = None) -> int:
    """Shared memory (dynamic + static) Triton gives this config on `arch` (rule 1).
    `precision` is the kernel's PRECISION flag; fp32 with "tf32" (or unknown, None) may
    take the tensor-core path, so it is counted with the larger wgmma buffering."""
    lim = arch_limits(arch)
    k = config.kwargs
    per_stage = (k["BLOCK_M"] * k["BLOCK_K"] + k["BLOCK_K"] * k["BLOCK_N"]) * dtype.itemsize
    tensor_cores = dtype != torch.float32 or precision != "ieee"
    wgmma = lim.warp_group_mma and config.num_warps % 4 == 0 and tensor_cores
    buffers = config.num_stages if wgmma else config.num_stages - 1
    return buffers * per_stage + lim.triton_static_smem_bytes


def acc_regs_per_thread(config: triton.Config) -> int:
    k = config.kwargs
    return k["BLOCK_M"] * k["BLOCK_N"] // (32 * config.num_warps)


def thread_reg_limit(config: triton.Config, arch: str | int) -> int:
    """Registers one thread of this config may hold: 255, or the block's share of the
    register file when that is less (ptxas caps the kernel there: .maxntid)."""
    return min(MAX_REGS_PER_THREAD, arch_limits(arch).max_regs_per_block // (32 * config.num_warps))


def _register_drop(config: triton.Config, arch: str, dtype: torch.dtype, epilogue_tiles: int) -> str | None:
    """Rule 3 of the Note: the budgets, scaled to the thread's register limit."""
    limit = thread_reg_limit(config, arch)
    scaled = lambda budget: budget * limit // MAX_REGS_PER_THREAD  # noqa: E731
    thin = f" (a thread of {config.num_warps} warps holds {limit} registers)" if limit < MAX_REGS_PER_THREAD else ""
    acc = acc_regs_per_thread(config)
    live = acc * (1 + epilogue_tiles)
    if live > scaled(EPILOGUE_REG_BUDGET):
        read_back = f" + {epilogue_tiles * acc} read back in the epilogue" if epilogue_tiles else ""
        return (f"{acc} fp32 accumulators per thread{read_back} = {live} registers > "
                f"{scaled(EPILOGUE_REG_BUDGET)}{thin}: spills")
    if dtype != torch.float32:
        return None
    if acc > scaled(FMA_ACC_REG_BUDGET):
        return f"{acc} fp32 accumulators per thread in an FMA loop > {scaled(FMA_ACC_REG_BUDGET)}{thin}: spills"
    step = acc * config.kwargs["BLOCK_K"]
    if step > FMA_STEP_BUDGET:
        return (f"{acc} fp32 accumulators x BLOCK_K {config.kwargs['BLOCK_K']} = {step} FMAs per K-step in an "
                f"FMA loop > {FMA_STEP_BUDGET}: spills")
    return None


def drop_reason(config: triton.Config, arch: str | int, dtype: torch.dtype, epilogue_tiles: int = 0,
                precision: str | None = None) -> str | None:
    """Why `config` must not run on `arch` for `dtype` operands (rules in the Note), or
    None if it may. `epilogue_tiles`: output-shaped fp32 tiles the kernel's epilogue
    reads back while the accumulators are live; `precision`: the PRECISION flag."""
    lim = arch_limits(arch)
    smem = smem_estimate_bytes(config, lim.arch, dtype, precision)
    if smem > lim.max_smem_per_block_bytes:
        return (f"shared memory {smem} B exceeds {lim.arch}'s {lim.max_smem_per_block_bytes} B per block "
                f"({lim.example_gpu})")
    if lim.warp_group_mma and config.num_warps % 4:
        return (f"{config.num_warps} warps, not a multiple of 4: {lim.arch} runs warp-group MMA (wgmma); "
                "16-bit tiles would fall back to mma.sync")
    return _register_drop(config, lim.arch, dtype, epilogue_tiles)


def configs_for(configs, arch: str | int, dtype: torch.dtype, epilogue_tiles: int = 0,
                precision: str | None = None):
    """(kept, dropped) where dropped is [(config, reason)]. Never keeps nothing: if every
    config is dropped the one with the least shared memory is kept (the autotuner needs
    one, and the compiler's own resource check then says what is wrong)."""
    kept, dropped = [], []
    for c in configs:
        reason = drop_reason(c, arch, dtype, epilogue_tiles, precision)
        (dropped.append((c, reason)) if reason else kept.append(c))
    if not kept and configs:
        least = min(configs, key=lambda c: smem_estimate_bytes(c, arch, dtype, precision))
        kept, dropped = [least], [(c, r) for c, r in dropped if c is not least]
    return kept, dropped


class ArchPruner:
    """`early_config_prune` for `triton.autotune`: keeps the configs that may run on the
    GPU holding the tensor argument `operand_arg` (whose dtype is the tiles' dtype), for
    the launch's PRECISION flag. Architectures without an `ARCH_LIMITS` entry keep the
    whole list (Triton's own out-of-resources check still skips what does not fit)."""

    def __init__(self, operand_arg: str, epilogue_tiles: int):
        self.operand_arg = operand_arg
        self.epilogue_tiles = epilogue_tiles

    def drop_reason(self, config, arch, dtype, precision: str | None = None) -> str | None:
        return drop_reason(config, arch, dtype, self.epilogue_tiles, precision)

    def kept(self, configs, arch, dtype, precision: str | None = None) -> list:
        """What a launch on `arch` autotunes over (never empty, see `configs_for`)."""
        return configs_for(configs, arch, dtype, self.epilogue_tiles, precision)[0]

    def __call__(self, configs, named_args, **kwargs):
        t = named_args[self.operand_arg]
        major, minor = torch.cuda.get_device_capability(t.device)
        arch = f"sm_{major}{minor}"
        if arch not in ARCH_LIMITS:
            return configs
        return self.kept(configs, arch, t.dtype, kwargs.get("PRECISION"))
