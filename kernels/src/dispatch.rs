//! The per-tier kernel table and the safe, length-checking entry points.
//!
//! A [`Kernels`] value holds one function pointer per kernel for one [`Isa`]. Tables for SIMD
//! tiers are only handed out by [`kernels`] when the CPU supports the tier, which is the
//! invariant that makes their `unsafe` calls sound. Every method here checks lengths before
//! calling into the table, so the table entries may assume them.

use std::sync::OnceLock;

use half::{bf16, f16};
use kiln_format::{BlockQ4_0, BlockQ8_0, DType, QK};

use crate::isa::{isa, Isa};
use crate::reference as r;
use crate::stats::ErrorStats;

/// A weight quantizer: GGML's reference rule over whole blocks, with round-trip statistics
/// ([`Kernels::quantize_blocks`]).
pub(crate) type QuantizeBlocksFn =
    fn(DType, &[f32], &mut Vec<u8>, &mut ErrorStats) -> Result<(), usize>;

/// Output rows computed together by one tile kernel call (they share the activation loads).
pub const TILE_ROWS: usize = 4;

/// A tile kernel: `TILE_ROWS` weight rows against `xs.len()` activation rows, writing
/// `out[t][r]`. Checks that the token count is one it was built for and that lengths agree.
pub(crate) type TileFn<W, X> = fn(&[&[W]; TILE_ROWS], &[&[X]], &mut [[f32; TILE_ROWS]]);

/// One activation block pair prepared once per product for a tier's pair kernel (AVX-512:
/// the 64 codes, their offset correction and the two scales, as three 512-bit vectors), so
/// that the tile kernels, which meet every token once per four weight rows, only load it.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct PreparedPair(pub(crate) [u8; 192]);

impl PreparedPair {
    pub(crate) const ZERO: PreparedPair = PreparedPair([0; 192]);
}

/// Prepare one token's Q8_0 row: `out.len() == x.len().div_ceil(2)`.
pub(crate) type PrepareFn = fn(&[BlockQ8_0], &mut [PreparedPair]);

/// A block-weight encoding's kernels over prepared activations: the preparation, and the
/// one-token and multi-token tiles (same token count as the plain ones, same bits).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prepared<W: 'static> {
    pub(crate) prepare: PrepareFn,
    pub(crate) tile: Tile<W, PreparedPair>,
}

/// Rows a [`RowsFn`] computes per call: a parallel task's rows ([`crate::matmul::ROW_CHUNK`]).
pub(crate) const WIDE_ROWS: usize = 4 * TILE_ROWS;

/// A matrix–vector kernel over `WIDE_ROWS` consecutive weight rows (`w`, each
/// `w.len() / WIDE_ROWS` long) and one activation row, writing `out[r]`. It gives the one-token
/// tile's bits; it exists to pay one call, one reduction and one store per sixteen rows
/// instead of per four, which matters on the short rows of small models.
pub(crate) type RowsFn<W, X> = fn(&[W], &[X], &mut [f32; WIDE_ROWS]);

/// One weight encoding's tile kernels: one token, and `tokens` tokens at once (the
/// register-blocked kernel for prefill), and where the tier has one, the sixteen-row
/// one-token kernel. All give the same bits for a (row, token) pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile<W: 'static, X: 'static> {
    pub(crate) one: TileFn<W, X>,
    pub(crate) tokens: usize,
    pub(crate) many: TileFn<W, X>,
    pub(crate) rows: Option<RowsFn<W, X>>,
}

impl<W, X> Tile<W, X> {
    pub(crate) const fn new(one: TileFn<W, X>, tokens: usize, many: TileFn<W, X>) -> Self {
        Tile {
            one,
            tokens,
            many,
            rows: None,
        }
    }

    /// The same tiles with a sixteen-row one-token kernel (the x86 tiers have them; NEON's
    /// tiles are one dot per row, with no reduction or hand-over to save).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const fn with_rows(self, rows: RowsFn<W, X>) -> Self {
        Tile {
            rows: Some(rows),
            ..self
        }
    }
}

/// One tier's kernels. Get one with [`kernels`] (a given tier) or [`active`] (the dispatched one).
#[derive(Debug)]
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
    /// The tokens-in-lanes kernel for block weights, where the tier has one (used for
    /// batches of [`crate::lanes::LANES`] tokens and more).
    pub(crate) lanes: Option<crate::lanes::LanesFn>,
    /// Whether [`Kernels::lanes`] is only worth it for weights whose offset codes exceed 127
    /// (Q8_0's): at AVX2, whose lanes kernel has no `vpdpbusd`, the tier's own Q4_0/Q5_0 kernels
    /// are faster and the lanes kernel only beats the Q8_0 tiles.
    pub(crate) lanes_wide_only: bool,
    /// The tokens-in-lanes kernel for K-quant weights (Q4_K, Q5_K, Q6_K), where the tier has
    /// one (used for batches of [`crate::KLANES_MIN_TOKENS`] tokens and more; see
    /// [`crate::klanes`]).
    pub(crate) klanes: Option<crate::klanes::KLanesFn>,
    /// The same for float weights (F32, F16, BF16, widened once per row).
    pub(crate) float_lanes: Option<crate::lanes::FloatLanesFn>,
    /// The one-token kernel for sixteen interleaved Q4_0 rows, where the tier has one (other
    /// tiers turn each chunk back into plain rows for their Q4_0 tiles).
    pub(crate) group_q4_0x16: Option<crate::interleaved::GroupFn>,
    /// The Q5_0, Q5_1 and K-quant tiles (see [`crate::kquant`]).
    pub(crate) kq: crate::kquant::KTiles,
}

