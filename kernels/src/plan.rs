//! Which product a matrix gets: [`plan`] names it as a [`Path`], from the tier's table, the
//! weights' encoding and width and the batch size. [`crate::matmul`] executes the path it
//! returns, [`crate::scores`] asks it whether keys go in the lanes, the tests ask it which
//! bits to expect, and `kiln-run bench --verbose` prints it: the thresholds below are read
//! nowhere else.
//!
//! | weights | path, in the order tried |
//! |---|---|
//! | F32, F16, BF16 | [`Path::FloatLanes`] from [`FLOAT_LANES_MIN_TOKENS`] tokens, else [`Path::Tiles`] |
//! | Q8_0, Q4_0, Q5_0 | [`Path::Lanes`] from [`LANES_MIN_TOKENS`], else [`Path::Tiles`] over prepared pairs where the tier has them, else over Q8_0 |
//! | IQ4_NL | [`Path::Lanes`] from [`IQ4_NL_LANES_MIN_TOKENS`], else [`Path::Tiles`] over Q8_0 |
//! | Q5_1 | [`Path::Tiles`] over Q8_0 |
//! | Q3_K, Q4_K, Q5_K, Q6_K | [`Path::KLanes`] from [`KLANES_MIN_TOKENS`], else [`Path::Tiles`] over Q8_K |
//! | Q2_K, IQ4_XS | [`Path::KLanes`] from [`Q2_K_LANES_MIN_TOKENS`], [`IQ4_XS_LANES_MIN_TOKENS`], else [`Path::Tiles`] over Q8_K |
//! | Q4_0x16 | [`Path::Interleaved`] below [`INTERLEAVED_LANES_MIN_TOKENS`], else [`Path::Lanes`]; on tiers without the interleaved kernel [`Path::Lanes`] from [`LANES_MIN_TOKENS`], else [`Path::Deinterleaved`] |
//! | IQ4_NLx16 | [`Path::Interleaved`] at AVX2; elsewhere [`Path::Lanes`] from [`IQ4_NL_LANES_MIN_TOKENS`] (joint batches and texts only), else [`Path::Interleaved`], else (tiers without the kernel) [`Path::Deinterleaved`] |
//! | IQ4_XSx16 | [`Path::Interleaved`] at AVX2; elsewhere [`Path::KLanes`] from [`IQ4_XS_LANES_MIN_TOKENS`], else [`Path::Interleaved`], else (tiers without the kernel) [`Path::Deinterleaved`] over Q8_K |
//!
//! With [`Batching::Texts`] the thresholds fall away: every lanes path the tier has is taken at
//! every batch size (and interleaved Q4_0 goes as with [`Batching::Independent`]).
//!
//! Each lanes path needs the tier's kernel for it.

use std::fmt;

use kiln_format::{QK, QK_K};

use crate::matrix::{Matrix, WeightData};
use crate::table::Kernels;
use crate::tile::Tile;

/// Batches of at least this many tokens multiply block weights through the tier's lanes
/// kernel, if it has one, which gives the scalar reference's bits; smaller batches give each
/// token the bits it gets alone. (From 8 tokens, half a lane group, the lanes kernel is
/// already faster: measured at 12-token prompts.)
pub const LANES_MIN_TOKENS: usize = 8;

/// The same for interleaved Q4_0 (`q4_0x16`) on tiers with an interleaved kernel, which takes
/// a few tokens per call (the chunk stays in cache between calls) and leaves the lanes kernel
/// little to win. Measured with `kiln-run bench -p N`, two threads, AVX-512 (prefill tok/s of
/// the interleaved kernel over the lanes kernel at the same N): SmolLM2-135M Q4_0 1.35× at 64,
/// 1.15× at 128, 1.06–1.19× at 256, even at 512; the 1B shape 1.2× at 64, 1.0–1.17× at 128,
/// 0.93–1.1× at 256, even at 512.
pub const INTERLEAVED_LANES_MIN_TOKENS: usize = 256;

/// The same for K-quant weights (Q3_K…Q6_K; Q2_K and IQ4_XS below) and the tier's K-quant lanes kernel (see
/// [`crate::klanes`]). Both paths give the reference's bits, so this only chooses the faster:
/// at 8 tokens the lanes kernel already is (1B-shape Q4_K_M pp8, two threads on a busy
/// host: 24 tok/s through the eight-token tiles, 54 through the lanes kernel).
pub const KLANES_MIN_TOKENS: usize = 8;

