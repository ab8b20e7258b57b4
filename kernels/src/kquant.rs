//! Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K): their tile kernels and products.
//!
//! GGML's pairing: Q5_0 and Q5_1 rows dot Q8_0 activations (32 a block), K-quant rows dot Q8_K
//! activations (256 a block, with the sum of every 16 codes, which apply the sub-block mins of
//! Q4_K/Q5_K and the −32 offset of Q6_K without touching the codes). Each block pair gives exact
//! integer sums ([`KBlock::Ints`]); one f32 term per block is formed from them in a fixed order
//! and added into accumulator `b % 8` ([`crate::reference::BLOCK_LANES`]). The tiers differ only
//! in how they compute the integer sums, so every tier gives the reference's bits.
//!
//! A product activates each token once (Q8_0 or Q8_K) and hands row chunks to the pool; the
//! multi-token tiles take several tokens per weight block, which the SIMD tiers unpack once.

use std::cell::RefCell;

use half::f16;
use kiln_format::kquants::K_SCALE_SIZE;
use kiln_format::{
    BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, QK, QK_K,
};

use crate::dispatch::{tile_ref, Kernels, Tile, TILE_ROWS};
use crate::pool::Pool;
use crate::reference::{self as r, BLOCK_LANES};

/// A weight block paired with its activation block type.
pub(crate) trait KBlock: Copy + Sync + 'static {
    /// The activation block it dots.
    type X: Copy + Sync + 'static;
    /// The exact integer sums of one block pair.
    type Ints: Copy;
    /// Whether the terms are added block after block into one sum (Q5_0, as Q4_0) rather than
    /// into accumulator `b % 8` ([`crate::reference::BLOCK_LANES`]).
    const SEQUENTIAL: bool = false;
    /// The reference's integer sums.
    fn ints_ref(w: &Self, x: &Self::X) -> Self::Ints;
    /// The block's f32 term from its integer sums, f16 scales widened by `h` (exact in every
    /// tier: F16C or `half`).
    fn term(w: &Self, x: &Self::X, ints: Self::Ints, h: impl Fn(f16) -> f32) -> f32;
}

impl KBlock for BlockQ5_0 {
    type X = BlockQ8_0;
    type Ints = i32;
    const SEQUENTIAL: bool = true;
    fn ints_ref(w: &Self, x: &BlockQ8_0) -> i32 {
        r::isum_q5_0(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8_0, ints: i32, h: impl Fn(f16) -> f32) -> f32 {
        r::term_q5_0(h(w.d), h(x.d), ints)
    }
}

impl KBlock for BlockQ5_1 {
    type X = BlockQ8_0;
    type Ints = (i32, i32);
    fn ints_ref(w: &Self, x: &BlockQ8_0) -> (i32, i32) {
        r::isum_q5_1(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8_0, ints: (i32, i32), h: impl Fn(f16) -> f32) -> f32 {
        r::term_q5_1(h(w.d), h(w.m), h(x.d), ints)
    }
}

impl KBlock for BlockQ4K {
    type X = BlockQ8K;
    type Ints = (i32, i32);
    fn ints_ref(w: &Self, x: &BlockQ8K) -> (i32, i32) {
        r::isum_q4_k(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: (i32, i32), h: impl Fn(f16) -> f32) -> f32 {
        r::term_k(h(w.d), h(w.dmin), x.d, ints)
    }
}

impl KBlock for BlockQ5K {
    type X = BlockQ8K;
    type Ints = (i32, i32);
    fn ints_ref(w: &Self, x: &BlockQ8K) -> (i32, i32) {
        r::isum_q5_k(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: (i32, i32), h: impl Fn(f16) -> f32) -> f32 {
        r::term_k(h(w.d), h(w.dmin), x.d, ints)
    }
}

impl KBlock for BlockQ6K {
    type X = BlockQ8K;
    type Ints = i32;
    fn ints_ref(w: &Self, x: &BlockQ8K) -> i32 {
        r::isum_q6_k(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: i32, h: impl Fn(f16) -> f32) -> f32 {
        r::term_q6_k(h(w.d), x.d, ints)
    }
}

/// Q4_K/Q5_K's eight 6-bit scales and eight 6-bit mins unpacked from their 12 bytes at once
/// (GGML's word-wise unpacking): the same values as
/// [`kiln_format::kquants::scale_min_k4`] for `j` in 0..8.
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) fn scales_mins_k4(s: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let sc_lo = u0 & K1;
    let sc_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let m_lo = u1 & K1;
    let m_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let cat = |a: u32, b: u32| {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (cat(sc_lo, sc_hi), cat(m_lo, m_hi))
}

/// Every tier's tiles for the five encodings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KTiles {
    pub(crate) q5_0: Tile<BlockQ5_0, BlockQ8_0>,
    pub(crate) q5_1: Tile<BlockQ5_1, BlockQ8_0>,
    pub(crate) q4_k: Tile<BlockQ4K, BlockQ8K>,
    pub(crate) q5_k: Tile<BlockQ5K, BlockQ8K>,
    pub(crate) q6_k: Tile<BlockQ6K, BlockQ8K>,
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
};

/// The reference dot of one row and one token: the reference's terms, added in its order.
pub(crate) fn dot_ref<W: KBlock>(w: &[W], x: &[W::X]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: block count mismatch");
    let term = |w: &W, x: &W::X| W::term(w, x, W::ints_ref(w, x), f16::to_f32);
    if W::SEQUENTIAL {
        w.iter().zip(x).fold(0.0, |s, (w, x)| s + term(w, x))
    } else {
        r::lanes_dot(w, x, term)
    }
}

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

thread_local! {
    /// The calling thread's Q8_K activations, reused from call to call.
    static ACT_Q8_K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
}

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

