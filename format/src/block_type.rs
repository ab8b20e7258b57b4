//! Block types as rows of one table: the [`BlockType`] trait every storage unit implements
//! (plain floats, GGML's blocks, Kiln's interleaved layout), and [`BlockKind`], the
//! object-safe row of the table that [`DType::block`] hands out to code that holds a dtype
//! only at run time.
//!
//! Sizes, the GGML id, reference quantization, dequantization and the finiteness scan all
//! come from here, so the value decoder ([`crate::values`]), the reader's NaN/Inf scan, the
//! quantizer and GGUF import need no `match` per dtype to do the same thing for every type.

use bytemuck::Pod;
use half::{bf16, f16};

use crate::blocks::{self, BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};
use crate::dtype::DType;
use crate::error::{FormatError, Result};
use crate::iq4::{self, BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16};
use crate::kquants::{self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use crate::q5::{self, BlockQ5_0, BlockQ5_1};

/// The float encoding of a block's scales (or, for the plain float types, of the element
/// itself): a value is non-finite when its exponent bits are all ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleFloat {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl ScaleFloat {
    /// Bytes of one value.
    pub const fn bytes(self) -> usize {
        match self {
            ScaleFloat::F32 => 4,
            ScaleFloat::F16 | ScaleFloat::BF16 => 2,
        }
    }

    /// The exponent bits, in the little-endian value read as an unsigned integer.
    pub const fn exponent_mask(self) -> u32 {
        match self {
            ScaleFloat::F32 => 0x7f80_0000,
            ScaleFloat::F16 => 0x7c00,
            ScaleFloat::BF16 => 0x7f80,
        }
    }
}

/// Where the floats a block's values are multiplied by sit, so that a reader can tell a block
/// whose values are all NaN or infinite (`0 · inf` is NaN) by reading those floats only.
///
/// A block holds `groups` groups of `per_group` consecutive floats from byte `offset`; a
/// non-finite float in group `g` makes the block's weights `g·w..(g + 1)·w` non-finite, `w`
/// being the block's weights over `groups`. Plain floats are one group of one float (the
/// element); Q5_1 and the K-quants one group of two (scale and minimum); `q4_0x16` sixteen
/// groups of one (a scale per interleaved row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scales {
    /// Their encoding.
    pub float: ScaleFloat,
    /// Byte offset of the first, within the block.
    pub offset: usize,
    /// Consecutive floats per group.
    pub per_group: usize,
    /// Groups per block.
    pub groups: usize,
}

impl Scales {
    /// One float at `offset`, covering the whole block.
    pub const fn one(float: ScaleFloat, offset: usize) -> Scales {
        Scales {
            float,
            offset,
            per_group: 1,
            groups: 1,
        }
    }
}

/// The values one weight's code may decode to, once its block's scales are fixed:
/// `(q + offset)·scale + shift` for codes `q` in `0..=max`, computed in that order (which is
/// the type's dequantizer's, value for value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodeGrid {
    /// The step between codes.
    pub scale: f32,
    /// Added after the scale (a minimum; 0 for symmetric types).
    pub shift: f32,
    /// Added to the code before scaling (−16 for Q5_0's unsigned codes).
    pub offset: i32,
    /// The largest code.
    pub max: i32,
    /// For a non-linear grid (IQ4_NL, IQ4_XS), the level of each code in ascending order: code
    /// `q` then decodes to `levels[q]·scale + shift` (`offset` is 0). `None` for the uniform
    /// grids, where the level is `q + offset`.
    pub levels: Option<&'static [i8]>,
}

impl CodeGrid {
    /// A uniform grid: code `q` decodes to `(q + offset)·scale + shift`.
    pub const fn uniform(scale: f32, shift: f32, offset: i32, max: i32) -> CodeGrid {
        CodeGrid {
            scale,
            shift,
            offset,
            max,
            levels: None,
        }
    }

    /// The value code `q` decodes to.
    pub fn value(self, q: i32) -> f32 {
        let level = match self.levels {
            Some(l) => f32::from(l[q as usize]),
            None => (q + self.offset) as f32,
        };
        level * self.scale + self.shift
    }

    /// The code whose value is nearest `w`, and that value.
    pub fn nearest(self, w: f32) -> (u8, f32) {
        let q = if self.scale == 0.0 {
            // Every code decodes to `shift`: the one nearest level 0.
            match self.levels {
                Some(l) => nearest_level(l, 0.0),
                None => -self.offset,
            }
        } else {
            let t = (w - self.shift) / self.scale;
            match self.levels {
                Some(l) => nearest_level(l, t),
                // Saturating: a value far off the grid (`t` past the `i32` range) takes the
                // end code it is nearest, as the clamp below gives every other.
                None => (t.round() as i32).saturating_sub(self.offset),
            }
        }
        .clamp(0, self.max);
        (q as u8, self.value(q))
    }
}

/// The index of the level nearest `t` in ascending `levels` (the lower one on a tie).
fn nearest_level(levels: &[i8], t: f32) -> i32 {
    let above = levels.partition_point(|&l| f32::from(l) < t);
    let i = if above == 0 {
        0
    } else if above == levels.len()
        || t - f32::from(levels[above - 1]) <= f32::from(levels[above]) - t
    {
        above - 1
    } else {
        above
    };
    i as i32
}

/// How a type's codes can be chosen apart from its scales (what error-compensating rounding
/// does: fit the scales, then pick each code on its weight's grid).
#[derive(Debug, Clone, Copy)]
pub struct Codes<B> {
    /// Every weight's grid in `block`, appended in weight order.
    pub grids: fn(block: &B, out: &mut Vec<CodeGrid>),
    /// Replace `block`'s codes by `codes` (one per weight, each within its grid's `max`).
    pub set: fn(block: &mut B, codes: &[u8]),
    /// How to store chosen scales, for types whose grids have no shift and whose scales can be
    /// set apart from the rule that fits them (see [`ScaleSetter`]).
    pub scales: Option<ScaleSetter<B>>,
}

