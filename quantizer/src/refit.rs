//! Least-squares scales for fixed codes, through the calibration's second moments.
//!
//! Error-compensating rounding ([`crate::gptq`]) must fix a block's scales before it picks any
//! of the block's codes, so the scales it writes were fitted to the row's original values with
//! only `H`'s diagonal as importance. Once the codes are chosen, the row's output error
//! `(w − ŵ)ᵀ·H·(w − ŵ)` is a quadratic in the scales alone (each weight is
//! `scale(group) · level(code)`), so the scales that minimise it, correlations included, solve
//! a small linear system: one unknown per scale group (18 for a 576-wide row, 64 for 2048).
//!
//! Two passes: the groups' scales, stored as the layout allows (IQ4_XS's are 6-bit multiples of
//! a super-block scale), then one factor per storage unit that rescales what the first pass
//! stored. The row keeps the new scales only where they lower the error through `H`; `H` is
//! the same shrunk and damped matrix the compensation uses, so the fit trusts the calibration's
//! correlations no further than the rounding does.

use kiln_format::block_type::{BlockKind, CodeGrid};

use crate::factor::{solve_spd, Factor};

/// The row's output error as a function of its group scales `s`, for fixed codes:
/// `(w − A·s)ᵀ·H·(w − A·s) = wᵀHw − 2·sᵀr + sᵀGs`, with `A`'s column `k` the levels of group
/// `k`'s codes (zero outside the group), `G = AᵀHA` and `r = AᵀHw`. Every candidate the refit
/// weighs uses the same codes, so `G` and `r` price them all; `wᵀHw` is left out.
struct Quadratic {
    m: usize,
    g: Vec<f64>,
    r: Vec<f64>,
}

impl Quadratic {
    /// `levels` holds each weight's level, `len` weights per group; `H` is `f`'s.
    fn new(f: &Factor, w: &[f32], levels: &[f32], len: usize) -> Quadratic {
        let n = w.len();
        let m = n / len;
        let mut g = vec![0.0f64; m * m];
        let mut r = vec![0.0f64; m];
        let mut v = vec![0.0f32; n];
        for k in 0..m {
            // v = H·a_k: the rows of H for group k's columns (H is symmetric), weighted.
            v.fill(0.0);
            for (j, &l) in levels.iter().enumerate().skip(k * len).take(len) {
                if l != 0.0 {
                    f.add_row(j, l, &mut v);
                }
            }
            r[k] = v
                .iter()
                .zip(w)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            for c in 0..m {
                g[k * m + c] = (c * len..(c + 1) * len)
                    .map(|j| f64::from(levels[j]) * f64::from(v[j]))
                    .sum();
            }
        }
        Quadratic { m, g, r }
    }

    /// The error of scales `s`, less the constant `wᵀHw`.
    fn error(&self, s: &[f64]) -> f64 {
        let m = self.m;
        (0..m)
            .map(|k| {
                let gs: f64 = (0..m).map(|c| self.g[k * m + c] * s[c]).sum();
                s[k] * (gs - 2.0 * self.r[k])
            })
            .sum()
    }

    /// The scales minimising the error when group `k`'s scale is `t[u]·base[k]` for the unit
    /// `u = k / per_unit` (`per_unit` 1 and `base` all ones: every group free). A unit the
    /// system cannot determine keeps `t = keep[u]`. `None` if the system cannot be solved.
    fn solve(&self, base: &[f64], per_unit: usize, keep: &[f64]) -> Option<Vec<f64>> {
        let m = self.m;
        let p = m / per_unit;
        // G' = BᵀGB and r' = Bᵀr, with B[k][u] = base[k] where k is in unit u.
        let mut g = vec![0.0f64; p * p];
        let mut r = vec![0.0f64; p];
        for k in 0..m {
            r[k / per_unit] += base[k] * self.r[k];
            for c in 0..m {
                g[(k / per_unit) * p + c / per_unit] += base[k] * self.g[k * m + c] * base[c];
            }
        }
        let mean_diag = (0..p).map(|u| g[u * p + u]).sum::<f64>() / p as f64;
        if !(mean_diag > 0.0 && mean_diag.is_finite()) {
            return None;
        }
        for u in 0..p {
            if g[u * p + u] <= 1e-12 * mean_diag {
                // Nothing to fit: pin the unknown to what it was.
                for c in 0..p {
                    g[u * p + c] = 0.0;
                    g[c * p + u] = 0.0;
                }
                g[u * p + u] = 1.0;
                r[u] = keep[u];
            }
        }
        solve_spd(&mut g, &mut r, p).ok()?;
        r.iter()
            .all(|t| t.is_finite())
            .then(|| (0..m).map(|k| r[k / per_unit] * base[k]).collect())
    }
}

