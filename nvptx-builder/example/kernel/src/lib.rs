//! `y = a·x + y` on the GPU: the smallest kernel crate `nvptx-builder` builds.
#![no_std]
#![feature(abi_ptx, stdarch_nvptx)]

use core::arch::nvptx;

/// A panic can only stop the kernel.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: `trap` aborts the kernel; it has no other effect.
    unsafe { nvptx::trap() }
}

/// `y[i] = a · x[i] + y[i]` for every `i < n`, one thread per element.
///
/// # Safety
/// `x` and `y` are device addresses of `n` floats each; launch at least `n` threads in all.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn saxpy(a: f32, x: *const f32, y: *mut f32, n: u32) {
    // SAFETY: reading the special registers has no precondition.
    let i = unsafe { nvptx::_block_idx_x() * nvptx::_block_dim_x() + nvptx::_thread_idx_x() } as u32;
    if i < n {
        // SAFETY: `i < n`, and both arrays hold `n` floats (this function's contract).
        unsafe { *y.add(i as usize) = a * *x.add(i as usize) + *y.add(i as usize) };
    }
}
