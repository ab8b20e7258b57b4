//! Q5_0, Q5_1, IQ4_NL (plain and interleaved), K-quant (Q2_K…Q6_K) and IQ4_XS products: every tier against the scalar reference,
//! bit for bit (the integer sums are exact and the float order is the reference's), through
//! one row's dot and through `matmul` for one token (decode) and many (prefill, through the
//! K-quant lanes kernel for Q2_K…Q6_K and IQ4_XS, the block lanes kernel for Q5_0 and IQ4_NL,
//! whose IQ4_NL order is [`r::dot_iq4_nl_q8_0_seq_ref`]); and the
//! reference itself against the format crate's dequantizers, which define the weights.
//!
//! Weight blocks are random bytes with random f16 scales (any byte pattern is a valid block),
//! activations random floats quantized by the reference's rules.

use half::f16;
use kiln_format::iq4::{
    dequantize_row_iq4_nl, dequantize_row_iq4_xs, interleave_iq4_nl, interleave_iq4_xs,
};
use kiln_format::kquants::{
    dequantize_row_q2_k, dequantize_row_q3_k, dequantize_row_q4_k, dequantize_row_q5_k,
    dequantize_row_q6_k,
};
use kiln_format::q5::{dequantize_row_q5_0, dequantize_row_q5_1};
use kiln_format::{BlockIQ4NLx16, BlockIQ4XSx16, GROUP_ROWS};
use kiln_kernels::reference as r;
use kiln_kernels::{
    kernels, plan, tested_isas, BlockIQ4NL, BlockIQ4XS, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, KernelError, Kernels, Matrix, Path, Pool,
    WeightData, QK, QK_K,
};
use proptest::prelude::*;

/// Relative error allowed between the reference dot and an f64 dot of the dequantized values,
/// per summed term, relative to `Σ|w·x|`: the reference rounds each block's term a few times
/// (scale products, the i32 → f32 conversion, the sum) and sums the blocks in f32.
const DEQUANT_TERMS_TOL: f64 = 8.0 * f32::EPSILON as f64;

/// Every tier tested here ([`tested_isas`]: fails if `KILN_EXPECT_TIERS` names one this CPU
/// lacks), each with its table.
fn tiers() -> Vec<&'static Kernels> {
    tested_isas()
        .into_iter()
        .map(|i| kernels(i).expect("a supported tier has a table"))
        .collect()
}

/// A small deterministic generator (tests take a seed from proptest).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 16
    }
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        std::array::from_fn(|_| self.next() as u8)
    }
    /// A scale: mostly small positive or negative values, sometimes zero.
    fn scale(&mut self) -> f16 {
        match self.next() % 8 {
            0 => f16::ZERO,
            k => {
                let m = (self.next() % 1000) as f32 / 1000.0 + 0.01;
                let sign = if k % 2 == 0 { -1.0 } else { 1.0 };
                f16::from_f32(sign * m * 0.05)
            }
        }
    }
    fn floats(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() % (1 << 24)) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * amp)
            .collect()
    }
}

fn q5_0_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ5_0> {
    (0..n)
        .map(|_| BlockQ5_0 {
            d: g.scale(),
            qh: g.bytes(),
            qs: g.bytes(),
        })
        .collect()
}

fn q5_1_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ5_1> {
    (0..n)
        .map(|_| BlockQ5_1 {
            d: g.scale(),
            m: g.scale(),
            qh: g.bytes(),
            qs: g.bytes(),
        })
        .collect()
}

fn q4_k_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ4K> {
    (0..n)
        .map(|_| BlockQ4K {
            d: g.scale(),
            dmin: g.scale(),
            scales: g.bytes(),
            qs: g.bytes(),
        })
        .collect()
}

fn q5_k_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ5K> {
    (0..n)
        .map(|_| BlockQ5K {
            d: g.scale(),
            dmin: g.scale(),
            scales: g.bytes(),
            qh: g.bytes(),
            qs: g.bytes(),
        })
        .collect()
}

fn q6_k_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ6K> {
    (0..n)
        .map(|_| {
            let mut b = BlockQ6K {
                ql: g.bytes(),
                qh: g.bytes(),
                scales: [0; 16],
                d: g.scale(),
            };
            b.scales = g.bytes::<16>().map(|v| v as i8);
            b
        })
        .collect()
}

fn q2_k_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ2K> {
    (0..n)
        .map(|_| BlockQ2K {
            scales: g.bytes(),
            qs: g.bytes(),
            d: g.scale(),
            dmin: g.scale(),
        })
        .collect()
}

fn q3_k_blocks(g: &mut Rng, n: usize) -> Vec<BlockQ3K> {
    (0..n)
        .map(|_| BlockQ3K {
            hmask: g.bytes(),
            qs: g.bytes(),
            scales: g.bytes(),
            d: g.scale(),
        })
        .collect()
}

