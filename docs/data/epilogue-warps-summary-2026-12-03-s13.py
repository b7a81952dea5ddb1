"""Summary of run-exp2.sh: kernel-only (ncu) and CUDA-event medians per variant."""
import collections, csv, re, sys

out = sys.argv[1]
shapes = (4096, 8192, 2880)
batches = (64, 128, 256)
points = [(d, b, k) for d in shapes for b in batches for k in ("sample", "greedy")]
scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
metrics = collections.defaultdict(list)  # (variant, point, metric) -> values
variant, seen = None, 0
for line in open(f"{out}/ncu.log", errors="replace"):
    m = re.match(r"=== (\S+) pass", line)
    if m:
        variant, seen = m.group(1), 0
        continue
    if re.match(r"\s+fused_tma_bf16_h128_n\d+ \(", line):
        seen += 1
        continue
    m = re.match(r"\s+(gpu__time_duration|sm__cycles_elapsed|sm__pipe_tensor|smsp__inst_executed)\S*\s+(\S+)\s+([\d.,]+)", line)
    if m and variant and 0 < seen <= len(points):
        v = float(m.group(3).replace(",", ""))
        if m.group(1) == "gpu__time_duration":
            v *= scale.get(m.group(2), 1.0)
        metrics[(variant, points[seen - 1], m.group(1))].append(v)
variants = ["main", "e4", "e5"]
mean = lambda xs: sum(xs) / len(xs)
print("kernel-only µs (ncu, mean of two passes): sample / greedy (sample/greedy) [sample vs main]")
for d in shapes:
    for b in batches:
        cells = []
        base = metrics.get(("main", (d, b, "sample"), "gpu__time_duration"))
        for v in variants:
            s = metrics.get((v, (d, b, "sample"), "gpu__time_duration"))
            g = metrics.get((v, (d, b, "greedy"), "gpu__time_duration"))
            if s and g:
                cells.append(f"{v} {mean(s):6.1f}/{mean(g):6.1f} ({mean(s)/mean(g):.3f}) [{mean(s)/mean(base):.3f}]")
        print(f"D{d} B{b:<3} " + "  ".join(cells))
print("B=256 sample: clock GHz, tensor %, warp instructions M (mean of passes)")
for d in shapes:
    for v in variants:
        p = (d, 256, "sample")
        vals = [metrics.get((v, p, k)) for k in ("sm__cycles_elapsed", "sm__pipe_tensor", "smsp__inst_executed")]
        if all(vals):
            print(f"  D{d} {v:4} {mean(vals[0]):.3g} {mean(vals[1]):.1f} {mean(vals[2])/1e6:.1f}")
rows = collections.defaultdict(list)
for r in csv.reader(open(f"{out}/events.csv")):
    if len(r) < 7 or r[2] == "dim":
        continue
    rows[(r[0], int(r[2]), int(r[4]), r[5])].append(float(r[6]))
print("events µs (median of 50 per run; runs in order): sample | greedy")
for v in variants:
    cells = []
    for d in (4096, 8192):
        for b in (128, 256):
            s, g = rows.get((v, d, b, "fused_sample")), rows.get((v, d, b, "fused_greedy"))
            if s and g:
                cells.append(f"D{d}B{b} " + "/".join(f"{x:.0f}" for x in s) + " | " + "/".join(f"{x:.0f}" for x in g))
    print(f"{v:4} " + "  ".join(cells))
