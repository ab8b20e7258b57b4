//! K-quant prefill with tokens in vector lanes: the layouts behind the K-quant lanes kernels
//! (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS rows against batches of Q8_K activations).
//!
//! The K-quant tiles of [`crate::kquant`] take a few tokens per unpacked super-block and reduce
//! each (row, token) dot across the lanes of a register, which costs as much per token as the
//! dot itself at prefill sizes. Here, as in [`crate::lanes`], a 32-bit lane is a token: four
//! codes of a weight row, broadcast to every lane, meet four codes of sixteen tokens in one
//! `vpdpbusd` (AVX-512) or `vpmaddubsw` (AVX2), and nothing is ever reduced across lanes.
//!
//! What the K-quants add to Q4_0's lanes kernel is the sub-block scales and the offsets:
//!
//! - Each sub-block's integer dot (32 weights for Q4_K/Q5_K, 16 for Q6_K) is multiplied by its
//!   scale before it joins the block's sum ([`KLaneRow::scales`], one i32 per sub-block).
//! - The codes stay unsigned as stored (0..=3, 0..=7, 0..=15, 0..=31, 0..=63), so no offset
//!   touches them; IQ4_XS's grid values (−127..=113) are stored plus 128. The mins of
//!   Q2_K/Q4_K/Q5_K and the offsets (Q3_K's −4, Q6_K's −32, IQ4_XS's −128) all multiply the sum
//!   of a sub-block's activations, which Q8_K carries per 16 codes (`bsums`): the activations
//!   carry them per token as pairs of i16 ([`KLaneBlock::bsums`]), the weights as pairs of i16
//!   factors ([`KLaneRow::pairs`]: `(m, m)` for a 32-weight sub-block's min, `(m_2k, m_2k+1)`
//!   for Q2_K's 16-weight ones, `(−32·sc_2k, −32·sc_2k+1)` per two 16-weight sub-blocks of
//!   Q6_K), and one `vpdpwssd` (or `vpmaddwd`) per pair gives the `mins` or the offset term,
//!   added into `isum`. The four [`KKind`]s are the four combinations of sub-block width and
//!   mins or offset.
//!
//! Every sum is exact, and each super-block's f32 term is [`crate::reference::term_k`] (with mins) or
//! [`crate::reference::term_q6_k`] (with an offset) of those sums, added into accumulator `b % 8` of its (row,
//! token) and the eight summed by [`crate::reference::sum_lanes8`]: the order of
//! [`crate::reference::dot_q4_k_q8_k_ref`] and its siblings (Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS). So a batch through the K-quant
//! lanes kernel gives every token the reference's bits, the same bits the one-token tiles give
//! it (unlike the Q4_0/Q8_0 lanes kernels, whose reference order differs from their one-token
//! tiles'), in every tier and at any thread count. [`crate::reference::klanes::ktile_ref`] is
//! the scalar statement of the kernel over these layouts, which the SIMD kernels are tested
//! against. The product that runs them is [`crate::matmul`]'s.
//!
//! Each weight row is unpacked once per product, a super-block at a time ([`KLaneRow`], 384
//! bytes for 256 weights), and the activations transposed once per product into
//! [`KLaneBlock`]s (4.6 KiB per super-block of sixteen tokens).
//!
//! Why not unpack K-quant rows into [`crate::lanes`]' Q4_0-style blocks (32 codes and one f32
//! scale each, against Q8_0 activations)? Folding a sub-block's scale and min into a per-block
//! f32 would change the activations (Q8_0, a scale per 32 codes, instead of GGML's Q8_K) and
//! the order of the float work, so a K-quant matrix would give different numbers in prefill
//! than in decode and than llama.cpp's pairing; it would also spend a float conversion and
//! two multiplies per 32 weights where this layout spends one integer multiply. Keeping Q8_K
//! and the exact per-super-block sums costs one `vpmulld` per sub-block (an eighth of the
//! `vpdpbusd` count for Q4_K, a quarter for Q6_K) and eight accumulators per (row, token)
//! kept in memory.

use kiln_format::iq4::iq4_xs_scale;
use kiln_format::kquants::{
    q2_k_codes, q3_k_codes, q3_k_scales, q5_k_codes, q6_k_codes, K_SCALE_SIZE,
};
use kiln_format::{BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};

use crate::lanes::{LanesAcc, LANES};
use crate::tile::TILE_ROWS;

