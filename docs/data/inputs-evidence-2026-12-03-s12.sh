#!/usr/bin/env bash
# Session 12: does the input distribution move cuBLAS's (and our) B = 128/256 times?
# Ran from bundle/s12/ (the bundle of commit 978ae34, carried): gemm_inputs.py and summarize.py are
# the two inputs-evidence-2026-12-03-s12-*.py beside this file, peers-old.py is
# `git show 978ae34:scripts/peers.py`, and ../peers.py the new one (commit 779e123).
set -u
out=$1; here=$(cd "$(dirname "$0")/.." && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw --format=csv,noheader | tee "$out/env.txt"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
cublas=$(python3 -c 'import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); print(next(iter(sorted(glob.glob(d + "/nvidia/**/libcublas.so*", recursive=True) + glob.glob(d + "/torch/lib/libcublas.so*"))), ""))' 2>/dev/null)
echo "cublas=$cublas" | tee -a "$out/env.txt"
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
S=4096x151936,8192x128256
for pass in 1 2; do
    s=$SECONDS
    LD_LIBRARY_PATH= timeout 150 "$ncu" --clock-control none --metrics $M -k regex:'fused_tma|nvjet|xmma|cutlass' "$here/flashsample" bench --out /tmp/b --shapes $S --batches 128,256 --runs 1 --warmup 0 --cublas "$cublas" >> "$out/ncu-bench.log" 2>&1
    echo "pass $pass bench rc=$? $((SECONDS - s))s"
    for kind in torch_rand peers_old bench_like; do
        s=$SECONDS
        echo "### pass $pass $kind" >> "$out/ncu-torch.log"
        LD_LIBRARY_PATH= timeout 100 "$ncu" --clock-control none --metrics $M -k regex:'nvjet|xmma|cutlass' python3 "$here/s12/gemm_inputs.py" $kind >> "$out/ncu-torch.log" 2>&1
        echo "pass $pass $kind rc=$? $((SECONDS - s))s"
    done
done
s=$SECONDS
timeout 120 python3 "$here/s12/peers-old.py" "$out/peers-old.csv" --shapes $S --batches 128,256 > /dev/null 2>&1; echo "peers-old rc=$? $((SECONDS - s))s"
s=$SECONDS
timeout 120 python3 "$here/peers.py" "$out/peers-new.csv" --shapes $S --batches 128,256 > /dev/null 2>&1; echo "peers-new rc=$? $((SECONDS - s))s"
s=$SECONDS
timeout 150 "$here/flashsample" bench --out /tmp/s12-bench --shapes $S --batches 128,256 --cublas "$cublas" > "$out/bench.log" 2>&1; echo "bench rc=$? $((SECONDS - s))s"
python3 "$here/s12/summarize.py" "$out/ncu-bench.log" "$out/ncu-torch.log"
cp /tmp/s12-bench/bench.csv "$out/bench.csv"
grep -h "cublas_gemm\|fused_sample,\|fused_greedy," "$out/bench.csv" | cut -d, -f1-5
cat "$out/peers-old.csv" "$out/peers-new.csv" | grep cublas
