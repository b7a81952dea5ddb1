//! The `sample` command's logit-processing flags: parsed into one [`Processing`] per row and
//! checked against the head before any work, every error naming its flag.

use std::path::{Path, PathBuf};

use clap::Args;
use flashsample::{Error, Penalties, Processing, Result};
use flashsample_cli::io::{NpyValues, read_npy};

#[derive(Args, Default)]
pub struct ProcessingArgs {
    /// Keep the K most likely tokens (every token tied with the K-th logit too), 1 ≤ K ≤ V.
    #[arg(long)]
    pub top_k: Option<i64>,
    /// Keep the smallest set of most likely tokens whose mass reaches P (after top-k), 0 < P ≤ 1.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep tokens at least P times as likely as the most likely one, 0 ≤ P ≤ 1.
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Soft-cap the logits to C·tanh(logit / C) before anything else, C > 0.
    #[arg(long)]
    pub softcap: Option<f32>,
    /// float32 .npy [V] (every row) or [B, V]: added to the logits after the soft-cap; -inf bans a token.
    #[arg(long)]
    pub bias: Option<PathBuf>,
    /// int32 .npy [ceil(V/32)] (every row) or [B, ceil(V/32)]: bit j of word w allows token 32w + j.
    #[arg(long)]
    pub mask: Option<PathBuf>,
    /// int64 .npy [B, L]: each row's token history (prompt and output so far), -1 pads.
    #[arg(long)]
    pub history: Option<PathBuf>,
    /// A seen token's logit l becomes l / R if l > 0, else l · R; R > 0 (needs --history).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// A token seen c times loses F · c (needs --history).
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// A seen token loses P (needs --history).
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// Output float32 .npy [B, N]: each drawn token's log-probability under the raw logits.
    /// Written and checked as --out is.
    #[arg(long)]
    pub logprobs: Option<PathBuf>,
    /// Output float32 .npy [B, N]: each drawn token's log-probability under the distribution
    /// it was drawn from (processed, over T, truncated; 0 for greedy). Written and checked as
    /// --out is.
    #[arg(long)]
    pub processed_logprobs: Option<PathBuf>,
    /// Split W by vocabulary into S shards sampled apart and merged exactly (the path of
    /// tensor-parallel sampling), 1 ≤ S ≤ V.
    #[arg(long)]
    pub shards: Option<i64>,
}

fn invalid(flag: &str, rule: impl Into<String>) -> Error {
    Error::InvalidArgument { argument: flag.into(), rule: rule.into() }
}

/// The flag a library field of `processing[r]` comes from.
pub fn flag_of_field(argument: &str) -> Option<&'static str> {
    let field = argument.strip_prefix("processing[")?.split("].").nth(1)?;
    Some(match field {
        "softcap" => "--softcap",
        "bias" => "--bias",
        "mask" => "--mask",
        "history" => "--history",
        "repetition_penalty" => "--repetition-penalty",
        "frequency_penalty" => "--frequency-penalty",
        "presence_penalty" => "--presence-penalty",
        "min_p" => "--min-p",
        "top_k" => "--top-k",
        "top_p" => "--top-p",
        _ => return None,
    })
}

/// The rows of `flag`'s `[width]` or `[batch, width]` file: one shared by every row, or one per
/// row (read with [`row_of`]).
fn per_row<T: Clone>(
    flag: &str,
    path: &Path,
    dims: &[usize],
    values: Vec<T>,
    batch: usize,
    width: usize,
    what: &str,
) -> Result<Vec<Vec<T>>> {
    match dims {
        [w] if *w == width => Ok(vec![values]),
        [b, w] if *b == batch && *w == width => Ok(values.chunks(width.max(1)).map(<[T]>::to_vec).collect()),
        _ => Err(invalid(
            flag,
            format!("{}: shape {dims:?}: must be [{width}] or [{batch}, {width}] ({what})", path.display()),
        )),
    }
}

/// Row `r`'s entry of per-row values that hold one entry per row or one shared by all.
fn row_of<T: Clone>(rows: &[T], r: usize) -> T {
    rows[r.min(rows.len() - 1)].clone()
}

impl ProcessingArgs {
    /// Whether any processing or log-probability flag was given.
    pub fn any(&self) -> bool {
        self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some()
            || self.softcap.is_some()
            || self.bias.is_some()
            || self.mask.is_some()
            || self.history.is_some()
            || self.repetition_penalty.is_some()
            || self.frequency_penalty.is_some()
            || self.presence_penalty.is_some()
            || self.logprobs.is_some()
            || self.processed_logprobs.is_some()
            || self.shards.is_some()
    }

