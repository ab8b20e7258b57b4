//! Prefill with tokens in vector lanes: the layouts behind the lanes kernels of the tiers that
//! have one (AVX-512 and AVX2, whose block lanes kernel [`crate::plan`] gives Q8_0 and IQ4_NL
//! weights only, for block weights; AVX-512 and AVX2 for float weights).
//!
//! A block-weight product for one token costs a horizontal layout: each integer dot leaves
//! partial sums in lanes that must be scaled and added per block. With sixteen tokens side by
//! side, a lane is a token instead: four codes of one weight row, broadcast to every lane,
//! meet four codes of sixteen tokens in one `vpdpbusd`, eight of those make a block's exact
//! integer dot for all sixteen tokens, and one conversion and two multiplies and an add apply
//! the scales. Nothing is ever reduced across lanes. Float weights work the same way with one
//! broadcast FMA per column, in tiles of [`FLOAT_TILE`] tokens and [`FLOAT_ROWS`] rows: each
//! column loads two vectors of tokens and eight broadcast weights for sixteen FMAs, so the
//! kernel is bound by the FMA units, not by its loads.
//!
//! To make that possible the activations of a batch are transposed once per product: into
//! [`LaneBlock`]s for block weights (`codes[g][t]`: codes `4g..4g+4` of token `t`), into
//! `x[c][t]` rows for float weights. Each weight row is unpacked once per product, into
//! unsigned bytes (`w + OFFSET`) and an f32 scale per block ([`LaneWeight`]), or widened to
//! f32 (`matmul`'s `LaneFloat`) a block of columns at a time, and every token group of the batch then
//! reads it.
//!
//! For block weights each block's integer sum is exact and the float work per block is the
//! scalar reference's (`s + isum·(d_w·d_x)`, block after block), so the lanes kernel gives the
//! reference's bits. For float weights each sum is one chain of fused multiply-adds in column
//! order ([`crate::reference::float_lanes_ref`]), in every tier that has the kernel. The
//! one-token tiles sum in a different order (partial sums per lane, added at the end), so a
//! token's result in a batch that takes the lanes kernels ([`crate::Path::Lanes`],
//! [`crate::Path::FloatLanes`]) may differ from the same token alone in the last bits, as any
//! two float summation orders do.

use kiln_format::{BlockQ4_0, BlockQ8_0, QK};

use crate::tile::TILE_ROWS;

/// Tokens per lane group: one 512-bit vector of 32-bit lanes.
pub(crate) const LANES: usize = 16;

/// One block of sixteen tokens' Q8_0 activations, transposed for the lanes kernel.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct LaneBlock {
    /// `codes[g][t]`: codes `4g..4g + 4` of token `t`.
    pub(crate) codes: [[[i8; 4]; LANES]; QK / 4],
    /// `−OFFSET·Σx` over the block, per token: corrects the weights' unsigned offset.
    pub(crate) corr: [i32; LANES],
    /// The block's scale, per token.
    pub(crate) dx: [f32; LANES],
}

impl LaneBlock {
    /// Zero codes and scales: a padding token, whose results are exact zeros.
    pub(crate) const ZERO: LaneBlock = LaneBlock {
        codes: [[[0; 4]; LANES]; QK / 4],
        corr: [0; LANES],
        dx: [0.0; LANES],
    };
}

/// Running sums of a lanes kernel call: `[row][group][token]`, two groups of sixteen tokens.
pub(crate) type LanesAcc = [[[f32; LANES]; 2]; TILE_ROWS];

/// The lanes kernel of a tier: `TILE_ROWS` unpacked weight rows (`codes[r]` holds
/// `32 · x0.len()` bytes, `dw[r]` one scale per block, every code at most `max_code`, the
/// encoding's [`LaneWeight::MAX_CODE`]) against one group of sixteen tokens (`x0`), or two
/// (`x1` too, the same blocks), adding each block's `isum·(d_w·d_x)` to the running sums
/// `acc[r][g][t]` block after block. Sums carried from call to call through `acc` take no
/// other rounding, so a product cut into blocks of columns gives the scalar reference's bits,
/// as one call over all of them does. (`max_code` lets a kernel without a four-byte dot, AVX2,
/// add several products of small codes in 16 bits before widening them.)
pub(crate) type LanesFn = fn(
    &[&[u8]; TILE_ROWS],
    &[&[f32]; TILE_ROWS],
    u8,
    &[LaneBlock],
    Option<&[LaneBlock]>,
    &mut LanesAcc,
);

