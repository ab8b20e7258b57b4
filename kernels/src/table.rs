//! The per-tier kernel table, the scalar tier's table, and the safe, length-checking entry
//! points.
//!
//! A [`Kernels`] value holds one function pointer per kernel for one [`Isa`]: the scalar
//! tier's ([`SCALAR_TABLE`], the [`reference`](crate::reference) kernels) here, the SIMD
//! tiers' in [`crate::simd`], each starting from the scalar one. Which table runs is decided
//! elsewhere ([`crate::dispatch`]), and only a supported tier's table is ever handed out,
//! which is what makes the SIMD entries' `unsafe` calls sound. Every method here checks
//! lengths before calling into the table, so the table entries may assume them. The matrix
//! products over a table are [`crate::matmul`]'s, along the path [`crate::plan`] names.

use half::{bf16, f16};
use kiln_format::{
    BlockIQ4NL, BlockIQ4XS, BlockIQ4XSx16, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, DType, QK,
};

use crate::interleaved::{Codes, Group};
use crate::isa::Isa;
use crate::klanes::KLanesFn;
use crate::kquant::{KTiles, SCALAR_TILES};
use crate::lanes::{FloatLanesFn, LanesFn};
use crate::reference::{self as r, tile_ref};
use crate::shape::weighted_sum_shape;
use crate::stats::ErrorStats;
use crate::tile::{Prepared, Tile, TILE_ROWS};

/// A weight quantizer: GGML's reference rule over whole blocks, with round-trip statistics
/// ([`Kernels::quantize_blocks`]).
pub(crate) type QuantizeBlocksFn =
    fn(DType, &[f32], &mut Vec<u8>, &mut ErrorStats) -> Result<(), usize>;

/// One tier's kernels. Get one with [`crate::kernels`] (a given tier) or [`crate::active`]
/// (the dispatched one).
#[derive(Debug, Clone)]
pub struct Kernels {
    pub(crate) isa: Isa,
    pub(crate) dot_f32: fn(&[f32], &[f32]) -> f32,
    pub(crate) axpy: fn(f32, &[f32], &mut [f32]),
    pub(crate) weighted_sum: fn(&[f32], usize, &[f32], usize, &mut [f32]),
    pub(crate) weighted_sum_f16: fn(&[f32], usize, &[f16], usize, &mut [f32]),
    pub(crate) dot_f16_f32: fn(&[f16], &[f32]) -> f32,
    pub(crate) dot_bf16_f32: fn(&[bf16], &[f32]) -> f32,
    pub(crate) dot_q8_0_q8_0: fn(&[BlockQ8_0], &[BlockQ8_0]) -> f32,
    pub(crate) dot_q4_0_q8_0: fn(&[BlockQ4_0], &[BlockQ8_0]) -> f32,
    pub(crate) quantize_row_q8_0_act: fn(&[f32], &mut [BlockQ8_0]),
    /// The K-quant products' activations (the reference's bits in every tier).
    pub(crate) quantize_row_q8_k_act: fn(&[f32], &mut [kiln_format::BlockQ8K]),
    pub(crate) rmsnorm: fn(&[f32], &[f32], f32, &mut [f32]),
    pub(crate) softmax_inplace: fn(&mut [f32]),
    pub(crate) exp_sum: fn(&mut [f32], f32) -> f32,
    pub(crate) silu_mul: fn(&[f32], &[f32], &mut [f32]),
    /// The reference in every tier: GeGLU runs once per MLP, a small share of a Gemma
    /// forward pass next to its matrix products.
    pub(crate) gelu_tanh_mul: fn(&[f32], &[f32], &mut [f32]),
    pub(crate) gelu: fn(&[f32], &mut [f32]),
    pub(crate) decode_bf16: fn(&[u8], &mut [f32]),
    /// f16 weights widened to f32 for the float lanes kernel.
    pub(crate) widen_f16: fn(&[f16], &mut [f32]),
    pub(crate) quantize_blocks: QuantizeBlocksFn,
    pub(crate) tile_f32: Tile<f32, f32>,
    pub(crate) tile_f16: Tile<f16, f32>,
    pub(crate) tile_bf16: Tile<bf16, f32>,
    pub(crate) tile_q8_0: Tile<BlockQ8_0, BlockQ8_0>,
    pub(crate) tile_q4_0: Tile<BlockQ4_0, BlockQ8_0>,
    /// Kernels over prepared activations, where the tier has them (used instead of the
    /// plain block tiles above).
    pub(crate) prepared_q8_0: Option<Prepared<BlockQ8_0>>,
    pub(crate) prepared_q4_0: Option<Prepared<BlockQ4_0>>,
    /// The tokens-in-lanes kernel for block weights, where the tier has one (which batches
    /// take it: [`crate::plan`]).
    pub(crate) lanes: Option<LanesFn>,
    /// The tokens-in-lanes kernel for K-quant weights (Q2_K…Q6_K, IQ4_XS), where the tier has
    /// one (see [`crate::klanes`]; which batches take it: [`crate::plan`]).
    pub(crate) klanes: Option<KLanesFn>,
    /// The same for float weights (F32, F16, BF16, widened once per row).
    pub(crate) float_lanes: Option<FloatLanesFn>,
    /// The kernel for sixteen interleaved Q4_0 rows against a few tokens, where the tier has
    /// one (other tiers turn each chunk back into plain rows for their Q4_0 tiles).
    pub(crate) group_q4_0x16: Option<Group>,
    /// The same for sixteen interleaved IQ4_NL rows (other tiers turn each chunk back into
    /// plain rows for their IQ4_NL tiles).
    pub(crate) group_iq4_nlx16: Option<Group>,
    /// The same for sixteen interleaved IQ4_XS rows, against Q8_K activations (other tiers
    /// turn each chunk back into plain rows for their IQ4_XS tiles or K-quant lanes kernel).
    pub(crate) group_iq4_xsx16: Option<Group<BlockIQ4XSx16, BlockQ8K>>,
    /// The Q5_0, Q5_1 and K-quant tiles (see [`crate::kquant`]).
    pub(crate) kq: KTiles,
}

