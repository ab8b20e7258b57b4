//! Matrix × activations: `out[t, r] = Σ_c x[t, c] · W[r, c]`, split over a [`Pool`].
//!
//! Work is cut into fixed chunks of [`ROW_CHUNK`] output rows. Inside a chunk, rows go through
//! the tier's tile kernel [`TILE_ROWS`] at a time (the last group is padded by repeating a row
//! and the extra results dropped) for every token, so each group's weights are loaded from
//! memory once and then reused from cache for all tokens. Every output element is reduced by
//! one kernel call in a fixed order, so the result does not depend on the thread count. For a
//! single token (decode), a full chunk is one call of the tier's sixteen-row kernel where it has
//! one: the same arithmetic as four one-token tiles, with one call, one reduction of sixteen
//! accumulators and one store, which on a small model's short rows (576 columns: nine block
//! pairs per row) cost about a fifth of decode time.
//!
//! Batches of [`LANES_MIN_TOKENS`] tokens or more (block weights; [`FLOAT_LANES_MIN_TOKENS`]
//! for float weights) go through the tier's lanes kernels where it has them (AVX-512; see
//! [`crate::lanes`]): sixteen tokens per vector, each weight row
//! unpacked or widened once per product. Below that size a token's result does not depend on
//! the other tokens of the batch; at or above it, it is the scalar reference's for block
//! weights and the lanes kernel's own fixed order for float weights, which differ from the
//! one-token tiles' in the last bits.

use std::cell::RefCell;

use kiln_format::{BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};

use crate::dispatch::{active, Kernels, Prepared, PreparedPair, Tile, TILE_ROWS, WIDE_ROWS};
use crate::interleaved::{deinterleave_chunk, prepare_group_x, unpack_interleaved_row, GroupX};
use crate::lanes::{
    prepare_float_group, prepare_group, unpack_row, LaneBlock, LaneFloat, LaneWeight, Lanes,
    LanesFn, LANES,
};
use crate::matrix::{Matrix, WeightData};
use crate::pool::Pool;

const ZERO_Q8_0: BlockQ8_0 = BlockQ8_0 {
    d: half::f16::ZERO,
    qs: [0; QK],
};

/// The most tokens any tier's multi-token tile kernel takes.
const MAX_TILE_TOKENS: usize = 4;

/// Batches of at least this many tokens multiply block weights through the tier's lanes
/// kernel, if it has one (the AVX-512 tier), which gives the scalar reference's bits; smaller
/// batches give each token the bits it gets alone. (From 8 tokens, half a lane group, the
/// lanes kernel is already faster: measured at 12-token prompts.)
pub const LANES_MIN_TOKENS: usize = 8;

/// The same for interleaved Q4_0 (`q4_0x16`), whose one-token kernel leaves the lanes kernel
/// less to win: below this many tokens it runs token by token (the chunk stays in cache
/// between tokens). Measured on SmolLM2-135M Q4_0, one and two threads: the per-token kernel
/// prefills 8 tokens 2.2× as fast as the lanes kernel, 16 tokens 1.4×, 32 tokens about as
/// fast; at 64 tokens the lanes kernel is ahead (1.1× at one thread), at 128 by 1.05–1.2×.
pub const INTERLEAVED_LANES_MIN_TOKENS: usize = 48;

/// The same for float weights and the float lanes kernel, which gains less per token.
pub const FLOAT_LANES_MIN_TOKENS: usize = 16;

/// Output rows per parallel task.
pub const ROW_CHUNK: usize = 16;
const _: () = assert!(
    ROW_CHUNK == WIDE_ROWS,
    "a full chunk is one sixteen-row kernel call"
);

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

