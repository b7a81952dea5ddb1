"""Peer timings on the GPU machine, in the same run as `flashsample bench`.

cuBLAS `x @ W.T` alone (the GEMM floor a fused sampler should match), the usual torch
pipeline (mm, softmax, multinomial) and, with `--processing`, vLLM-style unfused truncations
on materialised logits (top-k 50, top-p 0.9 by sort and cumulative sum, min-p 0.05) and,
with `--verification`, speculative decoding's rejection-sampling verifier (S sequences of k
drafts, S in 1, 16, 64 and k in 1, 3, 7, rows `torch_verify_k<k>` with batch S) on the
same shapes, bf16, CUDA events, L2 flushed before
every run (256 MB write), median of RUNS runs after warm-up, random inputs drawn like the
bench's (see `uniform`).

    python3 peers.py OUT.csv [--shapes 4096x151936,...] [--batches 1,2,...] [--runs 50] [--processing]
        [--verification]
"""
import argparse

import torch


def uniform(rows, cols, scale):
    """Uniform on [-scale, scale) from 24 random bits, rounded to bf16: the distribution of
    `flashsample bench`'s inputs (`fill_uniform_bf16`; cli/src/bench.rs makes W at scale
    0.05 and x at 2.0). At the H200's power cap a GEMM's clock depends on its inputs' bits
    (docs/PERF.md, how it is measured), so the peers must multiply the same kind of numbers as our
    kernels."""
    return ((torch.rand(rows, cols, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)


def timed(fn, runs, warmup, flush):
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    stop = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for i in range(runs):
        flush.fill_(i)
        start[i].record()
        fn()
        stop[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(start, stop))
    return times[len(times) // 2], times[0], times[-1]


def top_k(x, w, k=50):
    values, indices = (x @ w.T).float().topk(k, dim=-1)
    return indices.gather(-1, torch.multinomial(torch.softmax(values, dim=-1), 1))


def top_p(x, w, p=0.9):
    ordered, indices = (x @ w.T).float().sort(dim=-1, descending=True)
    probabilities = torch.softmax(ordered, dim=-1)
    before = probabilities.cumsum(dim=-1) - probabilities
    ordered = ordered.masked_fill(before >= p, float("-inf"))
    return indices.gather(-1, torch.multinomial(torch.softmax(ordered, dim=-1), 1))


def min_p(x, w, p=0.05):
    probabilities = torch.softmax((x @ w.T).float(), dim=-1)
    cut = probabilities.amax(dim=-1, keepdim=True) * p
    return torch.multinomial(probabilities.masked_fill(probabilities < cut, 0.0), 1)


def rejection_verify(x, w, drafts, q):
    """The verifier engines run for speculative decoding, at T = 1: the target's probabilities
    `p` at every position of S sequences (x holds their S * (k + 1) hidden states), each draft
    kept with probability min(1, p / q) under the drafter's materialised probabilities `q`
    [S, k, V], and at the first refused draft a token redrawn from the normalised residual
    max(p - q, 0), or after k kept drafts one drawn from p at position k. Returns the kept
    counts and the last token of each sequence."""
    sequences, k = drafts.shape
    p = torch.softmax((x @ w.T).float(), dim=-1).view(sequences, k + 1, -1)
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    kept = (torch.rand_like(p_draft) * q_draft <= p_draft).int().cumprod(dim=-1).sum(dim=-1)
    rows = torch.arange(sequences, device=x.device)
    residual = (p[:, :k] - q).clamp_min(0)[rows, kept.clamp(max=k - 1)]
    last = torch.where((kept < k)[:, None], residual, p[rows, k])
    return kept, torch.multinomial(last, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", default="4096x151936,8192x128256,4096x128256,2880x201088")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--processing", action="store_true")
    parser.add_argument("--verification", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = ["dim,vocab,batch,variant,median_us,min_us,max_us"]
    for shape in args.shapes.split(","):
        d, v = (int(x) for x in shape.split("x"))
        w = uniform(v, d, 0.05)
        for b in (int(x) for x in args.batches.split(",")):
            x = uniform(b, d, 2.0)
            gemm = timed(lambda: x @ w.T, args.runs, args.warmup, flush)
            sample = timed(
                lambda: torch.multinomial(torch.softmax((x @ w.T).float(), dim=-1), 1),
                args.runs, args.warmup, flush)
            rows.append(f"{d},{v},{b},cublas_gemm,{gemm[0]:.2f},{gemm[1]:.2f},{gemm[2]:.2f}")
            rows.append(f"{d},{v},{b},torch_sample,{sample[0]:.2f},{sample[1]:.2f},{sample[2]:.2f}")
            print(rows[-2], rows[-1], sep="\n", flush=True)
            if args.processing:
                for name, fn in (("torch_top_k", top_k), ("torch_top_p", top_p), ("torch_min_p", min_p)):
                    t = timed(lambda: fn(x, w), args.runs, args.warmup, flush)
                    rows.append(f"{d},{v},{b},{name},{t[0]:.2f},{t[1]:.2f},{t[2]:.2f}")
                    print(rows[-1], flush=True)
        if args.verification:
            for sequences in (1, 16, 64):
                for k in (1, 3, 7):
                    x = uniform(sequences * (k + 1), d, 2.0)
                    drafts = torch.randint(0, v, (sequences, k), device="cuda")
                    q = torch.softmax(torch.randn(sequences, k, v, device="cuda"), dim=-1)
                    t = timed(lambda: rejection_verify(x, w, drafts, q), args.runs, args.warmup, flush)
                    rows.append(f"{d},{v},{sequences},torch_verify_k{k},{t[0]:.2f},{t[1]:.2f},{t[2]:.2f}")
                    print(rows[-1], flush=True)
                    del q
        del w
    with open(args.out, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
