//! Scalar reference kernels: the specification every SIMD tier is tested against.
//!
//! Each function is written to be obviously right, in the order the maths reads. The scalar
//! tier of [`crate::Kernels`] runs exactly these. Every `*_ref` spec of the crate is here:
//! this module's vector kernels and per-encoding dots, `kblock`'s generic dot of a
//! Q5_0/Q5_1/K-quant row (the `KBlock` pairing of a weight block with its activation block)
//! and its one-dot-per-(row, token) tile, and `klanes`'s statement of the K-quant lanes kernel
//! over its unpacked layouts (tests only).

use half::{bf16, f16};
use kiln_format::iq4::IQ4_GRID;
use kiln_format::kquants::{
    q2_k_codes, q3_k_codes, q3_k_scales, q4_k_codes, q5_k_codes, q6_k_codes, scale_min_k4,
    K_SCALE_SIZE,
};
use kiln_format::q5::q5_codes;
use kiln_format::{
    BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_0x16, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, DType, GROUP_ROWS,
    QK, QK_K,
};

use crate::stats::ErrorStats;

pub(crate) mod kblock;
pub(crate) mod klanes;

pub(crate) use kblock::{dot_ref, tile_ref, KBlock};

/// `Σ a[i]·b[i]`, summed left to right.
pub fn dot_f32_ref(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    a.iter().zip(b).fold(0.0, |s, (x, y)| s + x * y)
}

/// `acc + Σ w[i]·x[i]` as one chain of fused multiply-adds in index order
/// (`acc = fma(w[i], x[i], acc)`): the order of the float lanes kernels, which give these bits
/// for every (row, token) of a batch they take ([`crate::Path::FloatLanes`]).
pub fn float_lanes_ref(w: &[f32], x: &[f32], acc: f32) -> f32 {
    assert_eq!(w.len(), x.len(), "float_lanes: length mismatch");
    w.iter().zip(x).fold(acc, |s, (w, x)| w.mul_add(*x, s))
}

/// `y += alpha·x`.
pub fn axpy_ref(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: length mismatch");
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// `out[r][c] = Σ_j probs[r·stride + j]·v[j·width + c]`, defined as the loop it replaced in
/// attention: per row of `out`, zero it, then [`axpy_ref`] with each row `j` of `v` in order.
pub fn weighted_sum_ref(probs: &[f32], stride: usize, v: &[f32], width: usize, out: &mut [f32]) {
    crate::shape::weighted_sum_shape(probs, stride, v, width, out);
    for (r, o) in out.chunks_exact_mut(width).enumerate() {
        o.fill(0.0);
        for (j, vj) in v.chunks_exact(width).enumerate() {
            axpy_ref(probs[r * stride + j], vj, o);
        }
    }
}

/// [`weighted_sum_ref`] over f16 rows of `v`, each widened to f32 first.
pub fn weighted_sum_f16_ref(
    probs: &[f32],
    stride: usize,
    v: &[f16],
    width: usize,
    out: &mut [f32],
) {
    crate::shape::weighted_sum_shape(probs, stride, v, width, out);
    let mut row = vec![0f32; width];
    for (r, o) in out.chunks_exact_mut(width).enumerate() {
        o.fill(0.0);
        for (j, vj) in v.chunks_exact(width).enumerate() {
            for (x, h) in row.iter_mut().zip(vj) {
                *x = h.to_f32();
            }
            axpy_ref(probs[r * stride + j], &row, o);
        }
    }
}

/// `Σ w[i]·x[i]` with f16 weights widened to f32.
pub fn dot_f16_f32_ref(w: &[f16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_f16_f32: length mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| s + w.to_f32() * x)
}

/// `Σ w[i]·x[i]` with bf16 weights widened to f32.
pub fn dot_bf16_f32_ref(w: &[bf16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_bf16_f32: length mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| s + w.to_f32() * x)
}

/// Quantize activations to Q8_0 with GGML's rule (`d = max|x|/127`, `q = round(x/d)`), the
/// same as [`kiln_format::blocks::quantize_block_q8_0_ref`] but without the NaN check and
/// writing into a caller's buffer. `x.len() == out.len() * 32`.
pub fn quantize_row_q8_0_act_ref(x: &[f32], out: &mut [BlockQ8_0]) {
    assert_eq!(
        x.len(),
        out.len() * QK,
        "quantize_row_q8_0_act: x must hold 32 values per output block"
    );
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        *b = kiln_format::blocks::quantize_block_q8_0_ref(xs.try_into().expect("QK chunk"));
    }
}

