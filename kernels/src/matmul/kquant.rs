//! The products of Q5_1 rows (tiles over Q8_0 activations) and of K-quant and IQ4_XS rows
//! (tiles or the K-quant lanes kernel over Q8_K activations; see [`crate::klanes`] for the
//! layouts), plain or, for IQ4_XS, sixteen rows interleaved (the interleaved kernel).

use std::cell::RefCell;

use kiln_format::{BlockIQ4XS, BlockIQ4XSx16, BlockQ8K, BlockQ8_0, GROUP_ROWS, QK, QK_K};

use super::{
    per_token, run_chunks, run_groups, run_tiles, tiles_chunk, with_q8_0_act, LANES_ROW_CHUNK,
    ROW_CHUNK,
};
use crate::klanes::{prepare_kgroup, KLaneBlock, KLaneRow, KLaneWeight, KLanesFn};
use crate::lanes::{LanesAcc, LANES};
use crate::plan::Path;
use crate::pool::Pool;
use crate::reference::BLOCK_LANES;
use crate::table::Kernels;
use crate::tile::{Tile, TILE_ROWS};

thread_local! {
    /// The calling thread's Q8_K activations, reused from call to call.
    static ACT_Q8_K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
}

impl Kernels {
    /// Q5_1 rows: the activations quantized to Q8_0 once, then `tile` over row chunks.
    pub(super) fn run_q8_0_tiles<W: Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, BlockQ8_0>,
    ) {
        let cols = x.len() / n_tokens;
        let nb = cols / QK;
        with_q8_0_act(|xq| {
            self.quantize_tokens(x, cols, xq, pool);
            run_tiles(ws, nb, xq, nb, n_tokens, outs, pool, tile)
        })
    }

    /// K-quant rows along `path`: the activations quantized to Q8_K once (GGML's rule, the
    /// reference's bits in every tier), then through the tier's K-quant lanes kernel
    /// ([`Path::KLanes`], [`run_klanes`]) or `tile` over row chunks ([`Path::Tiles`]). Both
    /// give the reference's bits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_q8_k_tiles<W: KLaneWeight + Sync>(
        &self,
        ws: &[(&[W], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        tile: Tile<W, BlockQ8K>,
        path: Path,
    ) {
        self.with_q8_k_act(x, n_tokens, pool, |xq, nb| {
            if path == Path::KLanes {
                let kernel = self.klanes.expect("planned for the tier's kernel");
                return run_klanes(ws, nb, xq, n_tokens, outs, pool, kernel);
            }
            assert!(
                matches!(path, Path::Tiles { .. }),
                "k-quant weights planned as {path}"
            );
            run_tiles(ws, nb, xq, nb, n_tokens, outs, pool, tile)
        })
    }

    /// Sixteen-row interleaved IQ4_XS (see [`crate::interleaved`]) along `path`, the
    /// activations quantized to Q8_K once: through the tier's interleaved kernel, a few
    /// tokens per call ([`Path::Interleaved`]); or with each chunk turned back into plain rows
    /// in a per-thread buffer, through the K-quant lanes kernel ([`Path::KLanes`]) or the
    /// tier's IQ4_XS tiles ([`Path::Deinterleaved`]). All give the reference's bits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_iq4_xsx16(
        &self,
        ws: &[(&[BlockIQ4XSx16], usize)],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
        pool: &Pool,
        path: Path,
    ) {
        if path == Path::Empty {
            outs.iter_mut().for_each(|o| o.fill(0.0));
            return;
        }
        self.with_q8_k_act(x, n_tokens, pool, |xq, nb| match path {
            Path::Interleaved { tokens } => {
                let group = self.group_iq4_xsx16.expect("planned for the tier's kernel");
                run_groups(ws, group, tokens, xq, nb, n_tokens, outs, pool)
            }
            Path::KLanes => {
                let kernel = self.klanes.expect("planned for the tier's kernel");
                with_klanes_act(xq, nb, n_tokens, pool, |xl| {
                    run_chunks(
                        ws,
                        n_tokens,
                        outs,
                        pool,
                        LANES_ROW_CHUNK,
                        |w, r0, r1, outs| {
                            with_plain_iq4_xs(
                                &w[r0 / GROUP_ROWS * nb..r1 / GROUP_ROWS * nb],
                                nb,
                                |p| klanes_chunk(p, nb, r1 - r0, xl, n_tokens, outs, kernel),
                            )
                        },
                    )
                })
            }
            Path::Deinterleaved { .. } => {
                let tile = &self.kq.iq4_xs;
                run_chunks(ws, n_tokens, outs, pool, ROW_CHUNK, |w, r0, _, outs| {
                    with_plain_iq4_xs(&w[r0 / GROUP_ROWS * nb..][..nb], nb, |p| {
                        tiles_chunk(p, nb, 0, GROUP_ROWS, xq, nb, n_tokens, outs, tile)
                    })
                })
            }
            _ => unreachable!("interleaved iq4_xs planned as {path}"),
        })
    }

    /// `f` over every token's activations quantized to Q8_K (`nb` blocks each), in the calling
    /// thread's reused buffer.
    fn with_q8_k_act<R>(
        &self,
        x: &[f32],
        n_tokens: usize,
        pool: &Pool,
        f: impl FnOnce(&[BlockQ8K], usize) -> R,
    ) -> R {
        let cols = x.len() / n_tokens;
        let nb = cols / QK_K;
        ACT_Q8_K.with_borrow_mut(|xq| {
            xq.clear();
            xq.resize(n_tokens * nb, bytemuck::Zeroable::zeroed());
            if nb > 0 {
                let quantize = self.quantize_row_q8_k_act;
                per_token(pool, xq, nb, |t, q| {
                    quantize(&x[t * cols..(t + 1) * cols], q)
                });
            }
            f(xq, nb)
        })
    }
}

