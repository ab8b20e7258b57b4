//! Error-compensating rounding (the idea of GPTQ/OBQ) inside GGML's exact block layouts.
//!
//! The quantity that matters is a matrix's output error over real inputs,
//! `E‖(W − Ŵ)·x‖² = Σ_r (w_r − ŵ_r)ᵀ·H·(w_r − ŵ_r)` with `H = E[x·xᵀ]` measured by calibration.
//! Rounding every weight to its nearest code ignores `H`'s off-diagonal terms: the errors of
//! correlated columns add up. Instead, the columns of each row are rounded one at a time, and
//! the error made on a column is pushed onto the columns not yet rounded, in the proportions
//! that cancel it best through `H`. With `U` the upper Cholesky factor of `H⁻¹`
//! (`H⁻¹ = Uᵀ·U`, rows and columns in processing order), rounding column `i` with error
//! `e = (w_i − ŵ_i) / U_ii` updates `w_k −= e·U_ik` for every later `k`. Rows are independent,
//! so they run in parallel.
//!
//! Two choices, each measured on SmolLM2-135M Q4_0 (mean KL-divergence against F32 on held-out
//! text, calibrated on different text; see docs/ACCURACY.md):
//!
//! - **Order**: columns are rounded largest `H_jj` first, so the columns that matter most are
//!   rounded while the most columns remain to absorb their error (0.173 → 0.145 against
//!   rounding in storage order with scales picked block by block as the row is reached).
//! - **Scales**: GGML's layout fixes one f16 scale per 32 consecutive columns, but the
//!   processing order visits a block's columns far apart. So every block's scale is chosen up
//!   front from the row's original values, by the importance-weighted scale search
//!   ([`crate::method`], weights `H_jj`), and the compensated rounding then picks the codes.
//!   Fitting the scales again to the values the rounding aimed at (each column's value with
//!   the errors pushed onto it), weighted by `H`'s diagonal alone, lowers the calibration's
//!   error but not the held-out one (SmolLM2's `iq4_nl_mix` went from 0.0826 to 0.0906 on a
//!   literary text; damping 0.25 without shrinkage). What does help is fitting them, once the
//!   codes are fixed, to the row's original values through the whole regularised `H`
//!   ([`crate::refit`], for the types whose layouts can store new scales: IQ4_NL and IQ4_XS).
//!   Chosen on calibration data alone (the statistics of the first 12 288 tokens of
//!   `fixtures/text/calibration-mixed.txt`, measured on its last 44 KB, which they do not
//!   reach; SmolLM2-135M): `iq4_nl_mix` 0.0571 → 0.0551, `iq4_xs_mix` 0.0597 → 0.0580.
//!
//! `H`'s off-diagonal terms are shrunk towards zero by [`SHRINK`] (`(1 − α)·H + α·diag(H)`),
//! so the compensation leans less on correlations that only the calibration text has; it is
//! then damped (`H + λ·I`, `λ` = [`DAMP`] of its mean diagonal, raised tenfold until the
//! Cholesky factorization succeeds) and columns that calibration never excited get a unit
//! diagonal, so they are rounded plainly. The output is an ordinary Q4_0/Q8_0 tensor: any
//! reader, the runner and llama.cpp use it unchanged.

use half::f16;
use kiln_format::blocks::{BlockQ4_0, BlockQ8_0, QK};
use kiln_format::DType;
use rayon::prelude::*;
use std::sync::Arc;

use crate::method::{quantize_block_q4_0, quantize_block_q8_0, Method};

