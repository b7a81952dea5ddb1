//! The bitcode → PTX link step, run when rustc calls the builder's own process as the kernel
//! crate's linker.
//!
//! rustc's nvptx target expects `llvm-bitcode-linker`, a component many installs cannot add.
//! rustc calls its linker with `--export-symbol K …`, the crate's bitcode object(s), rlibs,
//! `--target-cpu`, optional `--target-feature`, and `-o out.ptx`. With fat LTO the crate's
//! object already holds every function it uses, so the rlibs are not read. We then run:
//! `llvm-link` (merge the objects) → `opt` (internalize all but the kernels, drop dead code,
//! O3) → `llc` (PTX for the target CPU).

use std::path::PathBuf;
use std::process::Command;

/// Set (to the LLVM tools' folder) when the process is invoked as the linker.
pub(crate) const LINKER_MODE_VARIABLE: &str = "NVPTX_BUILDER_LINK";

/// The link step, from the arguments rustc passes.
pub(crate) fn run(llvm_bin: PathBuf, args: &[String]) -> Result<(), String> {
    let mut exports = Vec::new();
    let mut objects = Vec::new();
    let mut output = None;
    let mut cpu = None;
    let mut features = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--export-symbol" => exports.push(args.next().ok_or("--export-symbol without a name")?.clone()),
            "-o" => output = Some(args.next().ok_or("-o without a path")?.clone()),
            "--target-cpu" => cpu = Some(args.next().ok_or("--target-cpu without a value")?.clone()),
            "--target-feature" => features.push(args.next().ok_or("--target-feature without a value")?.clone()),
            "-L" | "--target" => {
                args.next();
            }
            other if other.starts_with("--target-feature=") => {
                features.push(other["--target-feature=".len()..].to_string())
            }
            other if other.ends_with(".o") => objects.push(other.to_string()),
            _ => {}
        }
    }
    let output = PathBuf::from(output.ok_or("the linker was given no -o")?);
    let cpu = cpu.ok_or("the linker was given no --target-cpu")?;
    if objects.is_empty() {
        return Err("the linker was given no bitcode object".into());
    }
    if exports.is_empty() {
        return Err("the kernel crate exports no kernel (missing #[unsafe(no_mangle)]?)".into());
    }
    let linked = output.with_extension("linked.bc");
    let optimized = output.with_extension("opt.bc");
    run_tool(Command::new(llvm_bin.join("llvm-link")).args(&objects).arg("-o").arg(&linked))?;
    run_tool(
        Command::new(llvm_bin.join("opt"))
            .arg(&linked)
            .arg("-passes=internalize,globaldce,default<O3>")
            .arg(format!("-internalize-public-api-list={}", exports.join(",")))
            .arg("-o")
            .arg(&optimized),
    )?;
    let mut llc = Command::new(llvm_bin.join("llc"));
    llc.arg(&optimized).arg(format!("-mcpu={cpu}")).arg("-o").arg(&output);
    if !features.is_empty() {
        llc.arg(format!("-mattr={}", features.join(",")));
    }
    run_tool(&mut llc)
}

fn run_tool(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed with {status}")) }
}
