"""Split-matmul microbenchmark: forward, dX and dW of one Linear(H, H) split into g
input slices, for
  cublas  the unsplit op (F.linear / torch.mm, cuBLAS): the roofline reference
  torch   slices with cuBLAS, summed out of place (fp32 partial sums, separate adds,
          torch.cat for dX, a separate add into the fp32 main grad for dW)
  triton  osdp_kernels, backend="triton" (fused accumulate / bias-free / cast)
  cuda    osdp_kernels, backend="cuda" (csrc/cuda WMMA kernels), when built
in bf16. Reports the median time over repeats (CUDA events), TFLOP/s, the ratio to
cuBLAS measured in the same run, and the extra peak memory of each variant
(torch.cuda.max_memory_allocated above what was allocated before the call).

    python bench/kernels.py             # full grid (sized for one ~10 min GPU call)
    python bench/kernels.py --quick     # a few shapes
    python bench/kernels.py --dry-run   # tiny shapes on CPU (torch reference and the
                                        # Triton interpreter): proves the script runs
Writes bench/results/kernels_<device>.csv (rows flushed as they come, so a run cut
short keeps what it measured) and, if matplotlib imports, kernels_<device>.png.

    python bench/kernels.py --head-ce   # the LM head + cross-entropy, forward + backward:
                                        # fused (osdp.ops.split_head_cross_entropy: Triton
                                        # on CUDA, the torch path on CPU) vs unfused
                                        # (x @ W.T, F.cross_entropy); runs on CPU too
Writes bench/results/head_ce_<device>.csv: median step time and the peak bytes of live
tensors above the inputs (CUDA: max_memory_allocated; CPU: osdp.memtrack.LiveBytesTracker),
beside the bytes the [tokens, vocab] logits would take.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no GPU needed")
    p.add_argument("--hidden", type=int, nargs="*", help="hidden sizes (default 1024 4096 8192 12288)")
    p.add_argument("--tokens", type=int, nargs="*", help="token counts (default 2048 8192 16384)")
    p.add_argument("--groups", type=int, nargs="*", help="split granularities (default 1 2 4 8 16)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new shapes after this")
    p.add_argument("--out-dir", type=Path, default=None, help="default bench/results (dry run: a temp dir)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--head-ce", action="store_true", help="benchmark the fused LM head + cross-entropy instead")
    p.add_argument("--vocab", type=int, nargs="*", help="--head-ce vocabulary sizes")
    p.add_argument("--slices", type=int, nargs="*", help="--head-ce vocabulary slices (default 1 4)")
    return p.parse_args()


args = parse_args()
import torch  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
if args.dry_run and not HAVE_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import
elif not HAVE_CUDA and not args.head_ce:
    print("bench/kernels.py: no CUDA device here, nothing to measure "
          "(use --dry-run to check the script on CPU).")
    sys.exit(0)

import torch.nn.functional as F  # noqa: E402

import osdp_kernels as K  # noqa: E402

DEVICE = "cuda" if HAVE_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAVE_CUDA else torch.float32  # CPU bf16 GEMMs are just slow


def grid():
    if args.dry_run:
        shapes = dict(hidden=[128], tokens=[64], groups=[1, 4])
    elif args.quick:
        shapes = dict(hidden=[4096], tokens=[8192], groups=[1, 4, 16])
    else:
        shapes = dict(hidden=[1024, 4096, 8192, 12288], tokens=[2048, 8192, 16384], groups=[1, 2, 4, 8, 16])
    for key in shapes:
        if getattr(args, key):
            shapes[key] = getattr(args, key)
    return [(h, t, g) for h in shapes["hidden"] for t in shapes["tokens"] for g in shapes["groups"] if h % g == 0]


def sync():
    if HAVE_CUDA:
        torch.cuda.synchronize()


def median_ms(fn) -> float:
    for _ in range(args.warmup):
        fn()
    sync()
    times = []
    for _ in range(1 if args.dry_run else args.repeats):
        if HAVE_CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def extra_peak_mib(fn) -> float:
    """Peak bytes allocated during one call above what was allocated before it."""
    if not HAVE_CUDA:
        return float("nan")
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def variants(H, T, g, backends):
    """{pass: {method: fn}} for one shape; every fn does the whole pass (all g slices)."""
    ks = H // g
    x, dy = torch.randn(T, H, device=DEVICE, dtype=DTYPE), torch.randn(T, H, device=DEVICE, dtype=DTYPE)
    W = torch.randn(H, H, device=DEVICE, dtype=DTYPE) / H**0.5
    Ws = [W[:, i * ks:(i + 1) * ks].contiguous() for i in range(g)]  # gathered slices
    main = [torch.zeros(H, ks, device=DEVICE) for _ in range(g)]  # fp32 main grads
    cols = [slice(i * ks, (i + 1) * ks) for i in range(g)]

    def torch_fwd():
        acc = F.linear(x[:, cols[0]], Ws[0]).float()
        for i in range(1, g):
            acc = acc + F.linear(x[:, cols[i]], Ws[i]).float()
        return acc.to(DTYPE)

    def torch_dw():
        for i in range(g):
            main[i].add_(dy.t() @ x[:, cols[i]])

    def kern_fwd(backend):
        def run():
            out = torch.zeros(T, H, device=DEVICE)
            y = None
            for i in range(g):
                y = K.addmm_slice_(out, x, Ws[i], i * ks, cast_to=DTYPE if i == g - 1 else None, backend=backend)
            return y
        return run

    def kern_dx(backend):
        def run():
            dx = torch.empty(T, H, device=DEVICE, dtype=DTYPE)
            for i in range(g):
                K.slice_dx(dy, Ws[i], dx, i * ks, backend=backend)
            return dx
        return run

    def kern_dw(backend):
        def run():
            for i in range(g):
                K.slice_dw(dy, x, i * ks, ks, out=main[i], accumulate=True, backend=backend)
        return run

    out = {
        "fwd": {"cublas": lambda: F.linear(x, W), "torch": torch_fwd},
        "dx": {"cublas": lambda: dy @ W, "torch": lambda: torch.cat([dy @ Ws[i] for i in range(g)], dim=1)},
        "dw": {"cublas": lambda: dy.t() @ x, "torch": torch_dw},
    }
    for b in backends:
        out["fwd"][b], out["dx"][b], out["dw"][b] = kern_fwd(b), kern_dx(b), kern_dw(b)
    return out


def head_ce_grid():
    """[(tokens, hidden, vocab), ...] and the slice counts of the --head-ce run."""
    if args.dry_run:
        shapes = dict(tokens=[64], hidden=[32], vocab=[500], slices=[1, 2])
    elif HAVE_CUDA:
        shapes = dict(tokens=[8192], hidden=[4096], vocab=[50304, 128256], slices=[1, 4])
    else:  # sized for two shared CPU cores: about a second per step
        shapes = dict(tokens=[1024], hidden=[256], vocab=[32768], slices=[1, 4])
    for key in ("tokens", "hidden", "vocab", "slices"):
        if getattr(args, key, None):
            shapes[key] = getattr(args, key)
    return [(t, h, v) for t in shapes["tokens"] for h in shapes["hidden"] for v in shapes["vocab"]], shapes["slices"]


def interleaved_median_ms(fns: dict) -> dict:
    """Median ms of each fn, the repeats taken round-robin so that load changing on a
    shared machine hits every method alike."""
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(1 if args.dry_run else args.repeats):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def head_ce_peak_bytes(fn, inputs) -> int:
    """Peak bytes of live tensors during one call, above what `inputs` hold."""
    if HAVE_CUDA:
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated() - base
    from osdp.memtrack import LiveBytesTracker

    with LiveBytesTracker(initial=inputs) as tracker:
        base = tracker.current_bytes
        fn()
    return tracker.peak_bytes - base


def main_head_ce():
    from osdp.ops import split_head_cross_entropy

    dtype = torch.bfloat16 if HAVE_CUDA else torch.float32
    device_name = torch.cuda.get_device_name() if HAVE_CUDA else ("cpu-dry-run" if args.dry_run else "cpu")
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    out_dir = args.out_dir or (Path("/tmp/osdp_kernels_dryrun") if args.dry_run else ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"head_ce_{tag}.csv"
    fields = ["device", "dtype", "tokens", "hidden", "vocab", "slices", "method", "backend", "ms",
              "peak_mib", "logits_mib", "vs_unfused_ms"]
    fused_backend = "triton" if HAVE_CUDA else "torch"
    print(f"device: {device_name}  dtype: {dtype}  torch {torch.__version__}  fused backend: {fused_backend}")
    print(f"{'T':>6} {'H':>6} {'V':>7} {'g':>3} {'method':8} {'ms':>9} {'peak MiB':>9} {'logits MiB':>10} {'x unfused':>9}")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        shapes, slice_counts = head_ce_grid()
        for T, H, V in shapes:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(T, H, generator=gen).to(DEVICE, dtype).requires_grad_()
            W = (torch.randn(V, H, generator=gen) / H**0.5).to(DEVICE, dtype).requires_grad_()
            t = torch.randint(0, V, (T,), generator=gen).to(DEVICE)

            def unfused():
                x.grad = W.grad = None
                F.cross_entropy(x @ W.T, t).backward()

            def fused(g):
                def run():
                    x.grad = W.grad = None
                    split_head_cross_entropy(x, W, t, num_slices=g).backward()
                return run

            fns = {("unfused", 1): unfused, **{("fused", g): fused(g) for g in slice_counts}}
            ms = interleaved_median_ms(fns)  # warm-up first: Triton autotuning stays out of the memory probe
            for (method, g), fn in fns.items():
                peak = head_ce_peak_bytes(fn, [x, W, t])
                row = dict(device=device_name, dtype=str(dtype).replace("torch.", ""), tokens=T, hidden=H, vocab=V,
                           slices=g, method=method, backend=fused_backend if method == "fused" else "torch",
                           ms=round(ms[(method, g)], 3), peak_mib=round(peak / 2**20, 1),
                           logits_mib=round(T * V * dtype.itemsize / 2**20, 1),
                           vs_unfused_ms=round(ms[("unfused", 1)] / ms[(method, g)], 3))
                w.writerow(row)
                f.flush()
                print(f"{T:6} {H:6} {V:7} {g:3} {method:8} {row['ms']:9.2f} {row['peak_mib']:9.1f} "
                      f"{row['logits_mib']:10.1f} {row['vs_unfused_ms']:9.3f}")
            if HAVE_CUDA:
                torch.cuda.empty_cache()
    print(f"wrote {csv_path}")


def main():
    if args.head_ce:
        return main_head_ce()
    backends = ["triton"] + (["cuda"] if HAVE_CUDA and K.cuda_available() else [])
    if HAVE_CUDA and not K.cuda_available():
        print("note: osdp_kernels._cuda is not built; the 'cuda' column is skipped")
    device_name = torch.cuda.get_device_name() if HAVE_CUDA else "cpu-dry-run"
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    out_dir = args.out_dir or (Path("/tmp/osdp_kernels_dryrun") if args.dry_run else ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"kernels_{tag}.csv"
    fields = ["device", "pass", "hidden", "tokens", "g", "method", "ms", "tflops", "vs_cublas", "extra_peak_mib"]
    print(f"device: {device_name}  dtype: {DTYPE}  torch {torch.__version__}  backends: {backends}")
    print(f"{'pass':4} {'H':>6} {'T':>6} {'g':>3} {'method':7} {'ms':>9} {'TFLOP/s':>8} {'x cuBLAS':>8} {'+MiB':>8}")
    rows, t_start = [], time.time()
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for H, T, g in grid():
            if time.time() - t_start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s reached; stopping (CSV holds what was measured)")
                break
            flops = 2.0 * T * H * H
            for pass_, fns in variants(H, T, g, backends).items():
                base_ms = None
                for method, fn in fns.items():
                    ms = median_ms(fn)  # warm-up first: Triton autotuning stays out of the memory probe
                    mib = extra_peak_mib(fn)
                    base_ms = ms if method == "cublas" else base_ms
                    row = dict(device=device_name, **{"pass": pass_}, hidden=H, tokens=T, g=g, method=method,
                               ms=round(ms, 4), tflops=round(flops / ms / 1e9, 2),
                               vs_cublas=round(base_ms / ms, 3), extra_peak_mib=round(mib, 1))
                    w.writerow(row)
                    f.flush()
                    rows.append(row)
                    print(f"{pass_:4} {H:6} {T:6} {g:3} {method:7} {ms:9.3f} {row['tflops']:8.1f} "
                          f"{row['vs_cublas']:8.3f} {mib:8.1f}")
            if HAVE_CUDA:
                torch.cuda.empty_cache()
    print(f"wrote {csv_path}")
    if not args.no_plot:
        plot(rows, out_dir / f"kernels_{tag}.png", device_name)


def plot(rows, path, device_name):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not rows:
        return
    T = max(r["tokens"] for r in rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for ax, pass_ in zip(axes, ["fwd", "dx", "dw"]):
        sel = [r for r in rows if r["pass"] == pass_ and r["tokens"] == T and r["method"] != "cublas"]
        for method in sorted({r["method"] for r in sel}):
            for H in sorted({r["hidden"] for r in sel}):
                pts = sorted((r["g"], r["vs_cublas"]) for r in sel if r["method"] == method and r["hidden"] == H)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{method} H={H}",
                            linestyle={"torch": ":", "triton": "-", "cuda": "--"}.get(method, "-"))
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_} (tokens={T})")
        ax.set_xlabel("slices g")
    axes[0].set_ylabel("speed vs unsplit cuBLAS (higher is better)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"split-matmul kernels, {str(DTYPE).replace('torch.', '')}, {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