/// Initial damping, as a fraction of the mean diagonal of `H`. Chosen with [`SHRINK`], on
/// calibration data alone: quantized from the statistics of the first 12 288 tokens of
/// `fixtures/text/calibration-mixed.txt`, measured on the following, unused part of it (mean
/// KL-divergence against F32, SmolLM2-135M, `SHRINK` 0.15): `iq4_nl_mix` 0.02 → 0.0552,
/// 0.05 → 0.0563, 0.1 → 0.0577, 0.25 → 0.0613, 0.5 → 0.0665; `q3_k_m` 0.05 → 0.0463,
/// 0.1 → 0.0464, 0.25 → 0.0494; `q4_0` 0.1032 at 0.05, against 0.1346 with the earlier
/// setting (damping 0.25, no shrinkage). 0.02 is lower still on `iq4_nl_mix` by 2%; 0.05
/// is where the curve flattens, and the less of the two to bet on one text. Shrinking the
/// off-diagonal already keeps the
/// compensation from trusting the calibration text's correlations too far, so less damping
/// is needed than without it (0.25 was best then, chosen on an evaluation text).
const DAMP: f64 = 0.05;

/// Fraction of `H`'s off-diagonal terms taken away before factoring (a shrinkage of the
/// measured second moments towards their diagonal). A few thousand tokens estimate `H` poorly
/// along directions the calibration text barely visits, and full compensation trusts those
/// directions as much as the rest. Chosen on calibration data alone: quantized from the
/// statistics of the first 12 288 tokens of `fixtures/text/calibration-mixed.txt`, measured
/// on the following, unused part of the same mixed text (mean KL-divergence against F32,
/// SmolLM2-135M; damping 0.25): `iq4_nl_mix` 0 → 0.0693, 0.15 → 0.0613, 0.3 → 0.0626,
/// 0.5 → 0.0664; `q3_k_m` 0 → 0.0554, 0.15 → 0.0494, 0.3 → 0.0499; with [`DAMP`]'s 0.05,
/// 0.3 → 0.0577 and 0.0470 against 0.15's 0.0563 and 0.0463. At 1 nothing is compensated.
const SHRINK: f64 = 0.15;

/// `U`, the upper Cholesky factor of `((1 − α)·H + α·diag(H) + λI)⁻¹` (α = [`SHRINK`]), and
/// the damped diagonal of `H`.
#[derive(Debug, Clone)]
pub struct Factor {
    /// Side length.
    pub n: usize,
    /// Row-major `n × n`, upper triangular.
    pub u: Vec<f32>,
    /// Diagonal of the damped `H` (importance weights for the scale search).
    pub diag: Vec<f32>,
    /// The damping that was applied, as a fraction of the mean diagonal.
    pub damp: f64,
    /// Processing order: `order[i]` is the column rounded `i`-th (largest `H_jj` first); `u` is
    /// the factor of `H` with rows and columns in this order.
    pub order: Vec<usize>,
    /// The measured `H` (shared with the importance it came from, not copied): with
    /// [`SHRINK`] and `diag`, the matrix that was factored, which [`crate::refit`] fits scales
    /// through ([`Factor::add_row`]).
    pub moments: Arc<Vec<f32>>,
}

impl Factor {
    /// `v += l · (row j of the shrunk, damped H)`, in column order. (The matrix is never
    /// formed: it would double the memory the factors take.)
    pub fn add_row(&self, j: usize, l: f32, v: &mut [f32]) {
        let n = self.n;
        let keep = 1.0 - SHRINK as f32;
        let row = &self.moments[j * n..(j + 1) * n];
        for (o, &h) in v[..j].iter_mut().zip(&row[..j]) {
            *o += l * (keep * h);
        }
        v[j] += l * self.diag[j];
        for (o, &h) in v[j + 1..].iter_mut().zip(&row[j + 1..]) {
            *o += l * (keep * h);
        }
    }
}

/// Dot product with independent accumulators (so the compiler can vectorize it).
#[inline]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f64>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// In-place lower Cholesky factorization of the symmetric `n × n` matrix `a` (row-major; only
/// the lower triangle is read). `Err(j)` if the matrix is not positive definite at column `j`.
fn cholesky_lower(a: &mut [f64], n: usize) -> Result<(), usize> {
    for j in 0..n {
        let (head, tail) = a.split_at_mut(j * n);
        let row_j = &mut tail[..n];
        // Row j, columns < j: L[j][k] = (A[j][k] − Σ_{m<k} L[j][m]·L[k][m]) / L[k][k].
        for k in 0..j {
            let row_k = &head[k * n..k * n + n];
            let s = row_j[k] - dot(&row_j[..k], &row_k[..k]);
            row_j[k] = s / row_k[k];
        }
        let d = row_j[j] - dot(&row_j[..j], &row_j[..j]);
        if d.is_nan() || d <= 0.0 || !d.is_finite() {
            return Err(j);
        }
        row_j[j] = d.sqrt();
        for v in &mut row_j[j + 1..] {
            *v = 0.0;
        }
    }
    Ok(())
}