/// The same for Q2_K, whose tiles are cheaper than the other K-quants' (two-bit codes): its
/// lanes kernel wins from here. Measured at AVX2 (1B shape, all matrices Q2_K, `kiln-run
/// bench -p N`, two threads, tiles against lanes, tok/s): 31 against 26 at 8 tokens, 36
/// against 39 at 16, 36 against 59 at 32.
pub const Q2_K_LANES_MIN_TOKENS: usize = 16;

/// The same for IQ4_XS, whose rows the lanes kernel unpacks through a table lookup per byte
/// and AVX2 multiplies nibble by nibble: 24 against 19 tok/s at 16 tokens, 26 against 29 at
/// 32, 26 against 34 at 64 (measured as [`Q2_K_LANES_MIN_TOKENS`]).
pub const IQ4_XS_LANES_MIN_TOKENS: usize = 32;

/// The same for IQ4_NL and the block lanes kernel: 33 against 20 tok/s at 16 tokens, 31
/// against 29 at 32, 30 against 40 at 64 (measured as [`Q2_K_LANES_MIN_TOKENS`]).
pub const IQ4_NL_LANES_MIN_TOKENS: usize = 48;

/// The same for float weights and the float lanes kernel, which gains less per token.
pub const FLOAT_LANES_MIN_TOKENS: usize = 16;

/// What a tile kernel's tokens are multiplied as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Operand {
    /// The f32 activations themselves (float weights).
    F32,
    /// The activations quantized to Q8_0 (GGML's rule), once per product.
    Q8_0,
    /// Q8_0 activations prepared once per product for the tier's pair kernel (AVX-512: two
    /// blocks' codes, offset correction and scales per 512-bit load).
    Q8_0Pairs,
    /// The activations quantized to Q8_K (256 a block, with the sums of every 16 codes).
    Q8_K,
}

impl Operand {
    /// A short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Operand::F32 => "f32",
            Operand::Q8_0 => "q8_0",
            Operand::Q8_0Pairs => "q8_0 pairs",
            Operand::Q8_K => "q8_k",
        }
    }
}

/// The product a matrix gets for one batch, as [`plan`] decides it. Every path gives each
/// output element from one kernel call in a fixed order, so none depends on the thread count;
/// which paths give which bits is said per variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Nothing to compute (no tokens, or interleaved rows with no whole block): the output is
    /// zeros, if anything.
    Empty,
    /// The tier's tile kernels: [`crate::TILE_ROWS`] rows at a time against `tokens` tokens
    /// per call (register-blocked; a batch's remainder one at a time), over activations
    /// `operand`. With `wide`, every full chunk of [`crate::ROW_CHUNK`] rows takes the
    /// sixteen-row kernel instead, `tokens` tokens per call (float weights take several, block
    /// weights one). A token's bits do not depend on its batch.
    Tiles {
        operand: Operand,
        tokens: usize,
        wide: bool,
    },
    /// Interleaved Q4_0 or IQ4_NL turned back into plain rows a sixteen-row chunk at a time,
    /// then the tier's Q4_0 or IQ4_NL tiles over Q8_0 activations, as [`Path::Tiles`] describes
    /// (tiers without an interleaved kernel).
    Deinterleaved { tokens: usize, wide: bool },
    /// Interleaved Q4_0 or IQ4_NL through the tier's interleaved kernel, sixteen rows and up to
    /// `tokens` tokens per call (the kernel's most, or the batch when smaller): the scalar
    /// reference's bits for every token (the plain rows' one-token bits), however the batch is
    /// cut.
    Interleaved { tokens: usize },
    /// The block lanes kernel: the batch's Q8_0 activations transposed, sixteen tokens a
    /// vector, each weight row unpacked once (from plain or interleaved blocks): the scalar
    /// reference's bits, which may differ from the one-token tiles' in the last bits.
    Lanes,
    /// The K-quant lanes kernel over Q8_K activations, sixteen tokens a vector: the
    /// reference's bits, as the K-quant tiles give.
    KLanes,
    /// The float lanes kernel: tokens transposed in tiles of 32, one fused multiply-add chain
    /// per (row, token) ([`crate::reference::float_lanes_ref`]'s bits), which may differ from
    /// the one-token tiles' in the last bits.
    FloatLanes,
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wide = |w: bool| if w { ", 16-row" } else { "" };
        match *self {
            Path::Empty => f.write_str("empty"),
            Path::Tiles {
                operand,
                tokens,
                wide: w,
            } => write!(f, "tiles ({}, {tokens} tok{})", operand.name(), wide(w)),
            Path::Deinterleaved { tokens, wide: w } => {
                write!(f, "deinterleaved tiles (q8_0, {tokens} tok{})", wide(w))
            }
            Path::Interleaved { tokens } => write!(f, "interleaved x16 ({tokens} tok)"),
            Path::Lanes => f.write_str("lanes (q8_0)"),
            Path::KLanes => f.write_str("k-lanes (q8_k)"),
            Path::FloatLanes => f.write_str("float lanes (f32)"),
        }
    }
}