/// Integer dot product of one pair of Q8_0 code blocks.
#[inline]
pub fn isum_q8_0(w: &BlockQ8_0, x: &BlockQ8_0) -> i32 {
    w.qs.iter()
        .zip(&x.qs)
        .map(|(&a, &b)| a as i32 * b as i32)
        .sum()
}

/// Integer dot product of a Q4_0 block (codes -8..=7) with a Q8_0 block.
#[inline]
pub fn isum_q4_0(w: &BlockQ4_0, x: &BlockQ8_0) -> i32 {
    let mut s = 0i32;
    for j in 0..QK / 2 {
        let lo = (w.qs[j] & 0x0f) as i32 - 8;
        let hi = (w.qs[j] >> 4) as i32 - 8;
        s += lo * x.qs[j] as i32 + hi * x.qs[j + QK / 2] as i32;
    }
    s
}

/// `Σ_blocks isum · (d_w·d_x)`: exact integer sums per block, one float product per block.
pub fn dot_q8_0_q8_0_ref(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q8_0_q8_0: block count mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| {
        s + isum_q8_0(w, x) as f32 * (w.d.to_f32() * x.d.to_f32())
    })
}

/// `Σ_blocks isum · (d_w·d_x)` for Q4_0 weights against Q8_0 activations.
pub fn dot_q4_0_q8_0_ref(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q4_0_q8_0: block count mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| {
        s + isum_q4_0(w, x) as f32 * (w.d.to_f32() * x.d.to_f32())
    })
}

/// Sixteen interleaved Q4_0 rows (`w`: one chunk's groups, block after block) · Q8_0
/// activations: `out[r]` is [`dot_q4_0_q8_0_ref`] of row `r`, which the interleaved kernels
/// reproduce bit for bit.
pub fn matvec_q4_0x16_ref(w: &[BlockQ4_0x16], x: &[BlockQ8_0], out: &mut [f32; GROUP_ROWS]) {
    assert_eq!(w.len(), x.len(), "matvec_q4_0x16: block count mismatch");
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<BlockQ4_0> = w.iter().map(|g| g.row(r)).collect();
        *o = dot_q4_0_q8_0_ref(&row, x);
    }
}

/// Sixteen interleaved IQ4_NL rows (`w`: one chunk's groups) · Q8_0 activations: `out[r]` is
/// [`dot_iq4_nl_q8_0_ref`] of row `r` (the plain rows' bits), which the interleaved kernels
/// reproduce bit for bit.
pub fn matvec_iq4_nlx16_ref(w: &[BlockIQ4NLx16], x: &[BlockQ8_0], out: &mut [f32; GROUP_ROWS]) {
    assert_eq!(w.len(), x.len(), "matvec_iq4_nlx16: block count mismatch");
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<BlockIQ4NL> = w.iter().map(|g| g.row(r)).collect();
        *o = dot_iq4_nl_q8_0_ref(&row, x);
    }
}

/// Sixteen interleaved IQ4_XS rows (`w`: one chunk's groups) · Q8_K activations: `out[r]` is
/// [`dot_iq4_xs_q8_k_ref`] of row `r` (the plain rows' bits), which the interleaved kernels
/// reproduce bit for bit.
pub fn matvec_iq4_xsx16_ref(w: &[BlockIQ4XSx16], x: &[BlockQ8K], out: &mut [f32; GROUP_ROWS]) {
    assert_eq!(w.len(), x.len(), "matvec_iq4_xsx16: block count mismatch");
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<BlockIQ4XS> = w.iter().map(|g| g.row(r)).collect();
        *o = dot_iq4_xs_q8_k_ref(&row, x);
    }
}

