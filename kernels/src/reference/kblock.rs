//! The generic reference dot of the blocks that pair with an activation block type of their
//! own (Q5_0, Q5_1 and IQ4_NL with Q8_0, the K-quants and IQ4_XS with Q8_K), and the
//! reference tile.

use half::f16;
use kiln_format::{
    BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8K, BlockQ8_0,
};

use super as r;
use crate::tile::TILE_ROWS;

/// A weight block paired with its activation block type.
pub(crate) trait KBlock: kiln_format::BlockType + Sync + 'static {
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

impl KBlock for BlockQ2K {
    type X = BlockQ8K;
    type Ints = (i32, i32);
    fn ints_ref(w: &Self, x: &BlockQ8K) -> (i32, i32) {
        r::isum_q2_k(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: (i32, i32), h: impl Fn(f16) -> f32) -> f32 {
        r::term_k(h(w.d), h(w.dmin), x.d, ints)
    }
}

impl KBlock for BlockQ3K {
    type X = BlockQ8K;
    type Ints = i32;
    fn ints_ref(w: &Self, x: &BlockQ8K) -> i32 {
        r::isum_q3_k(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: i32, h: impl Fn(f16) -> f32) -> f32 {
        r::term_q6_k(h(w.d), x.d, ints)
    }
}

impl KBlock for BlockIQ4NL {
    type X = BlockQ8_0;
    type Ints = i32;
    fn ints_ref(w: &Self, x: &BlockQ8_0) -> i32 {
        r::isum_iq4_nl(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8_0, ints: i32, h: impl Fn(f16) -> f32) -> f32 {
        r::term_q5_0(h(w.d), h(x.d), ints)
    }
}

impl KBlock for BlockIQ4XS {
    type X = BlockQ8K;
    type Ints = i32;
    fn ints_ref(w: &Self, x: &BlockQ8K) -> i32 {
        r::isum_iq4_xs(w, x)
    }
    #[inline(always)]
    fn term(w: &Self, x: &BlockQ8K, ints: i32, h: impl Fn(f16) -> f32) -> f32 {
        r::term_q6_k(h(w.d), x.d, ints)
    }
}

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
