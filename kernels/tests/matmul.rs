//! `matmul` against a naive triple loop for every weight encoding and tier, and the
//! determinism guarantees: bit-identical results for 1, 2 and 3 threads, and a token's
//! result independent of the batch it is in.
//!
//! The naive loop runs in f64 over dequantized weights (and, for Q8_0/Q4_0, over the Q8_0
//! activations the kernel sees), so the only difference is f32 summation: metric
//! `|got − naive| / Σ|w·x|`, bounded by `cols·ε` (`MATMUL_TERMS_TOL` per column).

use kiln_kernels::{
    kernels, plan, plan_for, tested_isas, Batching, Isa, KernelError, Kernels, Matrix,
    OwnedWeights, Path, Pool, WeightData, QK,
};

/// Allowed error per summed column relative to Σ|w·x|, plus a few roundings per block.
const MATMUL_TERMS_TOL: f64 = 2.0 * f32::EPSILON as f64;

struct Case {
    cols: usize,
    w: Vec<f32>,
}

impl Case {
    fn new(rows: usize, cols: usize, seed: u64) -> Case {
        let mut s = seed;
        let w = (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect();
        Case { cols, w }
    }
}

/// Every tier tested here ([`tested_isas`]: fails if `KILN_EXPECT_TIERS` names one this CPU
/// lacks), each with its table.
fn tiers() -> Vec<&'static Kernels> {
    tested_isas()
        .into_iter()
        .map(|i| kernels(i).expect("a supported tier has a table"))
        .collect()
}

fn activations(n: usize, seed: u64) -> Vec<f32> {
    Case::new(n, 1, seed).w.iter().map(|v| v * 3.0).collect()
}

/// Every encoding the case's shape allows (block dtypes need whole blocks per row, the
/// interleaved Q4_0 whole groups of sixteen rows).
fn encodings(c: &Case) -> Vec<OwnedWeights> {
    let mut all: Vec<OwnedWeights> = OwnedWeights::DTYPES
        .iter()
        .filter(|d| !d.starts_with('q') || c.cols.is_multiple_of(QK))
        .filter_map(|d| OwnedWeights::encode(d, &c.w))
        .collect();
    let interleaved: Vec<OwnedWeights> = all.iter().filter_map(|w| w.interleaved(c.cols)).collect();
    all.extend(interleaved);
    all
}

fn quantizes_activations(w: &OwnedWeights) -> bool {
    matches!(
        w,
        OwnedWeights::Q8_0(_) | OwnedWeights::Q4_0(_) | OwnedWeights::Q4_0x16 { .. }
    )
}

/// What the kernel multiplies by: `x` itself, or its Q8_0 round trip for quantized weights.
fn effective_x(x: &[f32], quantized: bool) -> Vec<f32> {
    if !quantized {
        return x.to_vec();
    }
    let q = kiln_format::blocks::quantize_row_q8_0_ref(x).unwrap();
    let mut o = vec![0.0; x.len()];
    kiln_format::blocks::dequantize_row_q8_0(&q, &mut o);
    o
}