fn iq4_nl_blocks(g: &mut Rng, n: usize) -> Vec<BlockIQ4NL> {
    (0..n)
        .map(|_| BlockIQ4NL {
            d: g.scale(),
            qs: g.bytes(),
        })
        .collect()
}

fn iq4_xs_blocks(g: &mut Rng, n: usize) -> Vec<BlockIQ4XS> {
    (0..n)
        .map(|_| BlockIQ4XS {
            d: g.scale(),
            scales_h: g.next() as u16,
            scales_l: g.bytes(),
            qs: g.bytes(),
        })
        .collect()
}

fn q8_0_act(x: &[f32]) -> Vec<BlockQ8_0> {
    let mut out = vec![bytemuck::Zeroable::zeroed(); x.len() / QK];
    r::quantize_row_q8_0_act_ref(x, &mut out);
    out
}

fn q8_k_act(x: &[f32]) -> Vec<BlockQ8K> {
    let mut out = vec![bytemuck::Zeroable::zeroed(); x.len() / QK_K];
    r::quantize_row_q8_k_act_ref(x, &mut out);
    out
}

fn q8_0_values(x: &[BlockQ8_0]) -> Vec<f64> {
    x.iter()
        .flat_map(|b| b.qs.map(|q| f64::from(b.d.to_f32()) * f64::from(q)))
        .collect()
}

fn q8_k_values(x: &[BlockQ8K]) -> Vec<f64> {
    x.iter()
        .flat_map(|b| b.qs.map(|q| f64::from(b.d) * f64::from(q)))
        .collect()
}

/// `got` within `DEQUANT_TERMS_TOL · n · Σ|w·x|` of `Σ w·x` in f64.
fn close_to_dequantized(got: f32, w: &[f32], x: &[f64], what: &str) {
    let exact: f64 = w.iter().zip(x).map(|(&w, &x)| f64::from(w) * x).sum();
    let abs: f64 = w
        .iter()
        .zip(x)
        .map(|(&w, &x)| (f64::from(w) * x).abs())
        .sum();
    let tol = DEQUANT_TERMS_TOL * w.len() as f64 * abs + 1e-30;
    assert!(
        (f64::from(got) - exact).abs() <= tol,
        "{what}: reference {got}, dequantized dot {exact}, tol {tol}"
    );
}

