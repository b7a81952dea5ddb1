//! A small Qwen2 with random weights, built by candle-transformers' own model code, for the
//! adapter's generation-loop example and its tests (on a CUDA device, and on the CPU).

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Activation, Init, VarBuilder, VarMap};
use candle_transformers::models::qwen2::{Config, Model};

/// The model and its LM head `W[V, D]`.
pub struct TinyQwen2 {
    pub model: Model,
    pub lm_head: Tensor,
    pub config: Config,
    // Owns the weights the model's tensors share.
    _weights: VarMap,
}

/// Qwen2's architecture at D = 1024, V = 32,000, two layers, random weights in `dtype`.
pub fn tiny_qwen2(device: &Device, dtype: DType) -> Result<TinyQwen2> {
    let config = Config {
        vocab_size: 32_000,
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 2,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        max_position_embeddings: 4096,
        sliding_window: 4096,
        max_window_layers: 2,
        tie_word_embeddings: false,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        use_sliding_window: false,
        hidden_act: Activation::Silu,
    };
    let weights = VarMap::new();
    let vb = VarBuilder::from_varmap(&weights, dtype, device);
    let model = Model::new(&config, vb.clone())?;
    let init = Init::Randn { mean: 0.0, stdev: 0.05 };
    let lm_head = vb.pp("lm_head").get_with_hints((config.vocab_size, config.hidden_size), "weight", init)?;
    Ok(TinyQwen2 { model, lm_head, config, _weights: weights })
}

impl TinyQwen2 {
    /// The final hidden states of the last position of `input` `[B, L]` (after the final
    /// norm), `[B, D]`: a strided view of the model's `[B, L, D]` output when `L > 1`.
    pub fn last_hidden(&mut self, input: &Tensor, offset: usize) -> Result<Tensor> {
        let states = self.model.forward(input, offset, None)?;
        let length = states.dim(1)?;
        states.narrow(1, length - 1, 1)?.squeeze(1)
    }
}
