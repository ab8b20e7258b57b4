//! The AVX-512 quantized tile: two 32-weight blocks per 512-bit `vpdpbusd`.
//!
//! The generic block kernel ([`super::quant::tile`]) spends more instructions per block on
//! the scale (`d_w·d_x`, converted from f16 and broadcast) than on the integer dot. Here a pair
//! of blocks shares every instruction:
//!
//! - the weight pair is one masked 36-byte load (Q4_0) or two 32-byte loads (Q8_0); `vpermw`
//!   spreads the codes into the order of the activation pair, and a second `vpermw` of the same
//!   load lines the two f16 scales up as `[d0 ×8, d1 ×8]`, converted in one `vcvtph2ps`;
//! - the activation pair (the 64 codes of two consecutive Q8_0 blocks, their offset
//!   correction and `[dx0 ×8, dx1 ×8]`) is shared by a tile's rows. [`prepare`] builds every
//!   pair of a token once per product (`matmul` does, for the whole batch), so the tiles,
//!   which meet each token once per four rows, only load it ([`PairSource`]).
//!
//! Lanes 0–7 of the integer result belong to the first block, 8–15 to the second. Each lane is
//! converted to f32 (exact) and accumulated with one FMA by `d_w·d_x` (the same f32 product
//! as the reference), so only the float summation order differs from the reference. A final
//! odd block goes through the same code with the second block masked to zero codes and zero
//! scales, adding exact zeros. A (row, token) result depends only on that row and token, so
//! the one-token and multi-token tiles agree bit for bit.

use std::arch::x86_64::*;

use kiln_format::{BlockQ4_0, BlockQ8_0};

use super::avx512_float::Avx512;
use super::float::{prefetch_ahead, F32Simd};
use crate::tile::PreparedPair;

/// An activation block pair in registers (or, stored by [`prepare`], in memory).
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct XPair {
    /// The 64 codes of blocks b and b+1.
    x: __m512i,
    /// `−k·Σx` per group of four codes, `k` the weight encoding's unsigned offset.
    bias: __m512i,
    /// `[dx_b ×8, dx_{b+1} ×8]`.
    dx: __m512,
}

/// A weight encoding the pair kernel handles.
pub(crate) trait PairBlock: kiln_format::BlockType {
    /// The offset that makes stored codes unsigned (`q + OFFSET` is what `vpdpbusd` sees).
    const OFFSET: i8;
    /// Codes (unsigned, in the activation pair's order) and `[d0 ×8, d1 ×8]` of blocks
    /// `p[0]` and, if `full`, `p[1]` (zero codes and zero scale otherwise).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI are enabled; `p` is valid for one block, and for two if `full`.
    unsafe fn load_pair(p: *const Self, full: bool) -> (__m512i, __m512);
}

/// Word `i` of a 36-byte Q4_0 pair (`d0`, 8 words of nibbles, `d1`, 8 words of nibbles).
const Q4_CODES: [i16; 32] = [
    1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13,
    14, 15, 16, 17,
];
/// `[d0 ×8, d1 ×8]` from a Q4_0 pair (words 0 and 9).
const Q4_SCALES: [i16; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
];
/// `[d0 ×8, d1 ×8]` from a Q8_0 pair (words 0 and 17).
const Q8_SCALES: [i16; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0,
];

#[inline(always)]
unsafe fn index(words: &[i16; 32]) -> __m512i {
    // SAFETY: `words` is 64 readable bytes; AVX-512F enabled (caller contract).
    unsafe { _mm512_loadu_si512(words.as_ptr() as *const __m512i) }
}

impl PairBlock for BlockQ4_0 {
    const OFFSET: i8 = 8;
    /// Nibble `j` of byte `i` is weight `i + 16j`: after the `vpermw`, quarters 1 and 3 (the
    /// second copy of each block's bytes) are shifted right by four, then every byte masked.
    #[inline(always)]
    unsafe fn load_pair(p: *const Self, full: bool) -> (__m512i, __m512) {
        // SAFETY: the masked load reads 18 (one block) or 36 bytes (two) from `p`, valid by the
        // caller contract, and suppresses faults on the masked-off rest; register-only
        // intrinsics otherwise, features enabled by the caller.
        unsafe {
            let mask: __mmask32 = if full { (1 << 18) - 1 } else { (1 << 9) - 1 };
            let v = _mm512_maskz_loadu_epi16(mask, p as *const i16);
            let q = _mm512_permutexvar_epi16(index(&Q4_CODES), v);
            let q = _mm512_mask_srli_epi16(q, 0xff00_ff00, q, 4);
            let q = _mm512_and_si512(q, _mm512_set1_epi8(0x0f));
            let d = _mm512_permutexvar_epi16(index(&Q4_SCALES), v);
            (q, _mm512_cvtph_ps(_mm512_castsi512_si256(d)))
        }
    }
}