/// [`matmul`] of several matrices by the same activations (`outs[i]` gets `ws[i]`'s product),
/// as one job on the pool: a forward pass's q/k/v or gate/up projections. Matrices of one
/// encoding share one quantization of the activations and one hand-over to the threads; each
/// result is bit for bit what [`matmul`] gives. Panics if the lengths disagree.
pub fn matmul_many(
    ws: &[&Matrix],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
) {
    active().matmul_many(ws, x, n_tokens, outs, pool)
}

impl Kernels {
    /// [`matmul`] at this table's tier.
    pub fn matmul(&self, w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32], pool: &Pool) {
        self.matmul_many(&[w], x, n_tokens, &mut [out], pool)
    }

    /// [`matmul_many`] at this table's tier.
    pub fn matmul_many(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
    ) {
        assert_eq!(ws.len(), outs.len(), "matmul: one output per matrix");
        let Some(first) = ws.first() else { return };
        let cols = first.cols;
        assert_eq!(
            Some(x.len()),
            n_tokens.checked_mul(cols),
            "matmul: x must be n_tokens × cols"
        );
        for (w, out) in ws.iter().zip(outs.iter()) {
            assert_eq!(
                w.cols, cols,
                "matmul: every matrix must take the same input"
            );
            assert_eq!(
                Some(out.len()),
                n_tokens.checked_mul(w.rows),
                "matmul: out must be n_tokens × rows"
            );
        }
        if n_tokens == 0 {
            return;
        }
        let same = ws
            .iter()
            .all(|w| std::mem::discriminant(&w.data) == std::mem::discriminant(&first.data));
        if !same {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul_many(&[w], x, n_tokens, &mut [out], pool);
            }
            return;
        }
        /// Every matrix's elements as the encoding `$v` (all are, checked above).
        macro_rules! all_as {
            ($v:ident) => {
                ws.iter()
                    .map(|w| match w.data {
                        WeightData::$v(d) => (d, w.rows),
                        _ => unreachable!("encodings checked equal"),
                    })
                    .collect::<Vec<_>>()
            };
        }
        let n = n_tokens;
        match first.data {
            WeightData::F32(_) => {
                let tile = self.tile_f32;
                self.run_float(&all_as!(F32), x, n, outs, pool, tile)
            }
            WeightData::F16(_) => {
                let tile = self.tile_f16;
                self.run_float(&all_as!(F16), x, n, outs, pool, tile)
            }
            WeightData::BF16(_) => {
                let tile = self.tile_bf16;
                self.run_float(&all_as!(BF16), x, n, outs, pool, tile)
            }
            WeightData::Q8_0(_) => {
                let tiles = (self.tile_q8_0, self.prepared_q8_0);
                self.run_quantized(&all_as!(Q8_0), x, n, outs, pool, tiles)
            }
            WeightData::Q4_0(_) => {
                let tiles = (self.tile_q4_0, self.prepared_q4_0);
                self.run_quantized(&all_as!(Q4_0), x, n, outs, pool, tiles)
            }
            WeightData::Q4_0x16(_) => self.run_interleaved(&all_as!(Q4_0x16), x, n, outs, pool),
        }
    }

    /// Sixteen-row interleaved Q4_0 (see [`crate::interleaved`]): through the tier's
    /// interleaved kernel, one token at a time, where it has one and the batch is below
    /// [`INTERLEAVED_LANES_MIN_TOKENS`]; larger batches through the lanes kernel (rows unpacked
    /// straight from the interleaved bytes); on tiers with neither, each chunk turned back into
    /// plain rows for the tier's Q4_0 tiles.
    fn run_interleaved(
        &self,
        ws: &[(&[BlockQ4_0x16], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        if nb == 0 {
            outs.iter_mut().for_each(|o| o.fill(0.0));
            return;
        }
        ACT_Q8_0.with_borrow_mut(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            let lanes = self.lanes.filter(|_| match self.group_q4_0x16 {
                Some(_) => n_tokens >= INTERLEAVED_LANES_MIN_TOKENS,
                None => n_tokens >= LANES_MIN_TOKENS,
            });
            if let (Some(group), None) = (self.group_q4_0x16, lanes) {
                return ACT_GROUP.with_borrow_mut(|gx| {
                    gx.clear();
                    gx.resize(n_tokens * nb, GroupX::ZERO);
                    per_token(pool, gx, nb, |t, o| {
                        prepare_group_x(&xq[t * nb..(t + 1) * nb], o)
                    });
                    run_chunks(ws, n_tokens, outs, pool, |w, r0, _, outs| {
                        let chunk = &w[r0 / GROUP_ROWS * nb..][..nb];
                        for (t, o) in outs.iter_mut().enumerate() {
                            let o: &mut [f32; GROUP_ROWS] =
                                (&mut **o).try_into().expect("whole sixteen-row chunks");
                            group(chunk, &gx[t * nb..(t + 1) * nb], o);
                        }
                    })
                });
            }
            ACT_LANES.with_borrow_mut(|xl| {
                if lanes.is_some() {
                    transpose_tokens(xq, nb, n_tokens, BlockQ4_0::OFFSET, xl, pool);
                }
                run_chunks(ws, n_tokens, outs, pool, |w, r0, _, outs| {
                    let chunk = &w[r0 / GROUP_ROWS * nb..][..nb];
                    match lanes {
                        Some(k) => {
                            let unpack = |r: usize, codes: &mut [u8], dw: &mut [f32]| {
                                unpack_interleaved_row(chunk, r, codes, dw)
                            };
                            lanes_rows(unpack, nb, 0, GROUP_ROWS, xl, n_tokens, outs, k)
                        }
                        None => PLAIN_ROWS.with_borrow_mut(|plain| {
                            deinterleave_chunk(chunk, plain);
                            let tile = &self.tile_q4_0;
                            tiles_chunk(plain, nb, 0, GROUP_ROWS, xq, nb, n_tokens, outs, tile)
                        }),
                    }
                })
            })
        })
    }

    /// Float weights: batches of [`FLOAT_LANES_MIN_TOKENS`] or more through the tier's float
    /// lanes kernel (activations transposed once, in groups of sixteen), others through `tile`.
    fn run_float<W: LaneFloat + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, f32>,
    ) {
        let cols = x.len() / n_tokens;
        let Some(kernel) = self
            .float_lanes
            .filter(|_| cols > 0 && n_tokens >= FLOAT_LANES_MIN_TOKENS)
        else {
            return run_tiles(ws, cols, x, cols, n_tokens, outs, pool, tile);
        };
        ACT_FLOAT_LANES.with_borrow_mut(|xl| {
            let groups = n_tokens.div_ceil(LANES);
            xl.clear();
            xl.resize(groups * cols, [0.0; LANES]);
            per_token(pool, xl, cols, |g, o| {
                let t1 = n_tokens.min((g + 1) * LANES);
                prepare_float_group(&x[g * LANES * cols..t1 * cols], cols, o)
            });
            run_chunks(ws, n_tokens, outs, pool, |w, r0, r1, outs| {
                WIDENED.with_borrow_mut(|wide| {
                    wide.resize(TILE_ROWS * cols, 0.0);
                    for g in (r0..r1).step_by(TILE_ROWS) {
                        let n = TILE_ROWS.min(r1 - g);
                        for (i, dst) in wide.chunks_exact_mut(cols).enumerate() {
                            let r = (g + i).min(r1 - 1);
                            W::widen(&w[r * cols..(r + 1) * cols], dst);
                        }
                        let wr: [&[f32]; TILE_ROWS] =
                            std::array::from_fn(|i| &wide[i * cols..(i + 1) * cols]);
                        for (tg, xg) in xl.chunks_exact(cols).enumerate() {
                            let res = kernel(&wr, xg);
                            scatter(&res, outs, tg, n_tokens, g - r0, n);
                        }
                    }
                })
            });
        })
    }

    /// [`run_tiles`] for block weights: the activations quantized to Q8_0 first (once for all
    /// the matrices), into the calling thread's reused buffer, and prepared for the tier's
    /// pair kernel if it has one (`tiles.1`).
    fn run_quantized<W: LaneWeight + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tiles: (Tile<W, BlockQ8_0>, Option<Prepared<W>>),
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        ACT_Q8_0.with_borrow_mut(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            if let Some(kernel) = self
                .lanes
                .filter(|_| nb > 0 && n_tokens >= LANES_MIN_TOKENS)
            {
                return ACT_LANES.with_borrow_mut(|xl| {
                    transpose_tokens(xq, nb, n_tokens, W::OFFSET, xl, pool);
                    run_lanes(ws, nb, xl, n_tokens, outs, pool, kernel)
                });
            }
            let Some(prepared) = tiles.1.filter(|_| nb > 0) else {
                return run_tiles(ws, nb, xq, nb, n_tokens, outs, pool, tiles.0);
            };
            ACT_PREPARED.with_borrow_mut(|xp| {
                let np = nb.div_ceil(2);
                xp.clear();
                xp.resize(n_tokens * np, PreparedPair::ZERO);
                per_token(pool, xp, np, |t, o| {
                    (prepared.prepare)(&xq[t * nb..(t + 1) * nb], o)
                });
                run_tiles(ws, nb, xp, np, n_tokens, outs, pool, prepared.tile)
            })
        })
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
        per_token(pool, xq, per_row, |t, q| {
            quantize(&x[t * cols..(t + 1) * cols], q)
        });
    }
}

