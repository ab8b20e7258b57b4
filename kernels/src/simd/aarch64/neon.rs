//! The aarch64 NEON tier: 4-lane float kernels and 8-bit block dots.
//!
//! NEON is part of the aarch64 baseline, so this tier is available on every aarch64 CPU.
//! The float dots keep four accumulators (16 elements per step) and finish the tail in the
//! reference's order; f16 weights are widened with integer operations (exact for every bit
//! pattern, subnormals included), because the half-precision vector types are not stable in
//! Rust. The block dots compute each block's integer sum exactly (`vmull_s8` + pairwise
//! widening adds) and accumulate `isum · (d_w·d_x)` in the reference's order, so they equal
//! the reference bit for bit. The tiles call the dots once per (row, token): a (row, token)
//! result never depends on the rest of the tile, as in every tier.
//!
//! The weighted sum (attention's `P·V` for one token) keeps its output rows in registers
//! across the keys with the reference axpy's multiply-then-add (this tier's axpy is the
//! reference), so it has the reference's bits.
//!
//! The Q5_0, Q5_1 and K-quant tiles are [`super::kquant`]'s; [`table`] takes their
//! `dotprod` variant where the CPU has the extension.
//!
//! Only the matrix kernels, dots and the weighted sum are vectorized by hand here; softmax and
//! SiLU are [`crate::approx`]'s (its polynomial `exp`, vectorized by the compiler), and RMSNorm
//! and activation quantization are the scalar reference.

use std::arch::aarch64::*;

use half::{bf16, f16};
use kiln_format::{BlockQ4_0, BlockQ8_0};

use crate::isa::Isa;
use crate::reference::tile_ref;
use crate::table::{Kernels, SCALAR_TABLE};
use crate::tile::Tile;

/// f32 lanes per vector.
const LANES: usize = 4;
/// Elements per step of the float dots (four independent accumulators).
const STEP: usize = 4 * LANES;

/// How a weight element type becomes four f32 lanes.
trait NeonWeight: kiln_format::BlockType {
    /// # Safety
    /// `p` is valid for reading four elements; NEON enabled.
    unsafe fn load4(p: *const Self) -> float32x4_t;
    fn to_f32(self) -> f32;
}

