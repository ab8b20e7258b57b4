//! The AVX2 one-token kernels for sixteen Q2_K, Q3_K, IQ4_XS or IQ4_NL rows
//! ([`crate::tile::RowsFn`]): a decoding step's matrix–vector product for these types.
//!
//! The four-row tiles take a K-quant block at a time: its integer sums are reduced to scalars
//! (two horizontal sums for Q2_K) and its float term formed in scalar registers. On a
//! 256-weight block whose codes take about fifty vector instructions, that tail costs a further
//! twenty-odd and a chain through memory. Here a row's blocks go eight at a time: each block's
//! sums stay as eight 32-bit lanes, the eight blocks' vectors are reduced together (one
//! transposing reduction, about one instruction a block), and the eight terms are formed in
//! the lanes of one register, block `8g + j` in lane `j`, which is the accumulator the
//! reference adds it to ([`crate::reference::lanes_dot`]).
//!
//! IQ4_NL's tile already goes eight blocks at a time; what its one-token kernel saves is the
//! activation side, the same for all sixteen rows: each block's `|x|` (the unsigned factor of
//! the signed product) and its scale in f32 are prepared once per call instead of once per
//! row, and a block's grid indices are split with one variable shift of a broadcast load.
//!
//! The terms are the reference's expressions ([`crate::reference::term_k`],
//! [`crate::reference::term_q6_k`], [`crate::reference::term_q5_0`]) lane by lane, and the
//! integer sums are exact, so every row's sum is the reference's bit for bit. Blocks past the
//! last whole group of eight take the one-block sums into the same lanes.

use std::arch::x86_64::*;

use std::cell::RefCell;

use kiln_format::{BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ8K, BlockQ8_0};

use super::kquant::{
    h, iq4_grid256, iq4_nl_avx2, iq4_xs_avx2, iq4_xs_lanes, iq4_xs_unpack, k16_lanes, q2_k_avx2,
    q2_k_unpack, q3_k_avx2, q3_k_unpack, scales8,
};
use super::q5::reduce8;
use crate::reference::{sum_lanes8, KBlock, BLOCK_LANES};
use crate::tile::WIDE_ROWS;

/// The activation scales of eight Q8_K blocks.
///
/// # Safety
/// AVX is enabled; `x` holds at least eight blocks.
#[inline(always)]
unsafe fn dx8(x: &[BlockQ8K]) -> __m256 {
    // SAFETY: AVX enabled (caller contract); indices below 8 ≤ x.len() (caller contract).
    unsafe {
        let d = |j: usize| x.get_unchecked(j).d;
        _mm256_setr_ps(d(0), d(1), d(2), d(3), d(4), d(5), d(6), d(7))
    }
}

/// One row against one token: `block(w, x)` gives a block's `N` integer sums, each as eight
/// i32 lanes; `terms(w, x, sums)` the float terms of eight blocks from their `N` exact sums
/// (lane `j`: block `j`); `one(w, x)` one block's sums as the tiles take them.
///
/// # Safety
/// AVX2, FMA and F16C are enabled (and whatever the closures need); `row.len() == x.len()`.
#[inline(always)]
unsafe fn row8<W: KBlock<X = BlockQ8K>, const N: usize>(
    row: &[W],
    x: &[BlockQ8K],
    block: impl Fn(&W, &BlockQ8K) -> [__m256i; N],
    terms: impl Fn(&[W], &[BlockQ8K], [__m256; N]) -> __m256,
    one: impl Fn(&W, &BlockQ8K) -> W::Ints,
) -> f32 {
    let nb = x.len();
    let groups = nb / BLOCK_LANES;
    // SAFETY: features enabled (caller contract). Group g reads blocks 8g..8g + 8 ≤ nb of the
    // row and the token, both nb long (caller contract); the tail reads blocks below nb.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for g in 0..groups {
            let b0 = g * BLOCK_LANES;
            let wb = row.get_unchecked(b0..b0 + BLOCK_LANES);
            let xb = x.get_unchecked(b0..b0 + BLOCK_LANES);
            let mut v = [[_mm256_setzero_si256(); BLOCK_LANES]; N];
            for j in 0..BLOCK_LANES {
                let s = block(&wb[j], &xb[j]);
                for n in 0..N {
                    v[n][j] = s[n];
                }
            }
            let mut sums = [_mm256_setzero_ps(); N];
            for n in 0..N {
                sums[n] = _mm256_cvtepi32_ps(reduce8(&v[n]));
            }
            acc = _mm256_add_ps(acc, terms(wb, xb, sums));
        }
        let mut lanes = [0f32; BLOCK_LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for b in groups * BLOCK_LANES..nb {
            let (w, xb) = (row.get_unchecked(b), x.get_unchecked(b));
            lanes[b % BLOCK_LANES] += W::term(w, xb, one(w, xb), |v| h(v));
        }
        sum_lanes8(&lanes)
    }
}

