//! One error type for the library and the CLI: each variant names what was wrong and the rule.

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
    /// Every logit of the row was −∞ or NaN, so there is no token to draw.
    #[error("row {row}, draw {draw}: no token can be drawn (every logit is -inf or NaN)")]
    NoToken { row: usize, draw: usize },
    /// A call into the caller's framework (candle) failed.
    #[error("{call} failed: {detail}")]
    Framework { call: String, detail: String },
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    File { path: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(argument: impl Into<String>, rule: impl Into<String>) -> Error {
    Error::InvalidArgument { argument: argument.into(), rule: rule.into() }
}