fn same_bits(got: f32, want: f32, what: &str) {
    assert_eq!(
        got.to_bits(),
        want.to_bits(),
        "{what}: got {got}, reference {want}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The reference's integer decompositions (codes, scales, mins through the block sums,
    /// Q6_K's offset, Q5_1's minimum through the activation sum) agree with the format crate's
    /// dequantizers.
    #[test]
    fn reference_dots_match_dequantized_weights(nb in 1usize..6, seed in any::<u64>()) {
        let mut g = Rng(seed);
        let x32 = g.floats(nb * QK_K, 4.0);
        let xq = q8_0_act(&x32);
        let xk = q8_k_act(&x32);
        let (v8, vk) = (q8_0_values(&xq), q8_k_values(&xk));
        let n32 = nb * QK_K / QK;
        let mut w = vec![0f32; nb * QK_K];

        let b = q5_0_blocks(&mut g, n32);
        dequantize_row_q5_0(&b, &mut w);
        close_to_dequantized(r::dot_q5_0_q8_0_ref(&b, &xq), &w, &v8, "q5_0");
        let b = q5_1_blocks(&mut g, n32);
        dequantize_row_q5_1(&b, &mut w);
        close_to_dequantized(r::dot_q5_1_q8_0_ref(&b, &xq), &w, &v8, "q5_1");
        let b = q4_k_blocks(&mut g, nb);
        dequantize_row_q4_k(&b, &mut w);
        close_to_dequantized(r::dot_q4_k_q8_k_ref(&b, &xk), &w, &vk, "q4_k");
        let b = q5_k_blocks(&mut g, nb);
        dequantize_row_q5_k(&b, &mut w);
        close_to_dequantized(r::dot_q5_k_q8_k_ref(&b, &xk), &w, &vk, "q5_k");
        let b = q6_k_blocks(&mut g, nb);
        dequantize_row_q6_k(&b, &mut w);
        close_to_dequantized(r::dot_q6_k_q8_k_ref(&b, &xk), &w, &vk, "q6_k");
        let b = q2_k_blocks(&mut g, nb);
        dequantize_row_q2_k(&b, &mut w);
        close_to_dequantized(r::dot_q2_k_q8_k_ref(&b, &xk), &w, &vk, "q2_k");
        let b = q3_k_blocks(&mut g, nb);
        dequantize_row_q3_k(&b, &mut w);
        close_to_dequantized(r::dot_q3_k_q8_k_ref(&b, &xk), &w, &vk, "q3_k");
        let b = iq4_nl_blocks(&mut g, n32);
        dequantize_row_iq4_nl(&b, &mut w);
        close_to_dequantized(r::dot_iq4_nl_q8_0_ref(&b, &xq), &w, &v8, "iq4_nl");
        let b = iq4_xs_blocks(&mut g, nb);
        dequantize_row_iq4_xs(&b, &mut w);
        close_to_dequantized(r::dot_iq4_xs_q8_k_ref(&b, &xk), &w, &vk, "iq4_xs");
    }

    /// Every tier's one-row dot gives the reference's bits, for block counts around the eight
    /// accumulators (1..=19 blocks), activations of any magnitude.
    #[test]
    fn every_tier_dot_equals_reference_bits(
        nb in 1usize..20,
        amp in prop::sample::select(vec![1e-3f32, 1.0, 100.0]),
        seed in any::<u64>(),
    ) {
        let mut g = Rng(seed);
        let x32 = g.floats(nb * QK_K, amp);
        let xq = q8_0_act(&x32);
        let xk = q8_k_act(&x32);
        let n32 = nb * QK_K / QK;
        let (b50, b51) = (q5_0_blocks(&mut g, n32), q5_1_blocks(&mut g, n32));
        let (b4k, b5k, b6k) = (q4_k_blocks(&mut g, nb), q5_k_blocks(&mut g, nb), q6_k_blocks(&mut g, nb));
        let (b2k, b3k) = (q2_k_blocks(&mut g, nb), q3_k_blocks(&mut g, nb));
        let (bnl, bxs) = (iq4_nl_blocks(&mut g, n32), iq4_xs_blocks(&mut g, nb));
        // Q5_0/Q5_1 also at block counts that are not multiples of eight.
        let m = (n32 - 1).min(nb * 3 + 1);
        for k in tiers() {
            let isa = k.isa();
            same_bits(k.dot_q5_0_q8_0(&b50, &xq), r::dot_q5_0_q8_0_ref(&b50, &xq), &format!("q5_0 {isa:?}"));
            same_bits(k.dot_q5_0_q8_0(&b50[..m], &xq[..m]), r::dot_q5_0_q8_0_ref(&b50[..m], &xq[..m]), &format!("q5_0 {m} blocks {isa:?}"));
            same_bits(k.dot_q5_1_q8_0(&b51, &xq), r::dot_q5_1_q8_0_ref(&b51, &xq), &format!("q5_1 {isa:?}"));
            same_bits(k.dot_q5_1_q8_0(&b51[..m], &xq[..m]), r::dot_q5_1_q8_0_ref(&b51[..m], &xq[..m]), &format!("q5_1 {m} blocks {isa:?}"));
            same_bits(k.dot_q4_k_q8_k(&b4k, &xk), r::dot_q4_k_q8_k_ref(&b4k, &xk), &format!("q4_k {isa:?}"));
            same_bits(k.dot_q5_k_q8_k(&b5k, &xk), r::dot_q5_k_q8_k_ref(&b5k, &xk), &format!("q5_k {isa:?}"));
            same_bits(k.dot_q6_k_q8_k(&b6k, &xk), r::dot_q6_k_q8_k_ref(&b6k, &xk), &format!("q6_k {isa:?}"));
            same_bits(k.dot_q2_k_q8_k(&b2k, &xk), r::dot_q2_k_q8_k_ref(&b2k, &xk), &format!("q2_k {isa:?}"));
            same_bits(k.dot_q3_k_q8_k(&b3k, &xk), r::dot_q3_k_q8_k_ref(&b3k, &xk), &format!("q3_k {isa:?}"));
            same_bits(k.dot_iq4_nl_q8_0(&bnl, &xq), r::dot_iq4_nl_q8_0_ref(&bnl, &xq), &format!("iq4_nl {isa:?}"));
            same_bits(k.dot_iq4_nl_q8_0(&bnl[..m], &xq[..m]), r::dot_iq4_nl_q8_0_ref(&bnl[..m], &xq[..m]), &format!("iq4_nl {m} blocks {isa:?}"));
            same_bits(k.dot_iq4_xs_q8_k(&bxs, &xk), r::dot_iq4_xs_q8_k_ref(&bxs, &xk), &format!("iq4_xs {isa:?}"));
        }
    }
}

/// Extreme blocks: every code and scale at its largest (and Q6_K's scales at −128), activations
/// at ±127 — the sums that would overflow a narrower accumulator or saturate a 16-bit pair.
#[test]
fn extreme_blocks_give_reference_bits() {
    let x: Vec<f32> = (0..2 * QK_K)
        .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    let (xq, xk) = (q8_0_act(&x), q8_k_act(&x));
    let one = f16::from_f32(1.0);
    let b50 = vec![
        BlockQ5_0 {
            d: one,
            qh: [0xff; 4],
            qs: [0xff; 16]
        };
        16
    ];
    let b51 = vec![
        BlockQ5_1 {
            d: one,
            m: one,
            qh: [0xff; 4],
            qs: [0xff; 16]
        };
        16
    ];
    let b4k = vec![
        BlockQ4K {
            d: one,
            dmin: one,
            scales: [0xff; 12],
            qs: [0xff; 128]
        };
        2
    ];
    let b5k = vec![
        BlockQ5K {
            d: one,
            dmin: one,
            scales: [0xff; 12],
            qh: [0xff; 32],
            qs: [0xff; 128]
        };
        2
    ];
    for (ql, qh, sc) in [(0xff, 0xff, 127i8), (0x00, 0x00, -128), (0xff, 0xff, -128)] {
        let b6k = vec![
            BlockQ6K {
                ql: [ql; 128],
                qh: [qh; 64],
                scales: [sc; 16],
                d: one
            };
            2
        ];
        for k in tiers() {
            let isa = k.isa();
            same_bits(
                k.dot_q6_k_q8_k(&b6k, &xk),
                r::dot_q6_k_q8_k_ref(&b6k, &xk),
                &format!("q6_k {ql:#x} {sc} {isa:?}"),
            );
        }
    }
    for k in tiers() {
        let isa = k.isa();
        same_bits(
            k.dot_q5_0_q8_0(&b50, &xq),
            r::dot_q5_0_q8_0_ref(&b50, &xq),
            &format!("q5_0 {isa:?}"),
        );
        same_bits(
            k.dot_q5_1_q8_0(&b51, &xq),
            r::dot_q5_1_q8_0_ref(&b51, &xq),
            &format!("q5_1 {isa:?}"),
        );
        same_bits(
            k.dot_q4_k_q8_k(&b4k, &xk),
            r::dot_q4_k_q8_k_ref(&b4k, &xk),
            &format!("q4_k {isa:?}"),
        );
        same_bits(
            k.dot_q5_k_q8_k(&b5k, &xk),
            r::dot_q5_k_q8_k_ref(&b5k, &xk),
            &format!("q5_k {isa:?}"),
        );
    }
    // Q2_K: codes and 4-bit scales and mins at their extremes.
    for (qs, sc) in [(0xff, 0xff), (0x00, 0xff), (0xff, 0x0f), (0xff, 0xf0)] {
        let b2k = vec![
            BlockQ2K {
                scales: [sc; 16],
                qs: [qs; 64],
                d: one,
                dmin: one
            };
            2
        ];
        for k in tiers() {
            let isa = k.isa();
            same_bits(
                k.dot_q2_k_q8_k(&b2k, &xk),
                r::dot_q2_k_q8_k_ref(&b2k, &xk),
                &format!("q2_k {qs:#x} {sc:#x} {isa:?}"),
            );
        }
    }
    // Q3_K: codes 0 or 7 against scales 31 (all bits set) or −32 (none).
    for (bits, sc) in [(0xff, 0xff), (0x00, 0x00), (0xff, 0x00), (0x00, 0xff)] {
        let b3k = vec![
            BlockQ3K {
                hmask: [bits; 32],
                qs: [bits; 64],
                scales: [sc; 12],
                d: one
            };
            2
        ];
        for k in tiers() {
            let isa = k.isa();
            same_bits(
                k.dot_q3_k_q8_k(&b3k, &xk),
                r::dot_q3_k_q8_k_ref(&b3k, &xk),
                &format!("q3_k {bits:#x} {sc:#x} {isa:?}"),
            );
        }
    }
    // IQ4_NL and IQ4_XS: the grid's ends (−127, 113) against scales 31 and −32.
    for qs in [0x00u8, 0xff, 0x0f, 0xf0] {
        let bnl = vec![
            BlockIQ4NL {
                d: one,
                qs: [qs; 16]
            };
            16
        ];
        for (sh, sl) in [(0xffffu16, 0xffu8), (0x0000, 0x00)] {
            let bxs = vec![
                BlockIQ4XS {
                    d: one,
                    scales_h: sh,
                    scales_l: [sl; 4],
                    qs: [qs; 128]
                };
                2
            ];
            for k in tiers() {
                let isa = k.isa();
                same_bits(
                    k.dot_iq4_xs_q8_k(&bxs, &xk),
                    r::dot_iq4_xs_q8_k_ref(&bxs, &xk),
                    &format!("iq4_xs {qs:#x} {sh:#x} {isa:?}"),
                );
            }
        }
        for k in tiers() {
            let isa = k.isa();
            same_bits(
                k.dot_iq4_nl_q8_0(&bnl, &xq),
                r::dot_iq4_nl_q8_0_ref(&bnl, &xq),
                &format!("iq4_nl {qs:#x} {isa:?}"),
            );
        }
    }
}

/// The extreme blocks of the lanes kernels' encodings as a prefill batch of 48 tokens
/// whose activation codes reach ±127 (Q8_K's −128 too): IQ4_NL's and IQ4_XS's grid ends under
/// scales 31 and −32, Q3_K's codes 0 and 7, Q2_K's 3 under scale and min 15, and Q8_0 weights at
/// −128 and 127, each token the reference's bits (the block lanes kernel's order where the
/// batch takes it).
#[test]
fn extreme_blocks_through_the_lanes_kernels_give_reference_bits() {
    let (rows, cols, n) = (4, 2 * QK_K, 48);
    let x: Vec<f32> = (0..n * cols)
        .map(|i| {
            let (t, c) = (i / cols, i % cols);
            let v = if (c + t) % 3 == 0 { -1.0 } else { 1.0 };
            // Some tokens' largest magnitude negative: Q8_K codes −128.
            if t % 2 == 1 && c % 64 == 5 {
                -2.0
            } else {
                v
            }
        })
        .collect();
    let one = f16::from_f32(1.0);
    let (n32, nk) = (rows * cols / QK, rows * cols / QK_K);
    let cycle = |i: usize, k: usize| i % k;
    let q8: Vec<BlockQ8_0> = (0..n32)
        .map(|i| BlockQ8_0 {
            d: one,
            qs: [if cycle(i, 3) == 0 { 127 } else { -128 }; QK],
        })
        .collect();
    let nl: Vec<BlockIQ4NL> = (0..n32)
        .map(|i| BlockIQ4NL {
            d: one,
            qs: [[0x00, 0xff, 0x0f, 0xf0][cycle(i, 4)]; 16],
        })
        .collect();
    let xs: Vec<BlockIQ4XS> = (0..nk)
        .map(|i| BlockIQ4XS {
            d: one,
            scales_h: [0xffff, 0][cycle(i, 2)],
            scales_l: [[0xff, 0][cycle(i, 2)]; 4],
            qs: [[0x00, 0xff, 0x0f][cycle(i, 3)]; 128],
        })
        .collect();
    let q3: Vec<BlockQ3K> = (0..nk)
        .map(|i| BlockQ3K {
            hmask: [[0xff, 0][cycle(i, 2)]; 32],
            qs: [[0xff, 0][cycle(i, 2)]; 64],
            scales: [[0xff, 0x00, 0xaa][cycle(i, 3)]; 12],
            d: one,
        })
        .collect();
    let q2: Vec<BlockQ2K> = (0..nk)
        .map(|i| BlockQ2K {
            scales: [[0xff, 0x0f, 0xf0][cycle(i, 3)]; 16],
            qs: [0xff; 64],
            d: one,
            dmin: one,
        })
        .collect();
    type Dot<'a> = Box<dyn Fn(usize, &[f32], bool) -> f32 + 'a>;
    let cases: Vec<(WeightData, Dot)> = vec![
        (
            WeightData::Q8_0(&q8),
            Box::new(|r, x, _| r::dot_q8_0_q8_0_ref(&q8[r * 16..][..16], &q8_0_act(x))),
        ),
        (
            WeightData::IQ4_NL(&nl),
            Box::new(|r, x, lanes| {
                let (w, a) = (&nl[r * 16..][..16], q8_0_act(x));
                if lanes {
                    r::dot_iq4_nl_q8_0_seq_ref(w, &a)
                } else {
                    r::dot_iq4_nl_q8_0_ref(w, &a)
                }
            }),
        ),
        (
            WeightData::IQ4_XS(&xs),
            Box::new(|r, x, _| r::dot_iq4_xs_q8_k_ref(&xs[r * 2..][..2], &q8_k_act(x))),
        ),
        (
            WeightData::Q3_K(&q3),
            Box::new(|r, x, _| r::dot_q3_k_q8_k_ref(&q3[r * 2..][..2], &q8_k_act(x))),
        ),
        (
            WeightData::Q2_K(&q2),
            Box::new(|r, x, _| r::dot_q2_k_q8_k_ref(&q2[r * 2..][..2], &q8_k_act(x))),
        ),
    ];
    let pool = Pool::new(2).unwrap();
    for (data, dot) in &cases {
        let m = Matrix::new(rows, cols, *data).unwrap();
        let name = data.dtype_name();
        for k in tiers() {
            let path = plan(k, &m, n);
            // Q8_0's tiles sum in their own order (tested in tiers.rs); its lanes give the
            // reference's.
            if matches!(data, WeightData::Q8_0(_)) && path != Path::Lanes {
                continue;
            }
            let mut out = vec![f32::NAN; n * rows];
            k.matmul(&m, &x, n, &mut out, &pool);
            for t in 0..n {
                for r in 0..rows {
                    let want = dot(r, &x[t * cols..(t + 1) * cols], path == Path::Lanes);
                    let what = format!("{name} {:?} ({path}) token {t} row {r}", k.isa());
                    same_bits(out[t * rows + r], want, &what);
                }
            }
        }
    }
}

/// Blocks of one encoding for a `rows × cols` matrix.
enum Owned {
    Q5_0(Vec<BlockQ5_0>),
    Q5_1(Vec<BlockQ5_1>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
    Q2K(Vec<BlockQ2K>),
    Q3K(Vec<BlockQ3K>),
    IQ4NL(Vec<BlockIQ4NL>),
    IQ4XS(Vec<BlockIQ4XS>),
    /// Interleaved IQ4_NL, with its plain rows (the reference's).
    IQ4NLx16(Vec<BlockIQ4NLx16>, Vec<BlockIQ4NL>),
    /// Interleaved IQ4_XS, with its plain rows (the reference's).
    IQ4XSx16(Vec<BlockIQ4XSx16>, Vec<BlockIQ4XS>),
}

impl Owned {
    fn all(g: &mut Rng, rows: usize, cols: usize) -> Vec<Owned> {
        let (n32, nk) = (rows * cols / QK, rows * cols / QK_K);
        let mut all = vec![
            Owned::Q5_0(q5_0_blocks(g, n32)),
            Owned::Q5_1(q5_1_blocks(g, n32)),
            Owned::Q4K(q4_k_blocks(g, nk)),
            Owned::Q5K(q5_k_blocks(g, nk)),
            Owned::Q6K(q6_k_blocks(g, nk)),
            Owned::Q2K(q2_k_blocks(g, nk)),
            Owned::Q3K(q3_k_blocks(g, nk)),
            Owned::IQ4NL(iq4_nl_blocks(g, n32)),
            Owned::IQ4XS(iq4_xs_blocks(g, nk)),
        ];
        if rows.is_multiple_of(GROUP_ROWS) {
            let b = iq4_nl_blocks(g, n32);
            all.push(Owned::IQ4NLx16(interleave_iq4_nl(&b, cols / QK), b));
            let b = iq4_xs_blocks(g, nk);
            all.push(Owned::IQ4XSx16(interleave_iq4_xs(&b, cols / QK_K), b));
        }
        all
    }

    fn data(&self) -> WeightData<'_> {
        match self {
            Owned::Q5_0(b) => WeightData::Q5_0(b),
            Owned::Q5_1(b) => WeightData::Q5_1(b),
            Owned::Q4K(b) => WeightData::Q4_K(b),
            Owned::Q5K(b) => WeightData::Q5_K(b),
            Owned::Q6K(b) => WeightData::Q6_K(b),
            Owned::Q2K(b) => WeightData::Q2_K(b),
            Owned::Q3K(b) => WeightData::Q3_K(b),
            Owned::IQ4NL(b) => WeightData::IQ4_NL(b),
            Owned::IQ4XS(b) => WeightData::IQ4_XS(b),
            Owned::IQ4NLx16(b, _) => WeightData::IQ4_NLx16(b),
            Owned::IQ4XSx16(b, _) => WeightData::IQ4_XSx16(b),
        }
    }

    /// The reference dot of row `r` (`cols` wide) with token activations `x`, in the block
    /// lanes kernel's order where the batch takes it (`lanes`; IQ4_NL's differs).
    fn ref_dot(&self, r: usize, cols: usize, x: &[f32], lanes: bool) -> f32 {
        let (n32, nk) = (cols / QK, cols / QK_K);
        match self {
            Owned::Q5_0(b) => r::dot_q5_0_q8_0_ref(&b[r * n32..(r + 1) * n32], &q8_0_act(x)),
            Owned::Q5_1(b) => r::dot_q5_1_q8_0_ref(&b[r * n32..(r + 1) * n32], &q8_0_act(x)),
            Owned::Q4K(b) => r::dot_q4_k_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x)),
            Owned::Q5K(b) => r::dot_q5_k_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x)),
            Owned::Q6K(b) => r::dot_q6_k_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x)),
            Owned::Q2K(b) => r::dot_q2_k_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x)),
            Owned::Q3K(b) => r::dot_q3_k_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x)),
            Owned::IQ4NL(b) | Owned::IQ4NLx16(_, b) if lanes => {
                r::dot_iq4_nl_q8_0_seq_ref(&b[r * n32..(r + 1) * n32], &q8_0_act(x))
            }
            Owned::IQ4NL(b) | Owned::IQ4NLx16(_, b) => {
                r::dot_iq4_nl_q8_0_ref(&b[r * n32..(r + 1) * n32], &q8_0_act(x))
            }
            Owned::IQ4XS(b) | Owned::IQ4XSx16(_, b) => {
                r::dot_iq4_xs_q8_k_ref(&b[r * nk..(r + 1) * nk], &q8_k_act(x))
            }
        }
    }
}

