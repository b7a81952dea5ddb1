//! `cargo xtask bundle`: one folder with everything a GPU run needs (the GPU machine has no
//! Rust): the release CLI, the release test binaries (the PTX is embedded in both), the
//! `nvptx-builder` example, `run.sh`, `peers.py` and `tp_peers.py`. The binaries are packed by
//! `xz` (the embedded PTX shrinks about tenfold, so the whole folder travels to a device run
//! with the working tree); `run.sh` unpacks them.

use std::path::{Path, PathBuf};

use crate::toolchain;

pub fn build(out: Option<&str>) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let out = out.map(PathBuf::from).unwrap_or_else(|| root.join("bundle"));
    let cargo = toolchain::cargo();
    let status = nvptx_builder::clean_command(&cargo)
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "--package",
            "flashsample-cli",
            "--package",
            "flashsample-cudarc-example",
            "--bins",
        ])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building the CLI and the decode-loop example failed".into());
    }
    let output = nvptx_builder::clean_command(&cargo)
        .current_dir(&root)
        .args(["test", "--release", "--workspace", "--no-run", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err("building the tests failed".into());
    }
    let tests = test_executables(&String::from_utf8_lossy(&output.stdout));
    // nvptx-builder's example: its build script builds the example kernels, its binary
    // launches them (stage `example` of run.sh).
    let example = root.join("nvptx-builder/example/host");
    let status = nvptx_builder::clean_command(&cargo)
        .current_dir(&example)
        .args(["build", "--release"])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building nvptx-builder's example failed".into());
    }
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("tests")).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    compress(&root.join("target/release/flashsample"), &out.join("flashsample.xz"))?;
    for (name, path) in &tests {
        compress(path, &out.join("tests").join(format!("{name}.xz")))?;
    }
    compress(&example.join("target/release/saxpy-example"), &out.join("saxpy-example.xz"))?;
    compress(&root.join("target/release/flashsample-cudarc-example"), &out.join("decode-loop-example.xz"))?;
    copy(&root.join("scripts/gpu-run.sh"), &out.join("run.sh"))?;
    copy(&root.join("scripts/peers.py"), &out.join("peers.py"))?;
    copy(&root.join("scripts/tp_peers.py"), &out.join("tp_peers.py"))?;
    println!(
        "bundle in {} ({} test binaries); on the GPU machine: bash {}/run.sh",
        out.display(),
        tests.len(),
        out.display()
    );
    Ok(())
}

/// `(target name, executable)` of every test binary in cargo's JSON messages.
fn test_executables(messages: &str) -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for line in messages.lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let is_test = message["profile"]["test"].as_bool() == Some(true);
        if let (true, Some(executable), Some(name)) =
            (is_test, message["executable"].as_str(), message["target"]["name"].as_str())
        {
            let package =
                message["package_id"].as_str().unwrap_or("").rsplit(['/', '#']).nth(1).unwrap_or("").to_string();
            let kind = message["target"]["kind"][0].as_str().unwrap_or("");
            let label = if kind == "lib" { format!("{}-lib", name) } else { format!("{package}-{name}") };
            found.push((label, PathBuf::from(executable)));
        }
    }
    found
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))
}

/// `cargo xtask bundle --candle`: the candle adapter's GPU tests, its generation-loop example
/// and the speculative-decoding example, in a folder of their own (default `bundle-candle/`;
/// candle's kernels make the binaries too big to travel with the main bundle). Needs candle's CUDA build environment
/// (`source scripts/candle-cuda-env.sh`).
pub fn build_candle(out: Option<&str>) -> Result<(), String> {
    let root = toolchain::workspace_root();
    let out = out.map(PathBuf::from).unwrap_or_else(|| root.join("bundle-candle"));
    let crate_dir = root.join("examples/candle");
    let cargo = toolchain::cargo();
    let output = nvptx_builder::clean_command(&cargo)
        .current_dir(&crate_dir)
        .args(["test", "--release", "--no-run", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err("building the candle adapter's tests failed (is scripts/candle-cuda-env.sh sourced?)".into());
    }
    let tests = test_executables(&String::from_utf8_lossy(&output.stdout));
    let status = nvptx_builder::clean_command(&cargo)
        .current_dir(&crate_dir)
        .args(["build", "--release"])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building the candle example failed".into());
    }
    // The speculative-decoding example is a workspace member; built in the candle crate's
    // target folder, it reuses the CUDA build of candle made just above.
    let status = nvptx_builder::clean_command(&cargo)
        .current_dir(&root)
        .env("CARGO_TARGET_DIR", crate_dir.join("target"))
        .args(["build", "--release", "-p", "flashsample-speculative-example", "--features", "cuda"])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err("building the speculative-decoding example failed".into());
    }
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    // xz shrinks each binary from about 57 MB (candle's kernels) to about 8, so this folder
    // and the main bundle travel together; run.sh unpacks them.
    for (name, path) in tests.iter().filter(|(name, _)| name.contains("adapter")) {
        compress(path, &out.join(format!("{name}.xz")))?;
    }
    compress(&crate_dir.join("target/release/flashsample-candle-example"), &out.join("candle-example.xz"))?;
    compress(&crate_dir.join("target/release/flashsample-speculative-example"), &out.join("speculative-example.xz"))?;
    copy(&root.join("scripts/gpu-run.sh"), &out.join("run.sh"))?;
    println!("candle bundle in {}; on the GPU machine: bash {}/run.sh OUT candle", out.display(), out.display());
    Ok(())
}

/// `to` = `from` compressed by `xz`.
fn compress(from: &Path, to: &Path) -> Result<(), String> {
    let file = std::fs::File::create(to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    let status = std::process::Command::new("xz")
        .args(["-T2", "-3", "-c"])
        .arg(from)
        .stdout(file)
        .status()
        .map_err(|e| format!("cannot run xz: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("xz failed on {}", from.display())) }
}
