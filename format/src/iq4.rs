//! GGML's non-linear 4-bit types: IQ4_NL (blocks of 32 weights, one f16 scale) and IQ4_XS
//! (256-weight super-blocks with 6-bit sub-block scales), both decoding a 4-bit index through
//! GGML's sixteen-value grid [`IQ4_GRID`]: `w = d·grid[q]` (IQ4_NL), `w = d·(ls − 32)·grid[q]`
//! (IQ4_XS, `ls` the 32-weight sub-block's 6-bit scale).

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::blocks::{check_finite, BlockQ4_0, BlockQ4_0x16, GROUP_ROWS, QK};
use crate::error::{FormatError, Result};
use crate::kquants::{check_importance, nearest_int, GROUP_MAX_EPS, QK_K};

/// GGML's `kvalues_iq4nl`: the sixteen values a 4-bit index decodes to, before the scale.
/// Denser near zero, where most weights are.
pub const IQ4_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// One IQ4_NL block, GGML's `block_iq4_nl` byte for byte (18 bytes, 4.5 bits a weight).
///
/// Weight `j` < 16 is the low nibble of `qs[j]`, weight `j + 16` its high nibble (as Q4_0).
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4NL {
    /// Scale.
    pub d: f16,
    /// Grid indices.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == 18);

/// Block `b` of sixteen consecutive rows of an IQ4_NL matrix, interleaved exactly as
/// [`BlockQ4_0x16`] interleaves Q4_0 (the two blocks share their layout: an f16 scale, then
/// sixteen bytes of nibbles in the same order), 288 bytes.
///
/// Why: the same as for Q4_0. A one-token product over plain IQ4_NL rows reduces every row's
/// eight block sums across a vector and gathers each block's scale; with sixteen rows
/// interleaved a 32-bit lane is a row, and one table lookup turns four nibbles of every row
/// into grid values at once. The indices themselves are GGML's, byte for byte.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4NLx16 {
    /// Row `r`'s scale.
    pub d: [f16; GROUP_ROWS],
    /// The rows' packed indices, interleaved four bytes at a time (as [`BlockQ4_0x16::qs`]).
    pub qs: [u8; GROUP_ROWS * QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockIQ4NLx16>() == std::mem::size_of::<BlockQ4_0x16>());
const _: () =
    assert!(std::mem::align_of::<BlockIQ4NLx16>() == std::mem::align_of::<BlockQ4_0x16>());

impl BlockIQ4NLx16 {
    /// Interleave one block of each of sixteen rows.
    pub fn from_rows(rows: &[BlockIQ4NL; GROUP_ROWS]) -> BlockIQ4NLx16 {
        let q4: [BlockQ4_0; GROUP_ROWS] = bytemuck::cast(*rows);
        bytemuck::cast(BlockQ4_0x16::from_rows(&q4))
    }

    /// Row `r`'s block.
    #[inline]
    pub fn row(&self, r: usize) -> BlockIQ4NL {
        bytemuck::cast(self.as_nibbles().row(r))
    }

    /// The same bytes seen as a Q4_0 group: what the code that only moves nibbles and scales
    /// (interleaving, unpacking a row) shares between the two layouts.
    #[inline]
    pub fn as_nibbles(&self) -> &BlockQ4_0x16 {
        bytemuck::cast_ref(self)
    }
}

/// Interleave a row-major IQ4_NL matrix of `blocks.len() / nb` rows (a multiple of 16) and
/// `nb` blocks per row: group `g·nb + b` is block `b` of rows `16g..16g + 16`.
pub fn interleave_iq4_nl(blocks: &[BlockIQ4NL], nb: usize) -> Vec<BlockIQ4NLx16> {
    let groups = crate::blocks::interleave_q4_0(bytemuck::cast_slice(blocks), nb);
    bytemuck::pod_collect_to_vec(&groups)
}

/// The row-major IQ4_NL blocks of an interleaved matrix with `nb` blocks per row (the inverse
/// of [`interleave_iq4_nl`]).
pub fn deinterleave_iq4_nlx16(groups: &[BlockIQ4NLx16], nb: usize) -> Vec<BlockIQ4NL> {
    let rows = crate::blocks::deinterleave_q4_0x16(bytemuck::cast_slice(groups), nb);
    bytemuck::pod_collect_to_vec(&rows)
}

/// One IQ4_XS super-block, GGML's `block_iq4_xs` byte for byte (136 bytes, 4.25 bits a
/// weight).
///
/// Sub-block `s` (of eight, 32 weights each) has the 6-bit scale `ls = (scales_l[s / 2] >> 4·(s
/// % 2)) & 15 | ((scales_h >> 2s) & 3) << 4`; its weights take `qs[16s..16s + 16]` as IQ4_NL's.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4XS {
    /// Super-block scale.
    pub d: f16,
    /// High two bits of each sub-block scale.
    pub scales_h: u16,
    /// Low four bits of each sub-block scale.
    pub scales_l: [u8; QK_K / 64],
    /// Grid indices.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(std::mem::size_of::<BlockIQ4XS>() == 136);

/// Super-block `b` of sixteen consecutive rows of an IQ4_XS matrix, interleaved (2176 bytes,
/// the size of the sixteen super-blocks it holds): the rows' scales field by field, then each
/// 32-weight sub-block's indices in [`BlockQ4_0x16`]'s order.
///
/// Why: as for IQ4_NL ([`BlockIQ4NLx16`]). A one-token product over plain IQ4_XS rows reads
/// sixteen row streams a super-block at a time and reduces every row's sums across a vector;
/// here a 32-bit lane is a row, one load gives four indices of eight rows, and a sub-block's
/// sixteen 6-bit scales unpack in two vectors. Every field is GGML's, byte for byte, only in
/// another order.
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIQ4XSx16 {
    /// Row `r`'s super-block scale.
    pub d: [f16; GROUP_ROWS],
    /// Row `r`'s `scales_h`.
    pub scales_h: [u16; GROUP_ROWS],
    /// Row `r`'s `scales_l`.
    pub scales_l: [[u8; QK_K / 64]; GROUP_ROWS],
    /// Sub-block `s`'s indices of the sixteen rows, interleaved four bytes at a time (as
    /// [`BlockQ4_0x16::qs`]).
    pub qs: [[u8; GROUP_ROWS * QK / 2]; QK_K / QK],
}

const _: () = assert!(std::mem::size_of::<BlockIQ4XSx16>() == GROUP_ROWS * 136);
const _: () = assert!(std::mem::align_of::<BlockIQ4XSx16>() == 2);

impl BlockIQ4XSx16 {
    /// Interleave one super-block of each of sixteen rows.
    pub fn from_rows(rows: &[BlockIQ4XS; GROUP_ROWS]) -> BlockIQ4XSx16 {
        BlockIQ4XSx16 {
            d: std::array::from_fn(|r| rows[r].d),
            scales_h: std::array::from_fn(|r| rows[r].scales_h),
            scales_l: std::array::from_fn(|r| rows[r].scales_l),
            qs: std::array::from_fn(|s| {
                crate::blocks::interleave_nibbles(&std::array::from_fn(|r| {
                    rows[r].qs[16 * s..16 * s + 16]
                        .try_into()
                        .expect("16 bytes")
                }))
            }),
        }
    }

    /// Row `r`'s super-block.
    pub fn row(&self, r: usize) -> BlockIQ4XS {
        let mut qs = [0u8; QK_K / 2];
        for (s, sub) in self.qs.iter().enumerate() {
            qs[16 * s..16 * s + 16].copy_from_slice(&crate::blocks::row_nibbles(sub, r));
        }
        BlockIQ4XS {
            d: self.d[r],
            scales_h: self.scales_h[r],
            scales_l: self.scales_l[r],
            qs,
        }
    }
}

/// Interleave a row-major IQ4_XS matrix of `blocks.len() / nb` rows (a multiple of 16) and
/// `nb` super-blocks per row: group `g·nb + b` is super-block `b` of rows `16g..16g + 16`.
pub fn interleave_iq4_xs(blocks: &[BlockIQ4XS], nb: usize) -> Vec<BlockIQ4XSx16> {
    crate::blocks::interleave_groups(blocks, nb, BlockIQ4XSx16::from_rows)
}

/// The row-major IQ4_XS super-blocks of an interleaved matrix with `nb` super-blocks per row
/// (the inverse of [`interleave_iq4_xs`]).
pub fn deinterleave_iq4_xsx16(groups: &[BlockIQ4XSx16], nb: usize) -> Vec<BlockIQ4XS> {
    crate::blocks::deinterleave_groups(groups, nb, BlockIQ4XSx16::row)
}

// ---------------------------------------------------------------------------------------------
// Quantizers: GGML's `quantize_row_iq4_nl_impl`, bit for bit.
//
// As for the K-quants (`kquants/quantize.rs`): f32 sums accumulated in GGML's loop order,
// products in GGML's association (`w*q*x` is `(w*q)*x`), no fused multiply-add, GGML's
// `nearest_int` and `best_index_int8` (ties to the upper index). Checked byte for byte against
// GGML (`format/tests/ggml_iq4.rs`).
// ---------------------------------------------------------------------------------------------

/// GGML's `ntry` for `quantize_iq4_nl`/`quantize_iq4_xs`: the scale search tries
/// `(itry − 127) / max` for `itry` in `−7..=7`.
const NTRY: i32 = 7;

/// GGML's `best_index_int8` over [`IQ4_GRID`]: the index of the grid value nearest `x`, the
/// upper one on a tie (and 15 for NaN, where every comparison fails).
#[inline]
fn best_index(x: f32) -> u8 {
    let val = &IQ4_GRID;
    if x <= f32::from(val[0]) {
        return 0;
    }
    if x >= f32::from(val[15]) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < f32::from(val[mav]) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - f32::from(val[mu - 1]) < f32::from(val[mu]) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// `Σ w·q·x` and `Σ w·q²` of `x` coded at inverse scale `id`, in GGML's order.
#[inline]
fn fit(xb: &[f32; 32], weight: &[f32; 32], id: f32) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for j in 0..32 {
        let idx = best_index(id * xb[j]);
        let q = f32::from(IQ4_GRID[usize::from(idx)]);
        let w = weight[j];
        sumqx += w * q * xb[j];
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// The per-block part of `quantize_row_iq4_nl_impl`: the scale of one 32-weight block, the one
/// of fifteen candidates (and the first fit) with the largest `(Σwqx)²/Σwq²`. `None` for a block
/// whose magnitudes are all below [`GROUP_MAX_EPS`] (GGML leaves its scale 0). GGML writes
/// the first fit's codes too, but both callers re-derive every code from the final scale.
fn block_scale(xb: &[f32; 32], weight: &[f32; 32]) -> Option<f32> {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let v0 = f32::from(IQ4_GRID[0]);
    let d = -max / v0;
    let (sumqx, sumq2) = fit(xb, weight, 1.0 / d);
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let id = (itry + i32::from(IQ4_GRID[0])) as f32 / max;
        let (sumqx, sumq2) = fit(xb, weight, id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// GGML's per-value weights for one 32-weight block: `x²` without importance, else
/// `qw·√(σ² + x²)` with `σ²` twice the mean square over the whole (super-)block.
fn block_weights(xb: &[f32; 32], qw: Option<(&[f32], f32)>) -> [f32; 32] {
    let mut weight = [0.0f32; 32];
    match qw {
        Some((qw, sigma2)) => {
            for j in 0..32 {
                weight[j] = qw[j] * (sigma2 + xb[j] * xb[j]).sqrt();
            }
        }
        None => {
            for j in 0..32 {
                weight[j] = xb[j] * xb[j];
            }
        }
    }
    weight
}

/// GGML's `sigma2`: `Σx² · (2 / n)`.
fn sigma2(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for &v in x {
        s += v * v;
    }
    s * (2.0 / x.len() as f32)
}

/// Pack 32 codes as GGML does: weight `j` in the low nibble of byte `j`, `j + 16` in the high.
#[inline]
fn pack32(l: &[u8; 32]) -> [u8; 16] {
    std::array::from_fn(|j| l[j] | (l[j + 16] << 4))
}

/// The 32 codes of 16 packed bytes, in weight order (inverse of [`pack32`]).
#[inline]
fn unpack32(qs: &[u8]) -> [u8; 32] {
    std::array::from_fn(|j| if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 })
}

fn as32<T>(x: &[T]) -> &[T; 32] {
    x.try_into().expect("a 32-value block")
}

fn quantize_block_iq4_nl(x: &[f32; QK], qw: Option<&[f32]>) -> BlockIQ4NL {
    let weight = block_weights(x, qw.map(|qw| (qw, sigma2(x))));
    // GGML codes with the f32 scale, then stores it rounded to f16 (no re-fit to the f16).
    let scale = block_scale(x, &weight).unwrap_or(0.0);
    let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let l: [u8; 32] = std::array::from_fn(|j| best_index(id * x[j]));
    BlockIQ4NL {
        d: f16::from_f32(scale),
        qs: pack32(&l),
    }
}

fn quantize_block_iq4_xs(x: &[f32; QK_K], qw: Option<&[f32; QK_K]>) -> BlockIQ4XS {
    let s2 = qw.map(|_| sigma2(x));
    let mut scales = [0.0f32; QK_K / 32];
    let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let xb = as32(xb);
        let w = qw.zip(s2).map(|(qw, s2)| (&qw[32 * ib..32 * ib + 32], s2));
        let Some(d) = block_scale(xb, &block_weights(xb, w)) else {
            continue;
        };
        scales[ib] = d;
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let mut b = BlockIQ4XS::zeroed();
    let (d, ls) = encode_iq4_xs_scales(max_scale, &scales);
    store_iq4_xs_scales(&mut b, d, &ls);
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        // Codes from the f32 super-block scale times the integer sub-block scale.
        let dl = d * ls[ib] as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        let codes: [u8; 32] = std::array::from_fn(|j| best_index(idl * xb[j]));
        b.qs[16 * ib..16 * ib + 16].copy_from_slice(&pack32(&codes));
    }
    b
}

/// GGML's encoding of eight sub-block scales: the super-block scale (as f32, before its f16
/// rounding) and each sub-block's `ls − 32`. `max_scale` is the scale of largest magnitude.
fn encode_iq4_xs_scales(max_scale: f32, scales: &[f32; QK_K / 32]) -> (f32, [i32; QK_K / 32]) {
    // The largest-magnitude sub-block scale maps to ls − 32 = −32 (the sign flip gains the
    // 6-bit range's extra negative step); an all-zero super-block stores d = −0.
    let d = -max_scale / 32.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, scales.map(|s| nearest_int(id * s).clamp(-32, 31)))
}

fn store_iq4_xs_scales(b: &mut BlockIQ4XS, d: f32, l: &[i32; QK_K / 32]) {
    b.d = f16::from_f32(d);
    (b.scales_h, b.scales_l) = (0, [0; QK_K / 64]);
    for (ib, &l) in l.iter().enumerate() {
        let ls = (l + 32) as u8;
        b.scales_l[ib / 2] |= (ls & 15) << (4 * (ib % 2));
        b.scales_h |= u16::from(ls >> 4) << (2 * ib);
    }
}

/// Store eight sub-block scales (the products `d·(ls − 32)` the grids should have) by GGML's
/// encoding, keeping the codes: the one of largest magnitude is stored as `−32·d`, the others
/// rounded to the nearest multiple of `d`.
pub fn set_iq4_xs_scales(b: &mut BlockIQ4XS, scales: &[f32; QK_K / 32]) {
    let max_scale = scales
        .iter()
        .copied()
        .fold(0.0f32, |m, s| if s.abs() > m.abs() { s } else { m });
    let (d, ls) = encode_iq4_xs_scales(max_scale, scales);
    store_iq4_xs_scales(b, d, &ls);
}

fn check_row(x: &[f32], block: usize) -> Result<()> {
    check_finite(x)?;
    if !x.len().is_multiple_of(block) {
        return Err(FormatError::RowLength {
            len: x.len(),
            block,
        });
    }
    Ok(())
}

/// GGML's IQ4_NL quantizer without an importance matrix (`quantize_iq4_nl(…, NULL)`, what
/// `llama-quantize` without `--imatrix` runs). GGML's own `quantize_row_iq4_nl_ref` differs:
/// it skips the scale search and the final re-coding (`ntry = −1`); GGUF files hold this one.
///
/// Rejects NaN/Inf and lengths that are not a multiple of 32.
pub fn quantize_row_iq4_nl_ref(x: &[f32]) -> Result<Vec<BlockIQ4NL>> {
    check_row(x, QK)?;
    Ok(x.chunks_exact(QK)
        .map(|c| quantize_block_iq4_nl(as32(c), None))
        .collect())
}

/// GGML's `quantize_iq4_nl` given an importance matrix, one row.
///
/// Rejects NaN/Inf, lengths that are not a multiple of 32, and importance of another length
/// or with negative or non-finite values.
pub fn quantize_row_iq4_nl_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockIQ4NL>> {
    check_row(x, QK)?;
    check_importance(qw, x.len())?;
    Ok(x.chunks_exact(QK)
        .zip(qw.chunks_exact(QK))
        .map(|(c, w)| quantize_block_iq4_nl(as32(c), Some(w)))
        .collect())
}

/// The 32 grid indices of an IQ4_NL block, in weight order.
pub fn iq4_nl_codes(b: &BlockIQ4NL) -> [u8; QK] {
    unpack32(&b.qs)
}

/// An IQ4_NL block's packed codes from its 32 grid indices in weight order (each below 16).
pub fn pack_iq4_nl_codes(q: &[u8; QK]) -> [u8; QK / 2] {
    pack32(q)
}

/// GGML's `dequantize_row_iq4_nl` (`out.len() == blocks.len() * 32`).
pub fn dequantize_row_iq4_nl(blocks: &[BlockIQ4NL], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, q) in o.iter_mut().zip(iq4_nl_codes(b)) {
            *o = d * f32::from(IQ4_GRID[usize::from(q)]);
        }
    }
}

