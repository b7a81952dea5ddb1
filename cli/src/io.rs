//! Files: matrices from safetensors, tokens to NumPy `.npy`.

use std::io::Write;
use std::path::Path;

use flashsample::{Elements, Error, Matrix, Result};
use safetensors::{Dtype, SafeTensors};

fn invalid(argument: impl Into<String>, rule: impl Into<String>) -> Error {
    Error::InvalidArgument { argument: argument.into(), rule: rule.into() }
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::File { path: path.display().to_string(), message: message.to_string() }
}

/// Reads one 2-D F32/F16/BF16 tensor from a safetensors file. `tensor` picks it by name; with
/// `None` the file must hold exactly one. `argument` (a CLI flag) names the input in errors.
pub fn load_matrix(path: &Path, tensor: Option<&str>, argument: &str) -> Result<Matrix> {
    if path.is_dir() {
        return Err(invalid(argument, format!("{} is a folder: give the .safetensors file", path.display())));
    }
    let file = std::fs::File::open(path).map_err(|e| file_error(path, e))?;
    // SAFETY: the map is read-only and dropped before we return; a file changed underneath
    // us can only give wrong values, which the finiteness checks may catch.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| file_error(path, e))?;
    let tensors = SafeTensors::deserialize(&map)
        .map_err(|e| file_error(path, format!("not a safetensors file: {}", describe_safetensors_error(&e))))?;
    let mut names: Vec<String> = tensors.names().into_iter().cloned().collect();
    names.sort();
    let name = match tensor {
        Some(name) if names.iter().any(|n| n == name) => name.to_string(),
        Some(name) => {
            return Err(invalid(
                format!("{argument}-tensor"),
                format!("{} holds no tensor `{name}` (it holds: {})", path.display(), names.join(", ")),
            ));
        }
        None if names.len() == 1 => names[0].clone(),
        None => {
            return Err(invalid(
                argument,
                format!(
                    "{} holds {} tensors ({}); pick one with {argument}-tensor NAME",
                    path.display(),
                    names.len(),
                    names.join(", ")
                ),
            ));
        }
    };
    let view = tensors.tensor(&name).map_err(|e| file_error(path, describe_safetensors_error(&e)))?;
    let &[rows, cols] = view.shape() else {
        return Err(invalid(argument, format!("tensor `{name}` has shape {:?}: it must be 2-D", view.shape())));
    };
    let bytes = view.data();
    let elements = match view.dtype() {
        Dtype::F32 => Elements::F32(bytemuck::pod_collect_to_vec(bytes)),
        Dtype::F16 => Elements::F16(bytemuck::pod_collect_to_vec(bytes)),
        Dtype::BF16 => Elements::BF16(bytemuck::pod_collect_to_vec(bytes)),
        other => {
            return Err(invalid(argument, format!("tensor `{name}` has dtype {other:?}: it must be F32, F16 or BF16")));
        }
    };
    Matrix::new(argument, rows, cols, elements)
}

/// What a safetensors error means, in words.
fn describe_safetensors_error(error: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match error {
        E::InvalidHeader => "its header is not valid UTF-8".into(),
        E::InvalidHeaderStart => "its header does not start with `{`".into(),
        E::InvalidHeaderDeserialization => "its header is not valid JSON".into(),
        E::HeaderTooLarge => "its header is larger than the 100 MB safetensors allows".into(),
        E::HeaderTooSmall => "it is shorter than the 8-byte header length".into(),
        E::InvalidHeaderLength => "its header length points past the end of the file".into(),
        E::TensorNotFound(name) => format!("it holds no tensor `{name}`"),
        E::TensorInvalidInfo => "a tensor's shape, dtype and offsets disagree".into(),
        E::InvalidOffset(name) => format!("the offsets of tensor `{name}` are invalid"),
        E::IoError(e) => format!("it cannot be read: {e}"),
        E::JsonError(e) => format!("its header is not valid JSON: {e}"),
        E::InvalidTensorView(dtype, shape, bytes) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot hold {bytes} bytes")
        }
        E::MetadataIncompleteBuffer => "the file is truncated or has bytes no tensor covers".into(),
        E::ValidationOverflow => "a tensor's shape overflows".into(),
    }
}

/// The element types of the `.npy` files flashsample reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NpyType {
    /// `<f4`
    F32,
    /// `<i4`
    I32,
    /// `<i8`
    I64,
}

