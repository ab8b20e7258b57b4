//! The aarch64 tier, NEON, a [`crate::Kernels`] table of its own: the x86 primitives are
//! written against x86 vector types, so nothing is shared with [`super::x86`] but the
//! portable helpers of [`crate::simd`].
//!
//! - [`neon`]: 4-lane float dots, exact 8-bit block dots, and the table.
//! - [`kquant`]: its Q5_0, Q5_1 and K-quant tiles (exact block sums with `vmull_s8`, or `sdot`
//!   where the CPU has `dotprod`).

pub(crate) mod kquant;
pub(crate) mod neon;