/// Every token's Q8_0 row (`xq`, `nb` blocks each) transposed into groups of sixteen tokens
/// for the lanes kernel (`xl`, `nb` blocks per group), for weights with unsigned offset
/// `offset`.
fn transpose_tokens(
    xq: &[BlockQ8_0],
    nb: usize,
    n_tokens: usize,
    offset: i32,
    xl: &mut Vec<LaneBlock>,
    pool: &Pool,
) {
    xl.clear();
    xl.resize(n_tokens.div_ceil(LANES) * nb, LaneBlock::ZERO);
    per_token(pool, xl, nb, |g, o| {
        let t1 = n_tokens.min((g + 1) * LANES);
        prepare_group(&xq[g * LANES * nb..t1 * nb], nb, offset, o)
    });
}

/// `f(t, items[t·per..(t+1)·per])` for every token `t`: over the pool for a batch of 8 tokens
/// or more, on the calling thread for fewer (microseconds of work).
fn per_token<T: Send>(
    pool: &Pool,
    items: &mut [T],
    per: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if items.len() >= 8 * per {
        pool.for_each_chunk(items, per, f);
    } else {
        items.chunks_mut(per).enumerate().for_each(|(t, c)| f(t, c));
    }
}

thread_local! {
    /// The calling thread's quantized activations, reused from call to call.
    static ACT_Q8_0: RefCell<Vec<BlockQ8_0>> = const { RefCell::new(Vec::new()) };
    /// The same activations transposed for the tier's lanes kernel.
    static ACT_LANES: RefCell<Vec<LaneBlock>> = const { RefCell::new(Vec::new()) };
    /// Float activations transposed for the float lanes kernel.
    static ACT_FLOAT_LANES: RefCell<Vec<[f32; LANES]>> = const { RefCell::new(Vec::new()) };
    /// A worker's float weight rows widened to f32 for the float lanes kernel.
    static WIDENED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A worker's unpacked weight rows for the lanes kernel: codes and scales.
    static UNPACKED: RefCell<(Vec<u8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The same activations prepared for the tier's interleaved Q4_0 kernel.
    static ACT_GROUP: RefCell<Vec<GroupX>> = const { RefCell::new(Vec::new()) };
    /// A worker's sixteen-row chunk of interleaved Q4_0 turned back into plain rows.
    static PLAIN_ROWS: RefCell<Vec<BlockQ4_0>> = const { RefCell::new(Vec::new()) };
    /// The same activations prepared for the tier's pair kernel.
    static ACT_PREPARED: RefCell<Vec<PreparedPair>> = const { RefCell::new(Vec::new()) };
}

/// Split every matrix's output into row chunks and run `tile` over all of them as one job.
///
/// `ws[i]` is `(weights, rows)`, `rows × wl` elements or blocks; `x` is `n_tokens × xl`;
/// `outs[i]` is `n_tokens × rows_i`.
#[allow(clippy::too_many_arguments)]
fn run_tiles<W: Sync, X: Sync>(
    ws: &[(&[W], usize)],
    wl: usize,
    x: &[X],
    xl: usize,
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    tile: Tile<W, X>,
) {
    assert!(tile.tokens >= 1 && tile.tokens <= MAX_TILE_TOKENS);
    run_chunks(ws, n_tokens, outs, pool, |w, r0, r1, outs| {
        tiles_chunk(w, wl, r0, r1, x, xl, n_tokens, outs, &tile)
    });
}

/// Rows `r0..r1` of `w` (`wl` elements or blocks a row) against every token of `x` through
/// `tile`: [`run_tiles`]' task. `outs[t]` is token t's slice of those rows.
#[allow(clippy::too_many_arguments)]
fn tiles_chunk<W, X>(
    w: &[W],
    wl: usize,
    r0: usize,
    r1: usize,
    x: &[X],
    xl: usize,
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    tile: &Tile<W, X>,
) {
    // One token and a full chunk: the sixteen-row kernel, straight into the output.
    if let Some(rows) = tile.rows.filter(|_| n_tokens == 1 && r1 - r0 == WIDE_ROWS) {
        let out: &mut [f32; WIDE_ROWS] = (&mut *outs[0]).try_into().expect("full chunk");
        return rows(&w[r0 * wl..r1 * wl], &x[..xl], out);
    }
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
                outs[t + j][g - r0..g - r0 + n].copy_from_slice(&r[..n]);
            }
            t += nt;
        }
    }
}