    /// `--shards`, checked against V: the number of vocabulary shards (1 without the flag).
    pub fn shard_count(&self, vocab: usize) -> Result<usize> {
        match self.shards {
            None => Ok(1),
            Some(s) if s < 1 || s > vocab as i64 => Err(invalid("--shards", format!("{s}: must be 1 to V = {vocab}"))),
            Some(s) => Ok(s as usize),
        }
    }

    /// The input files these flags read, each with its flag.
    pub fn inputs(&self) -> Vec<(&'static str, &Path)> {
        [("--bias", &self.bias), ("--mask", &self.mask), ("--history", &self.history)]
            .into_iter()
            .filter_map(|(flag, path)| Some((flag, path.as_deref()?)))
            .collect()
    }

    /// One [`Processing`] per row of a batch of `batch` rows over `vocab` tokens, each checked.
    pub fn rows(&self, batch: usize, vocab: usize) -> Result<Vec<Processing>> {
        let penalties = [
            ("--repetition-penalty", self.repetition_penalty),
            ("--frequency-penalty", self.frequency_penalty),
            ("--presence-penalty", self.presence_penalty),
        ];
        if self.history.is_none()
            && let Some((flag, _)) = penalties.iter().find(|(_, v)| v.is_some())
        {
            return Err(invalid(flag, "needs --history: the penalties count tokens of each row's history"));
        }
        let top_k = match self.top_k {
            Some(k) if k < 1 || k > vocab as i64 => {
                return Err(invalid("--top-k", format!("{k}: must be 1 to V = {vocab}")));
            }
            k => k.map(|k| k as u32),
        };
        let bias: Vec<Vec<(u32, f32)>> = match &self.bias {
            None => vec![Vec::new()],
            Some(path) => match read_npy(path, "--bias")? {
                (dims, NpyValues::F32(values)) => {
                    per_row("--bias", path, &dims, values, batch, vocab, "float32, V = vocabulary")?
                        .into_iter()
                        .map(|row| {
                            row.into_iter().enumerate().filter(|&(_, b)| b != 0.0).map(|(i, b)| (i as u32, b)).collect()
                        })
                        .collect()
                }
                _ => return Err(invalid("--bias", format!("{}: must be float32", path.display()))),
            },
        };
        let words = vocab.div_ceil(32);
        let mask: Vec<Option<Vec<u32>>> = match &self.mask {
            None => vec![None],
            Some(path) => match read_npy(path, "--mask")? {
                (dims, NpyValues::I32(values)) => {
                    let bits = values.into_iter().map(|w| w as u32).collect();
                    per_row("--mask", path, &dims, bits, batch, words, "int32 words of 32 tokens")?
                        .into_iter()
                        .map(Some)
                        .collect()
                }
                _ => return Err(invalid("--mask", format!("{}: must be int32", path.display()))),
            },
        };
        let history: Vec<Vec<u32>> = match &self.history {
            None => vec![Vec::new()],
            Some(path) => match read_npy(path, "--history")? {
                (dims, NpyValues::I64(values)) if dims.len() == 2 && dims[0] == batch => {
                    let mut rows = Vec::with_capacity(batch);
                    for (r, row) in values.chunks(dims[1].max(1)).enumerate().take(batch) {
                        let mut tokens = Vec::new();
                        for &t in row {
                            match t {
                                -1 => {}
                                t if t < -1 || t >= vocab as i64 => {
                                    return Err(invalid(
                                        "--history",
                                        format!(
                                            "row {r}: token {t}: must be -1 (padding) or 0 to V - 1 = {}",
                                            vocab - 1
                                        ),
                                    ));
                                }
                                t => tokens.push(t as u32),
                            }
                        }
                        rows.push(tokens);
                    }
                    rows.resize(batch, Vec::new());
                    rows
                }
                (dims, NpyValues::I64(_)) => {
                    return Err(invalid(
                        "--history",
                        format!("{}: shape {dims:?}: must be [B = {batch}, L]", path.display()),
                    ));
                }
                _ => return Err(invalid("--history", format!("{}: must be int64", path.display()))),
            },
        };
        let rows: Vec<Processing> = (0..batch)
            .map(|r| Processing {
                softcap: self.softcap,
                bias: row_of(&bias, r),
                mask: row_of(&mask, r),
                history: row_of(&history, r),
                penalties: Penalties {
                    repetition: self.repetition_penalty.unwrap_or(1.0),
                    frequency: self.frequency_penalty.unwrap_or(0.0),
                    presence: self.presence_penalty.unwrap_or(0.0),
                },
                min_p: self.min_p.unwrap_or(0.0),
                top_k,
                top_p: self.top_p.unwrap_or(1.0),
                logprobs: false,
                top_logprobs: 0,
            })
            .collect();
        for (r, p) in rows.iter().enumerate() {
            p.check(r, vocab)?;
        }
        Ok(rows)
    }
}
