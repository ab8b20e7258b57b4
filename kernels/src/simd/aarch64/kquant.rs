//! The NEON tier's Q5_0, Q5_1 and K-quant (Q4_K, Q5_K, Q6_K) tiles.
//!
//! Each weight block is unpacked once per tile into signed-byte vectors (its codes, with
//! Q5_0's −16 offset applied), then meets every token of the tile. The integer sums are
//! exact and equal to the reference's (`crate::reference::isum_*`): 16-byte products summed
//! into four i32 lanes per block or sub-block, the sub-block scales applied to those lanes in
//! integers, Q4_K/Q5_K's mins and Q6_K's −32 offset through the activation block sums, as the
//! x86 tiers do. The float terms are formed from them with the reference's operations and
//! added in its order (block after block for Q5_0, accumulator `b % 8` for the others), so the
//! tiles give the reference's bits.
//!
//! Two variants of the byte products, chosen once with the table ([`has_dotprod`]):
//! - [`Plain`], the baseline: `vmull_s8` into 16-bit products, pairs added into i32 lanes
//!   with `vpadalq_s16` (a product is at most 128·128, a pair fits i32 with room to spare);
//! - [`DotProd`], where the CPU has the `dotprod` extension: `sdot`, four products into each
//!   i32 lane in one instruction. Its intrinsic is not stable in Rust, so it is written as
//!   inline assembly, only ever inlined into `#[target_feature(enable = "dotprod")]` code.

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;
use kiln_format::{BlockQ4K, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0};

use crate::klanes::scales_mins_k4;
use crate::kquant::{tile_with, KTiles, SCALAR_TILES};
use crate::reference::KBlock;
use crate::tile::{Tile, TILE_ROWS};

/// How a variant adds the products of two vectors of sixteen signed bytes into four i32
/// lanes: which lane takes which product is the variant's business, the lanes' total is
/// exact.
trait ByteDot {
    /// `acc` plus the sixteen products `a[i]·b[i]`, spread over its lanes.
    ///
    /// # Safety
    /// NEON is enabled, and whatever extension the variant names.
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
}

/// Baseline NEON byte products.
struct Plain;

impl ByteDot for Plain {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // SAFETY: NEON enabled (caller contract); register-only intrinsics.
        unsafe {
            let acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            vpadalq_s16(acc, vmull_high_s8(a, b))
        }
    }
}

/// Byte products with the `dotprod` extension's `sdot`.
struct DotProd;