thread_local! {
    /// The calling thread's Q8_K activations transposed for the K-quant lanes kernel.
    static ACT_KLANES: RefCell<Vec<KLaneBlock>> = const { RefCell::new(Vec::new()) };
    /// A worker's chunk of interleaved IQ4_XS turned back into plain rows.
    static PLAIN_IQ4_XS: RefCell<Vec<BlockIQ4XS>> = const { RefCell::new(Vec::new()) };
    /// A worker's unpacked super-block of a chunk's rows, and its running sums:
    /// `acc[(lane·pairs + p)·row_tiles + rt]` for accumulator `lane` (super-blocks `b` with
    /// `b % 8 == lane`), pair of token groups `p` and four-row tile `rt`.
    static KLANES_SCRATCH: RefCell<(Vec<KLaneRow>, Vec<LanesAcc>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
}

/// K-quant rows (`ws[i]`: `(blocks, rows)`, `nb` super-blocks a row) against every token's
/// Q8_K row (`xq`) through the lanes `kernel`: the activations transposed once, then
/// [`LANES_ROW_CHUNK`] rows a task (see [`klanes_chunk`]).
fn run_klanes<W: KLaneWeight + Sync>(
    ws: &[(&[W], usize)],
    nb: usize,
    xq: &[BlockQ8K],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &Pool,
    kernel: KLanesFn,
) {
    with_klanes_act(xq, nb, n_tokens, pool, |xl| {
        run_chunks(
            ws,
            n_tokens,
            outs,
            pool,
            LANES_ROW_CHUNK,
            |w, r0, r1, outs| {
                klanes_chunk(
                    &w[r0 * nb..r1 * nb],
                    nb,
                    r1 - r0,
                    xl,
                    n_tokens,
                    outs,
                    kernel,
                )
            },
        );
    })
}

/// `f` over every token's Q8_K row (`xq`, `nb` super-blocks each) transposed for the K-quant
/// lanes kernel, in the calling thread's reused buffer.
fn with_klanes_act<R>(
    xq: &[BlockQ8K],
    nb: usize,
    n_tokens: usize,
    pool: &Pool,
    f: impl FnOnce(&[KLaneBlock]) -> R,
) -> R {
    ACT_KLANES.with_borrow_mut(|xl| {
        xl.clear();
        xl.resize(n_tokens.div_ceil(LANES) * nb, KLaneBlock::ZERO);
        per_token(pool, xl, nb, |g, o| {
            let t1 = n_tokens.min((g + 1) * LANES);
            prepare_kgroup(&xq[g * LANES * nb..t1 * nb], nb, o)
        });
        f(xl)
    })
}

/// `f` over the plain rows of interleaved IQ4_XS groups (`groups`: whole sixteen-row chunks,
/// `nb` super-blocks a row), turned back in the calling worker's reused buffer: a copy of the
/// chunk, paid once per product for all its tokens.
fn with_plain_iq4_xs<R>(
    groups: &[BlockIQ4XSx16],
    nb: usize,
    f: impl FnOnce(&[BlockIQ4XS]) -> R,
) -> R {
    PLAIN_IQ4_XS.with_borrow_mut(|plain| {
        plain.clear();
        plain.resize(groups.len() * GROUP_ROWS, bytemuck::Zeroable::zeroed());
        for (c, chunk) in groups.chunks_exact(nb).enumerate() {
            let rows = &mut plain[c * GROUP_ROWS * nb..(c + 1) * GROUP_ROWS * nb];
            for (b, g) in chunk.iter().enumerate() {
                for (r, row) in rows.chunks_exact_mut(nb).enumerate() {
                    row[b] = g.row(r);
                }
            }
        }
        f(plain)
    })
}

/// The `rows` rows of a chunk (`w`, `nb` super-blocks each) against every token group of `xl`
/// (`nb` super-blocks each) through the K-quant lanes `kernel`.
///
/// Super-block after super-block: its column of the chunk's rows is unpacked once (24 KiB
/// for 64 rows) and meets every pair of token groups' super-block (9 KiB), in L1 across the
/// chunk's sixteen four-row tiles, so the activations stream from memory once per chunk. The
/// terms go to the accumulator of the super-block's index modulo eight (the reference's
/// order), whose running sums wait in a per-thread buffer; the eight are summed in
/// [`crate::reference::sum_lanes8`]'s tree at the end.
fn klanes_chunk<W: KLaneWeight>(
    w: &[W],
    nb: usize,
    rows: usize,
    xl: &[KLaneBlock],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    kernel: KLanesFn,
) {
    let row_tiles = rows.div_ceil(TILE_ROWS);
    let groups = n_tokens.div_ceil(LANES);
    let pairs = groups.div_ceil(2);
    let per_lane = pairs * row_tiles;
    KLANES_SCRATCH.with_borrow_mut(|(unpacked, acc)| {
        acc.clear();
        acc.resize(BLOCK_LANES * per_lane, [[[0.0; LANES]; 2]; TILE_ROWS]);
        unpacked.resize(row_tiles * TILE_ROWS, KLaneRow::ZERO);
        for b in 0..nb {
            // Rows past the chunk's last (a short chunk) repeat it; their sums are dropped.
            for (i, u) in unpacked.iter_mut().enumerate() {
                w[i.min(rows - 1) * nb + b].unpack_into(u);
            }
            let acc = &mut acc[(b % BLOCK_LANES) * per_lane..][..per_lane];
            for (p, acc) in acc.chunks_exact_mut(row_tiles).enumerate() {
                let g = 2 * p;
                let x0 = &xl[g * nb + b];
                let x1 = (g + 1 < groups).then(|| &xl[(g + 1) * nb + b]);
                for (rt, acc) in acc.iter_mut().enumerate() {
                    let wr: [&KLaneRow; TILE_ROWS] =
                        std::array::from_fn(|j| &unpacked[rt * TILE_ROWS + j]);
                    kernel(W::KIND, &wr, x0, x1, acc);
                }
            }
        }
        // Each (row, token): its eight accumulators summed in the reference's tree, a whole
        // (row tile, pair) at a time (element-wise over arrays, which vectorizes), then
        // transposed into the outputs.
        for p in 0..pairs {
            for rt in 0..row_tiles {
                let i = p * row_tiles + rt;
                let a = |k: usize| &acc[k * per_lane + i];
                let mut sum: LanesAcc = [[[0.0; LANES]; 2]; TILE_ROWS];
                for (j, s) in sum.iter_mut().enumerate() {
                    for (g, s) in s.iter_mut().enumerate() {
                        for (l, s) in s.iter_mut().enumerate() {
                            let v = |k: usize| a(k)[j][g][l];
                            *s = ((v(0) + v(4)) + (v(2) + v(6))) + ((v(1) + v(5)) + (v(3) + v(7)));
                        }
                    }
                }
                for g in 0..2 {
                    let t0 = (2 * p + g) * LANES;
                    let t1 = n_tokens.min(t0 + LANES);
                    if t0 >= t1 {
                        break;
                    }
                    for (l, o) in outs[t0..t1].iter_mut().enumerate() {
                        let o = &mut o[rt * TILE_ROWS..rows.min((rt + 1) * TILE_ROWS)];
                        for (v, s) in o.iter_mut().zip(&sum) {
                            *v = s[g][l];
                        }
                    }
                }
            }
        }
    })
}
