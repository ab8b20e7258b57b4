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
//! `H` is factored by [`crate::factor`] (shrunk towards its diagonal, damped, columns in
//! processing order). The output is an ordinary tensor of the type: any reader, the runner and
//! llama.cpp use it unchanged.

use kiln_format::{BlockKind, DType};
use rayon::prelude::*;

use crate::factor::Factor;
use crate::method::Rule;
use crate::refit::refit_row;

/// Whether [`quantize_matrix`] can write `dtype`: its row of the block-type table is one row
/// of blocks whose codes can be set apart from their scales, and it has an importance-weighted
/// rule to fit the scales ([`Rule::weighted`]).
pub fn supports(dtype: DType) -> bool {
    let kind = dtype.block();
    kind.rows == 1 && kind.has_code_grids() && Rule::weighted(kind, &[]).is_some()
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
            quantize_row(&mut row, dtype.block(), f, rb, rd);
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

/// Compensated rounding of one row of `kind`, through its row of the block-type table.
///
/// Every block's scales (and minimums, and for the K-quants the sub-block scales and the
/// super-block scales that quantize them) are fitted first, with `H`'s diagonal as the
/// importance, by the type's importance-weighted rule ([`Rule::weighted`]: GGML's, what
/// `llama-quantize --imatrix` runs, or Kiln's scale search for Q8_0 and Q4_0), from the row's
/// original values: the processing order visits a block's columns far apart, so its scales
/// must be fixed before any of them is rounded. That leaves each column a fixed grid of values
/// `a·level(q) + b` over its codes `q` (`a` the sub-block's scale, `b` its offset, `level(q)`
/// either `q + o` or, for IQ4_NL/IQ4_XS, GGML's 16 non-linear levels), exactly as the type's
/// dequantizer computes them; the compensated rounding then picks the codes, and the blocks
/// are written back with them. The scales are what the weighted rule gives, except in the
/// types whose layouts can store new ones (IQ4_NL, IQ4_XS): there [`crate::refit`] then fits
/// them to the chosen codes.
fn quantize_row(row: &mut [f32], kind: &BlockKind, f: &Factor, out: &mut [u8], deq: &mut [f32]) {
    let n = row.len();
    let mut blocks = Vec::with_capacity(out.len());
    Rule::weighted(kind, &f.diag)
        .expect("a type with a weighted rule, checked by supports")
        .quantize_row(kind, row, &mut blocks);
    let mut grids = Vec::with_capacity(n);
    kind.code_grids(&blocks, &mut grids)
        .expect("a type with code grids, checked by supports");
    let mut codes = vec![0u8; n];
    let original = row.to_vec();
    round_compensated(row, f, &mut codes, deq, |j, w| grids[j].nearest(w));
    kind.set_codes(&mut blocks, &codes)
        .expect("a type with code grids, checked by supports");
    if refit_row(&original, f, kind, &codes, &mut blocks, deq) {
        row.copy_from_slice(deq);
    }
    out.copy_from_slice(&blocks);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::factor::factor;
    use crate::factor::tests::{inputs, rng, second_moment};
    use crate::method::Method;
    use kiln_format::QK;
    use kiln_kernels::ErrorStats;
    use std::sync::Arc;

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
            let mut stats = ErrorStats::default();
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
            let mut stats = ErrorStats::default();
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