impl NeonWeight for f32 {
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> float32x4_t {
        // SAFETY: four readable f32 (trait contract).
        unsafe { vld1q_f32(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl NeonWeight for bf16 {
    /// bf16 is the top half of an f32: widen to 32 bits and shift into place.
    #[inline(always)]
    unsafe fn load4(p: *const bf16) -> float32x4_t {
        // SAFETY: four readable bf16 = 8 bytes (trait contract); register-only otherwise.
        unsafe {
            let h = vld1_u16(p as *const u16);
            vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl NeonWeight for f16 {
    /// IEEE half to single: the exponent and mantissa bits moved up by 13 and scaled by
    /// 2^112 (the difference of the exponent biases) is exact for normal and subnormal
    /// values; infinities and NaNs (exponent all ones) get the f32 all-ones exponent; then
    /// the sign.
    #[inline(always)]
    unsafe fn load4(p: *const f16) -> float32x4_t {
        // SAFETY: four readable f16 = 8 bytes (trait contract); register-only otherwise.
        unsafe {
            let h = vmovl_u16(vld1_u16(p as *const u16));
            let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
            let em = vandq_u32(h, vdupq_n_u32(0x7fff));
            let shifted = vshlq_n_u32::<13>(em);
            let scaled = vmulq_f32(
                vreinterpretq_f32_u32(shifted),
                vdupq_n_f32(f32::from_bits(0x7780_0000)), // 2^112
            );
            let special = vcgeq_u32(em, vdupq_n_u32(0x7c00));
            let inf_nan = vorrq_u32(shifted, vdupq_n_u32(0x7f80_0000));
            let bits = vbslq_u32(special, inf_nan, vreinterpretq_u32_f32(scaled));
            vreinterpretq_f32_u32(vorrq_u32(bits, sign))
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// `Σ w[i]·x[i]`: four accumulators over 16-element steps, the tail in order.
///
/// # Safety
/// NEON enabled; `w.len() == x.len()`.
#[inline(always)]
unsafe fn dot<W: NeonWeight>(w: &[W], x: &[f32]) -> f32 {
    let n = x.len();
    let main = n - n % STEP;
    // SAFETY: every load is at an offset i + k·LANES + 4 <= main <= n of both slices.
    let mut s = unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i < main {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + k * LANES;
                *a = vfmaq_f32(
                    *a,
                    W::load4(w.as_ptr().add(o)),
                    vld1q_f32(x.as_ptr().add(o)),
                );
            }
            i += STEP;
        }
        vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ))
    };
    for (w, x) in w[main..].iter().zip(&x[main..]) {
        s += w.to_f32() * x;
    }
    s
}

/// The exact integer dot of two blocks of 32 signed codes (weights already centred).
///
/// # Safety
/// NEON enabled (register-only).
#[inline(always)]
unsafe fn isum(w_lo: int8x16_t, w_hi: int8x16_t, x: &BlockQ8_0) -> i32 {
    // SAFETY: x.qs is 32 readable bytes; register-only otherwise.
    unsafe {
        let x_lo = vld1q_s8(x.qs.as_ptr());
        let x_hi = vld1q_s8(x.qs.as_ptr().add(16));
        // |w·x| <= 128·127 fits i16; pairs of them are summed into i32 lanes.
        let mut acc = vpaddlq_s16(vmull_s8(vget_low_s8(w_lo), vget_low_s8(x_lo)));
        acc = vpadalq_s16(acc, vmull_high_s8(w_lo, x_lo));
        acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w_hi), vget_low_s8(x_hi)));
        acc = vpadalq_s16(acc, vmull_high_s8(w_hi, x_hi));
        vaddvq_s32(acc)
    }
}

/// A weight block type with an exact NEON integer dot against a Q8_0 block.
trait NeonBlock: kiln_format::BlockType {
    fn d(&self) -> f16;
    /// # Safety
    /// NEON enabled.
    unsafe fn isum(&self, x: &BlockQ8_0) -> i32;
}

impl NeonBlock for BlockQ8_0 {
    fn d(&self) -> f16 {
        self.d
    }
    #[inline(always)]
    unsafe fn isum(&self, x: &BlockQ8_0) -> i32 {
        // SAFETY: self.qs is 32 readable bytes; NEON enabled (trait contract).
        unsafe {
            let lo = vld1q_s8(self.qs.as_ptr());
            let hi = vld1q_s8(self.qs.as_ptr().add(16));
            isum(lo, hi, x)
        }
    }
}

impl NeonBlock for BlockQ4_0 {
    fn d(&self) -> f16 {
        self.d
    }
    /// Byte j holds weights j (low nibble) and j + 16 (high nibble), stored as `q + 8`.
    #[inline(always)]
    unsafe fn isum(&self, x: &BlockQ8_0) -> i32 {
        // SAFETY: self.qs is 16 readable bytes; NEON enabled (trait contract).
        unsafe {
            let v = vld1q_u8(self.qs.as_ptr());
            let eight = vdupq_n_s8(8);
            let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f))), eight);
            let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
            isum(lo, hi, x)
        }
    }
}

/// `Σ_blocks isum · (d_w·d_x)` in the reference's order (so its exact bits).
///
/// # Safety
/// NEON enabled; `w.len() == x.len()`.
#[inline(always)]
unsafe fn qdot<W: NeonBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
    w.iter().zip(x).fold(0.0, |s, (w, x)| {
        // SAFETY: NEON enabled (caller contract).
        let i = unsafe { w.isum(x) };
        s + i as f32 * (w.d().to_f32() * x.d.to_f32())
    })
}

/// Rows of `out` one weighted-sum block computes together: each vector of `v` it loads
/// serves all of them.
const WEIGHTED_ROWS: usize = 4;
/// Vectors per row of a weighted-sum block: `WEIGHTED_ROWS × 4` accumulators, 4 loaded
/// vectors and a broadcast probability fit the 32 registers.
const WEIGHTED_COLS: usize = 4;