/// One Q2_K row: [`crate::reference::term_k`] of eight blocks, lane by lane.
///
/// # Safety
/// AVX2, FMA and F16C are enabled; `row.len() == x.len()`.
#[inline(always)]
unsafe fn q2_k_row(row: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
    // SAFETY: the caller's contract, which is every closure's.
    unsafe {
        row8(
            row,
            x,
            |w, x| {
                let (isum, mins) = k16_lanes(&q2_k_unpack(w), x);
                [isum, mins]
            },
            |w, x, [isum, mins]| {
                let dx = dx8(x);
                let d = scales8(w, |b| b.d);
                let dmin = scales8(w, |b| b.dmin);
                _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_mul_ps(dx, d), isum),
                    _mm256_mul_ps(_mm256_mul_ps(dx, dmin), mins),
                )
            },
            |w, x| q2_k_avx2(&q2_k_unpack(w), x),
        )
    }
}

/// One Q3_K row: [`crate::reference::term_q6_k`] of eight blocks, lane by lane, of the sums
/// `isum − 4·Σ sc_s·bsum_s` ([`crate::reference::isum_q3_k`]).
///
/// # Safety
/// AVX2, FMA and F16C are enabled; `row.len() == x.len()`.
#[inline(always)]
unsafe fn q3_k_row(row: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
    // SAFETY: the caller's contract, which is every closure's.
    unsafe {
        row8(
            row,
            x,
            |w, x| {
                let (isum, sums) = k16_lanes(&q3_k_unpack(w), x);
                [_mm256_sub_epi32(isum, _mm256_slli_epi32::<2>(sums))]
            },
            |w, x, [isum]| _mm256_mul_ps(_mm256_mul_ps(dx8(x), scales8(w, |b| b.d)), isum),
            |w, x| q3_k_avx2(&q3_k_unpack(w), x),
        )
    }
}

/// One IQ4_XS row: [`crate::reference::term_q6_k`] of eight blocks, lane by lane.
///
/// # Safety
/// AVX2, FMA and F16C are enabled; `row.len() == x.len()`.
#[inline(always)]
unsafe fn iq4_xs_row(row: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
    // SAFETY: the caller's contract, which is every closure's.
    unsafe {
        row8(
            row,
            x,
            |w, x| [iq4_xs_lanes(&iq4_xs_unpack(w), x)],
            |w, x, [isum]| _mm256_mul_ps(_mm256_mul_ps(dx8(x), scales8(w, |b| b.d)), isum),
            |w, x| iq4_xs_avx2(&iq4_xs_unpack(w), x),
        )
    }
}

thread_local! {
    /// The calling thread's prepared activations for [`iq4_nl_row`]: each block's `|x|` and its
    /// scale in f32, reused from call to call.
    static IQ4_NL_X: RefCell<(Vec<__m256i>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One IQ4_NL row against one token whose blocks' `|x|` are `ax` and scales `dx` (f32):
/// [`crate::reference::term_q5_0`] of eight blocks, lane by lane.
///
/// # Safety
/// AVX2, FMA and F16C are enabled; `row`, `x`, `ax` and `dx` have the same length.
#[inline(always)]
unsafe fn iq4_nl_row(row: &[BlockIQ4NL], x: &[BlockQ8_0], ax: &[__m256i], dx: &[f32]) -> f32 {
    let nb = x.len();
    let groups = nb / BLOCK_LANES;
    // SAFETY: features enabled (caller contract). Group g reads blocks 8g..8g + 8 ≤ nb of the
    // row, the token and its prepared vectors, all nb long (caller contract); each block's
    // `qs` is 16 readable bytes (weights) or 32 (activations); the tail reads blocks below nb.
    unsafe {
        let grid = iq4_grid256();
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        // The low half keeps the bytes as they are (low nibbles: weights 0..16), the high half
        // shifts them right by four (high nibbles: weights 16..32).
        let split = _mm256_setr_epi64x(0, 0, 4, 4);
        let mut acc = _mm256_setzero_ps();
        for g in 0..groups {
            let b0 = g * BLOCK_LANES;
            let mut v = [_mm256_setzero_si256(); BLOCK_LANES];
            for (j, v) in v.iter_mut().enumerate() {
                let (w, xb) = (row.get_unchecked(b0 + j), x.get_unchecked(b0 + j));
                let raw =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128(w.qs.as_ptr() as *const __m128i));
                let idx = _mm256_and_si256(_mm256_srlv_epi64(raw, split), m4);
                let wv = _mm256_shuffle_epi8(grid, idx);
                let xv = _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i);
                let p = _mm256_maddubs_epi16(*ax.get_unchecked(b0 + j), _mm256_sign_epi8(wv, xv));
                *v = _mm256_madd_epi16(p, ones);
            }
            let isum = _mm256_cvtepi32_ps(reduce8(&v));
            let dw = scales8(row.get_unchecked(b0..b0 + BLOCK_LANES), |b| b.d);
            let dxv = _mm256_loadu_ps(dx.as_ptr().add(b0));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(dw, dxv)));
        }
        let mut lanes = [0f32; BLOCK_LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for b in groups * BLOCK_LANES..nb {
            let (w, xb) = (row.get_unchecked(b), x.get_unchecked(b));
            lanes[b % BLOCK_LANES] += BlockIQ4NL::term(w, xb, iq4_nl_avx2(w, xb), |v| h(v));
        }
        sum_lanes8(&lanes)
    }
}

