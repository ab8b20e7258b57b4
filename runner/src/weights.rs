//! The model's weights as borrowed views into the file's memory map.
//!
//! Matrices are [`Matrix`] views in whatever encoding the file stores (F32, F16, BF16, Q8_0,
//! Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, mixed per tensor, as GGML's Q4_K_M/Q5_K_M files are): nothing is dequantized or copied at load. The only copies are the
//! 1-D norm weights and biases that are not stored as f32 (a few kilobytes per layer), decoded
//! once so the kernels see `&[f32]`.

use std::borrow::Cow;

use kiln_format::{
    DType, KilnFile, MlpKind, NormKind, NormPlace, NormStyle, Positions, Role, TensorName,
    GROUP_ROWS, QK, QK_K,
};
use kiln_kernels::{layernorm, rmsnorm, Matrix, WeightData};

use crate::config::Config;
use crate::error::{Result, RunnerError};

/// A 1-D f32 weight: borrowed from the map when stored as f32, decoded otherwise.
pub type Vector<'a> = Cow<'a, [f32]>;

/// A norm: RMSNorm's weight, or LayerNorm's weight and bias.
#[derive(Debug)]
pub struct Norm<'a> {
    /// The weight, `(width)` (`1 + w` already added for [`NormStyle::OnePlusWeight`]).
    pub weight: Vector<'a>,
    /// LayerNorm's bias; `None` for RMSNorm.
    pub bias: Option<Vector<'a>>,
}

impl Norm<'_> {
    /// Normalize one row `x` into `out`.
    pub fn apply(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        match &self.bias {
            None => rmsnorm(x, &self.weight, eps, out),
            Some(b) => layernorm(x, &self.weight, b, eps, out),
        }
    }
}

/// One decoder layer.
#[derive(Debug)]
pub struct LayerWeights<'a> {
    /// The attention sublayer's norm, `(hidden)`: on its input (pre-norm) or on the residual
    /// after it (post-norm, BERT's `attention.output.LayerNorm`).
    pub attn_norm: Norm<'a>,
    /// Query projection, `(heads*head_dim, hidden)`.
    pub q: Matrix<'a>,
    /// Key projection, `(kv_heads*head_dim, hidden)`.
    pub k: Matrix<'a>,
    /// Value projection, `(kv_heads*head_dim, hidden)`.
    pub v: Matrix<'a>,
    /// Attention output projection, `(hidden, heads*head_dim)`.
    pub o: Matrix<'a>,
    /// q/k/v biases (Qwen2): `(heads*head_dim)`, `(kv_heads*head_dim)`, `(kv_heads*head_dim)`.
    pub qkv_bias: Option<[Vector<'a>; 3]>,
    /// Attention output bias (BERT), `(hidden)`.
    pub o_bias: Option<Vector<'a>>,
    /// Per-head query and key RMSNorm weights, `(head_dim)` each (Qwen3, Gemma 3).
    pub qk_norm: Option<[Vector<'a>; 2]>,
    /// RMSNorm weight on the attention output (Gemma 3), `(hidden)`.
    pub attn_post_norm: Option<Vector<'a>>,
    /// The MLP sublayer's norm, `(hidden)` (pre- or post-, as `attn_norm`).
    pub mlp_norm: Norm<'a>,
    /// RMSNorm weight on the MLP output (Gemma 3), `(hidden)`.
    pub mlp_post_norm: Option<Vector<'a>>,
    /// Gate projection, `(intermediate, hidden)`; none in a plain MLP (BERT).
    pub gate: Option<Matrix<'a>>,
    /// Up projection, `(intermediate, hidden)`.
    pub up: Matrix<'a>,
    /// Up projection bias (BERT), `(intermediate)`.
    pub up_bias: Option<Vector<'a>>,
    /// Down projection, `(hidden, intermediate)`.
    pub down: Matrix<'a>,
    /// Down projection bias (BERT), `(hidden)`.
    pub down_bias: Option<Vector<'a>>,
}

/// The whole model.
#[derive(Debug)]
pub struct Weights<'a> {
    /// Token embeddings, `(vocab, hidden)`; also the output projection when tied.
    pub embed: Matrix<'a>,
    /// Learned position embeddings (BERT), `(max_position_embeddings, hidden)`.
    pub pos_embed: Option<Matrix<'a>>,
    /// Row 0 of the token-type table (BERT), `(hidden)`: the type every token gets.
    pub type_embed: Option<Vec<f32>>,
    /// The norm on the summed embeddings (post-norm models), `(hidden)`.
    pub embed_norm: Option<Norm<'a>>,
    /// Decoder layers, `(layers)`.
    pub layers: Vec<LayerWeights<'a>>,
    /// Final norm (pre-norm models), `(hidden)`.
    pub final_norm: Option<Norm<'a>>,
    /// Output projection, `(vocab, hidden)`; `None` when tied to `embed`.
    pub lm_head: Option<Matrix<'a>>,
    /// An embedding model's projections of the pooled vector, in order, with their biases.
    pub dense: Vec<Dense<'a>>,
}