/// `out[r][c] = Σ_j probs[r·stride + j]·v[j·width + c]` with the bits of this tier's axpy
/// (the reference's: a multiply then an add per element, no FMA) over `j = 0, 1, …` into
/// zeroed rows, each element summed in the same order. Blocks of up to `WEIGHTED_ROWS` rows ×
/// `WEIGHTED_COLS` vectors stay in registers across all keys; the last `width % 4` elements
/// of a row are the reference's scalar code.
///
/// # Safety
/// NEON enabled; lengths as [`crate::shape::weighted_sum_shape`] checks them.
#[inline(always)]
unsafe fn weighted_sum(probs: &[f32], stride: usize, v: &[f32], width: usize, out: &mut [f32]) {
    let rows = out.len() / width;
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(WEIGHTED_ROWS);
        let (p, o) = (&probs[r * stride..], &mut out[r * width..(r + n) * width]);
        // SAFETY: NEON enabled; rows r..r+n of the caller's checked shape, whose
        // probabilities start at p.
        unsafe {
            match n {
                1 => weighted_rows::<1>(p, stride, v, width, o),
                2 => weighted_rows::<2>(p, stride, v, width, o),
                3 => weighted_rows::<3>(p, stride, v, width, o),
                _ => weighted_rows::<WEIGHTED_ROWS>(p, stride, v, width, o),
            }
        }
        r += n;
    }
}

/// [`weighted_sum`] of `R` rows: blocks of `WEIGHTED_COLS` vectors, then single vectors, then
/// the tail.
///
/// # Safety
/// As [`weighted_sum`], with `out` holding exactly `R` rows.
#[inline(always)]
unsafe fn weighted_rows<const R: usize>(
    probs: &[f32],
    stride: usize,
    v: &[f32],
    width: usize,
    out: &mut [f32],
) {
    let main = width - width % LANES;
    let mut c = 0;
    while c + WEIGHTED_COLS * LANES <= main {
        // SAFETY: forwarded contract; columns c..c + 4·WEIGHTED_COLS lie within the row.
        unsafe { weighted_block::<R, WEIGHTED_COLS>(probs, stride, v, width, out, c) };
        c += WEIGHTED_COLS * LANES;
    }
    while c < main {
        // SAFETY: forwarded contract; columns c..c + 4 lie within the row.
        unsafe { weighted_block::<R, 1>(probs, stride, v, width, out, c) };
        c += LANES;
    }
    crate::simd::weighted_sum_tail(probs, stride, v, width, out, main, |x| x);
}