/// `matmul` at every tier, with 1 and 2 threads, gives the reference dot of every (row, token)
/// bit for bit, and `matmul_many` over several matrices the same.
fn check_matmul(rows: usize, cols: usize, n_tokens: usize, seed: u64) {
    let mut g = Rng(seed);
    let x = g.floats(n_tokens * cols, 3.0);
    let all = Owned::all(&mut g, rows, cols);
    let pools = [Pool::new(1).unwrap(), Pool::new(2).unwrap()];
    for w in &all {
        let m = Matrix::new(rows, cols, w.data()).unwrap();
        let name = w.data().dtype_name();
        let want = |lanes: bool| -> Vec<f32> {
            (0..n_tokens)
                .flat_map(|t| {
                    let xt = &x[t * cols..(t + 1) * cols];
                    (0..rows).map(move |r| w.ref_dot(r, cols, xt, lanes))
                })
                .collect()
        };
        let (want_tiles, want_lanes) = (want(false), want(true));
        for k in tiers() {
            let want = match plan(k, &m, n_tokens) {
                Path::Lanes => &want_lanes,
                _ => &want_tiles,
            };
            for pool in &pools {
                let mut out = vec![f32::NAN; n_tokens * rows];
                k.matmul(&m, &x, n_tokens, &mut out, pool);
                for (i, (&got, &want)) in out.iter().zip(want).enumerate() {
                    same_bits(
                        got,
                        want,
                        &format!(
                            "{name} {rows}×{cols}, {n_tokens} tokens, token {} row {}, {:?}, {} threads",
                            i / rows,
                            i % rows,
                            k.isa(),
                            pool.threads()
                        ),
                    );
                }
                let (mut a, mut b) = (vec![0.0; n_tokens * rows], vec![0.0; n_tokens * rows]);
                k.matmul_many(&[&m, &m], &x, n_tokens, &mut [&mut a, &mut b], pool);
                assert!(a.iter().zip(want).all(|(g, w)| g.to_bits() == w.to_bits()));
                assert!(b.iter().zip(want).all(|(g, w)| g.to_bits() == w.to_bits()));
            }
        }
    }
}