/// The scalar tier: the reference kernels.
pub(crate) static SCALAR: Kernels = SCALAR_TABLE;

/// The scalar table as a constant, so SIMD tables can start from it.
pub(crate) const SCALAR_TABLE: Kernels = Kernels {
    isa: Isa::Scalar,
    dot_f32: r::dot_f32_ref,
    axpy: r::axpy_ref,
    weighted_sum: r::weighted_sum_ref,
    weighted_sum_f16: r::weighted_sum_f16_ref,
    dot_f16_f32: r::dot_f16_f32_ref,
    dot_bf16_f32: r::dot_bf16_f32_ref,
    dot_q8_0_q8_0: r::dot_q8_0_q8_0_ref,
    dot_q4_0_q8_0: r::dot_q4_0_q8_0_ref,
    quantize_row_q8_0_act: r::quantize_row_q8_0_act_ref,
    quantize_row_q8_k_act: r::quantize_row_q8_k_act_ref,
    rmsnorm: r::rmsnorm_ref,
    softmax_inplace: r::softmax_inplace_ref,
    exp_sum: r::exp_sum_ref,
    silu_mul: r::silu_mul_ref,
    gelu_tanh_mul: r::gelu_tanh_mul_ref,
    gelu: r::gelu_ref,
    decode_bf16: r::decode_bf16_ref,
    widen_f16: r::widen_f16_ref,
    quantize_blocks: r::quantize_blocks_ref,
    tile_f32: Tile::new(
        |w, x, o| tile_ref(w, x, o, r::dot_f32_ref),
        1,
        |w, x, o| tile_ref(w, x, o, r::dot_f32_ref),
    ),
    tile_f16: Tile::new(
        |w, x, o| tile_ref(w, x, o, r::dot_f16_f32_ref),
        1,
        |w, x, o| tile_ref(w, x, o, r::dot_f16_f32_ref),
    ),
    tile_bf16: Tile::new(
        |w, x, o| tile_ref(w, x, o, r::dot_bf16_f32_ref),
        1,
        |w, x, o| tile_ref(w, x, o, r::dot_bf16_f32_ref),
    ),
    tile_q8_0: Tile::new(
        |w, x, o| tile_ref(w, x, o, r::dot_q8_0_q8_0_ref),
        1,
        |w, x, o| tile_ref(w, x, o, r::dot_q8_0_q8_0_ref),
    ),
    tile_q4_0: Tile::new(
        |w, x, o| tile_ref(w, x, o, r::dot_q4_0_q8_0_ref),
        1,
        |w, x, o| tile_ref(w, x, o, r::dot_q4_0_q8_0_ref),
    ),
    prepared_q8_0: None,
    prepared_q4_0: None,
    lanes: None,
    klanes: None,
    float_lanes: None,
    group_q4_0x16: None,
    group_iq4_nlx16: None,
    group_iq4_xsx16: None,
    kq: SCALAR_TILES,
};

