//! Which tile kernel computes the logits tile: the [`Variant`] a caller may force, the
//! dispatcher's choice, and the registry kernels each variant launches.

use flashsample_core::abi::{HANDOFF_COLUMNS, HANDOFF_ROWS, N_TILE, STAGED_COLUMNS, TILE_ROWS, TMA_ITEM_ROWS};
use flashsample_core::registry::{ElementType, Kernel, Module};

use crate::error::{Result, invalid};
use crate::tensor::DType;

/// Batch-tile widths of the register-direct mma kernels.
pub const MMA_COLUMNS: [u32; 3] = [8, 16, 32];
/// The narrowest register-direct mma tile that holds `batch` columns, if one does.
fn narrowest_mma(batch: usize) -> Option<Variant> {
    MMA_COLUMNS.into_iter().find(|&c| batch <= c as usize).map(|columns| Variant::Mma { columns })
}

/// The `mma.sync` tile for `batch` columns: the narrowest register-direct width that holds
/// B, else the staged tile of 64 columns (faster than 128 columns at every B measured but one,
/// docs/PERF.md). The portable module's choice for tensor cores, and the tile that writes the
/// truncations' lists in place of the Hopper module's cooperative TMA tile at small B.
pub(crate) fn mma_sync_tile(batch: usize) -> Variant {
    narrowest_mma(batch).unwrap_or(Variant::Staged { columns: 64 })
}

/// The handoff tile for `batch` columns: 64 columns up to B = 64, else 128. The Hopper
/// module's choice past B = 32, and the tile that writes the truncations' lists in place of
/// the cooperative TMA tile past B = 16.
pub(crate) fn handoff_tile(batch: usize) -> Variant {
    Variant::TmaHandoff { columns: if batch <= 64 { 64 } else { 128 } }
}

/// Batch-tile widths of the TMA + `wgmma` kernels.
pub const TMA_COLUMNS: [u32; 5] = [8, 16, 32, 64, 128];

/// Which tile kernel computes the logits tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The dispatcher's choice for the module, dtype, D and B.
    Auto,
    /// Register-direct `mma.sync` tile with 8, 16 or 32 batch columns (BF16/F16, `D % 8 == 0`);
    /// in both modules.
    Mma {
        /// Batch columns per work item.
        columns: u32,
    },
    /// Staged `mma.sync` tile with 64 or 128 batch columns: `W` and `H` through shared memory
    /// by a `cp.async` ring, fragments by `ldmatrix`, so each chunk of `W` is read once for all
    /// the item's columns (BF16/F16, `D % 8 == 0`); in both modules.
    Staged {
        /// Batch columns per work item.
        columns: u32,
    },
    /// TMA + `wgmma` tile (Hopper module) on items of `rows` (64: ping-pong warpgroups; 128:
    /// both warpgroups on one item) × `columns` (8, 16, 32, 64 or 128); BF16/F16, `D % 8 == 0`.
    Tma {
        /// Vocabulary rows per work item.
        rows: u32,
        /// Batch columns per work item.
        columns: u32,
    },
    /// The cooperative TMA + `wgmma` tile (Hopper module) on items of 128 rows × `columns` (64
    /// or 128) whose sampling epilogue runs in warps of its own while the next item
    /// multiplies; BF16/F16, `D % 8 == 0`. The unfused pipeline runs `Tma { rows: 128, columns }`
    /// for it.
    TmaHandoff {
        /// Batch columns per work item.
        columns: u32,
    },
    /// CUDA-core tile, any dtype and any D; in both modules.
    Simt,
}

impl Variant {
    /// The variant for this problem: tensor cores when the dtype and D allow, then by module
    /// and B (from the forced variants of the benchmarks, docs/PERF.md).
    ///
    /// Hopper module:
    /// - B ≤ 32: the cooperative TMA tile (`Tma { rows: 128, columns }`) with the narrowest
    ///   width of 8, 16 and 32 that holds B;
    /// - 32 < B ≤ 64: the handoff tile with 64 columns;
    /// - B > 64: the handoff tile with 128 columns, which stages each byte of `H` for 128 rows
    ///   of `W` and runs the sampling epilogue beside the next item's multiplies.
    ///
    /// Portable module: the register-direct `mma.sync` tile with the narrowest width of 8, 16
    /// and 32 that holds B; above 32 the staged tile of 64 columns (it reads each chunk of `W`
    /// once per item, where the register-direct tile reads it once per 32 columns).
    #[cfg(any(test, feature = "internals"))]
    pub fn resolve(self, module: Module, dtype: DType, dim: usize, batch: usize) -> Result<Variant> {
        self.resolve_aligned(module, dtype, dim, batch, true)
    }