impl ByteDot for DotProd {
    /// Always inlined, so the assembler sees the calling function's `dotprod` feature (it
    /// rejects `sdot` in code compiled without it: a build error, never a wrong instruction).
    #[inline(always)]
    unsafe fn dot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // SAFETY: `dotprod` enabled (caller contract); `sdot` reads and writes only the three
        // vector registers named.
        unsafe {
            asm!(
                "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                acc = inout(vreg) acc,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }
}

/// Whether this CPU has the `dotprod` extension (detected once by the standard library).
pub(crate) fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// The exact integer dot of 32 codes (two vectors) against 32 activation bytes at `x`.
///
/// # Safety
/// As [`ByteDot::dot`]; `x` is valid for reading 32 bytes.
#[inline(always)]
unsafe fn dot32<D: ByteDot>(q: [int8x16_t; 2], x: *const i8) -> int32x4_t {
    // SAFETY: caller contract; both loads lie within the 32 bytes at x.
    unsafe {
        let acc = D::dot(vdupq_n_s32(0), q[0], vld1q_s8(x));
        D::dot(acc, q[1], vld1q_s8(x.add(16)))
    }
}

/// A weight block with a NEON unpacking and integer sums.
trait NeonBlock: KBlock {
    /// The block unpacked for all the tokens of a tile.
    type Unpacked: Copy;
    /// # Safety
    /// NEON is enabled.
    unsafe fn unpack(&self) -> Self::Unpacked;
    /// [`KBlock::ints_ref`] from the unpacked block.
    ///
    /// # Safety
    /// As [`ByteDot::dot`].
    unsafe fn ints<D: ByteDot>(u: &Self::Unpacked, x: &Self::X) -> Self::Ints;
}

/// Weights 0..16 of a Q5_0/Q5_1 block read their fifth bit from `qh` byte `j / 8`…
const Q5_PICK_LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
/// …and weights 16..32 from bytes 2 and 3.
const Q5_PICK_HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];

/// The 32 codes (0..=31) of a Q5_0/Q5_1 block: weights 0..16 (low nibbles) and 16..32 (high
/// nibbles), each with its fifth bit (bit `j` of `qh`) at 0x10.
///
/// # Safety
/// NEON is enabled.
#[inline(always)]
unsafe fn q5_codes(qh: [u8; 4], qs: &[u8; 16]) -> [uint8x16_t; 2] {
    // SAFETY: NEON enabled (caller contract); `qs` and the two pick tables are 16 readable
    // bytes each.
    unsafe {
        let raw = vld1q_u8(qs.as_ptr());
        let h = vreinterpretq_u8_u32(vdupq_n_u32(u32::from_le_bytes(qh)));
        // Byte k tests bit k % 8 of the byte it picked.
        let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
        let five = vdupq_n_u8(0x10);
        let fifth =
            |pick: &[u8; 16]| vandq_u8(vtstq_u8(vqtbl1q_u8(h, vld1q_u8(pick.as_ptr())), bit), five);
        [
            vorrq_u8(vandq_u8(raw, vdupq_n_u8(0x0f)), fifth(&Q5_PICK_LO)),
            vorrq_u8(vshrq_n_u8::<4>(raw), fifth(&Q5_PICK_HI)),
        ]
    }
}

impl NeonBlock for BlockQ5_0 {
    /// The codes less 16 (−16..=15).
    type Unpacked = [int8x16_t; 2];
    #[inline(always)]
    unsafe fn unpack(&self) -> [int8x16_t; 2] {
        // SAFETY: NEON enabled (caller contract); register-only otherwise.
        unsafe {
            let [lo, hi] = q5_codes(self.qh, &self.qs);
            let sixteen = vdupq_n_s8(16);
            [
                vsubq_s8(vreinterpretq_s8_u8(lo), sixteen),
                vsubq_s8(vreinterpretq_s8_u8(hi), sixteen),
            ]
        }
    }
    #[inline(always)]
    unsafe fn ints<D: ByteDot>(u: &[int8x16_t; 2], x: &BlockQ8_0) -> i32 {
        // SAFETY: caller contract; `x.qs` is 32 readable bytes.
        unsafe { vaddvq_s32(dot32::<D>(*u, x.qs.as_ptr())) }
    }
}

impl NeonBlock for BlockQ5_1 {
    /// The codes (0..=31).
    type Unpacked = [int8x16_t; 2];
    #[inline(always)]
    unsafe fn unpack(&self) -> [int8x16_t; 2] {
        // SAFETY: NEON enabled (caller contract).
        let [lo, hi] = unsafe { q5_codes(self.qh, &self.qs) };
        // SAFETY: register-only reinterpretations.
        unsafe { [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)] }
    }
    #[inline(always)]
    unsafe fn ints<D: ByteDot>(u: &[int8x16_t; 2], x: &BlockQ8_0) -> (i32, i32) {
        // SAFETY: caller contract; `x.qs` is 32 readable bytes.
        unsafe {
            let ones = vdupq_n_s8(1);
            let qx = dot32::<D>(*u, x.qs.as_ptr());
            let sx = dot32::<D>([ones, ones], x.qs.as_ptr());
            (vaddvq_s32(qx), vaddvq_s32(sx))
        }
    }
}