/// A tile computed as one dot per (row, token): the scalar tier's, and NEON's.
pub(crate) fn tile_ref<W, X>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[X]],
    out: &mut [[f32; TILE_ROWS]],
    dot: fn(&[W], &[X]) -> f32,
) {
    assert_eq!(xs.len(), out.len(), "tile: wrong output count");
    for (o, x) in out.iter_mut().zip(xs) {
        for (o, w) in o.iter_mut().zip(rows) {
            *o = dot(w, x);
        }
    }
}

/// Check the lengths of a [`Kernels::weighted_sum`] call: `v` and `out` are whole rows of
/// `width` values, and every row's probabilities
/// (`probs[r·stride..r·stride + keys]`) lie inside `probs`. Every tier's entry point calls
/// this first, so the kernels may read those ranges unchecked.
pub(crate) fn weighted_sum_shape<T>(
    probs: &[f32],
    stride: usize,
    v: &[T],
    width: usize,
    out: &[f32],
) {
    assert!(width > 0, "weighted_sum: zero width");
    assert!(
        v.len().is_multiple_of(width),
        "weighted_sum: v is not a whole number of rows of the width"
    );
    assert!(
        out.len().is_multiple_of(width),
        "weighted_sum: out is not a whole number of rows of the width"
    );
    let (rows, keys) = (out.len() / width, v.len() / width);
    let needed = match rows {
        0 => Some(0),
        _ => (rows - 1)
            .checked_mul(stride)
            .and_then(|n| n.checked_add(keys)),
    };
    assert!(
        needed.is_some_and(|n| n <= probs.len()),
        "weighted_sum: probs too short for {rows} rows of {keys} keys at stride {stride}"
    );
}

/// Check the arguments of a [`Kernels::quantize_blocks`] call: a block dtype it covers and
/// whole blocks. Every tier's entry point calls this first.
pub(crate) fn quantize_blocks_shape(dtype: DType, x: &[f32]) {
    assert!(
        matches!(dtype, DType::Q8_0 | DType::Q4_0),
        "quantize_blocks: {dtype} is not Q8_0 or Q4_0"
    );
    assert!(
        x.len().is_multiple_of(QK),
        "quantize_blocks: {} values are not whole blocks of {QK}",
        x.len()
    );
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
    lanes_wide_only: false,
    klanes: None,
    float_lanes: None,
    group_q4_0x16: None,
    kq: crate::kquant::SCALAR_TILES,
};

/// The kernels of tier `isa`, or `None` if this CPU (or this build) cannot run it.
pub fn kernels(isa: Isa) -> Option<&'static Kernels> {
    if !isa.is_supported() {
        return None;
    }
    match isa {
        Isa::Scalar => Some(&SCALAR),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(crate::simd::avx2::table()),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(crate::simd::avx512::table()),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => Some(crate::simd::neon::table()),
        _ => None,
    }
}

/// The kernels of the dispatched tier ([`isa`]).
pub fn active() -> &'static Kernels {
    static ACTIVE: OnceLock<&'static Kernels> = OnceLock::new();
    ACTIVE.get_or_init(|| kernels(isa()).unwrap_or(&SCALAR))
}

impl Kernels {
    /// Whether this tier multiplies float weights by batches of
    /// [`crate::FLOAT_LANES_MIN_TOKENS`] tokens or more through its float lanes kernel, whose
    /// every result is [`crate::reference::float_lanes_ref`]'s bits (AVX2 and AVX-512).
    pub fn has_float_lanes(&self) -> bool {
        self.float_lanes.is_some()
    }

    /// Whether this tier multiplies weights of encoding `w` by batches of
    /// [`crate::LANES_MIN_TOKENS`] tokens or more (or [`crate::INTERLEAVED_LANES_MIN_TOKENS`]
    /// for `q4_0x16`) through its block lanes kernel, whose every result is the scalar
    /// reference's bits: Q8_0, Q4_0, `q4_0x16` and Q5_0 at AVX-512, Q8_0 at AVX2; and Q4_K,
    /// Q5_K and Q6_K by batches of [`crate::KLANES_MIN_TOKENS`] through its K-quant lanes
    /// kernel (AVX-512), whose results are the reference's bits too.
    pub fn has_lanes(&self, w: &crate::WeightData) -> bool {
        use crate::lanes::LaneWeight;
        use crate::WeightData as D;
        let offset = match w {
            D::Q8_0(_) => kiln_format::BlockQ8_0::OFFSET,
            D::Q4_0(_) | D::Q4_0x16(_) => kiln_format::BlockQ4_0::OFFSET,
            D::Q5_0(_) => kiln_format::BlockQ5_0::OFFSET,
            D::Q4_K(_) | D::Q5_K(_) | D::Q6_K(_) => return self.klanes.is_some(),
            _ => return false,
        };
        self.lanes.is_some() && (!self.lanes_wide_only || offset > 127)
    }

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

    /// Quantize `x` (whole 32-value blocks) to Q8_0 or Q4_0 with GGML's reference rule,
    /// appending the blocks to `out` and their round-trip error to `stats`: exactly
    /// [`reference::quantize_blocks_ref`](crate::reference::quantize_blocks_ref), bytes and
    /// statistics, in every tier. `Err(b)` when block `b`'s f16 scale overflows; `out` then
    /// holds a partial result to discard. Panics if `dtype` is not Q8_0/Q4_0 or `x` is not
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