/// Tokens per float token tile: the float lanes kernel's activations are transposed in tiles
/// of this many tokens (`x[c][t]`), two 512-bit vectors (or four 256-bit ones) per column.
pub(crate) const FLOAT_TILE: usize = 32;

/// Weight rows per float lanes kernel call.
pub(crate) const FLOAT_ROWS: usize = 8;

/// Running sums of a float lanes call: `[row][token]`.
pub(crate) type FloatAcc = [[f32; FLOAT_TILE]; FLOAT_ROWS];

/// The float lanes kernel of a tier: `FLOAT_ROWS` weight rows widened to f32 (a block of
/// `x.len()` columns each) against the same columns of one token tile (`x[c][t]`), added to
/// the running sums `acc[r][t]` for the first `tokens` tokens (1..=[`FLOAT_TILE`]; lanes past
/// them may be left as they were or get the padding's zeros).
///
/// Each (row, token) sum is one chain of fused multiply-adds over the columns in order,
/// `acc = fma(w[c], x[c], acc)`, carried across calls through `acc` without any other
/// rounding: the result is [`crate::reference::float_lanes_ref`]'s, bit for bit, however the
/// columns are cut into blocks, the rows into chunks or the tokens into tiles, and in every
/// tier that has the kernel.
pub(crate) type FloatLanesFn =
    fn(&[&[f32]; FLOAT_ROWS], &[[f32; FLOAT_TILE]], usize, &mut FloatAcc);

/// Transpose up to [`FLOAT_TILE`] tokens' rows (`x`, `cols` each) into `out[c][t]`; missing
/// tokens are zero lanes.
pub(crate) fn prepare_float_tile(x: &[f32], cols: usize, out: &mut [[f32; FLOAT_TILE]]) {
    debug_assert!(x.len() <= FLOAT_TILE * cols && out.len() == cols);
    out.fill([0.0; FLOAT_TILE]);
    for (t, row) in x.chunks_exact(cols).enumerate() {
        for (o, &v) in out.iter_mut().zip(row) {
            o[t] = v;
        }
    }
}

/// A block encoding the lanes kernel takes, once unpacked to unsigned codes.
pub(crate) trait LaneWeight: kiln_format::BlockType {
    /// What makes the codes unsigned: the unpacked code is `weight + OFFSET`.
    const OFFSET: i32;
    /// The largest unpacked code the encoding can hold.
    const MAX_CODE: u8;
    /// Write the block's unsigned codes (weight `j` in byte `j`) and return its scale.
    fn unpack(&self, codes: &mut [u8; QK]) -> f32;
    /// [`LaneWeight::unpack`] of each block of `row` into the next 32 bytes of `codes` and the
    /// next scale of `dw` (an encoding may do the whole run at once).
    fn unpack_blocks(row: &[Self], codes: &mut [u8], dw: &mut [f32])
    where
        Self: Sized,
    {
        for ((w, c), d) in row
            .iter()
            .zip(codes.chunks_exact_mut(QK))
            .zip(dw.iter_mut())
        {
            *d = w.unpack(c.try_into().expect("QK chunk"));
        }
    }
}

impl LaneWeight for BlockQ8_0 {
    const OFFSET: i32 = 128;
    const MAX_CODE: u8 = 255;
    fn unpack(&self, codes: &mut [u8; QK]) -> f32 {
        *codes = self.qs.map(|q| (q as u8) ^ 0x80);
        self.d.to_f32_const()
    }
}