/// A dense layer of an embedding model: its weight and, if it has one, its bias.
pub type Dense<'a> = (Matrix<'a>, Option<Cow<'a, [f32]>>);

/// The dense layers `config`'s embedding spec lists (none for a generator).
fn dense_layers<'a>(file: &'a KilnFile, config: &Config) -> Result<Vec<Dense<'a>>> {
    let Some(spec) = &config.embedding else {
        return Ok(Vec::new());
    };
    spec.dense
        .iter()
        .enumerate()
        .map(|(k, d)| {
            // `ModelConfig::check` allows at most as many layers as there are roles.
            let (w, b) = Role::dense(k).ok_or_else(|| RunnerError::BadConfig {
                file: file.label().to_string(),
                field: "embedding.dense",
                reason: format!("dense layer {k} has no tensor name"),
            })?;
            let bias = d
                .bias
                .then(|| vector(file, TensorName::global(b)))
                .transpose()?;
            Ok((matrix(file, TensorName::global(w))?, bias))
        })
        .collect()
}

impl<'a> Weights<'a> {
    /// Borrow every weight from `file`. `config` must come from [`Config::from_file`] on the
    /// same file (which checked names and shapes).
    pub fn load(file: &'a KilnFile, config: &Config) -> Result<Weights<'a>> {
        let g = |role| TensorName::global(role);
        let layers = (0..config.layers as u32)
            .map(|l| {
                let t = |role| TensorName::layer(l, role);
                let norm = |role| norm(file, t(role), config.norm_style);
                let post = |role| config.post_norms.then(|| norm(role)).transpose();
                let full = |w, b| full_norm(file, config, t(w), t(b));
                let bias = |role| {
                    config
                        .linear_bias
                        .then(|| vector(file, t(role)))
                        .transpose()
                };
                Ok(LayerWeights {
                    attn_norm: full(Role::AttnNorm, Role::AttnNormBias)?,
                    q: matrix(file, t(Role::AttnQ))?,
                    k: matrix(file, t(Role::AttnK))?,
                    v: matrix(file, t(Role::AttnV))?,
                    o: matrix(file, t(Role::AttnO))?,
                    qkv_bias: if config.attention_bias {
                        Some([
                            vector(file, t(Role::AttnQBias))?,
                            vector(file, t(Role::AttnKBias))?,
                            vector(file, t(Role::AttnVBias))?,
                        ])
                    } else {
                        None
                    },
                    qk_norm: if config.qk_norm {
                        Some([norm(Role::AttnQNorm)?, norm(Role::AttnKNorm)?])
                    } else {
                        None
                    },
                    o_bias: bias(Role::AttnOBias)?,
                    attn_post_norm: post(Role::AttnPostNorm)?,
                    mlp_norm: full(Role::MlpNorm, Role::MlpNormBias)?,
                    mlp_post_norm: post(Role::MlpPostNorm)?,
                    gate: match config.mlp_kind {
                        MlpKind::Gated => Some(matrix(file, t(Role::MlpGate))?),
                        MlpKind::Plain => None,
                    },
                    up: matrix(file, t(Role::MlpUp))?,
                    up_bias: bias(Role::MlpUpBias)?,
                    down: matrix(file, t(Role::MlpDown))?,
                    down_bias: bias(Role::MlpDownBias)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let post = config.norm_place == NormPlace::Post;
        let type_embed = match config.type_vocab {
            Some(_) => {
                let table = matrix(file, g(Role::TypeEmbed))?;
                let mut row = vec![0.0; config.hidden];
                dequantize_row(&table, 0, &mut row);
                Some(row)
            }
            None => None,
        };
        Ok(Weights {
            embed: matrix(file, g(Role::Embed))?,
            pos_embed: match config.positions {
                Positions::Learned => Some(matrix(file, g(Role::PosEmbed))?),
                Positions::Rope => None,
            },
            type_embed,
            embed_norm: post
                .then(|| full_norm(file, config, g(Role::EmbedNorm), g(Role::EmbedNormBias)))
                .transpose()?,
            layers,
            final_norm: (!post)
                .then(|| full_norm(file, config, g(Role::FinalNorm), g(Role::FinalNormBias)))
                .transpose()?,
            lm_head: if config.tie_word_embeddings || config.is_encoder() {
                None
            } else {
                Some(matrix(file, g(Role::LmHead))?)
            },
            dense: dense_layers(file, config)?,
        })
    }

    /// The output projection, `(vocab, hidden)`.
    pub fn output(&self) -> &Matrix<'a> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weight data a decode step streams (every matrix once, the embedding row aside).
    pub fn matrix_bytes(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down]
                    .into_iter()
                    .chain(&l.gate)
                    .map(|m| m.data.byte_len())
                    .sum::<usize>()
            })
            .sum();
        layer + self.output().data.byte_len()
    }
}

fn matrix<'a>(file: &'a KilnFile, name: TensorName) -> Result<Matrix<'a>> {
    let tensor = name.to_string();
    let view = file.tensor(&tensor)?;
    let [rows, cols] = match *view.shape() {
        [r, c] => [r as usize, c as usize],
        ref other => {
            return Err(RunnerError::TensorShape {
                file: file.label().to_string(),
                tensor,
                expected: vec![0, 0],
                found: other.to_vec(),
            })
        }
    };
    let data = match view.dtype() {
        DType::F32 => WeightData::F32(view.as_f32()?),
        DType::F16 => WeightData::F16(view.as_f16()?),
        DType::BF16 => WeightData::BF16(view.as_bf16()?),
        DType::Q8_0 => WeightData::Q8_0(view.as_q8_0()?),
        DType::Q4_0 => WeightData::Q4_0(view.as_q4_0()?),
        DType::Q4_0x16 => WeightData::Q4_0x16(view.as_q4_0x16()?),
        DType::Q5_0 => WeightData::Q5_0(view.as_q5_0()?),
        DType::Q5_1 => WeightData::Q5_1(view.as_q5_1()?),
        DType::Q4_K => WeightData::Q4_K(view.as_q4_k()?),
        DType::Q5_K => WeightData::Q5_K(view.as_q5_k()?),
        DType::Q6_K => WeightData::Q6_K(view.as_q6_k()?),
        DType::Q2_K => WeightData::Q2_K(view.as_blocks()?),
        DType::Q3_K => WeightData::Q3_K(view.as_blocks()?),
        DType::IQ4_NL => WeightData::IQ4_NL(view.as_blocks()?),
        DType::IQ4_XS => WeightData::IQ4_XS(view.as_blocks()?),
        DType::IQ4_NLx16 => WeightData::IQ4_NLx16(view.as_blocks()?),
        DType::IQ4_XSx16 => WeightData::IQ4_XSx16(view.as_blocks()?),
    };
    Matrix::new(rows, cols, data).map_err(|source| RunnerError::Kernel {
        file: file.label().to_string(),
        tensor,
        source,
    })
}

