//! Float primitives and the generic float kernels built on them.

use half::{bf16, f16};

use crate::lanes::{FloatAcc, FLOAT_ROWS, FLOAT_TILE};
use crate::stream::Hint;

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
    /// `reduce` of each of `v[..n]` (`n <= 16`; the rest of the result is unspecified), with
    /// the same bits as `reduce` gives each alone. An ISA that can reduce several vectors in
    /// fewer instructions than one at a time (AVX-512) overrides it.
    #[inline(always)]
    unsafe fn reduce_many(v: &[Self::V; 16], n: usize) -> [f32; 16] {
        let mut out = [0.0; 16];
        for (o, &v) in out.iter_mut().zip(&v[..n]) {
            // SAFETY: forwarded contract.
            *o = unsafe { Self::reduce(v) };
        }
        out
    }
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
/// tile, so every `R`, `T` gives the same bits (and so does [`rows16`]).
///
/// # Safety
/// The ISA's features are enabled, every row and token slice has the same length, and
/// `R·T <= 16`.
#[inline(always)]
pub(crate) unsafe fn tile<S: F32Simd, W: Weight, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[f32]; T],
) -> [[f32; R]; T] {
    // SAFETY: forwarded contract.
    let acc = unsafe { tile_sums::<S, W, R, T>(rows, xs) };
    // SAFETY: features enabled (caller contract).
    let mut v = [unsafe { S::zero() }; 16];
    for t in 0..T {
        v[t * R..(t + 1) * R].copy_from_slice(&acc[t]);
    }
    // SAFETY: features enabled (caller contract); R·T <= 16.
    let sums = unsafe { S::reduce_many(&v, R * T) };
    let mut out = [[0.0; R]; T];
    for t in 0..T {
        for r in 0..R {
            out[t][r] = add_tail(sums[t * R + r], rows[r], xs[t], S::LANES);
        }
    }
    out
}

/// Sixteen consecutive weight rows (`w`, `16 × x.len()`) against one token: the one-row,
/// one-token [`tile`] sixteen times over, its sixteen sums reduced together (cheaper than one
/// at a time where the ISA can) and written straight to the output. The same bits as [`tile`].
///
/// One row at a time, the weights are one sequential stream, which the hardware prefetchers
/// follow without help (see [`PREFETCH_BYTES`]): F16 decode of SmolLM2 on one thread ran at
/// 80 tok/s in four-row tiles with software prefetching and at 100 tok/s this way.
///
/// # Safety
/// The ISA's features are enabled and `w.len() == 16 * x.len()`.
///
/// Where the CPU's prefetchers run too short a distance ahead of one stream (Intel's), the
/// lines [`crate::stream::distances`]`().float_rows` bytes ahead are asked for as well.
#[inline(always)]
pub(crate) unsafe fn rows16<S: F32Simd, W: Weight>(w: &[W], x: &[f32]) -> [f32; 16] {
    let n = x.len();
    let sp = crate::stream::distances();
    let (ahead, hint) = (sp.float_rows, sp.hint.unwrap_or(Hint::T1));
    // SAFETY: features enabled (caller contract).
    let mut v = [unsafe { S::zero() }; 16];
    for (r, vr) in v.iter_mut().enumerate() {
        let row = &w[r * n..(r + 1) * n];
        // SAFETY: every row has x.len() elements; features enabled (caller contract).
        *vr = unsafe {
            if ahead == 0 {
                tile_sums::<S, W, 1, 1>(&[row], &[x])[0][0]
            } else {
                with_prefetch_hint!(hint, row_sums_prefetching::<S, W>(row, x, ahead))
            }
        };
    }
    // SAFETY: features enabled (caller contract).
    let mut sums = unsafe { S::reduce_many(&v, 16) };
    for (r, s) in sums.iter_mut().enumerate() {
        *s = add_tail(*s, &w[r * n..(r + 1) * n], x, S::LANES);
    }
    sums
}