/// What a batch's rows are to each other, which decides whether the faster paths may be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Batching {
    /// One sequence's tokens (a prompt): the fastest path for the batch's size, whose bits
    /// may differ in the last place from those the tokens get one at a time.
    #[default]
    Joint,
    /// Tokens of independent sequences decoded together (a server's batch): each token gets
    /// exactly the bits it gets alone, whatever else is in the batch. The lanes paths whose
    /// bits differ from the one-token path's ([`Path::Lanes`] over plain Q8_0, Q4_0 and Q5_0
    /// rows, or over interleaved rows on a tier without the interleaved kernel, and
    /// [`Path::FloatLanes`]) give way to the tiles; the K-quant lanes and the interleaved
    /// kernels, which give the reference's bits at every batch size, stay.
    Independent,
    /// Whole texts of independent sequences, none ever computed a token at a time (an
    /// encoder's inputs): each matrix takes one path at every batch size, its lanes kernel
    /// where the tier has one (one fused chain per row and token, or the block lanes'
    /// reference bits), else its tiles. A text's rows get the same bits alone or beside any
    /// others, as with [`Batching::Independent`], without giving up the lanes kernels' speed.
    Texts,
}

/// The path `w` takes through tier `k`'s kernels for a batch of `n_tokens` tokens: the one
/// decision of [`crate::matmul`] (and of [`crate::scores`] for float keys).
pub fn plan(k: &Kernels, w: &Matrix, n_tokens: usize) -> Path {
    plan_for(k, w, n_tokens, Batching::Joint)
}

/// [`plan`] for a batch whose rows are related as `batching` says.
pub fn plan_for(k: &Kernels, w: &Matrix, n_tokens: usize, batching: Batching) -> Path {
    let joint = batching == Batching::Joint;
    let texts = batching == Batching::Texts;
    if n_tokens == 0 {
        return Path::Empty;
    }
    let cols = w.cols;
    let nb = cols / QK;
    /// The tile path of `tile` over `operand`.
    fn tiles<W, X>(tile: &Tile<W, X>, operand: Operand, n_tokens: usize, cols: usize) -> Path {
        let (tokens, wide) = tile_shape(tile, n_tokens, cols);
        Path::Tiles {
            operand,
            tokens,
            wide,
        }
    }
    // Block weights with a plain Q8_0 operand: the block lanes kernel for large enough
    // batches.
    let lanes = |min_tokens: usize| {
        (texts || joint && n_tokens >= min_tokens) && k.lanes.is_some() && nb > 0
    };
    let float = |tile_path: Path| {
        if (texts || joint && n_tokens >= FLOAT_LANES_MIN_TOKENS)
            && k.float_lanes.is_some()
            && cols > 0
        {
            Path::FloatLanes
        } else {
            tile_path
        }
    };
    match w.data {
        WeightData::F32(_) => float(tiles(&k.tile_f32, Operand::F32, n_tokens, cols)),
        WeightData::F16(_) => float(tiles(&k.tile_f16, Operand::F32, n_tokens, cols)),
        WeightData::BF16(_) => float(tiles(&k.tile_bf16, Operand::F32, n_tokens, cols)),
        WeightData::Q8_0(_) if lanes(LANES_MIN_TOKENS) => Path::Lanes,
        WeightData::Q8_0(_) => match k.prepared_q8_0.filter(|_| nb > 0) {
            Some(p) => tiles(&p.tile, Operand::Q8_0Pairs, n_tokens, cols),
            None => tiles(&k.tile_q8_0, Operand::Q8_0, n_tokens, cols),
        },
        WeightData::Q4_0(_) if lanes(LANES_MIN_TOKENS) => Path::Lanes,
        WeightData::Q4_0(_) => match k.prepared_q4_0.filter(|_| nb > 0) {
            Some(p) => tiles(&p.tile, Operand::Q8_0Pairs, n_tokens, cols),
            None => tiles(&k.tile_q4_0, Operand::Q8_0, n_tokens, cols),
        },
        WeightData::Q5_0(_) if lanes(LANES_MIN_TOKENS) => Path::Lanes,
        WeightData::Q5_0(_) => tiles(&k.kq.q5_0, Operand::Q8_0, n_tokens, cols),
        WeightData::Q5_1(_) => tiles(&k.kq.q5_1, Operand::Q8_0, n_tokens, cols),
        WeightData::IQ4_NL(_) if lanes(IQ4_NL_LANES_MIN_TOKENS) => Path::Lanes,
        WeightData::IQ4_NL(_) => tiles(&k.kq.iq4_nl, Operand::Q8_0, n_tokens, cols),
        // The K-quant super-block types, as the block-type table's dtypes classify them.
        _ if w.data.dtype().is_k_quant()
            && k.klanes.is_some()
            && cols / QK_K > 0
            && (texts || n_tokens >= klanes_min_tokens(&w.data)) =>
        {
            Path::KLanes
        }
        WeightData::Q4_K(_) => tiles(&k.kq.q4_k, Operand::Q8_K, n_tokens, cols),
        WeightData::Q5_K(_) => tiles(&k.kq.q5_k, Operand::Q8_K, n_tokens, cols),
        WeightData::Q6_K(_) => tiles(&k.kq.q6_k, Operand::Q8_K, n_tokens, cols),
        WeightData::Q2_K(_) => tiles(&k.kq.q2_k, Operand::Q8_K, n_tokens, cols),
        WeightData::Q3_K(_) => tiles(&k.kq.q3_k, Operand::Q8_K, n_tokens, cols),
        WeightData::IQ4_XS(_) => tiles(&k.kq.iq4_xs, Operand::Q8_K, n_tokens, cols),
        WeightData::Q4_0x16(_) => plan_q4_0x16(k, n_tokens, cols, batching),
        WeightData::IQ4_XSx16(_) => plan_iq4_xsx16(k, n_tokens, cols, batching),
        WeightData::IQ4_NLx16(_) => plan_iq4_nlx16(k, n_tokens, cols, batching),
    }
}