/// A Q4_K or Q5_K block unpacked: sub-block `s`'s 32 codes in vectors `2s` and `2s + 1`, its
/// scale, and the eight mins as 16-bit lanes.
#[derive(Clone, Copy)]
struct AffineK {
    codes: [int8x16_t; 16],
    scales: [i32; 8],
    mins: int16x8_t,
}

/// The mins of [`AffineK`] from the unpacked 6-bit values.
///
/// # Safety
/// NEON is enabled.
#[inline(always)]
unsafe fn mins16(m: &[u8; 8]) -> int16x8_t {
    // SAFETY: NEON enabled (caller contract); `m` is 8 readable bytes.
    unsafe { vreinterpretq_s16_u16(vmovl_u8(vld1_u8(m.as_ptr()))) }
}

/// Pair `c`'s nibbles of a Q4_K/Q5_K block, as four vectors: sub-block `2c` (low nibbles of
/// bytes `32c..32c + 32`), then sub-block `2c + 1` (their high nibbles).
///
/// # Safety
/// NEON is enabled and `c < 4`.
#[inline(always)]
unsafe fn nibbles(qs: &[u8; 128], c: usize) -> [uint8x16_t; 4] {
    // SAFETY: NEON enabled; bytes 32c..32c + 32 lie inside `qs` for c < 4 (caller contract).
    unsafe {
        let a = vld1q_u8(qs.as_ptr().add(32 * c));
        let b = vld1q_u8(qs.as_ptr().add(32 * c + 16));
        let m4 = vdupq_n_u8(0x0f);
        [
            vandq_u8(a, m4),
            vandq_u8(b, m4),
            vshrq_n_u8::<4>(a),
            vshrq_n_u8::<4>(b),
        ]
    }
}

impl NeonBlock for BlockQ4K {
    type Unpacked = AffineK;
    #[inline(always)]
    unsafe fn unpack(&self) -> AffineK {
        let (sc, m) = scales_mins_k4(&self.scales);
        // SAFETY: NEON enabled (caller contract); c < 4.
        unsafe {
            let mut codes = [vdupq_n_s8(0); 16];
            for c in 0..4 {
                for (o, v) in codes[4 * c..4 * c + 4].iter_mut().zip(nibbles(&self.qs, c)) {
                    *o = vreinterpretq_s8_u8(v);
                }
            }
            AffineK {
                codes,
                scales: sc.map(i32::from),
                mins: mins16(&m),
            }
        }
    }
    #[inline(always)]
    unsafe fn ints<D: ByteDot>(u: &AffineK, x: &BlockQ8K) -> (i32, i32) {
        // SAFETY: forwarded contract.
        unsafe { affine_k_ints::<D>(u, x) }
    }
}

impl NeonBlock for BlockQ5K {
    type Unpacked = AffineK;
    #[inline(always)]
    unsafe fn unpack(&self) -> AffineK {
        let (sc, m) = scales_mins_k4(&self.scales);
        // SAFETY: NEON enabled (caller contract); `qh` is 32 readable bytes; c < 4.
        unsafe {
            let qh = [
                vld1q_u8(self.qh.as_ptr()),
                vld1q_u8(self.qh.as_ptr().add(16)),
            ];
            let five = vdupq_n_u8(0x10);
            let mut codes = [vdupq_n_s8(0); 16];
            for c in 0..4 {
                // Bit 2c of qh[l] is the fifth bit of weight l of sub-block 2c, bit 2c + 1
                // that of sub-block 2c + 1.
                let (b0, b1) = (vdupq_n_u8(1 << (2 * c)), vdupq_n_u8(2 << (2 * c)));
                let fifth = [
                    vtstq_u8(qh[0], b0),
                    vtstq_u8(qh[1], b0),
                    vtstq_u8(qh[0], b1),
                    vtstq_u8(qh[1], b1),
                ];
                for ((o, v), f) in codes[4 * c..4 * c + 4]
                    .iter_mut()
                    .zip(nibbles(&self.qs, c))
                    .zip(fifth)
                {
                    *o = vreinterpretq_s8_u8(vorrq_u8(v, vandq_u8(f, five)));
                }
            }
            AffineK {
                codes,
                scales: sc.map(i32::from),
                mins: mins16(&m),
            }
        }
    }
    #[inline(always)]
    unsafe fn ints<D: ByteDot>(u: &AffineK, x: &BlockQ8K) -> (i32, i32) {
        // SAFETY: forwarded contract.
        unsafe { affine_k_ints::<D>(u, x) }
    }
}

