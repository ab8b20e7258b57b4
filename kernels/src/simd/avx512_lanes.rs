//! The AVX-512 lanes kernel: four weight rows against sixteen tokens, a token per 32-bit lane
//! (see [`crate::lanes`] for the layouts).

use std::arch::x86_64::*;

use crate::dispatch::TILE_ROWS;
use crate::lanes::{LaneBlock, Lanes, LANES};

/// `out[r][t] = Σ_b (Σ_j codes[r][b][j]·x[b][t][j] + corr[b][t]) · (dw[r][b]·dx[b][t])`.
///
/// Each block's integer sum is exact, and the float operations are the scalar reference's,
/// in its order: `s + isum · (d_w·d_x)` block after block, a multiply and an add each (no FMA).
/// So every lane is bit for bit [`crate::reference::dot_q8_0_q8_0_ref`] or
/// [`crate::reference::dot_q4_0_q8_0_ref`] of its row and token.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled; `codes[r]` holds `32 · x.len()` bytes and `dw[r]`
/// `x.len()` scales for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn tile(
    codes: &[&[u8]; TILE_ROWS],
    dw: &[&[f32]; TILE_ROWS],
    x: &[LaneBlock],
) -> Lanes {
    const R: usize = TILE_ROWS;
    let mut acc = [_mm512_setzero_ps(); R];
    for (b, xb) in x.iter().enumerate() {
        // SAFETY: `LaneBlock` is 64-byte aligned and its fields are whole 64-byte vectors;
        // row r's codes hold 32·nb bytes and its scales nb (caller contract), b < nb.
        unsafe {
            let corr = _mm512_load_si512(xb.corr.as_ptr() as *const __m512i);
            let mut isum = [corr; R];
            for g in 0..QK_GROUPS {
                let xv = _mm512_load_si512(xb.codes[g].as_ptr() as *const __m512i);
                for r in 0..R {
                    let p = codes[r].as_ptr().add(b * 32 + 4 * g) as *const i32;
                    let w = _mm512_set1_epi32(p.read_unaligned());
                    isum[r] = _mm512_dpbusd_epi32(isum[r], w, xv);
                }
            }
            let dx = _mm512_load_ps(xb.dx.as_ptr());
            for r in 0..R {
                let scale = _mm512_mul_ps(_mm512_set1_ps(*dw[r].get_unchecked(b)), dx);
                let term = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), scale);
                acc[r] = _mm512_add_ps(acc[r], term);
            }
        }
    }
    let mut out = [[0.0; LANES]; R];
    for r in 0..R {
        // SAFETY: `out[r]` is 16 writable f32; features enabled.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
    out
}

/// `out[r][t] = Σ_c w[r][c]·x[c][t]` for float weights widened to f32: a broadcast weight times
/// sixteen tokens per FMA, even and odd columns in two accumulators (eight independent FMA
/// chains for four rows) added at the end.
///
/// # Safety
/// AVX-512 F is enabled and every row holds `x.len()` weights.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn tile_float(w: &[&[f32]; TILE_ROWS], x: &[[f32; LANES]]) -> Lanes {
    const R: usize = TILE_ROWS;
    let mut even = [_mm512_setzero_ps(); R];
    let mut odd = [_mm512_setzero_ps(); R];
    let cols = x.len();
    let mut c = 0;
    while c + 1 < cols {
        // SAFETY: c + 1 < cols, the length of x and of every row (caller contract);
        // `[f32; 16]` rows of x are 64 readable bytes.
        unsafe {
            let x0 = _mm512_loadu_ps(x.get_unchecked(c).as_ptr());
            let x1 = _mm512_loadu_ps(x.get_unchecked(c + 1).as_ptr());
            for r in 0..R {
                let wr = w[r].as_ptr().add(c);
                even[r] = _mm512_fmadd_ps(_mm512_set1_ps(*wr), x0, even[r]);
                odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(*wr.add(1)), x1, odd[r]);
            }
        }
        c += 2;
    }
    if c < cols {
        // SAFETY: c < cols (see above).
        unsafe {
            let x0 = _mm512_loadu_ps(x.get_unchecked(c).as_ptr());
            for r in 0..R {
                let wc = *w[r].get_unchecked(c);
                even[r] = _mm512_fmadd_ps(_mm512_set1_ps(wc), x0, even[r]);
            }
        }
    }
    let mut out = [[0.0; LANES]; R];
    for r in 0..R {
        // SAFETY: `out[r]` is 16 writable f32; features enabled.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_add_ps(even[r], odd[r])) };
    }
    out
}

/// Groups of four codes in a block.
const QK_GROUPS: usize = 8;