    /// Q5_0/Q5_1 rows: the activations quantized to Q8_0 once, then `tile` over row chunks.
    pub(crate) fn run_q8_0_tiles<W: Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, BlockQ8_0>,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        crate::matmul::with_q8_0_act(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            crate::matmul::run_tiles(ws, nb, xq, nb, n_tokens, outs, pool, tile)
        })
    }

    /// K-quant rows: the activations quantized to Q8_K once (GGML's rule, the reference's
    /// bits in every tier), then batches of [`crate::KLANES_MIN_TOKENS`] or more through the tier's
    /// K-quant lanes kernel where it has one ([`crate::klanes::run_klanes`]), others through
    /// `tile` over row chunks. Both give the reference's bits.
    pub(crate) fn run_q8_k_tiles<W: crate::klanes::KLaneWeight + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, BlockQ8K>,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK_K;
        ACT_Q8_K.with_borrow_mut(|xq| {
            xq.clear();
            xq.resize(n_tokens * nb, bytemuck::Zeroable::zeroed());
            if nb > 0 {
                let quantize = self.quantize_row_q8_k_act;
                crate::matmul::per_token(pool, xq, nb, |t, q| {
                    quantize(&x[t * cols..(t + 1) * cols], q)
                });
            }
            if let Some(kernel) = self
                .klanes
                .filter(|_| nb > 0 && n_tokens >= crate::KLANES_MIN_TOKENS)
            {
                return crate::klanes::run_klanes(ws, nb, xq, n_tokens, outs, pool, kernel);
            }
            crate::matmul::run_tiles(ws, nb, xq, nb, n_tokens, outs, pool, tile)
        })
    }
}

/// One row and one token through a tier's one-token tile (the row repeated in its four slots).
fn one_dot<W, X>(tile: &Tile<W, X>, w: &[W], x: &[X]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: block count mismatch");
    let mut out = [[0f32; TILE_ROWS]];
    (tile.one)(&[w; TILE_ROWS], &[x], &mut out);
    out[0][0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn word_wise_scale_unpacking_matches_the_format(s in prop::array::uniform12(any::<u8>())) {
            let (sc, m) = scales_mins_k4(&s);
            for j in 0..8 {
                prop_assert_eq!((sc[j], m[j]), kiln_format::kquants::scale_min_k4(j, &s), "j {}", j);
            }
        }
    }
}
