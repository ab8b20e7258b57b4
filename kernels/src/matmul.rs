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
//! Which product a batch gets (tiles, the lanes kernels, the interleaved kernel) is
//! [`crate::plan`]'s decision, named by a [`Path`]; [`Kernels::matmul_many`] asks for it once
//! per encoding and runs it. A token's bits depend on the path: the tiles give it the bits it
//! gets alone, the block and float lanes kernels the scalar reference's and the float lanes
//! reference's (which differ from the one-token tiles' in the last bits), the interleaved and
//! K-quant paths the reference's, as the tiles do for those encodings. The K-quant products
//! are in [`kquant`](self::kquant).

use std::cell::RefCell;

use kiln_format::{BlockIQ4NL, BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};

use crate::dispatch::active;
use crate::interleaved::{
    deinterleave_chunk, prepare_group_x, Codes, Group, GroupX, GROUP_TOKENS_MAX,
};
use crate::lanes::{
    prepare_float_tile, prepare_group, unpack_row, FloatAcc, FloatLanesFn, LaneBlock, LaneWeight,
    LanesAcc, LanesFn, FLOAT_ROWS, FLOAT_TILE, LANES,
};
use crate::matrix::{Matrix, WeightData};
use crate::plan::{plan_for, Batching, Operand, Path};
use crate::pool::Pool;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::float::transpose4;
use crate::table::Kernels;
use crate::tile::{Prepared, PreparedPair, Tile, TILE_ROWS, WIDE_ROWS};

mod kquant;

const ZERO_Q8_0: BlockQ8_0 = BlockQ8_0 {
    d: half::f16::ZERO,
    qs: [0; QK],
};

/// The most tokens any tier's multi-token tile kernel takes.
const MAX_TILE_TOKENS: usize = 8;

/// Output rows per parallel task.
pub const ROW_CHUNK: usize = 16;

/// Output rows per parallel task of the float lanes kernel: the activations stream from memory
/// once per chunk, so a larger chunk reads them less often (at 16 rows, 1B-shape F16 prefill
/// was bound by that stream). 64 rows still make 32 tasks of a 2048-row matrix.
const FLOAT_ROW_CHUNK: usize = 64;

/// Columns per block of the float lanes product (see [`float_lanes_chunk`]).
const FLOAT_COLS: usize = 128;

/// Output rows per parallel task of the block lanes kernel, for the same reason as
/// [`FLOAT_ROW_CHUNK`]; a multiple of sixteen, as interleaved Q4_0 needs.
pub(crate) const LANES_ROW_CHUNK: usize = 64;
const _: () = assert!(LANES_ROW_CHUNK.is_multiple_of(GROUP_ROWS));

/// Blocks (of 32 columns) per column block of the block lanes product (see [`lanes_chunk`]).
const LANES_BLOCKS: usize = 8;
const _: () = assert!(
    ROW_CHUNK == WIDE_ROWS,
    "a full chunk is one sixteen-row kernel call"
);

/// Weight bytes × tokens below which a product runs on the calling thread only (a few
/// microseconds of work: less than waking the other threads and waiting for them costs).
const PARALLEL_MIN_WORK: usize = 48 * 1024;

/// A float encoding widened to f32 for the float lanes kernel (exact for f16 and bf16).
pub(crate) trait LaneFloat: kiln_format::BlockType {
    /// `dst[i] = src[i]` as f32 with `k`'s kernels; the lengths are equal.
    fn widen(k: &Kernels, src: &[Self], dst: &mut [f32]);
}

