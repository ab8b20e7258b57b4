//! Matrix × activations: `out[t, r] = Σ_c x[t, c] · W[r, c]`, split over a [`Pool`].
//!
//! Work is cut into fixed chunks of [`ROW_CHUNK`] output rows. Inside a chunk, rows go through
//! the tier's tile kernel [`TILE_ROWS`] at a time (the last group is padded by repeating a row
//! and the extra results dropped) for every token, so each group's weights are loaded from
//! memory once and then reused from cache for all tokens. Every output element is reduced by
//! one tile kernel call in a fixed order, so the result does not depend on the thread count,
//! and a token's result does not depend on how many other tokens are in the batch.

use kiln_format::{BlockQ8_0, QK};
use rayon::prelude::*;

use crate::dispatch::{active, Kernels, Tile, TILE_ROWS};
use crate::matrix::{Matrix, WeightData};
use crate::pool::Pool;

const ZERO_Q8_0: BlockQ8_0 = BlockQ8_0 {
    d: half::f16::ZERO,
    qs: [0; QK],
};

/// The most tokens any tier's multi-token tile kernel takes.
const MAX_TILE_TOKENS: usize = 4;

/// Output rows per parallel task.
pub const ROW_CHUNK: usize = 16;

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
            WeightData::Q8_0(d) => {
                let xq = self.quantize_tokens(x, cols, pool);
                run_tiles(
                    d,
                    cols / QK,
                    &xq,
                    cols / QK,
                    rows,
                    out,
                    pool,
                    self.tile_q8_0,
                )
            }
            WeightData::Q4_0(d) => {
                let xq = self.quantize_tokens(x, cols, pool);
                run_tiles(
                    d,
                    cols / QK,
                    &xq,
                    cols / QK,
                    rows,
                    out,
                    pool,
                    self.tile_q4_0,
                )
            }
        }
    }

    /// Quantize every token's activation row to Q8_0 (once per matmul).
    fn quantize_tokens(&self, x: &[f32], cols: usize, pool: &Pool) -> Vec<BlockQ8_0> {
        let per_row = cols / QK;
        let mut xq = vec![ZERO_Q8_0; x.len() / QK];
        if per_row == 0 {
            return xq;
        }
        let quantize = self.quantize_row_q8_0_act;
        if x.len() / cols >= 8 {
            pool.install(|| {
                xq.par_chunks_mut(per_row)
                    .zip(x.par_chunks(cols))
                    .for_each(|(q, xs)| quantize(xs, q))
            });
        } else {
            for (q, xs) in xq.chunks_mut(per_row).zip(x.chunks(cols)) {
                quantize(xs, q);
            }
        }
        xq
    }
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
    // tasks[c][t] is token t's slice of chunk c's output rows.
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..n_chunks).map(|_| Vec::new()).collect();
    for token_out in out.chunks_mut(rows) {
        for (c, piece) in token_out.chunks_mut(ROW_CHUNK).enumerate() {
            tasks[c].push(piece);
        }
    }
    let run = |(c, mut pieces): (usize, Vec<&mut [f32]>)| {
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
                    pieces[t + j][g - r0..g - r0 + n].copy_from_slice(&r[..n]);
                }
                t += nt;
            }
        }
    };
    if pool.threads() == 1 || n_chunks == 1 {
        tasks.into_iter().enumerate().for_each(run);
    } else {
        // About four pieces per thread: enough for stealing to even out a preempted worker,
        // few enough that small matvecs are not dominated by task overhead.
        let min_len = n_chunks.div_ceil(4 * pool.threads());
        pool.install(|| {
            tasks
                .into_par_iter()
                .enumerate()
                .with_min_len(min_len)
                .for_each(run)
        });
    }
}