impl LaneWeight for BlockQ4_0 {
    /// Q4_0 stores `q + 8` already.
    const OFFSET: i32 = 8;
    const MAX_CODE: u8 = 15;
    fn unpack(&self, codes: &mut [u8; QK]) -> f32 {
        let (lo, hi) = codes.split_at_mut(QK / 2);
        lo.copy_from_slice(&self.qs.map(|q| q & 0x0f));
        hi.copy_from_slice(&self.qs.map(|q| q >> 4));
        self.d.to_f32_const()
    }
}

impl LaneWeight for kiln_format::BlockQ5_0 {
    /// Q5_0's five-bit codes are `q + 16`.
    const OFFSET: i32 = 16;
    const MAX_CODE: u8 = 31;
    fn unpack(&self, codes: &mut [u8; QK]) -> f32 {
        *codes = kiln_format::q5::q5_codes(self.qh, &self.qs);
        self.d.to_f32_const()
    }
}

/// Both weights of an IQ4 index byte as offset codes: `IQ4_PAIRS[q]` is the grid values of
/// its low and high nibble, plus 128 (one lookup per byte where the rows are unpacked, which
/// at short prompts is a visible share of an IQ4 product).
const IQ4_PAIRS: [[u8; 2]; 256] = {
    let grid = kiln_format::iq4::IQ4_GRID;
    let mut t = [[0u8; 2]; 256];
    let mut q = 0;
    while q < 256 {
        t[q] = [(grid[q & 0x0f] as u8) ^ 0x80, (grid[q >> 4] as u8) ^ 0x80];
        q += 1;
    }
    t
};

/// Each sixteen IQ4 index bytes of `chunks` as the next 32 offset codes of `out`: weight `j`
/// (the low nibble of byte `j`) in byte `j`, weight `j + 16` (its high nibble) in byte
/// `j + 16`; as many chunks as `out` has room for. On x86-64 with SSSE3, two 16-byte table
/// lookups a chunk ([`crate::simd::x86::iq4`]); elsewhere [`unpack_iq4_ref`].
#[inline]
pub(crate) fn unpack_iq4<'a>(chunks: impl Iterator<Item = &'a [u8; 16]>, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::x86::iq4::available() {
        return crate::simd::x86::iq4::unpack(chunks, out);
    }
    unpack_iq4_ref(chunks, out)
}

/// [`unpack_iq4`] a byte at a time: the specification the SIMD unpacking is tested against.
#[inline]
pub(crate) fn unpack_iq4_ref<'a>(chunks: impl Iterator<Item = &'a [u8; 16]>, out: &mut [u8]) {
    for (qs, o) in chunks.zip(out.chunks_exact_mut(QK)) {
        let (lo, hi) = o.split_at_mut(QK / 2);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
            [*l, *h] = IQ4_PAIRS[usize::from(q)];
        }
    }
}

impl LaneWeight for kiln_format::BlockIQ4NL {
    /// IQ4_NL's codes index GGML's non-linear grid (−127..=113): each weight is its grid value,
    /// plus 128.
    const OFFSET: i32 = 128;
    const MAX_CODE: u8 = 241;
    fn unpack(&self, codes: &mut [u8; QK]) -> f32 {
        unpack_iq4(std::iter::once(&self.qs), codes);
        self.d.to_f32_const()
    }
    fn unpack_blocks(row: &[Self], codes: &mut [u8], dw: &mut [f32]) {
        unpack_iq4(row.iter().map(|b| &b.qs), codes);
        for (d, b) in dw.iter_mut().zip(row) {
            *d = b.d.to_f32_const();
        }
    }
}

/// Check the lengths a block lanes kernel relies on: every row's codes hold `32 · nb` bytes
/// and its scales `nb`, for the `nb` blocks of `x0` (and of `x1`, if given). The safe wrappers
/// of the SIMD tiers call this before their `unsafe` kernel calls.
#[cfg(target_arch = "x86_64")]
pub(crate) fn check_lanes_tile(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x0: &[LaneBlock],
    x1: Option<&[LaneBlock]>,
) {
    let nb = x0.len();
    assert!(
        codes.iter().all(|c| c.len() == 32 * nb)
            && dw.iter().all(|d| d.len() == nb)
            && x1.is_none_or(|x1| x1.len() == nb),
        "lanes tile: row length mismatch"
    );
}