/// Each group's scale, as its grids hold it.
fn group_scales(grids: &[CodeGrid], group: usize) -> Vec<f64> {
    grids
        .iter()
        .step_by(group)
        .map(|g| f64::from(g.scale))
        .collect()
}

/// Store `scales` in a copy of `blocks`; the copy and the scales it holds.
fn store(kind: &BlockKind, blocks: &[u8], scales: &[f64], group: usize) -> (Vec<u8>, Vec<f64>) {
    let mut out = blocks.to_vec();
    let s: Vec<f32> = scales.iter().map(|&v| v as f32).collect();
    kind.set_scales(&mut out, &s)
        .expect("a type with scale setters");
    let mut grids = Vec::with_capacity(blocks.len() / kind.bytes * kind.weights);
    kind.code_grids(&out, &mut grids)
        .expect("a type with scale setters has code grids");
    let held = group_scales(&grids, group);
    (out, held)
}

/// Refit the scales of one row's `blocks` (of `kind`, which has [`BlockKind::scale_group`])
/// whose codes are `codes`, to the row's original values `w` through the regularised second
/// moments that `f` factors. On success `blocks` and `deq` (the row's values) receive the new
/// scales and values. Returns whether the scales changed.
///
/// Two passes: the groups' scales, stored as the layout allows (IQ4_XS's are 6-bit multiples
/// of a super-block scale), then, where a unit holds several groups, one factor per unit on
/// what the first pass stored. The row takes whichever lowers the error most, if either does.
pub fn refit_row(
    w: &[f32],
    f: &Factor,
    kind: &BlockKind,
    codes: &[u8],
    blocks: &mut [u8],
    deq: &mut [f32],
) -> bool {
    let Some(group) = kind.scale_group() else {
        return false;
    };
    let n = w.len();
    let mut grids = Vec::with_capacity(n);
    kind.code_grids(blocks, &mut grids)
        .expect("a type with scale setters has code grids");
    debug_assert!(grids.iter().all(|g| g.shift == 0.0), "no shifts");
    let levels: Vec<f32> = grids
        .iter()
        .zip(codes)
        .map(|(g, &q)| CodeGrid { scale: 1.0, ..*g }.value(i32::from(q)))
        .collect();
    let quad = Quadratic::new(f, w, &levels, group);
    let old = group_scales(&grids, group);
    let mut best: Option<(Vec<u8>, f64)> = None;
    let mut least = quad.error(&old);
    // Pass 1: every group's scale free.
    let ones = vec![1.0f64; n / group];
    let Some(s) = quad.solve(&ones, 1, &old) else {
        return false;
    };
    let (stored, held) = store(kind, blocks, &s, group);
    let e = quad.error(&held);
    if e < least {
        (best, least) = (Some((stored, e)), e);
    }
    // Pass 2: one factor per unit on what pass 1 stored.
    let per_unit = kind.weights / group;
    if per_unit > 1 {
        if let Some(s2) = quad.solve(&held, per_unit, &vec![1.0; n / kind.weights]) {
            let (stored2, held2) = store(kind, blocks, &s2, group);
            let e2 = quad.error(&held2);
            if e2 < least {
                best = Some((stored2, e2));
            }
        }
    }
    let Some((stored, _)) = best else {
        return false;
    };
    grids.clear();
    kind.code_grids(&stored, &mut grids)
        .expect("a type with scale setters has code grids");
    let y: Vec<f32> = grids
        .iter()
        .zip(codes)
        .map(|(g, &q)| g.value(i32::from(q)))
        .collect();
    if !y.iter().all(|v| v.is_finite()) {
        return false;
    }
    blocks.copy_from_slice(&stored);
    deq.copy_from_slice(&y);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::factor::tests::{inputs, rng, second_moment};
    use kiln_format::DType;

    /// `(w − y)ᵀ·H·(w − y)` through the regularised `H` of `f`, formed densely.
    fn output_error(f: &Factor, w: &[f32], y: &[f32]) -> f64 {
        let n = w.len();
        let mut h = vec![0.0f32; n * n];
        for (j, row) in h.chunks_exact_mut(n).enumerate() {
            f.add_row(j, 1.0, row);
        }
        let e: Vec<f64> = w.iter().zip(y).map(|(a, b)| f64::from(a - b)).collect();
        (0..n)
            .map(|i| e[i] * (0..n).map(|j| f64::from(h[i * n + j]) * e[j]).sum::<f64>())
            .sum()
    }

    /// A row's blocks by GGML's weighted rule (unit importance), and the values they hold.
    fn weighted(kind: &BlockKind, w: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut blocks = Vec::new();
        kind.quantize_weighted(w, &vec![1.0; w.len()], &mut blocks)
            .unwrap()
            .unwrap();
        let mut deq = vec![0.0f32; w.len()];
        kind.dequantize(&blocks, w.len(), &mut deq);
        (blocks, deq)
    }

    /// Each value's code on its grid in `blocks`.
    fn codes_of(kind: &BlockKind, blocks: &[u8], values: &[f32]) -> Vec<u8> {
        let mut grids = Vec::new();
        kind.code_grids(blocks, &mut grids).unwrap();
        grids
            .iter()
            .zip(values)
            .map(|(g, &y)| g.nearest(y).0)
            .collect()
    }

    /// On correlated inputs, for each type with a scale setter: blocks from GGML's weighted
    /// rule, refitted for their own codes, keep those codes, decode to the values returned,
    /// never have more error through `H` than before, and have less in most rows.
    #[test]
    fn refitted_scales_lower_the_error_through_h() {
        let mut seed = 5u64;
        let n = 512;
        let rows = 16;
        let x = inputs(2048, n, &mut seed);
        let f = crate::factor::factor(&second_moment(&x, n), n);
        let w: Vec<f32> = (0..rows * n).map(|_| rng(&mut seed) * 0.1).collect();
        for dtype in [DType::IQ4_NL, DType::IQ4_XS] {
            let kind = dtype.block();
            let mut improved = 0;
            for r in w.chunks_exact(n) {
                let (mut blocks, mut deq) = weighted(kind, r);
                let codes = codes_of(kind, &blocks, &deq);
                let before = output_error(&f, r, &deq);
                let changed = refit_row(r, &f, kind, &codes, &mut blocks, &mut deq);
                let after = output_error(&f, r, &deq);
                let mut back = vec![0.0f32; n];
                kind.dequantize(&blocks, n, &mut back);
                assert_eq!(back, deq, "{dtype}: the bytes hold the returned values");
                assert_eq!(
                    codes_of(kind, &blocks, &deq),
                    codes,
                    "{dtype}: the codes are kept"
                );
                assert!(after <= before, "{dtype}: {after} > {before}");
                assert_eq!(changed, after < before, "{dtype}");
                improved += usize::from(after < 0.9 * before);
            }
            assert!(improved > rows / 2, "{dtype}: {improved} of {rows} rows");
        }
    }

    /// A row whose scales are already the least-squares ones for its codes is left as it
    /// was: refitting a refitted row changes nothing.
    #[test]
    fn a_refitted_row_is_left_alone() {
        let n = 256;
        let mut seed = 9u64;
        let x = inputs(1024, n, &mut seed);
        let f = crate::factor::factor(&second_moment(&x, n), n);
        let w: Vec<f32> = (0..n).map(|j| (j as f32 * 0.37).sin()).collect();
        let kind = DType::IQ4_XS.block();
        let (mut blocks, mut deq) = weighted(kind, &w);
        let codes = codes_of(kind, &blocks, &deq);
        assert!(refit_row(&w, &f, kind, &codes, &mut blocks, &mut deq));
        let (b0, d0) = (blocks.clone(), deq.clone());
        assert!(!refit_row(&w, &f, kind, &codes, &mut blocks, &mut deq));
        assert_eq!((blocks, deq), (b0, d0));
    }
}