impl PairBlock for BlockQ8_0 {
    const OFFSET: i8 = -128;
    /// Codes biased to unsigned by flipping the sign bit (`w + 128`).
    #[inline(always)]
    unsafe fn load_pair(p: *const Self, full: bool) -> (__m512i, __m512) {
        // SAFETY: block `p[0]` (34 bytes) is readable, and `p[1]` when `full`; the masked
        // load reads 2 or 36 bytes and suppresses faults on the rest; features enabled.
        unsafe {
            let b = p as *const u8;
            let lo = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let hi = if full {
                _mm256_loadu_si256(b.add(36) as *const __m256i)
            } else {
                _mm256_set1_epi8(-128)
            };
            let w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            let w = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
            let mask: __mmask32 = if full { (1 << 18) - 1 } else { 1 };
            let v = _mm512_maskz_loadu_epi16(mask, p as *const i16);
            let d = _mm512_permutexvar_epi16(index(&Q8_SCALES), v);
            (w, _mm512_cvtph_ps(_mm512_castsi512_si256(d)))
        }
    }
}

/// Where a tile's activation pairs come from.
pub(crate) trait PairSource: Copy {
    /// Blocks `b` and (if `full`) `b + 1` of the token row at `row`, for weights with offset
    /// `offset`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI are enabled; the row holds those blocks (see [`tile`]).
    unsafe fn pair(row: *const Self, b: usize, full: bool, offset: i8) -> XPair;
}

impl PairSource for BlockQ8_0 {
    #[inline(always)]
    unsafe fn pair(row: *const Self, b: usize, full: bool, offset: i8) -> XPair {
        // SAFETY: the caller's contract is `x_pair`'s for `row + b`.
        unsafe { x_pair(row.add(b), full, offset) }
    }
}

impl PairSource for PreparedPair {
    /// Prepared for the right offset already (caller contract): a load.
    #[inline(always)]
    unsafe fn pair(row: *const Self, b: usize, _full: bool, _offset: i8) -> XPair {
        // SAFETY: pair b / 2 is in the row (caller contract); `PreparedPair` has `XPair`'s
        // size and alignment (three 512-bit vectors), and every bit pattern is valid for them.
        unsafe { *(row.add(b / 2) as *const XPair) }
    }
}

/// Prepare activation blocks `x[0]` and, if `full`, `x[1]` (zeros otherwise) for weights with
/// unsigned offset `offset`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled; `x` is valid for one block, and for two if `full`.
#[inline(always)]
unsafe fn x_pair(x: *const BlockQ8_0, full: bool, offset: i8) -> XPair {
    // SAFETY: reads block x[0], and x[1] only when `full` (caller contract); features enabled.
    unsafe {
        let b0 = &*x;
        let lo = _mm256_loadu_si256(b0.qs.as_ptr() as *const __m256i);
        let (hi, d1) = if full {
            let b1 = &*x.add(1);
            (
                _mm256_loadu_si256(b1.qs.as_ptr() as *const __m256i),
                b1.d.to_bits(),
            )
        } else {
            (_mm256_setzero_si256(), 0)
        };
        let xv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        let z = _mm512_setzero_si512();
        let s = _mm512_dpbusd_epi32(z, _mm512_set1_epi8(offset), xv);
        let d = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_set1_epi16(b0.d.to_bits() as i16)),
            _mm_set1_epi16(d1 as i16),
            1,
        );
        XPair {
            x: xv,
            bias: _mm512_sub_epi32(z, s),
            dx: _mm512_cvtph_ps(d),
        }
    }
}

/// `R` weight rows against `T` activation rows (Q8_0 blocks, or pairs already prepared by
/// [`prepare`]: the same values either way, so the same bits), two blocks per step (see the
/// module documentation for the order of operations).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are enabled, every row has `nb` blocks and
/// every token `nb` blocks (`nb.div_ceil(2)` pairs if prepared, made with `W::OFFSET`), and
/// `R·T <= 16`.
#[inline(always)]
pub(crate) unsafe fn tile<W: PairBlock, A: PairSource, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[A]; T],
) -> [[f32; R]; T] {
    // SAFETY: forwarded contract.
    let acc = unsafe { tile_sums::<W, A, R, T>(rows, xs) };
    // SAFETY: features enabled (caller contract).
    let mut v = [unsafe { _mm512_setzero_ps() }; 16];
    for t in 0..T {
        v[t * R..(t + 1) * R].copy_from_slice(&acc[t]);
    }
    // SAFETY: features enabled (caller contract); R·T <= 16.
    let sums = unsafe { Avx512::reduce_many(&v, R * T) };
    std::array::from_fn(|t| std::array::from_fn(|r| sums[t * R + r]))
}

