//! How one block of 32 weights becomes a Q8_0 or Q4_0 block: the quantization [`Method`]s.
//!
//! Every method keeps GGML's block layout ([`BlockQ8_0`], [`BlockQ4_0`]); methods differ only in
//! how they pick the scale and the codes.
//!
//! - [`Method::Reference`] is GGML's rule (`quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`),
//!   bit for bit: Q8_0 scale `max|x| / 127`, Q4_0 scale "the signed value of largest magnitude
//!   / -8". The functions here are a faster restatement of
//!   [`kiln_format::blocks::quantize_block_q8_0_ref`] (rounding without a libm call, so the loop
//!   vectorizes); the tests hold them to the format crate's reference and to GGML's own output
//!   (`tests/ggml_vectors.rs`).
//! - [`Method::Search`] tries candidate scales around the reference one, refines each by least
//!   squares (`d = Σ w·x·q / Σ w·q²` for the codes `q` that scale gives), re-rounds the codes for
//!   the f16-rounded scale that will actually be stored, and keeps the block with the smallest
//!   (weighted) squared error, never one worse than the reference block.
//!
//! Importance weights: every block function takes `Option<&[f32; QK]>`, one non-negative weight
//! per column of the row the block covers (`None`: every weight 1), from calibration's
//! per-column activation statistics. The reference method ignores the weights by definition
//! (it is GGML's rule).
//!
//! Every block type is quantized the same way, through its row of the format's block-type
//! table ([`BlockKind`]): a [`Rule`] says which of the row's rules a [`Method`] takes (GGML's
//! reference rule, GGML's importance-weighted rule) or Kiln's scale search, which this module
//! adds for the two types GGML has no weighted rule for ([`search_rule`]: Q8_0 and Q4_0).

use half::f16;
use kiln_format::blocks::{BlockQ4_0, BlockQ8_0, QK};
use kiln_format::{BlockKind, BlockType, DType};

/// How the scale and codes of a block are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Method {
    /// GGML's reference rule, bit for bit.
    #[default]
    Reference,
    /// Least-squares scale search within the same layout; never worse than the reference on
    /// any block (by squared error, weighted by the importance weights when given).
    Search,
    /// Error-compensating rounding ([`crate::gptq`]) for matrices whose input second moments
    /// were measured by calibration; the scale search for every other block.
    Gptq,
}

