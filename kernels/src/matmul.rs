//! Matrix × activations: `out[t, r] = Σ_c x[t, c] · W[r, c]`, split over a [`Pool`].
//!
//! Work is cut into fixed chunks of [`ROW_CHUNK`] output rows. Inside a chunk, rows go through
//! the tier's tile kernel [`TILE_ROWS`] at a time (the last group is padded by repeating a row
//! and the extra results dropped) for every token, so each group's weights are loaded from
//! memory once and then reused from cache for all tokens. Every output element is reduced by
//! one tile kernel call in a fixed order, so the result does not depend on the thread count,
//! and a token's result does not depend on how many other tokens are in the batch.

use std::cell::RefCell;

use kiln_format::{BlockQ8_0, QK};

use crate::dispatch::{active, Kernels, Tile, TILE_ROWS};
use crate::matrix::{Matrix, WeightData};
use crate::pool::{Disjoint, Pool};

const ZERO_Q8_0: BlockQ8_0 = BlockQ8_0 {
    d: half::f16::ZERO,
    qs: [0; QK],
};

/// The most tokens any tier's multi-token tile kernel takes.
const MAX_TILE_TOKENS: usize = 4;

/// Output rows per parallel task.
pub const ROW_CHUNK: usize = 16;

/// Weight bytes × tokens below which a product runs on the calling thread only (a few
/// microseconds of work: less than waking the other threads and waiting for them costs).
const PARALLEL_MIN_WORK: usize = 48 * 1024;

/// `out[t*rows + r] = Σ_c x[t*cols + c] · W[r, c]` for `t in 0..n_tokens`, at the dispatched tier.
///
/// `x` is `[n_tokens, cols]`, `out` is `[n_tokens, rows]`. Q8_0 and Q4_0 weights quantize each
/// activation row to Q8_0 once and use integer dot products. Panics if the lengths disagree.
pub fn matmul(w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32], pool: &Pool) {
    active().matmul(w, x, n_tokens, out, pool)
}

impl Kernels {
    /// [`matmul`] at this table's tier.
    pub fn matmul(&self, w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32], pool: &Pool) {
        let (rows, cols) = (w.rows, w.cols);
        assert_eq!(
            Some(x.len()),
            n_tokens.checked_mul(cols),
            "matmul: x must be n_tokens × cols"
        );
        assert_eq!(
            Some(out.len()),
            n_tokens.checked_mul(rows),
            "matmul: out must be n_tokens × rows"
        );
        if rows == 0 || n_tokens == 0 {
            return;
        }
        match w.data {
            WeightData::F32(d) => run_tiles(d, cols, x, cols, rows, out, pool, self.tile_f32),
            WeightData::F16(d) => run_tiles(d, cols, x, cols, rows, out, pool, self.tile_f16),
            WeightData::BF16(d) => run_tiles(d, cols, x, cols, rows, out, pool, self.tile_bf16),
            WeightData::Q8_0(d) => ACT_Q8_0.with_borrow_mut(|xq| {
                self.quantize_tokens(x, cols, xq, pool);
                run_tiles(d, cols / QK, xq, cols / QK, rows, out, pool, self.tile_q8_0)
            }),
            WeightData::Q4_0(d) => ACT_Q8_0.with_borrow_mut(|xq| {
                self.quantize_tokens(x, cols, xq, pool);
                run_tiles(d, cols / QK, xq, cols / QK, rows, out, pool, self.tile_q4_0)
            }),
        }
    }

    /// Quantize every token's activation row to Q8_0 (once per matmul) into `xq`.
    fn quantize_tokens(&self, x: &[f32], cols: usize, xq: &mut Vec<BlockQ8_0>, pool: &Pool) {
        let per_row = cols / QK;
        xq.clear();
        xq.resize(x.len() / QK, ZERO_Q8_0);
        if per_row == 0 {
            return;
        }
        let quantize = self.quantize_row_q8_0_act;
        let n_tokens = x.len() / cols;
        if n_tokens >= 8 && pool.threads() > 1 {
            let out = Disjoint::new(&mut xq[..]);
            pool.run(n_tokens, &|t| {
                // SAFETY: task t writes only token t's blocks.
                let q = unsafe { out.slice_mut(t * per_row..(t + 1) * per_row) };
                quantize(&x[t * cols..(t + 1) * cols], q);
            });
        } else {
            for (q, xs) in xq.chunks_mut(per_row).zip(x.chunks(cols)) {
                quantize(xs, q);
            }
        }
    }
}

thread_local! {
    /// The calling thread's quantized activations, reused from call to call.
    static ACT_Q8_0: RefCell<Vec<BlockQ8_0>> = const { RefCell::new(Vec::new()) };
}

/// Split the output into row chunks and run `tile` over each on the pool.
///
/// `w` is `rows × wl` (elements or blocks), `x` is `n_tokens × xl`; `out` is `n_tokens × rows`.
#[allow(clippy::too_many_arguments)]
fn run_tiles<W: Sync, X: Sync>(
    w: &[W],
    wl: usize,
    x: &[X],
    xl: usize,
    rows: usize,
    out: &mut [f32],
    pool: &Pool,
    tile: Tile<W, X>,
) {
    assert!(tile.tokens >= 1 && tile.tokens <= MAX_TILE_TOKENS);
    let n_tokens = out.len() / rows;
    let n_chunks = rows.div_ceil(ROW_CHUNK);
    let out = Disjoint::new(out);
    let run = |c: usize| {
        let r0 = c * ROW_CHUNK;
        let r1 = (r0 + ROW_CHUNK).min(rows);
        for g in (r0..r1).step_by(TILE_ROWS) {
            let n = TILE_ROWS.min(r1 - g);
            let wr: [&[W]; TILE_ROWS] = std::array::from_fn(|i| {
                let r = (g + i).min(r1 - 1);
                &w[r * wl..(r + 1) * wl]
            });
            // Tokens in groups of `tile.tokens` (register-blocked), the rest one at a time.
            let mut t = 0;
            while t < n_tokens {
                let nt = if n_tokens - t >= tile.tokens {
                    tile.tokens
                } else {
                    1
                };
                let kernel = if nt == 1 { tile.one } else { tile.many };
                let mut xs = [&x[..0]; MAX_TILE_TOKENS];
                for (j, xj) in xs[..nt].iter_mut().enumerate() {
                    *xj = &x[(t + j) * xl..(t + j + 1) * xl];
                }
                let mut res = [[0.0f32; TILE_ROWS]; MAX_TILE_TOKENS];
                kernel(&wr, &xs[..nt], &mut res[..nt]);
                for (j, r) in res[..nt].iter().enumerate() {
                    let at = (t + j) * rows + g;
                    // SAFETY: chunk c writes only its own rows r0..r1 of each token, and the
                    // chunks of one call are disjoint.
                    let dst = unsafe { out.slice_mut(at..at + n) };
                    dst.copy_from_slice(&r[..n]);
                }
                t += nt;
            }
        }
    };
    // Small products (attention over a short context, tiny test matrices) stay on the calling
    // thread: waking the others would cost more than it saves.
    let work = std::mem::size_of_val(w).saturating_mul(n_tokens);
    if pool.threads() == 1 || n_chunks == 1 || work < PARALLEL_MIN_WORK {
        (0..n_chunks).for_each(run);
    } else {
        pool.run(n_chunks, &run);
    }
}