fn check(rows: usize, cols: usize, n_tokens: usize, seed: u64) {
    let case = Case::new(rows, cols, seed);
    let x = activations(n_tokens * cols, seed ^ 0xabc);
    let pools: Vec<Pool> = [1, 2, 3].iter().map(|&t| Pool::new(t).unwrap()).collect();
    let scalar = kernels(Isa::Scalar).unwrap();
    for owned in encodings(&case) {
        let m = Matrix::new(rows, cols, owned.data()).unwrap();
        let wd = owned.dequantized();
        let xe = effective_x(&x, quantizes_activations(&owned));
        for k in tiers() {
            let mut first: Option<Vec<f32>> = None;
            for pool in &pools {
                let mut out = vec![f32::NAN; rows * n_tokens];
                k.matmul(&m, &x, n_tokens, &mut out, pool);
                match &first {
                    None => first = Some(out),
                    Some(f) => assert!(
                        f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} {:?} {rows}x{cols} n={n_tokens}: {} threads differ from 1",
                        m.data.dtype_name(),
                        k.isa(),
                        pool.threads()
                    ),
                }
            }
            let out = first.unwrap();
            independent_rows_match_alone(k, &m, &x, n_tokens, &pools[1]);
            texts_rows_match_alone(k, &m, &x, n_tokens, &pools[1]);
            let path = plan(k, &m, n_tokens);
            if path == Path::FloatLanes {
                float_lanes_bits(&wd, &x, rows, cols, n_tokens, &out, k.isa());
            }
            for t in 0..n_tokens {
                for r in 0..rows {
                    let (mut exact, mut abs) = (0.0f64, 0.0f64);
                    for c in 0..cols {
                        let p = wd[r * cols + c] as f64 * xe[t * cols + c] as f64;
                        exact += p;
                        abs += p.abs();
                    }
                    let got = out[t * rows + r] as f64;
                    let tol = MATMUL_TERMS_TOL * (cols as f64 + 8.0) * abs + 1e-30;
                    assert!(
                        (got - exact).abs() <= tol,
                        "{} {:?} {rows}x{cols} n={n_tokens} t={t} r={r}: got {got}, naive {exact}, tol {tol}",
                        m.data.dtype_name(),
                        k.isa()
                    );
                }
            }
            // A token's result does not depend on the batch around it, except in batches that
            // take a tier's lanes kernels: the block lanes kernel gives the scalar reference's
            // bits, and the float lanes kernel `float_lanes_ref`'s (one FMA chain per row and
            // token), checked above.
            if path == Path::FloatLanes {
                continue;
            }
            let lanes = path == Path::Lanes;
            // Token 0 goes through the multi-token tile kernel, the last one may not.
            for t in [0, n_tokens - 1].into_iter().filter(|_| n_tokens > 1) {
                let mut single = vec![0.0; rows];
                let (want, what) = if lanes {
                    (scalar, "the scalar tier")
                } else {
                    (k, "single-token matmul")
                };
                let xt = &x[t * cols..(t + 1) * cols];
                want.matmul(&m, xt, 1, &mut single, &pools[1]);
                assert!(
                    single
                        .iter()
                        .zip(&out[t * rows..])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {:?} n={n_tokens}: batched token {t} differs from {what}",
                    m.data.dtype_name(),
                    k.isa()
                );
            }
        }
    }
}