/// GGML's IQ4_XS quantizer without an importance matrix (`quantize_iq4_xs(…, NULL)`, which is
/// also GGML's `quantize_row_iq4_xs_ref`).
///
/// Rejects NaN/Inf and lengths that are not a multiple of 256.
pub fn quantize_row_iq4_xs_ref(x: &[f32]) -> Result<Vec<BlockIQ4XS>> {
    check_row(x, QK_K)?;
    Ok(x.chunks_exact(QK_K)
        .map(|c| quantize_block_iq4_xs(c.try_into().expect("a super-block"), None))
        .collect())
}

/// GGML's `quantize_iq4_xs` given an importance matrix, one row.
///
/// Rejects NaN/Inf, lengths that are not a multiple of 256, and importance of another length
/// or with negative or non-finite values.
pub fn quantize_row_iq4_xs_weighted(x: &[f32], qw: &[f32]) -> Result<Vec<BlockIQ4XS>> {
    check_row(x, QK_K)?;
    check_importance(qw, x.len())?;
    Ok(x.chunks_exact(QK_K)
        .zip(qw.chunks_exact(QK_K))
        .map(|(c, w)| {
            quantize_block_iq4_xs(
                c.try_into().expect("a super-block"),
                Some(w.try_into().expect("a super-block's weights")),
            )
        })
        .collect())
}

