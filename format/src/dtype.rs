//! Element types a `.kiln` tensor may hold, and how many bytes a shape of each occupies.
//!
//! The numeric ids are GGML's `ggml_type` values, written explicitly so that the on-disk id never
//! depends on declaration order and so that blocks can be exchanged with GGUF without a table.
//! Kiln's own layouts, which GGML does not have, take ids from 1000 up: 1000 plus the GGML id
//! of the block they rearrange.

use std::fmt;

use half::{bf16, f16};

use crate::block_type::BlockKind;
use crate::blocks::{BlockQ4_0, BlockQ4_0x16, BlockQ8_0, GROUP_ROWS, QK};
use crate::iq4::{BlockIQ4NL, BlockIQ4NLx16, BlockIQ4XS, BlockIQ4XSx16};
use crate::kquants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use crate::q5::{BlockQ5_0, BlockQ5_1};

/// A tensor element type. Variants keep GGML's names (`Q4_K`, not `Q4K`) so that they read
/// as the types users know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the top half of a binary32).
    BF16,
    /// GGML Q8_0: blocks of 32 weights, an f16 scale and 32 signed bytes (34 bytes a block).
    Q8_0,
    /// GGML Q4_0: blocks of 32 weights, an f16 scale and 16 bytes of nibbles (18 bytes a block).
    Q4_0,
    /// Q4_0 with sixteen rows interleaved ([`BlockQ4_0x16`]): GGML's blocks and codes, in an
    /// order made for the one-token matrix–vector product. Only for matrices (two dimensions)
    /// whose row count is a multiple of 16. Since format 1.1.
    Q4_0x16,
    /// GGML Q5_0: blocks of 32 weights, an f16 scale, 32 fifth bits and 16 bytes of nibbles
    /// (22 bytes a block). Since format 1.2.
    Q5_0,
    /// GGML Q5_1: Q5_0 with an f16 minimum (24 bytes a block). Since format 1.2.
    Q5_1,
    /// GGML Q4_K: super-blocks of 256 weights, eight 32-weight sub-blocks with 6-bit scales
    /// and mins (144 bytes a block). Since format 1.2.
    Q4_K,
    /// GGML Q5_K: Q4_K with a fifth bit per weight (176 bytes a block). Since format 1.2.
    Q5_K,
    /// GGML Q6_K: super-blocks of 256 weights, sixteen 16-weight sub-blocks with 8-bit scales,
    /// 6-bit codes (210 bytes a block). Since format 1.2.
    Q6_K,
    /// GGML Q2_K: super-blocks of 256 weights, sixteen 16-weight sub-blocks with 4-bit scales
    /// and mins, 2-bit codes (84 bytes a block). Since format 1.4.
    Q2_K,
    /// GGML Q3_K: super-blocks of 256 weights, sixteen 16-weight sub-blocks with 6-bit scales,
    /// 3-bit codes (110 bytes a block). Since format 1.4.
    Q3_K,
    /// GGML IQ4_NL: blocks of 32 weights, an f16 scale and sixteen bytes of 4-bit indices into
    /// GGML's non-linear grid (18 bytes a block). Since format 1.4.
    IQ4_NL,
    /// GGML IQ4_XS: super-blocks of 256 weights, eight 32-weight sub-blocks with 6-bit scales,
    /// 4-bit indices into IQ4_NL's grid (136 bytes a block). Since format 1.4.
    IQ4_XS,
    /// IQ4_NL with sixteen rows interleaved ([`BlockIQ4NLx16`], the order of
    /// [`DType::Q4_0x16`]): GGML's blocks and indices, for the one-token product. Only for
    /// matrices whose row count is a multiple of 16. Since format 1.6.
    IQ4_NLx16,
    /// IQ4_XS with sixteen rows interleaved ([`BlockIQ4XSx16`]): GGML's super-blocks, scales
    /// and indices, for the one-token product. Only for matrices whose row count is a multiple
    /// of 16. Since format 1.7.
    IQ4_XSx16,
}