impl LaneFloat for f32 {
    fn widen(_: &Kernels, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl LaneFloat for half::f16 {
    fn widen(k: &Kernels, src: &[half::f16], dst: &mut [f32]) {
        k.widen_f16(src, dst)
    }
}

impl LaneFloat for half::bf16 {
    fn widen(k: &Kernels, src: &[half::bf16], dst: &mut [f32]) {
        k.decode_bf16(bytemuck::cast_slice(src), dst)
    }
}

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

/// [`matmul_many`] over a batch whose rows are related as `batching` says: with
/// [`Batching::Independent`] (tokens of different sequences) each row gets exactly the bits it
/// gets as a batch of one.
pub fn matmul_many_for(
    ws: &[&Matrix],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    batching: Batching,
) {
    active().matmul_many_for(ws, x, n_tokens, outs, pool, batching)
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
        self.matmul_many_for(ws, x, n_tokens, outs, pool, Batching::Joint)
    }

    /// [`matmul_many_for`] at this table's tier.
    pub fn matmul_many_for(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        batching: Batching,
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
                self.matmul_many_for(&[w], x, n_tokens, &mut [out], pool, batching);
            }
            return;
        }
        let path = plan_for(self, first, n_tokens, batching);
        self.run_encoding(ws, x, n_tokens, outs, pool, path)
    }

    /// Matrices of one encoding (`ws`, all as `ws[0]`, checked by the caller) along `path`:
    /// each encoding's family of products with its kernels from this table, one line an
    /// encoding.
    fn run_encoding(
        &self,
        ws: &[&Matrix],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        path: Path,
    ) {
        /// Every matrix's elements as the encoding `$v`.
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
        /// Encoding `$v` through the family product `$run` with this table's kernels `$k`.
        macro_rules! run {
            ($v:ident, $run:ident, $k:expr) => {
                self.$run(&all_as!($v), x, n, outs, pool, $k, path)
            };
        }
        match ws[0].data {
            WeightData::F32(_) => run!(F32, run_float, self.tile_f32),
            WeightData::F16(_) => run!(F16, run_float, self.tile_f16),
            WeightData::BF16(_) => run!(BF16, run_float, self.tile_bf16),
            WeightData::Q8_0(_) => run!(Q8_0, run_quantized, (self.tile_q8_0, self.prepared_q8_0)),
            WeightData::Q4_0(_) => run!(Q4_0, run_quantized, (self.tile_q4_0, self.prepared_q4_0)),
            WeightData::Q5_0(_) => run!(Q5_0, run_quantized, (self.kq.q5_0, None)),
            WeightData::IQ4_NL(_) => run!(IQ4_NL, run_quantized, (self.kq.iq4_nl, None)),
            WeightData::Q4_K(_) => run!(Q4_K, run_q8_k_tiles, self.kq.q4_k),
            WeightData::Q5_K(_) => run!(Q5_K, run_q8_k_tiles, self.kq.q5_k),
            WeightData::Q6_K(_) => run!(Q6_K, run_q8_k_tiles, self.kq.q6_k),
            WeightData::Q2_K(_) => run!(Q2_K, run_q8_k_tiles, self.kq.q2_k),
            WeightData::Q3_K(_) => run!(Q3_K, run_q8_k_tiles, self.kq.q3_k),
            WeightData::IQ4_XS(_) => run!(IQ4_XS, run_q8_k_tiles, self.kq.iq4_xs),
            WeightData::Q5_1(_) => {
                self.run_q8_0_tiles(&all_as!(Q5_1), x, n, outs, pool, self.kq.q5_1)
            }
            WeightData::Q4_0x16(_) => run!(Q4_0x16, run_interleaved, Codes::Q4_0),
            WeightData::IQ4_NLx16(_) => {
                // The same bytes as Q4_0 groups (one layout); `Codes` says what they index.
                let ws: Vec<(&[BlockQ4_0x16], usize)> = all_as!(IQ4_NLx16)
                    .into_iter()
                    .map(|(d, rows)| (bytemuck::cast_slice(d), rows))
                    .collect();
                self.run_interleaved(&ws, x, n, outs, pool, Codes::IQ4_NL, path)
            }
            WeightData::IQ4_XSx16(_) => {
                self.run_iq4_xsx16(&all_as!(IQ4_XSx16), x, n, outs, pool, path)
            }
        }
    }

    /// Sixteen-row interleaved Q4_0 or IQ4_NL (see [`crate::interleaved`]; `codes` says
    /// which) along `path`: through the tier's interleaved kernel, a few tokens per call
    /// ([`Path::Interleaved`]); through the lanes kernel, rows unpacked straight from the
    /// interleaved bytes ([`Path::Lanes`]); or each chunk turned back into plain rows for the
    /// tier's Q4_0 or IQ4_NL tiles ([`Path::Deinterleaved`]).
    #[allow(clippy::too_many_arguments)]
    fn run_interleaved(
        &self,
        ws: &[(&[BlockQ4_0x16], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        codes: Codes,
        path: Path,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        if path == Path::Empty {
            outs.iter_mut().for_each(|o| o.fill(0.0));
            return;
        }
        ACT_Q8_0.with_borrow_mut(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            if let Path::Interleaved { tokens } = path {
                let group = self
                    .interleaved_group(codes)
                    .expect("planned for the tier's kernel");
                return ACT_GROUP.with_borrow_mut(|gx| {
                    gx.clear();
                    gx.resize(n_tokens * nb, GroupX::ZERO);
                    per_token(pool, gx, nb, |t, o| {
                        prepare_group_x(&xq[t * nb..(t + 1) * nb], o)
                    });
                    run_groups(ws, group, tokens, gx, nb, n_tokens, outs, pool)
                });
            }
            if path == Path::Lanes {
                let k = self.lanes.expect("planned for the tier's kernel");
                return ACT_LANES.with_borrow_mut(|xl| {
                    transpose_tokens(xq, nb, n_tokens, codes.lanes_offset(), xl, pool);
                    run_chunks(
                        ws,
                        n_tokens,
                        outs,
                        pool,
                        LANES_ROW_CHUNK,
                        |w, r0, r1, outs| {
                            // Row i of the chunk is row (r0 + i) % 16 of sixteen-row group
                            // (r0 + i) / 16; r0 is a multiple of 16.
                            let unpack = |i: usize, b0: usize, c: &mut [u8], dw: &mut [f32]| {
                                let r = r0 + i;
                                let kb = dw.len();
                                let group = &w[r / GROUP_ROWS * nb + b0..][..kb];
                                codes.unpack_row(group, r % GROUP_ROWS, c, dw)
                            };
                            let max = codes.lanes_max_code();
                            lanes_chunk(unpack, nb, max, r1 - r0, xl, n_tokens, outs, k)
                        },
                    )
                });
            }
            assert!(
                matches!(path, Path::Deinterleaved { .. }),
                "interleaved {codes:?} planned as {path}"
            );
            run_chunks(ws, n_tokens, outs, pool, ROW_CHUNK, |w, r0, _, outs| {
                let chunk = &w[r0 / GROUP_ROWS * nb..][..nb];
                PLAIN_ROWS.with_borrow_mut(|plain| {
                    deinterleave_chunk(chunk, plain);
                    match codes {
                        Codes::Q4_0 => {
                            let tile = &self.tile_q4_0;
                            tiles_chunk(plain, nb, 0, GROUP_ROWS, xq, nb, n_tokens, outs, tile)
                        }
                        Codes::IQ4_NL => {
                            // IQ4_NL blocks are Q4_0's bytes: a scale and sixteen index bytes.
                            let plain: &[BlockIQ4NL] = bytemuck::cast_slice(plain);
                            let tile = &self.kq.iq4_nl;
                            tiles_chunk(plain, nb, 0, GROUP_ROWS, xq, nb, n_tokens, outs, tile)
                        }
                    }
                })
            })
        })
    }

    /// Float weights along `path`: through the tier's float lanes kernel
    /// ([`Path::FloatLanes`]: activations transposed once, in tiles of [`FLOAT_TILE`] tokens;
    /// see [`float_lanes_chunk`]) or through `tile` ([`Path::Tiles`]).
    #[allow(clippy::too_many_arguments)]
    fn run_float<W: LaneFloat + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, f32>,
        path: Path,
    ) {
        let cols = x.len() / n_tokens;
        if path != Path::FloatLanes {
            assert!(
                matches!(path, Path::Tiles { .. }),
                "float weights planned as {path}"
            );
            return run_tiles(ws, cols, x, cols, n_tokens, outs, pool, tile);
        }
        let kernel = self.float_lanes.expect("planned for the tier's kernel");
        ACT_FLOAT_LANES.with_borrow_mut(|xl| {
            xl.clear();
            xl.resize(n_tokens.div_ceil(FLOAT_TILE) * cols, [0.0; FLOAT_TILE]);
            per_token(pool, xl, cols, |g, o| {
                let t1 = n_tokens.min((g + 1) * FLOAT_TILE);
                prepare_float_tile(&x[g * FLOAT_TILE * cols..t1 * cols], cols, o)
            });
            run_chunks(
                ws,
                n_tokens,
                outs,
                pool,
                FLOAT_ROW_CHUNK,
                |w, r0, r1, outs| {
                    float_lanes_chunk(self, w, cols, r0, r1, xl, n_tokens, outs, kernel)
                },
            );
        })
    }

    /// Block weights along `path`, the activations quantized to Q8_0 first (once for all the
    /// matrices) into the calling thread's reused buffer: through the lanes kernel
    /// ([`Path::Lanes`]), or [`run_tiles`] over the activations prepared for the tier's pair
    /// kernel (`tiles.1`, [`Operand::Q8_0Pairs`]) or over plain Q8_0.
    #[allow(clippy::too_many_arguments)]
    fn run_quantized<W: LaneWeight + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tiles: (Tile<W, BlockQ8_0>, Option<Prepared<W>>),
        path: Path,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        ACT_Q8_0.with_borrow_mut(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            if path == Path::Lanes {
                let kernel = self.lanes.expect("planned for the tier's kernel");
                return ACT_LANES.with_borrow_mut(|xl| {
                    transpose_tokens(xq, nb, n_tokens, W::OFFSET, xl, pool);
                    run_lanes(ws, nb, xl, n_tokens, outs, pool, kernel)
                });
            }
            let operand = match path {
                Path::Tiles { operand, .. } => operand,
                _ => panic!("block weights planned as {path}"),
            };
            let Some(prepared) = tiles.1.filter(|_| operand == Operand::Q8_0Pairs) else {
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
    pub(crate) fn quantize_tokens(
        &self,
        x: &[f32],
        cols: usize,
        xq: &mut Vec<BlockQ8_0>,
        pool: &Pool,
    ) {
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
pub(crate) fn per_token<T: Send>(
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
    static ACT_FLOAT_LANES: RefCell<Vec<[f32; FLOAT_TILE]>> = const { RefCell::new(Vec::new()) };
    /// A worker's float weights widened to f32 for the float lanes kernel (a block of columns
    /// of a chunk's rows), and its running sums.
    static FLOAT_SCRATCH: RefCell<(Vec<f32>, Vec<FloatAcc>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// A worker's unpacked weights for the lanes kernel (a block of columns of a chunk's rows:
    /// codes and scales), and its running sums.
    static LANES_SCRATCH: RefCell<(Vec<u8>, Vec<f32>, Vec<LanesAcc>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// The same activations prepared for the tier's interleaved Q4_0 kernel.
    static ACT_GROUP: RefCell<Vec<GroupX>> = const { RefCell::new(Vec::new()) };
    /// A worker's sixteen-row chunk of interleaved Q4_0 turned back into plain rows.
    static PLAIN_ROWS: RefCell<Vec<BlockQ4_0>> = const { RefCell::new(Vec::new()) };
    /// The same activations prepared for the tier's pair kernel.
    static ACT_PREPARED: RefCell<Vec<PreparedPair>> = const { RefCell::new(Vec::new()) };
}

/// `f` with the calling thread's reused Q8_0 activation buffer.
pub(crate) fn with_q8_0_act<R>(f: impl FnOnce(&mut Vec<BlockQ8_0>) -> R) -> R {
    ACT_Q8_0.with_borrow_mut(f)
}

/// Interleaved matrices (`ws`, `nb` groups a sixteen-row chunk) through a tier's interleaved
/// kernel, `tokens` tokens a call: each chunk against every token's prepared row (`x`, `nb`
/// blocks a token).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_groups<W: Sync, X: Sync>(
    ws: &[(&[W], usize)],
    group: Group<W, X>,
    tokens: usize,
    x: &[X],
    nb: usize,
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
) {
    run_chunks(ws, n_tokens, outs, pool, ROW_CHUNK, |w, r0, _, outs| {
        let chunk = &w[r0 / GROUP_ROWS * nb..][..nb];
        let mut sums = [[0f32; GROUP_ROWS]; GROUP_TOKENS_MAX];
        for (c, outs) in outs.chunks_mut(tokens).enumerate() {
            let t0 = c * tokens;
            let sums = &mut sums[..outs.len()];
            (group.kernel)(chunk, &x[t0 * nb..(t0 + outs.len()) * nb], sums);
            for (o, s) in outs.iter_mut().zip(sums.iter()) {
                o.copy_from_slice(s);
            }
        }
    })
}

/// Split every matrix's output into row chunks and run `tile` over all of them as one job.
///
/// `ws[i]` is `(weights, rows)`, `rows × wl` elements or blocks; `x` is `n_tokens × xl`;
/// `outs[i]` is `n_tokens × rows_i`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_tiles<W: Sync, X: Sync>(
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
    run_chunks(ws, n_tokens, outs, pool, ROW_CHUNK, |w, r0, r1, outs| {
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
    // Several tokens and a full chunk: the sixteen-row kernel for several tokens, as many per
    // call as keep their activations in L1 (none: the four-row tiles below).
    let per_call = tile.rows_many_tokens(xl).min(MAX_TILE_TOKENS);
    if let Some(many) = tile
        .rows_many
        .filter(|_| n_tokens > 1 && per_call > 1 && r1 - r0 == WIDE_ROWS)
    {
        let w = &w[r0 * wl..r1 * wl];
        let mut t = 0;
        while t < n_tokens {
            let nt = per_call.min(n_tokens - t);
            let mut xs = [&x[..0]; MAX_TILE_TOKENS];
            for (j, xj) in xs[..nt].iter_mut().enumerate() {
                *xj = &x[(t + j) * xl..(t + j + 1) * xl];
            }
            let mut res = [[0.0f32; WIDE_ROWS]; MAX_TILE_TOKENS];
            many(w, &xs[..nt], &mut res[..nt]);
            for (j, r) in res[..nt].iter().enumerate() {
                outs[t + j][..WIDE_ROWS].copy_from_slice(r);
            }
            t += nt;
        }
        return;
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

/// Block weights against a batch through the tier's lanes kernel, [`LANES_ROW_CHUNK`] rows
/// a task (see [`lanes_chunk`]).
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
    run_chunks(
        ws,
        n_tokens,
        outs,
        pool,
        LANES_ROW_CHUNK,
        |w, r0, r1, outs| {
            let unpack = |i: usize, b0: usize, codes: &mut [u8], dw: &mut [f32]| {
                let r = r0 + i;
                let blocks = &w[r * nb + b0..r * nb + b0 + dw.len()];
                prefetch_next(blocks);
                unpack_row(blocks, codes, dw)
            };
            lanes_chunk(unpack, nb, W::MAX_CODE, r1 - r0, xl, n_tokens, outs, kernel)
        },
    );
}

/// Ask for the cache lines of the blocks that follow `blocks` in memory, as many bytes as
/// `blocks` hold: the lanes kernels unpack a column of 64 rows a few hundred bytes at a time,
/// 64 streams that the hardware prefetchers do not follow, so without this each unpacking
/// waits on memory (about a tenth of an IQ4_NL prefill's time at AVX2). The next column is
/// unpacked only after this one has met every token, long enough for the lines to arrive.
#[inline(always)]
fn prefetch_next<T>(blocks: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(blocks);
        crate::simd::x86::float::prefetch_at(blocks.as_ptr(), bytes, bytes);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = blocks;
}

/// Ask for the cache lines of `out`, about to be written.
#[inline(always)]
fn prefetch_write(out: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    crate::simd::x86::float::prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }, f32>(
        out.as_ptr(),
        0,
        std::mem::size_of_val(out),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let _ = out;
}

/// The `rows` rows of a chunk, row `i`'s blocks `b0..b0 + dw.len()` unpacked by
/// `unpack(i, b0, codes, dw)`, against every token group of `xl` (`nb` blocks each) through
/// the lanes `kernel`.
///
/// Blocks go [`LANES_BLOCKS`] at a time (256 columns): that block of the chunk's rows is
/// unpacked once (16 KiB of codes for 64 rows) and meets every pair of token groups' blocks
/// (10 KiB, in L1 across the chunk's sixteen four-row tiles), so the activations stream from
/// memory once per chunk rather than once per four rows. The running sums of every
/// (row tile, pair of groups) wait in a per-thread buffer between blocks.
#[allow(clippy::too_many_arguments)]
fn lanes_chunk(
    unpack: impl Fn(usize, usize, &mut [u8], &mut [f32]),
    nb: usize,
    max_code: u8,
    rows: usize,
    xl: &[LaneBlock],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    kernel: LanesFn,
) {
    let row_tiles = rows.div_ceil(TILE_ROWS);
    let groups = n_tokens.div_ceil(LANES);
    let pairs = groups.div_ceil(2);
    LANES_SCRATCH.with_borrow_mut(|(codes, dw, acc)| {
        acc.clear();
        acc.resize(pairs * row_tiles, [[[0.0; LANES]; 2]; TILE_ROWS]);
        let mut b0 = 0;
        while b0 < nb {
            let kb = LANES_BLOCKS.min(nb - b0);
            codes.resize(row_tiles * TILE_ROWS * kb * QK, 0);
            dw.resize(row_tiles * TILE_ROWS * kb, 0.0);
            // Rows past the chunk's last (a short chunk) repeat it; their sums are dropped.
            for (i, (c, d)) in codes
                .chunks_exact_mut(kb * QK)
                .zip(dw.chunks_exact_mut(kb))
                .enumerate()
            {
                unpack(i.min(rows - 1), b0, c, d);
            }
            for (p, acc) in acc.chunks_exact_mut(row_tiles).enumerate() {
                let g = 2 * p;
                let x0 = &xl[g * nb + b0..][..kb];
                let x1 = (g + 1 < groups).then(|| &xl[(g + 1) * nb + b0..][..kb]);
                for (rt, acc) in acc.iter_mut().enumerate() {
                    let rr = |j: usize| rt * TILE_ROWS + j;
                    let cr: [&[u8]; TILE_ROWS] =
                        std::array::from_fn(|j| &codes[rr(j) * kb * QK..(rr(j) + 1) * kb * QK]);
                    let dr: [&[f32]; TILE_ROWS] =
                        std::array::from_fn(|j| &dw[rr(j) * kb..(rr(j) + 1) * kb]);
                    kernel(&cr, &dr, max_code, x0, x1, acc);
                }
            }
            b0 += kb;
        }
        // Transposed into the outputs a row tile at a time (loops, not index arithmetic per
        // element: at 2048 columns this copy is a sixth of the kernel's own work).
        for (p, acc) in acc.chunks_exact(row_tiles).enumerate() {
            write_pair(acc, p, n_tokens, outs);
        }
    })
}

/// Pair `p`'s finished sums (`acc`, every row tile) into its tokens' outputs, transposed.
#[inline(always)]
fn write_pair(acc: &[LanesAcc], p: usize, n_tokens: usize, outs: &mut [&mut [f32]]) {
    for g in 0..2 {
        let t0 = (2 * p + g) * LANES;
        let t1 = n_tokens.min(t0 + LANES);
        if t0 >= t1 {
            break;
        }
        // The next group's output rows, asked for while this group's are written.
        for o in outs.iter().skip(t1).take(LANES) {
            prefetch_write(o);
        }
        transpose_sums(acc, g, &mut outs[t0..t1]);
    }
}

/// `o[i][r] = m[r][i]`, four rows by four tokens.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn transpose4(m: [&[f32; 4]; 4], o: [&mut [f32; 4]; 4]) {
    for (i, o) in o.into_iter().enumerate() {
        *o = std::array::from_fn(|r| m[r][i]);
    }
}

/// Token `l` of `outs` gets group `g`'s sums of every row tile of `acc` (`acc[rt][r][g][l]` is
/// row `rt·TILE_ROWS + r`). Four tokens at a time the four rows of a tile go as one 4 × 4
/// transpose ([`transpose4`]: shuffles and four stores, where a float a time was a load and a
/// store each); a short last tile or token quad goes a float at a time.
#[inline(always)]
fn transpose_sums(acc: &[LanesAcc], g: usize, outs: &mut [&mut [f32]]) {
    let mut quads = outs.chunks_exact_mut(4);
    let mut l = 0;
    for q in &mut quads {
        let [o0, o1, o2, o3] = q else { unreachable!() };
        let rows = o0.len();
        for (rt, a) in acc.iter().enumerate() {
            let base = rt * TILE_ROWS;
            if base + TILE_ROWS > rows {
                for (r, a) in a.iter().enumerate().take(rows - base) {
                    o0[base + r] = a[g][l];
                    o1[base + r] = a[g][l + 1];
                    o2[base + r] = a[g][l + 2];
                    o3[base + r] = a[g][l + 3];
                }
                break;
            }
            let m: [&[f32; 4]; TILE_ROWS] =
                std::array::from_fn(|r| a[r][g][l..l + 4].try_into().expect("4 lanes"));
            let o = [&mut **o0, &mut **o1, &mut **o2, &mut **o3].map(|o| {
                <&mut [f32; 4]>::try_from(&mut o[base..base + TILE_ROWS]).expect("4 rows")
            });
            transpose4(m, o);
        }
        l += 4;
    }
    for (i, o) in quads.into_remainder().iter_mut().enumerate() {
        for (o, a) in o.chunks_mut(TILE_ROWS).zip(acc) {
            for (v, a) in o.iter_mut().zip(a) {
                *v = a[g][l + i];
            }
        }
    }
}

/// Rows `r0..r1` of float weights `w` (`cols` a row) against every token tile of `xl` through
/// the float lanes `kernel`: [`Kernels::run_float`]'s task.
///
/// Columns go a block of [`FLOAT_COLS`] at a time. Each block of the chunk's rows is widened to
/// f32 once (64 rows × 128 columns: 32 KiB, in L1) and meets every token tile's block of
/// activations (`FLOAT_TILE × FLOAT_COLS`: 16 KiB), which stays in L1 across the chunk's eight
/// row tiles, so the activations stream from memory once per chunk instead of once per row
/// tile. The running sums of every (row tile, token tile) live in a per-thread buffer between
/// blocks; since the kernel carries them without extra rounding, the cut changes no bits.
#[allow(clippy::too_many_arguments)]
fn float_lanes_chunk<W: LaneFloat>(
    k: &Kernels,
    w: &[W],
    cols: usize,
    r0: usize,
    r1: usize,
    xl: &[[f32; FLOAT_TILE]],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    kernel: FloatLanesFn,
) {
    let row_tiles = (r1 - r0).div_ceil(FLOAT_ROWS);
    let token_tiles = n_tokens.div_ceil(FLOAT_TILE);
    FLOAT_SCRATCH.with_borrow_mut(|(wide, acc)| {
        acc.clear();
        acc.resize(token_tiles * row_tiles, [[0.0; FLOAT_TILE]; FLOAT_ROWS]);
        let mut c0 = 0;
        while c0 < cols {
            let kc = FLOAT_COLS.min(cols - c0);
            wide.resize(row_tiles * FLOAT_ROWS * kc, 0.0);
            // Rows past r1 (a short last chunk) repeat the last row; their sums are dropped.
            for (i, dst) in wide.chunks_exact_mut(kc).enumerate() {
                let r = (r0 + i).min(r1 - 1);
                W::widen(k, &w[r * cols + c0..r * cols + c0 + kc], dst);
            }
            for (tt, acc) in acc.chunks_exact_mut(row_tiles).enumerate() {
                let tokens = FLOAT_TILE.min(n_tokens - tt * FLOAT_TILE);
                let xb = &xl[tt * cols + c0..tt * cols + c0 + kc];
                for (rt, acc) in acc.iter_mut().enumerate() {
                    let wr: [&[f32]; FLOAT_ROWS] = std::array::from_fn(|i| {
                        let r = rt * FLOAT_ROWS + i;
                        &wide[r * kc..(r + 1) * kc]
                    });
                    kernel(&wr, xb, tokens, acc);
                }
            }
            c0 += kc;
        }
        for (tt, acc) in acc.chunks_exact(row_tiles).enumerate() {
            let t0 = tt * FLOAT_TILE;
            for (l, o) in outs[t0..n_tokens.min(t0 + FLOAT_TILE)]
                .iter_mut()
                .enumerate()
            {
                for (o, acc) in o.chunks_mut(FLOAT_ROWS).zip(acc) {
                    for (v, a) in o.iter_mut().zip(acc) {
                        *v = a[l];
                    }
                }
            }
        }
    })
}

/// Split every matrix's output into chunks of `chunk` rows and run `task` over all of them as
/// one job: `task(w, r0, r1, outs)` computes rows `r0..r1` of weights `w`, `outs[t]` being
/// token t's slice of those rows. The chunking decides only which thread computes a row, never
/// how, so it changes no bits.
///
/// `ws[i]` is `(weights, rows)`; `outs[i]` is `n_tokens × rows_i`.
pub(crate) fn run_chunks<W: Sync>(
    ws: &[(&[W], usize)],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    chunk: usize,
    task: impl Fn(&[W], usize, usize, &mut [&mut [f32]]) + Sync,
) {
    // Task k is chunk `k - starts[i]` of matrix i, for the last i with `starts[i] <= k`.
    let mut starts = Vec::with_capacity(ws.len());
    let mut n_tasks = 0;
    for &(_, rows) in ws {
        starts.push(n_tasks);
        n_tasks += rows.div_ceil(chunk);
    }
    // Chunk c's output is rows r0..r1 of every token: one slice per token, cut up front so
    // that each task owns its slices outright. `slots[k * n_tokens + t]` is token t's.
    let mut slots: Vec<&mut [f32]> = Vec::with_capacity(n_tasks * n_tokens);
    for (out, &(_, rows)) in outs.iter_mut().zip(ws) {
        if rows == 0 {
            continue;
        }
        let mut per_token: Vec<_> = out.chunks_mut(rows).map(|o| o.chunks_mut(chunk)).collect();
        for _ in 0..rows.div_ceil(chunk) {
            slots.extend(per_token.iter_mut().flat_map(|it| it.next()));
        }
    }
    debug_assert_eq!(slots.len(), n_tasks * n_tokens);
    let run = |k: usize, outs: &mut [&mut [f32]]| {
        let m = starts.partition_point(|&s| s <= k) - 1;
        let (w, rows) = ws[m];
        let r0 = (k - starts[m]) * chunk;
        task(w, r0, (r0 + chunk).min(rows), outs);
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