/// Columns `c..c + 4·C` of `R` rows of [`weighted_sum`]: `R × C` accumulators from zero, each
/// key's `C` vectors loaded once and multiplied by each row's probability, then added.
///
/// # Safety
/// As [`weighted_rows`], and `c + 4·C <= width`.
#[inline(always)]
unsafe fn weighted_block<const R: usize, const C: usize>(
    probs: &[f32],
    stride: usize,
    v: &[f32],
    width: usize,
    out: &mut [f32],
    c: usize,
) {
    let keys = v.len() / width;
    // SAFETY: v holds `keys` rows of `width` and out `R` rows, so every vector at column
    // c + 4·k < width of them is in bounds; row r's probabilities r·stride..r·stride + keys
    // lie in probs (the checked shape). Register-only otherwise.
    unsafe {
        let mut acc = [[vdupq_n_f32(0.0); C]; R];
        for j in 0..keys {
            let vp = v.as_ptr().add(j * width + c);
            let mut x = [vdupq_n_f32(0.0); C];
            for (k, x) in x.iter_mut().enumerate() {
                *x = vld1q_f32(vp.add(k * LANES));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let alpha = *probs.as_ptr().add(r * stride + j);
                for (a, &x) in acc.iter_mut().zip(&x) {
                    *a = vaddq_f32(*a, vmulq_n_f32(x, alpha));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let op = out.as_mut_ptr().add(r * width + c);
            for (k, &a) in acc.iter().enumerate() {
                vst1q_f32(op.add(k * LANES), a);
            }
        }
    }
}

// `neon` is in the aarch64 baseline, so these are plain functions: their `unsafe` blocks
// are sound on every aarch64 CPU, and each checks the lengths its kernel relies on.

fn float_dot<W: NeonWeight>(w: &[W], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: length mismatch");
    // SAFETY: NEON is always enabled on aarch64; lengths checked.
    unsafe { dot(w, x) }
}

fn quant_dot<W: NeonBlock>(w: &[W], x: &[BlockQ8_0]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot: block count mismatch");
    // SAFETY: NEON is always enabled on aarch64; lengths checked.
    unsafe { qdot(w, x) }
}

fn weighted(probs: &[f32], stride: usize, v: &[f32], width: usize, out: &mut [f32]) {
    crate::shape::weighted_sum_shape(probs, stride, v, width, out);
    // SAFETY: NEON is always enabled on aarch64; lengths checked.
    unsafe { weighted_sum(probs, stride, v, width, out) }
}

/// This tier's table; [`crate::kernels`] only calls it on aarch64. Two tables that differ only
/// in their Q5/K-quant tiles: the `dotprod` ones where the CPU has the extension, the plain
/// NEON ones otherwise.
pub(crate) fn table() -> &'static Kernels {
    static PLAIN: Kernels = Kernels {
        kq: super::kquant::PLAIN_TILES,
        ..BASE
    };
    static DOTPROD: Kernels = Kernels {
        kq: super::kquant::DOTPROD_TILES,
        ..BASE
    };
    if super::kquant::has_dotprod() {
        &DOTPROD
    } else {
        &PLAIN
    }
}

/// The kernels both tables share.
const BASE: Kernels = Kernels {
    isa: Isa::Neon,
    dot_f32: float_dot::<f32>,
    dot_f16_f32: float_dot::<f16>,
    dot_bf16_f32: float_dot::<bf16>,
    dot_q8_0_q8_0: quant_dot::<BlockQ8_0>,
    dot_q4_0_q8_0: quant_dot::<BlockQ4_0>,
    weighted_sum: weighted,
    tile_f32: Tile::new(
        |w, x, o| tile_ref(w, x, o, float_dot::<f32>),
        1,
        |w, x, o| tile_ref(w, x, o, float_dot::<f32>),
    ),
    tile_f16: Tile::new(
        |w, x, o| tile_ref(w, x, o, float_dot::<f16>),
        1,
        |w, x, o| tile_ref(w, x, o, float_dot::<f16>),
    ),
    tile_bf16: Tile::new(
        |w, x, o| tile_ref(w, x, o, float_dot::<bf16>),
        1,
        |w, x, o| tile_ref(w, x, o, float_dot::<bf16>),
    ),
    tile_q8_0: Tile::new(
        |w, x, o| tile_ref(w, x, o, quant_dot::<BlockQ8_0>),
        1,
        |w, x, o| tile_ref(w, x, o, quant_dot::<BlockQ8_0>),
    ),
    tile_q4_0: Tile::new(
        |w, x, o| tile_ref(w, x, o, quant_dot::<BlockQ4_0>),
        1,
        |w, x, o| tile_ref(w, x, o, quant_dot::<BlockQ4_0>),
    ),
    // NEON is baseline on aarch64, so the compiler vectorizes these as they stand.
    silu_mul: crate::approx::silu_mul,
    gelu_tanh_mul: crate::approx::gelu_tanh_mul,
    gelu: crate::approx::gelu,
    softmax_inplace: crate::approx::softmax_inplace,
    exp_sum: crate::approx::exp_sum,
    ..SCALAR_TABLE
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer widening of f16 equals `half`'s conversion on all 65 536 bit patterns
    /// (NaNs compared as NaNs).
    #[test]
    fn f16_widening_is_exact_for_every_bit_pattern() {
        for base in (0..=u16::MAX).step_by(4) {
            let h: [f16; 4] = std::array::from_fn(|i| f16::from_bits(base + i as u16));
            // SAFETY: four readable f16; NEON is always enabled on aarch64.
            let got = unsafe { f16::load4(h.as_ptr()) };
            let mut out = [0.0f32; 4];
            // SAFETY: four writable f32.
            unsafe { vst1q_f32(out.as_mut_ptr(), got) };
            for (g, h) in out.iter().zip(h) {
                let want = h.to_f32();
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "{:#06x}: got {g:e}, want {want:e}",
                    h.to_bits()
                );
            }
        }
    }
}
