//! The PTX the host runs, embedded at compile time, and the names of its kernels.
//!
//! `host/ptx/kernels.ptx` is written by `cargo xtask build-kernels` from `kernels/` and
//! committed, so building the host needs no nightly-only component; CI rebuilds it and fails
//! if the committed file is stale (`cargo xtask build-kernels --check`).

/// The kernels' PTX for sm_90.
pub const PTX: &str = include_str!("../ptx/kernels.ptx");

/// Every kernel the host launches; all are looked up once when a sampler is created.
pub const KERNELS: &[&str] = &[
    "fused_bf16_n8",
    "fused_bf16_n16",
    "fused_bf16_n32",
    "fused_f16_n8",
    "fused_f16_n16",
    "fused_f16_n32",
    "fused_simt_f32",
    "fused_simt_bf16",
    "fused_simt_f16",
    "logits_gemm_bf16_n8",
    "logits_gemm_bf16_n16",
    "logits_gemm_bf16_n32",
    "logits_gemm_f16_n8",
    "logits_gemm_f16_n16",
    "logits_gemm_f16_n32",
    "fused_tma_bf16_m64_n8",
    "fused_tma_bf16_m64_n16",
    "fused_tma_bf16_m64_n32",
    "fused_tma_bf16_m64_n64",
    "fused_tma_bf16_m64_n128",
    "fused_tma_bf16_m128_n8",
    "fused_tma_bf16_m128_n16",
    "fused_tma_bf16_m128_n32",
    "fused_tma_bf16_m128_n64",
    "fused_tma_bf16_m128_n128",
    "fused_tma_f16_m64_n8",
    "fused_tma_f16_m64_n16",
    "fused_tma_f16_m64_n32",
    "fused_tma_f16_m64_n64",
    "fused_tma_f16_m64_n128",
    "fused_tma_f16_m128_n8",
    "fused_tma_f16_m128_n16",
    "fused_tma_f16_m128_n32",
    "fused_tma_f16_m128_n64",
    "fused_tma_f16_m128_n128",
    "fused_tma_bf16_h128_n64",
    "fused_tma_bf16_h128_n128",
    "fused_tma_f16_h128_n64",
    "fused_tma_f16_h128_n128",
    "logits_tma_bf16_m64_n8",
    "logits_tma_bf16_m64_n16",
    "logits_tma_bf16_m64_n32",
    "logits_tma_bf16_m64_n64",
    "logits_tma_bf16_m64_n128",
    "logits_tma_bf16_m128_n8",
    "logits_tma_bf16_m128_n16",
    "logits_tma_bf16_m128_n32",
    "logits_tma_bf16_m128_n64",
    "logits_tma_bf16_m128_n128",
    "logits_tma_f16_m64_n8",
    "logits_tma_f16_m64_n16",
    "logits_tma_f16_m64_n32",
    "logits_tma_f16_m64_n64",
    "logits_tma_f16_m64_n128",
    "logits_tma_f16_m128_n8",
    "logits_tma_f16_m128_n16",
    "logits_tma_f16_m128_n32",
    "logits_tma_f16_m128_n64",
    "logits_tma_f16_m128_n128",
    "sample_logits",
    "reduce_candidates",
    "fill_uniform_bf16",
    "fill_uniform_f16",
    "fill_uniform_f32",
    "read_probe",
    "gumbel_estimate_error",
];

#[cfg(test)]
mod tests {
    #[test]
    fn every_listed_kernel_is_in_the_ptx() {
        for name in super::KERNELS {
            assert!(
                super::PTX.contains(&format!(".visible .entry {name}(")),
                "{name} missing from host/ptx/kernels.ptx"
            );
        }
    }
}