/// Accumulators of the Q5_1 and K-quant dot products: block `b`'s term (one f32 per block,
/// from exact integer sums) is added into accumulator `b % 8`, and the eight are summed by
/// [`sum_lanes8`]. Every tier reproduces this order, so every tier gives these bits. (Q5_0 adds
/// its terms block after block, as Q4_0 does: see [`dot_q5_0_q8_0_ref`].)
pub const BLOCK_LANES: usize = 8;

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`: the tree in which an 8-lane x86
/// register is summed (upper half onto lower, then pairs two apart, then neighbours).
#[inline]
pub fn sum_lanes8(a: &[f32; BLOCK_LANES]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// `Σ_b term(w[b], x[b])` in the order of [`BLOCK_LANES`]: term `b` into accumulator `b % 8`
/// (each starting at +0), then [`sum_lanes8`].
#[inline]
pub fn lanes_dot<W, X>(w: &[W], x: &[X], term: impl Fn(&W, &X) -> f32) -> f32 {
    let mut acc = [0f32; BLOCK_LANES];
    for (b, (w, x)) in w.iter().zip(x).enumerate() {
        acc[b % BLOCK_LANES] += term(w, x);
    }
    sum_lanes8(&acc)
}

/// `Σ (q_j − 16)·x_j` of a Q5_0 block against a Q8_0 block (exact).
pub fn isum_q5_0(w: &BlockQ5_0, x: &BlockQ8_0) -> i32 {
    q5_codes(w.qh, &w.qs)
        .iter()
        .zip(&x.qs)
        .map(|(&q, &x)| (i32::from(q) - 16) * i32::from(x))
        .sum()
}

/// One Q5_0 block's term: `isum · (d_w·d_x)`.
#[inline]
pub fn term_q5_0(dw: f32, dx: f32, isum: i32) -> f32 {
    isum as f32 * (dw * dx)
}

/// Q5_0 weights · Q8_0 activations (GGML's pairing): [`term_q5_0`] per block, added block
/// after block (`s + isum·(d_w·d_x)`, the order of [`dot_q4_0_q8_0_ref`], which the lanes
/// kernels reproduce for prefill).
pub fn dot_q5_0_q8_0_ref(w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q5_0_q8_0: block count mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| {
        s + term_q5_0(w.d.to_f32(), x.d.to_f32(), isum_q5_0(w, x))
    })
}

/// `(Σ q_j·x_j, Σ x_j)` of a Q5_1 block (codes 0..=31) against a Q8_0 block (exact).
pub fn isum_q5_1(w: &BlockQ5_1, x: &BlockQ8_0) -> (i32, i32) {
    let q = q5_codes(w.qh, &w.qs);
    let qx = q
        .iter()
        .zip(&x.qs)
        .map(|(&q, &x)| i32::from(q) * i32::from(x))
        .sum();
    let sx = x.qs.iter().map(|&x| i32::from(x)).sum();
    (qx, sx)
}

/// One Q5_1 block's term, `w = d·q + m` against `x = d_x·c`:
/// `qx · (d_w·d_x) + sx · (m_w·d_x)`, in that order.
///
/// GGML pairs Q5_1 with Q8_1 activations, whose blocks carry `d_x·Σc` as an f16; Kiln pairs it
/// with the Q8_0 activations Q5_0 and Q8_0 take (one quantization serves them all) and sums the
/// codes exactly instead.
#[inline]
pub fn term_q5_1(dw: f32, mw: f32, dx: f32, (qx, sx): (i32, i32)) -> f32 {
    qx as f32 * (dw * dx) + sx as f32 * (mw * dx)
}

/// Q5_1 weights · Q8_0 activations: [`term_q5_1`] per block, in the order of [`BLOCK_LANES`].
pub fn dot_q5_1_q8_0_ref(w: &[BlockQ5_1], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q5_1_q8_0: block count mismatch");
    lanes_dot(w, x, |w, x| {
        term_q5_1(w.d.to_f32(), w.m.to_f32(), x.d.to_f32(), isum_q5_1(w, x))
    })
}

/// `(Σ_s sc_s·Σ_{j∈s} q_j·x_j, Σ_s m_s·(bsum_2s + bsum_2s+1))` for the codes `q` (0..=31) of a
/// Q4_K/Q5_K block with packed scales `scales`, against a Q8_K block: the two exact integer
/// sums of GGML's `vec_dot_q4_K_q8_K`.
fn isum_k_affine(scales: &[u8; K_SCALE_SIZE], q: &[u8; QK_K], x: &BlockQ8K) -> (i32, i32) {
    let (mut isum, mut mins) = (0i32, 0i32);
    for s in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(s, scales);
        let dot: i32 = q[32 * s..32 * s + 32]
            .iter()
            .zip(&x.qs[32 * s..32 * s + 32])
            .map(|(&q, &x)| i32::from(q) * i32::from(x))
            .sum();
        isum += i32::from(sc) * dot;
        mins += i32::from(m) * (i32::from(x.bsums[2 * s]) + i32::from(x.bsums[2 * s + 1]));
    }
    (isum, mins)
}

/// The integer sums of a Q4_K block against a Q8_K block (see [`term_k`]).
pub fn isum_q4_k(w: &BlockQ4K, x: &BlockQ8K) -> (i32, i32) {
    isum_k_affine(&w.scales, &q4_k_codes(w), x)
}

/// The integer sums of a Q5_K block against a Q8_K block (see [`term_k`]).
pub fn isum_q5_k(w: &BlockQ5K, x: &BlockQ8K) -> (i32, i32) {
    isum_k_affine(&w.scales, &q5_k_codes(w), x)
}

/// One Q4_K/Q5_K block's term: `(d_x·d)·isum − (d_x·dmin)·mins`, GGML's order of operations.
#[inline]
pub fn term_k(d: f32, dmin: f32, dx: f32, (isum, mins): (i32, i32)) -> f32 {
    (dx * d) * isum as f32 - (dx * dmin) * mins as f32
}

/// Q4_K weights · Q8_K activations: [`term_k`] per block, in the order of [`BLOCK_LANES`].
pub fn dot_q4_k_q8_k_ref(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q4_k_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| {
        term_k(w.d.to_f32(), w.dmin.to_f32(), x.d, isum_q4_k(w, x))
    })
}

/// Q5_K weights · Q8_K activations: [`term_k`] per block, in the order of [`BLOCK_LANES`].
pub fn dot_q5_k_q8_k_ref(w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q5_k_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| {
        term_k(w.d.to_f32(), w.dmin.to_f32(), x.d, isum_q5_k(w, x))
    })
}

/// `Σ_s sc_s·(Σ_{j∈s} q_j·x_j − 32·bsum_s)` of a Q6_K block (codes 0..=63, sixteen
/// sub-blocks of 16) against a Q8_K block: the −32 offset applied through the block sums.
pub fn isum_q6_k(w: &BlockQ6K, x: &BlockQ8K) -> i32 {
    let q = q6_k_codes(w);
    (0..QK_K / 16)
        .map(|s| {
            let dot: i32 = q[16 * s..16 * s + 16]
                .iter()
                .zip(&x.qs[16 * s..16 * s + 16])
                .map(|(&q, &x)| i32::from(q) * i32::from(x))
                .sum();
            i32::from(w.scales[s]) * (dot - 32 * i32::from(x.bsums[s]))
        })
        .sum()
}

/// One Q6_K block's term: `(d_x·d)·isum`.
#[inline]
pub fn term_q6_k(d: f32, dx: f32, isum: i32) -> f32 {
    (dx * d) * isum as f32
}

/// Q6_K weights · Q8_K activations: [`term_q6_k`] per block, in the order of [`BLOCK_LANES`].
pub fn dot_q6_k_q8_k_ref(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q6_k_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| term_q6_k(w.d.to_f32(), x.d, isum_q6_k(w, x)))
}

/// `(Σ_s sc_s·Σ_{j∈s} q_j·x_j, Σ_s m_s·bsum_s)` of a Q2_K block (codes 0..=3, sixteen
/// sub-blocks of 16 with 4-bit scales `sc` and mins `m`) against a Q8_K block: the two exact
/// integer sums of GGML's `vec_dot_q2_K_q8_K`, whose term is [`term_k`]'s.
pub fn isum_q2_k(w: &BlockQ2K, x: &BlockQ8K) -> (i32, i32) {
    let q = q2_k_codes(w);
    let (mut isum, mut mins) = (0i32, 0i32);
    for (s, &sm) in w.scales.iter().enumerate() {
        let dot: i32 = q[16 * s..16 * s + 16]
            .iter()
            .zip(&x.qs[16 * s..16 * s + 16])
            .map(|(&q, &x)| i32::from(q) * i32::from(x))
            .sum();
        isum += i32::from(sm & 0x0f) * dot;
        mins += i32::from(sm >> 4) * i32::from(x.bsums[s]);
    }
    (isum, mins)
}

/// Q2_K weights · Q8_K activations: [`term_k`] per block, in the order of [`BLOCK_LANES`].
pub fn dot_q2_k_q8_k_ref(w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q2_k_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| {
        term_k(w.d.to_f32(), w.dmin.to_f32(), x.d, isum_q2_k(w, x))
    })
}

/// `Σ_s sc_s·(Σ_{j∈s} q_j·x_j − 4·bsum_s)` of a Q3_K block (codes 0..=7 standing for
/// `q − 4`, sixteen sub-blocks of 16 with signed 6-bit scales) against a Q8_K block: the −4
/// offset applied through the block sums, as Q6_K's −32.
pub fn isum_q3_k(w: &BlockQ3K, x: &BlockQ8K) -> i32 {
    let q = q3_k_codes(w);
    q3_k_scales(&w.scales)
        .iter()
        .enumerate()
        .map(|(s, &sc)| {
            let dot: i32 = q[16 * s..16 * s + 16]
                .iter()
                .zip(&x.qs[16 * s..16 * s + 16])
                .map(|(&q, &x)| i32::from(q) * i32::from(x))
                .sum();
            i32::from(sc) * (dot - 4 * i32::from(x.bsums[s]))
        })
        .sum()
}

/// Q3_K weights · Q8_K activations: [`term_q6_k`] (`(d_x·d)·isum`) per block, in the order of
/// [`BLOCK_LANES`].
pub fn dot_q3_k_q8_k_ref(w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_q3_k_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| term_q6_k(w.d.to_f32(), x.d, isum_q3_k(w, x)))
}

/// `Σ_j grid[q_j]·x_j` of sixteen bytes of IQ4 indices (weight `j` in the low nibble of byte
/// `j`, weight `j + 16` in the high one) against 32 activation codes (exact).
fn isum_iq4_32(qs: &[u8], x: &[i8]) -> i32 {
    let (lo, hi) = x.split_at(16);
    qs.iter()
        .zip(lo.iter().zip(hi))
        .map(|(&q, (&a, &b))| {
            i32::from(IQ4_GRID[usize::from(q & 0x0f)]) * i32::from(a)
                + i32::from(IQ4_GRID[usize::from(q >> 4)]) * i32::from(b)
        })
        .sum()
}

/// `Σ_j grid[q_j]·x_j` of an IQ4_NL block against a Q8_0 block (exact).
pub fn isum_iq4_nl(w: &BlockIQ4NL, x: &BlockQ8_0) -> i32 {
    isum_iq4_32(&w.qs, &x.qs)
}

/// IQ4_NL weights · Q8_0 activations: `isum·(d_w·d_x)` ([`term_q5_0`]) per block, in the order
/// of [`BLOCK_LANES`] (eight accumulators, as the K-quants: the SIMD tiers keep eight blocks'
/// terms in flight).
pub fn dot_iq4_nl_q8_0_ref(w: &[BlockIQ4NL], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_iq4_nl_q8_0: block count mismatch");
    lanes_dot(w, x, |w, x| {
        term_q5_0(w.d.to_f32(), x.d.to_f32(), isum_iq4_nl(w, x))
    })
}

/// IQ4_NL weights · Q8_0 activations block after block (`s + isum·(d_w·d_x)`, the order of
/// [`dot_q4_0_q8_0_ref`]): what the block lanes kernel ([`crate::Path::Lanes`]) gives a prefill
/// batch. The same terms as [`dot_iq4_nl_q8_0_ref`], summed in another order, so a token in
/// such a batch may differ from the same token alone in the last bits, as with Q4_0.
pub fn dot_iq4_nl_q8_0_seq_ref(w: &[BlockIQ4NL], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_iq4_nl_q8_0: block count mismatch");
    w.iter().zip(x).fold(0.0, |s, (w, x)| {
        s + term_q5_0(w.d.to_f32(), x.d.to_f32(), isum_iq4_nl(w, x))
    })
}

/// IQ4_XS sub-block `s`'s scale, `ls − 32` (−32..=31): the format crate's decoding of the
/// layout, which the lanes layouts ([`crate::klanes`]) read as well.
pub use kiln_format::iq4::iq4_xs_scale;

/// `Σ_s (ls_s − 32)·Σ_{j∈s} grid[q_j]·x_j` of an IQ4_XS block (eight sub-blocks of 32) against
/// a Q8_K block (exact).
pub fn isum_iq4_xs(w: &BlockIQ4XS, x: &BlockQ8K) -> i32 {
    (0..QK_K / 32)
        .map(|s| {
            iq4_xs_scale(w, s) * isum_iq4_32(&w.qs[16 * s..16 * s + 16], &x.qs[32 * s..32 * s + 32])
        })
        .sum()
}

/// IQ4_XS weights · Q8_K activations: `(d_x·d)·isum` ([`term_q6_k`]) per block, in the order
/// of [`BLOCK_LANES`].
pub fn dot_iq4_xs_q8_k_ref(w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot_iq4_xs_q8_k: block count mismatch");
    lanes_dot(w, x, |w, x| term_q6_k(w.d.to_f32(), x.d, isum_iq4_xs(w, x)))
}

/// Quantize activations to Q8_K blocks with GGML's rule
/// ([`kiln_format::kquants::quantize_block_q8_k_ref`]), into a caller's buffer: what the
/// K-quant products take. `x.len() == out.len() * 256`.
pub fn quantize_row_q8_k_act_ref(x: &[f32], out: &mut [BlockQ8K]) {
    assert_eq!(
        x.len(),
        out.len() * QK_K,
        "quantize_row_q8_k_act: x must hold 256 values per output block"
    );
    for (b, xs) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        *b = kiln_format::kquants::quantize_block_q8_k_ref(xs.try_into().expect("QK_K chunk"));
    }
}

/// HF `LlamaRMSNorm` in f32: `x / sqrt(mean(x²) + eps) * weight`.
pub fn rmsnorm_ref(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "rmsnorm: weight length mismatch");
    assert_eq!(x.len(), out.len(), "rmsnorm: output length mismatch");
    if x.is_empty() {
        return;
    }
    let ss = x.iter().fold(0.0f32, |s, v| s + v * v);
    // PyTorch: hidden_states * torch.rsqrt(variance + eps), then weight * (...)
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Numerically stable softmax in place (subtract the max first).
pub fn softmax_inplace_ref(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x[i] = e^(x[i] - shift)` in place, returning `Σ x[i]` (left to right): the exponentials
/// of one block of attention scores against a running maximum, and their sum, which is what
/// an online (flash-attention) softmax needs instead of a normalized row.
pub fn exp_sum_ref(x: &mut [f32], shift: f32) -> f32 {
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - shift).exp();
        sum += *v;
    }
    sum
}