/// [`plan_for`] of interleaved Q4_0 (`q4_0x16`).
fn plan_q4_0x16(k: &Kernels, n_tokens: usize, cols: usize, batching: Batching) -> Path {
    if cols / QK == 0 {
        return Path::Empty;
    }
    // The lanes kernel takes interleaved rows, from a larger batch where the interleaved
    // kernel is the alternative; independent tokens take it only there (the same bits).
    let lanes = k.lanes.is_some()
        && (batching == Batching::Joint || k.group_q4_0x16.is_some())
        && match k.group_q4_0x16 {
            Some(_) => n_tokens >= INTERLEAVED_LANES_MIN_TOKENS,
            None => n_tokens >= LANES_MIN_TOKENS,
        };
    match (lanes, k.group_q4_0x16) {
        (true, _) => Path::Lanes,
        (false, Some(g)) => Path::Interleaved {
            tokens: n_tokens.min(g.tokens),
        },
        (false, None) => {
            let (tokens, wide) = tile_shape(&k.tile_q4_0, n_tokens, cols);
            Path::Deinterleaved { tokens, wide }
        }
    }
}

/// [`plan_for`] of interleaved IQ4_XS (`iq4_xsx16`).
fn plan_iq4_xsx16(k: &Kernels, n_tokens: usize, cols: usize, batching: Batching) -> Path {
    if cols / QK_K == 0 {
        return Path::Empty;
    }
    // Every path gives the reference's bits (exact super-block sums, eight accumulators), so
    // only speed decides, whatever the batching.
    let texts = batching == Batching::Texts;
    let klanes_from = interleaved_iq4_xs_klanes_from(k);
    if k.klanes.is_some() && klanes_from.is_some_and(|m| texts || n_tokens >= m) {
        return Path::KLanes;
    }
    match k.group_iq4_xsx16 {
        Some(g) => Path::Interleaved {
            tokens: n_tokens.min(g.tokens),
        },
        None => {
            let (tokens, wide) = tile_shape(&k.kq.iq4_xs, n_tokens, cols);
            Path::Deinterleaved { tokens, wide }
        }
    }
}