/// Block weights against a batch through the tier's lanes kernel: every row chunk's rows
/// unpacked once (four at a time, into the worker's reused buffers) and run against every
/// group of sixteen tokens of `xl` (`n_groups × nb` transposed blocks).
#[allow(clippy::too_many_arguments)]
fn run_lanes<W: LaneWeight + Sync>(
    ws: &[(&[W], usize)],
    nb: usize,
    xl: &[LaneBlock],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    kernel: LanesFn,
) {
    run_chunks(ws, n_tokens, outs, pool, |w, r0, r1, outs| {
        let unpack = |r: usize, codes: &mut [u8], dw: &mut [f32]| {
            unpack_row(&w[r * nb..(r + 1) * nb], codes, dw)
        };
        lanes_rows(unpack, nb, r0, r1, xl, n_tokens, outs, kernel)
    });
}

/// Rows `r0..r1`, each unpacked by `unpack(r, codes, dw)`, against every token group of `xl`
/// through the lanes `kernel`.
#[allow(clippy::too_many_arguments)]
fn lanes_rows(
    unpack: impl Fn(usize, &mut [u8], &mut [f32]),
    nb: usize,
    r0: usize,
    r1: usize,
    xl: &[LaneBlock],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    kernel: LanesFn,
) {
    UNPACKED.with_borrow_mut(|(codes, dw)| {
        codes.resize(TILE_ROWS * nb * QK, 0);
        dw.resize(TILE_ROWS * nb, 0.0);
        for g in (r0..r1).step_by(TILE_ROWS) {
            let n = TILE_ROWS.min(r1 - g);
            for i in 0..TILE_ROWS {
                let r = (g + i).min(r1 - 1);
                unpack(
                    r,
                    &mut codes[i * nb * QK..(i + 1) * nb * QK],
                    &mut dw[i * nb..(i + 1) * nb],
                );
            }
            let cr: [&[u8]; TILE_ROWS] =
                std::array::from_fn(|i| &codes[i * nb * QK..(i + 1) * nb * QK]);
            let dr: [&[f32]; TILE_ROWS] = std::array::from_fn(|i| &dw[i * nb..(i + 1) * nb]);
            for (tg, x) in xl.chunks_exact(nb).enumerate() {
                scatter(&kernel(&cr, &dr, x), outs, tg, n_tokens, g - r0, n);
            }
        }
    })
}