fn vector<'a>(file: &'a KilnFile, name: TensorName) -> Result<Vector<'a>> {
    let view = file.tensor(&name.to_string())?;
    Ok(match view.dtype() {
        DType::F32 => Cow::Borrowed(view.as_f32()?),
        DType::F16 | DType::BF16 => Cow::Owned(view.to_f32_vec()),
        d => {
            return Err(RunnerError::TensorDType {
                file: file.label().to_string(),
                tensor: name.to_string(),
                dtype: d.to_string(),
                reason: "norm weights and biases must be f32, f16 or bf16",
            })
        }
    })
}

/// A norm weight as the plain RMSNorm kernel applies it: `(1 + w)` computed once here for
/// [`NormStyle::OnePlusWeight`] (Gemma's `output * (1.0 + weight.float())`, the same f32 sum).
fn norm<'a>(file: &'a KilnFile, name: TensorName, style: NormStyle) -> Result<Vector<'a>> {
    let w = vector(file, name)?;
    Ok(match style {
        NormStyle::Weight => w,
        NormStyle::OnePlusWeight => Cow::Owned(w.iter().map(|x| 1.0 + x).collect()),
    })
}

/// A block's norm: its weight, and for [`NormKind::Layer`] its bias (`bias`).
fn full_norm<'a>(
    file: &'a KilnFile,
    config: &Config,
    weight: TensorName,
    bias: TensorName,
) -> Result<Norm<'a>> {
    Ok(Norm {
        weight: norm(file, weight, config.norm_style)?,
        bias: match config.norm_kind {
            NormKind::Layer => Some(vector(file, bias)?),
            NormKind::Rms => None,
        },
    })
}