impl NpyType {
    fn descr(self) -> &'static str {
        match self {
            NpyType::F32 => "<f4",
            NpyType::I32 => "<i4",
            NpyType::I64 => "<i8",
        }
    }

    fn bytes(self) -> usize {
        match self {
            NpyType::F32 | NpyType::I32 => 4,
            NpyType::I64 => 8,
        }
    }
}

/// A little-endian `.npy` file (format 1.0) of shape `[rows, cols]`, int64 or float32,
/// written in blocks of columns, so a caller can write millions of draws per row in bounded
/// memory.
pub struct NpyWriter {
    file: std::fs::File,
    path: std::path::PathBuf,
    element: NpyType,
    rows: usize,
    cols: usize,
    data_offset: u64,
}

impl NpyWriter {
    /// Creates (or truncates) an int64 `path` with the header and room for every value.
    pub fn create(path: &Path, rows: usize, cols: usize) -> Result<NpyWriter> {
        NpyWriter::create_typed(path, NpyType::I64, rows, cols)
    }

    /// Creates (or truncates) `path` for `element` values (int64 or float32).
    pub fn create_typed(path: &Path, element: NpyType, rows: usize, cols: usize) -> Result<NpyWriter> {
        let mut header =
            format!("{{'descr': '{}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}", element.descr());
        // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64.
        let unpadded = 10 + header.len() + 1;
        header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
        header.push('\n');
        let mut file = std::fs::File::create(path).map_err(|e| file_error(path, e))?;
        let mut start = b"\x93NUMPY\x01\x00".to_vec();
        start.extend((header.len() as u16).to_le_bytes());
        start.extend(header.as_bytes());
        file.write_all(&start).map_err(|e| file_error(path, e))?;
        let data_offset = start.len() as u64;
        let bytes = (rows as u64).checked_mul(cols as u64).and_then(|n| n.checked_mul(element.bytes() as u64));
        let length = bytes.and_then(|b| b.checked_add(data_offset)).ok_or_else(|| file_error(path, "too large"))?;
        file.set_len(length).map_err(|e| file_error(path, e))?;
        Ok(NpyWriter { file, path: path.to_path_buf(), element, rows, cols, data_offset })
    }

    /// Writes columns `first_col .. first_col + count` of every row of an int64 file from
    /// `values` (`rows × count`, row-major).
    pub fn write_columns(&mut self, first_col: usize, count: usize, values: &[u32]) -> Result<()> {
        self.write_encoded(NpyType::I64, first_col, count, values, |v, out| out.extend((v as i64).to_le_bytes()))
    }

    /// As [`NpyWriter::write_columns`], for a float32 file.
    pub fn write_f32_columns(&mut self, first_col: usize, count: usize, values: &[f32]) -> Result<()> {
        self.write_encoded(NpyType::F32, first_col, count, values, |v, out| out.extend(v.to_le_bytes()))
    }

    fn write_encoded<T: Copy>(
        &mut self,
        element: NpyType,
        first_col: usize,
        count: usize,
        values: &[T],
        encode: impl Fn(T, &mut Vec<u8>),
    ) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        if element != self.element {
            return Err(invalid("values", format!("{element:?} values for a {:?} file", self.element)));
        }
        if first_col.checked_add(count).is_none_or(|end| end > self.cols) {
            return Err(invalid("first_col", format!("columns {first_col} + {count} exceed the file's {}", self.cols)));
        }
        if Some(values.len()) != self.rows.checked_mul(count) {
            return Err(invalid("values", format!("{} values for {} rows × {count} columns", values.len(), self.rows)));
        }
        let (path, size) = (&self.path, element.bytes());
        let mut bytes = Vec::with_capacity(count * size);
        for (row, chunk) in values.chunks(count.max(1)).enumerate() {
            bytes.clear();
            chunk.iter().for_each(|&v| encode(v, &mut bytes));
            let at = self.data_offset + ((row * self.cols + first_col) * size) as u64;
            self.file.seek(SeekFrom::Start(at)).map_err(|e| file_error(path, e))?;
            self.file.write_all(&bytes).map_err(|e| file_error(path, e))?;
        }
        Ok(())
    }

    /// Flushes the file to disk.
    pub fn finish(self) -> Result<()> {
        self.file.sync_all().map_err(|e| file_error(&self.path, e))
    }
}

