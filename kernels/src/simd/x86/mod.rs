//! The x86-64 tiers, AVX2 and AVX-512, each a [`crate::Kernels`] table built from the
//! primitives and generic kernels here.
//!
//! - [`float`]: the [`float::F32Simd`] primitives (load, load f16/bf16, fma, reduce) and the
//!   generic float kernels (dot, tile, axpy, sum of squares) built on them.
//! - [`quant`]: the [`quant::QDot`] primitives (one block's integer dot product, returned as
//!   eight i32 lanes) and the generic Q8_0/Q4_0 kernels built on them.
//! - [`avx2`], [`avx512`]: the primitives for each ISA and the `#[target_feature]` entry
//!   points that instantiate the generic kernels, collected in each tier's table (with the
//!   tier's K-quant tiles); AVX-512's float primitives are [`avx512_float`]'s, below both
//!   [`avx512`] and [`avx512_pair`].
//! - [`avx512_pair`]: the AVX-512 tier's own Q8_0/Q4_0 tile, two blocks per 512-bit
//!   `vpdpbusd` with the scales converted in registers (the generic block kernel spends more
//!   on each block's scale than on its dot).
//! - [`avx2_convert`]: weight conversion (bf16 decoding, GGML's reference Q8_0/Q4_0
//!   quantization with its round-trip statistics), shared by both tiers.
//! - [`kquant`]: both tiers' Q5_0, Q5_1 and K-quant block sums (exact integers, so their tiles
//!   give the reference's bits) and each tier's tiles over them; [`q5`], below it: the
//!   Q5_0/Q5_1 codes and tile, eight blocks' terms in the lanes of one register; [`q8k`]: both
//!   tiers' quantization of activations to Q8_K; [`avx2_rows`], above [`kquant`]: the AVX2
//!   one-token kernels for sixteen Q2_K, Q3_K, IQ4_XS or IQ4_NL rows, eight blocks' terms in
//!   the lanes of one register.
//! - [`avx512_lanes`], [`avx2_lanes`]: the block lanes kernels ([`crate::lanes`]);
//!   [`avx512_klanes`], [`avx2_klanes`]: the K-quant lanes kernels ([`crate::klanes`]), a token
//!   per 32-bit lane.
//! - [`avx512_group`], [`avx2_group`]: the kernels for sixteen interleaved Q4_0 rows
//!   ([`crate::interleaved`]), a row per 32-bit lane and a few tokens per call
//!   ([`group_kernel`] makes each tier's entry point); [`avx2_group_iq4`] the same for
//!   IQ4_NL rows, at both tiers.
//!
//! - [`iq4`]: IQ4 index bytes unpacked to the lanes kernels' offset codes with `pshufb`.
//!
//! In matrix–vector tiles (one token) the kernels also prefetch the weight stream
//! ([`float::PREFETCH_BYTES`] ahead).

pub(crate) mod avx2;
pub(crate) mod avx2_convert;
pub(crate) mod avx2_group;
pub(crate) mod avx2_group_iq4;
pub(crate) mod avx2_group_iq4xs;
pub(crate) mod avx2_klanes;
pub(crate) mod avx2_lanes;
pub(crate) mod avx2_rows;
pub(crate) mod avx512;
pub(crate) mod avx512_float;
pub(crate) mod avx512_group;
pub(crate) mod avx512_klanes;
pub(crate) mod avx512_lanes;
pub(crate) mod avx512_pair;
pub(crate) mod float;
pub(crate) mod iq4;
pub(crate) mod kquant;
pub(crate) mod q5;
pub(crate) mod q8k;
pub(crate) mod quant;

/// A tier's [`crate::interleaved::Group`] from module `$m`'s `matvec::<T>` and `TOKENS`, run
/// with target features `$features`: the safe entry point checks the lengths and picks the
/// instance for the call's token count. `$w` and `$x` are the groups and the prepared
/// activation blocks (the 32-weight layouts' by default).
macro_rules! group_kernel {
    ($features:literal, $m:ident) => {
        super::group_kernel!(
            $features,
            $m,
            kiln_format::BlockQ4_0x16,
            $crate::interleaved::GroupX
        )
    };
    ($features:literal, $m:ident, $w:ty, $x:ty) => {{
        use kiln_format::GROUP_ROWS;
        use $crate::interleaved::Group;

        fn kernel(w: &[$w], x: &[$x], out: &mut [[f32; GROUP_ROWS]]) {
            let n = out.len();
            assert!(
                (1..=$m::TOKENS).contains(&n),
                "group kernel: {n} tokens in one call"
            );
            assert_eq!(x.len(), n * w.len(), "group kernel: block count mismatch");

            #[target_feature(enable = $features)]
            unsafe fn run<const T: usize>(w: &[$w], x: &[$x], out: &mut [[f32; GROUP_ROWS]]) {
                // SAFETY: features enabled by this function's attribute; x.len() == T·w.len()
                // checked by the caller.
                out.copy_from_slice(&unsafe { $m::matvec::<T>(w, x) });
            }

            // SAFETY: this tier's table, the only way here, is handed out only when the CPU
            // has the tier's features (`crate::kernels`); lengths checked above, and `n` is
            // the instance's `T`.
            unsafe {
                match n {
                    1 => run::<1>(w, x, out),
                    2 => run::<2>(w, x, out),
                    3 => run::<3>(w, x, out),
                    4 => run::<4>(w, x, out),
                    5 => run::<5>(w, x, out),
                    6 => run::<6>(w, x, out),
                    7 => run::<7>(w, x, out),
                    _ => run::<8>(w, x, out),
                }
            }
        }

        const _: () = assert!($m::TOKENS <= $crate::interleaved::GROUP_TOKENS_MAX);
        Group::<$w, $x> {
            kernel,
            tokens: $m::TOKENS,
        }
    }};
}
pub(crate) use group_kernel;
