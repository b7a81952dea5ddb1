//! Validating PTX with `ptxas`: the per-kernel resource table and the budgets.

use std::path::Path;
use std::process::Command;

use crate::Error;

/// What `ptxas -v` reports for one kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub stack_frame: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Static shared memory in bytes.
    pub shared: u32,
}

/// Limits every kernel must keep; a build that breaks one fails. The default: any register
/// count, no local memory, no performance notices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    /// Most registers per thread (`None`: any).
    pub max_registers: Option<u32>,
    /// Whether a stack frame or spills (local memory) are allowed.
    ///
    /// Why forbid them by default: local memory in a kernel means a register array indexed at
    /// run time or more live values than registers, and both cost memory traffic on the hot
    /// path. A build that introduces one should fail where it happens, not in a benchmark.
    pub allow_local_memory: bool,
    /// Whether a ptxas "Potential Performance Loss" notice is allowed. ptxas prints one when
    /// it drops an instruction the kernel relies on, for example every `setmaxnreg` of a
    /// kernel with `.maxntid` but no `.minnctapersm` (C7508).
    pub allow_performance_notices: bool,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].trim_end().rsplit([' ', ',']).next()?.parse().ok()
}

/// Runs `ptxas -arch=<arch> -v` on `ptx`, enforces `budget` and returns every kernel's resources.
pub fn validate(ptxas: &Path, ptx: &Path, arch: &str, budget: &Budget) -> Result<Vec<KernelResources>, Error> {
    let output = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(ptx)
        .args(["-o", "/dev/null"])
        .output()
        .map_err(|e| Error::Ptxas(format!("cannot run {}: {e}", ptxas.display())))?;
    let log = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(Error::Ptxas(format!("ptxas rejected {}:\n{log}", ptx.display())));
    }
    let notices: Vec<&str> = log.lines().filter(|line| line.contains("Potential Performance Loss")).collect();
    if !notices.is_empty() && !budget.allow_performance_notices {
        return Err(Error::Budget(format!(
            "ptxas reports a performance loss in {}:\n{}",
            ptx.display(),
            notices.join("\n")
        )));
    }
    let mut kernels: Vec<KernelResources> = Vec::new();
    let mut in_entry = false;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            kernels.push(KernelResources { name, ..Default::default() });
            in_entry = true;
        } else if line.contains("Function properties for") {
            // Properties of a non-entry function (e.g. a panic path) follow; only entries count.
            in_entry = line.contains(kernels.last().map(|k| k.name.as_str()).unwrap_or("\u{0}"));
        } else if let (true, Some(kernel)) = (in_entry, kernels.last_mut()) {
            if line.contains("stack frame") {
                kernel.stack_frame = number_before(line, "bytes stack frame").unwrap_or(0);
                kernel.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                kernel.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                kernel.registers = number_before(line, "registers").unwrap_or(0);
                kernel.shared = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    kernels.sort_by(|a, b| a.name.cmp(&b.name));
    let mut over = Vec::new();
    for k in &kernels {
        if !budget.allow_local_memory && k.stack_frame + k.spill_stores + k.spill_loads > 0 {
            over.push(format!("{}: {} B stack, {} B spilled", k.name, k.stack_frame, k.spill_stores));
        }
        if let Some(max) = budget.max_registers.filter(|&max| k.registers > max) {
            over.push(format!("{}: {} registers > {max}", k.name, k.registers));
        }
    }
    if !over.is_empty() {
        return Err(Error::Budget(format!("kernels over the budget ({arch}):\n{}", over.join("\n"))));
    }
    Ok(kernels)
}

/// The resource table, one line per kernel.
pub fn table(arch: &str, kernels: &[KernelResources]) -> String {
    let mut out = format!("ptxas -arch={arch}: {} kernels\n", kernels.len());
    out.push_str(&format!(
        "{:<24} {:>9} {:>11} {:>12} {:>11} {:>11}\n",
        "kernel", "registers", "stack (B)", "spill st (B)", "spill ld (B)", "static smem"
    ));
    for k in kernels {
        out.push_str(&format!(
            "{:<24} {:>9} {:>11} {:>12} {:>11} {:>11}\n",
            k.name, k.registers, k.stack_frame, k.spill_stores, k.spill_loads, k.shared
        ));
    }
    out
}
