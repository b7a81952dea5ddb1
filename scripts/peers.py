"""Peer timings on the GPU machine, in the same run as `flashsample bench`.

cuBLAS `x @ W.T` alone (the GEMM floor a fused sampler should match) and the usual torch
pipeline (mm, softmax, multinomial) on the same shapes, bf16, CUDA events, L2 flushed before
every run (256 MB write), median of RUNS runs after warm-up, random inputs.

    python3 peers.py OUT.csv [--shapes 4096x151936,...] [--batches 1,2,...] [--runs 50]
"""
import argparse

import torch


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", default="4096x151936,8192x128256,4096x128256,2880x201088")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = ["dim,vocab,batch,variant,median_us,min_us,max_us"]
    for shape in args.shapes.split(","):
        d, v = (int(x) for x in shape.split("x"))
        w = (torch.rand(v, d, device="cuda", dtype=torch.bfloat16) - 0.5) * 0.1
        for b in (int(x) for x in args.batches.split(",")):
            x = (torch.rand(b, d, device="cuda", dtype=torch.bfloat16) - 0.5) * 4
            gemm = timed(lambda: x @ w.T, args.runs, args.warmup, flush)
            sample = timed(
                lambda: torch.multinomial(torch.softmax((x @ w.T).float(), dim=-1), 1),
                args.runs, args.warmup, flush)
            rows.append(f"{d},{v},{b},cublas_gemm,{gemm[0]:.2f},{gemm[1]:.2f},{gemm[2]:.2f}")
            rows.append(f"{d},{v},{b},torch_sample,{sample[0]:.2f},{sample[1]:.2f},{sample[2]:.2f}")
            print(rows[-2], rows[-1], sep="\n", flush=True)
        del w
    with open(args.out, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
