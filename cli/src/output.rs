//! The `sample` command's output file, checked before any work and written under a temporary
//! name, so a failed run leaves no partial `.npy` behind and never overwrites an input.

use std::path::{Path, PathBuf};

use flashsample::{Error, Result};

/// `--out`, written as `<out>.partial` until [`Partial::commit`] renames it; dropped
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

impl Partial {
    /// Checks `out`, the value of `flag`: not a folder, in a folder that exists, not one of
    /// `inputs` (nor another output); creates the partial file to prove the folder writable.
    pub fn new(flag: &str, out: &Path, inputs: &[&Path]) -> Result<Partial> {
        if out.is_dir() {
            return Err(invalid(flag, format!("{} is a folder: give a file name", out.display())));
        }
        let target =
            resolved(out).ok_or_else(|| invalid(flag, format!("{}: its folder does not exist", out.display())))?;
        for input in inputs {
            if resolved(input).is_some_and(|input| input == target) {
                return Err(invalid(
                    flag,
                    format!("{} is also an input or output: it would be overwritten", out.display()),
                ));
            }
        }
        let mut partial = out.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        std::fs::File::create(&partial)
            .map_err(|e| invalid(flag, format!("{} cannot be written: {e}", partial.display())))?;
        Ok(Partial { path: out.to_path_buf(), partial, committed: false })
    }

    /// Where to write until the commit.
    pub fn partial_path(&self) -> &Path {
        &self.partial
    }

    /// Renames the finished file to `--out`.
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
