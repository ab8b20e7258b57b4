//! Q4_0 and IQ4_NL matrices stored sixteen rows interleaved ([`BlockQ4_0x16`] and
//! [`BlockIQ4NLx16`], the `q4_0x16` and `iq4_nlx16` dtypes, one byte order for both): the
//! small-batch product of the tiers that have a kernel for them, and the way back to plain rows
//! for every other product. [`Codes`] says which of the two a group's nibbles are.
//!
//! In a plain Q4_0 matrix–vector product each 32-weight block of each row pays for its own
//! scale (an f16 conversion, a multiply, an add) and, in the AVX-512 pair kernel, for two
//! permutes that spread its nibbles into the activation's order: about ten vector instructions
//! per 64 weights, which keeps one core well below the memory bandwidth it could stream. With
//! sixteen rows interleaved, a 32-bit lane is a row: one load and a mask give four consecutive
//! codes of all sixteen rows, which meet the same four activation codes, broadcast, in one
//! integer dot; the sixteen scales convert in one instruction and the float work is done once
//! per block for sixteen rows. About 27 instructions per 512 weights instead of 80.
//!
//! A kernel call takes a few tokens ([`Group::tokens`]): the loads and masks of a block are
//! about half of those instructions, and a decoding step of several sequences, or a short
//! prompt, shares them. That is what lets a server's batched decode gain more than the
//! memory traffic it saves.
//!
//! Each row's sum is the scalar reference's, bit for bit: the integer dot of a block is exact,
//! and the float work per block is the reference's (Q4_0: `s + isum·(d_w·d_x)` in block order;
//! IQ4_NL: the same terms into eight accumulators by block, [`crate::reference::lanes_dot`]).
//! So a token's result is the same alone, in any batch, and on the scalar tier, and an
//! `iq4_nlx16` matrix gives exactly what the same blocks stored as plain `iq4_nl` give.
//!
//! IQ4_XS matrices stored the same way ([`kiln_format::BlockIQ4XSx16`], `iq4_xsx16`: a group is
//! sixteen rows' 256-weight super-blocks, each 32-weight sub-block's indices in this byte order)
//! have a kernel of their own over Q8_K activations ([`Group`]`<BlockIQ4XSx16, BlockQ8K>`, run
//! from [`crate::matmul`]'s K-quant products); every other path turns a chunk back into plain
//! rows for the K-quant lanes kernel or the IQ4_XS tiles.
//!
//! Batches that take the lanes kernels unpack each row straight from the interleaved bytes
//! ([`unpack_interleaved_row`], what the lanes kernel does to a plain row anyway). Tiers
//! without a kernel for the layout turn each sixteen-row chunk back into plain rows
//! ([`deinterleave_chunk`]) in a per-thread buffer and run their Q4_0 tiles on it: a copy of
//! the chunk, paid once per product for all its tokens.

use kiln_format::{BlockIQ4NL, BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};

use crate::lanes::LaneWeight;

/// What the nibbles of an interleaved group index: Q4_0's codes `q + 8`, or IQ4_NL's grid.
/// Everything that only moves bytes (the groups, unpacking a row, de-interleaving) is shared;
/// the kernels, the lanes kernel's offset and the plain tiles differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)] // the dtype names, as `DType` spells them
pub(crate) enum Codes {
    /// `q4_0x16`.
    Q4_0,
    /// `iq4_nlx16`.
    IQ4_NL,
}

impl Codes {
    /// The unsigned offset of the codes the lanes kernel takes ([`LaneWeight::OFFSET`]).
    pub(crate) fn lanes_offset(self) -> i32 {
        match self {
            Codes::Q4_0 => BlockQ4_0::OFFSET,
            Codes::IQ4_NL => BlockIQ4NL::OFFSET,
        }
    }

    /// The largest code the lanes kernel sees ([`LaneWeight::MAX_CODE`]).
    pub(crate) fn lanes_max_code(self) -> u8 {
        match self {
            Codes::Q4_0 => BlockQ4_0::MAX_CODE,
            Codes::IQ4_NL => BlockIQ4NL::MAX_CODE,
        }
    }

    /// Row `r` of one sixteen-row chunk unpacked for the lanes kernel, as
    /// [`crate::lanes::unpack_row`] gives the plain row.
    pub(crate) fn unpack_row(self, w: &[BlockQ4_0x16], r: usize, codes: &mut [u8], dw: &mut [f32]) {
        match self {
            Codes::Q4_0 => unpack_interleaved_row(w, r, codes, dw),
            Codes::IQ4_NL => unpack_interleaved_iq4_row(w, r, codes, dw),
        }
    }
}

