//! The AVX-512 tier (F, BW, VL, VNNI on top of AVX2 + FMA + F16C): 16-lane float kernels and
//! VNNI `vpdpbusd` block dots.
//!
//! The Q8_0/Q4_0 tiles and dots are [`super::avx512_pair`]'s: two blocks per 512-bit
//! `vpdpbusd`, sharing the scale work. The [`QDot`] primitives below (one block per 256-bit
//! `vpdpbusd`) back the generic block kernel, which the table no longer uses for these tiles but
//! which stays as this tier's instance of the shared code. The float primitives ([`Avx512`]'s
//! [`F32Simd`] methods) are [`super::avx512_float`]'s.

use std::arch::x86_64::*;

use half::{bf16, f16};
use kiln_format::{BlockQ4_0, BlockQ8_0};

use super::avx2::isa_entry_points;
use super::avx512_float::Avx512;
use super::avx512_group;
use super::avx512_lanes;
use super::avx512_pair::{self, PairBlock, PairSource};
use super::float::{self, Weight};
use super::kquant::avx512 as ktiles;
use super::quant::{self, QBlock, QDot};
use crate::isa::Isa;
use crate::kquant::KTiles;
use crate::lanes::{LaneBlock, LanesAcc};
use crate::table::{Kernels, SCALAR_TABLE};
use crate::tile::{Prepared, PreparedPair, Tile, TILE_ROWS, WIDE_ROWS};

/// A Q8_0 activation block prepared for `vpdpbusd` (unsigned × signed bytes).
#[derive(Clone, Copy)]
pub(crate) struct Prep {
    /// The 32 codes.
    x: __m256i,
    /// `−128·Σx` per group of four codes: corrects Q8_0 weights biased to unsigned by `+128`.
    bias128: __m256i,
    /// `−8·Σx` per group of four codes: corrects Q4_0's stored `q + 8`.
    bias8: __m256i,
}

// SAFETY: every method is only called from functions compiled with this tier's features.
unsafe impl QDot for Avx512 {
    type Prep = Prep;
    /// Codes biased to unsigned: `w + 128`.
    type W8 = __m256i;
    /// Unsigned nibbles `q + 8` (0..=15), weight j in byte j.
    type W4 = __m256i;
    #[inline(always)]
    unsafe fn prep(x: &BlockQ8_0) -> Prep {
        // SAFETY: x.qs is 32 readable bytes; AVX-512 VNNI/VL enabled (trait contract).
        unsafe {
            let x = _mm256_loadu_si256(x.qs.as_ptr() as *const __m256i);
            let z = _mm256_setzero_si256();
            let s128 = _mm256_dpbusd_epi32(z, _mm256_set1_epi8(-128), x);
            let s8 = _mm256_dpbusd_epi32(z, _mm256_set1_epi8(8), x);
            Prep {
                x,
                bias128: _mm256_sub_epi32(z, s128),
                bias8: _mm256_sub_epi32(z, s8),
            }
        }
    }
    #[inline(always)]
    unsafe fn load_q8(w: &BlockQ8_0) -> __m256i {
        // SAFETY: w.qs is 32 readable bytes; AVX2 enabled (trait contract).
        unsafe {
            let w = _mm256_loadu_si256(w.qs.as_ptr() as *const __m256i);
            _mm256_xor_si256(w, _mm256_set1_epi8(-128))
        }
    }
    #[inline(always)]
    unsafe fn load_q4(w: &BlockQ4_0) -> __m256i {
        // SAFETY: w.qs is 16 readable bytes; AVX2 enabled (trait contract).
        unsafe {
            let raw = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(raw, m4);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
            _mm256_set_m128i(hi, lo)
        }
    }
    /// `(w + 128)` as unsigned bytes times `x`, plus `−128·Σx`: exact for every i8 code.
    #[inline(always)]
    unsafe fn dot_q8(wu: __m256i, x: &Prep) -> __m256i {
        // SAFETY: AVX-512 VNNI/VL enabled (trait contract); register-only intrinsic.
        unsafe { _mm256_dpbusd_epi32(x.bias128, wu, x.x) }
    }
    /// Stored nibbles `q + 8` (unsigned) times `x`, plus `−8·Σx`.
    #[inline(always)]
    unsafe fn dot_q4(q: __m256i, x: &Prep) -> __m256i {
        // SAFETY: AVX-512 VNNI/VL enabled (trait contract); register-only intrinsic.
        unsafe { _mm256_dpbusd_epi32(x.bias8, q, x.x) }
    }
}

