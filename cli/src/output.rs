//! The `sample` command's output files, checked before any work and written under temporary
//! names, so a failed run leaves no partial `.npy` behind and never overwrites an input, another
//! output or a file the user cannot write.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use flashsample::{Error, Result};

/// An output file, written as `<path>.partial` until [`Partial::commit`] renames it; dropped
/// uncommitted, the partial file is removed.
pub struct Partial {
    path: PathBuf,
    partial: PathBuf,
    committed: bool,
}

fn invalid(flag: &str, rule: String) -> Error {
    Error::InvalidArgument { argument: flag.into(), rule }
}

/// The file `path` names once it exists: its own canonical path, or its folder's joined with
/// its name.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(canonical) = path.canonicalize() {
        return Some(canonical);
    }
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    Some(folder.canonicalize().ok()?.join(path.file_name()?))
}

/// The temporary name an output is written under until the run ends.
fn partial_of(out: &Path) -> PathBuf {
    let mut partial = OsString::from(out.as_os_str());
    partial.push(".partial");
    PathBuf::from(partial)
}

/// Refuses, before any file is created, an output (`flag`, path) that is the same file as an
/// input or another output: one equal to an input, or whose `.partial` name is an input, would
/// overwrite it; two outputs that are one file, or one named like another's `.partial` file,
/// would leave one's bytes under the other's name after the final renames. Paths whose folder
/// does not exist are left to [`Partial::new`], which refuses them.
pub fn check_distinct(inputs: &[(&str, &Path)], outputs: &[(&str, &Path)]) -> Result<()> {
    // Unresolved paths (no such folder) equal nothing.
    let same = |a: &Option<PathBuf>, b: &Option<PathBuf>| a.is_some() && a == b;
    let input_targets: Vec<Option<PathBuf>> = inputs.iter().map(|(_, path)| resolved(path)).collect();
    let targets: Vec<Option<PathBuf>> = outputs.iter().map(|(_, path)| resolved(path)).collect();
    let partials: Vec<PathBuf> = outputs.iter().map(|(_, path)| partial_of(path)).collect();
    let resolved_partials: Vec<Option<PathBuf>> = partials.iter().map(|p| resolved(p)).collect();
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        let (target, partial) = (&targets[i], &resolved_partials[i]);
        for (&(input, _), input_target) in inputs.iter().zip(&input_targets) {
            if same(target, input_target) {
                let rule = format!("{} is also the input {input}: it would be overwritten", path.display());
                return Err(invalid(flag, rule));
            }
            if same(partial, input_target) {
                let rule = format!(
                    "{} is written as {} until the run ends, and that is the input {input}: it would be overwritten",
                    path.display(),
                    partials[i].display()
                );
                return Err(invalid(flag, rule));
            }
        }
        for (j, &(other, _)) in outputs.iter().enumerate().filter(|&(j, _)| j != i) {
            if same(target, &targets[j]) {
                let rule = format!("{} is also {other}: each output needs a file of its own", path.display());
                return Err(invalid(flag, rule));
            }
            if same(target, &resolved_partials[j]) {
                let rule = format!(
                    "{} is the name {other} is written under until the run ends: each output needs a file of its own",
                    path.display()
                );
                return Err(invalid(flag, rule));
            }
        }
    }
    Ok(())
}

/// Refuses an existing `out` that the final rename would replace although the user could not
/// write it: one that is not a regular file (a device, a pipe), is read-only, or cannot be
/// opened for writing. The rename needs only the folder's permission, so without this check a
/// read-only file would be silently replaced.
fn check_replaceable(flag: &str, out: &Path) -> Result<()> {
    let Ok(metadata) = std::fs::metadata(out) else { return Ok(()) };
    let path = out.display();
    if !metadata.is_file() {
        return Err(invalid(flag, format!("{path} exists and is not a regular file: it would be replaced")));
    }
    if metadata.permissions().readonly() {
        return Err(invalid(
            flag,
            format!("{path} exists and is read-only: a run replaces it, so make it writable or give another name"),
        ));
    }
    // Opened without truncating: the file is left as it is until the run succeeds.
    std::fs::OpenOptions::new()
        .write(true)
        .open(out)
        .map(drop)
        .map_err(|e| invalid(flag, format!("{path} exists and cannot be written: {e}")))
}

impl Partial {
    /// Checks `out`, the value of `flag`: not a folder, in a folder that exists, replaceable if
    /// it exists; creates the partial file to prove the folder writable. [`check_distinct`]
    /// checks it against the other files first.
    pub fn new(flag: &str, out: &Path) -> Result<Partial> {
        if out.is_dir() {
            return Err(invalid(flag, format!("{} is a folder: give a file name", out.display())));
        }
        if resolved(out).is_none() {
            return Err(invalid(flag, format!("{}: its folder does not exist", out.display())));
        }
        check_replaceable(flag, out)?;
        let partial = partial_of(out);
        std::fs::File::create(&partial)
            .map_err(|e| invalid(flag, format!("{} cannot be written: {e}", partial.display())))?;
        Ok(Partial { path: out.to_path_buf(), partial, committed: false })
    }

    /// Where to write until the commit.
    pub fn partial_path(&self) -> &Path {
        &self.partial
    }

    /// Renames the finished file to its final name.
    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.partial, &self.path)
            .map_err(|e| Error::File { path: self.path.display().to_string(), message: e.to_string() })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}