/// Unpack one weight row into `codes` (32 bytes per block) and `dw` (one scale per block).
pub(crate) fn unpack_row<W: LaneWeight>(row: &[W], codes: &mut [u8], dw: &mut [f32]) {
    W::unpack_blocks(row, codes, dw)
}

/// Transpose up to sixteen tokens' Q8_0 rows (`xq`, `nb` blocks each) into `out` (`nb`
/// blocks), for weights with unsigned offset `offset`; missing tokens are zero lanes.
pub(crate) fn prepare_group(xq: &[BlockQ8_0], nb: usize, offset: i32, out: &mut [LaneBlock]) {
    debug_assert!(xq.len() <= LANES * nb && out.len() == nb);
    for (b, o) in out.iter_mut().enumerate() {
        *o = LaneBlock::ZERO;
        for (t, row) in xq.chunks_exact(nb).enumerate() {
            let x = &row[b];
            for (g, q) in x.qs.chunks_exact(4).enumerate() {
                o.codes[g][t].copy_from_slice(q);
            }
            o.corr[t] = -offset * x.qs.iter().map(|&q| q as i32).sum::<i32>();
            o.dx[t] = x.d.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_format::blocks::{quantize_row_q4_0_ref, quantize_row_q8_0_ref};
    use proptest::prelude::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    proptest! {
        /// The IQ4 unpacking this CPU takes gives the byte-at-a-time table's codes.
        #[test]
        fn iq4_unpacking_equals_the_reference(
            qs in prop::collection::vec(prop::array::uniform16(any::<u8>()), 1..12),
        ) {
            let (mut got, mut want) = (vec![0u8; 32 * qs.len()], vec![0u8; 32 * qs.len()]);
            unpack_iq4(qs.iter(), &mut got);
            unpack_iq4_ref(qs.iter(), &mut want);
            prop_assert_eq!(got, want);
        }
    }

    /// Unpacked codes minus the offset are the weights' integer codes, in order.
    #[test]
    fn unpacked_codes_are_the_weights_plus_the_offset() {
        let v = values(3 * QK, 1);
        let q4 = quantize_row_q4_0_ref(&v).unwrap();
        let q8 = quantize_row_q8_0_ref(&v).unwrap();
        let (mut c4, mut d4) = (vec![0u8; 3 * QK], vec![0.0; 3]);
        let (mut c8, mut d8) = (vec![0u8; 3 * QK], vec![0.0; 3]);
        unpack_row(&q4, &mut c4, &mut d4);
        unpack_row(&q8, &mut c8, &mut d8);
        for b in 0..3 {
            assert_eq!(d4[b], q4[b].d.to_f32());
            assert_eq!(d8[b], q8[b].d.to_f32());
            for j in 0..QK {
                let nibble = if j < 16 {
                    q4[b].qs[j] & 0x0f
                } else {
                    q4[b].qs[j - 16] >> 4
                };
                assert_eq!(c4[b * QK + j] as i32 - BlockQ4_0::OFFSET, nibble as i32 - 8);
                assert_eq!(
                    c8[b * QK + j] as i32 - BlockQ8_0::OFFSET,
                    q8[b].qs[j] as i32
                );
            }
        }
        // IQ4_NL: every index (the Q4_0 nibbles reused) gives its grid value.
        let iq4: Vec<kiln_format::BlockIQ4NL> = q4
            .iter()
            .map(|b| kiln_format::BlockIQ4NL { d: b.d, qs: b.qs })
            .collect();
        let (mut ci, mut di) = (vec![0u8; 3 * QK], vec![0.0; 3]);
        unpack_row(&iq4, &mut ci, &mut di);
        let mut dq = vec![0.0f32; 3 * QK];
        kiln_format::iq4::dequantize_row_iq4_nl(&iq4, &mut dq);
        for (j, (&c, &w)) in ci.iter().zip(&dq).enumerate() {
            let grid = c as i32 - kiln_format::BlockIQ4NL::OFFSET;
            assert_eq!(grid as f32 * di[j / QK], w, "weight {j}");
        }
    }

    /// Every token's codes land in its lane, in groups of four; missing tokens are zeros.
    #[test]
    fn prepared_groups_transpose_tokens_into_lanes() {
        let (nb, n) = (2, 5);
        let xq = quantize_row_q8_0_ref(&values(n * nb * QK, 7)).unwrap();
        let mut out = vec![LaneBlock::ZERO; nb];
        prepare_group(&xq, nb, 8, &mut out);
        for (b, o) in out.iter().enumerate() {
            for t in 0..LANES {
                let x = (t < n).then(|| xq[t * nb + b]);
                for j in 0..QK {
                    assert_eq!(o.codes[j / 4][t][j % 4], x.map_or(0, |x| x.qs[j]));
                }
                let sum: i32 = x.map_or(0, |x| x.qs.iter().map(|&q| q as i32).sum());
                assert_eq!(o.corr[t], -8 * sum);
                assert_eq!(o.dx[t], x.map_or(0.0, |x| x.d.to_f32()));
            }
        }
    }

    /// A tier's lanes kernel against the scalar reference dot of every (row, token): the same
    /// bits, for one to sixteen tokens (the rest zero lanes, giving exact zeros).
    fn lanes_equal_reference<W: LaneWeight>(
        lanes_tile: LanesFn,
        rows: &[Vec<W>],
        xs: &[Vec<BlockQ8_0>],
        dot: fn(&[W], &[BlockQ8_0]) -> f32,
    ) {
        let nb = xs[0].len();
        let mut codes = vec![vec![0u8; nb * 32]; TILE_ROWS];
        let mut dw = vec![vec![0.0f32; nb]; TILE_ROWS];
        for r in 0..TILE_ROWS {
            unpack_row(&rows[r], &mut codes[r], &mut dw[r]);
        }
        let flat: Vec<BlockQ8_0> = xs.iter().flatten().copied().collect();
        let mut x = vec![LaneBlock::ZERO; nb];
        prepare_group(&flat, nb, W::OFFSET, &mut x);
        // One call over every block, and the blocks cut in two calls (sums carried in acc),
        // with the group alone and as both groups of a pair.
        let cut = nb / 2;
        let part = |v: &[u8], lo: usize, hi: usize| v[32 * lo..32 * hi].to_vec();
        for split in [false, true] {
            let mut acc: LanesAcc = [[[0.0; 16]; 2]; TILE_ROWS];
            let mut acc1: LanesAcc = [[[0.0; 16]; 2]; TILE_ROWS];
            let ranges = if split {
                vec![(0, cut), (cut, nb)]
            } else {
                vec![(0, nb)]
            };
            for (lo, hi) in ranges {
                let cs: Vec<Vec<u8>> = codes.iter().map(|c| part(c, lo, hi)).collect();
                let cr: [&[u8]; TILE_ROWS] = std::array::from_fn(|r| cs[r].as_slice());
                let dr: [&[f32]; TILE_ROWS] = std::array::from_fn(|r| &dw[r][lo..hi]);
                lanes_tile(&cr, &dr, W::MAX_CODE, &x[lo..hi], None, &mut acc);
                lanes_tile(
                    &cr,
                    &dr,
                    W::MAX_CODE,
                    &x[lo..hi],
                    Some(&x[lo..hi]),
                    &mut acc1,
                );
            }
            for r in 0..TILE_ROWS {
                for t in 0..16 {
                    let want = xs.get(t).map_or(0.0, |x| dot(&rows[r], x));
                    assert_eq!(acc[r][0][t].to_bits(), want.to_bits(), "row {r} token {t}");
                    for (g, pair) in acc1[r].iter().enumerate() {
                        assert_eq!(
                            pair[t].to_bits(),
                            want.to_bits(),
                            "pair {g} row {r} token {t}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Every tier's block lanes kernel gives the scalar reference's bits for each encoding
        /// it may be handed (Q8_0, Q4_0, Q5_0, IQ4_NL), one to sixteen tokens, the blocks in one
        /// call or two, one group or a pair.
        #[test]
        fn lanes_tile_equals_reference_bits(
            nb in 1usize..7,
            n in 1usize..=16,
            seed in prop::collection::vec(-8.0f32..8.0, 20 * 32 * 6),
        ) {
            let len = nb * 32;
            let vals = |i: usize| &seed[i * len..(i + 1) * len];
            let xs: Vec<Vec<BlockQ8_0>> =
                (0..n).map(|i| quantize_row_q8_0_ref(vals(i)).unwrap()).collect();
            let q8: Vec<Vec<BlockQ8_0>> =
                (16..20).map(|i| quantize_row_q8_0_ref(vals(i)).unwrap()).collect();
            let q4: Vec<Vec<BlockQ4_0>> =
                (16..20).map(|i| quantize_row_q4_0_ref(vals(i)).unwrap()).collect();
            let q5: Vec<Vec<kiln_format::BlockQ5_0>> = (16..20)
                .map(|i| kiln_format::q5::quantize_row_q5_0_ref(vals(i)).unwrap())
                .collect();
            // IQ4_NL: the Q4_0 blocks' bytes as grid indices, a scale from the same values.
            let iq4: Vec<Vec<kiln_format::BlockIQ4NL>> = q4
                .iter()
                .map(|row| {
                    row.iter()
                        .map(|b| kiln_format::BlockIQ4NL { d: b.d, qs: b.qs })
                        .collect()
                })
                .collect();
            for isa in crate::isa::tested_isas() {
                let Some(k) = crate::kernels(isa).and_then(|k| k.lanes) else {
                    continue;
                };
                lanes_equal_reference(k, &q8, &xs, crate::reference::dot_q8_0_q8_0_ref);
                lanes_equal_reference(k, &q4, &xs, crate::reference::dot_q4_0_q8_0_ref);
                lanes_equal_reference(k, &q5, &xs, crate::reference::dot_q5_0_q8_0_ref);
                lanes_equal_reference(k, &iq4, &xs, crate::reference::dot_iq4_nl_q8_0_seq_ref);
            }
        }
    }

    /// The largest products each encoding can make, where 16-bit partial sums would overflow
    /// if a kernel added too many: every code at its extreme against activations of ±127
    /// (the most a Q8_0 activation holds), alternating between tokens.
    #[test]
    fn lanes_tile_is_exact_at_the_extreme_codes() {
        use half::f16;
        let d = f16::from_f32(0.5);
        let xs: Vec<Vec<BlockQ8_0>> = (0..16)
            .map(|t| {
                let q = if t % 2 == 0 { 127 } else { -127 };
                vec![BlockQ8_0 { d, qs: [q; QK] }; 3]
            })
            .collect();
        let rows = |b: u8| vec![vec![BlockQ4_0 { d, qs: [b; QK / 2] }; 3]; TILE_ROWS];
        let q5 = |qh: u32, b: u8| {
            vec![
                vec![
                    kiln_format::BlockQ5_0 {
                        d,
                        qh: qh.to_le_bytes(),
                        qs: [b; QK / 2]
                    };
                    3
                ];
                TILE_ROWS
            ]
        };
        let q8 = |q: i8| vec![vec![BlockQ8_0 { d, qs: [q; QK] }; 3]; TILE_ROWS];
        for isa in crate::isa::tested_isas() {
            let Some(k) = crate::kernels(isa).and_then(|k| k.lanes) else {
                continue;
            };
            for b in [0x00, 0xff] {
                lanes_equal_reference(k, &rows(b), &xs, crate::reference::dot_q4_0_q8_0_ref);
            }
            for (qh, b) in [(0, 0x00), (u32::MAX, 0xff)] {
                lanes_equal_reference(k, &q5(qh, b), &xs, crate::reference::dot_q5_0_q8_0_ref);
            }
            for q in [-128, 127] {
                lanes_equal_reference(k, &q8(q), &xs, crate::reference::dot_q8_0_q8_0_ref);
            }
        }
    }
}
