//! Checks and fixes on the generated PTX that are about GPU correctness, not any project.

/// The names of the PTX's entry points, in order.
pub fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines().filter_map(|l| l.strip_prefix(".visible .entry ")).map(|l| l.split('(').next().unwrap_or(l)).collect()
}

/// What a kernel's PTX declares of its launches: its block size, and the blocks a
/// multiprocessor must be able to hold at once, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchBounds {
    /// `.maxntid threads, 1, 1`.
    pub threads: u32,
    /// `.minnctapersm blocks`: ptxas then gives each thread at most the registers that many
    /// blocks of `threads` leave it.
    pub min_blocks: Option<u32>,
}

/// Adds `.maxntid` (and `.minnctapersm` where given) after the parameter list of every entry
/// `launch_bounds` names.
///
/// Why: rustc has no attribute for NVVM launch bounds. Without them ptxas assumes a kernel may
/// run with any block size, up to 1024 threads, and may give each thread fewer registers than
/// a block of the size the kernel really uses allows (or more than it can have, or more than
/// the blocks per multiprocessor the kernel is written for leave it).
pub fn add_launch_bounds(ptx: &str, launch_bounds: &dyn Fn(&str) -> Option<LaunchBounds>) -> String {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut bounds = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(entry) = line.strip_prefix(".visible .entry ") {
            bounds = launch_bounds(entry.split('(').next().unwrap_or(entry));
        } else if let Some(LaunchBounds { threads, min_blocks }) = bounds.filter(|_| line.starts_with(')')) {
            out.push_str(&format!(".maxntid {threads}, 1, 1\n"));
            if let Some(blocks) = min_blocks {
                out.push_str(&format!(".minnctapersm {blocks}\n"));
            }
            bounds = None;
        }
    }
    out
}

/// An instruction that must appear a bounded number of times in a kernel: `(prefix, fewest,
/// most)`.
pub type Occurrences = (&'static str, usize, usize);

/// Checks that every entry holds each of the instructions `ops_of(entry)` names within its
/// bounds.
///
/// Why: warp- and warpgroup-collective `.sync.aligned` instructions (`wgmma.wait_group`,
/// `wgmma.commit_group`, …) must be executed by every thread of the group at the same
/// instance. LLVM treats inline asm as ordinary code and may duplicate it into both arms of a
/// branch (it did, around `if lane == 0`): that compiles, and hangs on the GPU. A kernel that
/// writes such an instruction once must hold it once.
pub fn check_written_once(ptx: &str, ops_of: &dyn Fn(&str) -> &'static [Occurrences]) -> Result<(), String> {
    let mut problems = Vec::new();
    for entry in ptx.split(".visible .entry ").skip(1) {
        let name = entry.split('(').next().unwrap_or("");
        for &(op, fewest, most) in ops_of(name) {
            let copies = entry.lines().filter(|l| l.trim_start().starts_with(op)).count();
            if !(fewest..=most).contains(&copies) {
                problems.push(format!("{name}: `{op}` appears {copies} times (expected {fewest}..={most})"));
            }
        }
    }
    if problems.is_empty() { Ok(()) } else { Err(problems.join("\n")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = ".visible .entry a(\n.param .u64 a_param_0\n)\n{\nret;\n}\n.visible .entry b(\n)\n{\nwgmma.wait_group.sync.aligned 0;\n@%p bra L;\nwgmma.wait_group.sync.aligned 0;\nL:\nret;\n}\n";

    #[test]
    fn launch_bounds_go_after_the_named_entries_parameters() {
        let out =
            add_launch_bounds(PTX, &|name| (name == "a").then_some(LaunchBounds { threads: 384, min_blocks: None }));
        assert!(out.contains(".param .u64 a_param_0\n)\n.maxntid 384, 1, 1\n{"), "{out}");
        assert_eq!(out.matches(".maxntid").count(), 1);
        assert_eq!(entries(&out), ["a", "b"]);
        let out =
            add_launch_bounds(PTX, &|name| (name == "b").then_some(LaunchBounds { threads: 256, min_blocks: Some(2) }));
        assert!(out.contains(".entry b(\n)\n.maxntid 256, 1, 1\n.minnctapersm 2\n{"), "{out}");
        assert_eq!(out.matches(".minnctapersm").count(), 1);
    }

    #[test]
    fn a_duplicated_aligned_op_is_reported() {
        const ONCE: &[Occurrences] = &[("wgmma.wait_group.sync.aligned 0", 1, 1)];
        let error = check_written_once(PTX, &|name| if name == "b" { ONCE } else { &[] }).unwrap_err();
        assert!(error.contains("b: `wgmma.wait_group.sync.aligned 0` appears 2 times"), "{error}");
    }
}