/// [`crate::reference::isum_q4_k`] (and `isum_q5_k`) from an unpacked block:
/// `Σ_s sc_s·dot_s` with each sub-block's four lanes scaled in i32, and
/// `Σ_s m_s·(bsum_2s + bsum_2s+1)`.
///
/// # Safety
/// As [`ByteDot::dot`].
#[inline(always)]
unsafe fn affine_k_ints<D: ByteDot>(u: &AffineK, x: &BlockQ8K) -> (i32, i32) {
    // SAFETY: caller contract; `x.qs` is 256 readable bytes, read 32 at a time at offsets
    // below 256; `x.bsums` is 16 readable i16.
    unsafe {
        let mut acc = vdupq_n_s32(0);
        for s in 0..8 {
            let q = [u.codes[2 * s], u.codes[2 * s + 1]];
            let d = dot32::<D>(q, x.qs.as_ptr().add(32 * s));
            acc = vmlaq_n_s32(acc, d, u.scales[s]);
        }
        // Lane s: bsum_2s + bsum_2s+1 (at most 32·128 in magnitude, exact in i16).
        let pairs = vpaddq_s16(
            vld1q_s16(x.bsums.as_ptr()),
            vld1q_s16(x.bsums.as_ptr().add(8)),
        );
        let mins = vmlal_high_s16(
            vmull_s16(vget_low_s16(pairs), vget_low_s16(u.mins)),
            pairs,
            u.mins,
        );
        (vaddvq_s32(acc), vaddvq_s32(mins))
    }
}

/// A Q6_K block unpacked: sub-block `s`'s sixteen codes (0..=63) in vector `s`, the sixteen
/// scales, and the scales as 16-bit lanes for the offset.
#[derive(Clone, Copy)]
struct Q6K {
    codes: [int8x16_t; 16],
    scales: [i32; 16],
    sc16: [int16x8_t; 2],
}