/// Sub-block `s`'s signed scale `ls − 32` (in `−32..=31`): its weights are `d·(ls − 32)·grid[q]`.
#[inline]
pub fn iq4_xs_scale(b: &BlockIQ4XS, s: usize) -> i32 {
    let lo = (b.scales_l[s / 2] >> (4 * (s % 2))) & 15;
    let hi = ((b.scales_h >> (2 * s)) & 3) as u8;
    i32::from(lo | (hi << 4)) - 32
}

/// The 256 grid indices of an IQ4_XS super-block, in weight order.
pub fn iq4_xs_codes(b: &BlockIQ4XS) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (s, c) in q.chunks_exact_mut(32).enumerate() {
        c.copy_from_slice(&unpack32(&b.qs[16 * s..16 * s + 16]));
    }
    q
}

/// An IQ4_XS super-block's packed codes from its 256 grid indices in weight order (each
/// below 16).
pub fn pack_iq4_xs_codes(q: &[u8; QK_K]) -> [u8; QK_K / 2] {
    let mut qs = [0u8; QK_K / 2];
    for (dst, c) in qs.chunks_exact_mut(16).zip(q.chunks_exact(32)) {
        dst.copy_from_slice(&pack32(as32(c)));
    }
    qs
}

/// GGML's `dequantize_row_iq4_xs` (`out.len() == blocks.len() * 256`).
pub fn dequantize_row_iq4_xs(blocks: &[BlockIQ4XS], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * QK_K, "output length mismatch");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let q = iq4_xs_codes(b);
        for (s, (o, q)) in o.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let dl = d * iq4_xs_scale(b, s) as f32;
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * f32::from(IQ4_GRID[usize::from(q)]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `iq4_xsx16` bytes are docs/FORMAT.md's: each field of the sixteen super-blocks
    /// together, then sub-block `s`'s indices with bytes `4i..4i + 4` of row `r` at
    /// `64i + 4r`; and interleaving a matrix and back gives its super-blocks.
    #[test]
    fn iq4_xsx16_bytes_are_the_documented_layout() {
        let nb = 2;
        let rows: Vec<BlockIQ4XS> = (0..GROUP_ROWS * nb)
            .map(|k| {
                let mut b = BlockIQ4XS::zeroed();
                b.d = f16::from_f32(k as f32);
                b.scales_h = 1000 + k as u16;
                b.scales_l = std::array::from_fn(|j| (10 * k + j) as u8);
                b.qs = std::array::from_fn(|j| (k * 7 + j * 3) as u8);
                b
            })
            .collect();
        let groups = interleave_iq4_xs(&rows, nb);
        assert_eq!(groups.len(), nb);
        for (b, g) in groups.iter().enumerate() {
            let bytes: &[u8] = bytemuck::bytes_of(g);
            for r in 0..GROUP_ROWS {
                let s_r = &rows[r * nb + b];
                assert_eq!(&bytes[2 * r..2 * r + 2], &s_r.d.to_le_bytes());
                assert_eq!(&bytes[32 + 2 * r..34 + 2 * r], &s_r.scales_h.to_le_bytes());
                assert_eq!(&bytes[64 + 4 * r..68 + 4 * r], &s_r.scales_l);
                for s in 0..8 {
                    for i in 0..4 {
                        let at = 128 + 256 * s + 64 * i + 4 * r;
                        let from = 16 * s + 4 * i;
                        assert_eq!(&bytes[at..at + 4], &s_r.qs[from..from + 4]);
                    }
                }
            }
        }
        assert_eq!(deinterleave_iq4_xsx16(&groups, nb), rows);
    }

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37).sin()).collect()
    }

    #[test]
    fn rejects_non_finite_values() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = ramp(QK_K);
            x[77] = bad;
            let w = vec![1.0; QK_K];
            for e in [
                quantize_row_iq4_nl_ref(&x).err(),
                quantize_row_iq4_nl_weighted(&x, &w).err(),
            ]
            .into_iter()
            .chain([
                quantize_row_iq4_xs_ref(&x).err(),
                quantize_row_iq4_xs_weighted(&x, &w).err(),
            ]) {
                assert!(
                    matches!(e, Some(FormatError::NonFinite { position: 77, .. })),
                    "{e:?}"
                );
            }
        }
    }

    #[test]
    fn rejects_rows_that_are_not_whole_blocks() {
        let x = ramp(QK_K + QK);
        let w = vec![1.0; x.len()];
        assert!(matches!(
            quantize_row_iq4_nl_ref(&x[..33]),
            Err(FormatError::RowLength { len: 33, block: 32 })
        ));
        assert!(matches!(
            quantize_row_iq4_nl_weighted(&x[..33], &w[..33]),
            Err(FormatError::RowLength { len: 33, block: 32 })
        ));
        for e in [
            quantize_row_iq4_xs_ref(&x).err(),
            quantize_row_iq4_xs_weighted(&x, &w).err(),
        ] {
            assert!(
                matches!(
                    e,
                    Some(FormatError::RowLength {
                        len: 288,
                        block: 256
                    })
                ),
                "{e:?}"
            );
        }
        // Whole IQ4_NL blocks are fine, and an empty row is no blocks.
        assert_eq!(quantize_row_iq4_nl_ref(&x).unwrap().len(), 9);
        assert!(quantize_row_iq4_xs_ref(&[]).unwrap().is_empty());
    }

    #[test]
    fn rejects_bad_importance() {
        let x = ramp(QK_K);
        let short = vec![1.0; QK_K - 1];
        assert!(matches!(
            quantize_row_iq4_nl_weighted(&x, &short),
            Err(FormatError::ImportanceLength {
                len: 255,
                expected: 256
            })
        ));
        assert!(matches!(
            quantize_row_iq4_xs_weighted(&x, &short),
            Err(FormatError::ImportanceLength {
                len: 255,
                expected: 256
            })
        ));
        for bad in [-1.0, f32::NAN, f32::INFINITY] {
            let mut w = vec![1.0; QK_K];
            w[5] = bad;
            assert!(matches!(
                quantize_row_iq4_nl_weighted(&x, &w),
                Err(FormatError::BadImportance { position: 5, .. })
            ));
            assert!(matches!(
                quantize_row_iq4_xs_weighted(&x, &w),
                Err(FormatError::BadImportance { position: 5, .. })
            ));
        }
    }

    #[test]
    fn best_index_takes_the_upper_index_on_ties() {
        assert_eq!(best_index(-1000.0), 0);
        assert_eq!(best_index(1000.0), 15);
        assert_eq!(best_index(0.0), 8); // −10 and 1: 1 is nearer
        assert_eq!(best_index(-4.5), 8); // halfway between −10 and 1
        assert_eq!(best_index(-4.6), 7);
        assert_eq!(best_index(101.0), 15); // halfway between 89 and 113
        for (i, &g) in IQ4_GRID.iter().enumerate() {
            assert_eq!(usize::from(best_index(f32::from(g))), i);
        }
    }

    #[test]
    fn zero_rows_code_to_the_index_nearest_zero() {
        let nl = quantize_row_iq4_nl_ref(&[0.0; QK]).unwrap();
        assert_eq!(nl[0].d.to_bits(), 0);
        assert_eq!(iq4_nl_codes(&nl[0]), [8; QK]);
        // GGML's super-block scale is −max/32: −0 for an all-zero super-block, whose
        // sub-block scales are then all 0 (stored ls = 32).
        let xs = quantize_row_iq4_xs_ref(&[0.0; QK_K]).unwrap();
        assert_eq!(xs[0].d.to_bits(), 0x8000);
        assert_eq!(iq4_xs_codes(&xs[0]), [8; QK_K]);
        assert!((0..8).all(|s| iq4_xs_scale(&xs[0], s) == 0));
    }

    #[test]
    fn codes_and_scales_round_trip_through_packing() {
        let mut b = BlockIQ4XS::zeroed();
        let codes: [u8; QK_K] = std::array::from_fn(|i| (i * 7 % 16) as u8);
        for (s, c) in codes.chunks_exact(32).enumerate() {
            b.qs[16 * s..16 * s + 16].copy_from_slice(&pack32(c.try_into().unwrap()));
            let ls = (s * 9 + 5) as u8 % 64;
            b.scales_l[s / 2] |= (ls & 15) << (4 * (s % 2));
            b.scales_h |= u16::from(ls >> 4) << (2 * s);
        }
        assert_eq!(iq4_xs_codes(&b), codes);
        for s in 0..8 {
            assert_eq!(iq4_xs_scale(&b, s), ((s * 9 + 5) % 64) as i32 - 32);
        }
    }

    #[test]
    fn quantization_is_close() {
        // Half the grid's widest gap (24·d, d ≈ max/113) is about 0.1 here; allow some slack
        // for the scale search trading the extremes for the bulk.
        let x = ramp(4 * QK_K);
        let w: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 5) as f32).collect();
        let mut out = vec![0.0; x.len()];
        let worst = |out: &[f32]| {
            x.iter()
                .zip(out)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        };
        dequantize_row_iq4_nl(&quantize_row_iq4_nl_weighted(&x, &w).unwrap(), &mut out);
        let nl = worst(&out);
        dequantize_row_iq4_xs(&quantize_row_iq4_xs_weighted(&x, &w).unwrap(), &mut out);
        let xs = worst(&out);
        assert!(nl < 0.15 && xs < 0.15, "{nl} {xs}");
    }
}