/// One activation block prepared for the interleaved kernel, once per token per product: its
/// codes, `−8·Σx` (the correction for Q4_0's unsigned nibbles `q + 8`) and its scale in f32.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(8))]
pub(crate) struct GroupX {
    pub(crate) qs: [i8; QK],
    pub(crate) corr: i32,
    pub(crate) dx: f32,
}

impl GroupX {
    pub(crate) const ZERO: GroupX = GroupX {
        qs: [0; QK],
        corr: 0,
        dx: 0.0,
    };
}

/// Prepare one token's Q8_0 row (`out.len() == x.len()`).
pub(crate) fn prepare_group_x(x: &[BlockQ8_0], out: &mut [GroupX]) {
    assert_eq!(x.len(), out.len(), "prepare_group_x: length mismatch");
    for (o, b) in out.iter_mut().zip(x) {
        *o = GroupX {
            qs: b.qs,
            corr: -8 * b.qs.iter().map(|&q| i32::from(q)).sum::<i32>(),
            dx: b.d.to_f32(),
        };
    }
}

/// The interleaved kernel of a tier: the `nb` groups of one sixteen-row chunk (`w`) against
/// `out.len()` tokens' prepared rows (`x`: token after token, `nb` blocks each), writing token
/// `t`'s sum of row `r` to `out[t][r]`. `out.len()` runs from 1 to the kernel's
/// [`Group::tokens`]; each token's sums are the same bits whatever tokens share the call.
/// `W` is the layout's group, `X` what a token's block is prepared as ([`GroupX`] for the
/// 32-weight blocks, Q8_K itself for IQ4_XS's super-blocks).
pub(crate) type GroupFn<W, X> = fn(&[W], &[X], &mut [[f32; GROUP_ROWS]]);

/// The most tokens any tier's interleaved kernel takes per call.
pub(crate) const GROUP_TOKENS_MAX: usize = 8;

/// A tier's interleaved kernel and the most tokens it takes per call (as many as keep their
/// accumulators and the unpacked weights in registers).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group<W = BlockQ4_0x16, X = GroupX> {
    pub(crate) kernel: GroupFn<W, X>,
    pub(crate) tokens: usize,
}

/// The plain rows of one sixteen-row chunk (`w`: its `nb` groups) into `out` (`16·nb`
/// blocks, row after row).
pub(crate) fn deinterleave_chunk(w: &[BlockQ4_0x16], out: &mut Vec<BlockQ4_0>) {
    let nb = w.len();
    out.clear();
    out.resize(
        GROUP_ROWS * nb,
        BlockQ4_0 {
            d: half::f16::ZERO,
            qs: [0; QK / 2],
        },
    );
    for (b, g) in w.iter().enumerate() {
        for r in 0..GROUP_ROWS {
            out[r * nb + b] = g.row(r);
        }
    }
}

/// Row `r` of one sixteen-row chunk (`w`: its groups) unpacked for the lanes kernel, straight
/// from the interleaved bytes: `codes` gets 32 unsigned codes (`q + 8`) per block, `dw` the
/// block scales, as [`crate::lanes::unpack_row`] gives for the plain row.
pub(crate) fn unpack_interleaved_row(
    w: &[BlockQ4_0x16],
    r: usize,
    codes: &mut [u8],
    dw: &mut [f32],
) {
    for ((g, c), d) in w.iter().zip(codes.chunks_exact_mut(QK)).zip(dw.iter_mut()) {
        // `to_f32_const` is plain integer code the compiler inlines; `to_f32` checks the CPU for
        // F16C on every call, which cost a tenth of Q4_0 prefill here. Both are exact.
        *d = g.d[r].to_f32_const();
        for i in 0..QK / 8 {
            // Four bytes of the row at once: low nibbles are codes 4i.., high ones 16 + 4i...
            let at = 64 * i + 4 * r;
            let v = u32::from_le_bytes(g.qs[at..at + 4].try_into().expect("four bytes"));
            c[4 * i..4 * i + 4].copy_from_slice(&(v & 0x0f0f_0f0f).to_le_bytes());
            c[QK / 2 + 4 * i..QK / 2 + 4 * i + 4]
                .copy_from_slice(&((v >> 4) & 0x0f0f_0f0f).to_le_bytes());
        }
    }
}

