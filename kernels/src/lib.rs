//! kiln-kernels: the compute kernels of Kiln's CPU inference, each as a scalar reference plus
//! SIMD tiers chosen at run time.
//!
//! - [`Matrix`] borrows a weight matrix in one of the [`WeightData`] encodings (F32, F16, BF16,
//!   Q8_0, Q4_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K); [`matmul`] multiplies it by a
//!   batch of activation rows on a [`Pool`]. Q5_0/Q5_1 rows dot Q8_0 activations and K-quant
//!   rows Q8_K activations, as in GGML, with every tier giving the reference's bits
//!   (`kquant`; [`Kernels::dot_q4_k_q8_k`] and its siblings expose one row's product).
//!   Every block trait the kernels are written over (`KBlock`, `LaneWeight`, `LaneFloat`,
//!   `QBlock`, `PairBlock`, NEON's) extends the format's [`kiln_format::BlockType`], so a kernel
//!   exists only for a type that is a row of the format's block-type table, and
//!   [`WeightData::dtype`] names that row.
//! - The vector kernels ([`rmsnorm`], [`softmax_inplace`], [`exp_sum`], [`silu_mul`], [`gelu_tanh_mul`], [`gelu`],
//!   [`dot_f32`], [`axpy`], [`weighted_sum`], [`weighted_sum_f16`]) and the per-encoding dot products
//!   ([`dot_q8_0_q8_0`], [`dot_q4_0_q8_0`], [`dot_f16_f32`], [`dot_bf16_f32`]) cover the rest of
//!   a forward pass.
//! - The weight-conversion kernels serve the quantizer: [`decode_bf16`], and
//!   [`quantize_blocks`] (GGML's reference rule for any block type of one row, with the round
//!   trip's [`ErrorStats`]: Q8_0 and Q4_0 in one fused pass, the same bits in every tier; the
//!   other types by their rows of the format's block-type table).
//! - [`isa`] is the instruction-set tier in use: the best the CPU has ([`Isa::Avx512`],
//!   [`Isa::Avx2`], [`Isa::Neon`], [`Isa::Scalar`]), lowered by the `KILN_ISA` environment
//!   variable ([`ISA_ENV`]; an unknown or unsupported name is ignored with a warning). Each tier
//!   is a [`Kernels`] table of function pointers; [`active`] is the table of [`isa`], chosen
//!   once per process, and [`kernels`] returns any supported tier's table, so tests can compare
//!   every tier against the [`reference`](mod@reference) kernels on one machine.
//! - [`plan`] names the product a matrix gets for a batch as a [`Path`] (tiles over some
//!   [`Operand`], the block, K-quant or float lanes kernels, the interleaved kernel); every
//!   threshold of that choice is there, and [`matmul`], [`scores`], the tests and
//!   `kiln-run bench --verbose` all ask it.
//!
//! Module map, in layers: a module imports from its own layer and those below, never from
//! a layer above or through the crate root, and the imports form no circle (unit tests
//! excepted: they reach every tier through `dispatch`). `tests/layers.rs` holds the code to
//! this map.
//!
//! 1. Leaves: `isa` (tiers and their detection), `error`, `stats` ([`ErrorStats`], whose order
//!    of additions the quantization kernels share), `stream` (prefetch distances), `pool`,
//!    `matrix` ([`WeightData`], [`Matrix`]), `shape` (the argument checks every tier's entry
//!    points share), `encoder` (LayerNorm, portable code with no tiers), and
//!    `simd::x86::iq4` (IQ4 indices unpacked with `pshufb` behind its own feature check, not
//!    a tier: what the lanes layouts unpack IQ4 rows with).
//! 2. Operand layouts and kernel types: `tile` ([`TILE_ROWS`], the tile kernel types),
//!    `lanes` (tokens in lanes for block and float weights), `klanes` (the same for K-quants),
//!    `interleaved` (sixteen-row Q4_0).
//! 3. The spec: `reference` (every scalar `*_ref`; `reference::kblock`: the Q5/K-quant
//!    block pairing, its dot and the reference tile; `reference::klanes`: the K-quant lanes
//!    kernel over its layouts), and `approx` (the polynomial `exp` the SIMD tiers share).
//! 4. `kquant`: the Q5/K-quant tile tables and the generic tile the tiers instantiate.
//! 5. `table`: [`Kernels`], the scalar tier's table, the safe length-checking entry points.
//! 6. The tiers, each building a [`Kernels`] table: `simd::x86::{avx2, avx512, …}` and
//!    `simd::aarch64::{neon, kquant}`, over the portable helpers in `simd`.
//! 7. Selection: `dispatch` ([`kernels`], [`active`]).
//! 8. Products: `plan`, `matmul` (row chunks over the [`Pool`], tiles and the lanes kernels;
//!    `matmul::kquant`: the Q5_1 and K-quant products), `scores`.

mod approx;
mod dispatch;
mod encoder;
mod error;
mod interleaved;
mod isa;
mod klanes;
mod kquant;
mod lanes;
mod matmul;
mod matrix;
mod plan;
mod pool;
pub mod reference;
mod scores;
mod shape;
mod simd;
mod stats;
pub mod stream;
mod table;
mod tile;

