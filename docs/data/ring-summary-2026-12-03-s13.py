"""Summary of run-exp.sh: kernel-only (ncu) and CUDA-event medians per variant."""
import collections, csv, re, sys

out = sys.argv[1]
points = [(d, b, k) for d in (4096, 8192) for b in (128, 256) for k in ("sample", "greedy")]
scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
times = collections.defaultdict(list)  # (variant, point) -> [us]
extra = collections.defaultdict(list)
variant, seen = None, []
for line in open(f"{out}/ncu.log", errors="replace"):
    m = re.match(r"=== (\S+) pass", line)
    if m:
        variant, seen = m.group(1), []
        continue
    if re.match(r"\s+fused_tma_bf16_h128_n128 \(", line):
        seen.append(None)
        continue
    m = re.match(r"\s+(gpu__time_duration.sum|sm__cycles_elapsed.avg.per_second|sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active|lts__t_bytes.sum)\s+(\S+)\s+([\d.,]+)", line)
    if m and variant and seen and len(seen) <= len(points):
        p = points[len(seen) - 1]
        v = float(m.group(3).replace(",", ""))
        if m.group(1) == "gpu__time_duration.sum":
            times[(variant, p)].append(v * scale.get(m.group(2), 1.0))
        else:
            extra[(variant, p, m.group(1)[:12])].append(f"{v:g}{m.group(2)}")
variants = ["main", "s5w1", "s5w1p", "s5w0p", "s4p"]
print("kernel-only µs (ncu, mean of passes): sample / greedy (sample/greedy)")
print("variant   " + "  ".join(f"D{d} B{b:<3}" + " " * 12 for d in (4096, 8192) for b in (128, 256)))
for v in variants:
    cells = []
    for d in (4096, 8192):
        for b in (128, 256):
            s, g = times.get((v, (d, b, "sample"))), times.get((v, (d, b, "greedy")))
            if s and g:
                ms, mg = sum(s) / len(s), sum(g) / len(g)
                cells.append(f"{ms:6.1f}/{mg:6.1f} ({ms/mg:.3f})")
            else:
                cells.append("-" * 22)
    print(f"{v:8}  " + "  ".join(cells))
print("clock, tensor %, L2 (first pass) at B=256:")
for v in variants:
    for d in (4096, 8192):
        for k in ("sample", "greedy"):
            p = (d, 256, k)
            print(f"  {v:6} D{d} {k:6}", [extra.get((v, p, key), ["-"])[0] for key in ("sm__cycles_e", "sm__pipe_ten", "lts__t_bytes")])
rows = collections.defaultdict(list)
for r in csv.reader(open(f"{out}/events.csv")):
    if len(r) < 7 or r[2] == "dim":
        continue
    v, d, b, var, med = r[0], int(r[2]), int(r[4]), r[5], float(r[6])
    rows[(v, d, b, var)].append(med)
print("events µs (median of 50; main twice, first/last): sample / greedy")
for v in variants:
    cells = []
    for d in (4096, 8192):
        for b in (128, 256):
            s, g = rows.get((v, d, b, "fused_sample")), rows.get((v, d, b, "fused_greedy"))
            if s and g:
                cells.append("/".join(f"{x:.1f}" for x in s) + " | " + "/".join(f"{x:.1f}" for x in g))
    print(f"{v:8} " + "   ".join(cells))