/// Sub-blocks of sixteen codes in a super-block (Q8_K's `bsums`).
pub(crate) const KSUBS: usize = QK_K / 16;

/// One super-block of sixteen tokens' Q8_K activations, transposed for the lanes kernels.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct KLaneBlock {
    /// `codes[g][t]`: codes `4g..4g + 4` of token `t`.
    pub(crate) codes: [[[i8; 4]; LANES]; QK_K / 4],
    /// `bsums[k][t]`: Q8_K's `(bsums[2k], bsums[2k + 1])` of token `t`, a pair of i16 per
    /// 32-bit lane (the sums of codes `32k..32k + 16` and `32k + 16..32k + 32`).
    pub(crate) bsums: [[[i16; 2]; LANES]; KSUBS / 2],
    /// The super-block's scale, per token.
    pub(crate) dx: [f32; LANES],
}
const _: () = assert!(std::mem::size_of::<KLaneBlock>() == 73 * 64);

impl KLaneBlock {
    /// Zero codes and scales: a padding token, whose results are exact zeros.
    pub(crate) const ZERO: KLaneBlock = KLaneBlock {
        codes: [[[0; 4]; LANES]; QK_K / 4],
        bsums: [[[0; 2]; LANES]; KSUBS / 2],
        dx: [0.0; LANES],
    };
}

/// How a K-quant encoding's sub-block scales and offsets enter its sums: a row of this table
/// is a sub-block width and whether the activation sums meet mins (a second sum) or an offset
/// (folded into the first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KKind {
    /// Q4_K and Q5_K: eight sub-blocks of 32 with unsigned scales, and mins
    /// (`w = d·sc·q − dmin·m`): the term is [`crate::reference::term_k`].
    Affine32,
    /// Q2_K: sixteen sub-blocks of 16 with 4-bit scales and mins, the term
    /// [`crate::reference::term_k`]'s.
    Affine16,
    /// Q6_K and Q3_K: sixteen sub-blocks of 16 with signed scales, codes offset by 32 or 4
    /// (`w = d·sc·(q − 32)`): the term is [`crate::reference::term_q6_k`].
    Offset16,
    /// IQ4_XS: eight sub-blocks of 32 with signed scales, grid values stored plus 128 (codes
    /// up to 241, which AVX2's byte product takes nibble by nibble): the term is
    /// [`crate::reference::term_q6_k`]'s.
    Offset32,
}

impl KKind {
    /// Codes per sub-block: what each scale multiplies.
    #[cfg(test)]
    pub(crate) const fn sub(self) -> usize {
        match self {
            KKind::Affine32 | KKind::Offset32 => 32,
            KKind::Affine16 | KKind::Offset16 => 16,
        }
    }

    /// Whether the activation sums meet mins, a second sum with its own super-block scale.
    #[cfg(test)]
    pub(crate) const fn affine(self) -> bool {
        matches!(self, KKind::Affine32 | KKind::Affine16)
    }
}

/// One super-block of one weight row, unpacked for the lanes kernels.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct KLaneRow {
    /// The codes as stored, unsigned (weight `j` in byte `j`).
    pub(crate) codes: [u8; QK_K],
    /// The sub-blocks' scales (the first eight for 32-weight sub-blocks).
    pub(crate) scales: [i32; KSUBS],
    /// `pairs[k]`: the factors of Q8_K's `(bsums[2k], bsums[2k + 1])`: the mins (`(m_k, m_k)`
    /// for [`KKind::Affine32`], `(m_2k, m_2k+1)` for [`KKind::Affine16`]) or the offset times
    /// the scales (`(−32·sc_2k, −32·sc_2k+1)` for Q6_K, `(−128·sc_k, −128·sc_k)` for IQ4_XS).
    pub(crate) pairs: [[i16; 2]; KSUBS / 2],
    /// The super-block scale, widened from f16.
    pub(crate) d: f32,
    /// The super-block scale of the mins, widened from f16 (zero for an offset kind).
    pub(crate) dmin: f32,
}
const _: () = assert!(std::mem::size_of::<KLaneRow>() == 6 * 64);

impl KLaneRow {
    /// All zeros: a valid row whose terms are zero.
    pub(crate) const ZERO: KLaneRow = KLaneRow {
        codes: [0; QK_K],
        scales: [0; KSUBS],
        pairs: [[0; 2]; KSUBS / 2],
        d: 0.0,
        dmin: 0.0,
    };
}

