//! Validates PTX with `ptxas` and prints each kernel's resources; enforces the budgets.
//!
//! Budget: no kernel may use a stack frame or spill. Local memory in these kernels means a
//! register array indexed at run time or too many live values, both of which cost bandwidth
//! on the hot path, so a build that introduces one fails here rather than in a benchmark.
//! A "Potential Performance Loss" notice fails the build too: ptxas says so when it drops
//! an instruction the kernel relies on (it ignored every `setmaxnreg` while the kernels had
//! `.maxntid` without `.minnctapersm`, C7508).

use std::path::Path;
use std::process::Command;

#[derive(Default)]
struct Resources {
    name: String,
    registers: u32,
    stack_frame: u32,
    spill_stores: u32,
    spill_loads: u32,
    shared: u32,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].trim_end().rsplit([' ', ',']).next()?.parse().ok()
}

pub fn validate(ptxas: &Path, ptx: &Path, arch: &str) -> Result<(), String> {
    let output = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(ptx)
        .args(["-o", "/dev/null"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let log = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("ptxas rejected {}:\n{log}", ptx.display()));
    }
    let notices: Vec<&str> = log.lines().filter(|line| line.contains("Potential Performance Loss")).collect();
    if !notices.is_empty() {
        return Err(format!("ptxas reports a performance loss in {}:\n{}", ptx.display(), notices.join("\n")));
    }
    let mut kernels: Vec<Resources> = Vec::new();
    let mut in_entry = false;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernels.push(Resources { name: rest.split('\'').next().unwrap_or("").to_string(), ..Default::default() });
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
    println!("ptxas -arch={arch}: {} kernels", kernels.len());
    println!(
        "{:<24} {:>9} {:>11} {:>12} {:>11} {:>11}",
        "kernel", "registers", "stack (B)", "spill st (B)", "spill ld (B)", "static smem"
    );
    let mut over_budget = Vec::new();
    for k in &kernels {
        println!(
            "{:<24} {:>9} {:>11} {:>12} {:>11} {:>11}",
            k.name, k.registers, k.stack_frame, k.spill_stores, k.spill_loads, k.shared
        );
        if k.stack_frame + k.spill_stores + k.spill_loads > 0 {
            over_budget.push(k.name.clone());
        }
    }
    if !over_budget.is_empty() {
        return Err(format!("kernels over the budget of no stack frame and no spills: {}", over_budget.join(", ")));
    }
    Ok(())
}