impl DType {
    /// Every dtype, in id order.
    pub const ALL: [DType; 17] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::BF16,
        DType::Q4_0x16,
        DType::IQ4_NLx16,
        DType::IQ4_XSx16,
    ];

    /// The on-disk id (GGML's `ggml_type` number).
    pub const fn id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::IQ4_NL => 20,
            DType::IQ4_XS => 23,
            DType::BF16 => 30,
            DType::Q4_0x16 => 1002,
            DType::IQ4_NLx16 => 1020,
            DType::IQ4_XSx16 => 1023,
        }
    }

    /// The dtype with on-disk id `id`, if this build knows it.
    pub const fn from_id(id: u32) -> Option<DType> {
        match id {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Q4_0),
            6 => Some(DType::Q5_0),
            7 => Some(DType::Q5_1),
            8 => Some(DType::Q8_0),
            12 => Some(DType::Q4_K),
            13 => Some(DType::Q5_K),
            14 => Some(DType::Q6_K),
            10 => Some(DType::Q2_K),
            11 => Some(DType::Q3_K),
            20 => Some(DType::IQ4_NL),
            23 => Some(DType::IQ4_XS),
            30 => Some(DType::BF16),
            1002 => Some(DType::Q4_0x16),
            1020 => Some(DType::IQ4_NLx16),
            1023 => Some(DType::IQ4_XSx16),
            _ => None,
        }
    }

    /// Lower-case name as used on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_0x16 => "q4_0x16",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::Q2_K => "q2_k",
            DType::Q3_K => "q3_k",
            DType::IQ4_NL => "iq4_nl",
            DType::IQ4_XS => "iq4_xs",
            DType::IQ4_NLx16 => "iq4_nlx16",
            DType::IQ4_XSx16 => "iq4_xsx16",
        }
    }

    /// Parse a name as printed by [`DType::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }

    /// This dtype's row of the block-type table: its sizes, GGML id, reference quantizer,
    /// dequantizer and the scales that must be finite (see [`crate::block_type`]). The one
    /// place a dtype is tied to the struct that stores it.
    pub const fn block(self) -> &'static BlockKind {
        const F32: BlockKind = BlockKind::of::<f32>();
        const F16: BlockKind = BlockKind::of::<f16>();
        const BF16: BlockKind = BlockKind::of::<bf16>();
        const Q8_0: BlockKind = BlockKind::of::<BlockQ8_0>();
        const Q4_0: BlockKind = BlockKind::of::<BlockQ4_0>();
        const Q4_0X16: BlockKind = BlockKind::of::<BlockQ4_0x16>();
        const Q5_0: BlockKind = BlockKind::of::<BlockQ5_0>();
        const Q5_1: BlockKind = BlockKind::of::<BlockQ5_1>();
        const Q4_K: BlockKind = BlockKind::of::<BlockQ4K>();
        const Q5_K: BlockKind = BlockKind::of::<BlockQ5K>();
        const Q6_K: BlockKind = BlockKind::of::<BlockQ6K>();
        const Q2_K: BlockKind = BlockKind::of::<BlockQ2K>();
        const Q3_K: BlockKind = BlockKind::of::<BlockQ3K>();
        const IQ4_NL: BlockKind = BlockKind::of::<BlockIQ4NL>();
        const IQ4_XS: BlockKind = BlockKind::of::<BlockIQ4XS>();
        const IQ4_NLX16: BlockKind = BlockKind::of::<BlockIQ4NLx16>();
        const IQ4_XSX16: BlockKind = BlockKind::of::<BlockIQ4XSx16>();
        match self {
            DType::F32 => &F32,
            DType::F16 => &F16,
            DType::BF16 => &BF16,
            DType::Q8_0 => &Q8_0,
            DType::Q4_0 => &Q4_0,
            DType::Q4_0x16 => &Q4_0X16,
            DType::Q5_0 => &Q5_0,
            DType::Q5_1 => &Q5_1,
            DType::Q4_K => &Q4_K,
            DType::Q5_K => &Q5_K,
            DType::Q6_K => &Q6_K,
            DType::Q2_K => &Q2_K,
            DType::Q3_K => &Q3_K,
            DType::IQ4_NL => &IQ4_NL,
            DType::IQ4_XS => &IQ4_XS,
            DType::IQ4_NLx16 => &IQ4_NLX16,
            DType::IQ4_XSx16 => &IQ4_XSX16,
        }
    }

    /// Number of weights one storage unit covers (1 for plain floats, 32 for blocks, 256 for a
    /// K-quant super-block, 512 for a sixteen-row group of blocks).
    pub const fn block_len(self) -> usize {
        self.block().weights
    }

    /// The dtype whose values this one stores: [`DType::Q4_0`] for [`DType::Q4_0x16`],
    /// [`DType::IQ4_NL`] for [`DType::IQ4_NLx16`] and [`DType::IQ4_XS`] for
    /// [`DType::IQ4_XSx16`] (the same blocks in another order), the dtype itself otherwise. Quantization policies, tolerances and reports speak of this one.
    pub const fn logical(self) -> DType {
        match self {
            DType::Q4_0x16 => DType::Q4_0,
            DType::IQ4_NLx16 => DType::IQ4_NL,
            DType::IQ4_XSx16 => DType::IQ4_XS,
            d => d,
        }
    }

    /// The sixteen-row interleaved layout of this dtype's blocks, if Kiln has one (Q4_0 and
    /// IQ4_NL, whose blocks share one layout, and IQ4_XS).
    pub const fn interleaved(self) -> Option<DType> {
        match self {
            DType::Q4_0 => Some(DType::Q4_0x16),
            DType::IQ4_NL => Some(DType::IQ4_NLx16),
            DType::IQ4_XS => Some(DType::IQ4_XSx16),
            _ => None,
        }
    }

    /// How a writer stores a tensor of `shape` whose values are of dtype `self`: Q4_0, IQ4_NL
    /// and IQ4_XS matrices with a multiple of 16 rows (and whole blocks a row) as
    /// [`DType::Q4_0x16`], [`DType::IQ4_NLx16`] and [`DType::IQ4_XSx16`], everything else as
    /// itself.
    pub fn storage_for(self, shape: &[u64]) -> DType {
        match (self.interleaved(), shape) {
            (Some(x), &[rows, cols])
                if rows > 0
                    && rows % GROUP_ROWS as u64 == 0
                    && cols % self.block_len() as u64 == 0 =>
            {
                x
            }
            _ => self,
        }
    }

    /// Rows one storage unit spans: 16 for the interleaved layouts (a unit interleaves sixteen
    /// rows' blocks), 1 otherwise. A writer that works in chunks of rows cuts them at
    /// multiples of this.
    pub const fn rows_per_unit(self) -> usize {
        self.block().rows
    }

    /// `bytes` (whole rows of `cols` values in the logical dtype's row-major layout, as GGML
    /// and the quantizers produce them) laid out the way this storage dtype keeps them: the
    /// one place a layout's arrangement is applied. Borrowed unchanged for plain layouts.
    pub fn to_storage(self, cols: usize, bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
        match self {
            // Both interleaved layouts move the same 18-byte blocks the same way.
            DType::Q4_0x16 | DType::IQ4_NLx16 => {
                let mut out = Vec::with_capacity(bytes.len());
                crate::blocks::interleave_q4_0_bytes(bytes, cols / QK, &mut out);
                out.into()
            }
            DType::IQ4_XSx16 => {
                let blocks: Vec<BlockIQ4XS> = bytemuck::pod_collect_to_vec(bytes);
                let groups = crate::iq4::interleave_iq4_xs(&blocks, cols / QK_K);
                bytemuck::cast_slice::<BlockIQ4XSx16, u8>(&groups)
                    .to_vec()
                    .into()
            }
            _ => bytes.into(),
        }
    }

    /// The reverse of [`DType::to_storage`]: stored bytes back to the logical dtype's
    /// row-major layout (for export to GGUF, which knows only that).
    pub fn from_storage(self, cols: usize, bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
        match self {
            DType::Q4_0x16 | DType::IQ4_NLx16 => {
                let groups: Vec<BlockQ4_0x16> = bytemuck::pod_collect_to_vec(bytes);
                let rows = crate::blocks::deinterleave_q4_0x16(&groups, (cols / QK).max(1));
                bytemuck::cast_slice::<BlockQ4_0, u8>(&rows).to_vec().into()
            }
            DType::IQ4_XSx16 => {
                let groups: Vec<BlockIQ4XSx16> = bytemuck::pod_collect_to_vec(bytes);
                let rows = crate::iq4::deinterleave_iq4_xsx16(&groups, (cols / QK_K).max(1));
                bytemuck::cast_slice::<BlockIQ4XS, u8>(&rows)
                    .to_vec()
                    .into()
            }
            _ => bytes.into(),
        }
    }

    /// Bytes of one storage unit.
    pub const fn block_bytes(self) -> usize {
        self.block().bytes
    }

    /// Whether this is a block-quantized type.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Whether this is one of the K-quant super-block types (256 weights a block, dotted with
    /// Q8_K activations): the K-quants and IQ4_XS.
    pub const fn is_k_quant(self) -> bool {
        matches!(
            self,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS
        )
    }

    /// Bits of storage per weight (e.g. 4.5 for Q4_0).
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_len() as f64
    }

    /// Byte length of a row-major tensor of `shape`, or why the shape cannot hold this dtype.
    ///
    /// Block types are laid out row by row, so the last (innermost) dimension must be a
    /// multiple of the block length; all arithmetic is checked because shapes come from disk.
    pub fn byte_len(self, shape: &[u64]) -> Result<u64, String> {
        let mut elements: u64 = 1;
        for &d in shape {
            elements = elements
                .checked_mul(d)
                .ok_or_else(|| format!("shape {shape:?} overflows 64 bits"))?;
        }
        let interleaved = self.rows_per_unit() > 1;
        if interleaved {
            // The plain dtype's block length: the columns a row's block spans.
            let row_block = self.logical().block_len() as u64;
            let ok = matches!(shape, &[rows, cols]
                if rows % GROUP_ROWS as u64 == 0 && cols % row_block == 0);
            if !ok {
                return Err(format!(
                    "{} needs a matrix of a multiple of {GROUP_ROWS} rows and of {row_block} \
                     columns, shape is {shape:?}",
                    self.name()
                ));
            }
        }
        let bl = self.block_len() as u64;
        if bl > 1 && !interleaved {
            let last = shape.last().copied().unwrap_or(1);
            if last % bl != 0 {
                return Err(format!(
                    "{} needs the last dimension to be a multiple of {bl}, shape is {shape:?}",
                    self.name()
                ));
            }
        }
        (elements / bl)
            .checked_mul(self.block_bytes() as u64)
            .ok_or_else(|| format!("shape {shape:?} overflows 64 bits"))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_ggml_ids() {
        for d in DType::ALL {
            assert_eq!(DType::from_id(d.id()), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::Q8_0.id(), 8);
        assert_eq!(DType::BF16.id(), 30);
        assert_eq!(DType::from_id(3), None);
        assert_eq!(DType::Q4_K.id(), 12);
        assert_eq!(DType::Q6_K.id(), 14);
        assert_eq!(DType::Q5_0.id(), 6);
        assert_eq!(DType::Q2_K.id(), 10);
        assert_eq!(DType::Q3_K.id(), 11);
        assert_eq!(DType::IQ4_NL.id(), 20);
        assert_eq!(DType::IQ4_XS.id(), 23);
        assert!(DType::ALL.windows(2).all(|w| w[0].id() < w[1].id()));
    }

    #[test]
    fn byte_lengths() {
        assert_eq!(DType::F32.byte_len(&[3, 5]), Ok(60));
        assert_eq!(DType::BF16.byte_len(&[7]), Ok(14));
        assert_eq!(DType::Q8_0.byte_len(&[2, 64]), Ok(4 * 34));
        assert_eq!(DType::Q4_0.byte_len(&[1, 32]), Ok(18));
        assert!(DType::Q4_0.byte_len(&[1, 33]).is_err());
        assert!(DType::F32.byte_len(&[u64::MAX, 2]).is_err());
        assert_eq!(DType::Q4_0.bits_per_weight(), 4.5);
        assert_eq!(DType::Q8_0.bits_per_weight(), 8.5);
        assert_eq!(DType::Q4_0x16.byte_len(&[32, 64]), Ok(64 * 18));
        assert_eq!(DType::Q4_0x16.bits_per_weight(), 4.5);
        assert!(DType::Q4_0x16.byte_len(&[8, 64]).is_err());
        assert!(DType::Q4_0x16.byte_len(&[16, 48]).is_err());
        assert!(DType::Q4_0x16.byte_len(&[512]).is_err());
        assert!(DType::Q4_0x16.byte_len(&[2, 16, 32]).is_err());
        assert_eq!(DType::IQ4_NLx16.byte_len(&[32, 64]), Ok(64 * 18));
        assert_eq!(DType::IQ4_NLx16.bits_per_weight(), 4.5);
        assert!(DType::IQ4_NLx16.byte_len(&[8, 64]).is_err());
        assert!(DType::IQ4_NLx16.byte_len(&[512]).is_err());
        assert_eq!(DType::IQ4_XSx16.byte_len(&[32, 512]), Ok(64 * 136));
        assert_eq!(DType::IQ4_XSx16.bits_per_weight(), 4.25);
        assert!(DType::IQ4_XSx16.byte_len(&[8, 512]).is_err());
        assert!(DType::IQ4_XSx16.byte_len(&[16, 288]).is_err());
        assert!(DType::IQ4_XSx16.byte_len(&[4096]).is_err());
        assert_eq!(DType::Q4_K.byte_len(&[2, 512]), Ok(4 * 144));
        assert_eq!(DType::Q5_K.bits_per_weight(), 5.5);
        assert_eq!(DType::Q6_K.bits_per_weight(), 6.5625);
        assert_eq!(DType::Q5_0.bits_per_weight(), 5.5);
        assert_eq!(DType::Q5_1.bits_per_weight(), 6.0);
        assert!(DType::Q6_K.byte_len(&[2, 576]).is_err());
        assert_eq!(DType::Q5_0.byte_len(&[1, 576]), Ok(18 * 22));
        assert_eq!(DType::Q2_K.bits_per_weight(), 2.625);
        assert_eq!(DType::Q3_K.bits_per_weight(), 3.4375);
        assert_eq!(DType::IQ4_NL.bits_per_weight(), 4.5);
        assert_eq!(DType::IQ4_XS.bits_per_weight(), 4.25);
        assert_eq!(DType::IQ4_XS.byte_len(&[2, 512]), Ok(4 * 136));
        assert!(DType::Q3_K.byte_len(&[1, 32]).is_err());
    }

    #[test]
    fn q4_0_matrices_of_whole_row_groups_are_stored_interleaved() {
        assert_eq!(DType::Q4_0.storage_for(&[48, 64]), DType::Q4_0x16);
        assert_eq!(DType::Q4_0.storage_for(&[40, 64]), DType::Q4_0);
        assert_eq!(DType::Q4_0.storage_for(&[0, 64]), DType::Q4_0);
        assert_eq!(DType::Q4_0.storage_for(&[4096]), DType::Q4_0);
        assert_eq!(DType::Q8_0.storage_for(&[48, 64]), DType::Q8_0);
        assert_eq!(DType::Q4_0x16.logical(), DType::Q4_0);
        assert_eq!(DType::F16.logical(), DType::F16);
        assert_eq!(DType::Q4_0x16.id(), 1002);
        assert_eq!(DType::IQ4_NL.storage_for(&[48, 64]), DType::IQ4_NLx16);
        assert_eq!(DType::IQ4_NL.storage_for(&[40, 64]), DType::IQ4_NL);
        assert_eq!(DType::IQ4_NL.storage_for(&[4096]), DType::IQ4_NL);
        assert_eq!(DType::IQ4_NLx16.logical(), DType::IQ4_NL);
        assert_eq!(DType::IQ4_NLx16.id(), 1020);
        assert_eq!(DType::IQ4_XS.storage_for(&[48, 512]), DType::IQ4_XSx16);
        assert_eq!(DType::IQ4_XS.storage_for(&[40, 512]), DType::IQ4_XS);
        assert_eq!(DType::IQ4_XS.storage_for(&[48, 4096]), DType::IQ4_XSx16);
        assert_eq!(DType::IQ4_XSx16.logical(), DType::IQ4_XS);
        assert_eq!(DType::IQ4_XSx16.id(), 1023);
        assert_eq!(DType::Q5_0.interleaved(), None);
    }

    #[test]
    fn storage_layouts_round_trip_and_plain_ones_are_untouched() {
        let cols = 64;
        let rows = 2 * crate::blocks::GROUP_ROWS;
        let blocks: Vec<u8> = (0..rows * cols / QK * 18)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for x in [DType::Q4_0x16, DType::IQ4_NLx16] {
            let stored = x.to_storage(cols, &blocks);
            assert_ne!(stored.as_ref(), blocks.as_slice());
            assert_eq!(x.from_storage(cols, &stored).as_ref(), blocks.as_slice());
            assert_eq!(x.rows_per_unit(), crate::blocks::GROUP_ROWS);
        }
        let k_cols = 2 * QK_K;
        let super_blocks: Vec<u8> = (0..rows * k_cols / QK_K * 136)
            .map(|i| (i * 37 % 253) as u8)
            .collect();
        {
            let x = DType::IQ4_XSx16;
            let stored = x.to_storage(k_cols, &super_blocks);
            assert_eq!(stored.len(), super_blocks.len());
            assert_ne!(stored.as_ref(), super_blocks.as_slice());
            assert_eq!(
                x.from_storage(k_cols, &stored).as_ref(),
                super_blocks.as_slice()
            );
            assert_eq!(x.rows_per_unit(), crate::blocks::GROUP_ROWS);
        }
        for d in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_0,
            DType::IQ4_NL,
            DType::IQ4_XS,
        ] {
            assert!(matches!(
                d.to_storage(cols, &blocks),
                std::borrow::Cow::Borrowed(_)
            ));
            assert!(matches!(
                d.from_storage(cols, &blocks),
                std::borrow::Cow::Borrowed(_)
            ));
            assert_eq!(d.rows_per_unit(), 1);
        }
        assert_eq!(DType::Q4_0x16.rows_per_unit(), crate::blocks::GROUP_ROWS);
    }
}