/// [`rows16`] for `T` tokens: each of the sixteen rows one sequential stream, as there, each
/// weight vector loaded (and widened) once and multiplied into every token's accumulators.
/// Every (row, token) is the one-row, `T`-token [`tile`]'s, so the same bits as [`rows16`]
/// gives that token alone. As [`rows16`], it asks for the lines
/// [`crate::stream::distances`]`().float_rows` bytes ahead where that is set: a row at a time
/// here, since each row's FMAs for several tokens leave the loads sparse enough that the
/// hardware prefetchers alone fall behind (SmolLM2 F16, eight tokens: 34 ms a pass without).
///
/// # Safety
/// The ISA's features are enabled, every token slice has the same length and
/// `w.len() == 16 * xs[0].len()`.
#[inline(always)]
pub(crate) unsafe fn rows16_tokens<S: F32Simd, W: Weight, const T: usize>(
    w: &[W],
    xs: &[&[f32]; T],
) -> [[f32; 16]; T] {
    use std::arch::x86_64::{_MM_HINT_NTA, _MM_HINT_T0, _MM_HINT_T1, _MM_HINT_T2};
    let sp = crate::stream::distances();
    let ahead = sp.float_rows;
    // SAFETY: forwarded contract (each arm).
    unsafe {
        match sp.hint.unwrap_or(Hint::T1) {
            Hint::T0 => rows16_tokens_with::<S, W, T, _MM_HINT_T0>(w, xs, ahead),
            Hint::T1 => rows16_tokens_with::<S, W, T, _MM_HINT_T1>(w, xs, ahead),
            Hint::T2 => rows16_tokens_with::<S, W, T, _MM_HINT_T2>(w, xs, ahead),
            Hint::Nta => rows16_tokens_with::<S, W, T, _MM_HINT_NTA>(w, xs, ahead),
        }
    }
}

/// [`rows16_tokens`] with prefetch strategy `H` and distance `ahead` (0: none).
///
/// # Safety
/// As [`rows16_tokens`].
#[inline(always)]
unsafe fn rows16_tokens_with<S: F32Simd, W: Weight, const T: usize, const H: i32>(
    w: &[W],
    xs: &[&[f32]; T],
    ahead: usize,
) -> [[f32; 16]; T] {
    let n = xs[0].len();
    // SAFETY: features enabled (caller contract).
    let mut v = [[unsafe { S::zero() }; 16]; T];
    for r in 0..16 {
        let row = &w[r * n..(r + 1) * n];
        if ahead > 0 {
            prefetch_lines::<H, W>(row.as_ptr(), ahead, std::mem::size_of_val(row));
        }
        // SAFETY: every row and token has n elements; features enabled (caller contract).
        let acc = unsafe { tile_sums::<S, W, 1, T>(&[row], xs) };
        for t in 0..T {
            v[t][r] = acc[t][0];
        }
    }
    let mut out = [[0.0; 16]; T];
    for t in 0..T {
        // SAFETY: features enabled (caller contract).
        out[t] = unsafe { S::reduce_many(&v[t], 16) };
        for (r, s) in out[t].iter_mut().enumerate() {
            *s = add_tail(*s, &w[r * n..(r + 1) * n], xs[t], S::LANES);
        }
    }
    out
}

