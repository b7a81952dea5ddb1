"""Torch's tensor-parallel sampling baseline on the GPU machine, beside `flashsample bench-tp`.

Each of N processes (one per GPU, NCCL) holds a vocabulary shard of W (bf16, ⌈V/N⌉ rows, the
last padded); a step computes its logits shard `x @ W_shard.T`, all-gathers the shards' logits
into `[B, V]` on every rank (`all_gather_into_tensor`) and samples from `softmax(logits)`
(`torch.multinomial`), the usual pipeline of engines that shard the LM head. Rows
`torch_tp_sample` (the step) and `torch_tp_all_gather` (the all-gather of the logits alone),
CUDA events on every rank, L2 flushed before every run, a barrier between runs, median of RUNS
runs after warm-up, the slowest rank's median; inputs drawn like the bench's (`uniform`).

    python3 tp_peers.py OUT.csv [--gpus 1,2,4,8] [--shapes 4096x151936,...] [--batches 1,16,64,256] [--runs 30]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def uniform(rows, cols, scale):
    """Uniform on [-scale, scale) rounded to bf16, as `flashsample bench`'s inputs."""
    return ((torch.rand(rows, cols, device="cuda") * 2 - 1) * scale).to(torch.bfloat16)


def timed(fn, runs, warmup, flush):
    for _ in range(warmup):
        fn()
    times = []
    for i in range(runs):
        flush.fill_(i)
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    # The slowest rank's median (and its spread).
    figures = torch.tensor([times[len(times) // 2], times[0], times[-1]], device="cuda")
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures.tolist()


def rank_main(rank, world, args, port, queue):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for shape in args.shapes.split(","):
        dim, vocab = map(int, shape.split("x"))
        shard = -(-vocab // world)
        torch.manual_seed(rank)
        w = uniform(shard, dim, 0.05)
        for batch in map(int, args.batches.split(",")):
            torch.manual_seed(1000 + batch)
            x = uniform(batch, dim, 2.0)
            gathered = torch.empty(world, batch, shard, dtype=torch.bfloat16, device="cuda")

            def step():
                local = x @ w.T
                dist.all_gather_into_tensor(gathered, local)
                logits = gathered.permute(1, 0, 2).reshape(batch, world * shard)[:, :vocab]
                return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1)

            local = x @ w.T

            def gather():
                dist.all_gather_into_tensor(gathered, local)

            for name, fn in (("torch_tp_sample", step), ("torch_tp_all_gather", gather)):
                median, low, high = timed(fn, args.runs, 5, flush)
                rows.append(f"{world},{dim},{vocab},{batch},{name},{median:.2f},{low:.2f},{high:.2f},{args.runs}")
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--gpus", default="1,2,4,8")
    parser.add_argument("--shapes", default="4096x151936,8192x128256")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    available = torch.cuda.device_count()
    lines = ["gpus,dim,vocab,batch,variant,median_us,min_us,max_us,runs"]
    context = mp.get_context("spawn")
    for index, world in enumerate(map(int, args.gpus.split(","))):
        if world > available:
            print(f"N = {world}: skipped, this machine has {available} GPU(s)")
            continue
        queue = context.SimpleQueue()
        port = 29500 + os.getpid() % 1000 + index
        processes = [context.Process(target=rank_main, args=(r, world, args, port, queue)) for r in range(world)]
        for p in processes:
            p.start()
        rows = queue.get()
        for p in processes:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"N = {world}: a rank exited with {p.exitcode}")
        lines.extend(rows)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