/// [`unpack_interleaved_row`] for IQ4_NL indices: each block's sixteen index bytes gathered
/// from the interleaved bytes, then turned into offset grid codes (`grid + 128`) a run of
/// blocks at a time, as [`crate::lanes::unpack_iq4`] does for plain rows.
pub(crate) fn unpack_interleaved_iq4_row(
    w: &[BlockQ4_0x16],
    r: usize,
    codes: &mut [u8],
    dw: &mut [f32],
) {
    /// Blocks gathered per lookup run (a 256-byte stack buffer).
    const RUN: usize = 16;
    let mut qs = [[0u8; QK / 2]; RUN];
    for ((run, c), d) in w
        .chunks(RUN)
        .zip(codes.chunks_mut(RUN * QK))
        .zip(dw.chunks_mut(RUN))
    {
        for ((g, q), d) in run.iter().zip(qs.iter_mut()).zip(d.iter_mut()) {
            *d = g.d[r].to_f32_const();
            for i in 0..QK / 8 {
                let at = 64 * i + 4 * r;
                q[4 * i..4 * i + 4].copy_from_slice(&g.qs[at..at + 4]);
            }
        }
        crate::lanes::unpack_iq4(qs[..run.len()].iter(), c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::Kernels;
    use kiln_format::blocks::{interleave_q4_0, quantize_row_q4_0_ref, quantize_row_q8_0_ref};
    use kiln_format::iq4::{interleave_iq4_nl, quantize_row_iq4_nl_ref};
    use proptest::prelude::*;

    #[test]
    fn a_chunk_deinterleaves_to_its_rows() {
        let nb = 3;
        let v: Vec<f32> = (0..32 * nb * QK)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let rows = quantize_row_q4_0_ref(&v).unwrap();
        let g = interleave_q4_0(&rows, nb);
        let mut out = Vec::new();
        deinterleave_chunk(&g[nb..2 * nb], &mut out);
        assert_eq!(out, rows[16 * nb..]);
        for r in 0..16 {
            let (mut c0, mut d0) = (vec![0u8; nb * QK], vec![0f32; nb]);
            let (mut c1, mut d1) = (vec![1u8; nb * QK], vec![1f32; nb]);
            crate::lanes::unpack_row(&rows[(16 + r) * nb..(17 + r) * nb], &mut c0, &mut d0);
            unpack_interleaved_row(&g[nb..2 * nb], r, &mut c1, &mut d1);
            assert_eq!((c0, d0), (c1, d1), "row {r}");
        }
    }

    /// An IQ4_NL row unpacked from the interleaved bytes is the plain row's unpacking (grid
    /// values plus 128), over more blocks than one lookup run takes.
    #[test]
    fn an_iq4_nl_chunk_unpacks_to_its_rows() {
        let nb = 19;
        let v: Vec<f32> = (0..16 * nb * QK)
            .map(|i| ((i * 53 % 211) as f32 - 105.0) / 9.0)
            .collect();
        let rows = quantize_row_iq4_nl_ref(&v).unwrap();
        let g = interleave_iq4_nl(&rows, nb);
        let nibbles: &[BlockQ4_0x16] = bytemuck::cast_slice(&g);
        for r in 0..16 {
            let (mut c0, mut d0) = (vec![0u8; nb * QK], vec![0f32; nb]);
            let (mut c1, mut d1) = (vec![1u8; nb * QK], vec![1f32; nb]);
            crate::lanes::unpack_row(&rows[r * nb..(r + 1) * nb], &mut c0, &mut d0);
            Codes::IQ4_NL.unpack_row(nibbles, r, &mut c1, &mut d1);
            assert_eq!((c0, d0), (c1, d1), "row {r}");
        }
    }

    /// Checks that `n` tokens through the interleaved matrix `mi` at tier `k` get exactly what
    /// they get through the same blocks stored plainly (`mp`); returns the interleaved path.
    fn same_as_plain(
        k: &Kernels,
        mp: &crate::Matrix,
        mi: &crate::Matrix,
        n: usize,
        pool: &crate::Pool,
    ) -> crate::Path {
        let (rows, cols) = (mi.rows, mi.cols);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 613 % 401) as f32 - 200.0) / 53.0)
            .collect();
        let path = crate::plan(k, mi, n);
        let (mut want, mut got) = (vec![0f32; n * rows], vec![f32::NAN; n * rows]);
        k.matmul(mp, &x, n, &mut want, pool);
        k.matmul(mi, &x, n, &mut got, pool);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{:?} n={n} ({path}): interleaved rows differ from the plain rows",
            k.isa()
        );
        path
    }

    /// Interleaved IQ4_NL through the paths a tier without its interleaved kernel takes: the
    /// lanes kernel from 48 tokens (what the AVX-512 tier's prompts take) and the plain tiles
    /// on de-interleaved chunks below; each gives exactly what the plain rows give.
    #[test]
    fn interleaved_iq4_nl_without_its_kernel_gives_the_plain_rows_bits() {
        use crate::{Matrix, Path, Pool, WeightData};
        let (rows, cols) = (48, 7 * QK);
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0)
            .collect();
        let plain = quantize_row_iq4_nl_ref(&v).unwrap();
        let x16 = interleave_iq4_nl(&plain, cols / QK);
        let mp = Matrix::new(rows, cols, WeightData::IQ4_NL(&plain)).unwrap();
        let mi = Matrix::new(rows, cols, WeightData::IQ4_NLx16(&x16)).unwrap();
        let pool = Pool::new(2).unwrap();
        let mut lanes_seen = false;
        for isa in crate::isa::tested_isas() {
            let Some(k) = crate::kernels(isa) else {
                continue;
            };
            let k = Kernels {
                group_iq4_nlx16: None,
                ..k.clone()
            };
            for n in [1, 5, 50] {
                let path = same_as_plain(&k, &mp, &mi, n, &pool);
                lanes_seen |= path == Path::Lanes;
                assert!(
                    matches!(path, Path::Lanes | Path::Deinterleaved { .. }),
                    "{isa:?} n={n}: {path}"
                );
            }
        }
        // The lanes path is exercised wherever a tested tier has the lanes kernel (every x86
        // tier).
        let has_lanes = crate::isa::tested_isas()
            .into_iter()
            .any(|i| crate::kernels(i).is_some_and(|k| k.lanes.is_some()));
        assert_eq!(lanes_seen, has_lanes);
    }

    /// Interleaved IQ4_XS at every tier, with and without its interleaved kernel: the kernel
    /// (decode, short batches), the K-quant lanes kernel on de-interleaved chunks (prompts at
    /// AVX-512, and wherever the kernel is missing) and the plain tiles on de-interleaved
    /// chunks; each gives exactly what the plain rows give.
    #[test]
    fn interleaved_iq4_xs_gives_the_plain_rows_bits_on_every_path() {
        use crate::{Matrix, Path, Pool, WeightData};
        use kiln_format::iq4::{interleave_iq4_xs, quantize_row_iq4_xs_ref};
        let (rows, cols) = (48, 9 * kiln_format::QK_K);
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0)
            .collect();
        let plain = quantize_row_iq4_xs_ref(&v).unwrap();
        let x16 = interleave_iq4_xs(&plain, cols / kiln_format::QK_K);
        let mp = Matrix::new(rows, cols, WeightData::IQ4_XS(&plain)).unwrap();
        let mi = Matrix::new(rows, cols, WeightData::IQ4_XSx16(&x16)).unwrap();
        let pool = Pool::new(2).unwrap();
        let mut seen = Vec::new();
        for isa in crate::isa::tested_isas() {
            let Some(k) = crate::kernels(isa) else {
                continue;
            };
            let without = Kernels {
                group_iq4_xsx16: None,
                ..k.clone()
            };
            for k in [k, &without] {
                for n in [1, 3, 5, 40] {
                    let path = same_as_plain(k, &mp, &mi, n, &pool);
                    seen.push(std::mem::discriminant(&path));
                }
            }
        }
        // The de-interleaved tiles are taken at every tier without the kernel (scalar at
        // least); the interleaved kernel and the K-quant lanes wherever x86 is tested.
        let had = |p: Path| seen.contains(&std::mem::discriminant(&p));
        assert!(had(Path::Deinterleaved {
            tokens: 1,
            wide: false
        }));
        let x86 = crate::isa::tested_isas()
            .into_iter()
            .any(|i| crate::kernels(i).is_some_and(|k| k.group_iq4_xsx16.is_some()));
        assert_eq!(had(Path::Interleaved { tokens: 1 }), x86);
        assert_eq!(had(Path::KLanes), x86);
    }

    #[test]
    fn prepared_blocks_carry_the_offset_correction() {
        let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
        let q = quantize_row_q8_0_ref(&x).unwrap();
        let mut p = [GroupX::ZERO; 2];
        prepare_group_x(&q, &mut p);
        for (p, q) in p.iter().zip(&q) {
            assert_eq!(p.qs, q.qs);
            assert_eq!(p.dx, q.d.to_f32());
            assert_eq!(p.corr, -8 * q.qs.iter().map(|&c| c as i32).sum::<i32>());
        }
    }

    proptest! {
        /// Every tier's interleaved kernels (Q4_0 and IQ4_NL) give the scalar reference's bits
        /// for every row and every token, from one token per call to the kernel's most, on
        /// whole and partial scale ranges (rows with tiny and large scales side by side),
        /// including blocks of zero scale: a token's sums do not depend on which tokens share
        /// its call. Up to eleven blocks, so IQ4_NL's eight accumulators wrap.
        #[test]
        fn interleaved_kernels_equal_reference_bits(
            nb in 1usize..12,
            seed in prop::collection::vec(-8.0f32..8.0, 16 * 32 * 11),
            acts in prop::collection::vec(-4.0f32..4.0, GROUP_TOKENS_MAX * 32 * 11),
            row_scale in prop::collection::vec(
                prop::sample::select(vec![0.0f32, 1e-3, 1.0, 50.0]), 16),
            tok_scale in prop::collection::vec(
                prop::sample::select(vec![0.0f32, 1e-2, 1.0, 30.0]), GROUP_TOKENS_MAX),
        ) {
            let n = nb * QK;
            let rows: Vec<f32> = (0..GROUP_ROWS)
                .flat_map(|r| {
                    let k = row_scale[r];
                    seed[r * n..(r + 1) * n].iter().map(move |v| v * k)
                })
                .collect();
            let q4 = interleave_q4_0(&quantize_row_q4_0_ref(&rows).unwrap(), nb);
            let iq4 = interleave_iq4_nl(&quantize_row_iq4_nl_ref(&rows).unwrap(), nb);
            let xs: Vec<Vec<BlockQ8_0>> = (0..GROUP_TOKENS_MAX)
                .map(|t| {
                    let v: Vec<f32> = acts[t * n..(t + 1) * n].iter().map(|a| a * tok_scale[t]).collect();
                    quantize_row_q8_0_ref(&v).unwrap()
                })
                .collect();
            let mut gx = vec![GroupX::ZERO; GROUP_TOKENS_MAX * nb];
            for (x, o) in xs.iter().zip(gx.chunks_exact_mut(nb)) {
                prepare_group_x(x, o);
            }
            for (codes, isa) in [Codes::Q4_0, Codes::IQ4_NL]
                .into_iter()
                .flat_map(|c| crate::isa::tested_isas().into_iter().map(move |i| (c, i)))
            {
                let Some(group) = crate::kernels(isa).and_then(|k| k.interleaved_group(codes)) else {
                    continue;
                };
                let groups: &[BlockQ4_0x16] = match codes {
                    Codes::Q4_0 => &q4,
                    Codes::IQ4_NL => bytemuck::cast_slice(&iq4),
                };
                let want: Vec<[f32; GROUP_ROWS]> = xs
                    .iter()
                    .map(|x| {
                        let mut o = [f32::NAN; GROUP_ROWS];
                        match codes {
                            Codes::Q4_0 => crate::reference::matvec_q4_0x16_ref(&q4, x, &mut o),
                            Codes::IQ4_NL => {
                                crate::reference::matvec_iq4_nlx16_ref(&iq4, x, &mut o)
                            }
                        }
                        o
                    })
                    .collect();
                prop_assert!((1..=GROUP_TOKENS_MAX).contains(&group.tokens));
                for tokens in 1..=group.tokens {
                    // Tokens from the start, `tokens` per call, the last call maybe shorter.
                    for t0 in (0..GROUP_TOKENS_MAX).step_by(tokens) {
                        let k = tokens.min(GROUP_TOKENS_MAX - t0);
                        let mut got = vec![[f32::NAN; GROUP_ROWS]; k];
                        (group.kernel)(groups, &gx[t0 * nb..(t0 + k) * nb], &mut got);
                        for (t, got) in got.iter().enumerate() {
                            for r in 0..GROUP_ROWS {
                                prop_assert_eq!(
                                    got[r].to_bits(),
                                    want[t0 + t][r].to_bits(),
                                    "{:?} {:?}, {} per call, token {}, row {}: {} vs {}",
                                    codes, isa, tokens, t0 + t, r, got[r], want[t0 + t][r]
                                );
                            }
                        }
                    }
                }
            }
        }

        /// Every tier's interleaved IQ4_XS kernel gives the scalar reference's bits for every
        /// row and token, one token per call to the kernel's most: sub-block scales of every
        /// value GGML's rule gives, rows and tokens of very different scales, Q8_K codes of
        /// −128, and up to eleven super-blocks, so the eight accumulators wrap.
        #[test]
        fn interleaved_iq4_xs_kernel_equals_reference_bits(
            nb in 1usize..12,
            seed in prop::collection::vec(-8.0f32..8.0, 16 * 256),
            acts in prop::collection::vec(-4.0f32..4.0, GROUP_TOKENS_MAX * 256),
            row_scale in prop::collection::vec(
                prop::sample::select(vec![0.0f32, 1e-3, 1.0, 50.0]), 16),
            tok_scale in prop::collection::vec(
                prop::sample::select(vec![0.0f32, 1e-2, 1.0, 30.0, -30.0]), GROUP_TOKENS_MAX),
        ) {
            use kiln_format::iq4::{interleave_iq4_xs, quantize_row_iq4_xs_ref};
            use kiln_format::kquants::quantize_block_q8_k_ref;
            use kiln_format::{BlockQ8K, QK_K};
            let n = nb * QK_K;
            // Each super-block of a row a different stretch of the seed, and a different size
            // in each super-block (so the sub-block scales spread).
            let seed = &seed;
            let rows: Vec<f32> = (0..GROUP_ROWS)
                .flat_map(|r| {
                    let k = row_scale[r];
                    (0..n).map(move |j| {
                        let b = j / QK_K;
                        seed[(r * 97 + b * 31 + j) % seed.len()] * k * (1.0 + (b % 4) as f32)
                    })
                })
                .collect();
            let xs16 = interleave_iq4_xs(&quantize_row_iq4_xs_ref(&rows).unwrap(), nb);
            let mut xq: Vec<BlockQ8K> = (0..GROUP_TOKENS_MAX)
                .flat_map(|t| {
                    let v: Vec<f32> = (0..n)
                        .map(|j| acts[(t * 131 + j) % acts.len()] * tok_scale[t])
                        .collect();
                    v.chunks_exact(QK_K)
                        .map(|c| quantize_block_q8_k_ref(c.try_into().unwrap()))
                        .collect::<Vec<_>>()
                })
                .collect();
            // GGML's rule never gives −128 (its scale maps the largest magnitude to ±127), but
            // a Q8_K block may hold it; every eleventh code of the odd tokens is set to it.
            for (i, b) in xq.iter_mut().enumerate() {
                if (i / nb) % 2 == 1 {
                    b.qs.iter_mut().step_by(11).for_each(|q| *q = -128);
                }
            }
            let want: Vec<[f32; GROUP_ROWS]> = xq
                .chunks_exact(nb)
                .map(|x| {
                    let mut o = [f32::NAN; GROUP_ROWS];
                    crate::reference::matvec_iq4_xsx16_ref(&xs16, x, &mut o);
                    o
                })
                .collect();
            for isa in crate::isa::tested_isas() {
                let Some(group) = crate::kernels(isa).and_then(|k| k.group_iq4_xsx16) else {
                    continue;
                };
                prop_assert!((1..=GROUP_TOKENS_MAX).contains(&group.tokens));
                for tokens in 1..=group.tokens {
                    for t0 in (0..GROUP_TOKENS_MAX).step_by(tokens) {
                        let k = tokens.min(GROUP_TOKENS_MAX - t0);
                        let mut got = vec![[f32::NAN; GROUP_ROWS]; k];
                        (group.kernel)(&xs16, &xq[t0 * nb..(t0 + k) * nb], &mut got);
                        for (t, got) in got.iter().enumerate() {
                            for r in 0..GROUP_ROWS {
                                prop_assert_eq!(
                                    got[r].to_bits(),
                                    want[t0 + t][r].to_bits(),
                                    "{:?}, {} per call, token {}, row {}: {} vs {}",
                                    isa, tokens, t0 + t, r, got[r], want[t0 + t][r]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