/// Storing a block's scales as near to chosen values as its layout allows: what a caller that
/// fits the scales for fixed codes (least squares through second moments) needs.
#[derive(Debug, Clone, Copy)]
pub struct ScaleSetter<B> {
    /// Consecutive weights that share one scale.
    pub group: usize,
    /// Encode `scales` (one per group, in weight order: the `scale` their grids should have)
    /// in `block`; the codes are kept. The grids read back afterwards hold the stored values,
    /// which differ from those asked for by the layout's rounding.
    pub set: fn(block: &mut B, scales: &[f32]),
}

/// An importance-weighted quantizer of one row (values, one weight per value) to blocks `B`.
pub type WeightedRow<B> = fn(&[f32], &[f32]) -> Result<Vec<B>>;

/// One storage unit of a tensor dtype: a plain float, or a block of quantized weights.
///
/// Adding a block type to Kiln is: a `#[repr(C)]` struct with a size assertion, an
/// implementation of this trait (wrapping GGML's reference rule, never restating it), a
/// [`DType`] variant with its row in [`DType::block`] (`BlockKind::of::<NewBlock>()`), and its
/// kernels. The value decoder, the reader's finiteness scan, the quantizer's reference path and
/// GGUF import then handle it without further code; the table test in this module checks its
/// sizes, its round trip and its finiteness scan.
pub trait BlockType: Pod {
    /// The dtype this unit stores.
    const DTYPE: DType;
    /// Weights one unit holds (1 for plain floats).
    const WEIGHTS: usize;
    /// Rows one unit spans (16 for `q4_0x16`, whose unit interleaves sixteen rows' blocks).
    const ROWS: usize = 1;
    /// GGML's `ggml_type` id and name, where GGML has this layout.
    const GGML: Option<(u32, &'static str)>;
    /// The floats that must be finite for the unit's values to be.
    const SCALES: Scales;
    /// GGML's importance-weighted rule for one row (`quantize_<type>` given an importance
    /// matrix: one non-negative weight per value), where the format crate has one.
    const WEIGHTED: Option<WeightedRow<Self>> = None;
    /// The weights' grids and how to set the codes, for types whose every weight decodes as
    /// `level(q)·scale + shift` on a grid fixed by the block's scales (see [`CodeGrid`]): what
    /// a quantizer that fits the scales first (by [`BlockType::WEIGHTED`], or for Q8_0 and
    /// Q4_0 by a search of its own) needs to choose the codes apart from them.
    const CODES: Option<Codes<Self>> = None;

    /// Quantize whole rows of `cols` values by GGML's reference rule (`quantize_row_*_ref`,
    /// bit for bit; round to nearest even for the plain floats). Rejects NaN/Inf and lengths
    /// that are not whole units.
    fn quantize_rows_ref(x: &[f32], cols: usize) -> Result<Vec<Self>>;

    /// Dequantize whole rows of `cols` values (`out.len()` of them), by GGML's rule.
    fn dequantize_rows(units: &[Self], cols: usize, out: &mut [f32]);
}

/// A row of the block-type table: what [`BlockType`] says about one type, with its functions
/// taken as bytes, for code that knows the dtype only at run time.
#[derive(Debug, Clone, Copy)]
pub struct BlockKind {
    /// The dtype.
    pub dtype: DType,
    /// Weights per unit.
    pub weights: usize,
    /// Bytes per unit (the struct's `size_of`).
    pub bytes: usize,
    /// Rows one unit spans.
    pub rows: usize,
    /// GGML's id and name, if GGML has this layout.
    pub ggml: Option<(u32, &'static str)>,
    /// Where the floats that must be finite sit.
    pub scales: Scales,
    quantize_ref: QuantizeBytes,
    quantize_weighted: Option<WeightedBytes>,
    dequantize: DequantizeBytes,
    code_grids: Option<GridsBytes>,
    set_codes: Option<SetCodesBytes>,
    set_scales: Option<(usize, SetScalesBytes)>,
}

// The table's functions, over bytes (see the methods of the same names).
type QuantizeBytes = fn(&[f32], usize, &mut Vec<u8>) -> Result<()>;
type WeightedBytes = fn(&[f32], &[f32], &mut Vec<u8>) -> Result<()>;
type DequantizeBytes = fn(&[u8], usize, &mut [f32]);
type GridsBytes = fn(&[u8], &mut Vec<CodeGrid>);
type SetCodesBytes = fn(&mut [u8], &[u8]);
type SetScalesBytes = fn(&mut [u8], &[f32]);

impl BlockKind {
    /// The row of block type `T`.
    pub const fn of<T: BlockType>() -> BlockKind {
        BlockKind {
            dtype: T::DTYPE,
            weights: T::WEIGHTS,
            bytes: std::mem::size_of::<T>(),
            rows: T::ROWS,
            ggml: T::GGML,
            scales: T::SCALES,
            quantize_ref: quantize_ref_bytes::<T>,
            quantize_weighted: match T::WEIGHTED {
                Some(_) => Some(quantize_weighted_bytes::<T>),
                None => None,
            },
            dequantize: dequantize_bytes::<T>,
            code_grids: match T::CODES {
                Some(_) => Some(code_grids_bytes::<T>),
                None => None,
            },
            set_codes: match T::CODES {
                Some(_) => Some(set_codes_bytes::<T>),
                None => None,
            },
            set_scales: match T::CODES {
                Some(Codes {
                    scales: Some(s), ..
                }) => Some((s.group, set_scales_bytes::<T>)),
                _ => None,
            },
        }
    }

    /// Whether the type's codes can be set apart from its scales ([`BlockType::CODES`]).
    pub fn has_code_grids(&self) -> bool {
        self.code_grids.is_some()
    }

    /// Every weight's grid in `bytes` (whole units), appended to `out`; `None` if the type
    /// has no [`BlockType::CODES`].
    pub fn code_grids(&self, bytes: &[u8], out: &mut Vec<CodeGrid>) -> Option<()> {
        self.code_grids.map(|g| g(bytes, out))
    }

    /// Replace the codes of `bytes` (whole units) by `codes`, one per weight; `None` if the
    /// type has no [`BlockType::CODES`].
    pub fn set_codes(&self, bytes: &mut [u8], codes: &[u8]) -> Option<()> {
        self.set_codes.map(|s| s(bytes, codes))
    }

