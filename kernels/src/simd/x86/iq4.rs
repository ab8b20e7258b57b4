//! IQ4 index bytes unpacked to offset codes (grid value plus 128) with `pshufb`, for the lanes
//! kernels' row unpacking ([`crate::lanes::unpack_iq4_16`]).
//!
//! The rows of a prefill product are unpacked once per product, but at prompts of a hundred
//! tokens that is still a sixth of an IQ4_XS product's time when each byte is a table lookup:
//! one 16-byte lookup per nibble half does the same work in a handful of instructions.

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

/// Sixteen IQ4 index bytes (`qs`) as 32 offset codes: weight `j` (the low nibble of byte `j`)
/// in `lo[j]`, weight `j + 16` (its high nibble) in `hi[j]`. Panics unless all three hold at
/// least sixteen bytes; the caller checks [`available`].
#[inline]
pub(crate) fn unpack16(qs: &[u8], lo: &mut [u8], hi: &mut [u8]) {
    assert!(
        qs.len() >= 16 && lo.len() >= 16 && hi.len() >= 16,
        "unpack16: short slice"
    );
    debug_assert!(available());

    #[target_feature(enable = "ssse3")]
    unsafe fn run(qs: &[u8], lo: &mut [u8], hi: &mut [u8]) {
        // SAFETY: SSSE3 enabled by this function's attribute; each slice holds at least 16
        // bytes (checked by the caller), read and written unaligned.
        unsafe {
            let grid = _mm_loadu_si128(OFFSET_GRID.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0f);
            let raw = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
            let l = _mm_shuffle_epi8(grid, _mm_and_si128(raw, m4));
            let h = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16::<4>(raw), m4));
            _mm_storeu_si128(lo.as_mut_ptr() as *mut __m128i, l);
            _mm_storeu_si128(hi.as_mut_ptr() as *mut __m128i, h);
        }
    }
    // SAFETY: the caller runs this only where `available()` (SSSE3); lengths checked above.
    unsafe { run(qs, lo, hi) }
}