    /// As [`Variant::resolve`] for matrices whose start and row stride are (`aligned`) or are
    /// not all multiples of 16 bytes: the tensor-core tiles load 16-byte vectors, so unaligned
    /// matrices get the SIMT tile.
    pub fn resolve_aligned(
        self,
        module: Module,
        dtype: DType,
        dim: usize,
        batch: usize,
        aligned: bool,
    ) -> Result<Variant> {
        let tensor_cores = dtype != DType::F32 && dim.is_multiple_of(8) && aligned;
        let needs_tensor_cores = |name: &str| {
            Err(invalid(
                "variant",
                format!(
                    "the {name} kernels need BF16 or F16, D % 8 == 0 and 16-byte aligned rows (got {dtype}, D = {dim}{})",
                    if aligned { "" } else { ", rows not 16-byte aligned" }
                ),
            ))
        };
        let hopper = module == Module::Hopper;
        match self {
            Variant::Auto if !tensor_cores => Ok(Variant::Simt),
            Variant::Auto if !hopper => Ok(mma_sync_tile(batch)),
            Variant::Auto if batch <= 32 => Ok(Variant::Tma {
                rows: 128,
                columns: TMA_COLUMNS.into_iter().find(|&c| batch <= c as usize).unwrap_or(32),
            }),
            Variant::Auto => Ok(handoff_tile(batch)),
            Variant::Mma { columns } if !MMA_COLUMNS.contains(&columns) => {
                Err(invalid("variant", format!("Mma {{ columns: {columns} }}: columns must be 8, 16 or 32")))
            }
            Variant::Staged { columns } if !STAGED_COLUMNS.contains(&columns) => {
                Err(invalid("variant", format!("Staged {{ columns: {columns} }}: columns must be 64 or 128")))
            }
            Variant::Tma { rows, columns } if !TMA_ITEM_ROWS.contains(&rows) || !TMA_COLUMNS.contains(&columns) => {
                Err(invalid(
                    "variant",
                    format!(
                        "Tma {{ rows: {rows}, columns: {columns} }}: rows must be 64 or 128, columns 8, 16, 32, 64 or 128"
                    ),
                ))
            }
            Variant::TmaHandoff { columns } if !HANDOFF_COLUMNS.contains(&columns) => {
                Err(invalid("variant", format!("TmaHandoff {{ columns: {columns} }}: columns must be 64 or 128")))
            }
            Variant::Tma { .. } | Variant::TmaHandoff { .. } if !hopper => Err(invalid(
                "variant",
                format!(
                    "{self:?} needs the Hopper module (TMA and wgmma); this sampler runs the {} module",
                    module.name()
                ),
            )),
            Variant::Mma { .. } if !tensor_cores => needs_tensor_cores("mma"),
            Variant::Staged { .. } if !tensor_cores => needs_tensor_cores("staged mma"),
            Variant::Tma { .. } | Variant::TmaHandoff { .. } if !tensor_cores => needs_tensor_cores("TMA"),
            other => Ok(other),
        }
    }

    /// Every tensor-core variant that can be forced with `module`: the mma widths, the staged
    /// widths, then (Hopper) both TMA item heights at every width and the handoff widths.
    #[cfg(any(test, feature = "internals"))]
    pub fn tensor_core(module: Module) -> impl Iterator<Item = Variant> {
        let mma = MMA_COLUMNS.map(|columns| Variant::Mma { columns });
        let staged = STAGED_COLUMNS.map(|columns| Variant::Staged { columns });
        let tma = TMA_ITEM_ROWS.into_iter().flat_map(|rows| TMA_COLUMNS.map(|columns| Variant::Tma { rows, columns }));
        let handoff = HANDOFF_COLUMNS.map(|columns| Variant::TmaHandoff { columns });
        let hopper = (module == Module::Hopper).then_some(tma.chain(handoff));
        mma.into_iter().chain(staged).chain(hopper.into_iter().flatten())
    }

