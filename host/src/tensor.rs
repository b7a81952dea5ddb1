//! Host matrices in the three element types the kernels read.

use half::{bf16, f16};

use crate::error::{Result, invalid};

/// Element type of `W` and `H`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (binary32's exponent, 8 bits of significand).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The narrowest type that holds every value of both exactly (f16 and bf16 meet in f32).
    pub fn common(self, other: DType) -> DType {
        if self == other { self } else { DType::F32 }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
        })
    }
}

/// Shape and element type of a matrix (on the host or the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixShape {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// The element type.
    pub dtype: DType,
}

/// Row-major elements of one type.
#[derive(Clone, Debug, PartialEq)]
pub enum Elements {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `f16` elements.
    F16(Vec<f16>),
    /// `bf16` elements.
    BF16(Vec<bf16>),
}

impl Elements {
    /// How many elements.
    pub fn len(&self) -> usize {
        match self {
            Elements::F32(v) => v.len(),
            Elements::F16(v) => v.len(),
            Elements::BF16(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Elements::F32(_) => DType::F32,
            Elements::F16(_) => DType::F16,
            Elements::BF16(_) => DType::BF16,
        }
    }

    /// Element `i` as f32 (exact for every type).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Elements::F32(v) => v[i],
            Elements::F16(v) => v[i].to_f32(),
            Elements::BF16(v) => v[i].to_f32(),
        }
    }

    /// The elements' bytes, in memory order.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Elements::F32(v) => bytemuck::cast_slice(v),
            Elements::F16(v) => bytemuck::cast_slice(v),
            Elements::BF16(v) => bytemuck::cast_slice(v),
        }
    }
}

/// A `rows × cols` row-major matrix on the host.
///
/// ```
/// use flashsample::{Elements, Matrix, half::bf16};
/// let w = Matrix::new("lm_head", 2, 3, Elements::BF16(vec![bf16::from_f32(0.5); 6]))?;
/// assert_eq!((w.rows(), w.cols(), w.get(1, 2)), (2, 3, 0.5));
/// # Ok::<(), flashsample::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    elements: Elements,
}

impl Matrix {
    /// `argument` names the matrix in the error when `elements` does not hold `rows · cols`.
    pub fn new(argument: &str, rows: usize, cols: usize, elements: Elements) -> Result<Matrix> {
        if rows.checked_mul(cols) != Some(elements.len()) {
            return Err(invalid(argument, format!("{} elements cannot form a {rows} x {cols} matrix", elements.len())));
        }
        Ok(Matrix { rows, cols, elements })
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.elements.dtype()
    }

    /// Shape and element type.
    pub fn shape(&self) -> MatrixShape {
        MatrixShape { rows: self.rows, cols: self.cols, dtype: self.dtype() }
    }

    /// The row-major elements.
    pub fn elements(&self) -> &Elements {
        &self.elements
    }

    /// Element `[row, col]` as f32 (exact for every type).
    #[inline]
    pub fn get(&self, row: usize, col: usize) -> f32 {
        self.elements.get(row * self.cols + col)
    }

    /// The same values in `dtype`; exact when `dtype` holds them all (any type to F32, or the
    /// same type), otherwise rounded to nearest.
    pub fn to_dtype(&self, dtype: DType) -> Matrix {
        if dtype == self.dtype() {
            return self.clone();
        }
        self.converted(dtype)
    }

    /// As [`Matrix::to_dtype`], without a copy when the type is already `dtype`.
    pub fn into_dtype(self, dtype: DType) -> Matrix {
        if dtype == self.dtype() { self } else { self.converted(dtype) }
    }

    fn converted(&self, dtype: DType) -> Matrix {
        let values = (0..self.elements.len()).map(|i| self.elements.get(i));
        let elements = match dtype {
            DType::F32 => Elements::F32(values.collect()),
            DType::F16 => Elements::F16(values.map(f16::from_f32).collect()),
            DType::BF16 => Elements::BF16(values.map(bf16::from_f32).collect()),
        };
        Matrix { rows: self.rows, cols: self.cols, elements }
    }

    /// Rows `start..end` as a new matrix.
    pub fn row_range(&self, start: usize, end: usize) -> Matrix {
        let range = start * self.cols..end * self.cols;
        let elements = match &self.elements {
            Elements::F32(v) => Elements::F32(v[range].to_vec()),
            Elements::F16(v) => Elements::F16(v[range].to_vec()),
            Elements::BF16(v) => Elements::BF16(v[range].to_vec()),
        };
        Matrix { rows: end - start, cols: self.cols, elements }
    }

    /// The first non-finite element as `(row, col)`, if any.
    pub fn first_non_finite(&self) -> Option<(usize, usize)> {
        use rayon::prelude::*;
        let bad = |r: usize| (0..self.cols).find(|&c| !self.get(r, c).is_finite());
        (0..self.rows).into_par_iter().find_map_first(|r| bad(r).map(|c| (r, c)))
    }
}
