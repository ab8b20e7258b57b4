//! Attention scores of one block of keys: `out[r, j] = scale · Σ_c q[r, c] · k[j, c]`, in
//! query-major order (a row of scores per query, as the softmax reads them).
//!
//! This is [`crate::matmul`] with the keys as the matrix and the queries as the tokens, and
//! it gives exactly what `matmul` followed by a multiply by `scale` gives, bit for bit. What
//! differs is the work around the kernel when the tier multiplies through its float lanes
//! kernel. A `matmul` of a 128-key block by 64 query rows transposes the queries, widens the
//! keys, zeroes its running sums and scatters its results across the query rows, for every
//! block; at 64 columns that costs about as much as the products. Here the keys take the
//! lanes instead (transposed and widened once, 32 keys a tile), the query rows are the
//! kernel's weight rows as they are (already f32), and each finished tile is a row of 32
//! scores copied (and scaled) straight into place. Both orders make each score one FMA chain
//! over the columns in order ([`crate::reference::float_lanes_ref`]), and `fma(a, b, c)` is
//! `fma(b, a, c)`, so the bits are the same.

use std::cell::RefCell;

use crate::dispatch::active;
use crate::lanes::{FloatAcc, FLOAT_ROWS, FLOAT_TILE};
use crate::matmul::LaneFloat;
use crate::matrix::{Matrix, WeightData};
use crate::plan::{plan, Path};
use crate::pool::Pool;
use crate::table::Kernels;

/// [`Kernels::scores`] at the dispatched tier.
pub fn scores(q: &[f32], k: &Matrix, scale: f32, out: &mut [f32], pool: &Pool) {
    active().scores(q, k, scale, out, pool)
}

thread_local! {
    /// The calling thread's keys transposed into tiles of 32 (`[col][key]`).
    static KEYS: RefCell<Vec<[f32; FLOAT_TILE]>> = const { RefCell::new(Vec::new()) };
}

impl Kernels {
    /// `out[r·k.rows + j] = scale · Σ_c q[r·k.cols + c] · k[j, c]` for every query row `r` of
    /// `q` and key row `j` of `k`: [`Kernels::matmul`] of `k` by the query rows, each result
    /// then multiplied by `scale`, with the same bits. Panics if the lengths disagree.
    pub fn scores(&self, q: &[f32], k: &Matrix, scale: f32, out: &mut [f32], pool: &Pool) {
        let d = k.cols;
        assert!(
            d > 0 && q.len().is_multiple_of(d),
            "scores: q is not whole rows of the key width"
        );
        let rows = q.len() / d;
        assert_eq!(
            Some(out.len()),
            rows.checked_mul(k.rows),
            "scores: out must be query rows × keys"
        );
        // Where `matmul` would take the float lanes kernel, the keys go in the lanes instead
        // of the queries: the same bits (see the module's doc).
        match (k.data, plan(self, k, rows)) {
            (WeightData::F32(w), Path::FloatLanes) => self.scores_lanes(q, w, d, scale, out),
            (WeightData::F16(w), Path::FloatLanes) => self.scores_lanes(q, w, d, scale, out),
            (WeightData::BF16(w), Path::FloatLanes) => self.scores_lanes(q, w, d, scale, out),
            _ => {
                self.matmul(k, q, rows, out, pool);
                out.iter_mut().for_each(|x| *x *= scale);
            }
        }
    }

    /// [`Kernels::scores`] through the float lanes kernel with the keys in the lanes.
    fn scores_lanes<W: LaneFloat>(
        &self,
        q: &[f32],
        k: &[W],
        d: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let kernel = self.float_lanes.expect("checked by the caller");
        let (rows, keys) = (q.len() / d, k.len() / d);
        if keys == 0 {
            return;
        }
        KEYS.with_borrow_mut(|kt| {
            let tiles = keys.div_ceil(FLOAT_TILE);
            kt.clear();
            kt.resize(tiles * d, [0.0; FLOAT_TILE]);
            let mut wide = [0.0f32; FLOAT_TILE];
            for (j, key) in k.chunks_exact(d).enumerate() {
                let tile = &mut kt[j / FLOAT_TILE * d..(j / FLOAT_TILE + 1) * d];
                for (c0, part) in key.chunks(FLOAT_TILE).enumerate() {
                    let w = &mut wide[..part.len()];
                    W::widen(self, part, w);
                    for (col, &v) in tile[c0 * FLOAT_TILE..].iter_mut().zip(w.iter()) {
                        col[j % FLOAT_TILE] = v;
                    }
                }
            }
            for r0 in (0..rows).step_by(FLOAT_ROWS) {
                let n = FLOAT_ROWS.min(rows - r0);
                // Rows past the last query repeat it; their scores are dropped.
                let qr: [&[f32]; FLOAT_ROWS] = std::array::from_fn(|i| {
                    let r = (r0 + i).min(rows - 1);
                    &q[r * d..(r + 1) * d]
                });
                for (t, tile) in kt.chunks_exact(d).enumerate() {
                    let j0 = t * FLOAT_TILE;
                    let nk = FLOAT_TILE.min(keys - j0);
                    let mut acc: FloatAcc = [[0.0; FLOAT_TILE]; FLOAT_ROWS];
                    kernel(&qr, tile, nk, &mut acc);
                    for (i, acc) in acc[..n].iter().enumerate() {
                        let o = &mut out[(r0 + i) * keys + j0..(r0 + i) * keys + j0 + nk];
                        for (o, &a) in o.iter_mut().zip(acc) {
                            *o = a * scale;
                        }
                    }
                }
            }
        })
    }
}
