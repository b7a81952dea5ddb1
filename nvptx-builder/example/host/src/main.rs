//! Launches the example kernel with cudarc and checks every value against the CPU.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

const SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/saxpy_sm80.ptx"));
const SM90A: &str = include_str!(concat!(env!("OUT_DIR"), "/saxpy_sm90a.ptx"));

fn main() -> Result<(), Box<dyn Error>> {
    // SAFETY: probing only opens and closes the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("no NVIDIA driver here: the PTX was built (see the build log); run this on a GPU to launch it");
        return Ok(());
    }
    let context = CudaContext::new(0)?;
    let (major, minor) = context.compute_capability()?;
    // sm_90a PTX loads on compute capability 9.0 only; sm_80 PTX on everything from 8.0.
    let (arch, ptx) = if (major, minor) == (9, 0) { ("sm_90a", SM90A) } else { ("sm_80", SM80) };
    let stream = context.default_stream();
    let module = context.load_module(Ptx::from_src(ptx))?;
    let saxpy = module.load_function("saxpy")?;
    let n = 1u32 << 20;
    let a = 0.75f32;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5 - 100.0).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 1.25).collect();
    let x_device = stream.clone_htod(&x)?;
    let mut y_device = stream.clone_htod(&y)?;
    let mut launch = stream.launch_builder(&saxpy);
    launch.arg(&a).arg(&x_device).arg(&mut y_device).arg(&n);
    // SAFETY: the arguments are the kernel's (f32, *const f32, *mut f32, u32) with buffers of n
    // floats, and the grid covers n threads.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n))? };
    let got = stream.clone_dtoh(&y_device)?;
    // Plain `a * x + y` is not contracted into an FMA on either side, so the results are equal
    // bit for bit.
    let equal = got.iter().zip(x.iter().zip(&y)).filter(|(g, (x, y))| g.to_bits() == (a * *x + *y).to_bits()).count();
    println!("saxpy on {} ({arch} PTX): {equal} of {n} values equal the CPU's", context.name()?);
    if equal != n as usize {
        return Err("the GPU's values differ from the CPU's".into());
    }
    Ok(())
}