    /// Weights per scale that [`BlockKind::set_scales`] takes, for types whose scales can be
    /// stored apart from their fitting ([`Codes::scales`]).
    pub fn scale_group(&self) -> Option<usize> {
        self.set_scales.map(|(g, _)| g)
    }

    /// Store `scales` (one per [`BlockKind::scale_group`] weights of `bytes`, whole units) as
    /// near as the layout allows, keeping the codes; `None` if the type cannot.
    pub fn set_scales(&self, bytes: &mut [u8], scales: &[f32]) -> Option<()> {
        self.set_scales.map(|(_, s)| s(bytes, scales))
    }

    /// Quantize whole rows of `cols` values by GGML's reference rule, appending the units'
    /// bytes to `out` (nothing on error). See [`BlockType::quantize_rows_ref`].
    pub fn quantize_ref(&self, x: &[f32], cols: usize, out: &mut Vec<u8>) -> Result<()> {
        (self.quantize_ref)(x, cols, out)
    }

    /// Whether the type has an importance-weighted rule ([`BlockType::WEIGHTED`]).
    pub fn has_weighted(&self) -> bool {
        self.quantize_weighted.is_some()
    }

    /// Quantize one row by the type's importance-weighted rule, appending the bytes to `out`;
    /// `None` if it has none.
    pub fn quantize_weighted(
        &self,
        row: &[f32],
        importance: &[f32],
        out: &mut Vec<u8>,
    ) -> Option<Result<()>> {
        self.quantize_weighted.map(|q| q(row, importance, out))
    }

    /// Decode whole rows of `cols` values (`bytes`: whole units, not necessarily aligned) into
    /// `out`, whose length is their number of values.
    pub fn dequantize(&self, bytes: &[u8], cols: usize, out: &mut [f32]) {
        (self.dequantize)(bytes, cols, out)
    }

    /// Whether every scale of one unit's bytes is finite.
    pub fn scales_finite(&self, unit: &[u8]) -> bool {
        let s = self.scales;
        let n = s.per_group * s.groups * s.float.bytes();
        unit[s.offset..s.offset + n]
            .chunks_exact(s.float.bytes())
            .all(|v| !exponent_all_ones(v, s.float.exponent_mask()))
    }

    /// Non-finite values in `bytes` (whole units): how many, and the index of the first. A
    /// unit's values are its scales times its codes, so a non-finite scale makes all the
    /// values of its group non-finite, counted from the group's first; for units spanning
    /// several rows the index is in storage order (unit, then group within it).
    pub fn count_non_finite(&self, bytes: &[u8]) -> (usize, Option<usize>) {
        let s = self.scales;
        match s.float.bytes() {
            4 => self.scan::<4>(bytes),
            _ => self.scan::<2>(bytes),
        }
    }