// 32 registers: 4 rows × 2 accumulators × 2 tokens for floats, 4 rows × 4 tokens for blocks,
// 4 rows × 4 vectors (+ 4 loaded, 1 broadcast) for weighted sums (a head of 64 in one block),
// 8 rows × 2 vectors of tokens (+ 2 loaded, 1 broadcast) for float lanes, 2 accumulators × 8
// tokens for the sixteen-row float kernel.
isa_entry_points!(
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    Avx512,
    2,
    4,
    4,
    8,
    2,
    8
);

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_pair<W: PairBlock, A: PairSource, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[A]; T],
) -> [[f32; TILE_ROWS]; T] {
    // SAFETY: features enabled by this function's attribute; lengths checked by callers.
    unsafe { avx512_pair::tile::<W, A, TILE_ROWS, T>(rows, xs) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_pair<W: PairBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
    // SAFETY: features enabled by this function's attribute; lengths checked by callers.
    unsafe { avx512_pair::tile::<W, BlockQ8_0, 1, 1>(&[w], &[x])[0][0] }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_pair<W: PairBlock>(w: &[W], x: &[PreparedPair]) -> [f32; WIDE_ROWS] {
    // SAFETY: features enabled by this function's attribute; lengths checked by callers.
    unsafe { avx512_pair::rows16::<W, PreparedPair>(w, x) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn prepare_pairs<W: PairBlock>(x: &[BlockQ8_0], out: &mut [PreparedPair]) {
    // SAFETY: features enabled by this function's attribute; lengths checked by callers.
    unsafe { avx512_pair::prepare(x, W::OFFSET, out) }
}

// The safe wrappers below check every length the pair kernel relies on; their `unsafe` calls
// are sound because `table()` is only handed out when the CPU has this tier's features.

fn pair_tile<W: PairBlock, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[BlockQ8_0]],
    out: &mut [[f32; TILE_ROWS]],
) {
    let xs: &[&[BlockQ8_0]; T] = crate::simd::check_tile(rows, xs, out);
    // SAFETY: features supported (see above); lengths checked.
    let res = unsafe { tile_pair::<W, BlockQ8_0, T>(rows, xs) };
    out.copy_from_slice(&res);
}

fn prepare<W: PairBlock>(x: &[BlockQ8_0], out: &mut [PreparedPair]) {
    assert_eq!(out.len(), x.len().div_ceil(2), "prepare: wrong pair count");
    // SAFETY: features supported (see above); lengths checked.
    unsafe { prepare_pairs::<W>(x, out) }
}

fn prepared_tile<W: PairBlock, const T: usize>(
    rows: &[&[W]; TILE_ROWS],
    xs: &[&[PreparedPair]],
    out: &mut [[f32; TILE_ROWS]],
) {
    let xs: &[&[PreparedPair]; T] = xs.try_into().expect("tile: wrong token count");
    assert!(out.len() == T, "tile: wrong output count");
    let nb = rows[0].len();
    assert!(
        rows.iter().all(|r| r.len() == nb) && xs.iter().all(|x| x.len() == nb.div_ceil(2)),
        "tile: row length mismatch"
    );
    // SAFETY: features supported (see above); lengths checked.
    let res = unsafe { tile_pair::<W, PreparedPair, T>(rows, xs) };
    out.copy_from_slice(&res);
}

fn prepared_rows<W: PairBlock>(w: &[W], x: &[PreparedPair], out: &mut [f32; WIDE_ROWS]) {
    let nb = w.len() / WIDE_ROWS;
    assert!(
        w.len() == WIDE_ROWS * nb && x.len() == nb.div_ceil(2),
        "rows: row length mismatch"
    );
    // SAFETY: features supported (see above); lengths checked.
    *out = unsafe { rows_pair::<W>(w, x) };
}

/// The prepared-activation kernels for one block encoding.
fn prepared<W: PairBlock>() -> Prepared<W> {
    Prepared {
        prepare: prepare::<W>,
        tile: Tile::new(prepared_tile::<W, 1>, 4, prepared_tile::<W, 4>)
            .with_rows(prepared_rows::<W>),
    }
}

fn pair_dot<W: PairBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: block count mismatch");
    // SAFETY: features supported (see above); lengths checked.
    unsafe { dot_pair(w, x) }
}

fn lanes_tile(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    _max_code: u8,
    x0: &[LaneBlock],
    x1: Option<&[LaneBlock]>,
    acc: &mut LanesAcc,
) {
    crate::lanes::check_lanes_tile(codes, dw, x0, x1);
    // SAFETY: features supported (see above); lengths checked.
    unsafe {
        match x1 {
            Some(x1) => avx512_lanes::tile::<2>(codes, dw, [x0, x1], acc),
            None => avx512_lanes::tile::<1>(codes, dw, [x0], acc),
        }
    }
}

fn klanes_tile(
    kind: crate::klanes::KKind,
    rows: &[&crate::klanes::KLaneRow; TILE_ROWS],
    x0: &crate::klanes::KLaneBlock,
    x1: Option<&crate::klanes::KLaneBlock>,
    acc: &mut LanesAcc,
) {
    // SAFETY: features supported (see above); the layouts are fixed-size types.
    unsafe { super::avx512_klanes::ktile(kind, rows, x0, x1, acc) }
}

fn quantize_row_q8_k_act(x: &[f32], out: &mut [kiln_format::BlockQ8K]) {
    assert_eq!(
        x.len(),
        out.len() * kiln_format::QK_K,
        "quantize_row_q8_k_act: length mismatch"
    );
    // SAFETY: features supported (see above); lengths checked.
    unsafe { super::q8k::quantize_avx512(x, out) }
}

/// Tokens per multi-token Q5 or K-quant tile: this tier's 32 registers, in which a K-quant
/// block (or eight Q5 blocks) stays unpacked across the tile's tokens.
const KQ_TOKENS: usize = 8;

/// This tier's Q5 and K-quant tiles, [`super::kquant`]'s.
const KQ_TILES: KTiles = KTiles {
    q5_0: Tile::new(
        ktiles::q5_0_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q5_0_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_0_tile_avx512),
    q5_1: Tile::new(
        ktiles::q5_1_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q5_1_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_1_tile_avx512),
    q4_k: Tile::new(
        ktiles::q4_k_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q4_k_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q4_k_tile_avx512),
    q5_k: Tile::new(
        ktiles::q5_k_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q5_k_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q5_k_tile_avx512),
    q6_k: Tile::new(
        ktiles::q6_k_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q6_k_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q6_k_tile_avx512),
    q2_k: Tile::new(
        ktiles::q2_k_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q2_k_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q2_k_tile_avx512),
    q3_k: Tile::new(
        ktiles::q3_k_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::q3_k_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::q3_k_tile_avx512),
    iq4_nl: Tile::new(
        ktiles::iq4_nl_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::iq4_nl_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::iq4_nl_tile_avx512),
    iq4_xs: Tile::new(
        ktiles::iq4_xs_tile_avx512::<1>,
        KQ_TOKENS,
        ktiles::iq4_xs_tile_avx512::<KQ_TOKENS>,
    )
    .with_rows(ktiles::rows::iq4_xs_tile_avx512),
};

/// This tier's table; [`crate::kernels`] only calls it when the CPU supports the tier.
pub(crate) fn table() -> &'static Kernels {
    static TABLE: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| Kernels {
        dot_q8_0_q8_0: pair_dot::<BlockQ8_0>,
        dot_q4_0_q8_0: pair_dot::<BlockQ4_0>,
        tile_q8_0: Tile::new(pair_tile::<BlockQ8_0, 1>, 4, pair_tile::<BlockQ8_0, 4>),
        tile_q4_0: Tile::new(pair_tile::<BlockQ4_0, 1>, 4, pair_tile::<BlockQ4_0, 4>),
        prepared_q8_0: Some(prepared::<BlockQ8_0>()),
        prepared_q4_0: Some(prepared::<BlockQ4_0>()),
        lanes: Some(lanes_tile),
        klanes: Some(klanes_tile),
        quantize_row_q8_k_act,
        group_q4_0x16: Some(super::group_kernel!(
            "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
            avx512_group
        )),
        // AVX2's kernels: this tier has none of its own for the IQ4 layouts yet (prompts of
        // IQ4_XS take this tier's K-quant lanes kernel).
        group_iq4_nlx16: Some(super::avx2::group_iq4_nlx16()),
        group_iq4_xsx16: Some(super::avx2::group_iq4_xsx16()),
        kq: KQ_TILES,
        ..table_for(Isa::Avx512)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_format::blocks::{quantize_row_q4_0_ref, quantize_row_q8_0_ref};
    use proptest::prelude::*;

    /// Prepared activations feed the tile the same values it computes for itself: the
    /// results are the same bits, for one and four tokens, odd and even block counts.
    fn same_bits<W: PairBlock + std::fmt::Debug>(rows: &[Vec<W>], xs: &[Vec<BlockQ8_0>]) {
        let nb = xs[0].len();
        let wr: [&[W]; TILE_ROWS] = std::array::from_fn(|i| rows[i].as_slice());
        let prepared: Vec<Vec<PreparedPair>> = xs
            .iter()
            .map(|x| {
                let mut o = vec![PreparedPair::ZERO; nb.div_ceil(2)];
                prepare::<W>(x, &mut o);
                o
            })
            .collect();
        for t in [1, 4] {
            let plain: Vec<&[BlockQ8_0]> = xs[..t].iter().map(|x| x.as_slice()).collect();
            let prep: Vec<&[PreparedPair]> = prepared[..t].iter().map(|x| x.as_slice()).collect();
            let (mut a, mut b) = (vec![[0.0; TILE_ROWS]; t], vec![[1.0; TILE_ROWS]; t]);
            if t == 1 {
                pair_tile::<W, 1>(&wr, &plain, &mut a);
                prepared_tile::<W, 1>(&wr, &prep, &mut b);
            } else {
                pair_tile::<W, 4>(&wr, &plain, &mut a);
                prepared_tile::<W, 4>(&wr, &prep, &mut b);
            }
            let bits = |v: &[[f32; TILE_ROWS]]| -> Vec<u32> {
                v.iter().flatten().map(|f| f.to_bits()).collect()
            };
            assert_eq!(bits(&a), bits(&b), "{t} tokens, {nb} blocks");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn prepared_tiles_equal_plain_tiles(
            nb in 1usize..9,
            seed in prop::collection::vec(-8.0f32..8.0, 8 * 32 * 8),
        ) {
            if !crate::isa::tested_isas().contains(&Isa::Avx512) {
                return Ok(());
            }
            let n = nb * 32;
            let vals = |i: usize| &seed[i * n..(i + 1) * n];
            let xs: Vec<Vec<BlockQ8_0>> =
                (0..4).map(|i| quantize_row_q8_0_ref(vals(i)).unwrap()).collect();
            let q8: Vec<Vec<BlockQ8_0>> =
                (4..8).map(|i| quantize_row_q8_0_ref(vals(i)).unwrap()).collect();
            let q4: Vec<Vec<BlockQ4_0>> =
                (4..8).map(|i| quantize_row_q4_0_ref(vals(i)).unwrap()).collect();
            same_bits(&q8, &xs);
            same_bits(&q4, &xs);
        }
    }
}
