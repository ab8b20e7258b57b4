//! The AVX-512 tier (F, BW, VL, VNNI on top of AVX2 + FMA + F16C): 16-lane float kernels and
//! VNNI `vpdpbusd` block dots.
//!
//! The Q8_0/Q4_0 tiles and dots are [`super::avx512_pair`]'s: two blocks per 512-bit
//! `vpdpbusd`, sharing the scale work. The [`QDot`] primitives below (one block per 256-bit
//! `vpdpbusd`) back the generic block kernel, which the table no longer uses for these tiles but
//! which stays as this tier's instance of the shared code.

use std::arch::x86_64::*;

use half::{bf16, f16};
use kiln_format::{BlockQ4_0, BlockQ8_0};

use super::avx2::isa_entry_points;
use super::avx512_group;
use super::avx512_lanes;
use super::avx512_pair::{self, PairBlock, PairSource};
use super::float::{self, F32Simd, Weight};
use super::quant::{self, QBlock, QDot};
use crate::isa::Isa;
use crate::lanes::{LaneBlock, LanesAcc};
use crate::table::{Kernels, SCALAR_TABLE};
use crate::tile::{Prepared, PreparedPair, Tile, TILE_ROWS, WIDE_ROWS};

/// Marker type for this ISA's primitives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512;

// SAFETY: every method is only called from functions compiled with this tier's features.
unsafe impl F32Simd for Avx512 {
    const LANES: usize = 16;
    type V = __m512;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: p valid for 16 f32 (trait contract); unaligned load.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: p valid for writing 16 f32 (trait contract); unaligned store.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> __m512 {
        // SAFETY: p valid for 16 f16 = 32 bytes (trait contract).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> __m512 {
        // SAFETY: p valid for 16 bf16 = 32 bytes (trait contract); bf16 is the top half of f32.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
        }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe { sum1(v) }
    }
    #[inline(always)]
    unsafe fn reduce_many(v: &[__m512; 16], n: usize) -> [f32; 16] {
        // SAFETY: AVX-512F enabled (trait contract).
        unsafe {
            if n > 4 {
                std::mem::transmute::<__m512, [f32; 16]>(sum16(v))
            } else {
                let mut out = [0.0; 16];
                for (o, &v) in out.iter_mut().zip(&v[..n]) {
                    *o = sum1(v);
                }
                out
            }
        }
    }
}

/// The sum of `v`'s lanes, in a fixed tree: lanes `i` and `i + 8` first, then `i` and `i + 4`,
/// `i` and `i + 2`, and the last two. [`sum16`] adds in the same tree, so a tile may reduce its
/// accumulators either way and give the same bits.
///
/// # Safety
/// AVX-512F is enabled.
#[inline(always)]
pub(crate) unsafe fn sum1(v: __m512) -> f32 {
    // SAFETY: register-only intrinsics; AVX-512F enabled (caller contract).
    unsafe {
        let s = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0xEE>(v, v));
        let t = _mm512_add_ps(s, _mm512_shuffle_f32x4::<0x01>(s, s));
        let u = _mm512_add_ps(t, _mm512_shuffle_ps::<0x0E>(t, t));
        let r = _mm512_add_ps(u, _mm512_shuffle_ps::<0x01>(u, u));
        _mm512_cvtss_f32(r)
    }
}

/// Lane `i` of the result is [`sum1`]`(v[i])`, bit for bit: each level of the tree is done for
/// several vectors at once, shuffles gathering the operands of four (then eight, sixteen) rows
/// into one register, so sixteen sums cost 45 instructions instead of 128.
///
/// # Safety
/// AVX-512F is enabled.
#[inline(always)]
pub(crate) unsafe fn sum16(v: &[__m512; 16]) -> __m512 {
    // Where row `i`'s sum lands after the last level: `4·(i % 4) + i / 4`.
    const ORDER: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
    // SAFETY: register-only intrinsics and a 64-byte load of `ORDER`; AVX-512F enabled
    // (caller contract).
    unsafe {
        // Lanes i and i + 8: rows 2k (lanes 0..8) and 2k + 1 (lanes 8..16).
        let s: [__m512; 8] = std::array::from_fn(|k| {
            let (a, b) = (v[2 * k], v[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            )
        });
        // Lanes i and i + 4: 128-bit lane j holds row 4k + j.
        let t: [__m512; 4] = std::array::from_fn(|k| {
            let (c, d) = (s[2 * k], s[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(c, d),
                _mm512_shuffle_f32x4::<0xDD>(c, d),
            )
        });
        // Lanes i and i + 2, within each 128-bit lane, for two rows per lane.
        let u: [__m512; 2] = std::array::from_fn(|k| {
            let (e, f) = (t[2 * k], t[2 * k + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(e, f),
                _mm512_shuffle_ps::<0xEE>(e, f),
            )
        });
        // The last two: lane 4j + m holds row 4m + j.
        let r = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(u[0], u[1]),
            _mm512_shuffle_ps::<0xDD>(u[0], u[1]),
        );
        let order = _mm512_loadu_si512(ORDER.as_ptr() as *const __m512i);
        _mm512_permutexvar_ps(order, r)
    }
}

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
        kq: super::kquant::AVX512_TILES,
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

    #[target_feature(enable = "avx512f")]
    unsafe fn sums_both_ways(v: &[[f32; 16]; 16]) -> ([f32; 16], [f32; 16]) {
        // SAFETY: AVX-512F enabled; 16 readable f32 per row.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(v[i].as_ptr()));
            let many = std::mem::transmute::<__m512, [f32; 16]>(sum16(&v));
            (many, std::array::from_fn(|i| sum1(v[i])))
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// `sum16` and `sum1` add in the same tree (lanes i and i+8, i and i+4, i and i+2, the
        /// last two), checked against a scalar model of it: the same bits, on values of mixed
        /// magnitudes where the order shows.
        #[test]
        fn sum16_and_sum1_add_in_the_same_tree(
            m in prop::collection::vec(-1.0f32..1.0, 256),
            e in prop::collection::vec(-20i32..20, 256),
        ) {
            if !crate::isa::tested_isas().contains(&Isa::Avx512) {
                return Ok(());
            }
            let v: [[f32; 16]; 16] =
                std::array::from_fn(|i| std::array::from_fn(|j| m[16 * i + j] * 2f32.powi(e[16 * i + j])));
            // SAFETY: AVX-512F checked above.
            let (many, one) = unsafe { sums_both_ways(&v) };
            for (i, a) in v.iter().enumerate() {
                let s: [f32; 8] = std::array::from_fn(|j| a[j] + a[j + 8]);
                let t: [f32; 4] = std::array::from_fn(|j| s[j] + s[j + 4]);
                let want = (t[0] + t[2]) + (t[1] + t[3]);
                prop_assert_eq!(many[i].to_bits(), want.to_bits(), "sum16 row {}", i);
                prop_assert_eq!(one[i].to_bits(), want.to_bits(), "sum1 row {}", i);
            }
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
