"""Prints kernel, µs, GHz, tensor % for every profiled kernel of ncu logs, in order."""
import re
import sys

for path in sys.argv[1:]:
    print(f"== {path}")
    kernel = None
    vals = {}
    for line in open(path, errors="replace"):
        if line.startswith("### "):
            if kernel:
                print(kernel, vals)
            kernel = None
            print(line.strip())
            continue
        m = re.match(r"  (\S+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
        if m:
            if kernel:
                print(kernel, vals)
            kernel, vals = m.group(1)[:40], {}
            continue
        m = re.match(r"\s+(gpu__time_duration.sum|sm__cycles_elapsed.avg.per_second|sm__pipe_tensor_op_hmma_cycles_active\S*)\s+(\S+)\s+([\d.,]+)", line)
        if m and kernel:
            vals[m.group(1).split("__")[1][:12]] = m.group(3) + m.group(2)
    if kernel:
        print(kernel, vals)