/// Solve `a·x = b` in place (`b` receives `x`) for symmetric positive definite `n × n` `a`
/// (row-major; overwritten by its Cholesky factor). `Err(j)` if `a` is not positive definite.
pub(crate) fn solve_spd(a: &mut [f64], b: &mut [f64], n: usize) -> Result<(), usize> {
    cholesky_lower(a, n)?;
    for i in 0..n {
        b[i] = (b[i] - dot(&a[i * n..i * n + i], &b[..i])) / a[i * n + i];
    }
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| a[k * n + i] * b[k]).sum();
        b[i] = (b[i] - s) / a[i * n + i];
    }
    Ok(())
}

/// `T = (L⁻¹)ᵀ` for lower-triangular `l` (so `T` is upper triangular), row by row: row `c` of
/// `T` is column `c` of `L⁻¹`, found by forward substitution with contiguous dot products.
fn inverse_transposed(l: &[f64], n: usize) -> Vec<f64> {
    let mut t = vec![0.0f64; n * n];
    t.par_chunks_mut(n).enumerate().for_each(|(c, row)| {
        row[c] = 1.0 / l[c * n + c];
        for i in c + 1..n {
            let li = &l[i * n..i * n + n];
            row[i] = -dot(&li[c..i], &row[c..i]) / li[i];
        }
    });
    t
}

/// Factor the second-moment matrix `h` (`n × n`, row-major).
pub fn factor(h: &Arc<Vec<f32>>, n: usize) -> Factor {
    assert_eq!(h.len(), n * n, "a square matrix");
    // Largest mean square first: the columns that matter most are rounded while the most
    // columns are left to absorb their error.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]).then(a.cmp(&b)));
    let hp: Vec<f32> = (0..n * n)
        .map(|k| h[order[k / n] * n + order[k % n]])
        .collect();
    let mut f = factor_ordered(&hp, n);
    // Diagonal back in column order (importance weights for the scale search).
    let mut diag = vec![0.0f32; n];
    for (i, &j) in order.iter().enumerate() {
        diag[j] = f.diag[i];
    }
    f.moments = Arc::clone(h);
    f.diag = diag;
    f.order = order;
    f
}

fn factor_ordered(h: &[f32], n: usize) -> Factor {
    let mean_diag = (0..n).map(|i| f64::from(h[i * n + i])).sum::<f64>() / n.max(1) as f64;
    // Columns calibration never excited get a unit diagonal: they are rounded plainly.
    let scale = if mean_diag > 0.0 { mean_diag } else { 1.0 };
    let mut damp = DAMP;
    loop {
        // Reverse the index order: the lower factor of the reversed matrix, inverted and
        // reversed back, is the upper factor of H⁻¹ (H = R·Rᵀ with R = P·L·P upper, so
        // H⁻¹ = R⁻ᵀ·R⁻¹ and U = R⁻¹).
        let mut a = vec![0.0f64; n * n];
        for i in 0..n {
            for j in 0..=i {
                let (hi, hj) = (n - 1 - i, n - 1 - j);
                let keep = if i == j { 1.0 } else { 1.0 - SHRINK };
                a[i * n + j] = keep * f64::from(h[hi * n + hj]);
            }
            let hi = n - 1 - i;
            if h[hi * n + hi] <= 0.0 {
                a[i * n + i] = scale;
            }
            a[i * n + i] += damp * scale;
        }
        let diag: Vec<f32> = (0..n).map(|i| a[(n - 1 - i) * (n + 1)] as f32).collect();
        if cholesky_lower(&mut a, n).is_ok() {
            let t = inverse_transposed(&a, n);
            // U[i][j] = L⁻¹[n−1−i][n−1−j] = T[n−1−j][n−1−i].
            let mut u = vec![0.0f32; n * n];
            for i in 0..n {
                for j in i..n {
                    u[i * n + j] = t[(n - 1 - j) * n + (n - 1 - i)] as f32;
                }
            }
            return Factor {
                n,
                u,
                diag,
                damp,
                order: Vec::new(),
                moments: Arc::default(),
            };
        }
        damp *= 10.0;
    }
}

