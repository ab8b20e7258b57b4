//! The measured second moments `H = E[x·xᵀ]` of a matrix's inputs, factored for
//! error-compensating rounding ([`crate::gptq`]) and for refitting scales through them
//! ([`crate::refit`]): [`factor`] gives the [`Factor`] both read.
//!
//! `H`'s off-diagonal terms are shrunk towards zero by [`SHRINK`] (`(1 − α)·H + α·diag(H)`),
//! so the compensation leans less on correlations that only the calibration text has; it is
//! then damped (`H + λ·I`, `λ` = [`DAMP`] of its mean diagonal, raised tenfold until the
//! Cholesky factorization succeeds) and columns that calibration never excited get a unit
//! diagonal, so they are rounded plainly. Columns are put in processing order (largest `H_jj`
//! first) before factoring; [`crate::gptq`] says why.

use rayon::prelude::*;
use std::sync::Arc;

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
}