impl NeonBlock for BlockQ6K {
    type Unpacked = Q6K;
    #[inline(always)]
    unsafe fn unpack(&self) -> Q6K {
        // SAFETY: NEON enabled (caller contract); for h < 2 and p < 2, `ql` is read at
        // 64h + 32·(k % 2) + 16p + 16 <= 128 and `qh` at 32h + 16p + 16 <= 64; `scales` is 16
        // readable bytes.
        unsafe {
            let m4 = vdupq_n_u8(0x0f);
            let top = vdupq_n_u8(0x30);
            let mut codes = [vdupq_n_s8(0); 16];
            for h in 0..2 {
                for p in 0..2 {
                    let ql0 = vld1q_u8(self.ql.as_ptr().add(64 * h + 16 * p));
                    let ql1 = vld1q_u8(self.ql.as_ptr().add(64 * h + 32 + 16 * p));
                    let qh = vld1q_u8(self.qh.as_ptr().add(32 * h + 16 * p));
                    // Weight 16p + l + 32k of half h: a nibble of ql0 (k even) or ql1 (k odd),
                    // bits 2k..2k + 2 of qh moved to bits 4..6.
                    let low = [
                        vandq_u8(ql0, m4),
                        vandq_u8(ql1, m4),
                        vshrq_n_u8::<4>(ql0),
                        vshrq_n_u8::<4>(ql1),
                    ];
                    let high = [
                        vshlq_n_u8::<4>(qh),
                        vshlq_n_u8::<2>(qh),
                        qh,
                        vshrq_n_u8::<2>(qh),
                    ];
                    for k in 0..4 {
                        codes[8 * h + 2 * k + p] =
                            vreinterpretq_s8_u8(vorrq_u8(low[k], vandq_u8(high[k], top)));
                    }
                }
            }
            let sc = vld1q_s8(self.scales.as_ptr());
            Q6K {
                codes,
                scales: self.scales.map(i32::from),
                sc16: [vmovl_s8(vget_low_s8(sc)), vmovl_high_s8(sc)],
            }
        }
    }
    /// `Σ_s sc_s·dot_s − 32·Σ_s sc_s·bsum_s`: the reference's sum with the offset gathered
    /// (integers, so the same value).
    #[inline(always)]
    unsafe fn ints<D: ByteDot>(u: &Q6K, x: &BlockQ8K) -> i32 {
        // SAFETY: caller contract; `x.qs` is 256 readable bytes, read 16 at a time at offsets
        // below 256; `x.bsums` is 16 readable i16.
        unsafe {
            let mut acc = vdupq_n_s32(0);
            for s in 0..16 {
                let x = vld1q_s8(x.qs.as_ptr().add(16 * s));
                let d = D::dot(vdupq_n_s32(0), u.codes[s], x);
                acc = vmlaq_n_s32(acc, d, u.scales[s]);
            }
            let b0 = vld1q_s16(x.bsums.as_ptr());
            let b1 = vld1q_s16(x.bsums.as_ptr().add(8));
            let mut off = vmull_s16(vget_low_s16(b0), vget_low_s16(u.sc16[0]));
            off = vmlal_high_s16(off, b0, u.sc16[0]);
            off = vmlal_s16(off, vget_low_s16(b1), vget_low_s16(u.sc16[1]));
            off = vmlal_high_s16(off, b1, u.sc16[1]);
            vaddvq_s32(acc) - 32 * vaddvq_s32(off)
        }
    }
}

/// `R` rows against `T` tokens: each weight block unpacked once, its terms in the reference's
/// order (Q5_0's block after block from +0, the others through [`tile_with`]).
///
/// # Safety
/// As [`ByteDot::dot`]; every row and token has the same number of blocks.
#[inline(always)]
unsafe fn tile<W: NeonBlock, D: ByteDot, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[W::X]; T],
) -> [[f32; R]; T] {
    // SAFETY: NEON enabled (caller contract).
    let unpack = |w: &W| unsafe { w.unpack() };
    // SAFETY: the caller's features are the ones `D` needs.
    let ints = |u: &W::Unpacked, x: &W::X| unsafe { W::ints::<D>(u, x) };
    if !W::SEQUENTIAL {
        return tile_with(rows, xs, unpack, ints, f16::to_f32);
    }
    let mut out = [[0f32; R]; T];
    for b in 0..xs[0].len() {
        for r in 0..R {
            let w = &rows[r][b];
            let u = unpack(w);
            for t in 0..T {
                let x = &xs[t][b];
                out[t][r] += W::term(w, x, ints(&u, x), f16::to_f32);
            }
        }
    }
    out
}

/// The plain-NEON tile's safe wrapper: `T` tokens against four rows.
fn plain_tile<W: NeonBlock, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[W::X]],
    out: &mut [[f32; TILE_ROWS]],
) {
    let xs = crate::simd::check_tile::<_, _, T>(rows, xs, out);
    // SAFETY: NEON is always enabled on aarch64; lengths checked above.
    out.copy_from_slice(&unsafe { tile::<W, Plain, TILE_ROWS, T>(rows, xs) });
}