/// Sixteen consecutive weight rows (`w`, `16·nb` blocks) against one token: the four-row,
/// one-token [`tile`] four times over, its sixteen sums reduced together (45 instructions
/// instead of 128) and returned as one vector, so a matrix–vector product pays one call and
/// one store per sixteen rows. The same bits as [`tile`].
///
/// # Safety
/// As [`tile`], for one token and the sixteen rows `w[16·nb]` holds.
#[inline(always)]
pub(crate) unsafe fn rows16<W: PairBlock, A: PairSource>(w: &[W], x: &[A]) -> [f32; 16] {
    let nb = w.len() / 16;
    // SAFETY: features enabled (caller contract).
    let mut v = [unsafe { _mm512_setzero_ps() }; 16];
    for (g, vg) in v.chunks_exact_mut(4).enumerate() {
        let rows: [&[W]; 4] = std::array::from_fn(|i| &w[(4 * g + i) * nb..(4 * g + i + 1) * nb]);
        // SAFETY: every row has nb blocks, x holds nb of them (caller contract).
        vg.copy_from_slice(&unsafe { tile_sums::<W, A, 4, 1>(&rows, &[x]) }[0]);
    }
    // SAFETY: features enabled (caller contract).
    unsafe { Avx512::reduce_many(&v, 16) }
}

/// [`tile`]'s accumulators, not yet reduced.
///
/// # Safety
/// As [`tile`].
#[inline(always)]
unsafe fn tile_sums<W: PairBlock, A: PairSource, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[A]; T],
) -> [[__m512; R]; T] {
    let nb = rows[0].len();
    // SAFETY: features enabled (caller contract).
    let mut acc = [[unsafe { _mm512_setzero_ps() }; R]; T];
    let mut b = 0;
    while b < nb {
        let full = b + 1 < nb;
        // SAFETY: b < nb, and b + 1 < nb when `full`, for every row and token slice (all hold
        // nb blocks, caller contract); features enabled.
        unsafe {
            // Every row's weights first, then one token at a time: 2·R weight registers and
            // one prepared activation pair live beside the R·T accumulators.
            let mut wv = [(_mm512_setzero_si512(), _mm512_setzero_ps()); R];
            for (r, wr) in wv.iter_mut().enumerate() {
                let wp = rows[r].as_ptr().add(b);
                if T == 1 {
                    prefetch_ahead(wp, 2 * std::mem::size_of::<W>());
                }
                *wr = W::load_pair(wp, full);
            }
            for t in 0..T {
                let xp = A::pair(xs[t].as_ptr(), b, full, W::OFFSET);
                for r in 0..R {
                    let (w, dw) = wv[r];
                    let isum = _mm512_dpbusd_epi32(xp.bias, w, xp.x);
                    let scale = _mm512_mul_ps(dw, xp.dx);
                    acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t][r]);
                }
            }
        }
        b += 2;
    }
    acc
}

/// Every activation block pair of one token's row `x`, prepared for weights with unsigned
/// offset `offset` (what [`tile`] computes per tile, done once per product instead):
/// `out[p]` is blocks `2p` and `2p + 1` (zeros for a missing odd one).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled and `out.len() == x.len().div_ceil(2)`.
#[inline(always)]
pub(crate) unsafe fn prepare(x: &[BlockQ8_0], offset: i8, out: &mut [PreparedPair]) {
    for (p, o) in out.iter_mut().enumerate() {
        let b = 2 * p;
        // SAFETY: block b exists (p < ceil(nb/2)), block b + 1 when `full`; `PreparedPair`
        // is 192 bytes aligned to 64, the layout of `XPair` (three 512-bit vectors), so the
        // aligned stores are in bounds; features enabled (caller contract).
        unsafe {
            let xp = x_pair(x.as_ptr().add(b), b + 1 < x.len(), offset);
            let dst = o as *mut PreparedPair as *mut XPair;
            _mm512_store_si512(std::ptr::addr_of_mut!((*dst).x), xp.x);
            _mm512_store_si512(std::ptr::addr_of_mut!((*dst).bias), xp.bias);
            _mm512_store_ps(std::ptr::addr_of_mut!((*dst).dx) as *mut f32, xp.dx);
        }
    }
}