/// The `#[target_feature]` kernels; their callers check the lengths.
mod imp {
    use super::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q2_k(w: &[BlockQ2K], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
        let nb = x.len();
        for (r, o) in out.iter_mut().enumerate() {
            // SAFETY: features enabled by this function's attribute; row r is nb blocks, as
            // is the token (caller contract: w.len() == WIDE_ROWS·nb).
            *o = unsafe { q2_k_row(w.get_unchecked(r * nb..(r + 1) * nb), x) };
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q3_k(w: &[BlockQ3K], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
        let nb = x.len();
        for (r, o) in out.iter_mut().enumerate() {
            // SAFETY: as in `q2_k`.
            *o = unsafe { q3_k_row(w.get_unchecked(r * nb..(r + 1) * nb), x) };
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn iq4_nl(w: &[BlockIQ4NL], x: &[BlockQ8_0], out: &mut [f32; WIDE_ROWS]) {
        let nb = x.len();
        IQ4_NL_X.with_borrow_mut(|(ax, dx)| {
            ax.clear();
            dx.clear();
            for b in x {
                // SAFETY: features enabled by this function's attribute; `b.qs` is 32 bytes.
                unsafe {
                    ax.push(_mm256_abs_epi8(_mm256_loadu_si256(
                        b.qs.as_ptr() as *const __m256i
                    )));
                    dx.push(h(b.d));
                }
            }
            for (r, o) in out.iter_mut().enumerate() {
                // SAFETY: as in `q2_k`; `ax` and `dx` hold the token's nb blocks.
                *o = unsafe { iq4_nl_row(w.get_unchecked(r * nb..(r + 1) * nb), x, ax, dx) };
            }
        })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn iq4_xs(w: &[BlockIQ4XS], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
        let nb = x.len();
        for (r, o) in out.iter_mut().enumerate() {
            // SAFETY: as in `q2_k`.
            *o = unsafe { iq4_xs_row(w.get_unchecked(r * nb..(r + 1) * nb), x) };
        }
    }
}

/// Sixteen Q2_K rows against one token (`w`: the rows one after another).
pub(crate) fn q2_k(w: &[BlockQ2K], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
    assert_eq!(w.len(), WIDE_ROWS * x.len(), "rows: row length mismatch");
    // SAFETY: this tier's table, the only way here, is handed out only when the CPU has AVX2,
    // FMA and F16C (`crate::kernels`); lengths checked above.
    unsafe { imp::q2_k(w, x, out) }
}

/// Sixteen Q3_K rows against one token (`w`: the rows one after another).
pub(crate) fn q3_k(w: &[BlockQ3K], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
    assert_eq!(w.len(), WIDE_ROWS * x.len(), "rows: row length mismatch");
    // SAFETY: as in `q2_k`.
    unsafe { imp::q3_k(w, x, out) }
}

/// Sixteen IQ4_XS rows against one token (`w`: the rows one after another).
pub(crate) fn iq4_xs(w: &[BlockIQ4XS], x: &[BlockQ8K], out: &mut [f32; WIDE_ROWS]) {
    assert_eq!(w.len(), WIDE_ROWS * x.len(), "rows: row length mismatch");
    // SAFETY: as in `q2_k`.
    unsafe { imp::iq4_xs(w, x, out) }
}

/// Sixteen IQ4_NL rows against one token (`w`: the rows one after another).
pub(crate) fn iq4_nl(w: &[BlockIQ4NL], x: &[BlockQ8_0], out: &mut [f32; WIDE_ROWS]) {
    assert_eq!(w.len(), WIDE_ROWS * x.len(), "rows: row length mismatch");
    // SAFETY: as in `q2_k`.
    unsafe { imp::iq4_nl(w, x, out) }
}
