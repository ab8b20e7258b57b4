//! The weight-conversion kernels (bf16 decoding, GGML's reference quantization with
//! round-trip statistics: Q8_0/Q4_0 fused, the other block types by their rows of the
//! block-type table) give the reference's bits in every supported tier: bytes, statistics,
//! and the failing block when a scale overflows.

use kiln_format::DType;
use kiln_kernels::reference as r;
use kiln_kernels::{kernels, tested_isas, ErrorStats, Kernels, QK};
use proptest::prelude::*;

/// Every tier tested here ([`tested_isas`]: fails if `KILN_EXPECT_TIERS` names one this CPU
/// lacks), each with its table.
fn tiers() -> Vec<&'static Kernels> {
    tested_isas()
        .into_iter()
        .map(|i| kernels(i).expect("a supported tier has a table"))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Every bf16 bit pattern decodes as the format crate decodes it (the independent spec), in
/// every tier, at lengths that exercise the vector tail, from unaligned starts, with a
/// trailing odd byte ignored.
#[test]
fn decode_bf16_equals_format_decode_on_every_pattern() {
    let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
    let mut want = vec![0.0f32; 1 << 16];
    kiln_format::values::decode_to_f32(DType::BF16, &bytes, &mut want);
    for k in tiers() {
        for len in [0usize, 1, 15, 16, 17, 33, 1000, 1 << 16] {
            for skip in [0usize, 1] {
                let src = &bytes[2 * skip..];
                let len = len.min(src.len() / 2);
                let src = &src[..(2 * len + 1).min(src.len())];
                let mut got = vec![f32::NAN; len];
                k.decode_bf16(src, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want[skip..skip + len]),
                    "{:?} len {len} skip {skip}",
                    k.isa()
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "one output per two bytes")]
fn decode_bf16_wrong_output_length_panics() {
    kiln_kernels::decode_bf16(&[0u8; 8], &mut [0.0; 3]);
}

/// Quantize with tier `k` and with the reference; both results (and on success the bytes and
/// statistics) must be equal.
fn check_tier(k: &Kernels, dtype: DType, x: &[f32]) -> Result<(), TestCaseError> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut sa, mut sb) = (ErrorStats::default(), ErrorStats::default());
    let ra = r::quantize_blocks_ref(dtype, x, &mut a, &mut sa);
    let rb = k.quantize_blocks(dtype, x, &mut b, &mut sb);
    prop_assert_eq!(ra, rb, "{:?} {}", k.isa(), dtype);
    if ra.is_ok() {
        prop_assert!(a == b, "{:?} {}: bytes differ", k.isa(), dtype);
        prop_assert_eq!(sa, sb, "{:?} {}", k.isa(), dtype);
    }
    Ok(())
}

/// Ties of round-half-away, all-zero blocks of both signs, repeated extremes of both signs,
/// subnormal blocks (whose `1/d` overflows: the tiers fall back to the reference inside the
/// kernel) and tiny ones, in whole runs and in runs of 1..=17 blocks from several starts
/// (the AVX2 Q4_0 kernel works on eight blocks at a time, the rest one by one).
#[test]
#[allow(clippy::needless_range_loop)] // the test writes patterns by index
fn quantize_blocks_special_blocks_match_reference() {
    let mut x: Vec<f32> = (0..32 * 512)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2_654_435_761) >> 8;
            (h % 20001) as f32 / 10000.0 - 1.0
        })
        .collect();
    for j in 0..32 {
        x[j] = (j as f32 - 16.0) + 0.5;
    }
    x[0] = -127.0;
    x[32..64].fill(0.0);
    x[64..96].fill(-0.0);
    for j in 96..128 {
        x[j] = if j % 2 == 0 { 3.0 } else { -3.0 };
    }
    for j in 128..160 {
        x[j] = if j % 2 == 0 { -3.0 } else { 3.0 };
    }
    x[160..192].fill(1e-39);
    x[161] = -2e-39;
    x[192..224].fill(1e-37);
    x[225] = 0.5;
    x[226] = -0.5;
    for j in 256..288 {
        x[j] = (j as f32 - 270.0) * 1e-3 + 1e-4;
    }
    let mut runs: Vec<(usize, usize)> = vec![(0, x.len())];
    for start in [0usize, 3, 4, 5, 6, 100] {
        for blocks in 1..=17 {
            runs.push((start * QK, (start + blocks) * QK));
        }
    }
    for k in tiers() {
        for dtype in [DType::Q8_0, DType::Q4_0] {
            for &(lo, hi) in &runs {
                check_tier(k, dtype, &x[lo..hi]).unwrap();
            }
        }
        // Scale overflow: block 1 of 1e7 (1e7 / 127 > 65504) is the one named.
        let mut y = x[..64].to_vec();
        y[40] = 1.0e7;
        let mut out = Vec::new();
        let mut s = ErrorStats::default();
        assert_eq!(k.quantize_blocks(DType::Q8_0, &y, &mut out, &mut s), Err(1));
        check_tier(k, DType::Q8_0, &y).unwrap();
    }
}

