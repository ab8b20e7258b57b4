//! Named intermediate activations, reported by the forward pass to an [`Observer`].
//!
//! The names are transformers' module paths plus `.output`, exactly as the reference dumps
//! (`fixtures/reference/`) spell them, so `kiln-verify` can compare layer by layer. They come
//! from one table, [`Activation::name`], where a family that names a site differently (GLM-4's
//! norms) has its own spelling, read from its row of [`kiln_format::FAMILIES`]. The forward pass takes `Option<&mut dyn Observer>`: with
//! `None` the only cost is one branch per site (no names are formatted, nothing is copied).

use std::fmt;

use kiln_format::Architecture;

/// Receives activations during a forward pass (on one of the session's compute threads, hence
/// `Send`).
pub trait Observer: Send {
    /// Whether `record` should be called for `name` (skip the rest cheaply).
    fn wants(&self, name: &str) -> bool;
    /// One activation: `shape = [rows, cols]` (rows = tokens of this forward call), row-major.
    fn record(&mut self, name: &str, data: &[f32], shape: [usize; 2]);
    /// Change, in place, an activation the forward pass goes on from: offered (after
    /// `record`) where a weight matrix's product lands, before anything else reads it (the
    /// embedding rows, after the family's embedding scale and an encoder's embedding norm;
    /// q/k/v, o_proj, gate/up, the MLP's output and the logits). Adding
    /// `x·Eᵀ` there is exactly the forward pass with that matrix's weights `W + E`, which is
    /// how quantization measures what one matrix's rounding costs in the logits without a
    /// second model. The default changes nothing.
    fn edit(&mut self, _name: &str, _data: &mut [f32], _shape: [usize; 2]) {}
}

/// Every activation the forward pass reports, one per transformers module output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `model.embed_tokens.output`, `(T, hidden)`.
    Embed,
    /// `model.layers.N.input_layernorm.output`, `(T, hidden)`.
    AttnNorm(usize),
    /// `model.layers.N.self_attn.q_proj.output` (bias added, before rope), `(T, heads*head_dim)`.
    Q(usize),
    /// `model.layers.N.self_attn.k_proj.output` (before rope), `(T, kv_heads*head_dim)`.
    K(usize),
    /// `model.layers.N.self_attn.v_proj.output`, `(T, kv_heads*head_dim)`.
    V(usize),
    /// `model.layers.N.self_attn.q_norm.output` (Qwen3, Gemma 3: queries after the per-head
    /// norm, before rope), `(T, heads*head_dim)`.
    QNorm(usize),
    /// `model.layers.N.self_attn.k_norm.output`, `(T, kv_heads*head_dim)`.
    KNorm(usize),
    /// `model.layers.N.self_attn.o_proj.input`: the attention output, `(T, heads*head_dim)`.
    /// (An input, not an output: calibration needs what the o_proj matrix multiplies, and no
    /// module of the reference outputs exactly that.)
    AttnOut(usize),
    /// `model.layers.N.self_attn.o_proj.output` (before the residual add), `(T, hidden)`.
    O(usize),
    /// `model.layers.N.post_attention_layernorm.output`: the pre-MLP norm of the Llama
    /// family, `(T, hidden)`.
    MlpNorm(usize),
    /// `model.layers.N.post_attention_layernorm.output` of Gemma 3: the norm of the attention
    /// output (the same module name as [`Activation::MlpNorm`] in the Llama family, where it
    /// is the pre-MLP norm), `(T, hidden)`.
    AttnPostNorm(usize),
    /// `model.layers.N.pre_feedforward_layernorm.output` (Gemma 3's pre-MLP norm), `(T, hidden)`.
    PreFfnNorm(usize),
    /// `model.layers.N.post_feedforward_layernorm.output` (Gemma 3), `(T, hidden)`.
    PostFfnNorm(usize),
    /// `model.layers.N.mlp.gate_proj.output` (before SiLU), `(T, intermediate)`.
    Gate(usize),
    /// `model.layers.N.mlp.up_proj.output`, `(T, intermediate)`.
    Up(usize),
    /// `model.layers.N.mlp.down_proj.input`: `act_fn(gate) * up`, `(T, intermediate)`.
    DownIn(usize),
    /// `model.layers.N.mlp.output` (before the residual add), `(T, hidden)`.
    Mlp(usize),
    /// `model.layers.N.output`, the residual stream after layer N, `(T, hidden)`.
    Layer(usize),
    /// `model.norm.output`, `(T, hidden)`.
    FinalNorm,
    /// `logits`, `(T, vocab)` (or the last token only when only it was computed).
    Logits,
}

