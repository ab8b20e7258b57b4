//! Float primitives and the generic float kernels built on them.

use half::{bf16, f16};

/// One ISA's f32 vector primitives.
///
/// # Safety
/// Every method requires the implementing ISA's features to be enabled in the caller (they are
/// only called from `#[target_feature]` functions of that ISA). Pointer arguments must be valid
/// for reading or writing `LANES` elements.
pub(crate) unsafe trait F32Simd {
    /// f32 lanes per vector.
    const LANES: usize;
    /// The vector type.
    type V: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn load_f16(p: *const f16) -> Self::V;
    unsafe fn load_bf16(p: *const bf16) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a·b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Sum of the lanes.
    unsafe fn reduce(v: Self::V) -> f32;
}

/// A weight element type the float kernels can load as f32 vectors.
pub(crate) trait Weight: Copy {
    /// # Safety
    /// As [`F32Simd`]: `p` valid for `S::LANES` elements, the ISA's features enabled.
    unsafe fn load<S: F32Simd>(p: *const Self) -> S::V;
    fn to_f32(self) -> f32;
}

impl Weight for f32 {
    #[inline(always)]
    unsafe fn load<S: F32Simd>(p: *const f32) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Weight for f16 {
    #[inline(always)]
    unsafe fn load<S: F32Simd>(p: *const f16) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::load_f16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Weight for bf16 {
    #[inline(always)]
    unsafe fn load<S: F32Simd>(p: *const bf16) -> S::V {
        // SAFETY: forwarded contract.
        unsafe { S::load_bf16(p) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// `R` weight rows against `T` activation rows: two accumulators per (row, token),
/// `2·LANES` elements per step, the tail (fewer than `2·LANES` elements) in scalar order after
/// the reduction. Each weight vector is loaded once per step and used for all `T` tokens.
/// A (row, token) result depends only on that row and that token, never on the rest of the
/// tile, so every `R`, `T` gives the same bits.
///
/// # Safety
/// The ISA's features are enabled and every row and token slice has the same length.
#[inline(always)]
pub(crate) unsafe fn tile<S: F32Simd, W: Weight, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[f32]; T],
) -> [[f32; R]; T] {
    let n = xs[0].len();
    let step = 2 * S::LANES;
    let main = n - n % step;
    // SAFETY: features enabled (caller contract).
    let mut acc0 = [[unsafe { S::zero() }; R]; T];
    let mut acc1 = acc0;
    let mut i = 0;
    while i < main {
        // SAFETY: i + 2·LANES <= main <= n, and every slice has n elements (caller contract).
        unsafe {
            let mut x0 = [S::zero(); T];
            let mut x1 = [S::zero(); T];
            for t in 0..T {
                x0[t] = S::load(xs[t].as_ptr().add(i));
                x1[t] = S::load(xs[t].as_ptr().add(i + S::LANES));
            }
            for r in 0..R {
                let wp = rows[r].as_ptr();
                if T == 1 {
                    prefetch_ahead(wp.add(i), step * std::mem::size_of::<W>());
                }
                let w0 = W::load::<S>(wp.add(i));
                let w1 = W::load::<S>(wp.add(i + S::LANES));
                for t in 0..T {
                    acc0[t][r] = S::fma(w0, x0[t], acc0[t][r]);
                    acc1[t][r] = S::fma(w1, x1[t], acc1[t][r]);
                }
            }
        }
        i += step;
    }
    let mut out = [[0.0; R]; T];
    for t in 0..T {
        for r in 0..R {
            // SAFETY: features enabled (caller contract).
            let mut s = unsafe { S::reduce(S::add(acc0[t][r], acc1[t][r])) };
            for (w, x) in rows[r][main..].iter().zip(&xs[t][main..]) {
                s += w.to_f32() * x;
            }
            out[t][r] = s;
        }
    }
    out
}

/// How far ahead of the weights being read the kernels ask for the cache lines they will read
/// next. A tile reads several consecutive weight rows at once, which the hardware prefetchers,
/// working within 4 KiB pages, follow poorly: with rows of a few hundred bytes to a few
/// kilobytes, a matrix–vector product streamed at 6–9 GB/s without software prefetching and at
/// 15–21 GB/s with it (AMD EPYC, 64 KiB ahead into L2; nearer distances, or L1 as the target,
/// did worse).
pub(crate) const PREFETCH_BYTES: usize = 64 * 1024;

/// Prefetch the cache lines `PREFETCH_BYTES` past each line of `p..p+len` into L2. A prefetch
/// never faults, so the address may lie past the end of the data (it is computed with wrapping
/// arithmetic and never dereferenced).
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(p: *const T, len: usize) {
    let p = p.cast::<i8>().wrapping_add(PREFETCH_BYTES);
    let mut off = 0;
    while off < len {
        // SAFETY: `_mm_prefetch` is SSE (baseline x86-64) and only hints the cache; it does
        // not access memory architecturally, so any address is allowed.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                p.wrapping_add(off),
            )
        };
        off += 64;
    }
}

/// `y += alpha·x`.
///
/// # Safety
/// The ISA's features are enabled and `x.len() == y.len()`.
#[inline(always)]
pub(crate) unsafe fn axpy<S: F32Simd>(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let main = n - n % S::LANES;
    let mut i = 0;
    // SAFETY: features enabled; i + LANES <= main <= n = y.len().
    unsafe {
        let a = S::splat(alpha);
        while i < main {
            let v = S::fma(a, S::load(x.as_ptr().add(i)), S::load(y.as_ptr().add(i)));
            S::store(y.as_mut_ptr().add(i), v);
            i += S::LANES;
        }
    }
    for (y, x) in y[main..].iter_mut().zip(&x[main..]) {
        *y += alpha * x;
    }
}

/// RMSNorm with a vector sum of squares; the scaling is element-wise (same rounding as the
/// reference), so only the sum's order differs.
///
/// # Safety
/// The ISA's features are enabled and `x`, `weight`, `out` have equal lengths.
#[inline(always)]
pub(crate) unsafe fn rmsnorm<S: F32Simd>(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    // SAFETY: forwarded contract (x against itself has equal lengths).
    let ss = unsafe { tile::<S, f32, 1, 1>(&[x], &[x]) }[0][0];
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}