/// A lanes kernel's `res[r][t]` for token group `tg` into rows `o0..o0 + n` of each token's
/// output slice (tokens past `n_tokens` are padding).
fn scatter(res: &Lanes, outs: &mut [&mut [f32]], tg: usize, n_tokens: usize, o0: usize, n: usize) {
    let t0 = tg * LANES;
    for (l, o) in outs[t0..n_tokens.min(t0 + LANES)].iter_mut().enumerate() {
        for (k, v) in o[o0..o0 + n].iter_mut().enumerate() {
            *v = res[k][l];
        }
    }
}

/// Split every matrix's output into chunks of [`ROW_CHUNK`] rows and run `task` over all of
/// them as one job: `task(w, r0, r1, outs)` computes rows `r0..r1` of weights `w`, `outs[t]`
/// being token t's slice of those rows.
///
/// `ws[i]` is `(weights, rows)`; `outs[i]` is `n_tokens × rows_i`.
fn run_chunks<W: Sync>(
    ws: &[(&[W], usize)],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    task: impl Fn(&[W], usize, usize, &mut [&mut [f32]]) + Sync,
) {
    // Task k is chunk `k - starts[i]` of matrix i, for the last i with `starts[i] <= k`.
    let mut starts = Vec::with_capacity(ws.len());
    let mut n_tasks = 0;
    for &(_, rows) in ws {
        starts.push(n_tasks);
        n_tasks += rows.div_ceil(ROW_CHUNK);
    }
    // Chunk c's output is rows r0..r1 of every token: one slice per token, cut up front so
    // that each task owns its slices outright. `slots[k * n_tokens + t]` is token t's.
    let mut slots: Vec<&mut [f32]> = Vec::with_capacity(n_tasks * n_tokens);
    for (out, &(_, rows)) in outs.iter_mut().zip(ws) {
        if rows == 0 {
            continue;
        }
        let mut per_token: Vec<_> = out
            .chunks_mut(rows)
            .map(|o| o.chunks_mut(ROW_CHUNK))
            .collect();
        for _ in 0..rows.div_ceil(ROW_CHUNK) {
            slots.extend(per_token.iter_mut().flat_map(|it| it.next()));
        }
    }
    debug_assert_eq!(slots.len(), n_tasks * n_tokens);
    let run = |k: usize, outs: &mut [&mut [f32]]| {
        let m = starts.partition_point(|&s| s <= k) - 1;
        let (w, rows) = ws[m];
        let r0 = (k - starts[m]) * ROW_CHUNK;
        task(w, r0, (r0 + ROW_CHUNK).min(rows), outs);
    };
    // Small products (attention over a short context, tiny test matrices) stay on the calling
    // thread: waking the others would cost more than it saves.
    let bytes: usize = ws.iter().map(|(w, _)| std::mem::size_of_val(*w)).sum();
    let work = bytes.saturating_mul(n_tokens);
    if pool.threads() == 1 || n_tasks == 1 || work < PARALLEL_MIN_WORK {
        slots
            .chunks_mut(n_tokens)
            .enumerate()
            .for_each(|(k, outs)| run(k, outs));
    } else {
        pool.for_each_chunk(&mut slots, n_tokens, run);
    }
}
