//! Tier selection: which [`Kernels`] table runs on this CPU.
//!
//! [`kernels`] hands out a tier's table only when [`Isa::is_supported`] says the CPU (and this
//! build) can run it, which is the invariant that makes the SIMD tables' `unsafe` calls sound;
//! [`active`] is the table of [`isa`], the best supported tier lowered by `KILN_ISA`, chosen once
//! per process.

use std::sync::OnceLock;

use crate::isa::{isa, Isa};
use crate::table::{Kernels, SCALAR};

/// The kernels of tier `isa`, or `None` if this CPU (or this build) cannot run it.
pub fn kernels(isa: Isa) -> Option<&'static Kernels> {
    if !isa.is_supported() {
        return None;
    }
    match isa {
        Isa::Scalar => Some(&SCALAR),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(crate::simd::x86::avx2::table()),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(crate::simd::x86::avx512::table()),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => Some(crate::simd::aarch64::neon::table()),
        _ => None,
    }
}

/// The kernels of the dispatched tier ([`isa`]).
pub fn active() -> &'static Kernels {
    static ACTIVE: OnceLock<&'static Kernels> = OnceLock::new();
    ACTIVE.get_or_init(|| kernels(isa()).unwrap_or(&SCALAR))
}