#[test]
fn matvec_and_prefill_shapes() {
    for (rows, cols, n) in [
        (1, 256, 1),
        (5, 512, 1),
        (16, 256, 1),
        (33, 768, 1),
        // Sixteen-row one-token kernels: whole groups of eight blocks, and two with a tail.
        (16, 8 * 256, 1),
        (32, 17 * 256, 1),
        (7, 256, 2),
        (20, 512, 3),
        (17, 256, 4),
        (9, 256, 9),
        (40, 512, 17),
        // Interleaved IQ4_NL: a few tokens per call, and the lanes kernel.
        (48, 512, 6),
        (32, 19 * 256, 3),
        (32, 512, 50),
    ] {
        check_matmul(rows, cols, n, (rows * 1000 + cols + n) as u64);
    }
}

/// One-token products of 32-weight block types whose rows are not whole groups of eight blocks
/// (the sixteen-row kernels' tail), against the reference bit for bit.
#[test]
fn matvec_rows_with_a_tail_of_blocks() {
    let (rows, cols) = (32, 19 * QK);
    let mut g = Rng(19);
    let x = g.floats(cols, 3.0);
    let nl = iq4_nl_blocks(&mut g, rows * cols / QK);
    let x16 = interleave_iq4_nl(&nl, cols / QK);
    let pool = Pool::new(2).unwrap();
    for data in [WeightData::IQ4_NL(&nl), WeightData::IQ4_NLx16(&x16)] {
        let m = Matrix::new(rows, cols, data).unwrap();
        for k in tiers() {
            let mut out = vec![f32::NAN; rows];
            k.matmul(&m, &x, 1, &mut out, &pool);
            for (r, &got) in out.iter().enumerate() {
                let want = r::dot_iq4_nl_q8_0_ref(&nl[r * 19..(r + 1) * 19], &q8_0_act(&x));
                same_bits(
                    got,
                    want,
                    &format!("{} {rows}×{cols} row {r}, {:?}", data.dtype_name(), k.isa()),
                );
            }
        }
    }
}

