//! The bitcode → PTX link step, run when rustc calls this binary as the kernel crate's linker.
//!
//! rustc's nvptx target expects `llvm-bitcode-linker`, which cannot be installed here. It
//! calls its linker with `--export-symbol K …`, the crate's bitcode object(s), rlibs,
//! `--target-cpu`, optional `--target-feature`, and `-o out.ptx`. With fat LTO the crate's
//! object already holds every function it uses, so the rlibs are not read. We then run:
//! `llvm-link` (merge the objects) → `opt` (internalize all but the kernels, drop dead code,
//! O3) → `llc` (PTX for the target CPU).

use std::path::PathBuf;
use std::process::Command;

use flashsample_core::registry::Kernel;

/// Set (to the LLVM tools' folder) when this binary is invoked as the linker.
pub const LINKER_MODE_VARIABLE: &str = "FLASHSAMPLE_PTX_LINK";

pub fn run(args: &[String]) -> Result<(), String> {
    let llvm_bin = PathBuf::from(std::env::var_os(LINKER_MODE_VARIABLE).expect("checked by main"));
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
    run_tool(&mut llc)?;
    let ptx = std::fs::read_to_string(&output).map_err(|e| format!("cannot read {}: {e}", output.display()))?;
    std::fs::write(&output, add_launch_bounds(&ptx)).map_err(|e| format!("cannot write {}: {e}", output.display()))
}

/// Adds `.maxntid` to every kernel that declares launch bounds in the registry
/// ([`Kernel::launch_bounds`]): rustc has no attribute for NVVM launch bounds.
fn add_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut bounds = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            bounds = Kernel::named(entry.split('(').next().unwrap_or(entry)).and_then(Kernel::launch_bounds);
        } else if let Some(threads) = bounds.filter(|_| line.starts_with(')')) {
            out.push_str(&format!(".maxntid {threads}, 1, 1\n"));
            bounds = None;
        }
    }
    out
}

fn run_tool(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed with {status}")) }
}