/// Writes `values` (`rows × cols`, row-major) as a little-endian int64 `.npy` (format 1.0).
pub fn write_npy_i64(path: &Path, rows: usize, cols: usize, values: &[u32]) -> Result<()> {
    let mut writer = NpyWriter::create(path, rows, cols)?;
    writer.write_columns(0, cols, values)?;
    writer.finish()
}

/// The values of a `.npy` file read by [`read_npy`].
#[derive(Clone, Debug, PartialEq)]
pub enum NpyValues {
    /// A float32 (`<f4`) file's values.
    F32(Vec<f32>),
    /// An int32 (`<i4`) file's values.
    I32(Vec<i32>),
    /// An int64 (`<i8`) file's values.
    I64(Vec<i64>),
}

/// A C-ordered little-endian `.npy` (format 1.0 or 2.0) of float32, int32 or int64: its shape
/// and values. Errors are [`Error::InvalidArgument`] naming `argument` (a CLI flag) and saying
/// what is wrong with the file.
pub fn read_npy(path: &Path, argument: &str) -> Result<(Vec<usize>, NpyValues)> {
    let bytes = std::fs::read(path).map_err(|e| invalid(argument, format!("{}: {e}", path.display())))?;
    let bad = |why: &str| invalid(argument, format!("{}: {why}", path.display()));
    let (header_start, header_len) = match bytes.get(..8) {
        Some(b"\x93NUMPY\x01\x00") if bytes.len() >= 10 => (10, u16::from_le_bytes([bytes[8], bytes[9]]) as usize),
        Some(b"\x93NUMPY\x02\x00") if bytes.len() >= 12 => {
            (12, u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize)
        }
        _ => return Err(bad("not a .npy file of format 1.0 or 2.0")),
    };
    let header = bytes
        .get(header_start..header_start + header_len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("its header is cut or not text"))?;
    if header.contains("'fortran_order': True") {
        return Err(bad("Fortran order: save it in C order"));
    }
    let element = [NpyType::F32, NpyType::I32, NpyType::I64]
        .into_iter()
        .find(|t| header.contains(&format!("'{}'", t.descr())))
        .ok_or_else(|| bad("its dtype is not float32, int32 or int64 (little-endian)"))?;
    let shape = header.split("'shape': (").nth(1).and_then(|s| s.split(')').next()).ok_or_else(|| bad("no shape"))?;
    let dims: Vec<usize> = shape
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().map_err(|_| bad("its shape is not a tuple of sizes")))
        .collect::<Result<_>>()?;
    let data = &bytes[header_start + header_len..];
    let count = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| bad("its shape overflows"))?;
    if Some(data.len()) != count.checked_mul(element.bytes()) {
        return Err(bad(&format!("{} data bytes for shape {dims:?} of {}", data.len(), element.descr())));
    }
    let values = match element {
        NpyType::F32 => {
            NpyValues::F32(data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect())
        }
        NpyType::I32 => {
            NpyValues::I32(data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4"))).collect())
        }
        NpyType::I64 => {
            NpyValues::I64(data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect())
        }
    };
    Ok((dims, values))
}

/// Reads back a `.npy` written by [`write_npy_i64`]: `(rows, cols, values)`.
pub fn read_npy_i64(path: &Path) -> Result<(usize, usize, Vec<i64>)> {
    let bad = || file_error(path, "not a 2-D int64 .npy");
    match read_npy(path, "npy")? {
        (dims, NpyValues::I64(values)) if dims.len() == 2 => Ok((dims[0], dims[1], values)),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block that does not fit the file is an error naming the argument, and the blocks that
    /// fit read back in place.
    #[test]
    fn npy_blocks_outside_the_file_are_errors() {
        let path = std::env::temp_dir().join(format!("flashsample-npy-{}.npy", std::process::id()));
        let mut writer = NpyWriter::create(&path, 2, 3).unwrap();
        let beyond = writer.write_columns(2, 2, &[0; 4]).unwrap_err();
        assert!(matches!(&beyond, Error::InvalidArgument { argument, .. } if argument == "first_col"), "{beyond}");
        let short = writer.write_columns(0, 2, &[0; 3]).unwrap_err();
        assert!(matches!(&short, Error::InvalidArgument { argument, .. } if argument == "values"), "{short}");
        writer.write_columns(1, 2, &[1, 2, 3, 4]).unwrap();
        writer.write_columns(0, 1, &[5, 6]).unwrap();
        writer.finish().unwrap();
        let read = read_npy_i64(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(read, (2, 3, vec![5, 1, 2, 6, 3, 4]));
    }
}
