#!/usr/bin/env bash
# Source this to build candle's CUDA backend on a machine without a CUDA installation:
#   source scripts/candle-cuda-env.sh [DIR]     (DIR default: .cuda-wheels in the repository)
# candle 0.11 compiles its kernels with nvcc and links cuBLAS, cuRAND and the CUDA runtime;
# NVIDIA's PyPI wheels of CUDA 13.0 ship all of them (nvcc 13.0 writes PTX 9.0, which
# driver 580 loads). No wheel ships the driver library, so a link-time stub of libcuda is
# made from cuda.h; the real one comes with the driver on the GPU machine.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheels=${1:-$here/.cuda-wheels}
cuda="$wheels/nvidia/cu13"
if [ ! -x "$cuda/bin/nvcc" ]; then
    python3 -m pip install -q --no-deps --target "$wheels" \
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
        nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 || return 1
fi
for lib in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
    ln -sf "lib$lib" "$cuda/lib/lib${lib%%.so*}.so"
done
if [ ! -f "$cuda/lib/stubs/libcuda.so" ]; then
    mkdir -p "$cuda/lib/stubs"
    gcc -E -P -I"$cuda/include" "$cuda/include/cuda.h" | tr '\n' ' ' \
        | grep -oE 'CUresult +cu[A-Za-z0-9_]+ *\(' | grep -oE 'cu[A-Za-z0-9_]+' | sort -u \
        | sed 's/.*/int &(void){return 999;}/' > "$cuda/lib/stubs/cuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/stubs/libcuda.so" "$cuda/lib/stubs/cuda_stub.c" || return 1
fi
export CUDA_HOME="$cuda" PATH="$cuda/bin:$PATH" CUDA_COMPUTE_CAP=90
export LIBRARY_PATH="$cuda/lib:$cuda/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