impl Method {
    /// Name used on the command line, in reports and in provenance.
    pub const fn name(self) -> &'static str {
        match self {
            Method::Reference => "reference",
            Method::Search => "search",
            Method::Gptq => "gptq",
        }
    }

    /// Parse a name as printed by [`Method::name`].
    pub fn parse(s: &str) -> Option<Method> {
        [Method::Reference, Method::Search, Method::Gptq]
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Round half away from zero (C's `roundf`) without a libm call, for codes: the argument is
/// first clamped to ±256, beyond every code range (`max`/`min` also turn NaN into -256, so
/// the conversion never sees a NaN and needs no fix-up; callers never pass one).
///
/// `v - trunc(v)` is exact in binary32, so comparing it with ±0.5 decides the tie the way
/// `roundf` does; this keeps the reference bit-identical while letting the loop vectorize.
#[inline(always)]
fn round_away(v: f32) -> i32 {
    // Not `clamp`: clamp keeps NaN, and a NaN here would cost the vector loop a fix-up.
    #[allow(clippy::manual_clamp)]
    let v = v.max(-256.0).min(256.0);
    let t = v as i32;
    let frac = v - t as f32;
    t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
}

/// GGML's Q8_0 rule (identical to [`kiln_format::blocks::quantize_block_q8_0_ref`]).
#[inline(always)]
pub fn quantize_block_q8_0_reference(x: &[f32; QK]) -> BlockQ8_0 {
    let amax = abs_max(x);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    if !id.is_finite() {
        // max|x| below ~3.7e-37: 1/d overflows and GGML's rule turns 0·∞ into NaN codes; the
        // format crate's reference defines those (NaN -> 0, ±∞ -> ±127).
        return kiln_format::blocks::quantize_block_q8_0_ref(x);
    }
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = round_away(v * id).clamp(-128, 127) as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// GGML's Q4_0 rule (identical to [`kiln_format::blocks::quantize_block_q4_0_ref`]).
#[inline(always)]
pub fn quantize_block_q4_0_reference(x: &[f32; QK]) -> BlockQ4_0 {
    let max = signed_abs_max(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut codes = [0u8; QK];
    for (c, &v) in codes.iter_mut().zip(x) {
        // GGML truncates toward zero after adding 8.5; the operand is in [0.5, 16.5] except when
        // 1/d overflows (|max| < ~2.4e-38), where the clamp keeps the nibble in range.
        *c = ((v * id + 8.5) as i32).clamp(0, 15) as u8;
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs: pack_nibbles(&codes),
    }
}

/// Lanes of the vectorized reductions (8 × f32 = one AVX register, two SSE registers).
const LANES: usize = 8;

/// `max |x|`, in lanes so that it vectorizes (max is exact in any order).
#[inline(always)]
fn abs_max(x: &[f32; QK]) -> f32 {
    let mut m = [0.0f32; LANES];
    for c in x.chunks_exact(LANES) {
        for l in 0..LANES {
            m[l] = m[l].max(c[l].abs());
        }
    }
    m.iter().fold(0.0f32, |a, &b| a.max(b))
}

/// GGML's Q4_0 extreme: the first value of largest magnitude, with its sign; `+0.0` when the
/// block is all zeros (GGML never updates its `max = 0.0f` then, whatever the zeros' signs).
#[inline(always)]
fn signed_abs_max(x: &[f32; QK]) -> f32 {
    let amax = abs_max(x);
    if amax == 0.0 {
        return 0.0;
    }
    x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
}

/// Pack 32 unsigned 4-bit codes in GGML's order (weight `j` low nibble of byte `j`, weight
/// `j + 16` high nibble of byte `j`).
#[inline(always)]
fn pack_nibbles(codes: &[u8; QK]) -> [u8; QK / 2] {
    let mut qs = [0u8; QK / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = codes[j] | (codes[j + QK / 2] << 4);
    }
    qs
}

/// Quantize one block to Q8_0 with `method`; `w` are per-column importance weights.
#[inline(always)]
pub fn quantize_block_q8_0(method: Method, x: &[f32; QK], w: Option<&[f32; QK]>) -> BlockQ8_0 {
    let reference = quantize_block_q8_0_reference(x);
    match method {
        Method::Reference => reference,
        Method::Search | Method::Gptq => {
            let mut codes = [0i8; QK];
            let mut ref_deq = [0.0f32; QK];
            kiln_format::blocks::dequantize_block_q8_0(&reference, &mut ref_deq);
            let ref_err = weighted_sq_err(x, &ref_deq, w);
            let amax = abs_max(x);
            let candidates = (0..=16).map(|i| amax / (123.0 + 0.5 * i as f32));
            match search(x, w, candidates, -128, 127, ref_err) {
                Some((d, q)) => {
                    for (c, &v) in codes.iter_mut().zip(&q) {
                        *c = v as i8;
                    }
                    BlockQ8_0 { d, qs: codes }
                }
                None => reference,
            }
        }
    }
}

/// Quantize one block to Q4_0 with `method`; `w` are per-column importance weights.
#[inline(always)]
pub fn quantize_block_q4_0(method: Method, x: &[f32; QK], w: Option<&[f32; QK]>) -> BlockQ4_0 {
    let reference = quantize_block_q4_0_reference(x);
    match method {
        Method::Reference => reference,
        Method::Search | Method::Gptq => {
            let mut ref_deq = [0.0f32; QK];
            kiln_format::blocks::dequantize_block_q4_0(&reference, &mut ref_deq);
            let ref_err = weighted_sq_err(x, &ref_deq, w);
            let max = signed_abs_max(x);
            // The extreme on the -8 side (GGML's choice) with divisors 7..9, and on the +7 side
            // with divisors 6.5..7.5.
            let negative = (0..=16).map(|i| max / -(7.0 + 0.125 * i as f32));
            let positive = (0..=8).map(|i| max / (6.5 + 0.125 * i as f32));
            match search(x, w, negative.chain(positive), -8, 7, ref_err) {
                Some((d, q)) => {
                    let mut codes = [0u8; QK];
                    for (c, &v) in codes.iter_mut().zip(&q) {
                        *c = (v + 8) as u8;
                    }
                    BlockQ4_0 {
                        d,
                        qs: pack_nibbles(&codes),
                    }
                }
                None => reference,
            }
        }
    }
}

/// Kiln's scale search over whole rows of one block type, appending the blocks' bytes to `out`:
/// each block by the type's [`Method::Search`], with its columns' `importance` weights when
/// given (one per column of the row).
pub type SearchRow = fn(row: &[f32], importance: Option<&[f32]>, out: &mut Vec<u8>);

/// A block type Kiln has a scale search for.
trait Searched: BlockType {
    /// One block by [`Method::Search`].
    fn search(x: &[f32; QK], w: Option<&[f32; QK]>) -> Self;
}

impl Searched for BlockQ8_0 {
    fn search(x: &[f32; QK], w: Option<&[f32; QK]>) -> Self {
        quantize_block_q8_0(Method::Search, x, w)
    }
}

impl Searched for BlockQ4_0 {
    fn search(x: &[f32; QK], w: Option<&[f32; QK]>) -> Self {
        quantize_block_q4_0(Method::Search, x, w)
    }
}

fn search_row<T: Searched>(row: &[f32], importance: Option<&[f32]>, out: &mut Vec<u8>) {
    for (b, x) in row.chunks_exact(QK).enumerate() {
        let x: &[f32; QK] = x.try_into().expect("QK chunk");
        let w = importance.map(|w| w[b * QK..(b + 1) * QK].try_into().expect("QK chunk"));
        out.extend_from_slice(bytemuck::bytes_of(&T::search(x, w)));
    }
}

/// The block types Kiln has a scale search for, by dtype.
const SEARCHES: [(DType, SearchRow); 2] = [
    (BlockQ8_0::DTYPE, search_row::<BlockQ8_0>),
    (BlockQ4_0::DTYPE, search_row::<BlockQ4_0>),
];

/// Kiln's scale search for rows of `kind`, where it has one (Q8_0 and Q4_0).
pub fn search_rule(kind: &BlockKind) -> Option<SearchRow> {
    SEARCHES
        .iter()
        .find(|(dtype, _)| *dtype == kind.dtype)
        .map(|&(_, search)| search)
}

/// How one row of a block type is quantized: one of the rules of its row of the block-type
/// table, or Kiln's scale search.
#[derive(Debug, Clone, Copy)]
pub enum Rule<'a> {
    /// GGML's reference rule ([`BlockKind::quantize_ref`]).
    Reference,
    /// GGML's importance-weighted rule ([`BlockKind::quantize_weighted`]), these weights.
    Weighted(&'a [f32]),
    /// Kiln's scale search ([`search_rule`]), importance-weighted when weights are given.
    Search(SearchRow, Option<&'a [f32]>),
}

impl<'a> Rule<'a> {
    /// The rule `method` takes for rows of `kind` with per-column `importance`: the reference
    /// for [`Method::Reference`]; otherwise Kiln's search where the type has one (with or
    /// without importance), the type's weighted rule where it has one and there is
    /// importance, and the reference where neither applies.
    pub fn choose(kind: &BlockKind, method: Method, importance: Option<&'a [f32]>) -> Rule<'a> {
        match (method, importance) {
            (Method::Reference, _) => Rule::Reference,
            (_, None) => search_rule(kind).map_or(Rule::Reference, |s| Rule::Search(s, None)),
            (_, Some(w)) => Rule::weighted(kind, w).unwrap_or(Rule::Reference),
        }
    }

    /// The rule that fits rows of `kind` to importance weights `w`: Kiln's search where the
    /// type has one, else GGML's weighted rule; `None` if the type has neither.
    pub fn weighted(kind: &BlockKind, w: &'a [f32]) -> Option<Rule<'a>> {
        match search_rule(kind) {
            Some(search) => Some(Rule::Search(search, Some(w))),
            None => kind.has_weighted().then_some(Rule::Weighted(w)),
        }
    }

    /// Quantize `row` (finite values, whole blocks of `kind`, which has this rule), appending
    /// the blocks' bytes to `out`.
    pub fn quantize_row(self, kind: &BlockKind, row: &[f32], out: &mut Vec<u8>) {
        match self {
            Rule::Reference => kind.quantize_ref(row, row.len(), out),
            Rule::Weighted(w) => kind
                .quantize_weighted(row, w, out)
                .expect("a type with a weighted rule"),
            Rule::Search(search, w) => {
                search(row, w, out);
                Ok(())
            }
        }
        .expect("a finite row of whole blocks")
    }
}

/// Σ w·(x − y)², with w = 1 when no weights are given.
#[inline]
fn weighted_sq_err(x: &[f32; QK], y: &[f32; QK], w: Option<&[f32; QK]>) -> f32 {
    let mut s = 0.0f32;
    for j in 0..QK {
        let e = x[j] - y[j];
        s += w.map_or(1.0, |w| w[j]) * e * e;
    }
    s
}

/// Nearest codes in `qmin..=qmax` for scale `d` (non-zero).
#[inline]
fn codes_for(x: &[f32; QK], d: f32, qmin: i32, qmax: i32) -> [i32; QK] {
    let id = 1.0 / d;
    let mut q = [0i32; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_away(v * id).clamp(qmin, qmax);
    }
    q
}

/// The best (f16 scale, codes) among the candidates, if one beats `ref_err` strictly.
fn search(
    x: &[f32; QK],
    w: Option<&[f32; QK]>,
    candidates: impl Iterator<Item = f32>,
    qmin: i32,
    qmax: i32,
    ref_err: f32,
) -> Option<(f16, [i32; QK])> {
    let mut best: Option<(f16, [i32; QK])> = None;
    let mut best_err = ref_err;
    for d0 in candidates {
        if d0 == 0.0 || !d0.is_finite() {
            continue;
        }
        // Codes for the candidate, then the least-squares scale for those codes.
        let q = codes_for(x, d0, qmin, qmax);
        let (mut sxq, mut sqq) = (0.0f32, 0.0f32);
        for j in 0..QK {
            let wj = w.map_or(1.0, |w| w[j]);
            sxq += wj * x[j] * q[j] as f32;
            sqq += wj * (q[j] * q[j]) as f32;
        }
        if sqq == 0.0 {
            continue;
        }
        // The scale that is stored is f16: re-round the codes for it and measure with it.
        let dh = f16::from_f32(sxq / sqq);
        let d = dh.to_f32();
        if d == 0.0 || !d.is_finite() {
            continue;
        }
        let q = codes_for(x, d, qmin, qmax);
        let mut err = 0.0f32;
        for j in 0..QK {
            let e = x[j] - d * q[j] as f32;
            err += w.map_or(1.0, |w| w[j]) * e * e;
        }
        if err < best_err {
            best_err = err;
            best = Some((dh, q));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_away_matches_roundf_on_ties_and_neighbours() {
        for v in [
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.5,
            0.0,
            -0.0,
        ] {
            assert_eq!(round_away(v), v.round() as i32, "{v}");
        }
        assert_eq!(round_away(f32::INFINITY).clamp(-128, 127), 127);
        assert_eq!(round_away(f32::NEG_INFINITY).clamp(-128, 127), -128);
    }

    /// Blocks whose largest magnitude is so small that 1/d overflows: codes stay in range.
    #[test]
    fn regression_near_denormal_block_keeps_codes_in_range() {
        let mut x = [0.0f32; QK];
        x[0] = 1e-39;
        x[1] = -5e-40;
        let b = quantize_block_q4_0_reference(&x);
        assert_eq!(b.d.to_f32(), 0.0);
        assert!((0..QK).all(|j| (-8..=7).contains(&b.code(j))));
        let b = quantize_block_q8_0_reference(&x);
        assert_eq!(b.d.to_f32(), 0.0);
    }

    #[test]
    fn method_names_round_trip() {
        for m in [Method::Reference, Method::Search] {
            assert_eq!(Method::parse(m.name()), Some(m));
        }
        assert_eq!(Method::parse("imatrix"), None);
    }
}