impl Activation {
    /// The name of this site in an `arch` model: its transformers module path plus `.output`.
    /// The norms around the MLP are named by the modules the family's row gives
    /// ([`kiln_format::family::NormModules`]: GLM-4's attention-output norm is
    /// `post_self_attn_layernorm`, its pre-MLP norm keeps Llama's `post_attention_layernorm`, its
    /// MLP-output norm is `post_mlp_layernorm`); every other site is spelled alike.
    pub fn name(self, arch: Architecture) -> String {
        use Activation::*;
        if arch.spec().encoder {
            return self.bert_name();
        }
        let layer = |l: usize, s: &str| format!("model.layers.{l}.{s}.output");
        let norms = arch.spec().norms;
        match (norms.post, self) {
            (Some((attn, _)), AttnPostNorm(l)) => layer(l, attn),
            (Some(_), PreFfnNorm(l)) => layer(l, norms.mlp),
            (Some((_, mlp)), PostFfnNorm(l)) => layer(l, mlp),
            _ => self.to_string(),
        }
    }
}

impl Activation {
    /// The name of this site in a `BertModel` (the encoder family): its module path plus
    /// `.output`. A post-norm block's norms are its `LayerNorm`s after each residual add, so
    /// [`Activation::AttnNorm`] is `attention.output` (`LayerNorm(dense + input)`) and
    /// [`Activation::Layer`] the layer's output; [`Activation::DownIn`] is `intermediate`
    /// (the GELU of its dense output).
    fn bert_name(self) -> String {
        use Activation::*;
        let layer = |l: usize, s: &str| format!("encoder.layer.{l}.{s}.output");
        match self {
            Embed => "embeddings.output".into(),
            AttnNorm(l) => layer(l, "attention.output"),
            Q(l) => layer(l, "attention.self.query"),
            K(l) => layer(l, "attention.self.key"),
            V(l) => layer(l, "attention.self.value"),
            AttnOut(l) => format!("encoder.layer.{l}.attention.output.dense.input"),
            O(l) => layer(l, "attention.output.dense"),
            Up(l) => layer(l, "intermediate.dense"),
            DownIn(l) => layer(l, "intermediate"),
            Mlp(l) => layer(l, "output.dense"),
            Layer(l) => format!("encoder.layer.{l}.output"),
            // Sites a BERT block does not have keep the decoder spelling (never emitted).
            other => other.to_string(),
        }
    }
}

/// The Llama family's and Gemma 3's names (see [`Activation::name`] for the others).
impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use Activation::*;
        let layer = |f: &mut fmt::Formatter<'_>, l: &usize, s: &str| {
            write!(f, "model.layers.{l}.{s}.output")
        };
        match self {
            Embed => f.write_str("model.embed_tokens.output"),
            AttnNorm(l) => layer(f, l, "input_layernorm"),
            Q(l) => layer(f, l, "self_attn.q_proj"),
            K(l) => layer(f, l, "self_attn.k_proj"),
            V(l) => layer(f, l, "self_attn.v_proj"),
            QNorm(l) => layer(f, l, "self_attn.q_norm"),
            KNorm(l) => layer(f, l, "self_attn.k_norm"),
            AttnOut(l) => write!(f, "model.layers.{l}.self_attn.o_proj.input"),
            O(l) => layer(f, l, "self_attn.o_proj"),
            MlpNorm(l) | AttnPostNorm(l) => layer(f, l, "post_attention_layernorm"),
            PreFfnNorm(l) => layer(f, l, "pre_feedforward_layernorm"),
            PostFfnNorm(l) => layer(f, l, "post_feedforward_layernorm"),
            Gate(l) => layer(f, l, "mlp.gate_proj"),
            Up(l) => layer(f, l, "mlp.up_proj"),
            DownIn(l) => write!(f, "model.layers.{l}.mlp.down_proj.input"),
            Mlp(l) => layer(f, l, "mlp"),
            Layer(l) => write!(f, "model.layers.{l}.output"),
            FinalNorm => f.write_str("model.norm.output"),
            Logits => f.write_str("logits"),
        }
    }
}