pub use half::{bf16, f16};
pub use kiln_format::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_0x16, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, GROUP_ROWS, QK, QK_K,
};

pub use dispatch::{active, kernels};
pub use encoder::layernorm;
pub use error::KernelError;
pub use isa::{
    best_isa, isa, missing_tiers, supported_isas, tested_isas, Isa, EXPECT_TIERS_ENV, ISA_ENV,
};
pub use matmul::{matmul, matmul_many, matmul_many_for, ROW_CHUNK};
pub use matrix::{Matrix, OwnedWeights, WeightData};
pub use plan::{
    plan, plan_for, Batching, Operand, Path, FLOAT_LANES_MIN_TOKENS, INTERLEAVED_LANES_MIN_TOKENS,
    IQ4_NL_LANES_MIN_TOKENS, IQ4_XS_LANES_MIN_TOKENS, KLANES_MIN_TOKENS, LANES_MIN_TOKENS,
    Q2_K_LANES_MIN_TOKENS,
};
pub use pool::{cap_threads, max_threads, Pool};
pub use scores::scores;
pub use stats::ErrorStats;
pub use table::Kernels;
pub use tile::TILE_ROWS;

/// HF `LlamaRMSNorm` of one row in f32: `out = x / sqrt(mean(x²) + eps) · weight`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    active().rmsnorm(x, weight, eps, out)
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    active().softmax_inplace(x)
}

/// `x[i] = e^(x[i] - shift)` in place, returning their sum: one block of an online softmax
/// (attention over the KV cache a block of keys at a time).
pub fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    active().exp_sum(x, shift)
}

/// `out = silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    active().silu_mul(gate, up, out)
}

/// `out = gelu(x)`, the exact (erf) GELU of encoders' plain MLPs, element-wise.
pub fn gelu(x: &[f32], out: &mut [f32]) {
    active().gelu(x, out)
}

/// `out = gelu_tanh(gate) · up` (GeGLU with PyTorch's tanh-approximated GELU), element-wise.
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    active().gelu_tanh_mul(gate, up, out)
}

/// `Σ a[i]·b[i]`. Panics if the lengths differ.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    active().dot_f32(a, b)
}

/// `y += alpha·x`. Panics if the lengths differ.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    active().axpy(alpha, x, y)
}

/// `out[r][c] = Σ_j probs[r·stride + j]·v[j·width + c]`: for each row of `out` (`width`
/// wide, overwritten), the sum of the rows of `v` weighted by that row's probabilities, as in
/// attention's `P·V` for one token. Bit for bit the [`axpy`] of each row of `v` in order into
/// a zeroed row, with the rows of `out` kept in registers across all of `v` instead of being
/// loaded and stored once per row of `v`. Panics if `width` is zero, `v` or `out` is not
/// whole rows, or `probs` is too short for the rows at `stride`.
pub fn weighted_sum(probs: &[f32], stride: usize, v: &[f32], width: usize, out: &mut [f32]) {
    active().weighted_sum(probs, stride, v, width, out)
}

/// [`weighted_sum`] over f16 rows of `v` (an f16 KV cache's values), widened as they are
/// loaded: the same bits as [`weighted_sum`] over the widened rows.
pub fn weighted_sum_f16(probs: &[f32], stride: usize, v: &[f16], width: usize, out: &mut [f32]) {
    active().weighted_sum_f16(probs, stride, v, width, out)
}

/// Little-endian bf16 bytes to f32, NaNs quieted. Panics unless `out.len() == bytes.len() / 2`.
pub fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    active().decode_bf16(bytes, out)
}

/// Quantize weights (whole blocks) to a block type of one row with GGML's reference rule and
/// accumulate their round-trip error; see [`Kernels::quantize_blocks`].
pub fn quantize_blocks(
    dtype: kiln_format::DType,
    x: &[f32],
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    active().quantize_blocks(dtype, x, out, stats)
}

/// Quantize activations to Q8_0 blocks with GGML's rule (`d = max|x|/127`, `q = round(x/d)`).
/// Panics unless `x.len() == 32 · out.len()`.
pub fn quantize_row_q8_0_act(x: &[f32], out: &mut [BlockQ8_0]) {
    active().quantize_row_q8_0_act(x, out)
}

/// Q8_0 weights · Q8_0 activations. Panics if the block counts differ.
///
/// Weight codes may be any i8; activation codes must be in -127..=127, which is what
/// [`quantize_row_q8_0_act`] produces (the AVX2 tier's sign trick cannot negate -128).
pub fn dot_q8_0_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    active().dot_q8_0_q8_0(w, x)
}

/// Q4_0 weights · Q8_0 activations. Panics if the block counts differ.
pub fn dot_q4_0_q8_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    active().dot_q4_0_q8_0(w, x)
}

/// f16 weights · f32 activations. Panics if the lengths differ.
pub fn dot_f16_f32(w: &[f16], x: &[f32]) -> f32 {
    active().dot_f16_f32(w, x)
}

/// bf16 weights · f32 activations. Panics if the lengths differ.
pub fn dot_bf16_f32(w: &[bf16], x: &[f32]) -> f32 {
    active().dot_bf16_f32(w, x)
}