    fn scan<const N: usize>(&self, bytes: &[u8]) -> (usize, Option<usize>) {
        let s = self.scales;
        let mask = s.float.exponent_mask();
        let per_group = self.weights / s.groups;
        let mut count = 0;
        let mut first = None;
        if s.groups == 1 && s.per_group == 1 {
            // The plain floats (and one-scale blocks): one float per unit, no inner loop.
            for (i, unit) in bytes.chunks_exact(self.bytes).enumerate() {
                if exponent_all_ones(&unit[s.offset..s.offset + N], mask) {
                    count += self.weights;
                    first.get_or_insert(i * self.weights);
                }
            }
            return (count, first);
        }
        for (i, unit) in bytes.chunks_exact(self.bytes).enumerate() {
            for g in 0..s.groups {
                let at = s.offset + g * s.per_group * N;
                let bad = unit[at..at + s.per_group * N]
                    .chunks_exact(N)
                    .any(|v| exponent_all_ones(v, mask));
                if bad {
                    count += per_group;
                    first.get_or_insert(i * self.weights + g * per_group);
                }
            }
        }
        (count, first)
    }
}

/// Whether the little-endian float in `v` (2 or 4 bytes) has all of `mask`'s exponent bits.
#[inline]
pub(crate) fn exponent_all_ones(v: &[u8], mask: u32) -> bool {
    let mut e = [0u8; 4];
    e[..v.len()].copy_from_slice(v);
    u32::from_le_bytes(e) & mask == mask
}

fn quantize_ref_bytes<T: BlockType>(x: &[f32], cols: usize, out: &mut Vec<u8>) -> Result<()> {
    let units = T::quantize_rows_ref(x, cols)?;
    out.extend_from_slice(bytemuck::cast_slice(&units));
    Ok(())
}

fn quantize_weighted_bytes<T: BlockType>(x: &[f32], qw: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let q = T::WEIGHTED.expect("only in rows of types with a weighted rule");
    out.extend_from_slice(bytemuck::cast_slice(&q(x, qw)?));
    Ok(())
}

fn dequantize_bytes<T: BlockType>(bytes: &[u8], cols: usize, out: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(units) => T::dequantize_rows(units, cols, out),
        // Unaligned (or not whole units, which the collect reports): copy into aligned storage.
        Err(_) => T::dequantize_rows(&bytemuck::pod_collect_to_vec::<u8, T>(bytes), cols, out),
    }
}

fn code_grids_bytes<T: BlockType>(bytes: &[u8], out: &mut Vec<CodeGrid>) {
    let c = T::CODES.expect("only in rows of types with codes");
    for b in bytemuck::pod_collect_to_vec::<u8, T>(bytes).iter() {
        (c.grids)(b, out);
    }
}

fn set_codes_bytes<T: BlockType>(bytes: &mut [u8], codes: &[u8]) {
    let c = T::CODES.expect("only in rows of types with codes");
    let mut units = bytemuck::pod_collect_to_vec::<u8, T>(bytes);
    assert_eq!(codes.len(), units.len() * T::WEIGHTS, "one code per weight");
    for (b, q) in units.iter_mut().zip(codes.chunks_exact(T::WEIGHTS)) {
        (c.set)(b, q);
    }
    bytes.copy_from_slice(bytemuck::cast_slice(&units));
}

fn set_scales_bytes<T: BlockType>(bytes: &mut [u8], scales: &[f32]) {
    let s = T::CODES
        .and_then(|c| c.scales)
        .expect("only in rows of types with scale setters");
    let mut units = bytemuck::pod_collect_to_vec::<u8, T>(bytes);
    let per_unit = T::WEIGHTS / s.group;
    assert_eq!(scales.len(), units.len() * per_unit, "one scale per group");
    for (b, sc) in units.iter_mut().zip(scales.chunks_exact(per_unit)) {
        (s.set)(b, sc);
    }
    bytes.copy_from_slice(bytemuck::cast_slice(&units));
}

/// Rows of `cols` values of whole `block`-weight blocks, or the error the reference
/// quantizers give.
fn check_rows(x: &[f32], block: usize) -> Result<()> {
    blocks::check_finite(x)?;
    if !x.len().is_multiple_of(block) {
        return Err(FormatError::RowLength {
            len: x.len(),
            block,
        });
    }
    Ok(())
}

impl BlockType for f32 {
    const DTYPE: DType = DType::F32;
    const WEIGHTS: usize = 1;
    const GGML: Option<(u32, &'static str)> = Some((0, "F32"));
    const SCALES: Scales = Scales::one(ScaleFloat::F32, 0);

    fn quantize_rows_ref(x: &[f32], _cols: usize) -> Result<Vec<f32>> {
        check_rows(x, 1)?;
        Ok(x.to_vec())
    }

    fn dequantize_rows(units: &[f32], _cols: usize, out: &mut [f32]) {
        out.copy_from_slice(units);
    }
}

impl BlockType for f16 {
    const DTYPE: DType = DType::F16;
    const WEIGHTS: usize = 1;
    const GGML: Option<(u32, &'static str)> = Some((1, "F16"));
    const SCALES: Scales = Scales::one(ScaleFloat::F16, 0);

    /// Round to nearest, ties to even; values beyond f16's range become infinite.
    fn quantize_rows_ref(x: &[f32], _cols: usize) -> Result<Vec<f16>> {
        check_rows(x, 1)?;
        Ok(x.iter().map(|&v| f16::from_f32(v)).collect())
    }

    fn dequantize_rows(units: &[f16], _cols: usize, out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        units.convert_to_f32_slice(out);
    }
}

impl BlockType for bf16 {
    const DTYPE: DType = DType::BF16;
    const WEIGHTS: usize = 1;
    const GGML: Option<(u32, &'static str)> = Some((30, "BF16"));
    const SCALES: Scales = Scales::one(ScaleFloat::BF16, 0);

    /// Round to nearest, ties to even (what PyTorch's `.to(torch.bfloat16)` does).
    fn quantize_rows_ref(x: &[f32], _cols: usize) -> Result<Vec<bf16>> {
        check_rows(x, 1)?;
        Ok(x.iter().map(|&v| bf16::from_f32(v)).collect())
    }

    fn dequantize_rows(units: &[bf16], _cols: usize, out: &mut [f32]) {
        assert_eq!(out.len(), units.len(), "output length mismatch");
        for (o, u) in out.iter_mut().zip(units) {
            *o = u.to_f32();
        }
    }
}

/// A GGML block type whose units are one row's blocks in order: the row functions, and the
/// offset of its f16 scale floats.
macro_rules! ggml_block {
    ($t:ty, $dtype:ident, $weights:expr, $id:expr, $scales:expr,
     $quantize:path, $dequantize:path, weighted: $weighted:expr, codes: $codes:expr) => {
        impl BlockType for $t {
            const DTYPE: DType = DType::$dtype;
            const WEIGHTS: usize = $weights;
            const GGML: Option<(u32, &'static str)> = Some(($id, stringify!($dtype)));
            const SCALES: Scales = $scales;
            const WEIGHTED: Option<WeightedRow<Self>> = $weighted;
            const CODES: Option<Codes<Self>> = $codes;

            fn quantize_rows_ref(x: &[f32], _cols: usize) -> Result<Vec<Self>> {
                $quantize(x)
            }

            fn dequantize_rows(units: &[Self], _cols: usize, out: &mut [f32]) {
                $dequantize(units, out)
            }
        }
    };
}

/// Q8_0: `q·d` for the signed 8-bit `q`, as codes `q + 128` in 0..=255.
const Q8_0_CODES: Codes<BlockQ8_0> = Codes {
    grids: |b, out| out.extend([CodeGrid::uniform(b.d.to_f32(), 0.0, -128, 255); QK]),
    set: |b, q| {
        for (s, &c) in b.qs.iter_mut().zip(q) {
            *s = (i32::from(c) - 128) as i8;
        }
    },
    scales: None,
};

/// Q4_0: `(q − 8)·d`, codes 0..=15, packed as IQ4_NL's indices (weight `j` in the low
/// nibble of byte `j`, weight `j + 16` in its high nibble).
const Q4_0_CODES: Codes<BlockQ4_0> = Codes {
    grids: |b, out| out.extend([CodeGrid::uniform(b.d.to_f32(), 0.0, -8, 15); QK]),
    set: |b, q| b.qs = iq4::pack_iq4_nl_codes(q.try_into().expect("a block's codes")),
    scales: None,
};

/// Q5_0: `(q − 16)·d`, codes 0..=31.
const Q5_0_CODES: Codes<BlockQ5_0> = Codes {
    grids: |b, out| {
        let g = CodeGrid::uniform(b.d.to_f32(), 0.0, -16, 31);
        out.extend([g; QK]);
    },
    set: |b, q| (b.qh, b.qs) = q5::pack_q5_codes(q.try_into().expect("a block's codes")),
    scales: None,
};

/// Q5_1: `q·d + m`, codes 0..=31.
const Q5_1_CODES: Codes<BlockQ5_1> = Codes {
    grids: |b, out| {
        let g = CodeGrid::uniform(b.d.to_f32(), b.m.to_f32(), 0, 31);
        out.extend([g; QK]);
    },
    set: |b, q| (b.qh, b.qs) = q5::pack_q5_codes(q.try_into().expect("a block's codes")),
    scales: None,
};

/// Q4_K and Q5_K: `(d·sc)·q − dmin·m` per 32-weight sub-block, codes 0..=`max`.
fn k_sub_block_grids(
    d: f16,
    dmin: f16,
    scales: &[u8; kquants::K_SCALE_SIZE],
    max: i32,
    out: &mut Vec<CodeGrid>,
) {
    for s in 0..QK_K / 32 {
        let (sc, m) = kquants::scale_min_k4(s, scales);
        let g = CodeGrid::uniform(
            d.to_f32() * f32::from(sc),
            -(dmin.to_f32() * f32::from(m)),
            0,
            max,
        );
        out.extend([g; 32]);
    }
}

const Q4_K_CODES: Codes<BlockQ4K> = Codes {
    grids: |b, out| k_sub_block_grids(b.d, b.dmin, &b.scales, 15, out),
    set: |b, q| b.qs = kquants::pack_q4_k_codes(q.try_into().expect("a super-block's codes")),
    scales: None,
};

const Q5_K_CODES: Codes<BlockQ5K> = Codes {
    grids: |b, out| k_sub_block_grids(b.d, b.dmin, &b.scales, 31, out),
    set: |b, q| {
        (b.qh, b.qs) = kquants::pack_q5_k_codes(q.try_into().expect("a super-block's codes"))
    },
    scales: None,
};

/// Q6_K: `(d·sc)·(q − 32)` per 16-weight sub-block, codes 0..=63.
const Q6_K_CODES: Codes<BlockQ6K> = Codes {
    grids: |b, out| {
        for &sc in &b.scales {
            let g = CodeGrid::uniform(b.d.to_f32() * f32::from(sc), 0.0, -32, 63);
            out.extend([g; 16]);
        }
    },
    set: |b, q| {
        (b.ql, b.qh) = kquants::pack_q6_k_codes(q.try_into().expect("a super-block's codes"))
    },
    scales: None,
};

/// Q2_K: `(d·sc)·q − dmin·m` per 16-weight sub-block (4-bit `sc` and `m`), codes 0..=3.
const Q2_K_CODES: Codes<BlockQ2K> = Codes {
    grids: |b, out| {
        for &s in &b.scales {
            let g = CodeGrid::uniform(
                b.d.to_f32() * f32::from(s & 0x0f),
                -(b.dmin.to_f32() * f32::from(s >> 4)),
                0,
                3,
            );
            out.extend([g; 16]);
        }
    },
    set: |b, q| b.qs = kquants::pack_q2_k_codes(q.try_into().expect("a super-block's codes")),
    scales: None,
};

/// Q3_K: `(d·sc)·(q − 4)` per 16-weight sub-block (`sc` signed, 6 bits), codes 0..=7.
const Q3_K_CODES: Codes<BlockQ3K> = Codes {
    grids: |b, out| {
        for sc in kquants::q3_k_scales(&b.scales) {
            let g = CodeGrid::uniform(b.d.to_f32() * f32::from(sc), 0.0, -4, 7);
            out.extend([g; 16]);
        }
    },
    set: |b, q| {
        (b.hmask, b.qs) = kquants::pack_q3_k_codes(q.try_into().expect("a super-block's codes"))
    },
    scales: None,
};

/// IQ4_NL: `d·grid[q]` on GGML's 16-level non-linear grid, codes 0..=15.
const IQ4_NL_CODES: Codes<BlockIQ4NL> = Codes {
    grids: |b, out| out.extend([iq4_grid(b.d.to_f32()); QK]),
    set: |b, q| b.qs = iq4::pack_iq4_nl_codes(q.try_into().expect("a block's codes")),
    scales: Some(ScaleSetter {
        group: QK,
        set: |b, s| b.d = f16::from_f32(s[0]),
    }),
};

/// IQ4_XS: `(d·(ls − 32))·grid[q]` per 32-weight sub-block, codes 0..=15.
const IQ4_XS_CODES: Codes<BlockIQ4XS> = Codes {
    grids: |b, out| {
        let d = b.d.to_f32();
        for s in 0..QK_K / 32 {
            out.extend([iq4_grid(d * iq4::iq4_xs_scale(b, s) as f32); 32]);
        }
    },
    set: |b, q| b.qs = iq4::pack_iq4_xs_codes(q.try_into().expect("a super-block's codes")),
    scales: Some(ScaleSetter {
        group: 32,
        set: |b, s| iq4::set_iq4_xs_scales(b, s.try_into().expect("a super-block's scales")),
    }),
};

fn iq4_grid(scale: f32) -> CodeGrid {
    CodeGrid {
        levels: Some(&iq4::IQ4_GRID),
        ..CodeGrid::uniform(scale, 0.0, 0, 15)
    }
}

/// An f16 scale and minimum at the start of the block (Q5_1, Q4_K, Q5_K).
const SCALE_AND_MIN: Scales = Scales {
    float: ScaleFloat::F16,
    offset: 0,
    per_group: 2,
    groups: 1,
};

ggml_block!(BlockQ8_0, Q8_0, QK, 8, Scales::one(ScaleFloat::F16, 0),
    blocks::quantize_row_q8_0_ref, blocks::dequantize_row_q8_0,
    weighted: None, codes: Some(Q8_0_CODES));
ggml_block!(BlockQ4_0, Q4_0, QK, 2, Scales::one(ScaleFloat::F16, 0),
    blocks::quantize_row_q4_0_ref, blocks::dequantize_row_q4_0,
    weighted: None, codes: Some(Q4_0_CODES));
ggml_block!(BlockQ5_0, Q5_0, QK, 6, Scales::one(ScaleFloat::F16, 0),
    q5::quantize_row_q5_0_ref, q5::dequantize_row_q5_0,
    weighted: Some(q5::quantize_row_q5_0_weighted), codes: Some(Q5_0_CODES));
ggml_block!(BlockQ5_1, Q5_1, QK, 7, SCALE_AND_MIN,
    q5::quantize_row_q5_1_ref, q5::dequantize_row_q5_1,
    weighted: Some(q5::quantize_row_q5_1_weighted), codes: Some(Q5_1_CODES));
ggml_block!(BlockQ4K, Q4_K, QK_K, 12, SCALE_AND_MIN,
    kquants::quantize_row_q4_k_ref, kquants::dequantize_row_q4_k,
    weighted: Some(kquants::quantize_row_q4_k_weighted), codes: Some(Q4_K_CODES));
ggml_block!(BlockQ5K, Q5_K, QK_K, 13, SCALE_AND_MIN,
    kquants::quantize_row_q5_k_ref, kquants::dequantize_row_q5_k,
    weighted: Some(kquants::quantize_row_q5_k_weighted), codes: Some(Q5_K_CODES));
// Q6_K keeps its one f16 scale after the codes and sub-block scales.
ggml_block!(BlockQ6K, Q6_K, QK_K, 14, Scales::one(ScaleFloat::F16, std::mem::offset_of!(BlockQ6K, d)),
    kquants::quantize_row_q6_k_ref, kquants::dequantize_row_q6_k,
    weighted: Some(kquants::quantize_row_q6_k_weighted), codes: Some(Q6_K_CODES));

// Q2_K and Q3_K keep their f16 scales after the codes; IQ4_XS its one scale first.
ggml_block!(BlockQ2K, Q2_K, QK_K, 10,
    Scales { float: ScaleFloat::F16, offset: std::mem::offset_of!(BlockQ2K, d), per_group: 2, groups: 1 },
    kquants::quantize_row_q2_k_ref, kquants::dequantize_row_q2_k,
    weighted: Some(kquants::quantize_row_q2_k_weighted), codes: Some(Q2_K_CODES));
ggml_block!(BlockQ3K, Q3_K, QK_K, 11, Scales::one(ScaleFloat::F16, std::mem::offset_of!(BlockQ3K, d)),
    kquants::quantize_row_q3_k_ref, kquants::dequantize_row_q3_k,
    weighted: Some(kquants::quantize_row_q3_k_weighted), codes: Some(Q3_K_CODES));
// IQ4: codes on the 16 non-linear levels (`CodeGrid::levels`).
ggml_block!(BlockIQ4NL, IQ4_NL, QK, 20, Scales::one(ScaleFloat::F16, 0),
    iq4::quantize_row_iq4_nl_ref, iq4::dequantize_row_iq4_nl,
    weighted: Some(iq4::quantize_row_iq4_nl_weighted), codes: Some(IQ4_NL_CODES));
ggml_block!(BlockIQ4XS, IQ4_XS, QK_K, 23, Scales::one(ScaleFloat::F16, 0),
    iq4::quantize_row_iq4_xs_ref, iq4::dequantize_row_iq4_xs,
    weighted: Some(iq4::quantize_row_iq4_xs_weighted), codes: Some(IQ4_XS_CODES));

/// A sixteen-row interleaved layout (`$x`, of `$dtype`) of GGML's blocks of `$qk` weights,
/// so the plain type's reference rule and decoder, in Kiln's order. Rows must come in whole
/// groups of sixteen.
macro_rules! interleaved_block {
    ($x:ident, $dtype:ident, $qk:expr, $quantize:path, $interleave:path, $deinterleave:path, $dequantize:path) => {
        impl BlockType for $x {
            const DTYPE: DType = DType::$dtype;
            const WEIGHTS: usize = GROUP_ROWS * $qk;
            const ROWS: usize = GROUP_ROWS;
            const GGML: Option<(u32, &'static str)> = None;
            /// Sixteen f16 scales first, one per row's block.
            const SCALES: Scales = Scales {
                float: ScaleFloat::F16,
                offset: 0,
                per_group: 1,
                groups: GROUP_ROWS,
            };

            fn quantize_rows_ref(x: &[f32], cols: usize) -> Result<Vec<$x>> {
                let group = cols * GROUP_ROWS;
                if cols == 0 || !cols.is_multiple_of($qk) || !x.len().is_multiple_of(group) {
                    return Err(FormatError::RowLength {
                        len: x.len(),
                        block: group.max($qk),
                    });
                }
                let rows = $quantize(x)?;
                Ok($interleave(&rows, cols / $qk))
            }

            fn dequantize_rows(units: &[$x], cols: usize, out: &mut [f32]) {
                let rows = $deinterleave(units, (cols / $qk).max(1));
                $dequantize(&rows, out)
            }
        }
    };
}

interleaved_block!(
    BlockQ4_0x16,
    Q4_0x16,
    QK,
    blocks::quantize_row_q4_0_ref,
    blocks::interleave_q4_0,
    blocks::deinterleave_q4_0x16,
    blocks::dequantize_row_q4_0
);
interleaved_block!(
    BlockIQ4NLx16,
    IQ4_NLx16,
    QK,
    iq4::quantize_row_iq4_nl_ref,
    iq4::interleave_iq4_nl,
    iq4::deinterleave_iq4_nlx16,
    iq4::dequantize_row_iq4_nl
);
interleaved_block!(
    BlockIQ4XSx16,
    IQ4_XSx16,
    QK_K,
    iq4::quantize_row_iq4_xs_ref,
    iq4::interleave_iq4_xs,
    iq4::deinterleave_iq4_xsx16,
    iq4::dequantize_row_iq4_xs
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Root mean square of the round-trip error over the row's largest magnitude, the bound per
    /// type for rows of values spread evenly over [-1, 1] (about twice what each type reaches).
    struct Row {
        dtype: DType,
        weights: usize,
        bytes: usize,
        max_relative_rms_error: f64,
    }

    const fn row(dtype: DType, weights: usize, bytes: usize, bound: f64) -> Row {
        Row {
            dtype,
            weights,
            bytes,
            max_relative_rms_error: bound,
        }
    }

    /// Every dtype, with GGML's sizes (`ggml-common.h`) and its round-trip bound.
    const TABLE: [Row; 17] = [
        row(DType::F32, 1, 4, 0.0),
        row(DType::F16, 1, 2, 2.5e-4),
        row(DType::BF16, 1, 2, 2e-3),
        row(DType::Q8_0, QK, 34, 5e-3),
        row(DType::Q4_0, QK, 18, 8e-2),
        row(DType::Q4_0x16, GROUP_ROWS * QK, GROUP_ROWS * 18, 8e-2),
        row(DType::Q5_0, QK, 22, 4e-2),
        row(DType::Q5_1, QK, 24, 4e-2),
        row(DType::Q4_K, QK_K, 144, 6e-2),
        row(DType::Q5_K, QK_K, 176, 3e-2),
        row(DType::Q6_K, QK_K, 210, 1.5e-2),
        row(DType::Q2_K, QK_K, 84, 0.27),
        row(DType::Q3_K, QK_K, 110, 0.15),
        row(DType::IQ4_NL, QK, 18, 8e-2),
        row(DType::IQ4_XS, QK_K, 136, 8e-2),
        row(DType::IQ4_NLx16, GROUP_ROWS * QK, GROUP_ROWS * 18, 8e-2),
        row(DType::IQ4_XSx16, GROUP_ROWS * QK_K, GROUP_ROWS * 136, 8e-2),
    ];

    /// Sixteen rows (whole `q4_0x16` groups) of 512 values (whole super-blocks).
    const ROWS: usize = 16;
    const COLS: usize = 2 * QK_K;

    fn values() -> Vec<f32> {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        (0..ROWS * COLS)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_table_has_every_dtype_once() {
        let mut seen: Vec<DType> = TABLE.iter().map(|r| r.dtype).collect();
        seen.sort();
        let mut all = DType::ALL.to_vec();
        all.sort();
        assert_eq!(seen, all);
    }

    #[test]
    fn every_block_type_sizes_round_trip_and_finiteness() {
        let x = values();
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        for r in &TABLE {
            let d = r.dtype;
            let k = d.block();
            assert_eq!(k.dtype, d);
            assert_eq!((k.weights, k.bytes), (r.weights, r.bytes), "{d}");
            assert_eq!(
                (d.block_len(), d.block_bytes()),
                (r.weights, r.bytes),
                "{d}"
            );
            match k.ggml {
                Some((id, name)) => {
                    assert_eq!(id, d.id(), "{d}");
                    assert!(name.eq_ignore_ascii_case(d.name()), "{d}");
                }
                None => assert_ne!(d.logical(), d, "{d}: only Kiln's own layouts lack one"),
            }
            assert_eq!(k.rows, d.rows_per_unit(), "{d}");

            let mut bytes = Vec::new();
            k.quantize_ref(&x, COLS, &mut bytes).unwrap();
            assert_eq!(
                bytes.len() as u64,
                d.byte_len(&[ROWS as u64, COLS as u64]).unwrap()
            );
            let mut y = vec![0f32; x.len()];
            k.dequantize(&bytes, COLS, &mut y);
            let se: f64 = x
                .iter()
                .zip(&y)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let rel = (se / x.len() as f64).sqrt() / amax;
            assert!(rel <= r.max_relative_rms_error, "{d}: {rel}");
            assert_eq!(k.count_non_finite(&bytes), (0, None), "{d}");

            // A NaN in each scale group of the second unit: that group's values, no others.
            let s = k.scales;
            let per_group = k.weights / s.groups;
            for g in 0..s.groups {
                for f in 0..s.per_group {
                    let mut bad = bytes.clone();
                    let at = k.bytes + s.offset + (g * s.per_group + f) * s.float.bytes();
                    let nan: &[u8] = match s.float {
                        ScaleFloat::F32 => &f32::NAN.to_le_bytes(),
                        ScaleFloat::F16 => &f16::NAN.to_le_bytes(),
                        ScaleFloat::BF16 => &bf16::NAN.to_le_bytes(),
                    };
                    bad[at..at + nan.len()].copy_from_slice(nan);
                    assert!(!k.scales_finite(&bad[k.bytes..2 * k.bytes]), "{d}");
                    assert!(k.scales_finite(&bad[..k.bytes]), "{d}");
                    assert_eq!(
                        k.count_non_finite(&bad),
                        (per_group, Some(k.weights + g * per_group)),
                        "{d} group {g} float {f}"
                    );
                }
            }
        }
    }

    #[test]
    fn reference_quantize_refuses_nan_and_partial_rows() {
        let mut x = values();
        for r in &TABLE {
            let k = r.dtype.block();
            let mut out = Vec::new();
            if r.weights > 1 {
                let e = k.quantize_ref(&x[..COLS - 1], COLS - 1, &mut out);
                assert!(
                    matches!(e, Err(FormatError::RowLength { .. })),
                    "{}",
                    r.dtype
                );
            }
            x[7] = f32::NAN;
            let e = k.quantize_ref(&x, COLS, &mut out);
            assert!(
                matches!(e, Err(FormatError::NonFinite { position: 7, .. })),
                "{}: {e:?}",
                r.dtype
            );
            assert!(out.is_empty(), "{}", r.dtype);
            x[7] = 0.5;
        }
    }

    /// Every type with code grids decodes any codes set on them to the grids' values, exactly
    /// (up to the sign of zero: a grid adds its shift, 0 for symmetric types), which is what
    /// error-compensating rounding relies on.
    #[test]
    fn code_grids_are_the_dequantizers_values() {
        let x = values();
        let w = vec![1.0f32; COLS];
        for d in DType::ALL
            .into_iter()
            .filter(|d| d.block().has_code_grids())
        {
            let k = d.block();
            let mut bytes = Vec::new();
            match k.quantize_weighted(&x[..COLS], &w, &mut bytes) {
                Some(r) => r.unwrap(),
                // Q8_0 and Q4_0: GGML has no weighted rule for them.
                None => k.quantize_ref(&x[..COLS], COLS, &mut bytes).unwrap(),
            }
            let mut grids = Vec::new();
            k.code_grids(&bytes, &mut grids).unwrap();
            assert_eq!(grids.len(), COLS, "{d}");
            let codes: Vec<u8> = grids
                .iter()
                .enumerate()
                .map(|(j, g)| ((j * 7 + 3) % (g.max as usize + 1)) as u8)
                .collect();
            k.set_codes(&mut bytes, &codes).unwrap();
            let mut y = vec![0f32; COLS];
            k.dequantize(&bytes, COLS, &mut y);
            for (j, (g, &q)) in grids.iter().zip(&codes).enumerate() {
                assert_eq!(g.value(i32::from(q)), y[j], "{d} weight {j}");
            }
        }
    }

    /// For the types whose scales can be stored apart from their fitting: storing the scales
    /// the grids read back changes no byte; storing others keeps the codes and gives grids
    /// with those scales, up to the layout's rounding (f16 for IQ4_NL, 6-bit multiples of an
    /// f16 super-block scale for IQ4_XS, whose largest scale is kept to f16's precision).
    #[test]
    fn scale_setters_keep_the_codes_and_store_the_scales() {
        let x = values();
        let w = vec![1.0f32; COLS];
        let setters: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|d| d.block().scale_group().is_some())
            .collect();
        assert_eq!(setters, [DType::IQ4_NL, DType::IQ4_XS]);
        for d in setters {
            let k = d.block();
            let group = k.scale_group().unwrap();
            let mut bytes = Vec::new();
            k.quantize_weighted(&x[..COLS], &w, &mut bytes)
                .unwrap()
                .unwrap();
            let mut grids = Vec::new();
            k.code_grids(&bytes, &mut grids).unwrap();
            let scales: Vec<f32> = grids.iter().step_by(group).map(|g| g.scale).collect();
            let mut same = bytes.clone();
            k.set_scales(&mut same, &scales).unwrap();
            assert_eq!(same, bytes, "{d}: the stored scales again");

            // New scales: each group's scaled by its own factor, one of them negated.
            let wanted: Vec<f32> = scales
                .iter()
                .enumerate()
                .map(|(i, &s)| s * (0.7 + 0.05 * (i % 9) as f32) * if i == 3 { -1.0 } else { 1.0 })
                .collect();
            let mut set = bytes.clone();
            k.set_scales(&mut set, &wanted).unwrap();
            let mut new_grids = Vec::new();
            k.code_grids(&set, &mut new_grids).unwrap();
            let unit_groups = k.weights / group;
            for (i, (&want, g)) in wanted
                .iter()
                .zip(new_grids.iter().step_by(group))
                .enumerate()
            {
                let unit = &wanted[i / unit_groups * unit_groups..][..unit_groups];
                let largest = unit.iter().fold(0f32, |m, s| m.max(s.abs()));
                // Within half a step of the layout's grid of scales.
                let step = if unit_groups == 1 {
                    want.abs() / 1024.0
                } else {
                    largest / 32.0
                };
                assert!(
                    (g.scale - want).abs() <= step * 0.5 + largest / 1024.0,
                    "{d} group {i}: {} for {want}",
                    g.scale
                );
            }
            let (mut old_codes, mut new_codes) = (vec![0u8; COLS], vec![0u8; COLS]);
            let mut y = vec![0f32; COLS];
            k.dequantize(&bytes, COLS, &mut y);
            for (j, g) in grids.iter().enumerate() {
                old_codes[j] = g.nearest(y[j]).0;
            }
            k.dequantize(&set, COLS, &mut y);
            for (j, g) in new_grids.iter().enumerate() {
                new_codes[j] = g.nearest(y[j]).0;
            }
            assert_eq!(new_codes, old_codes, "{d}: the codes are kept");
        }
    }

    /// The nearest code on a uniform and on a non-linear grid, a negative scale (IQ4's scales
    /// are often negative), codes clamped to the grid, and a zero scale.
    #[test]
    fn nearest_codes_on_uniform_and_level_grids() {
        let u = CodeGrid::uniform(0.5, 1.0, -4, 7);
        assert_eq!(u.nearest(1.0), (4, 1.0));
        assert_eq!(u.nearest(1.74), (5, 1.5));
        assert_eq!(u.nearest(100.0), (7, 2.5));
        assert_eq!(u.nearest(-100.0), (0, -1.0));
        // Far past the `i32` range (a tiny scale): the end codes, not a wrapped offset.
        let tiny = CodeGrid::uniform(1e-30, 0.0, -128, 255);
        assert_eq!(tiny.nearest(1e10), (255, tiny.value(255)));
        assert_eq!(tiny.nearest(-1e10), (0, tiny.value(0)));
        assert_eq!(
            CodeGrid::uniform(0.0, 0.25, -16, 31).nearest(3.0),
            (16, 0.25)
        );
        let levels = |scale| CodeGrid {
            levels: Some(&crate::iq4::IQ4_GRID),
            ..CodeGrid::uniform(scale, 0.0, 0, 15)
        };
        // Levels −127 −104 −83 −65 −49 −35 −22 −10 1 13 25 38 53 69 89 113.
        assert_eq!(levels(0.5).nearest(6.0), (9, 6.5));
        assert_eq!(levels(0.5).nearest(-60.0), (0, -63.5));
        assert_eq!(levels(0.5).nearest(1e9), (15, 56.5));
        assert_eq!(levels(-0.5).nearest(6.0), (7, 5.0));
        assert_eq!(levels(0.0).nearest(6.0), (8, 0.0));
        // Every value's code is at least as near as every other code.
        for k in -300..300 {
            let w = k as f32 * 0.37;
            let (q, y) = levels(0.5).nearest(w);
            assert_eq!(y, levels(0.5).value(i32::from(q)));
            for other in 0..16 {
                assert!((w - y).abs() <= (w - levels(0.5).value(other)).abs(), "{w}");
            }
        }
    }

    #[test]
    fn weighted_rules_are_ggml_types_with_importance() {
        let x = values();
        let w = vec![1.0f32; COLS];
        for d in DType::ALL {
            let k = d.block();
            let mut out = Vec::new();
            match k.quantize_weighted(&x[..COLS], &w, &mut out) {
                Some(r) => {
                    r.unwrap();
                    assert_eq!(out.len(), COLS / k.weights * k.bytes, "{d}");
                }
                None => assert!(!k.has_weighted(), "{d}"),
            }
        }
        let with: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|d| d.block().has_weighted())
            .collect();
        assert_eq!(
            with,
            [
                DType::Q5_0,
                DType::Q5_1,
                DType::Q2_K,
                DType::Q3_K,
                DType::Q4_K,
                DType::Q5_K,
                DType::Q6_K,
                DType::IQ4_NL,
                DType::IQ4_XS
            ]
        );
    }
}