/// The `dotprod` tile, compiled with the extension.
///
/// # Safety
/// The CPU has `dotprod`; every row and token has the same number of blocks.
#[target_feature(enable = "dotprod")]
unsafe fn dotprod_imp<W: NeonBlock, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[W::X]; T],
) -> [[f32; TILE_ROWS]; T] {
    // SAFETY: this function's features are the ones `DotProd` needs; lengths as the caller
    // checked them.
    unsafe { tile::<W, DotProd, TILE_ROWS, T>(rows, xs) }
}

/// The `dotprod` tile's safe wrapper: `T` tokens against four rows.
fn dotprod_tile<W: NeonBlock, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[W::X]],
    out: &mut [[f32; TILE_ROWS]],
) {
    let xs = crate::simd::check_tile::<_, _, T>(rows, xs, out);
    // SAFETY: `DOTPROD_TILES`, the only way here, is put in the NEON table only when the CPU
    // has `dotprod` (`super::neon::table`), and this module's tests check it before using
    // them; lengths checked above.
    out.copy_from_slice(&unsafe { dotprod_imp::<W, T>(rows, xs) });
}

/// Tokens per multi-token tile. Not tuned on hardware: an unpacked K-quant block is sixteen
/// of the 32 vector registers, so a few tokens' activation loads and sums fit beside it.
const TOKENS: usize = 4;

/// The plain-NEON tiles.
pub(crate) const PLAIN_TILES: KTiles = KTiles {
    q5_0: Tile::new(plain_tile::<_, 1>, TOKENS, plain_tile::<_, TOKENS>),
    q5_1: Tile::new(plain_tile::<_, 1>, TOKENS, plain_tile::<_, TOKENS>),
    q4_k: Tile::new(plain_tile::<_, 1>, TOKENS, plain_tile::<_, TOKENS>),
    q5_k: Tile::new(plain_tile::<_, 1>, TOKENS, plain_tile::<_, TOKENS>),
    q6_k: Tile::new(plain_tile::<_, 1>, TOKENS, plain_tile::<_, TOKENS>),
    // Q2_K, Q3_K, IQ4_NL and IQ4_XS: the reference's tiles.
    ..SCALAR_TILES
};