/// Whether [`quantize_matrix`] can write `dtype`.
pub fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q8_0) || grid::supports(dtype.block())
}

/// Quantize `rows × cols` weights `w` (row-major) to `dtype` (Q4_0, Q8_0, Q5_0, Q5_1, Q2_K,
/// Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS) with error compensation through `f`; appends the
/// blocks to `out` and returns the dequantized values.
///
/// The caller has checked that every value is finite and that `cols` is a multiple of the
/// type's block (256 for the K-quants).
pub fn quantize_matrix(
    w: &[f32],
    cols: usize,
    dtype: DType,
    f: &Factor,
    out: &mut Vec<u8>,
) -> Vec<f32> {
    assert!(supports(dtype), "a block type");
    assert_eq!(f.n, cols, "the factor matches the columns");
    assert_eq!(cols % dtype.block_len(), 0, "whole blocks");
    let rows = w.len() / cols;
    let block_bytes = dtype.block_bytes();
    let row_bytes = cols / dtype.block_len() * block_bytes;
    let mut bytes = vec![0u8; rows * row_bytes];
    let mut deq = vec![0.0f32; rows * cols];
    bytes
        .par_chunks_mut(row_bytes)
        .zip(deq.par_chunks_mut(cols))
        .enumerate()
        .for_each(|(r, (rb, rd))| {
            let mut row = w[r * cols..(r + 1) * cols].to_vec();
            if grid::supports(dtype.block()) {
                grid::quantize_row(&mut row, dtype.block(), f, rb, rd);
            } else {
                quantize_row(&mut row, dtype, f, rb, rd);
            }
        });
    out.extend_from_slice(&bytes);
    deq
}

/// The compensated rounding of one row onto fixed per-column grids: column `j`'s value is
/// `grid(j, q)` for codes `q` in `0..=qmax[j]`; `codes` receives them. `row` is consumed.
/// Returns nothing: `deq` receives each column's grid value.
fn round_compensated(
    row: &mut [f32],
    f: &Factor,
    codes: &mut [u8],
    deq: &mut [f32],
    nearest: impl Fn(usize, f32) -> (u8, f32),
) {
    let n = f.n;
    let mut wp: Vec<f32> = f.order.iter().map(|&j| row[j]).collect();
    for i in 0..n {
        let j = f.order[i];
        let (q, y) = nearest(j, wp[i]);
        codes[j] = q;
        deq[j] = y;
        let e = (wp[i] - y) / f.u[i * n + i];
        if e != 0.0 {
            let u_row = &f.u[i * n + i + 1..(i + 1) * n];
            for (v, &u) in wp[i + 1..].iter_mut().zip(u_row) {
                *v -= e * u;
            }
        }
    }
    row.copy_from_slice(deq);
}