impl Kernels {
    /// The tier these kernels run at.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// `Σ a[i]·b[i]`. Panics if the lengths differ.
    pub fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
        (self.dot_f32)(a, b)
    }

    /// `y += alpha·x`. Panics if the lengths differ.
    pub fn axpy(&self, alpha: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len(), "axpy: length mismatch");
        (self.axpy)(alpha, x, y)
    }

    /// `out[r][c] = Σ_j probs[r·stride + j]·v[j·width + c]`: the probability-weighted sum of the
    /// rows of `v` (each `width` wide, `keys = v.len() / width` of them) for each of the
    /// `out.len() / width` rows of `out`, which it overwrites. The same bits as this tier's
    /// [`axpy`](Self::axpy) over `j = 0, 1, …` into a zeroed row. Panics if `width` is zero,
    /// `v` or `out` is not whole rows, or `probs` is too short for the rows at `stride`.
    pub fn weighted_sum(
        &self,
        probs: &[f32],
        stride: usize,
        v: &[f32],
        width: usize,
        out: &mut [f32],
    ) {
        weighted_sum_shape(probs, stride, v, width, out);
        (self.weighted_sum)(probs, stride, v, width, out)
    }

    /// [`weighted_sum`](Self::weighted_sum) over f16 rows of `v` (an f16 KV cache's values),
    /// each widened as it is loaded: the same bits as `weighted_sum` over the widened rows.
    pub fn weighted_sum_f16(
        &self,
        probs: &[f32],
        stride: usize,
        v: &[f16],
        width: usize,
        out: &mut [f32],
    ) {
        weighted_sum_shape(probs, stride, v, width, out);
        (self.weighted_sum_f16)(probs, stride, v, width, out)
    }

    /// `Σ w[i]·x[i]` for f16 weights. Panics if the lengths differ.
    pub fn dot_f16_f32(&self, w: &[f16], x: &[f32]) -> f32 {
        assert_eq!(w.len(), x.len(), "dot_f16_f32: length mismatch");
        (self.dot_f16_f32)(w, x)
    }

    /// `Σ w[i]·x[i]` for bf16 weights. Panics if the lengths differ.
    pub fn dot_bf16_f32(&self, w: &[bf16], x: &[f32]) -> f32 {
        assert_eq!(w.len(), x.len(), "dot_bf16_f32: length mismatch");
        (self.dot_bf16_f32)(w, x)
    }

    /// Q8_0 weights · Q8_0 activations. Panics if the block counts differ.
    pub fn dot_q8_0_q8_0(&self, w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        assert_eq!(w.len(), x.len(), "dot_q8_0_q8_0: block count mismatch");
        (self.dot_q8_0_q8_0)(w, x)
    }

    /// Q4_0 weights · Q8_0 activations. Panics if the block counts differ.
    pub fn dot_q4_0_q8_0(&self, w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        assert_eq!(w.len(), x.len(), "dot_q4_0_q8_0: block count mismatch");
        (self.dot_q4_0_q8_0)(w, x)
    }

    /// Quantize activations to Q8_0 (GGML's rule). Panics unless `x.len() == 32·out.len()`.
    pub fn quantize_row_q8_0_act(&self, x: &[f32], out: &mut [BlockQ8_0]) {
        assert_eq!(
            x.len(),
            out.len() * QK,
            "quantize_row_q8_0_act: x must hold 32 values per output block"
        );
        (self.quantize_row_q8_0_act)(x, out)
    }

    /// Quantize activations to Q8_K (GGML's rule, the bits of
    /// [`crate::reference::quantize_row_q8_k_act_ref`] in every tier). Panics unless
    /// `x.len() == 256·out.len()`.
    pub fn quantize_row_q8_k_act(&self, x: &[f32], out: &mut [kiln_format::BlockQ8K]) {
        assert_eq!(
            x.len(),
            out.len() * kiln_format::QK_K,
            "quantize_row_q8_k_act: x must hold 256 values per output block"
        );
        (self.quantize_row_q8_k_act)(x, out)
    }

    /// RMSNorm of one row. Panics if the lengths differ.
    pub fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        assert_eq!(x.len(), weight.len(), "rmsnorm: weight length mismatch");
        assert_eq!(x.len(), out.len(), "rmsnorm: output length mismatch");
        (self.rmsnorm)(x, weight, eps, out)
    }

    /// Softmax in place.
    pub fn softmax_inplace(&self, x: &mut [f32]) {
        (self.softmax_inplace)(x)
    }

    /// `x[i] = e^(x[i] - shift)` in place; returns their sum.
    pub fn exp_sum(&self, x: &mut [f32], shift: f32) -> f32 {
        (self.exp_sum)(x, shift)
    }

    /// `out = silu(gate)·up`. Panics if the lengths differ.
    pub fn silu_mul(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
        assert_eq!(gate.len(), out.len(), "silu_mul: output length mismatch");
        (self.silu_mul)(gate, up, out)
    }

    /// `out = gelu_tanh(gate)·up` (GeGLU). Panics if the lengths differ.
    pub fn gelu_tanh_mul(&self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert_eq!(gate.len(), up.len(), "gelu_tanh_mul: length mismatch");
        assert_eq!(
            gate.len(),
            out.len(),
            "gelu_tanh_mul: output length mismatch"
        );
        (self.gelu_tanh_mul)(gate, up, out)
    }

    /// `out = gelu(x)`, the exact (erf) GELU of encoders' MLPs. Panics if the lengths differ.
    pub fn gelu(&self, x: &[f32], out: &mut [f32]) {
        assert_eq!(x.len(), out.len(), "gelu: output length mismatch");
        (self.gelu)(x, out)
    }

    /// `out[i] = w[i]` as f32. Panics if the lengths differ.
    pub fn widen_f16(&self, w: &[f16], out: &mut [f32]) {
        assert_eq!(w.len(), out.len(), "widen_f16: length mismatch");
        (self.widen_f16)(w, out)
    }

    /// Little-endian bf16 bytes to f32 (NaNs quieted, as the format crate decodes them); a
    /// trailing odd byte is ignored. Panics unless `out.len() == bytes.len() / 2`.
    pub fn decode_bf16(&self, bytes: &[u8], out: &mut [f32]) {
        (self.decode_bf16)(bytes, out)
    }

    /// Quantize `x` (whole blocks) to `dtype`, any block type of one row, with GGML's
    /// reference rule, appending the blocks to `out` and their round-trip error to `stats`:
    /// exactly [`reference::quantize_blocks_ref`](crate::reference::quantize_blocks_ref),
    /// bytes and statistics, in every tier (Q8_0 and Q4_0 through the tier's fused loop where
    /// it has one). `Err(b)` when block `b`'s f16 scales overflow; `out` then holds a partial
    /// result to discard. Panics if `dtype` is not a block type of one row or `x` is not
    /// whole blocks.
    pub fn quantize_blocks(
        &self,
        dtype: DType,
        x: &[f32],
        out: &mut Vec<u8>,
        stats: &mut ErrorStats,
    ) -> Result<(), usize> {
        (self.quantize_blocks)(dtype, x, out, stats)
    }
}