/// Decode row `row` of `m` into `out` (`m.cols` values): the embedding lookup.
pub fn dequantize_row(m: &Matrix<'_>, row: usize, out: &mut [f32]) {
    let cols = m.cols;
    assert!(row < m.rows, "row {row} of a {}-row matrix", m.rows);
    assert_eq!(out.len(), cols, "output length");
    let range = row * cols..(row + 1) * cols;
    let per_row = cols / m.data.block_len();
    let blocks = row * per_row..(row + 1) * per_row;
    match m.data {
        WeightData::F32(d) => out.copy_from_slice(&d[range]),
        WeightData::F16(d) => out
            .iter_mut()
            .zip(&d[range])
            .for_each(|(o, w)| *o = w.to_f32()),
        WeightData::BF16(d) => out
            .iter_mut()
            .zip(&d[range])
            .for_each(|(o, w)| *o = w.to_f32()),
        WeightData::Q8_0(d) => kiln_format::blocks::dequantize_row_q8_0(&d[blocks], out),
        WeightData::Q4_0(d) => kiln_format::blocks::dequantize_row_q4_0(&d[blocks], out),
        WeightData::Q5_0(d) => kiln_format::q5::dequantize_row_q5_0(&d[blocks], out),
        WeightData::Q5_1(d) => kiln_format::q5::dequantize_row_q5_1(&d[blocks], out),
        WeightData::Q4_K(d) => kiln_format::kquants::dequantize_row_q4_k(&d[blocks], out),
        WeightData::Q5_K(d) => kiln_format::kquants::dequantize_row_q5_k(&d[blocks], out),
        WeightData::Q6_K(d) => kiln_format::kquants::dequantize_row_q6_k(&d[blocks], out),
        WeightData::Q2_K(d) => kiln_format::kquants::dequantize_row_q2_k(&d[blocks], out),
        WeightData::Q3_K(d) => kiln_format::kquants::dequantize_row_q3_k(&d[blocks], out),
        WeightData::IQ4_NL(d) => kiln_format::iq4::dequantize_row_iq4_nl(&d[blocks], out),
        WeightData::IQ4_XS(d) => kiln_format::iq4::dequantize_row_iq4_xs(&d[blocks], out),
        WeightData::Q4_0x16(d) => {
            // Block b of the row is row `row % 16` of group `(row / 16)·nb + b`.
            let nb = cols / QK;
            let groups = &d[row / GROUP_ROWS * nb..][..nb];
            for (g, o) in groups.iter().zip(out.chunks_exact_mut(QK)) {
                let block = g.row(row % GROUP_ROWS);
                kiln_format::blocks::dequantize_block_q4_0(&block, o.try_into().expect("QK"));
            }
        }
        WeightData::IQ4_NLx16(d) => {
            // As for Q4_0x16.
            let nb = cols / QK;
            let groups = &d[row / GROUP_ROWS * nb..][..nb];
            for (g, o) in groups.iter().zip(out.chunks_exact_mut(QK)) {
                let block = g.row(row % GROUP_ROWS);
                kiln_format::iq4::dequantize_row_iq4_nl(std::slice::from_ref(&block), o);
            }
        }
        WeightData::IQ4_XSx16(d) => {
            // As for Q4_0x16, a super-block at a time.
            let nb = cols / QK_K;
            let groups = &d[row / GROUP_ROWS * nb..][..nb];
            for (g, o) in groups.iter().zip(out.chunks_exact_mut(QK_K)) {
                let block = g.row(row % GROUP_ROWS);
                kiln_format::iq4::dequantize_row_iq4_xs(std::slice::from_ref(&block), o);
            }
        }
    }
}
