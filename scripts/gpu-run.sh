#!/usr/bin/env bash
# Runs on the GPU machine from the folder `cargo xtask bundle` made (it has no Rust).
#   bash bundle/run.sh OUT [unpack] [quick] [smoke] [tests] [portable] [processing] [verification] [demo] [example] [bench] [peers] [ncu] [ncu-processing] [iso] [sanitizer] [candle] [tp] [base]
# (none named = tests portable demo bench ncu). The bundle's binaries travel compressed
# (`NAME.xz`, so the whole bundle fits what a device call carries): every run first unpacks
# those not unpacked yet beside them; `unpack` does only that. `tests` runs every test binary
# with the device's module (Hopper on an H200); `portable` runs the GPU tests and the CLI's
# again with the portable module forced (FLASHSAMPLE_MODULE=portable), our stand-in for an
# A100.
# `processing` runs the logit-processing tests (processing, borrowed mode, tensor parallelism
# over the GPUs the machine has, the CLI) with each module, then times every processing mode
# beside torch's unfused pipeline (scripts/peers.py --processing) on the Hopper module, and
# beside FlashInfer's pipeline when OUT/flashinfer.csv holds its benchmark's timings of the
# same run (`bench --flashinfer`). `verification` runs the suite's verification bodies with
# each module, then times speculative verification (1, 3, 7 drafts for 1, 16, 64 sequences)
# beside plain sampling of the same rows and torch's rejection-sampling verifier
# (scripts/peers.py --verification) on the Hopper module. `quick`
# runs the three GPU tests that exercise every kernel variant (CPU agreement, unfused = fused,
# tile width); `smoke` adds a short benchmark of every variant on the two headline shapes.
# `ncu-processing` times each kernel of every processing mode alone under ncu (one call per
# mode at B = 1, 64 and 256, D = 4096), which splits a mode's cost among the fused tile, the
# reduction, `winner_logits` and the processing pipeline's launches.
# `sanitizer` runs compute-sanitizer's memcheck, racecheck, synccheck and initcheck over every
# kernel variant on odd shapes, with each module. `example` launches nvptx-builder's example
# kernel and checks it against the CPU, and runs the borrowed-mode decode loop with both
# modules; `candle` runs the candle adapter's tests, its example and the
# speculative-decoding example (from the folder `cargo xtask bundle --candle` makes). `bench`
# times both modules beside cuBLAS; `peers` adds torch's timings (scripts/peers.py). `tp` times
# tensor-parallel sampling over 1, 2, 4 and 8 GPUs (as many as the machine has) beside torch's
# all-gather of logits (scripts/tp_peers.py). `base` times this build beside an earlier one in
# the same call (BUNDLE/base/flashsample.xz: the `flashsample.xz` of that build's bundle, copied
# in by hand): both modules, both headline shapes, B = 1 to 256, every processing mode, cuBLAS;
# it writes this / base for every row both time to OUT/base-ratios.csv and prints the range of
# the ratios per module and variant.
# Logs and CSVs go to OUT; a summary table is printed last.
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT [stages]}; shift
mkdir -p "$out"
stages=${*:-tests portable demo example bench ncu}
summary=()
step() { # name, command...
    local name=$1; shift
    local start=$SECONDS
    "$@"; local rc=$?
    summary+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
}
# unpack PACKED TO: an executable from an xz file, by Python's lzma (the GPU machine need not
# have xz).
unpack() {
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2" && chmod +x "$2"
}
for packed in "$here"/*.xz "$here"/tests/*.xz; do
    [ -f "$packed" ] && [ ! -f "${packed%.xz}" ] || continue
    unpack "$packed" "${packed%.xz}"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
# The cuBLAS torch ships, for the bench's in-process reference: cudarc opens it by name through
# the loader's path, so its folder goes on LD_LIBRARY_PATH with a `libcublas.so` link to it.
cublas_path() {
    local lib
    lib=$(python3 -c 'import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); print(next(iter(sorted(glob.glob(d + "/nvidia/**/libcublas.so.*", recursive=True))), ""))' 2>/dev/null)
    [ -n "$lib" ] || return 0
    mkdir -p /tmp/flashsample-cublas && ln -sf "$lib" /tmp/flashsample-cublas/libcublas.so
    echo "/tmp/flashsample-cublas:$(dirname "$lib")"
}
# NCCL as torch ships it (libnccl.so.2): cudarc opens it by the names it knows, `libnccl.so`
# among them, so a link of that name goes on LD_LIBRARY_PATH for the tensor-parallel tests.
nccl_path() {
    local lib
    lib=$(python3 -c 'import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); print(next(iter(sorted(glob.glob(d + "/nvidia/**/libnccl.so.*", recursive=True))), ""))' 2>/dev/null)
    [ -n "$lib" ] || return 0
    mkdir -p /tmp/flashsample-nccl && ln -sf "$lib" /tmp/flashsample-nccl/libnccl.so
    echo "/tmp/flashsample-nccl"
}
find_ncu() {
    command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1
}
run_tests() { # log, binaries...
    local log=$1; shift
    # Each binary under a time limit, its output straight to the log, so a hang shows which
    # test it was in and the later stages still run.
    export FLASHSAMPLE_BIN="$here/flashsample"
    local nccl
    nccl=$(nccl_path)
    export LD_LIBRARY_PATH="${nccl:+$nccl:}${LD_LIBRARY_PATH:-}"
    for t in "$@"; do
        echo "=== $(basename "$t") (FLASHSAMPLE_MODULE=${FLASHSAMPLE_MODULE:-auto})" >> "$log"
        step "$(basename "$t")${FLASHSAMPLE_MODULE:+ $FLASHSAMPLE_MODULE}" timeout 560 "$t" --include-ignored --test-threads=1 --nocapture >> "$log" 2>&1
    done
    grep -E "^===|test result|FAILED|panicked|chi2|disagreements|agree in|largest" "$log" | tail -60
}
for stage in $stages; do
    case $stage in
    unpack) ;;
    tests) run_tests "$out/gpu-tests.log" $(ls "$here"/tests/* | grep -v '\.xz$') ;;
    portable) FLASHSAMPLE_MODULE=portable run_tests "$out/gpu-tests-portable.log" "$here/tests/tests-gpu" "$here/tests/tests-borrowed" "$here/tests/cli-cli" ;;
    processing)
        for module in hopper portable; do
            FLASHSAMPLE_MODULE=$module run_tests "$out/gpu-processing.log" "$here/tests/tests-processing" "$here/tests/tests-borrowed" "$here/tests/tests-tensor_parallel" "$here/tests/cli-cli"
        done
        libs=$(cublas_path)
        flashinfer=""
        [ -f "$out/flashinfer.csv" ] && flashinfer="--flashinfer '$out/flashinfer.csv'"
        step processing-peers timeout 200 bash -c "python3 '$here/peers.py' '$out/peers-processing.csv' --shapes 4096x151936,8192x128256 --batches 1,16,64,256 --processing --runs 30 > '$out/peers-processing.log' 2>&1"
        step processing-bench timeout 300 bash -c "LD_LIBRARY_PATH='$libs' '$here/flashsample' bench --out '$out/bench-processing' --modules hopper --shapes 4096x151936,8192x128256 --batches 1,16,64,256 ${libs:+--cublas} --processing --runs 30 --peers '$out/peers-processing.csv' $flashinfer > '$out/bench-processing.log' 2>&1"
        tail -40 "$out/bench-processing.log"
        ;;
    verification)
        for module in hopper portable; do
            for binary in tests-gpu tests-borrowed; do
                step "verification $binary $module" timeout 300 bash -c "FLASHSAMPLE_MODULE=$module '$here/tests/$binary' --include-ignored --test-threads=1 --nocapture verification same_key >> '$out/gpu-verification.log' 2>&1"
            done
        done
        grep -E "test result|FAILED|panicked|agrees" "$out/gpu-verification.log" | tail -20
        libs=$(cublas_path)
        step verification-peers timeout 300 bash -c "python3 '$here/peers.py' '$out/peers-verification.csv' --shapes 4096x151936,8192x128256 --batches 1 --verification --runs 30 > '$out/peers-verification.log' 2>&1"
        step verification-bench timeout 300 bash -c "LD_LIBRARY_PATH='$libs' '$here/flashsample' bench --out '$out/bench-verification' --modules hopper --shapes 4096x151936,8192x128256 --batches 1 ${libs:+--cublas} --verification --runs 30 --peers '$out/peers-verification.csv' > '$out/bench-verification.log' 2>&1"
        tail -30 "$out/bench-verification.log"
        ;;
    quick|smoke)
        step quick-tests timeout 120 "$here/tests/tests-gpu" --include-ignored --test-threads=1 --nocapture same_tokens unfused tile_width >> "$out/smoke.log" 2>&1
        grep -E "test result|FAILED|panicked" "$out/smoke.log" | tail -10
        ;;&
    smoke)
        step smoke-bench timeout 240 bash -c "'$here/flashsample' bench --out '$out/smoke-bench' --shapes 4096x151936,8192x128256 --all-variants --runs 20 >> '$out/smoke.log' 2>&1"
        ;;
    quick) ;;
    demo)
        step demo timeout 120 bash -c "'$here/flashsample' demo 2>&1 | tee '$out/demo.log'"
        step demo-portable timeout 120 bash -c "FLASHSAMPLE_MODULE=portable '$here/flashsample' demo 2>&1 | tee -a '$out/demo.log'"
        ;;
    example)
        step example timeout 60 bash -c "'$here/saxpy-example' 2>&1 | tee '$out/example.log'"
        step decode-loop timeout 120 bash -c "'$here/decode-loop-example' 2>&1 | tee -a '$out/example.log'"
        step decode-loop-portable timeout 120 bash -c "FLASHSAMPLE_MODULE=portable '$here/decode-loop-example' 2>&1 | tail -3 | tee -a '$out/example.log'"
        ;;
    sanitizer)
        # compute-sanitizer's four tools over every kernel variant on odd shapes (the
        # hardening tests' sanitizer workload), with each module; any report fails the step.
        sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
        for module in hopper portable; do
            for tool in memcheck racecheck synccheck initcheck; do
                step "sanitizer $tool $module" timeout 300 bash -c "FLASHSAMPLE_MODULE=$module '$sanitizer' --tool $tool --error-exitcode 3 '$here/tests/tests-hardening' --include-ignored --exact sanitizer_workload_every_variant_on_odd_shapes --test-threads=1 >> '$out/sanitizer.log' 2>&1"
            done
        done
        grep -E "SUMMARY|test result|FAILED|panicked" "$out/sanitizer.log" | tail -20
        ;;
    candle)
        # The candle adapter (bundle made by `cargo xtask bundle --candle`): candle links the
        # CUDA runtime, cuBLAS and cuRAND, which torch's wheels carry.
        libs=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)) + "/nvidia/cu13/lib")')
        candle=/tmp/flashsample-candle && mkdir -p $candle
        for packed in "$here"/*adapter*.xz "$here"/candle-example.xz "$here"/speculative-example.xz "$here"/../bundle-candle/*.xz; do
            [ -f "$packed" ] || continue
            unpack "$packed" "$candle/$(basename "$packed" .xz)"
        done
        for module in auto portable; do
            # Speculative decoding through the adapter: its checks (every emitted token equals
            # one-token decoding, the target's own drafts all kept) fail the step.
            [ -x "$candle/speculative-example" ] && step "speculative $module" timeout 300 bash -c "FLASHSAMPLE_MODULE=$module LD_LIBRARY_PATH='$libs' '$candle/speculative-example' cuda >> '$out/speculative.log' 2>&1"
            step "candle-example $module" timeout 200 bash -c "FLASHSAMPLE_MODULE=$module LD_LIBRARY_PATH='$libs' '$candle/candle-example' 2>&1 | tail -6 | tee -a '$out/candle.log'"
            for t in "$candle"/*adapter*; do
                step "candle-tests $module" timeout 400 bash -c "FLASHSAMPLE_MODULE=$module LD_LIBRARY_PATH='$libs' '$t' --include-ignored --test-threads=1 --nocapture >> '$out/candle.log' 2>&1"
            done
        done
        grep -E "test result|FAILED|panicked|chi2|tokens drawn" "$out/candle.log" | tail -20
        [ -f "$out/speculative.log" ] && tail -12 "$out/speculative.log"
        ;;
    peers) step peers timeout 200 bash -c "python3 '$here/peers.py' '$out/peers.csv' > '$out/peers.log' 2>&1" ;;
    tp)
        step tp-peers timeout 300 bash -c "python3 '$here/tp_peers.py' '$out/tp-peers.csv' > '$out/tp.log' 2>&1"
        step bench-tp timeout 300 bash -c "LD_LIBRARY_PATH='$(nccl_path)' '$here/flashsample' bench-tp --out '$out/tp' --peers '$out/tp-peers.csv' >> '$out/tp.log' 2>&1"
        tail -14 "$out/tp.log"
        ;;
    bench)
        libs=$(cublas_path)
        echo "in-bench cuBLAS from: ${libs:-none found}" | tee "$out/bench.log"
        peers=""
        [ -f "$out/peers.csv" ] && peers="--peers '$out/peers.csv'"
        step bench timeout 480 bash -c "LD_LIBRARY_PATH='$libs' '$here/flashsample' bench --out '$out/bench' --modules hopper,portable --shapes 4096x151936,8192x128256 ${libs:+--cublas} $peers 2>&1 | tee -a '$out/bench.log'"
        ;;
    base)
        if [ ! -f "$here/base/flashsample.xz" ]; then
            echo "stage base: no $here/base/flashsample.xz"
            continue
        fi
        [ -f "$here/base/flashsample" ] || unpack "$here/base/flashsample.xz" "$here/base/flashsample"
        libs=$(cublas_path)
        # One build after the other on the same machine, so that only this call's ratios are
        # compared; the earlier build runs first.
        for build in base this; do
            binary="$here/flashsample"
            [ "$build" = base ] && binary="$here/base/flashsample"
            step "bench $build" timeout 240 bash -c "LD_LIBRARY_PATH='$libs' '$binary' bench --out '$out/bench-$build' --modules hopper,portable --shapes 4096x151936,8192x128256 --batches 1,16,64,128,256 ${libs:+--cublas} --processing --runs 20 > '$out/bench-$build.log' 2>&1"
        done
        python3 - "$out/bench-this/bench.csv" "$out/bench-base/bench.csv" "$out/base-ratios.csv" <<'PY'
import csv, sys
def rows(path):
    try:
        return {(r['module'], r['dim'], r['batch'], r['variant']): float(r['median_us']) for r in csv.DictReader(open(path))}
    except OSError as error:
        sys.exit(f"stage base: {error}")
this, base = rows(sys.argv[1]), rows(sys.argv[2])
ratios = {key: this[key] / base[key] for key in this if key in base and base[key] > 0}
with open(sys.argv[3], 'w', newline='') as f:
    w = csv.writer(f)
    w.writerow(['module', 'dim', 'batch', 'variant', 'this_us', 'base_us', 'this_over_base'])
    for key, ratio in sorted(ratios.items()):
        w.writerow([*key, this[key], base[key], f'{ratio:.3f}'])
groups = {}
for (module, _, _, variant), ratio in ratios.items():
    groups.setdefault((module, variant), []).append(ratio)
print('module variant: this / base, lowest .. highest over shapes and B')
for (module, variant), values in sorted(groups.items()):
    print(f'{module} {variant}: {min(values):.3f} .. {max(values):.3f}')
PY
        ;;
    iso)
        # Kernel-only times (each kernel alone under ncu, caches flushed by ncu): ours at B = 128
        # and 256 against cuBLAS's GEMM launched by the bench on the same buffers (the inputs'
        # bits move a GEMM's power-capped clock, so both multiply the same numbers). Immune to
        # the clock drift of a long sweep.
        ncu=$(find_ncu)
        libs=$(cublas_path)
        step iso timeout 300 bash -c "LD_LIBRARY_PATH='$libs' '$ncu' --clock-control none --metrics gpu__time_duration.sum -k regex:'fused_tma|reduce_candidates|nvjet|xmma|cutlass' '$here/flashsample' bench --out /tmp/iso-bench --shapes 4096x151936,8192x128256 --batches 128,256 --runs 1 --warmup 0 ${libs:+--cublas} > '$out/iso.log' 2>&1"
        grep -hE "^  [a-zA-Z_]|gpu__time" "$out/iso.log" | head -60
        ;;
    ncu-processing)
        ncu=$(find_ncu)
        step ncu-processing timeout 300 bash -c "'$ncu' --clock-control none --metrics gpu__time_duration.sum -k regex:'fused|reduce|winner|merge|process|logits_|sample_logits' '$here/flashsample' bench --out /tmp/ncu-processing-bench --modules hopper --shapes 4096x151936 --batches 1,64,256 --processing --runs 1 --warmup 0 > '$out/ncu-processing.log' 2>&1"
        grep -cE "gpu__time" "$out/ncu-processing.log"
        ;;
    ncu)
        ncu=$(find_ncu)
        step ncu timeout 150 bash -c "'$ncu' --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum -k regex:'fused|reduce|logits_|sample_logits' '$here/flashsample' bench --out /tmp/ncu-bench --shapes 4096x151936 --batches 1,64,256 --runs 1 --warmup 0 > '$out/ncu.log' 2>&1"
        grep -E "fused_|reduce_|logits_|sample_logits|dram__bytes|gpu__time" "$out/ncu.log" | head -60
        ;;
    esac
done
printf '%s\n' "${summary[@]}"