impl Kernels {
    /// The tier's kernel for sixteen interleaved rows of `codes`, if it has one.
    pub(crate) fn interleaved_group(&self, codes: Codes) -> Option<Group> {
        match codes {
            Codes::Q4_0 => self.group_q4_0x16,
            Codes::IQ4_NL => self.group_iq4_nlx16,
        }
    }
}

/// The one-row products of the Q5_0, Q5_1 and K-quant tiles ([`crate::kquant`]).
impl Kernels {
    /// Q5_0 weights · Q8_0 activations. Panics if the block counts differ.
    pub fn dot_q5_0_q8_0(&self, w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
        one_dot(&self.kq.q5_0, w, x)
    }

    /// Q5_1 weights · Q8_0 activations. Panics if the block counts differ.
    pub fn dot_q5_1_q8_0(&self, w: &[BlockQ5_1], x: &[BlockQ8_0]) -> f32 {
        one_dot(&self.kq.q5_1, w, x)
    }

    /// Q4_K weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_q4_k_q8_k(&self, w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.q4_k, w, x)
    }

    /// Q5_K weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_q5_k_q8_k(&self, w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.q5_k, w, x)
    }

    /// Q6_K weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_q6_k_q8_k(&self, w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.q6_k, w, x)
    }

    /// Q2_K weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_q2_k_q8_k(&self, w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.q2_k, w, x)
    }

    /// Q3_K weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_q3_k_q8_k(&self, w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.q3_k, w, x)
    }

    /// IQ4_NL weights · Q8_0 activations. Panics if the block counts differ.
    pub fn dot_iq4_nl_q8_0(&self, w: &[BlockIQ4NL], x: &[BlockQ8_0]) -> f32 {
        one_dot(&self.kq.iq4_nl, w, x)
    }

    /// IQ4_XS weights · Q8_K activations. Panics if the block counts differ.
    pub fn dot_iq4_xs_q8_k(&self, w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
        one_dot(&self.kq.iq4_xs, w, x)
    }
}

/// One row and one token through a tier's one-token tile (the row repeated in its four slots).
fn one_dot<W, X>(tile: &Tile<W, X>, w: &[W], x: &[X]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: block count mismatch");
    let mut out = [[0f32; TILE_ROWS]];
    (tile.one)(&[w; TILE_ROWS], &[x], &mut out);
    out[0][0]
}
