//! The AVX-512 K-quant lanes kernel: one super-block of four weight rows against sixteen or
//! thirty-two tokens, a token per 32-bit lane (see [`crate::klanes`] for the layouts).

use std::arch::x86_64::*;

use crate::klanes::{KKind, KLaneBlock, KLaneRow, KSUBS};
use crate::lanes::LanesAcc;
use crate::tile::TILE_ROWS;

/// [`crate::reference::klanes::ktile_ref`] for `G` groups of sixteen tokens (one or two), sub-blocks of
/// `SUB` codes ([`KKind::sub`]), with or without a separate mins sum (`AFFINE`).
///
/// Per sub-block, `SUB / 4` `vpdpbusd` give each (row, token) its exact integer dot, one
/// `vpmulld` by the broadcast scale and an add fold it into the block's sum; eight `vpdpwssd`
/// over the activations' sub-block sums give the mins (or the offset term, into the sum).
/// The float term is then formed with the reference's multiplies and subtraction, in its
/// order (no FMA), and added to `acc`: every lane is [`crate::reference::klanes::ktile_ref`]'s bits.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile<const G: usize, const SUB: usize, const AFFINE: bool>(
    rows: &[&KLaneRow; TILE_ROWS],
    x: [&KLaneBlock; G],
    acc: &mut LanesAcc,
) {
    const R: usize = TILE_ROWS;
    let zero = _mm512_setzero_si512();
    let mut isum = [[zero; G]; R];
    for s in 0..KSUBS * 16 / SUB {
        let mut dot = [[zero; G]; R];
        for q in s * SUB / 4..(s + 1) * SUB / 4 {
            // SAFETY: `KLaneBlock` is 64-byte aligned and each `codes[q]` is one whole 64-byte
            // vector; q < 64.
            let xv: [__m512i; G] = std::array::from_fn(|g| unsafe {
                _mm512_load_si512(x[g].codes[q].as_ptr() as *const __m512i)
            });
            for r in 0..R {
                // SAFETY: codes 4q..4q + 4 of the row's 256; read unaligned.
                let word =
                    unsafe { (rows[r].codes.as_ptr().add(4 * q) as *const i32).read_unaligned() };
                let w = _mm512_set1_epi32(word);
                for g in 0..G {
                    dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], w, xv[g]);
                }
            }
        }
        for r in 0..R {
            let sc = _mm512_set1_epi32(rows[r].scales[s]);
            for g in 0..G {
                isum[r][g] = _mm512_add_epi32(isum[r][g], _mm512_mullo_epi32(dot[r][g], sc));
            }
        }
    }
    let mut mins = [[zero; G]; R];
    for k in 0..KSUBS / 2 {
        // SAFETY: each `bsums[k]` is one whole, aligned 64-byte vector.
        let bv: [__m512i; G] = std::array::from_fn(|g| unsafe {
            _mm512_load_si512(x[g].bsums[k].as_ptr() as *const __m512i)
        });
        for r in 0..R {
            let pw = _mm512_set1_epi32(crate::klanes::pair_word(rows[r].pairs[k]));
            for g in 0..G {
                if AFFINE {
                    mins[r][g] = _mm512_dpwssd_epi32(mins[r][g], pw, bv[g]);
                } else {
                    isum[r][g] = _mm512_dpwssd_epi32(isum[r][g], pw, bv[g]);
                }
            }
        }
    }
    for g in 0..G {
        // SAFETY: `dx` is one whole, aligned 64-byte vector.
        let dx = unsafe { _mm512_load_ps(x[g].dx.as_ptr()) };
        for r in 0..R {
            let dxd = _mm512_mul_ps(dx, _mm512_set1_ps(rows[r].d));
            let mut term = _mm512_mul_ps(dxd, _mm512_cvtepi32_ps(isum[r][g]));
            if AFFINE {
                let dxm = _mm512_mul_ps(dx, _mm512_set1_ps(rows[r].dmin));
                term = _mm512_sub_ps(term, _mm512_mul_ps(dxm, _mm512_cvtepi32_ps(mins[r][g])));
            }
            // SAFETY: `acc[r][g]` is 16 readable, writable f32.
            unsafe {
                let a = _mm512_loadu_ps(acc[r][g].as_ptr());
                _mm512_storeu_ps(acc[r][g].as_mut_ptr(), _mm512_add_ps(a, term));
            }
        }
    }
}

/// [`crate::klanes::KLanesFn`] at AVX-512.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn ktile(
    kind: KKind,
    rows: &[&KLaneRow; TILE_ROWS],
    x0: &KLaneBlock,
    x1: Option<&KLaneBlock>,
    acc: &mut LanesAcc,
) {
    // SAFETY: features enabled (caller contract); the layouts are fixed-size types.
    unsafe {
        match (kind, x1) {
            (KKind::Affine32, Some(x1)) => tile::<2, 32, true>(rows, [x0, x1], acc),
            (KKind::Affine32, None) => tile::<1, 32, true>(rows, [x0], acc),
            (KKind::Affine16, Some(x1)) => tile::<2, 16, true>(rows, [x0, x1], acc),
            (KKind::Affine16, None) => tile::<1, 16, true>(rows, [x0], acc),
            (KKind::Offset16, Some(x1)) => tile::<2, 16, false>(rows, [x0, x1], acc),
            (KKind::Offset16, None) => tile::<1, 16, false>(rows, [x0], acc),
            // `vpdpbusd` takes unsigned bytes up to 255: IQ4_XS's codes need no splitting.
            (KKind::Offset32, Some(x1)) => tile::<2, 32, false>(rows, [x0, x1], acc),
            (KKind::Offset32, None) => tile::<1, 32, false>(rows, [x0], acc),
        }
    }
}
