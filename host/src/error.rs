//! One error type for the library and the CLI: each variant names what was wrong and the rule.

use crate::sampled::{RowStatus, Sampled};

/// What went wrong, with the argument or call to blame.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument broke a rule; `argument` names it (e.g. `params[3].temperature`).
    #[error("invalid {argument}: {rule}")]
    InvalidArgument {
        /// The argument, e.g. `params[3].temperature` (the CLI names its flag instead).
        argument: String,
        /// The rule it broke, with the value.
        rule: String,
    },
    /// `W` and `H` have different element types.
    #[error("dtype mismatch: the LM head is {lm_head} but the hidden states are {hidden}; they must be the same")]
    DTypeMismatch {
        /// `W`'s element type.
        lm_head: crate::DType,
        /// `H`'s element type.
        hidden: crate::DType,
    },
    /// No CUDA driver or no CUDA device on this machine.
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// The device cannot load the PTX module the sampler was asked to run.
    #[error("the {module} module needs compute capability {needs}; this device has {found}")]
    UnsupportedDevice {
        /// The module's name (`portable` or `hopper`).
        module: &'static str,
        /// The device's compute capability.
        found: String,
        /// The compute capabilities the module loads on.
        needs: String,
    },
    /// A CUDA driver call failed; `call` says which (and after which kernel, for a sync).
    #[error("CUDA call {call} failed: {detail}")]
    Cuda {
        /// The driver call.
        call: String,
        /// The driver's error name and text.
        detail: String,
    },
    /// Some rows have no token ([`RowStatus`]); the others were drawn. `sampled` holds every
    /// row's results, with the status sentinels in those rows' token slots.
    #[error("{}", rows_without_token_message(rows))]
    RowsWithoutToken {
        /// Each row without a token and why.
        rows: Vec<(usize, RowStatus)>,
        /// Every row's results.
        sampled: Box<Sampled>,
    },
    /// NCCL is missing, or a call or collective failed or timed out; `rank` names the GPU's
    /// rank where one is to blame.
    #[error("NCCL: {call} failed{}: {detail}", rank.map(|r| format!(" on rank {r}")).unwrap_or_default())]
    Nccl {
        /// The rank whose call failed, where one is to blame.
        rank: Option<usize>,
        /// The NCCL call or collective.
        call: String,
        /// NCCL's error and text, or what timed out.
        detail: String,
    },
    /// A call into the caller's framework (candle) failed.
    #[error("{call} failed: {detail}")]
    Framework {
        /// The framework's call.
        call: String,
        /// The framework's error.
        detail: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
}

/// `sampled` as it is, or [`Error::RowsWithoutToken`] naming each row whose slots hold a
/// status (the error carries every row's results).
pub(crate) fn sampled_or_row_status(sampled: Sampled) -> Result<Sampled> {
    let rows = sampled.rows_without_token();
    if rows.is_empty() { Ok(sampled) } else { Err(Error::RowsWithoutToken { rows, sampled: Box::new(sampled) }) }
}

fn rows_without_token_message(rows: &[(usize, RowStatus)]) -> String {
    const SHOWN: usize = 8;
    let mut text = format!("{} row(s) have no token:", rows.len());
    for (row, status) in rows.iter().take(SHOWN) {
        text += &format!(" row {row} ({});", status.describe());
    }
    if rows.len() > SHOWN {
        text += &format!(" and {} more;", rows.len() - SHOWN);
    }
    text + " the other rows were drawn"
}

/// The library's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(argument: impl Into<String>, rule: impl Into<String>) -> Error {
    Error::InvalidArgument { argument: argument.into(), rule: rule.into() }
}
