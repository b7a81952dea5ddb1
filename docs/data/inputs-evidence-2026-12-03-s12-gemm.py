"""x @ W.T on the two target shapes at B = 128, 256 with one kind of random inputs (for ncu)."""
import sys
import torch

kind = sys.argv[1]
torch.manual_seed(0)


def make(rows, cols, scale):
    if kind == "torch_rand":  # what run.sh's iso stage used: U[0, 1) in bf16 (8 random bits)
        return torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16)
    if kind == "peers_old":  # what peers.py used: (U[0, 1) in bf16 - 0.5) * 2 scale
        return (torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) - 0.5) * (2 * scale)
    if kind == "bench_like":  # 24-bit uniform on [-scale, scale) rounded to bf16, as the bench
        return ((torch.rand(rows, cols, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)
    raise SystemExit(kind)


for d, v in [(4096, 151936), (8192, 128256)]:
    w = make(v, d, 0.05)
    for b in [128, 256]:
        x = make(b, d, 2.0)
        y = x @ w.T
    torch.cuda.synchronize()
    del w
