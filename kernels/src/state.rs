//! Device state the host would otherwise write with a copy: the decode step of row parameters
//! and a call's tensor maps. Written by kernels, both are ordered on the caller's stream and can
//! be captured in a CUDA graph, where a host-to-device copy from pageable memory cannot.

use flashsample_core::abi::AdvanceStepsArgs;

use crate::arch;

/// `row_params[b].step += by` (wrapping) for every `b < batch`.
///
/// # Safety
/// `args.row_params` holds `args.batch` row parameters no other kernel touches meanwhile.
#[inline(always)]
pub unsafe fn advance_steps(args: &AdvanceStepsArgs) {
    let (mut b, stride) = arch::global_thread();
    while b < args.batch as u64 {
        let row = args.row_params.add(b).as_mut_ptr();
        // SAFETY: `b < batch`: inside the row parameters (this function's contract).
        unsafe { (*row).step = (*row).step.wrapping_add(args.by) };
        b += stride;
    }
}

/// One thread writes both maps (static indices keep the argument block out of local memory),
/// then releases its stores to the tensor-map proxy, which the TMA producer acquires before its
/// first load.
///
/// # Safety
/// `args.destination` holds two 64-byte aligned tensor maps in global memory that no kernel
/// reads meanwhile.
#[cfg(flashsample_module = "hopper")]
#[inline(always)]
pub unsafe fn store_tensor_maps(args: &flashsample_core::abi::StoreTensorMapsArgs) {
    if arch::block_index() != 0 || arch::thread_index() != 0 {
        return;
    }
    let words = args.destination.address() as *mut u64;
    for word in 0..16 {
        // SAFETY: words `0 .. 32` are the two maps of the destination (this function's contract).
        unsafe {
            *words.add(word) = args.lm_head[word];
            *words.add(16 + word) = args.hidden[word];
        }
    }
    // SAFETY: a fence.
    unsafe { crate::hopper::release_tensor_map() };
}
