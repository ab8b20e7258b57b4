//! IQ4 index bytes unpacked to offset codes (grid value plus 128) with `pshufb`, for the lanes
//! kernels' row unpacking ([`crate::lanes::unpack_iq4`]).
//!
//! The rows of a prefill product are unpacked once per product, but at prompts of a hundred
//! tokens that is still a sixth of an IQ4_XS product's time when each byte is a table lookup:
//! one 16-byte lookup per nibble half does the same work in a handful of instructions, and one
//! call takes a whole row's blocks.

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// The sixteen grid values plus 128: the unsigned codes the lanes kernels take.
const OFFSET_GRID: [u8; 16] = {
    let grid = kiln_format::iq4::IQ4_GRID;
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (grid[i] as u8) ^ 0x80;
        i += 1;
    }
    t
};

/// Whether this CPU has SSSE3 (`pshufb`), asked once.
pub(crate) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("ssse3"))
}

/// Each sixteen IQ4 index bytes of `chunks` as the next 32 offset codes of `out`: weight `j`
/// (the low nibble of byte `j`) in byte `j`, weight `j + 16` (its high nibble) in byte
/// `j + 16`; as many chunks as `out` has room for. One call takes a whole row's blocks (or a
/// super-block's), so the feature check and the call are paid once for all of them. The caller
/// checks [`available`].
#[inline]
pub(crate) fn unpack<'a>(chunks: impl Iterator<Item = &'a [u8; 16]>, out: &mut [u8]) {
    assert!(available(), "iq4::unpack without SSSE3");

    #[target_feature(enable = "ssse3")]
    unsafe fn run<'a>(chunks: impl Iterator<Item = &'a [u8; 16]>, out: &mut [u8]) {
        // SAFETY: SSSE3 enabled by this function's attribute; each chunk is 16 readable bytes
        // and each `o` 32 writable ones, read and written unaligned.
        unsafe {
            let grid = _mm_loadu_si128(OFFSET_GRID.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0f);
            for (q, o) in chunks.zip(out.chunks_exact_mut(32)) {
                let raw = _mm_loadu_si128(q.as_ptr() as *const __m128i);
                let l = _mm_shuffle_epi8(grid, _mm_and_si128(raw, m4));
                let h = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
                _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, l);
                _mm_storeu_si128(o.as_mut_ptr().add(16) as *mut __m128i, h);
            }
        }
    }
    // SAFETY: SSSE3 is available (checked above).
    unsafe { run(chunks, out) }
}
