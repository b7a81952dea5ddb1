#!/usr/bin/env bash
# Session 13 experiment: five stages / wait_group 1 / no L2 promotion for the 128-column handoff tile.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=$1
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader | tee "$out/exp.log"
variants="s5w1 s5w1p s5w0p s4p"
bin() { if [ "$1" = main ]; then echo "$here/main/flashsample"; else echo "$here/$1/flashsample"; fi; }
for v in $variants; do
    echo "=== $v" >> "$out/quick.log"
    timeout 120 "$here/$v/tests-gpu" --include-ignored --test-threads=1 --nocapture same_tokens unfused tile_width >> "$out/quick.log" 2>&1
    echo "quick $v rc=$?" | tee -a "$out/exp.log"
done
for pass in 1 2; do
    for v in main $variants; do
        echo "=== $v pass $pass" >> "$out/ncu.log"
        LD_LIBRARY_PATH= timeout 120 "$ncu" --clock-control none --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum -k regex:h128_n128 "$(bin $v)" bench --out /tmp/ncu-$v --shapes 4096x151936,8192x128256 --batches 128,256 --runs 1 --warmup 0 >> "$out/ncu.log" 2>&1
        echo "ncu $v pass $pass rc=$?" | tee -a "$out/exp.log"
    done
done
for v in main $variants main; do
    rm -rf /tmp/ev; timeout 120 "$(bin $v)" bench --out /tmp/ev --shapes 4096x151936,8192x128256 --batches 128,256 --runs 50 > /dev/null 2>&1
    echo "events $v rc=$?" | tee -a "$out/exp.log"
    for f in /tmp/ev/*.csv; do sed "s/^/$v,$(basename $f),/" "$f" >> "$out/events.csv"; done
done
python3 "$here/summary.py" "$out" | tee "$out/summary.txt"