/// Batches through the lanes kernels: more than eight super-blocks a row (the eight
/// accumulators wrap), chunks of 64 rows and a short last one, one group of sixteen tokens and
/// pairs of groups with a partial last group.
#[test]
fn prefill_batches_through_the_lanes_kernels_give_reference_bits() {
    for (rows, cols, n) in [
        (8, 256, 8),
        (12, 9 * 256, 16),
        (70, 10 * 256, 33),
        (5, 3 * 256, 48),
    ] {
        check_matmul(rows, cols, n, (rows * 7919 + cols + n) as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    fn random_prefill_shapes_give_reference_bits(
        rows in 1usize..70,
        blocks in 1usize..11,
        n_tokens in 8usize..40,
        seed in any::<u64>(),
    ) {
        check_matmul(rows, blocks * QK_K, n_tokens, seed);
    }

    #[test]
    fn random_matmul_shapes_give_reference_bits(
        rows in 1usize..40,
        blocks in 1usize..4,
        n_tokens in 1usize..12,
        seed in any::<u64>(),
    ) {
        check_matmul(rows, blocks * QK_K, n_tokens, seed);
    }
}

const Q8K_ZERO: BlockQ8K = BlockQ8K {
    d: 0.0,
    qs: [0; QK_K],
    bsums: [0; QK_K / 16],
};

/// Every tier's Q8_K quantization of activations is the reference's, byte for byte (the scale
/// compared by bits): random rows, rows whose largest magnitude occurs with both signs, rows
/// with NaN and infinities, all-zero and all-NaN blocks.
fn q8_k_act_same_bytes(x: &[f32], what: &str) {
    let mut want = vec![Q8K_ZERO; x.len() / QK_K];
    r::quantize_row_q8_k_act_ref(x, &mut want);
    for k in tiers() {
        let mut got = vec![Q8K_ZERO; x.len() / QK_K];
        k.quantize_row_q8_k_act(x, &mut got);
        for (b, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.d.to_bits(),
                w.d.to_bits(),
                "{what} block {b} scale, {:?}",
                k.isa()
            );
            assert_eq!(g.qs, w.qs, "{what} block {b} codes, {:?}", k.isa());
            assert_eq!(g.bsums, w.bsums, "{what} block {b} sums, {:?}", k.isa());
        }
    }
}

proptest! {
    #[test]
    fn every_tier_quantizes_q8_k_activations_as_the_reference(
        blocks in 1usize..4,
        seed in any::<u64>(),
        amp in prop::sample::select(vec![1e-30f32, 1e-3, 1.0, 3.0, 1e30]),
        specials in prop::collection::vec((0usize..1024, 0usize..6), 0..6),
    ) {
        let mut g = Rng(seed);
        let mut x = g.floats(blocks * QK_K, amp);
        for (i, kind) in specials {
            let i = i % x.len();
            x[i] = match kind {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -x[(i + 7) % x.len()],
                4 => 0.0,
                _ => -0.0,
            };
        }
        // The largest magnitude with both signs, the negative first.
        if let Some((m, _)) = x.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())) {
            let v = x[m].abs();
            if v.is_finite() {
                x[m] = v;
                x[m / 2] = -v;
            }
        }
        q8_k_act_same_bytes(&x, "random");
    }
}

