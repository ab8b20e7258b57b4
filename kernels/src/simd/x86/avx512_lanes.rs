//! The AVX-512 lanes kernel: four weight rows against sixteen or thirty-two tokens, a token per
//! 32-bit lane (see [`crate::lanes`] for the layouts).

use std::arch::x86_64::*;

use crate::lanes::{LaneBlock, LanesAcc};
use crate::tile::TILE_ROWS;

/// `acc[r][g][t] += Σ_b (Σ_j codes[r][b][j]·x[g][b][t][j] + corr[g][b][t]) · (dw[r][b]·dx[g][b][t])`
/// for `G` groups of sixteen tokens (one or two).
///
/// Each block's integer sum is exact, and the float operations are the scalar reference's,
/// in its order: `s + isum · (d_w·d_x)` block after block, a multiply and an add each (no FMA).
/// So every lane is bit for bit [`crate::reference::dot_q8_0_q8_0_ref`] or
/// [`crate::reference::dot_q4_0_q8_0_ref`] of its row and token, whether the blocks come in
/// one call or several. With two groups each broadcast weight word feeds two `vpdpbusd`, and
/// the eight integer sums are independent chains (four were too few to cover the
/// instruction's latency).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled; every `x[g]` holds the same number of blocks, `codes[r]`
/// holds `32 · x[0].len()` bytes and `dw[r]` `x[0].len()` scales for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn tile<const G: usize>(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: [&[LaneBlock]; G],
    acc: &mut LanesAcc,
) {
    const R: usize = TILE_ROWS;
    let mut a = [[_mm512_setzero_ps(); G]; R];
    for (a, acc) in a.iter_mut().zip(acc.iter()) {
        for (a, acc) in a.iter_mut().zip(acc) {
            // SAFETY: `acc[r][g]` is 16 readable f32; features enabled.
            *a = unsafe { _mm512_loadu_ps(acc.as_ptr()) };
        }
    }
    for b in 0..x[0].len() {
        // SAFETY: `LaneBlock` is 64-byte aligned and its fields are whole 64-byte vectors;
        // every group holds x[0].len() blocks and row r's codes 32·nb bytes and its scales nb
        // (caller contract), b < nb.
        unsafe {
            let corr: [__m512i; G] = std::array::from_fn(|g| {
                _mm512_load_si512(x[g].get_unchecked(b).corr.as_ptr() as *const __m512i)
            });
            let mut isum = [corr; R];
            for q in 0..QK_GROUPS {
                let xv: [__m512i; G] = std::array::from_fn(|g| {
                    _mm512_load_si512(x[g].get_unchecked(b).codes[q].as_ptr() as *const __m512i)
                });
                for r in 0..R {
                    let p = codes[r].as_ptr().add(b * 32 + 4 * q) as *const i32;
                    let w = _mm512_set1_epi32(p.read_unaligned());
                    for g in 0..G {
                        isum[r][g] = _mm512_dpbusd_epi32(isum[r][g], w, xv[g]);
                    }
                }
            }
            for g in 0..G {
                let dx = _mm512_load_ps(x[g].get_unchecked(b).dx.as_ptr());
                for r in 0..R {
                    let scale = _mm512_mul_ps(_mm512_set1_ps(*dw[r].get_unchecked(b)), dx);
                    let term = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r][g]), scale);
                    a[r][g] = _mm512_add_ps(a[r][g], term);
                }
            }
        }
    }
    for r in 0..R {
        for g in 0..G {
            // SAFETY: `acc[r][g]` is 16 writable f32; features enabled.
            unsafe { _mm512_storeu_ps(acc[r][g].as_mut_ptr(), a[r][g]) };
        }
    }
}

/// Groups of four codes in a block.
const QK_GROUPS: usize = 8;
