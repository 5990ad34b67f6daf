//! Builds the CUDA emulator when the `emulator` feature is on: the kernel
//! sources of `cuda/` compiled as C++ for this CPU with the fiber runtime of
//! `cuda/emu/` (tests only; the device build is NVRTC's, at run time).

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "emulator")]
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        // The CPU backend's arithmetic rounds every product: so must the kernels here.
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unused-parameter")
        // `#pragma unroll` is for NVRTC; GCC has its own spelling.
        .flag_if_supported("-Wno-unknown-pragmas")
        .opt_level(2)
        .include("cuda/emu")
        .file("cuda/emu/emu.cpp")
        .file("cuda/emu/kernels.cpp")
        .compile("bulkhead_cuda_emu");
}