    /// Batch columns per work item.
    pub(crate) fn columns(self) -> u32 {
        match self {
            Variant::Mma { columns }
            | Variant::Staged { columns }
            | Variant::Tma { columns, .. }
            | Variant::TmaHandoff { columns } => columns,
            _ => N_TILE,
        }
    }

    /// Vocabulary rows per tile-kernel work item (one candidate per row, draw and such tile).
    pub(crate) fn tile_rows(self) -> u32 {
        match self {
            Variant::Tma { rows, .. } => rows,
            Variant::TmaHandoff { .. } => HANDOFF_ROWS,
            _ => TILE_ROWS,
        }
    }

    /// The TMA boxes a TMA variant reads: (rows of `W`, rows of `H`).
    pub(crate) fn tma_boxes(self) -> Option<(u32, u32)> {
        match self {
            Variant::Tma { rows, columns } => Some((rows, columns)),
            Variant::TmaHandoff { columns } => Some((HANDOFF_ROWS, columns)),
            _ => None,
        }
    }

    /// The tile kernel of fused sampling for a resolved variant.
    pub(crate) fn fused_kernel(self, dtype: DType) -> Kernel {
        let element = element_type(dtype);
        match self {
            Variant::Mma { columns } => Kernel::FusedMma { element, columns, chains: false },
            Variant::Staged { columns } => Kernel::FusedStaged { element, columns, chains: false },
            Variant::Tma { rows, columns } => Kernel::FusedTma { element, rows, columns },
            Variant::TmaHandoff { columns } => Kernel::FusedHandoff { element, columns },
            Variant::Simt | Variant::Auto => Kernel::FusedSimt { element, chains: false },
        }
    }

    /// The chain kernel of a resolved `mma.sync` or SIMT variant: `None` for the TMA tiles,
    /// which write no chains, and for the staged tile of 128 columns, whose chains (six per
    /// column) would pass the 99 KiB of shared memory Ada and consumer Ampere give a block.
    pub(crate) fn chains_kernel(self, dtype: DType) -> Option<Kernel> {
        let element = element_type(dtype);
        match self {
            Variant::Mma { columns } => Some(Kernel::FusedMma { element, columns, chains: true }),
            Variant::Staged { columns: 64 } => Some(Kernel::FusedStaged { element, columns: 64, chains: true }),
            Variant::Staged { .. } => None,
            Variant::Simt | Variant::Auto => Some(Kernel::FusedSimt { element, chains: true }),
            Variant::Tma { .. } | Variant::TmaHandoff { .. } => None,
        }
    }

    /// The unfused pipeline's GEMM for a resolved variant (the handoff tile's is the
    /// cooperative TMA GEMM of its width; [`Variant::Auto`], unresolved, is the SIMT tile's).
    pub(crate) fn logits_kernel(self, dtype: DType) -> Kernel {
        let element = element_type(dtype);
        match self {
            Variant::Mma { columns } => Kernel::LogitsMma { element, columns },
            Variant::Staged { columns } => Kernel::LogitsStaged { element, columns },
            Variant::Tma { rows, columns } => Kernel::LogitsTma { element, rows, columns },
            Variant::TmaHandoff { columns } => Kernel::LogitsTma { element, rows: HANDOFF_ROWS, columns },
            Variant::Simt | Variant::Auto => Kernel::LogitsSimt { element },
        }
    }
}