/// One row: `row` is consumed (it holds the compensated values as it goes).
fn quantize_row(row: &mut [f32], dtype: DType, f: &Factor, out: &mut [u8], deq: &mut [f32]) {
    let n = f.n;
    let (qmin, qmax) = if dtype == DType::Q4_0 {
        (-8.0f32, 7.0f32)
    } else {
        (-128.0, 127.0)
    };
    // Every block's scale, from the row's own values (importance-weighted search).
    let scales: Vec<f16> = (0..n / QK)
        .map(|b| {
            let x: &[f32; QK] = row[b * QK..(b + 1) * QK].try_into().expect("a block");
            let wts: &[f32; QK] = f.diag[b * QK..(b + 1) * QK].try_into().expect("a block");
            if dtype == DType::Q4_0 {
                quantize_block_q4_0(Method::Search, x, Some(wts)).d
            } else {
                quantize_block_q8_0(Method::Search, x, Some(wts)).d
            }
        })
        .collect();
    // Round in the factor's order, pushing each error onto the columns still to come.
    let mut wp: Vec<f32> = f.order.iter().map(|&j| row[j]).collect();
    let mut codes = vec![0i32; n];
    for i in 0..n {
        let j = f.order[i];
        let d = scales[j / QK].to_f32();
        let q = if d == 0.0 {
            0.0
        } else {
            (wp[i] / d).round().clamp(qmin, qmax)
        };
        codes[j] = q as i32;
        let y = d * q;
        deq[j] = y;
        let e = (wp[i] - y) / f.u[i * n + i];
        if e != 0.0 {
            let u_row = &f.u[i * n + i + 1..(i + 1) * n];
            for (v, &u) in wp[i + 1..].iter_mut().zip(u_row) {
                *v -= e * u;
            }
        }
    }
    for b in 0..n / QK {
        let c: &[i32; QK] = codes[b * QK..(b + 1) * QK].try_into().expect("a block");
        let dst = &mut out[b * dtype.block_bytes()..(b + 1) * dtype.block_bytes()];
        write_block(dtype, scales[b], c, dst);
    }
}

/// Compensated rounding for GGML's Q5, K-quant and IQ4 layouts.
///
/// Every block's scales (and minimums, and for the K-quants the sub-block scales and the
/// super-block scales that quantize them) are fitted first, by GGML's importance-weighted rule
/// for the type (what `llama-quantize --imatrix` runs) with `H`'s diagonal as the importance,
/// from the row's original values: the processing order visits a block's columns far apart,
/// so its scales must be fixed before any of them is rounded. That leaves each column a fixed
/// grid of values `a·level(q) + b` over its codes `q` (`a` the sub-block's scale, `b` its
/// offset, `level(q)` either `q + o` or, for IQ4_NL/IQ4_XS, GGML's 16 non-linear levels),
/// exactly as the type's dequantizer computes them; the compensated rounding then
/// picks the codes, and the blocks are written back with them. The scales are what GGML's
/// weighted rule gives, except in the types whose layouts can store new ones (IQ4_NL,
/// IQ4_XS): there [`crate::refit`] then fits them to the chosen codes.
mod grid {
    use super::{round_compensated, Factor};
    use kiln_format::BlockKind;

    /// Whether this module writes the type: it has GGML's weighted rule to fit the scales and
    /// codes that can be set apart from them (its row of the block-type table says).
    pub(super) fn supports(kind: &BlockKind) -> bool {
        kind.rows == 1 && kind.has_weighted() && kind.has_code_grids()
    }

    /// Fit the blocks, round compensated, and write the blocks with the new codes.
    pub(super) fn quantize_row(
        row: &mut [f32],
        kind: &BlockKind,
        f: &Factor,
        out: &mut [u8],
        deq: &mut [f32],
    ) {
        let n = row.len();
        let mut blocks = Vec::with_capacity(out.len());
        kind.quantize_weighted(row, &f.diag, &mut blocks)
            .expect("a type with a weighted rule, checked by supports")
            .expect("a finite row of whole blocks, checked by the caller");
        let mut grids = Vec::with_capacity(n);
        kind.code_grids(&blocks, &mut grids)
            .expect("a type with code grids, checked by supports");
        let mut codes = vec![0u8; n];
        let original = row.to_vec();
        round_compensated(row, f, &mut codes, deq, |j, w| grids[j].nearest(w));
        kind.set_codes(&mut blocks, &codes)
            .expect("a type with code grids, checked by supports");
        if crate::refit::refit_row(&original, f, kind, &codes, &mut blocks, deq) {
            row.copy_from_slice(deq);
        }
        out.copy_from_slice(&blocks);
    }
}

