//! SIMD tiers, each a [`crate::Kernels`] table, written once over a few primitives per ISA.
//!
//! - [`x86`] (x86-64 only): the AVX2 and AVX-512 tiers, their shared primitives and generic
//!   kernels.
//! - [`aarch64`] (aarch64 only): the NEON tier.
//! - Here: the portable pieces every tier's safe wrappers use ([`check_tile`], the weighted
//!   sum's scalar tail).
//!
//! The generic kernels are `#[inline(always)]` and `unsafe`: they are only ever inlined into a
//! `#[target_feature]` function of the matching ISA, whose safe wrapper has checked lengths.
//! Tails shorter than one vector step go to scalar code in the reference's order. A tier's
//! table is only handed out by [`crate::kernels`] on a CPU that has its features, which is
//! what makes its `unsafe` calls sound.

#[cfg(target_arch = "aarch64")]
pub(crate) mod aarch64;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Check the lengths every tile kernel relies on (the token count is `T`, one output row per
/// token, every weight row and token of the same length) and return the tokens as an array.
/// The safe wrappers of the SIMD tiers call this before their `unsafe` kernel calls.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn check_tile<'a, R, X, const T: usize>(
    rows: &[&[R]; crate::tile::TILE_ROWS],
    xs: &'a [&'a [X]],
    out: &[[f32; crate::tile::TILE_ROWS]],
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