/// The registry's element type of `dtype`.
pub(crate) fn element_type(dtype: DType) -> ElementType {
    match dtype {
        DType::BF16 => ElementType::Bf16,
        DType::F16 => ElementType::F16,
        DType::F32 => ElementType::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashsample_core::registry::KERNELS;

    /// Every kernel a resolved variant launches is in the registry and in the module the
    /// variant resolved for.
    #[test]
    fn dispatched_kernels_are_registry_kernels_of_their_module() {
        let listed = |kernel: Kernel| KERNELS.iter().any(|e| e.kernel == kernel);
        for module in Module::ALL {
            for dtype in [DType::BF16, DType::F16] {
                for variant in Variant::tensor_core(module) {
                    let variant = variant.resolve(module, dtype, 4096, 16).unwrap();
                    assert!(listed(variant.fused_kernel(dtype)) && module.holds(variant.fused_kernel(dtype)));
                    let logits = variant.logits_kernel(dtype);
                    assert!(listed(logits) && module.holds(logits), "{variant:?}");
                    if let Some(chains) = variant.chains_kernel(dtype) {
                        assert!(listed(chains) && module.holds(chains), "{variant:?}");
                    }
                }
            }
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                assert!(module.holds(Variant::Simt.fused_kernel(dtype)));
                assert!(Variant::Simt.chains_kernel(dtype).is_some_and(|k| module.holds(k)));
                assert!(module.holds(Variant::Simt.logits_kernel(dtype)));
            }
            // The dispatcher's tiles apply the per-entry steps and sum log-sum-exp terms, so
            // processed calls and log-probabilities stay fused at every B.
            for batch in [1, 8, 9, 16, 17, 64, 65, 128, 129, 1024] {
                let variant = Variant::Auto.resolve(module, DType::BF16, 4096, batch).unwrap();
                let kernel = variant.fused_kernel(DType::BF16);
                assert!(module.holds(kernel), "{module:?} B = {batch}");
                assert!(kernel.applies_processing() && kernel.writes_tile_sums(), "{module:?} B = {batch}");
            }
        }
    }

    #[test]
    fn the_portable_module_dispatches_mma_tiles_and_refuses_tma() {
        let resolve = |batch| Variant::Auto.resolve(Module::Portable, DType::BF16, 4096, batch).unwrap();
        assert_eq!(resolve(1), Variant::Mma { columns: 8 });
        assert_eq!(resolve(16), Variant::Mma { columns: 16 });
        assert_eq!(resolve(17), Variant::Mma { columns: 32 });
        assert_eq!(resolve(32), Variant::Mma { columns: 32 });
        assert_eq!(resolve(33), Variant::Staged { columns: 64 });
        assert_eq!(resolve(64), Variant::Staged { columns: 64 });
        assert_eq!(resolve(65), Variant::Staged { columns: 64 });
        assert_eq!(resolve(256), Variant::Staged { columns: 64 });
        assert_eq!(Variant::Auto.resolve(Module::Portable, DType::F32, 4096, 4).unwrap(), Variant::Simt);
        let tma = Variant::Tma { rows: 128, columns: 8 }.resolve(Module::Portable, DType::BF16, 4096, 1);
        assert!(tma.unwrap_err().to_string().contains("needs the Hopper module"));
        assert_eq!(Variant::tensor_core(Module::Portable).count(), MMA_COLUMNS.len() + STAGED_COLUMNS.len());
    }

    /// Every TMA kernel's dynamic shared memory fits one block of an sm_90 multiprocessor, with
    /// at least two stages so that loads overlap multiplies (a launch asking for more fails).
    /// The portable module's kernels fit the smallest per-block shared memory of the GPUs it
    /// runs on (Ada and consumer Ampere: 99 KiB), so that none of them fails to launch there.
    #[test]
    fn portable_kernels_fit_every_supported_gpu() {
        const SM86_SHARED_LIMIT_BYTES: u32 = 99 * 1024;
        for entry in Module::Portable.kernels() {
            assert!(entry.kernel.shared_bytes() <= SM86_SHARED_LIMIT_BYTES, "{}", entry.name);
        }
    }

    #[test]
    fn tma_kernels_fit_in_shared_memory_with_two_stages() {
        use flashsample_core::abi::{SM90_SHARED_LIMIT_BYTES, tma_handoff_stages, tma_stages};
        for entry in KERNELS.iter().filter(|e| e.kernel.needs_hopper()) {
            assert!(entry.kernel.shared_bytes() <= SM90_SHARED_LIMIT_BYTES, "{}", entry.name);
        }
        for rows in TMA_ITEM_ROWS {
            for columns in TMA_COLUMNS {
                assert!(tma_stages(rows, columns) >= 2, "Tma {{ {rows}, {columns} }}");
            }
        }
        for columns in HANDOFF_COLUMNS {
            assert!(tma_handoff_stages(columns) >= 2, "TmaHandoff {{ {columns} }}");
        }
    }
}