fn write_block(dtype: DType, d: f16, codes: &[i32; QK], dst: &mut [u8]) {
    if dtype == DType::Q4_0 {
        let mut qs = [0u8; QK / 2];
        for (i, q) in qs.iter_mut().enumerate() {
            let lo = (codes[i] + 8) as u8;
            let hi = (codes[i + QK / 2] + 8) as u8;
            *q = lo | (hi << 4);
        }
        dst.copy_from_slice(bytemuck::bytes_of(&BlockQ4_0 { d, qs }));
    } else {
        let mut qs = [0i8; QK];
        for (q, &c) in qs.iter_mut().zip(codes) {
            *q = c as i8;
        }
        dst.copy_from_slice(bytemuck::bytes_of(&BlockQ8_0 { d, qs }));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed % 20001) as f32 / 10000.0 - 1.0
    }

    /// Correlated inputs: x = A·z for a random mixing matrix A.
    pub(crate) fn inputs(tokens: usize, n: usize, seed: &mut u64) -> Vec<f32> {
        let a: Vec<f32> = (0..n * n).map(|_| rng(seed)).collect();
        let mut x = vec![0.0f32; tokens * n];
        for t in 0..tokens {
            let z: Vec<f32> = (0..n).map(|_| rng(seed)).collect();
            for i in 0..n {
                // Strongly uneven column scales, as in real activations.
                let s = if i % 7 == 0 { 8.0 } else { 1.0 };
                x[t * n + i] = s * (0..n).map(|k| a[i * n + k] * z[k]).sum::<f32>() / n as f32;
            }
        }
        x
    }

    pub(crate) fn second_moment(x: &[f32], n: usize) -> Arc<Vec<f32>> {
        let tokens = x.len() / n;
        let mut h = vec![0.0f32; n * n];
        crate::calibrate::accumulate_gram(x, tokens, n, &mut h);
        Arc::new(h.iter().map(|v| v / tokens as f32).collect())
    }

    #[test]
    fn factor_is_the_upper_cholesky_of_the_inverse() {
        let mut seed = 7u64;
        let n = 40;
        let x = inputs(200, n, &mut seed);
        let h = second_moment(&x, n);
        let f = factor(&h, n);
        // Largest diagonal first.
        for w in f.order.windows(2) {
            assert!(h[w[0] * n + w[0]] >= h[w[1] * n + w[1]]);
        }
        // (Uᵀ·U)·(P·((1 − α)·H + α·diag(H) + λI)·Pᵀ) = I, in processing order.
        let mut hd: Vec<f64> = (0..n * n)
            .map(|k| (1.0 - SHRINK) * f64::from(h[f.order[k / n] * n + f.order[k % n]]))
            .collect();
        for i in 0..n {
            hd[i * n + i] = f64::from(f.diag[f.order[i]]);
        }
        for i in 0..n {
            for j in 0..n {
                let mut s = 0.0f64;
                for k in 0..n {
                    let uu: f64 = (0..n)
                        .map(|m| f64::from(f.u[m * n + i]) * f64::from(f.u[m * n + k]))
                        .sum();
                    s += uu * hd[k * n + j];
                }
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((s - want).abs() < 1e-3, "({i},{j}) = {s}");
            }
            for j in 0..i {
                assert_eq!(f.u[i * n + j], 0.0, "upper triangular");
            }
        }
    }

    fn dequantize(dtype: DType, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0f32; bytes.len() / dtype.block_bytes() * QK];
        kiln_format::values::decode_rows_f32(dtype, QK, bytes, &mut out);
        out
    }

    /// The output error `Σ_t ‖(W − Ŵ)·x_t‖²`.
    fn output_error(w: &[f32], wq: &[f32], x: &[f32], n: usize) -> f64 {
        let rows = w.len() / n;
        let mut e = 0.0f64;
        for xt in x.chunks_exact(n) {
            for r in 0..rows {
                let d: f32 = (0..n).map(|j| (w[r * n + j] - wq[r * n + j]) * xt[j]).sum();
                e += f64::from(d) * f64::from(d);
            }
        }
        e
    }

    #[test]
    fn compensated_rounding_beats_nearest_rounding_on_output_error() {
        let mut seed = 11u64;
        let n = 64;
        let rows = 24;
        let x = inputs(512, n, &mut seed);
        let h = second_moment(&x, n);
        let w: Vec<f32> = (0..rows * n).map(|_| rng(&mut seed) * 0.1).collect();
        let f = factor(&h, n);
        for dtype in [DType::Q4_0, DType::Q8_0] {
            let mut out = Vec::new();
            let deq = quantize_matrix(&w, n, dtype, &f, &mut out);
            assert_eq!(out.len(), rows * n / QK * dtype.block_bytes());
            // The bytes decode to the values returned.
            let back = dequantize(dtype, &out);
            assert_eq!(back, deq);
            // Against GGML's reference rounding of the same matrix.
            let mut ref_out = Vec::new();
            let mut stats = crate::ErrorStats::default();
            crate::rows::convert_rows(
                &w,
                n,
                dtype,
                Method::Reference,
                None,
                &mut ref_out,
                &mut stats,
            )
            .unwrap();
            let ref_deq = dequantize(dtype, &ref_out);
            let (e_gptq, e_ref) = (
                output_error(&w, &deq, &x, n),
                output_error(&w, &ref_deq, &x, n),
            );
            assert!(
                e_gptq < 0.7 * e_ref,
                "{dtype}: compensated {e_gptq} vs reference {e_ref}"
            );
        }
    }

    /// Q5_0, Q5_1 and the K-quants: the bytes decode to the values returned, and the output
    /// error is well below that of GGML's importance-weighted rule (what the same blocks'
    /// scales come from) with the same importance.
    #[test]
    fn compensated_rounding_in_q5_and_k_quant_layouts() {
        let mut seed = 23u64;
        let n = 256;
        let rows = 12;
        let x = inputs(1024, n, &mut seed);
        let h = second_moment(&x, n);
        let w: Vec<f32> = (0..rows * n).map(|_| rng(&mut seed) * 0.1).collect();
        let f = factor(&h, n);
        for dtype in [
            DType::Q5_0,
            DType::Q5_1,
            DType::Q2_K,
            DType::Q3_K,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
            DType::IQ4_NL,
            DType::IQ4_XS,
        ] {
            let mut out = Vec::new();
            let deq = quantize_matrix(&w, n, dtype, &f, &mut out);
            assert_eq!(
                out.len(),
                rows * n / dtype.block_len() * dtype.block_bytes()
            );
            let mut back = vec![0.0f32; rows * n];
            kiln_format::values::decode_rows_f32(dtype, n, &out, &mut back);
            assert_eq!(back, deq, "{dtype}: the bytes hold the returned values");
            let mut weighted = Vec::new();
            let mut stats = crate::ErrorStats::default();
            let imp: Vec<f32> = f.diag.clone();
            crate::rows::convert_rows(
                &w,
                n,
                dtype,
                Method::Search,
                Some(&imp),
                &mut weighted,
                &mut stats,
            )
            .unwrap();
            let mut weighted_deq = vec![0.0f32; rows * n];
            kiln_format::values::decode_rows_f32(dtype, n, &weighted, &mut weighted_deq);
            let (e_gptq, e_weighted) = (
                output_error(&w, &deq, &x, n),
                output_error(&w, &weighted_deq, &x, n),
            );
            println!(
                "{dtype}: compensated {e_gptq:.4e} weighted {e_weighted:.4e} ratio {:.3}",
                e_gptq / e_weighted
            );
            assert!(
                e_gptq < 0.8 * e_weighted,
                "{dtype}: compensated {e_gptq} vs weighted {e_weighted}"
            );
        }
    }

    #[test]
    fn unexcited_columns_and_zero_rows_are_handled() {
        let n = 32;
        // Only column 0 ever sees input.
        let mut h = vec![0.0f32; n * n];
        h[0] = 4.0;
        let f = factor(&Arc::new(h), n);
        assert!(f.u.iter().all(|v| v.is_finite()));
        let w = vec![0.0f32; 2 * n];
        let mut out = Vec::new();
        let deq = quantize_matrix(&w, n, DType::Q4_0, &f, &mut out);
        assert!(deq.iter().all(|&v| v == 0.0));
    }
}