/// [`plan_for`] of interleaved IQ4_NL (`iq4_nlx16`).
fn plan_iq4_nlx16(k: &Kernels, n_tokens: usize, cols: usize, batching: Batching) -> Path {
    if cols / QK == 0 {
        return Path::Empty;
    }
    // The lanes kernel's bits (blocks added in order) are not the interleaved kernel's (eight
    // accumulators, as the plain rows' tiles), so only a prompt or whole texts take it, as for
    // plain IQ4_NL.
    let (joint, texts) = (batching == Batching::Joint, batching == Batching::Texts);
    let lanes_from = interleaved_iq4_nl_lanes_from(k);
    if k.lanes.is_some() && lanes_from.is_some_and(|m| texts || joint && n_tokens >= m) {
        return Path::Lanes;
    }
    match k.group_iq4_nlx16 {
        Some(g) => Path::Interleaved {
            tokens: n_tokens.min(g.tokens),
        },
        None => {
            let (tokens, wide) = tile_shape(&k.kq.iq4_nl, n_tokens, cols);
            Path::Deinterleaved { tokens, wide }
        }
    }
}

/// From how many tokens interleaved IQ4_NL (`iq4_nlx16`) takes the lanes kernel at tier `k`,
/// if ever.
///
/// - Never at AVX2, whose interleaved kernel is faster at every prompt length measured: the
///   1B shape, two threads, the interleaved kernel against the lanes kernel, three rounds,
///   tok/s: pp128 61–83 against 59–62, pp256 69–74 against 56–64, pp512 72–75 against 61–65.
///   Every batch then gets the one-token bits.
/// - From [`IQ4_NL_LANES_MIN_TOKENS`] at AVX-512 (as for plain rows), whose lanes kernel
///   multiplies with `vpdpbusd` while its interleaved kernel is AVX2's.
/// - Without an interleaved kernel, from the same count, against the plain tiles.
fn interleaved_iq4_nl_lanes_from(k: &Kernels) -> Option<usize> {
    match (k.group_iq4_nlx16, k.isa()) {
        (Some(_), crate::isa::Isa::Avx2) => None,
        _ => Some(IQ4_NL_LANES_MIN_TOKENS),
    }
}

/// From how many tokens interleaved IQ4_XS (`iq4_xsx16`) takes the K-quant lanes kernel at
/// tier `k`, if ever.
///
/// - Never at AVX2, whose interleaved kernel is as fast or faster at every prompt length
///   measured: the 1B shape, two threads, tok/s, the interleaved kernel against the lanes
///   kernel, rounds alternated: pp128 68.9, 78.6, 80.8 against 76.3, 72.7, 68.3; pp512
///   83.8, 76.1 against 71.0, 75.2.
/// - From [`IQ4_XS_LANES_MIN_TOKENS`] elsewhere, as for plain rows: at AVX-512 the lanes
///   kernel multiplies with `vpdpbusd` while the interleaved kernel is AVX2's; without an
///   interleaved kernel the alternative is the plain tiles.
fn interleaved_iq4_xs_klanes_from(k: &Kernels) -> Option<usize> {
    match (k.group_iq4_xsx16, k.isa()) {
        (Some(_), crate::isa::Isa::Avx2) => None,
        _ => Some(IQ4_XS_LANES_MIN_TOKENS),
    }
}

/// From how many tokens a K-quant encoding takes the K-quant lanes kernel.
fn klanes_min_tokens(data: &WeightData) -> usize {
    match data {
        WeightData::Q2_K(_) => Q2_K_LANES_MIN_TOKENS,
        WeightData::IQ4_XS(_) => IQ4_XS_LANES_MIN_TOKENS,
        _ => KLANES_MIN_TOKENS,
    }
}

/// Tokens per tile call at the start of a batch of `n_tokens` over rows of `cols`, and whether
/// full chunks take the sixteen-row kernel: for one token where the tier has it, for several
/// where it has the several-token one and at least two tokens' activations fit its budget
/// ([`Tile::rows_many_tokens`]); else the register-blocked count when the batch has that
/// many, else one.
fn tile_shape<W, X>(tile: &Tile<W, X>, n_tokens: usize, cols: usize) -> (usize, bool) {
    if n_tokens == 1 {
        return (1, tile.rows.is_some());
    }
    let many = tile.rows_many_tokens(cols);
    if many > 1 {
        return (n_tokens.min(many), true);
    }
    let tokens = if n_tokens >= tile.tokens {
        tile.tokens
    } else {
        1
    };
    (tokens, false)
}
