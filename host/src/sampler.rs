//! [`Sampler`]: what every backend that samples host matrices does, so that a caller can hold
//! "the GPU if usable, else the CPU" as one value, and [`LmHead`], the LM head a sampler
//! keeps.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::batch::Batch;
use crate::error::{Result, invalid};
use crate::params::{Draws, HeadShape, sharded_head};
use crate::sampled::Sampled;
use crate::tensor::Matrix;

/// A backend that samples host matrices: [`crate::CpuSampler`], [`crate::CudaSampler`] or a
/// tensor-parallel group of GPUs. [`crate::gpu_or_cpu`] picks the GPU if one is usable.
///
/// ```
/// use flashsample::{Batch, Draws, Elements, Matrix, Sampler, SamplingParams};
/// let sampler: Box<dyn Sampler> = flashsample::gpu_or_cpu(0)?;
/// let w = Matrix::new("lm_head", 3, 2, Elements::F32(vec![1.0, 0.0, 0.0, 1.0, 0.5, 0.5]))?;
/// let h = Matrix::new("hidden", 1, 2, Elements::F32(vec![2.0, -1.0]))?;
/// let head = sampler.upload_lm_head(&w)?;
/// let batch = Batch::new(vec![SamplingParams::new(1.0, 42, 0, 0)]);
/// let sampled = sampler.sample(&head, &h, &batch, Draws::first(4))?;
/// assert_eq!(sampled.tokens.len(), 4);
/// # Ok::<(), flashsample::Error>(())
/// ```
pub trait Sampler {
    /// What the sampler runs on, in words.
    fn device(&self) -> String;

    /// Checks `W[V, D]` (non-empty, `V < 2³¹`, every weight finite) and keeps it for this
    /// sampler.
    fn upload_lm_head(&self, lm_head: &Matrix) -> Result<LmHead>;

    /// As [`Sampler::upload_lm_head`] for `W` split by vocabulary: shard `s` holds the tokens
    /// after those of shards `0 .. s`, and every shard but the last is a multiple of 4 rows
    /// (a Philox block). Each shard is sampled apart and the shards' winners merge into the
    /// tokens of the whole head.
    fn upload_lm_head_shards(&self, shards: &[Matrix]) -> Result<LmHead>;

    /// `draws` of each row of `hidden` (`H[B, D]`, `W`'s dtype) from the row's processed
    /// `softmax(H·Wᵀ / T)`, with the log-probabilities the batch's processing asks for. A row
    /// without a token (non-finite logits, or nothing allowed) makes the call
    /// [`crate::Error::RowsWithoutToken`], which carries every row's results.
    fn sample(&self, lm_head: &LmHead, hidden: &Matrix, batch: &Batch, draws: Draws) -> Result<Sampled>;

    /// Waits for outstanding work and reports any error it left (a GPU's kernels run after
    /// its calls return); the sampler is then gone. Dropping it instead reports such an error
    /// on standard error.
    fn close(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

/// An LM head kept by the sampler that uploaded it (see [`Sampler::upload_lm_head`]): on the
/// CPU, on a GPU, or split over GPUs.
pub struct LmHead {
    /// The sampler that made it.
    pub(crate) owner: Owner,
    /// The whole head's shape (every shard together).
    pub(crate) shape: HeadShape,
    /// Each shard's first token.
    pub(crate) offsets: Vec<usize>,
    pub(crate) storage: HeadStorage,
}

impl std::fmt::Debug for LmHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self.storage {
            HeadStorage::Cpu(_) => "cpu",
            HeadStorage::Cuda(_) => "cuda",
        };
        f.debug_struct("LmHead")
            .field("shape", &self.shape)
            .field("offsets", &self.offsets)
            .field("on", &place)
            .finish()
    }
}

/// Where an LM head's shards are.
pub(crate) enum HeadStorage {
    Cpu(Vec<Matrix>),
    Cuda(Vec<crate::cuda::ResidentHead>),
}

impl LmHead {
    /// A head of `shards` (with their shapes) kept by `owner`: the shards must make one
    /// head.
    pub(crate) fn new(owner: Owner, shapes: &[HeadShape], storage: HeadStorage) -> Result<LmHead> {
        let (shape, offsets) = sharded_head(shapes.iter().copied())?;
        if let Some(s) = offsets[1..].iter().position(|&offset| !offset.is_multiple_of(4)) {
            return Err(invalid(
                format!("shards[{s}]"),
                format!("{} rows: every shard but the last must be whole blocks of 4 tokens", shapes[s].vocab),
            ));
        }
        Ok(LmHead { owner, shape, offsets, storage })
    }

    /// The whole head's shape.
    pub fn shape(&self) -> HeadShape {
        self.shape
    }

    /// How many vocabulary shards it is kept in.
    pub fn shards(&self) -> usize {
        self.offsets.len()
    }

    /// Refuses a head another sampler uploaded.
    pub(crate) fn check_owner(&self, owner: Owner) -> Result<()> {
        if self.owner != owner {
            return Err(invalid("lm_head", "uploaded by another sampler: upload it with this one"));
        }
        Ok(())
    }
}

/// Which sampler made an [`LmHead`]: a number unique in the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Owner(u64);

impl Owner {
    /// The owner of every CPU head: CPU samplers hold no state, so any of them may use it.
    pub(crate) const CPU: Owner = Owner(0);

    /// A new sampler's own number.
    pub(crate) fn next() -> Owner {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Owner(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}