/// [`tile_sums`] for one row and one token, asking for the line `ahead` bytes past each one it
/// reads with `_mm_prefetch` strategy `H`: the same loads and FMAs in the same order, so the
/// same bits.
///
/// # Safety
/// The ISA's features are enabled and `w.len() == x.len()`.
#[inline(always)]
unsafe fn row_sums_prefetching<S: F32Simd, W: Weight, const H: i32>(
    w: &[W],
    x: &[f32],
    ahead: usize,
) -> S::V {
    let n = x.len();
    let step = 2 * S::LANES;
    let main = n - n % step;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // SAFETY: features enabled (caller contract).
    let (mut acc0, mut acc1) = unsafe { (S::zero(), S::zero()) };
    let mut i = 0;
    while i < main {
        prefetch_lines::<H, W>(wp.wrapping_add(i), ahead, step * size_of::<W>());
        // SAFETY: i + 2·LANES <= main <= n, and both slices have n elements (caller contract).
        unsafe {
            let x0 = S::load(xp.add(i));
            let x1 = S::load(xp.add(i + S::LANES));
            acc0 = S::fma(W::load::<S>(wp.add(i)), x0, acc0);
            acc1 = S::fma(W::load::<S>(wp.add(i + S::LANES)), x1, acc1);
        }
        i += step;
    }
    // SAFETY: features enabled (caller contract).
    unsafe { S::add(acc0, acc1) }
}