#[test]
fn q8_k_activation_edge_blocks() {
    q8_k_act_same_bytes(&[0.0; QK_K], "zeros");
    q8_k_act_same_bytes(&[f32::NAN; QK_K], "NaN");
    q8_k_act_same_bytes(&[-0.0; QK_K], "negative zeros");
    let mut x = vec![1.0f32; 2 * QK_K];
    x[300] = f32::INFINITY;
    x[5] = f32::NAN;
    q8_k_act_same_bytes(&x, "infinity");
    let ramp: Vec<f32> = (0..QK_K).map(|i| i as f32 - 127.5).collect();
    q8_k_act_same_bytes(&ramp, "ramp");
}

#[test]
fn matrix_new_rejects_partial_blocks() {
    let k = vec![bytemuck::Zeroable::zeroed(); 4];
    let e = Matrix::new(2, 576, WeightData::Q4_K(&k)).unwrap_err();
    assert_eq!(
        e,
        KernelError::ColsNotBlockLenMultiple {
            dtype: "q4_k",
            cols: 576,
            block: 256
        }
    );
    assert!(e.to_string().contains("576 columns"), "{e}");
    let q5 = vec![bytemuck::Zeroable::zeroed(); 4];
    let e = Matrix::new(2, 48, WeightData::Q5_0(&q5)).unwrap_err();
    assert!(matches!(
        e,
        KernelError::ColsNotBlockLenMultiple { block: 32, .. }
    ));
    let e = Matrix::new(
        3,
        256,
        WeightData::Q6_K(&vec![bytemuck::Zeroable::zeroed(); 2]),
    )
    .unwrap_err();
    assert!(matches!(
        e,
        KernelError::LengthMismatch {
            expected: 3,
            found: 2,
            ..
        }
    ));
}
