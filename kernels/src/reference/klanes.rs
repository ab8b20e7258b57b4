//! The scalar statement of the K-quant lanes kernel ([`crate::klanes::KLanesFn`]) over its
//! unpacked layouts, which every tier's kernel is tested against (tests only: the products
//! themselves are checked against [`super::dot_q4_k_q8_k_ref`] and its siblings).
#![cfg(test)]

use kiln_format::QK_K;

use crate::klanes::{KKind, KLaneBlock, KLaneRow, KSUBS};
use crate::lanes::LanesAcc;
use crate::tile::TILE_ROWS;

/// The exact integer sums of one unpacked super-block against one token (lane `t` of `x`):
/// `(isum, mins)` of [`super::term_k`] for the kinds with mins (the sums of
/// [`crate::reference::isum_q4_k`], [`crate::reference::isum_q2_k`]), `(isum, 0)` of
/// [`super::term_q6_k`] for the kinds with an offset (its term already in `isum`,
/// [`crate::reference::isum_q6_k`], [`crate::reference::isum_q3_k`],
/// [`crate::reference::isum_iq4_xs`]).
pub(crate) fn ints_ref(kind: KKind, w: &KLaneRow, x: &KLaneBlock, t: usize) -> (i32, i32) {
    let sub = kind.sub();
    let mut isum = 0i32;
    for s in 0..QK_K / sub {
        let dot: i32 = (s * sub..(s + 1) * sub)
            .map(|j| i32::from(w.codes[j]) * i32::from(x.codes[j / 4][t][j % 4]))
            .sum();
        isum += w.scales[s] * dot;
    }
    let pairs: i32 = (0..KSUBS / 2)
        .map(|k| {
            let (p, b) = (w.pairs[k], x.bsums[k][t]);
            i32::from(p[0]) * i32::from(b[0]) + i32::from(p[1]) * i32::from(b[1])
        })
        .sum();
    if kind.affine() {
        (isum, pairs)
    } else {
        (isum + pairs, 0)
    }
}

/// The scalar statement of [`crate::klanes::KLanesFn`]: each (row, token)'s term from [`ints_ref`], formed as
/// the reference forms it, added to `acc`.
pub(crate) fn ktile_ref(
    kind: KKind,
    rows: &[&KLaneRow; TILE_ROWS],
    x0: &KLaneBlock,
    x1: Option<&KLaneBlock>,
    acc: &mut LanesAcc,
) {
    for (g, x) in std::iter::once(x0).chain(x1).enumerate() {
        for (w, acc) in rows.iter().zip(acc.iter_mut()) {
            for (t, a) in acc[g].iter_mut().enumerate() {
                let ints = ints_ref(kind, w, x, t);
                *a += if kind.affine() {
                    super::term_k(w.d, w.dmin, x.dx[t], ints)
                } else {
                    super::term_q6_k(w.d, x.dx[t], ints.0)
                };
            }
        }
    }
}