/// The tiles for CPUs with `dotprod`.
pub(crate) const DOTPROD_TILES: KTiles = KTiles {
    q5_0: Tile::new(dotprod_tile::<_, 1>, TOKENS, dotprod_tile::<_, TOKENS>),
    q5_1: Tile::new(dotprod_tile::<_, 1>, TOKENS, dotprod_tile::<_, TOKENS>),
    q4_k: Tile::new(dotprod_tile::<_, 1>, TOKENS, dotprod_tile::<_, TOKENS>),
    q5_k: Tile::new(dotprod_tile::<_, 1>, TOKENS, dotprod_tile::<_, TOKENS>),
    q6_k: Tile::new(dotprod_tile::<_, 1>, TOKENS, dotprod_tile::<_, TOKENS>),
    // Q2_K, Q3_K, IQ4_NL and IQ4_XS: the reference's tiles.
    ..SCALAR_TILES
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference as r;
    use crate::reference::dot_ref;
    use bytemuck::Zeroable;
    use kiln_format::{QK, QK_K};
    use proptest::prelude::*;

    /// A small deterministic generator (the tests take a seed from proptest).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 16
        }
        /// A finite scale of either sign, sometimes zero.
        fn scale(&mut self) -> f16 {
            let v = (self.next() % 2001) as f32 / 1000.0 - 1.0;
            f16::from_f32(v * 0.05)
        }
        /// `n` blocks of random bytes (every byte pattern is a valid block), their f16 scales
        /// then made finite by `fix`.
        fn blocks<W: bytemuck::Pod>(&mut self, n: usize, fix: impl Fn(&mut W, &mut Rng)) -> Vec<W> {
            let mut v = vec![W::zeroed(); n];
            for b in bytemuck::cast_slice_mut::<W, u8>(&mut v) {
                *b = self.next() as u8;
            }
            for w in &mut v {
                fix(w, self);
            }
            v
        }
        fn floats(&mut self, n: usize, amp: f32) -> Vec<f32> {
            (0..n)
                .map(|_| ((self.next() % (1 << 24)) as f32 / (1u32 << 24) as f32 - 0.5) * amp)
                .collect()
        }
    }

    /// Each token through `tiles` (the multi-token tile over whole groups, the one-token tile
    /// for the rest) against four rows gives the reference dot of every (row, token), bit for
    /// bit.
    fn check<W: KBlock>(
        tiles: &Tile<W, W::X>,
        rows: &[Vec<W>; TILE_ROWS],
        xs: &[Vec<W::X>],
        what: &str,
    ) {
        let rows: [&[W]; TILE_ROWS] = std::array::from_fn(|r| &rows[r][..]);
        let mut t0 = 0;
        while t0 < xs.len() {
            let n = if xs.len() - t0 >= tiles.tokens {
                tiles.tokens
            } else {
                1
            };
            let group: Vec<&[W::X]> = xs[t0..t0 + n].iter().map(|x| &x[..]).collect();
            let mut out = vec![[f32::NAN; TILE_ROWS]; n];
            let f = if n == 1 { tiles.one } else { tiles.many };
            f(&rows, &group, &mut out);
            for (t, o) in out.iter().enumerate() {
                for (r, &got) in o.iter().enumerate() {
                    let want = dot_ref(rows[r], group[t]);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}: token {} row {r}: got {got}, reference {want}",
                        t0 + t
                    );
                }
            }
            t0 += n;
        }
    }

    /// Every Q5/K-quant tile of `tiles` against the reference, `nb` K-quant blocks a row
    /// (eight times as many Q5 blocks, less `trim` so their count need not be a multiple of
    /// eight).
    fn check_all(
        tiles: &KTiles,
        nb: usize,
        trim: usize,
        n_tokens: usize,
        amp: f32,
        seed: u64,
        what: &str,
    ) {
        let mut g = Rng(seed);
        let n32 = nb * QK_K / QK - trim;
        let x: Vec<Vec<f32>> = (0..n_tokens).map(|_| g.floats(nb * QK_K, amp)).collect();
        let x8: Vec<Vec<BlockQ8_0>> = x
            .iter()
            .map(|x| {
                let mut q = vec![BlockQ8_0::zeroed(); n32];
                r::quantize_row_q8_0_act_ref(&x[..n32 * QK], &mut q);
                q
            })
            .collect();
        let xk: Vec<Vec<BlockQ8K>> = x
            .iter()
            .map(|x| {
                let mut q = vec![BlockQ8K::zeroed(); nb];
                r::quantize_row_q8_k_act_ref(x, &mut q);
                q
            })
            .collect();
        let q5_0 = std::array::from_fn(|_| g.blocks(n32, |w: &mut BlockQ5_0, g| w.d = g.scale()));
        check(&tiles.q5_0, &q5_0, &x8, &format!("{what} q5_0"));
        let q5_1 = std::array::from_fn(|_| {
            g.blocks(n32, |w: &mut BlockQ5_1, g| {
                (w.d, w.m) = (g.scale(), g.scale())
            })
        });
        check(&tiles.q5_1, &q5_1, &x8, &format!("{what} q5_1"));
        let q4_k = std::array::from_fn(|_| {
            g.blocks(nb, |w: &mut BlockQ4K, g| {
                (w.d, w.dmin) = (g.scale(), g.scale())
            })
        });
        check(&tiles.q4_k, &q4_k, &xk, &format!("{what} q4_k"));
        let q5_k = std::array::from_fn(|_| {
            g.blocks(nb, |w: &mut BlockQ5K, g| {
                (w.d, w.dmin) = (g.scale(), g.scale())
            })
        });
        check(&tiles.q5_k, &q5_k, &xk, &format!("{what} q5_k"));
        let q6_k = std::array::from_fn(|_| g.blocks(nb, |w: &mut BlockQ6K, g| w.d = g.scale()));
        check(&tiles.q6_k, &q6_k, &xk, &format!("{what} q6_k"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// The plain-NEON tiles, and the `dotprod` ones where this CPU has the extension, give
        /// the reference's bits for every encoding, one token and several, for block counts
        /// around the eight accumulators and activations of any magnitude.
        #[test]
        fn neon_tiles_equal_reference_bits(
            nb in 1usize..11,
            trim in 0usize..8,
            n_tokens in 1usize..2 * TOKENS + 2,
            amp in prop::sample::select(vec![1e-3f32, 1.0, 100.0]),
            seed in any::<u64>(),
        ) {
            check_all(&PLAIN_TILES, nb, trim, n_tokens, amp, seed, "plain");
            if has_dotprod() {
                check_all(&DOTPROD_TILES, nb, trim, n_tokens, amp, seed, "dotprod");
            }
        }
    }

    /// Codes, scales and activations at their extremes (all bits set, Q6_K's scales at both
    /// ends, activation codes at ±127 and −128): no 16-bit product or pair sum may saturate.
    #[test]
    fn extreme_blocks_give_reference_bits() {
        let one = f16::from_f32(1.0);
        for (byte, act) in [(0xffu8, -1.0f32), (0xff, 1.0), (0x00, -1.0), (0xaa, 1.0)] {
            // Q8_K codes reach −128 when the largest magnitude is negative.
            let x: Vec<f32> = (0..2 * QK_K)
                .map(|i| if i % 3 == 0 { act } else { -act * 0.5 })
                .collect();
            let mut x8 = vec![BlockQ8_0::zeroed(); 2 * QK_K / QK];
            r::quantize_row_q8_0_act_ref(&x, &mut x8);
            let mut xk = vec![BlockQ8K::zeroed(); 2];
            r::quantize_row_q8_k_act_ref(&x, &mut xk);
            let q5_0 = BlockQ5_0 {
                d: one,
                qh: [byte; 4],
                qs: [byte; 16],
            };
            let q5_1 = BlockQ5_1 {
                d: one,
                m: one,
                qh: [byte; 4],
                qs: [byte; 16],
            };
            let q4_k = BlockQ4K {
                d: one,
                dmin: one,
                scales: [byte; 12],
                qs: [byte; 128],
            };
            let q5_k = BlockQ5K {
                d: one,
                dmin: one,
                scales: [byte; 12],
                qh: [byte; 32],
                qs: [byte; 128],
            };
            for tiles in [PLAIN_TILES, DOTPROD_TILES]
                .iter()
                .take(1 + usize::from(has_dotprod()))
            {
                check(
                    &tiles.q5_0,
                    &std::array::from_fn(|_| vec![q5_0; 16]),
                    std::slice::from_ref(&x8),
                    "q5_0",
                );
                check(
                    &tiles.q5_1,
                    &std::array::from_fn(|_| vec![q5_1; 16]),
                    std::slice::from_ref(&x8),
                    "q5_1",
                );
                check(
                    &tiles.q4_k,
                    &std::array::from_fn(|_| vec![q4_k; 2]),
                    std::slice::from_ref(&xk),
                    "q4_k",
                );
                check(
                    &tiles.q5_k,
                    &std::array::from_fn(|_| vec![q5_k; 2]),
                    std::slice::from_ref(&xk),
                    "q5_k",
                );
                for sc in [127i8, -128] {
                    let q6_k = BlockQ6K {
                        ql: [byte; 128],
                        qh: [byte; 64],
                        scales: [sc; 16],
                        d: one,
                    };
                    check(
                        &tiles.q6_k,
                        &std::array::from_fn(|_| vec![q6_k; 2]),
                        std::slice::from_ref(&xk),
                        "q6_k",
                    );
                }
            }
        }
    }
}