/// `out = silu(gate) · up` with `silu(g) = g / (1 + e^-g)`.
pub fn silu_mul_ref(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: length mismatch");
    assert_eq!(gate.len(), out.len(), "silu_mul: output length mismatch");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

/// `out = gelu(x)`, PyTorch's exact GELU (`approximate="none"`, transformers' `gelu`):
/// `x · ½ · (1 + erf(x / √2))`, computed as `x · ½ · erfc(−x / √2)` in f64 with libm's
/// `erfc` and rounded once: within an f32 rounding of PyTorch's on every input, and right in
/// the far negative tail too, where `1 + erf` cancels (PyTorch's f32 gives −0 below about
/// −5.5, the true value being under 10⁻⁷ in size).
pub fn gelu_ref(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "gelu: output length mismatch");
    for (o, &v) in out.iter_mut().zip(x) {
        let v = f64::from(v);
        *o = (v * 0.5 * libm::erfc(-v * std::f64::consts::FRAC_1_SQRT_2)) as f32;
    }
}

/// `out = gelu_tanh(gate) · up`, PyTorch's `gelu(approximate="tanh")` (transformers'
/// `gelu_pytorch_tanh`) in f32 as its CPU kernel computes it:
/// `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`.
pub fn gelu_tanh_mul_ref(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "gelu_tanh_mul: length mismatch");
    assert_eq!(
        gate.len(),
        out.len(),
        "gelu_tanh_mul: output length mismatch"
    );
    // M_SQRT2 * M_2_SQRTPI * 0.5, rounded to f32 as PyTorch's `const float kBeta` is.
    const BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const KAPPA: f32 = 0.044715;
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let inner = BETA * (g + KAPPA * (g * g * g));
        *o = 0.5 * g * (1.0 + inner.tanh()) * u;
    }
}

