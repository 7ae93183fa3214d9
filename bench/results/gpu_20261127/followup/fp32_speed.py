"""fp32 (TF32 off) split-kernel time against cuBLAS, same run, medians of 20 (CUDA events)."""
import torch
import osdp_kernels as K

torch.backends.cuda.matmul.allow_tf32 = False


def med(fn, n=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


for M, N, Kt in [(4096, 4096, 4096), (8192, 4096, 1024), (16, 4096, 4096)]:
    x = torch.randn(M, Kt, device="cuda"); w = torch.randn(N, Kt, device="cuda")
    out = torch.zeros(M, N, device="cuda"); dy = torch.randn(M, N, device="cuda"); dx = torch.empty(M, Kt, device="cuda")
    g = torch.empty(N, Kt, device="cuda")
    rows = {"fwd cublas": med(lambda: torch.addmm(out, x, w.T)),
            "dx cublas": med(lambda: dy @ w), "dw cublas": med(lambda: dy.T @ x)}
    for be in ("triton", "cuda"):
        rows[f"fwd {be}"] = med(lambda: K.addmm_slice_(out, x, w, 0, backend=be))
        rows[f"dx {be}"] = med(lambda: K.slice_dx(dy, w, dx, 0, backend=be))
        rows[f"dw {be}"] = med(lambda: K.slice_dw(dy, x, 0, Kt, out=g, backend=be))
    for k, v in rows.items():
        base = rows[k.split()[0] + " cublas"]
        print(f"M={M} N={N} K={Kt} {k:<12} {v:8.3f} ms  x cuBLAS {base / v:5.2f}  {2 * M * N * Kt / v / 1e9:7.1f} TFLOP/s")