/// Q4_K/Q5_K's eight 6-bit scales and eight 6-bit mins unpacked from their 12 bytes at once
/// (GGML's word-wise unpacking): the same values as
/// [`kiln_format::kquants::scale_min_k4`] for `j` in 0..8.
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
pub(crate) fn scales_mins_k4(s: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let sc_lo = u0 & K1;
    let sc_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let m_lo = u1 & K1;
    let m_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let cat = |a: u32, b: u32| {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (cat(sc_lo, sc_hi), cat(m_lo, m_hi))
}

/// Q3_K's sixteen 6-bit scales, before their −32, unpacked from their 12 bytes at once
/// (word-wise, as GGML does): [`kiln_format::kquants::q3_k_scales`] plus 32. The one-token
/// kernels unpack a block's scales per product, where the byte-by-byte unpacking costs more
/// than the block's dot.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn q3_k_scales6(s: &[u8; K_SCALE_SIZE]) -> [u8; 16] {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, hi) = (u(0), u(1), u(2));
    let words = [
        (a0 & K2) | ((hi & K1) << 4),
        (a1 & K2) | (((hi >> 2) & K1) << 4),
        ((a0 >> 4) & K2) | (((hi >> 4) & K1) << 4),
        ((a1 >> 4) & K2) | (((hi >> 6) & K1) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// A pair of i16 as one 32-bit lane, the first in the low half (`vpdpwssd`'s order).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn pair_word(p: [i16; 2]) -> i32 {
    (u32::from(p[0] as u16) | (u32::from(p[1] as u16) << 16)) as i32
}

/// A K-quant block encoding the lanes kernels take.
pub(crate) trait KLaneWeight: Copy {
    /// How its scales and offsets enter the sums.
    const KIND: KKind;
    /// Unpack the block into `row` (every field written).
    fn unpack_into(&self, row: &mut KLaneRow);

    /// The block unpacked.
    #[cfg(test)]
    fn unpack(&self) -> KLaneRow {
        let mut row = KLaneRow::ZERO;
        self.unpack_into(&mut row);
        row
    }
}

/// Q4_K/Q5_K's scales and mins into a row (its codes set apart).
fn affine_scales(row: &mut KLaneRow, scales: &[u8; 12], d: f32, dmin: f32) {
    let (sc, m) = scales_mins_k4(scales);
    for s in 0..8 {
        row.scales[s] = i32::from(sc[s]);
        row.scales[s + 8] = 0;
        row.pairs[s] = [i16::from(m[s]); 2];
    }
    row.d = d;
    row.dmin = dmin;
}

impl KLaneWeight for BlockQ4K {
    const KIND: KKind = KKind::Affine32;
    /// The nibbles in [`kiln_format::kquants::q4_k_codes`]' order, written in place by
    /// whole-slice loops the compiler vectorizes (a row is unpacked once per product, but at
    /// short prompts that is a visible share of the work).
    fn unpack_into(&self, row: &mut KLaneRow) {
        for (qs, out) in self.qs.chunks_exact(32).zip(row.codes.chunks_exact_mut(64)) {
            let (lo, hi) = out.split_at_mut(32);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                *l = q & 0x0f;
                *h = q >> 4;
            }
        }
        affine_scales(row, &self.scales, self.d.to_f32(), self.dmin.to_f32());
    }
}

impl KLaneWeight for BlockQ5K {
    const KIND: KKind = KKind::Affine32;
    fn unpack_into(&self, row: &mut KLaneRow) {
        row.codes = q5_k_codes(self);
        affine_scales(row, &self.scales, self.d.to_f32(), self.dmin.to_f32());
    }
}

impl KLaneWeight for BlockQ6K {
    const KIND: KKind = KKind::Offset16;
    fn unpack_into(&self, row: &mut KLaneRow) {
        row.codes = q6_k_codes(self);
        for (s, &sc) in self.scales.iter().enumerate() {
            row.scales[s] = i32::from(sc);
        }
        for (k, p) in row.pairs.iter_mut().enumerate() {
            // |−32·sc| ≤ 4096: an i16.
            *p = [
                -32 * i16::from(self.scales[2 * k]),
                -32 * i16::from(self.scales[2 * k + 1]),
            ];
        }
        row.d = self.d.to_f32();
        row.dmin = 0.0;
    }
}

impl KLaneWeight for BlockQ3K {
    const KIND: KKind = KKind::Offset16;
    /// Codes `q + 4` (0..=7) as [`kiln_format::kquants::q3_k_codes`] gives them, the −4 in the
    /// pairs as Q6_K's −32.
    fn unpack_into(&self, row: &mut KLaneRow) {
        row.codes = q3_k_codes(self);
        let sc = q3_k_scales(&self.scales);
        for (s, &sc) in sc.iter().enumerate() {
            row.scales[s] = i32::from(sc);
        }
        for (k, p) in row.pairs.iter_mut().enumerate() {
            // |−4·sc| ≤ 128.
            *p = [-4 * i16::from(sc[2 * k]), -4 * i16::from(sc[2 * k + 1])];
        }
        row.d = self.d.to_f32();
        row.dmin = 0.0;
    }
}

impl KLaneWeight for BlockQ2K {
    const KIND: KKind = KKind::Affine16;
    fn unpack_into(&self, row: &mut KLaneRow) {
        row.codes = q2_k_codes(self);
        for (s, &sm) in self.scales.iter().enumerate() {
            row.scales[s] = i32::from(sm & 0x0f);
        }
        for (k, p) in row.pairs.iter_mut().enumerate() {
            *p = [
                i16::from(self.scales[2 * k] >> 4),
                i16::from(self.scales[2 * k + 1] >> 4),
            ];
        }
        row.d = self.d.to_f32();
        row.dmin = self.dmin.to_f32();
    }
}

impl KLaneWeight for BlockIQ4XS {
    const KIND: KKind = KKind::Offset32;
    /// Sub-block `s`'s sixteen bytes hold weights `32s + j` (low nibble of byte `j`) and `32s +
    /// j + 16` (high nibble); each becomes its grid value plus 128 (1..=241).
    fn unpack_into(&self, row: &mut KLaneRow) {
        let (chunks, _) = self.qs.as_chunks::<16>();
        crate::lanes::unpack_iq4(chunks.iter(), &mut row.codes);
        for s in 0..QK_K / 32 {
            let sc = iq4_xs_scale(self, s);
            row.scales[s] = sc;
            row.scales[s + 8] = 0;
            // |−128·sc| ≤ 4096.
            row.pairs[s] = [(-128 * sc) as i16; 2];
        }
        row.d = self.d.to_f32();
        row.dmin = 0.0;
    }
}

/// The K-quant lanes kernel of a tier: one super-block of `TILE_ROWS` unpacked weight rows
/// (`rows`, encodings of kind `kind`) against the same super-block of one group of sixteen
/// tokens (`x0`), or two (`x1` too), adding the block's term to `acc[r][g][t]`.
///
/// The caller adds super-block `b`'s terms into its accumulator `b % 8` and sums the eight with
/// [`crate::reference::sum_lanes8`]; every tier's kernel adds exactly
/// [`crate::reference::klanes::ktile_ref`]'s term, so the result is the scalar reference dot's bits.
pub(crate) type KLanesFn =
    fn(KKind, &[&KLaneRow; TILE_ROWS], &KLaneBlock, Option<&KLaneBlock>, &mut LanesAcc);

/// Transpose up to sixteen tokens' Q8_K rows (`xq`, `nb` super-blocks each) into `out` (`nb`
/// super-blocks); missing tokens are zero lanes.
pub(crate) fn prepare_kgroup(xq: &[BlockQ8K], nb: usize, out: &mut [KLaneBlock]) {
    debug_assert!(xq.len() <= LANES * nb && out.len() == nb);
    for (b, o) in out.iter_mut().enumerate() {
        *o = KLaneBlock::ZERO;
        for (t, row) in xq.chunks_exact(nb).enumerate() {
            let x = &row[b];
            for (g, q) in x.qs.chunks_exact(4).enumerate() {
                o.codes[g][t].copy_from_slice(q);
            }
            for (k, s) in x.bsums.chunks_exact(2).enumerate() {
                o.bsums[k][t] = [s[0], s[1]];
            }
            o.dx[t] = x.d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference as r;
    use crate::reference::klanes::ktile_ref;
    use half::f16;
    use proptest::prelude::*;

    fn q8_k(seed: u64) -> BlockQ8K {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 24) as u32
        };
        let v: Vec<f32> = (0..QK_K)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        kiln_format::kquants::quantize_block_q8_k_ref(v.as_slice().try_into().unwrap())
    }

    fn check<W: KLaneWeight>(w: &W, xs: &[BlockQ8K], dot: fn(&[W], &[BlockQ8K]) -> f32) {
        let mut x = [KLaneBlock::ZERO];
        prepare_kgroup(xs, 1, &mut x);
        let u = w.unpack();
        let mut acc: LanesAcc = [[[0.0; LANES]; 2]; TILE_ROWS];
        ktile_ref(W::KIND, &[&u; TILE_ROWS], &x[0], Some(&x[0]), &mut acc);
        for (t, &term) in acc[0][1].iter().enumerate() {
            // One block: accumulator 0 holds the term, the other seven +0.
            let mut lanes = [0.0f32; 8];
            lanes[0] = term;
            let got = r::sum_lanes8(&lanes);
            let want = xs.get(t).map_or(0.0, |x| {
                dot(std::slice::from_ref(w), std::slice::from_ref(x))
            });
            assert_eq!(got.to_bits(), want.to_bits(), "token {t}");
        }
    }

    proptest! {
        /// Q4_K's in-place unpacking orders the codes as the format crate does.
        #[test]
        fn q4_k_unpacking_matches_the_format(qs in prop::collection::vec(any::<u8>(), 128)) {
            let b = BlockQ4K {
                d: f16::ONE,
                dmin: f16::ONE,
                scales: [0; 12],
                qs: qs.try_into().unwrap(),
            };
            prop_assert_eq!(b.unpack().codes, kiln_format::kquants::q4_k_codes(&b));
        }

        /// The unpacked layouts and `ktile_ref` give the reference dot's bits for one block,
        /// for every encoding, with the tokens past the batch zero.
        #[test]
        fn ktile_ref_is_the_reference_dot(
            seed in any::<u64>(),
            scales in prop::array::uniform12(any::<u8>()),
            qs in prop::collection::vec(any::<u8>(), 128 + 64 + 32),
            d in -1.0f32..1.0,
            n in 1usize..=16,
        ) {
            let xs: Vec<BlockQ8K> = (0..n as u64).map(|t| q8_k(seed ^ t)).collect();
            let (d, dmin) = (f16::from_f32(d), f16::from_f32(d * 0.3));
            let q4 = BlockQ4K { d, dmin, scales, qs: qs[..128].try_into().unwrap() };
            let q5 = BlockQ5K {
                d, dmin, scales,
                qh: qs[128..160].try_into().unwrap(),
                qs: qs[..128].try_into().unwrap(),
            };
            let q6 = BlockQ6K {
                ql: qs[..128].try_into().unwrap(),
                qh: qs[128..192].try_into().unwrap(),
                scales: std::array::from_fn(|i| qs[192 + i] as i8),
                d,
            };
            let q2 = BlockQ2K {
                scales: qs[192..208].try_into().unwrap(),
                qs: qs[..64].try_into().unwrap(),
                d,
                dmin,
            };
            let q3 = BlockQ3K {
                hmask: qs[128..160].try_into().unwrap(),
                qs: qs[..64].try_into().unwrap(),
                scales,
                d,
            };
            let iq4 = BlockIQ4XS {
                d,
                scales_h: u16::from_le_bytes([qs[200], qs[201]]),
                scales_l: qs[192..196].try_into().unwrap(),
                qs: qs[..128].try_into().unwrap(),
            };
            check(&q4, &xs, r::dot_q4_k_q8_k_ref);
            check(&q5, &xs, r::dot_q5_k_q8_k_ref);
            check(&q6, &xs, r::dot_q6_k_q8_k_ref);
            check(&q2, &xs, r::dot_q2_k_q8_k_ref);
            check(&q3, &xs, r::dot_q3_k_q8_k_ref);
            check(&iq4, &xs, r::dot_iq4_xs_q8_k_ref);
        }

        /// Every tier's K-quant lanes kernel adds `ktile_ref`'s terms, bit for bit, for one
        /// group and two, onto running sums, for every kind (four different rows each, of two
        /// encodings where a kind has two).
        #[test]
        fn every_tier_kernel_matches_ktile_ref(
            seed in any::<u64>(),
            bytes in prop::collection::vec(any::<u8>(), TILE_ROWS * 210),
            n in 1usize..=16,
        ) {
            let xs: Vec<BlockQ8K> = (0..2 * n as u64).map(|t| q8_k(seed ^ (t << 32))).collect();
            let mut x = [KLaneBlock::ZERO; 2];
            prepare_kgroup(&xs[..n], 1, &mut x[..1]);
            prepare_kgroup(&xs[n..], 1, &mut x[1..]);
            let rows = |kind: KKind| -> Vec<KLaneRow> {
                bytes.chunks_exact(210).enumerate().map(|(i, b)| {
                    let d = f16::from_bits(u16::from_le_bytes([b[0], b[1] & 0x3f]));
                    let dmin = f16::from_bits(u16::from_le_bytes([b[2], b[3] & 0x3f]));
                    let qs: [u8; 128] = b[16..144].try_into().unwrap();
                    match kind {
                        KKind::Affine32 if i % 2 == 0 => BlockQ4K {
                            d, dmin, scales: b[4..16].try_into().unwrap(), qs,
                        }.unpack(),
                        KKind::Affine32 => BlockQ5K {
                            d, dmin, scales: b[4..16].try_into().unwrap(),
                            qh: b[144..176].try_into().unwrap(), qs,
                        }.unpack(),
                        KKind::Affine16 => BlockQ2K {
                            scales: b[4..20].try_into().unwrap(),
                            qs: b[20..84].try_into().unwrap(),
                            d, dmin,
                        }.unpack(),
                        KKind::Offset16 if i % 2 == 0 => BlockQ6K {
                            ql: qs,
                            qh: b[144..208].try_into().unwrap(),
                            scales: std::array::from_fn(|j| b[4 + j] as i8),
                            d,
                        }.unpack(),
                        KKind::Offset16 => BlockQ3K {
                            hmask: b[144..176].try_into().unwrap(),
                            qs: b[20..84].try_into().unwrap(),
                            scales: b[4..16].try_into().unwrap(),
                            d,
                        }.unpack(),
                        KKind::Offset32 => BlockIQ4XS {
                            d,
                            scales_h: u16::from_le_bytes([b[2], b[3]]),
                            scales_l: b[4..8].try_into().unwrap(),
                            qs,
                        }.unpack(),
                    }
                }).collect()
            };
            for kind in [KKind::Affine32, KKind::Affine16, KKind::Offset16, KKind::Offset32] {
                let u = rows(kind);
                let wr: [&KLaneRow; TILE_ROWS] = std::array::from_fn(|r| &u[r]);
                let start: LanesAcc = std::array::from_fn(|r| {
                    std::array::from_fn(|g| std::array::from_fn(|t| (r + g + t) as f32 * 0.25))
                });
                let mut want = start;
                ktile_ref(kind, &wr, &x[0], Some(&x[1]), &mut want);
                for isa in crate::tested_isas() {
                    let Some(kernel) = crate::kernels(isa).and_then(|k| k.klanes) else {
                        continue;
                    };
                    let mut two = start;
                    kernel(kind, &wr, &x[0], Some(&x[1]), &mut two);
                    let mut one = start;
                    kernel(kind, &wr, &x[0], None, &mut one);
                    for r in 0..TILE_ROWS {
                        for t in 0..LANES {
                            let what = format!("{isa:?} {kind:?} row {r} token {t}");
                            prop_assert_eq!(two[r][0][t].to_bits(), want[r][0][t].to_bits(), "{}", what);
                            prop_assert_eq!(two[r][1][t].to_bits(), want[r][1][t].to_bits(), "{}", what);
                            prop_assert_eq!(one[r][0][t].to_bits(), want[r][0][t].to_bits(), "{}", what);
                            prop_assert_eq!(one[r][1][t].to_bits(), start[r][1][t].to_bits(), "{}", what);
                        }
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn word_wise_q3_k_scales_match_the_format(s in prop::array::uniform12(any::<u8>())) {
            let want = q3_k_scales(&s);
            let got = q3_k_scales6(&s);
            for j in 0..16 {
                prop_assert_eq!(got[j] as i8 - 32, want[j], "j {}", j);
            }
        }

        #[test]
        fn word_wise_scale_unpacking_matches_the_format(s in prop::array::uniform12(any::<u8>())) {
            let (sc, m) = scales_mins_k4(&s);
            for j in 0..8 {
                prop_assert_eq!((sc[j], m[j]), kiln_format::kquants::scale_min_k4(j, &s), "j {}", j);
            }
        }
    }
}
