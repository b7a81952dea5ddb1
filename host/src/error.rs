//! One error type for the library and the CLI: each variant names what was wrong and the rule.

use flashsample_core::{NO_TOKEN, NON_FINITE_TOKEN};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument broke a rule; `argument` names it (e.g. `params[3].temperature`).
    #[error("invalid {argument}: {rule}")]
    InvalidArgument { argument: String, rule: String },
    /// `W` and `H` have different element types.
    #[error("dtype mismatch: the LM head is {lm_head} but the hidden states are {hidden}; they must be the same")]
    DTypeMismatch { lm_head: crate::DType, hidden: crate::DType },
    /// No CUDA driver or no CUDA device on this machine.
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// The device cannot load the PTX module the sampler was asked to run.
    #[error("the {module} module needs compute capability {needs}; this device has {found}")]
    UnsupportedDevice { module: &'static str, found: String, needs: String },
    /// A CUDA driver call failed; `call` says which (and after which kernel, for a sync).
    #[error("CUDA call {call} failed: {detail}")]
    Cuda { call: String, detail: String },
    /// Some rows have no token ([`RowStatus`]); the others were drawn. `tokens` holds every
    /// slot, with [`NO_TOKEN`] or [`NON_FINITE_TOKEN`] in those rows' slots.
    #[error("{}", rows_without_token_message(rows))]
    RowsWithoutToken { rows: Vec<(usize, RowStatus)>, tokens: Vec<u32> },
    /// NCCL is missing, or a call or collective failed or timed out; `rank` names the GPU's
    /// rank where one is to blame.
    #[error("NCCL: {call} failed{}: {detail}", rank.map(|r| format!(" on rank {r}")).unwrap_or_default())]
    Nccl { rank: Option<usize>, call: String, detail: String },
    /// A call into the caller's framework (candle) failed.
    #[error("{call} failed: {detail}")]
    Framework { call: String, detail: String },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    File { path: String, message: String },
}

/// Why a row has no token. Every draw of the row gets it, and its slots in the tokens hold the
/// sentinel [`RowStatus::token`] (in borrowed mode that is the status the device reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowStatus {
    /// Every logit of the row is −∞: no token is allowed. Slot: [`NO_TOKEN`].
    NoAllowedToken,
    /// A logit of the row is NaN or +∞, or a score overflowed `f32` (a logit within `23·T` of
    /// `f32::MAX`): the distribution is undefined. Slot: [`NON_FINITE_TOKEN`].
    NonFiniteLogits,
}

impl RowStatus {
    /// The status a token slot holds: `None` for a drawn token.
    pub fn of_token(token: u32) -> Option<RowStatus> {
        match token {
            NO_TOKEN => Some(RowStatus::NoAllowedToken),
            NON_FINITE_TOKEN => Some(RowStatus::NonFiniteLogits),
            _ => None,
        }
    }

    /// The sentinel a slot of such a row holds.
    pub fn token(self) -> u32 {
        match self {
            RowStatus::NoAllowedToken => NO_TOKEN,
            RowStatus::NonFiniteLogits => NON_FINITE_TOKEN,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            RowStatus::NoAllowedToken => "every logit is -inf",
            RowStatus::NonFiniteLogits => "a logit is NaN or +inf",
        }
    }
}

/// `tokens` (`draws` per row) as they are, or [`Error::RowsWithoutToken`] naming each row whose
/// slots hold a status.
pub fn tokens_or_row_status(tokens: Vec<u32>, draws: usize) -> Result<Vec<u32>> {
    let mut rows = Vec::new();
    for (row, slots) in tokens.chunks(draws.max(1)).enumerate() {
        if let Some(status) = slots.iter().find_map(|&t| RowStatus::of_token(t)) {
            rows.push((row, status));
        }
    }
    if rows.is_empty() { Ok(tokens) } else { Err(Error::RowsWithoutToken { rows, tokens }) }
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

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(argument: impl Into<String>, rule: impl Into<String>) -> Error {
    Error::InvalidArgument { argument: argument.into(), rule: rule.into() }
}