/// `out[i] = w[i]` widened from f16 to f32 (exact).
pub fn widen_f16_ref(w: &[f16], out: &mut [f32]) {
    assert_eq!(w.len(), out.len(), "widen_f16: length mismatch");
    for (o, w) in out.iter_mut().zip(w) {
        *o = w.to_f32();
    }
}

/// Little-endian bf16 bytes to f32: `out[i]` from bytes `2i, 2i + 1` (`half`'s widening,
/// which sets the quiet bit of a NaN, as the format crate's decoding does). A trailing odd
/// byte is ignored. Panics unless `out.len() == bytes.len() / 2`.
pub fn decode_bf16_ref(bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        out.len(),
        bytes.len() / 2,
        "decode_bf16: one output per two bytes"
    );
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
    }
}

/// Quantize `x` (whole blocks of a block type of one row, rows laid end to end) with GGML's
/// reference rule, appending the blocks' bytes to `out` and the round trip (`x` against its
/// dequantized blocks) to `stats` with [`ErrorStats::add`], block by block: Q8_0 and Q4_0,
/// the types the SIMD tiers have a fused loop for, with the format crate's block functions
/// ([`kiln_format::blocks::quantize_block_q8_0_ref`],
/// [`kiln_format::blocks::quantize_block_q4_0_ref`]), which define every input's bits; every
/// other type through its row of the block-type table ([`kiln_format::BlockKind`]).
///
/// `Err(b)` when block `b`'s scales are not finite in f16 (its largest magnitude is beyond
/// what the format can scale); blocks before it have been written and counted, and callers
/// discard the partial output.
///
/// # Panics
/// If `dtype` is not a block type of one row, `x` is not whole blocks, or, for the types
/// other than Q8_0 and Q4_0, `x` holds NaN or an infinity (their rows reject them).
pub fn quantize_blocks_ref(
    dtype: DType,
    x: &[f32],
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    crate::shape::quantize_blocks_shape(dtype, x);
    if !matches!(dtype, DType::Q8_0 | DType::Q4_0) {
        return quantize_blocks_by_row(dtype.block(), x, out, stats);
    }
    let mut y = [0.0f32; QK];
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let xb: &[f32; QK] = xb.try_into().expect("QK chunk");
        let d = if dtype == DType::Q8_0 {
            let block = kiln_format::blocks::quantize_block_q8_0_ref(xb);
            kiln_format::blocks::dequantize_block_q8_0(&block, &mut y);
            out.extend_from_slice(bytemuck::bytes_of(&block));
            block.d
        } else {
            let block = kiln_format::blocks::quantize_block_q4_0_ref(xb);
            kiln_format::blocks::dequantize_block_q4_0(&block, &mut y);
            out.extend_from_slice(bytemuck::bytes_of(&block));
            block.d
        };
        if !d.is_finite() {
            return Err(b);
        }
        stats.add(xb, &y);
    }
    Ok(())
}

/// [`quantize_blocks_ref`] for a type without a fused loop: the row's reference rule over
/// all of `x`, then the blocks before the first with a non-finite scale dequantized and
/// counted.
fn quantize_blocks_by_row(
    kind: &kiln_format::BlockKind,
    x: &[f32],
    out: &mut Vec<u8>,
    stats: &mut ErrorStats,
) -> Result<(), usize> {
    let start = out.len();
    kind.quantize_ref(x, x.len(), out)
        .expect("finite values: the caller checks them");
    let units = &out[start..];
    let bad = units
        .chunks_exact(kind.bytes)
        .position(|u| !kind.scales_finite(u));
    let good = bad.unwrap_or(x.len() / kind.weights);
    let mut y = vec![0.0f32; good * kind.weights];
    kind.dequantize(&units[..good * kind.bytes], kind.weights, &mut y);
    stats.add(&x[..y.len()], &y);
    bad.map_or(Ok(()), Err)
}
