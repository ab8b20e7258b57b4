//! SIMD tiers, written once over a few primitives.
//!
//! - [`float`]: the [`float::F32Simd`] primitives (load, load f16/bf16, fma, reduce) and the
//!   generic float kernels (dot, tile, axpy, sum of squares) built on them.
//! - [`quant`]: the [`quant::QDot`] primitives (one block's integer dot product, returned as
//!   eight i32 lanes) and the generic Q8_0/Q4_0 kernels built on them.
//! - `avx2`, `avx512`: the primitives for each ISA and the `#[target_feature]` entry points that
//!   instantiate the generic kernels, collected in a [`crate::Kernels`] table.
//! - `neon`: the aarch64 tier (4-lane float dots, exact 8-bit block dots), on its own
//!   because the x86 primitives above are written against x86 vector types; `kquant_neon`:
//!   its Q5_0, Q5_1 and K-quant tiles (exact block sums with `vmull_s8`, or `sdot` where the
//!   CPU has `dotprod`).
//! - [`avx512_pair`]: the AVX-512 tier's own Q8_0/Q4_0 tile, two blocks per 512-bit
//!   `vpdpbusd` with the scales converted in registers (the generic block kernel spends more
//!   on each block's scale than on its dot).
//! - [`avx2_convert`]: weight conversion (bf16 decoding, GGML's reference Q8_0/Q4_0
//!   quantization with its round-trip statistics), shared by both x86 tiers.
//! - [`kquant_x86`]: both x86 tiers' Q5_0, Q5_1 and K-quant block sums (exact integers, so
//!   their tiles give the reference's bits); [`q5_x86`]: the Q5_0/Q5_1 tile, eight blocks'
//!   terms in the lanes of one register; [`q8k_x86`]: both x86 tiers' quantization of
//!   activations to Q8_K.
//! - [`avx512_klanes`], [`avx2_klanes`]: the K-quant lanes kernels ([`crate::klanes`]), a
//!   token per 32-bit lane.
//! - [`avx512_group`], [`avx2_group`]: the one-token kernels for sixteen interleaved Q4_0
//!   rows ([`crate::interleaved`]), a row per 32-bit lane.
//!
//! In matrix–vector tiles (one token) the kernels also prefetch the weight stream
//! ([`float::PREFETCH_BYTES`] ahead).
//!
//! The generic kernels are `#[inline(always)]` and `unsafe`: they are only ever inlined into a
//! `#[target_feature]` function of the matching ISA, whose safe wrapper has checked lengths.
//! Tails shorter than one vector step go to scalar code in the reference's order.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_convert;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_group;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_klanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_group;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_klanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_lanes;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_pair;
#[cfg(target_arch = "x86_64")]
pub(crate) mod float;
#[cfg(target_arch = "aarch64")]
pub(crate) mod kquant_neon;
#[cfg(target_arch = "x86_64")]
pub(crate) mod kquant_x86;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
#[cfg(target_arch = "x86_64")]
pub(crate) mod q5_x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod q8k_x86;
#[cfg(target_arch = "x86_64")]
pub(crate) mod quant;

/// Check the lengths every tile kernel relies on (the token count is `T`, one output row per
/// token, every weight row and token of the same length) and return the tokens as an array.
/// The safe wrappers of the SIMD tiers call this before their `unsafe` kernel calls.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn check_tile<'a, R, X, const T: usize>(
    rows: &[&[R]; crate::TILE_ROWS],
    xs: &'a [&'a [X]],
    out: &[[f32; crate::TILE_ROWS]],
) -> &'a [&'a [X]; T] {
    let xs: &[&[X]; T] = xs.try_into().expect("tile: wrong token count");
    assert!(out.len() == T, "tile: wrong output count");
    let n = xs[0].len();
    assert!(
        rows.iter().all(|r| r.len() == n) && xs.iter().all(|x| x.len() == n),
        "tile: row length mismatch"
    );
    xs
}

/// Columns `from..width` of every row of a weighted sum (`out`, whole rows of `width`), in
/// the reference's order: zero, then a multiply and an add per key, keys in order. The tiers
/// finish the elements past their last full vector with this, as their `axpy` does.
pub(crate) fn weighted_sum_tail<W: Copy>(
    probs: &[f32],
    stride: usize,
    v: &[W],
    width: usize,
    out: &mut [f32],
    from: usize,
    widen: impl Fn(W) -> f32,
) {
    if from == width {
        return;
    }
    for (r, o) in out.chunks_exact_mut(width).enumerate() {
        let o = &mut o[from..];
        o.fill(0.0);
        for (j, vj) in v.chunks_exact(width).enumerate() {
            let alpha = probs[r * stride + j];
            for (y, &x) in o.iter_mut().zip(&vj[from..]) {
                *y += alpha * widen(x);
            }
        }
    }
}
