//! Q5_0, Q5_1, IQ4_NL and the K-quants (Q2_K…Q6_K, IQ4_XS): their tile tables and one-row
//! dots.
//!
//! GGML's pairing: Q5_0, Q5_1 and IQ4_NL rows dot Q8_0 activations (32 a block), K-quant and
//! IQ4_XS rows dot Q8_K activations (256 a block, with the sum of every 16 codes, which apply
//! the sub-block mins of Q2_K/Q4_K/Q5_K and the offsets of Q3_K and Q6_K without touching the
//! codes). Each block pair gives exact
//! integer sums ([`KBlock::Ints`]); one f32 term per block is formed from them in a fixed order
//! and added into accumulator `b % 8` ([`crate::reference::BLOCK_LANES`]). The tiers differ only
//! in how they compute the integer sums, so every tier gives the reference's bits.
//!
//! The pairing itself ([`KBlock`]) and the reference dot are [`crate::reference`]'s; here are
//! the tile tables ([`KTiles`]), the generic tile the SIMD tiers instantiate ([`tile_with`])
//! and the one-row dots. A product (in `matmul`) activates each token once (Q8_0 or Q8_K) and
//! hands row chunks to the pool; the multi-token tiles take several tokens per weight block,
//! which the SIMD tiers unpack once.

use half::f16;
use kiln_format::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8K, BlockQ8_0,
};

use crate::reference::{self as r, dot_ref, tile_ref, KBlock, BLOCK_LANES};
use crate::tile::{Tile, TILE_ROWS};

/// Every tier's tiles for these encodings. A tier without a kernel of its own for one keeps
/// the scalar tier's (`..SCALAR_TILES`): the same bits, slower.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KTiles {
    pub(crate) q5_0: Tile<BlockQ5_0, BlockQ8_0>,
    pub(crate) q5_1: Tile<BlockQ5_1, BlockQ8_0>,
    pub(crate) q4_k: Tile<BlockQ4K, BlockQ8K>,
    pub(crate) q5_k: Tile<BlockQ5K, BlockQ8K>,
    pub(crate) q6_k: Tile<BlockQ6K, BlockQ8K>,
    pub(crate) q2_k: Tile<BlockQ2K, BlockQ8K>,
    pub(crate) q3_k: Tile<BlockQ3K, BlockQ8K>,
    pub(crate) iq4_nl: Tile<BlockIQ4NL, BlockQ8_0>,
    pub(crate) iq4_xs: Tile<BlockIQ4XS, BlockQ8K>,
}

/// The reference's tile: one [`dot_ref`] per (row, token).
fn ref_tile<W: KBlock>(rows: &[&[W]; TILE_ROWS], xs: &[&[W::X]], out: &mut [[f32; TILE_ROWS]]) {
    tile_ref(rows, xs, out, dot_ref::<W>)
}

/// The scalar tier's tiles.
pub(crate) const SCALAR_TILES: KTiles = KTiles {
    q5_0: Tile::new(ref_tile, 1, ref_tile),
    q5_1: Tile::new(ref_tile, 1, ref_tile),
    q4_k: Tile::new(ref_tile, 1, ref_tile),
    q5_k: Tile::new(ref_tile, 1, ref_tile),
    q6_k: Tile::new(ref_tile, 1, ref_tile),
    q2_k: Tile::new(ref_tile, 1, ref_tile),
    q3_k: Tile::new(ref_tile, 1, ref_tile),
    iq4_nl: Tile::new(ref_tile, 1, ref_tile),
    iq4_xs: Tile::new(ref_tile, 1, ref_tile),
};

/// `R` weight rows against `T` tokens: each weight block unpacked once by `unpack`, its
/// integer sums with each token's block from `ints`, the terms widened by `h`, each (row,
/// token) accumulated in the reference's order: the SIMD tiers' tile, and the reference's
/// bits whenever `ints` is exact.
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) fn tile_with<W: KBlock, U, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[W::X]; T],
    unpack: impl Fn(&W) -> U,
    ints: impl Fn(&U, &W::X) -> W::Ints,
    h: impl Fn(f16) -> f32 + Copy,
) -> [[f32; R]; T] {
    assert!(
        !W::SEQUENTIAL,
        "tile_with: the eight-accumulator order only"
    );
    let nb = xs[0].len();
    let mut acc = [[[0f32; BLOCK_LANES]; R]; T];
    for b in 0..nb {
        let lane = b % BLOCK_LANES;
        for r in 0..R {
            let w = &rows[r][b];
            let u = unpack(w);
            for t in 0..T {
                let x = &xs[t][b];
                acc[t][r][lane] += W::term(w, x, ints(&u, x), h);
            }
        }
    }
    let mut out = [[0f32; R]; T];
    for t in 0..T {
        for r in 0..R {
            out[t][r] = r::sum_lanes8(&acc[t][r]);
        }
    }
    out
}
