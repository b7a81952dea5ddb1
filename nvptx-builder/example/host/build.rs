//! Builds `../kernel` into PTX for Ampere and newer (sm_80) and for Hopper (sm_90a), validated
//! by ptxas when one is found; `main.rs` embeds both.

use std::path::PathBuf;

use nvptx_builder::{Budget, PtxBuilder, Target};

fn main() {
    // rustc calls this build script back as the kernel crate's linker.
    nvptx_builder::link_if_invoked();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    let built = PtxBuilder::new("../kernel")
        .target(Target::new("sm_80").ptx_isa(7, 0).output(out.join("saxpy_sm80.ptx")))
        .target(Target::new("sm_90a").ptx_isa(8, 0).output(out.join("saxpy_sm90a.ptx")))
        .validate(Budget::default())
        // The example insists on validation; without ptxas the error says how to get it.
        .require_ptxas()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    for target in built {
        if let Some(resources) = target.resources {
            println!("cargo:warning={}", nvptx_builder::table(&target.target.cpu, &resources).replace('\n', " | "));
        }
    }
}
