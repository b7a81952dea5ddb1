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
    let kernels = parse_log(&log);
    let over = over_budget(&kernels, budget);
    if !over.is_empty() {
        return Err(Error::Budget(format!("kernels over the budget ({arch}):\n{}", over.join("\n"))));
    }
    Ok(kernels)
}

/// Every entry's resources from a `ptxas -v` log, sorted by name. Functions that are not
/// entries (a panic path, say) are skipped: their lines follow an entry's but name another
/// function.
fn parse_log(log: &str) -> Vec<KernelResources> {
    let mut kernels: Vec<KernelResources> = Vec::new();
    let mut in_entry = false;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            kernels.push(KernelResources { name, ..Default::default() });
            in_entry = true;
        } else if let Some(function) = line.split("Function properties for ").nth(1) {
            in_entry = kernels.last().is_some_and(|k| k.name == function.trim());
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
    kernels
}

/// One line per kernel and limit it breaks.
fn over_budget(kernels: &[KernelResources], budget: &Budget) -> Vec<String> {
    let mut over = Vec::new();
    for k in kernels {
        if !budget.allow_local_memory && k.stack_frame + k.spill_stores + k.spill_loads > 0 {
            over.push(format!(
                "{}: {} B stack frame, {} B spill stores, {} B spill loads (local memory)",
                k.name, k.stack_frame, k.spill_stores, k.spill_loads
            ));
        }
        if let Some(max) = budget.max_registers.filter(|&max| k.registers > max) {
            over.push(format!("{}: {} registers > {max}", k.name, k.registers));
        }
    }
    over
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines in the format ptxas 12.9 prints with `-v`: an entry with static shared memory, a
    /// panic function that follows it, an entry with a stack frame and spills.
    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'tile' for 'sm_90a'
ptxas info    : Function properties for tile
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 392 bytes cmem[0]
ptxas info    : Compile time = 2.771 ms
ptxas info    : Function properties for _RNvNtCs0_4core9panicking9panic_fmt
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'merge' for 'sm_90a'
ptxas info    : Function properties for merge
    64 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 64 bytes cumulative stack size
ptxas info    : Compile time = 2.464 ms
";

    fn kernel(name: &str, registers: u32, stack_frame: u32, spills: (u32, u32), shared: u32) -> KernelResources {
        let (spill_stores, spill_loads) = spills;
        KernelResources { name: name.into(), registers, stack_frame, spill_stores, spill_loads, shared }
    }

    #[test]
    fn the_log_gives_each_entrys_resources_and_skips_other_functions() {
        assert_eq!(parse_log(LOG), [kernel("merge", 8, 64, (8, 4), 0), kernel("tile", 168, 0, (0, 0), 1024)]);
    }

    #[test]
    fn the_default_budget_forbids_local_memory_and_a_register_limit_is_enforced() {
        let kernels = parse_log(LOG);
        assert_eq!(
            over_budget(&kernels, &Budget::default()),
            ["merge: 64 B stack frame, 8 B spill stores, 4 B spill loads (local memory)"]
        );
        let budget = Budget { max_registers: Some(128), allow_local_memory: true, ..Budget::default() };
        assert_eq!(over_budget(&kernels, &budget), ["tile: 168 registers > 128"]);
    }
}