/// Every (row, token) of a float lanes product is `float_lanes_ref` of the row (widened
/// weights, exact for f16/bf16) and the token, bit for bit.
fn float_lanes_bits(
    wd: &[f32],
    x: &[f32],
    rows: usize,
    cols: usize,
    n_tokens: usize,
    out: &[f32],
    isa: Isa,
) {
    for t in 0..n_tokens {
        for r in 0..rows {
            let want = kiln_kernels::reference::float_lanes_ref(
                &wd[r * cols..(r + 1) * cols],
                &x[t * cols..(t + 1) * cols],
                0.0,
            );
            let got = out[t * rows + r];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{isa:?} {rows}x{cols} n={n_tokens} t={t} r={r}: float lanes {got}, reference {want}"
            );
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
    /// Float weights in batches that take the float lanes kernels: shapes across the row
    /// chunk (64), the row tile (8), the column block (128) and the token tile (32, and half
    /// of it), every tier, 1–3 threads, against the naive loop and `float_lanes_ref`'s bits.
    #[test]
    fn float_lanes_batches(
        rows in proptest::sample::select(vec![1usize, 7, 8, 20, 64, 65, 130]),
        cols in proptest::sample::select(vec![1usize, 5, 64, 127, 128, 129, 300]),
        n in proptest::sample::select(vec![16usize, 17, 31, 32, 33, 48, 70]),
        seed in proptest::prelude::any::<u64>(),
    ) {
        check(rows, cols, n, seed);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
    /// Block weights in batches that take the lanes kernels (from 8 tokens; 48 for interleaved
    /// Q4_0): shapes across the row chunk (64), the row tile (4), the column block (8 blocks),
    /// one group of sixteen tokens or a pair, every tier, 1–3 threads, against the naive loop
    /// and, at AVX-512, the scalar reference's bits per token.
    #[test]
    fn block_lanes_batches(
        rows in proptest::sample::select(vec![16usize, 20, 48, 64, 80, 144]),
        cols in proptest::sample::select(vec![32usize, 256, 288, 544]),
        n in proptest::sample::select(vec![8usize, 16, 17, 33, 48, 50, 70]),
        seed in proptest::prelude::any::<u64>(),
    ) {
        check(rows, cols, n, seed);
    }
}

#[test]
fn matvec_block_shapes() {
    check(37, 96, 1, 1); // rows not a multiple of the tile or chunk
    check(64, 32, 1, 2);
    check(1, 160, 1, 3);
}

#[test]
fn matvec_odd_float_shapes() {
    check(19, 45, 1, 4); // float only: cols not a multiple of 32
    check(5, 1, 1, 5);
    // Two full chunks (the sixteen-row kernel for one token) and a tail, compared bit for bit
    // with a batch of three (the four-row tiles), cols leaving a scalar tail.
    check(35, 45, 3, 11);
}

#[test]
fn interleaved_q4_0_shapes() {
    check(48, 96, 1, 12); // three sixteen-row chunks, one token
    check(32, 160, 3, 13); // a small batch: the interleaved kernel token by token
    check(64, 64, 17, 14); // the interleaved kernel token by token
    check(32, 96, 50, 16); // the lanes kernel, rows unpacked from the interleaved bytes
    check(16, 32, 8, 15);
}

/// Interleaved Q4_0 gives the scalar reference's bits for every batch size through the
/// interleaved and lanes kernels; where [`plan`] turns it back into plain rows
/// ([`Path::Deinterleaved`]: the scalar tier, NEON), the tier's own plain Q4_0 tiles' bits.
fn interleaved_bits(rows: usize, cols: usize, n: usize, seed: u64) {
    let case = Case::new(rows, cols, seed);
    let plain = OwnedWeights::encode("q4_0", &case.w).unwrap();
    let inter = plain.interleaved(cols).unwrap();
    let pool = Pool::new(2).unwrap();
    let scalar = kernels(Isa::Scalar).unwrap();
    let x = activations(n * cols, seed ^ 0x5eed);
    let mp = Matrix::new(rows, cols, plain.data()).unwrap();
    let mi = Matrix::new(rows, cols, inter.data()).unwrap();
    let mut want = vec![0.0; rows * n];
    scalar.matmul(&mp, &x, n, &mut want, &pool);
    for k in tiers() {
        let mut got = vec![f32::NAN; rows * n];
        k.matmul(&mi, &x, n, &mut got, &pool);
        // Turned back into plain rows, interleaved rows get the tier's own Q4_0 tiles' bits.
        let mut want = want.clone();
        if let Path::Deinterleaved { .. } = plan(k, &mi, n) {
            k.matmul(&mp, &x, n, &mut want, &pool);
        }
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{:?} {rows}x{cols} n={n}: interleaved q4_0 differs from the reference",
            k.isa()
        );
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    #[test]
    fn interleaved_q4_0_gives_reference_bits(
        groups in 1usize..4,
        nb in 1usize..14,
        n in proptest::sample::select(vec![1usize, 2, 5, 8, 19, 50]),
        seed in proptest::prelude::any::<u64>(),
    ) {
        interleaved_bits(16 * groups, 32 * nb, n, seed);
    }
}

#[test]
fn interleaved_matrices_need_whole_row_groups() {
    let plain = OwnedWeights::encode("q4_0", &[0.5; 32 * 32]).unwrap();
    let inter = plain.interleaved(32).unwrap();
    let WeightData::Q4_0x16(g) = inter.data() else {
        panic!("interleaved")
    };
    let e = Matrix::new(24, 32, WeightData::Q4_0x16(&g[..1])).unwrap_err();
    assert!(
        matches!(e, KernelError::RowsNotGroupMultiple { rows: 24, .. }),
        "{e}"
    );
    let e = Matrix::new(16, 96, WeightData::Q4_0x16(g)).unwrap_err();
    assert!(matches!(e, KernelError::LengthMismatch { .. }), "{e}");
    assert!(Matrix::new(32, 32, WeightData::Q4_0x16(g)).is_ok());
}

#[test]
fn prefill_shapes() {
    check(37, 96, 5, 6);
    check(50, 64, 17, 7);
    check(3, 33, 4, 8);
    check(21, 96, 40, 9); // two full lane groups and a partial one
    check(9, 32, 16, 10);
}

#[test]
fn empty_shapes_are_no_ops() {
    let pool = Pool::new(2).unwrap();
    let m = Matrix::new(0, 32, WeightData::F32(&[])).unwrap();
    kiln_kernels::matmul(&m, &[0.0; 64], 2, &mut [], &pool);
    let m = Matrix::new(3, 0, WeightData::F32(&[])).unwrap();
    let mut out = [f32::NAN; 3];
    kiln_kernels::matmul(&m, &[], 1, &mut out, &pool);
    assert_eq!(out, [0.0; 3]);
}

#[test]
fn matrix_new_rejects_wrong_length() {
    let e = Matrix::new(2, 3, WeightData::F32(&[0.0; 5])).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::LengthMismatch {
                expected: 6,
                found: 5,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn matrix_new_rejects_partial_blocks() {
    let e = Matrix::new(1, 48, WeightData::Q8_0(&[])).unwrap_err();
    assert!(
        matches!(e, KernelError::ColsNotBlockMultiple { cols: 48, .. }),
        "{e}"
    );
}

#[test]
fn matrix_new_rejects_overflow() {
    let e = Matrix::new(usize::MAX, 2, WeightData::F32(&[])).unwrap_err();
    assert!(matches!(e, KernelError::ShapeOverflow { .. }), "{e}");
}

#[test]
fn pool_rejects_zero_threads_and_caps_at_the_cpus() {
    assert_eq!(Pool::new(0).unwrap_err(), KernelError::ZeroThreads);
    assert_eq!(
        Pool::new(3).unwrap().threads(),
        3.min(kiln_kernels::max_threads())
    );
    assert_eq!(
        Pool::new(100_000).unwrap().threads(),
        kiln_kernels::max_threads()
    );
}

#[test]
#[should_panic(expected = "x must be n_tokens × cols")]
fn matmul_rejects_wrong_x_length() {
    let pool = Pool::new(1).unwrap();
    let m = Matrix::new(1, 2, WeightData::F32(&[1.0, 2.0])).unwrap();
    kiln_kernels::matmul(&m, &[1.0], 1, &mut [0.0], &pool);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

    /// Random shapes: rows not a multiple of the tile, odd and even block counts (the AVX-512
    /// kernel takes blocks in pairs and masks a last odd one), token counts around the
    /// multi-token tile width and the lanes kernel's groups of sixteen; every encoding, tier
    /// and thread count, against the naive loop
    /// and bit for bit between batched and single-token products.
    #[test]
    fn random_shapes_match_naive(rows in 1usize..40, blocks in 1usize..12, n_tokens in 1usize..40, seed in 0u64..1000) {
        check(rows, blocks * QK, n_tokens, seed);
    }
}

/// `matmul_many` gives each matrix exactly what `matmul` gives it alone: same encodings (one
/// fused job), mixed encodings (one job per matrix), a matrix with no rows in the group, every
/// tier and 1–3 threads, decode and prefill batches.
#[test]
fn matmul_many_equals_separate_products() {
    // Large enough that even one token of the Q4_0 group goes to the other threads.
    let cols = 8 * QK;
    let pools: Vec<Pool> = [1, 2, 3].iter().map(|&t| Pool::new(t).unwrap()).collect();
    let shapes = [300usize, 0, 203, 5];
    let cases: Vec<Case> = shapes
        .iter()
        .enumerate()
        .map(|(i, &rows)| Case::new(rows, cols, 40 + i as u64))
        .collect();
    let groups: Vec<Vec<&str>> = vec![
        vec!["q4_0"; 4],
        vec!["q8_0"; 4],
        vec!["f16"; 4],
        vec!["f32", "q4_0", "q8_0", "bf16"],
    ];
    for dtypes in &groups {
        let owned: Vec<OwnedWeights> = cases
            .iter()
            .zip(dtypes)
            .map(|(c, d)| OwnedWeights::encode(d, &c.w).unwrap())
            .collect();
        let mats: Vec<Matrix> = owned
            .iter()
            .zip(&shapes)
            .map(|(o, &rows)| Matrix::new(rows, cols, o.data()).unwrap())
            .collect();
        let refs: Vec<&Matrix> = mats.iter().collect();
        for n_tokens in [1, 6, 21] {
            let x = activations(n_tokens * cols, 99 + n_tokens as u64);
            for k in tiers() {
                for pool in &pools {
                    let mut outs: Vec<Vec<f32>> = shapes
                        .iter()
                        .map(|&r| vec![f32::NAN; r * n_tokens])
                        .collect();
                    let mut views: Vec<&mut [f32]> =
                        outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    k.matmul_many(&refs, &x, n_tokens, &mut views, pool);
                    for (m, got) in mats.iter().zip(&outs) {
                        let mut alone = vec![f32::NAN; m.rows * n_tokens];
                        k.matmul(m, &x, n_tokens, &mut alone, &pools[0]);
                        assert!(
                            alone
                                .iter()
                                .zip(got)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{dtypes:?} {:?} n={n_tokens} {} threads: {} ({} rows) differs",
                            k.isa(),
                            pool.threads(),
                            m.data.dtype_name(),
                            m.rows
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "every matrix must take the same input")]
fn matmul_many_rejects_different_input_widths() {
    let pool = Pool::new(1).unwrap();
    let a = Matrix::new(1, 2, WeightData::F32(&[1.0, 2.0])).unwrap();
    let b = Matrix::new(1, 3, WeightData::F32(&[1.0, 2.0, 3.0])).unwrap();
    kiln_kernels::matmul_many(
        &[&a, &b],
        &[1.0, 1.0],
        1,
        &mut [&mut [0.0], &mut [0.0]],
        &pool,
    );
}

/// `scores` is `matmul` of the keys by the query rows, each result times `scale`, bit for bit,
/// in every tier and encoding (the float lanes tiers take another path from 16 query rows).
fn scores_bits(rows: usize, keys: usize, d: usize, seed: u64) {
    let case = Case::new(keys, d, seed);
    let q = activations(rows * d, seed ^ 0x5c0);
    let pool = Pool::new(1).unwrap();
    let scale = 0.125 + (seed % 7) as f32 * 0.01;
    for owned in encodings(&case) {
        let m = Matrix::new(keys, d, owned.data()).unwrap();
        for k in tiers() {
            let mut want = vec![0.0; rows * keys];
            k.matmul(&m, &q, rows, &mut want, &pool);
            want.iter_mut().for_each(|x| *x *= scale);
            let mut got = vec![f32::NAN; rows * keys];
            k.scores(&q, &m, scale, &mut got, &pool);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} {:?} {rows} queries × {keys} keys × {d}: scores differ from matmul · scale",
                m.data.dtype_name(),
                k.isa()
            );
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    #[test]
    fn scores_equal_matmul_times_scale(
        rows in proptest::sample::select(vec![1usize, 4, 15, 16, 17, 64, 70]),
        keys in proptest::sample::select(vec![1usize, 31, 32, 33, 128, 140]),
        d in proptest::sample::select(vec![16usize, 45, 64, 128]),
        seed in proptest::prelude::any::<u64>(),
    ) {
        scores_bits(rows, keys, d, seed);
    }
}

/// Which products [`plan`] gives: decode (one token) never takes a lanes kernel, the scalar
/// tier has only tiles, and every path has a name of its own.
#[test]
fn plan_names_the_products() {
    let case = Case::new(32, 512, 3);
    let scalar = kernels(Isa::Scalar).unwrap();
    let mut names = std::collections::BTreeMap::new();
    for owned in encodings(&case) {
        let m = Matrix::new(32, 512, owned.data()).unwrap();
        for k in tiers() {
            assert_eq!(plan(k, &m, 0), Path::Empty);
            let one = plan(k, &m, 1);
            assert!(
                matches!(
                    one,
                    Path::Tiles { tokens: 1, .. }
                        | Path::Deinterleaved { tokens: 1, .. }
                        | Path::Interleaved { tokens: 1 }
                ),
                "{} {:?}: one token planned as {one}",
                m.data.dtype_name(),
                k.isa()
            );
            for n in [1, 7, 8, 16, 47, 48, 64] {
                let p = plan(k, &m, n);
                if std::ptr::eq(k, scalar) {
                    assert!(
                        matches!(p, Path::Tiles { .. } | Path::Deinterleaved { .. }),
                        "{} scalar n={n}: {p}",
                        m.data.dtype_name()
                    );
                }
                assert!(names.insert(p.to_string(), p).is_none_or(|q| q == p), "{p}");
            }
        }
    }
}

/// With [`Batching::Texts`] every token of a batch gets the bits it gets in a batch of one
/// under the same batching (an encoder's text is the same alone or beside others).
fn texts_rows_match_alone(k: &Kernels, m: &Matrix, x: &[f32], n_tokens: usize, pool: &Pool) {
    let (rows, cols) = (m.rows, m.cols);
    let mut out = vec![f32::NAN; rows * n_tokens];
    k.matmul_many_for(&[m], x, n_tokens, &mut [&mut out], pool, Batching::Texts);
    let path = plan_for(k, m, n_tokens, Batching::Texts);
    // One path at every size (interleaved Q4_0 aside, whose paths all give the reference's
    // bits).
    let lanes = |p: Path| matches!(p, Path::Lanes | Path::FloatLanes | Path::KLanes);
    if !matches!(m.data, WeightData::Q4_0x16(_)) {
        assert_eq!(
            lanes(path),
            lanes(plan_for(k, m, 1, Batching::Texts)),
            "{} {:?} n={n_tokens}: {path}",
            m.data.dtype_name(),
            k.isa()
        );
    }
    for t in 0..n_tokens {
        let mut single = vec![f32::NAN; rows];
        let one = &x[t * cols..(t + 1) * cols];
        k.matmul_many_for(&[m], one, 1, &mut [&mut single], pool, Batching::Texts);
        let got = &out[t * rows..(t + 1) * rows];
        assert!(
            got.iter()
                .zip(&single)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{} {:?} {rows}x{cols} n={n_tokens} t={t} ({path}): a text's row differs alone",
            m.data.dtype_name(),
            k.isa()
        );
    }
}

/// With [`Batching::Independent`] every token of a batch gets the bits it gets as a batch of
/// one, whatever the batch's size: what a server decoding several sequences together needs.
fn independent_rows_match_alone(k: &Kernels, m: &Matrix, x: &[f32], n_tokens: usize, pool: &Pool) {
    let (rows, cols) = (m.rows, m.cols);
    let mut out = vec![f32::NAN; rows * n_tokens];
    k.matmul_many_for(
        &[m],
        x,
        n_tokens,
        &mut [&mut out],
        pool,
        Batching::Independent,
    );
    let path = plan_for(k, m, n_tokens, Batching::Independent);
    for t in 0..n_tokens {
        let mut single = vec![f32::NAN; rows];
        k.matmul(m, &x[t * cols..(t + 1) * cols], 1, &mut single, pool);
        let got = &out[t * rows..(t + 1) * rows];
        assert!(
            got.iter().zip(&single).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{} {:?} {rows}x{cols} n={n_tokens} t={t} ({path}): independent rows differ from the token alone",
            m.data.dtype_name(),
            k.isa()
        );
    }
}
