//! SIMD tiers, written once over a few primitives.
//!
//! - [`float`]: the [`float::F32Simd`] primitives (load, load f16/bf16, fma, reduce) and the
//!   generic float kernels (dot, tile, axpy, sum of squares) built on them.
//! - [`quant`]: the [`quant::QDot`] primitives (one block's integer dot product, returned as
//!   eight i32 lanes) and the generic Q8_0/Q4_0 kernels built on them.
//! - `avx2`, `avx512`: the primitives for each ISA and the `#[target_feature]` entry points that
//!   instantiate the generic kernels, collected in a [`crate::Kernels`] table.
//!
//! The generic kernels are `#[inline(always)]` and `unsafe`: they are only ever inlined into a
//! `#[target_feature]` function of the matching ISA, whose safe wrapper has checked lengths.
//! Tails shorter than one vector step go to scalar code in the reference's order.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod float;
#[cfg(target_arch = "x86_64")]
pub(crate) mod quant;