/// The reference itself: its blocks are the format crate's GGML rule, and its statistics
/// are those of the values against the dequantized blocks.
#[test]
fn quantize_blocks_reference_is_the_format_rule() {
    let x: Vec<f32> = (0..256)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let mut out = Vec::new();
    let mut s = ErrorStats::default();
    r::quantize_blocks_ref(DType::Q4_0, &x, &mut out, &mut s).unwrap();
    let blocks = kiln_format::blocks::quantize_row_q4_0_ref(&x).unwrap();
    assert_eq!(out, bytemuck::cast_slice::<_, u8>(&blocks));
    let mut y = vec![0.0f32; x.len()];
    kiln_format::blocks::dequantize_row_q4_0(&blocks, &mut y);
    let err: f64 = x
        .iter()
        .zip(&y)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    assert_eq!(s.count, 256);
    assert!(
        (s.sum_sq_error - err).abs() <= 1e-5 * err,
        "{} vs {err}",
        s.sum_sq_error
    );
}

/// Every other block type of one row: in every tier, its row's reference rule (the bytes the
/// format crate gives), the statistics of the values against its row's dequantizer, and the
/// first block whose scales overflow, with the blocks before it counted.
#[test]
fn quantize_blocks_of_other_types_are_their_rows() {
    let x: Vec<f32> = (0..2 * 256)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let others = DType::ALL.into_iter().filter(|d| {
        d.is_quantized() && d.rows_per_unit() == 1 && !matches!(d, DType::Q8_0 | DType::Q4_0)
    });
    for dtype in others {
        let kind = dtype.block();
        let mut want = Vec::new();
        kind.quantize_ref(&x, x.len(), &mut want).unwrap();
        let mut y = vec![0.0f32; x.len()];
        kind.dequantize(&want, x.len(), &mut y);
        let mut want_stats = ErrorStats::default();
        want_stats.add(&x, &y);
        // The second block's scales overflow f16.
        let mut big = x.clone();
        big[kind.weights..2 * kind.weights].fill(1e12);
        for k in tiers() {
            let (mut got, mut stats) = (Vec::new(), ErrorStats::default());
            k.quantize_blocks(dtype, &x, &mut got, &mut stats).unwrap();
            assert_eq!(got, want, "{dtype} {:?}", k.isa());
            assert_eq!(stats, want_stats, "{dtype} {:?}", k.isa());
            let (mut got, mut stats) = (Vec::new(), ErrorStats::default());
            let r = k.quantize_blocks(dtype, &big, &mut got, &mut stats);
            assert_eq!(r, Err(1), "{dtype} {:?}", k.isa());
            assert_eq!(stats.count, kind.weights as u64, "{dtype}: block 0 counted");
        }
    }
}

#[test]
#[should_panic(expected = "not a block type of one row")]
fn quantize_blocks_rejects_float_dtypes() {
    let _ = kiln_kernels::quantize_blocks(
        DType::F16,
        &[0.0; 32],
        &mut Vec::new(),
        &mut ErrorStats::default(),
    );
}

#[test]
#[should_panic(expected = "not whole blocks")]
fn quantize_blocks_rejects_partial_blocks() {
    let _ = kiln_kernels::quantize_blocks(
        DType::Q8_0,
        &[0.0; 33],
        &mut Vec::new(),
        &mut ErrorStats::default(),
    );
}

/// Block values: each block gets its own magnitude (from subnormal, where `1/d` overflows, to
/// past the f16 scale limit), and some values are zero, negated extremes or repeated.
fn blocks() -> impl Strategy<Value = Vec<f32>> {
    let block = (
        prop::sample::select(vec![0.0f32, 1e-39, 1e-30, 1e-3, 0.05, 1.0, 300.0, 6e5, 1e7]),
        prop::collection::vec(-1.0f32..1.0, QK),
        prop::collection::vec(0u8..8, QK),
    )
        .prop_map(|(scale, u, kind)| {
            u.iter()
                .zip(&kind)
                .map(|(&u, &k)| match k {
                    0 => 0.0,
                    1 => scale,
                    2 => -scale,
                    _ => u * scale,
                })
                .collect::<Vec<f32>>()
        });
    prop::collection::vec(block, 1..40).prop_map(|b| b.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every tier equals the reference on random blocks: bytes, statistics, and the failing
    /// block when a scale overflows.
    #[test]
    fn quantize_blocks_match_reference_on_random_blocks(x in blocks()) {
        for k in tiers() {
            for dtype in [DType::Q4_0, DType::Q8_0] {
                check_tier(k, dtype, &x)?;
            }
        }
    }
}