/// Report `data` (`rows × cols`) as `act` of an `arch` model if an observer is attached and
/// wants it.
#[inline]
pub(crate) fn emit(
    observer: &mut Option<&mut dyn Observer>,
    arch: Architecture,
    act: Activation,
    data: &[f32],
    cols: usize,
) {
    if let Some(o) = observer {
        let name = act.name(arch);
        if o.wants(&name) {
            o.record(&name, data, [data.len() / cols.max(1), cols]);
        }
    }
}

/// [`emit`], then offer the observer to [`Observer::edit`] the activation.
pub(crate) fn emit_edit(
    observer: &mut Option<&mut dyn Observer>,
    arch: Architecture,
    act: Activation,
    data: &mut [f32],
    cols: usize,
) {
    if let Some(o) = observer {
        let name = act.name(arch);
        if o.wants(&name) {
            let shape = [data.len() / cols.max(1), cols];
            o.record(&name, data, shape);
            o.edit(&name, data, shape);
        }
    }
}

/// Whether an attached observer wants `act` of an `arch` model (false without one).
pub(crate) fn wants(
    observer: &Option<&mut dyn Observer>,
    arch: Architecture,
    act: Activation,
) -> bool {
    observer.as_ref().is_some_and(|o| o.wants(&act.name(arch)))
}

/// An observer that keeps copies of everything it is offered (or of the listed names).
#[derive(Debug, Default)]
pub struct Recorder {
    /// Names to keep; empty keeps everything.
    pub only: Vec<String>,
    /// What was recorded, in order: name, shape, data.
    pub records: Vec<(String, [usize; 2], Vec<f32>)>,
}

impl Recorder {
    /// The first record named `name`.
    pub fn get(&self, name: &str) -> Option<(&[usize; 2], &[f32])> {
        self.records
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, s, d)| (s, d.as_slice()))
    }
}

impl Observer for Recorder {
    fn wants(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|n| n == name)
    }

    fn record(&mut self, name: &str, data: &[f32], shape: [usize; 2]) {
        self.records.push((name.to_string(), shape, data.to_vec()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_the_reference_dumps() {
        for (a, want) in [
            (Activation::Embed, "model.embed_tokens.output"),
            (
                Activation::AttnNorm(0),
                "model.layers.0.input_layernorm.output",
            ),
            (Activation::Q(3), "model.layers.3.self_attn.q_proj.output"),
            (Activation::K(3), "model.layers.3.self_attn.k_proj.output"),
            (Activation::V(3), "model.layers.3.self_attn.v_proj.output"),
            (Activation::O(3), "model.layers.3.self_attn.o_proj.output"),
            (
                Activation::MlpNorm(1),
                "model.layers.1.post_attention_layernorm.output",
            ),
            (
                Activation::QNorm(2),
                "model.layers.2.self_attn.q_norm.output",
            ),
            (
                Activation::KNorm(2),
                "model.layers.2.self_attn.k_norm.output",
            ),
            (
                Activation::AttnPostNorm(1),
                "model.layers.1.post_attention_layernorm.output",
            ),
            (
                Activation::PreFfnNorm(1),
                "model.layers.1.pre_feedforward_layernorm.output",
            ),
            (
                Activation::PostFfnNorm(4),
                "model.layers.4.post_feedforward_layernorm.output",
            ),
            (Activation::Gate(29), "model.layers.29.mlp.gate_proj.output"),
            (Activation::Up(29), "model.layers.29.mlp.up_proj.output"),
            (Activation::Mlp(2), "model.layers.2.mlp.output"),
            (Activation::Layer(3), "model.layers.3.output"),
            (Activation::FinalNorm, "model.norm.output"),
            (Activation::Logits, "logits"),
        ] {
            assert_eq!(a.to_string(), want);
        }
    }

    #[test]
    fn glm4_names_its_norms_its_own_way() {
        let g = Architecture::Glm4;
        for (a, want) in [
            (
                Activation::AttnPostNorm(1),
                "model.layers.1.post_self_attn_layernorm.output",
            ),
            (
                Activation::PreFfnNorm(1),
                "model.layers.1.post_attention_layernorm.output",
            ),
            (
                Activation::PostFfnNorm(1),
                "model.layers.1.post_mlp_layernorm.output",
            ),
            (Activation::Q(0), "model.layers.0.self_attn.q_proj.output"),
        ] {
            assert_eq!(a.name(g), want);
        }
        assert_eq!(
            Activation::PreFfnNorm(1).name(Architecture::Gemma3),
            "model.layers.1.pre_feedforward_layernorm.output"
        );
    }
}
