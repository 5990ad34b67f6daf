//! Instruction-set paths the kernels can take, and their run-time detection.
//!
//! Invariants:
//! 1. `Isa::Scalar` runs everywhere; every other variant is only ever executed after
//!    [`Isa::is_available`] said yes on this CPU (the dispatchers assert it), because
//!    running an unsupported instruction is undefined behaviour, not a panic.
//! 2. `Isa::Avx512` implies everything `Isa::Avx2` needs (avx2, fma, f16c), so AVX-512
//!    dispatch may fall back to AVX2 code for the types it has no wider kernel for.

/// A SIMD code path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust; the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C: `vpmaddubsw` int8 dot products on 256-bit vectors.
    Avx2,
    /// AVX2's set plus AVX-512 F/BW/VL/VNNI: `vpdpbusd` int8 dot products.
    Avx512,
}

impl Isa {
    /// The fastest path this CPU supports.
    pub fn detect() -> Isa {
        if Isa::Avx512.is_available() {
            Isa::Avx512
        } else if Isa::Avx2.is_available() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Every path this CPU can run, slowest first; always starts with `Scalar`.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// Whether this CPU can run the path. Cheap: the standard library caches detection.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => has_avx2(),
            Isa::Avx512 => has_avx2() && has_avx512(),
        }
    }

    /// Lower-case name for logs and benchmark tables.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}