/// [`tile`]'s vector part: each (row, token)'s two accumulators added, not yet reduced.
///
/// # Safety
/// The ISA's features are enabled and every row and token slice has the same length.
#[inline(always)]
unsafe fn tile_sums<S: F32Simd, W: Weight, const R: usize, const T: usize>(
    rows: &[&[W]; R],
    xs: &[&[f32]; T],
) -> [[S::V; R]; T] {
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
                if T == 1 && R > 1 {
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
    for t in 0..T {
        for r in 0..R {
            // SAFETY: features enabled (caller contract).
            acc0[t][r] = unsafe { S::add(acc0[t][r], acc1[t][r]) };
        }
    }
    acc0
}

/// The float lanes kernel ([`crate::lanes::FloatLanesFn`]) over `R`-row by `V`-vector
/// register blocks: `FLOAT_ROWS / R` row blocks for each group of `V` token vectors, single
/// vectors for what is left of the tile's tokens. `R·V` accumulators, `V` token loads and `R`
/// broadcasts per column.
///
/// # Safety
/// The ISA's features are enabled, every row holds `x.len()` weights, `tokens <= FLOAT_TILE`,
/// `FLOAT_ROWS % R == 0` and `V·LANES <= FLOAT_TILE`.
#[inline(always)]
pub(crate) unsafe fn lanes<S: F32Simd, const R: usize, const V: usize>(
    w: &[&[f32]; FLOAT_ROWS],
    x: &[[f32; FLOAT_TILE]],
    tokens: usize,
    acc: &mut FloatAcc,
) {
    let vecs = tokens.div_ceil(S::LANES);
    let mut v0 = 0;
    while v0 < vecs {
        let wide = vecs - v0 >= V;
        for r0 in (0..FLOAT_ROWS).step_by(R) {
            // SAFETY: forwarded contract; rows r0..r0 + R < FLOAT_ROWS, lanes below
            // vecs·LANES <= FLOAT_TILE.
            unsafe {
                if wide {
                    lanes_block::<S, R, V>(w, r0, x, v0 * S::LANES, acc)
                } else {
                    lanes_block::<S, R, 1>(w, r0, x, v0 * S::LANES, acc)
                }
            }
        }
        v0 += if wide { V } else { 1 };
    }
}

/// Rows `r0..r0 + R` and lanes `l0..l0 + V·LANES` of [`lanes`]: the running sums loaded, one
/// FMA per (row, vector) per column, stored back.
///
/// # Safety
/// As [`lanes`], with `r0 + R <= FLOAT_ROWS` and `l0 + V·LANES <= FLOAT_TILE`.
#[inline(always)]
unsafe fn lanes_block<S: F32Simd, const R: usize, const V: usize>(
    w: &[&[f32]; FLOAT_ROWS],
    r0: usize,
    x: &[[f32; FLOAT_TILE]],
    l0: usize,
    acc: &mut FloatAcc,
) {
    // SAFETY: lanes l0..l0 + V·LANES of rows r0..r0 + R of acc and of every column of x are
    // in bounds (caller contract); every weight row holds x.len() values; features enabled.
    unsafe {
        let mut a = [[S::zero(); V]; R];
        for (r, a) in a.iter_mut().enumerate() {
            for (v, a) in a.iter_mut().enumerate() {
                *a = S::load(acc[r0 + r].as_ptr().add(l0 + v * S::LANES));
            }
        }
        let wp: [*const f32; R] = std::array::from_fn(|r| w[r0 + r].as_ptr());
        for (c, xc) in x.iter().enumerate() {
            let xp = xc.as_ptr().add(l0);
            let mut xv = [S::zero(); V];
            for (v, xv) in xv.iter_mut().enumerate() {
                *xv = S::load(xp.add(v * S::LANES));
            }
            for (r, a) in a.iter_mut().enumerate() {
                let b = S::splat(*wp[r].add(c));
                for (a, &xv) in a.iter_mut().zip(&xv) {
                    *a = S::fma(b, xv, *a);
                }
            }
        }
        for (r, a) in a.iter().enumerate() {
            for (v, &a) in a.iter().enumerate() {
                S::store(acc[r0 + r].as_mut_ptr().add(l0 + v * S::LANES), a);
            }
        }
    }
}

/// `sum` plus the products past the last full step of `2·lanes` elements, in scalar order.
#[inline(always)]
fn add_tail<W: Weight>(mut sum: f32, w: &[W], x: &[f32], lanes: usize) -> f32 {
    let main = x.len() - x.len() % (2 * lanes);
    for (w, x) in w[main..].iter().zip(&x[main..]) {
        sum += w.to_f32() * x;
    }
    sum
}

/// How far ahead of the weights being read the kernels ask for the cache lines they will read
/// next. A tile reads several consecutive weight rows at once, which the hardware prefetchers,
/// working within 4 KiB pages, follow poorly: with rows of a few hundred bytes to a few
/// kilobytes, a matrix–vector product streamed at 6–9 GB/s without software prefetching and at
/// 15–21 GB/s with it (AMD EPYC, 64 KiB ahead into L2; nearer distances, or L1 as the target,
/// did worse).
///
/// A single row read from start to end is another matter: the prefetchers follow it, and
/// software prefetching on top only costs (see [`rows16`]), so one-row tiles do without.
pub(crate) const PREFETCH_BYTES: usize = 64 * 1024;

/// Prefetch the cache lines `PREFETCH_BYTES` past each line of `p..p+len` into L2. A prefetch
/// never faults, so the address may lie past the end of the data (it is computed with wrapping
/// arithmetic and never dereferenced).
#[inline(always)]
pub(crate) fn prefetch_ahead<T>(p: *const T, len: usize) {
    prefetch_at(p, PREFETCH_BYTES, len)
}

/// Prefetch the cache lines `ahead` bytes past each line of `p..p+len` into L2 (see
/// [`prefetch_ahead`]).
#[inline(always)]
pub(crate) fn prefetch_at<T>(p: *const T, ahead: usize, len: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(p, ahead, len)
}

/// `$f::<G…, H>(args…)` with `H` the `_mm_prefetch` strategy of the [`Hint`] `$hint`: a
/// kernel generic over its prefetch level is instantiated once per level and the level is
/// picked once per call, never per cache line.
macro_rules! with_prefetch_hint {
    ($hint:expr, $f:ident $(::<$($g:ty),*>)? ($($arg:expr),* $(,)?)) => {{
        use std::arch::x86_64::{_MM_HINT_NTA, _MM_HINT_T0, _MM_HINT_T1, _MM_HINT_T2};
        match $hint {
            $crate::stream::Hint::T0 => $f::<$($($g,)*)? _MM_HINT_T0>($($arg),*),
            $crate::stream::Hint::T1 => $f::<$($($g,)*)? _MM_HINT_T1>($($arg),*),
            $crate::stream::Hint::T2 => $f::<$($($g,)*)? _MM_HINT_T2>($($arg),*),
            $crate::stream::Hint::Nta => $f::<$($($g,)*)? _MM_HINT_NTA>($($arg),*),
        }
    }};
}
pub(crate) use with_prefetch_hint;

/// Prefetch the cache lines `ahead` bytes past each line of `p..p+len` with `_mm_prefetch`
/// strategy `H` (the level the lines fill).
#[inline(always)]
pub(crate) fn prefetch_lines<const H: i32, T>(p: *const T, ahead: usize, len: usize) {
    let p = p.cast::<i8>().wrapping_add(ahead);
    let mut off = 0;
    while off < len {
        // SAFETY: `_mm_prefetch` is SSE (baseline x86-64) and only hints the cache; it does
        // not access memory architecturally, so any address is allowed.
        unsafe { std::arch::x86_64::_mm_prefetch::<H>(p.wrapping_add(off)) };
        off += 64;
    }
}

/// `o[i] = [m[0][i], m[1][i], m[2][i], m[3][i]]`: a 4 × 4 transpose as four unpacks and four
/// moves between halves (SSE, baseline x86-64). The lanes kernels' sums are token-major per
/// row; the outputs are row-major per token. Written element by element, LLVM kept it as
/// sixteen scalar stores, about a tenth of a MiniLM embedding's time at AVX2.
#[inline(always)]
pub(crate) fn transpose4(m: [&[f32; 4]; 4], o: [&mut [f32; 4]; 4]) {
    use std::arch::x86_64::*;
    let [o0, o1, o2, o3] = o;
    // SAFETY: SSE is baseline x86-64; every pointer is to a whole `[f32; 4]` (unaligned
    // loads and stores).
    unsafe {
        let r: [__m128; 4] = std::array::from_fn(|i| _mm_loadu_ps(m[i].as_ptr()));
        let lo01 = _mm_unpacklo_ps(r[0], r[1]); // r0[0] r1[0] r0[1] r1[1]
        let lo23 = _mm_unpacklo_ps(r[2], r[3]);
        let hi01 = _mm_unpackhi_ps(r[0], r[1]); // r0[2] r1[2] r0[3] r1[3]
        let hi23 = _mm_unpackhi_ps(r[2], r[3]);
        _mm_storeu_ps(o0.as_mut_ptr(), _mm_movelh_ps(lo01, lo23));
        _mm_storeu_ps(o1.as_mut_ptr(), _mm_movehl_ps(lo23, lo01));
        _mm_storeu_ps(o2.as_mut_ptr(), _mm_movelh_ps(hi01, hi23));
        _mm_storeu_ps(o3.as_mut_ptr(), _mm_movehl_ps(hi23, hi01));
    }
}

/// `out[i] = w[i]` as f32, a vector at a time.
///
/// # Safety
/// The ISA's features are enabled and `out.len() == w.len()`.
#[inline(always)]
pub(crate) unsafe fn widen<S: F32Simd, W: Weight>(w: &[W], out: &mut [f32]) {
    let n = w.len();
    let main = n - n % S::LANES;
    let mut i = 0;
    // SAFETY: features enabled; i + LANES <= main <= n = out.len().
    unsafe {
        while i < main {
            S::store(out.as_mut_ptr().add(i), W::load::<S>(w.as_ptr().add(i)));
            i += S::LANES;
        }
    }
    for (o, w) in out[main..].iter_mut().zip(&w[main..]) {
        *o = w.to_f32();
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

/// Rows of `out` one [`weighted_sum`] block computes together: each vector of `v` it loads
/// serves all of them.
pub(crate) const WEIGHTED_ROWS: usize = 4;

/// `out[r][c] = Σ_j probs[r·stride + j]·v[j·width + c]`, with the bits of [`axpy`] over
/// `j = 0, 1, …` into zeroed rows: each row splits at the same place (full vectors by FMA, the
/// last `width % LANES` elements by a multiply and an add) and each element sums in the same
/// order. What changes is the memory traffic: `axpy` loads and stores its row once per key,
/// while here blocks of up to [`WEIGHTED_ROWS`] rows × `C` vectors stay in registers across
/// all keys, and each vector of `v` is loaded once per block.
///
/// # Safety
/// The ISA's features are enabled and the lengths are as
/// [`crate::shape::weighted_sum_shape`] checks them.
#[inline(always)]
pub(crate) unsafe fn weighted_sum<S: F32Simd, const C: usize, W: Weight>(
    probs: &[f32],
    stride: usize,
    v: &[W],
    width: usize,
    out: &mut [f32],
) {
    let rows = out.len() / width;
    let mut r = 0;
    while r < rows {
        let n = (rows - r).min(WEIGHTED_ROWS);
        let (p, o) = (&probs[r * stride..], &mut out[r * width..(r + n) * width]);
        // SAFETY: features enabled; rows r..r+n of the caller's checked shape, whose
        // probabilities start at p.
        unsafe {
            match n {
                1 => weighted_rows::<S, 1, C, W>(p, stride, v, width, o),
                2 => weighted_rows::<S, 2, C, W>(p, stride, v, width, o),
                3 => weighted_rows::<S, 3, C, W>(p, stride, v, width, o),
                _ => weighted_rows::<S, WEIGHTED_ROWS, C, W>(p, stride, v, width, o),
            }
        }
        r += n;
    }
}

/// [`weighted_sum`] of `R` rows: blocks of `C` vectors across the full vectors of a row, then
/// single vectors, then the tail in `axpy`'s scalar order.
///
/// # Safety
/// As [`weighted_sum`], with `out` holding exactly `R` rows.
#[inline(always)]
unsafe fn weighted_rows<S: F32Simd, const R: usize, const C: usize, W: Weight>(
    probs: &[f32],
    stride: usize,
    v: &[W],
    width: usize,
    out: &mut [f32],
) {
    let main = width - width % S::LANES;
    let mut c = 0;
    while c + C * S::LANES <= main {
        // SAFETY: forwarded contract; columns c..c + C·LANES lie within the row's full vectors.
        unsafe { weighted_block::<S, R, C, W>(probs, stride, v, width, out, c) };
        c += C * S::LANES;
    }
    while c < main {
        // SAFETY: forwarded contract; columns c..c + LANES lie within the row's full vectors.
        unsafe { weighted_block::<S, R, 1, W>(probs, stride, v, width, out, c) };
        c += S::LANES;
    }
    crate::simd::weighted_sum_tail(probs, stride, v, width, out, main, W::to_f32);
}

/// Columns `c..c + C·LANES` of `R` rows of [`weighted_sum`]: `R × C` accumulators, starting at
/// zero, each key's `C` vectors loaded once and multiplied by each row's probability.
///
/// # Safety
/// As [`weighted_rows`], and `c + C·LANES <= width`.
#[inline(always)]
unsafe fn weighted_block<S: F32Simd, const R: usize, const C: usize, W: Weight>(
    probs: &[f32],
    stride: usize,
    v: &[W],
    width: usize,
    out: &mut [f32],
    c: usize,
) {
    let keys = v.len() / width;
    // SAFETY: features enabled; v holds `keys` rows of `width` and out `R` rows, so every
    // vector at column c + k·LANES < width of them is in bounds; row r's probabilities
    // r·stride..r·stride + keys lie in probs (the checked shape).
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        for j in 0..keys {
            let vp = v.as_ptr().add(j * width + c);
            let mut x = [S::zero(); C];
            for (k, x) in x.iter_mut().enumerate() {
                *x = W::load::<S>(vp.add(k * S::LANES));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let alpha = S::splat(*probs.as_ptr().add(r * stride + j));
                for (a, &x) in acc.iter_mut().zip(&x) {
                    *a = S::fma(alpha, x, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let op = out.as_mut_ptr().add(r * width + c);
            for (k, &a) in acc.iter().enumerate() {
                S::store(op.add(k * S::LANES), a);
            }
        }
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
