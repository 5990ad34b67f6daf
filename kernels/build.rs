//! Builds the CUDA emulator when the `emulator` feature is on: the kernel
//! sources of `cuda/` compiled as C++ for this CPU with the fiber runtime of
//! `cuda/emu/` (tests only; the device build is NVRTC's, at run time).

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "emulator")]
    emulator();
}

/// The emulator's library. A GPU faults on a load or store that is not
/// aligned to its size ("misaligned address"), where this CPU would just
/// take it: the kernels are built with the alignment sanitizer, which stops
/// the process at the first such access, naming the line (through GCC's
/// runtime, linked statically where it is found, so that a binary built
/// here with the emulator in, as the GPU check's is, needs nothing more on
/// the GPU machine; else as a trap: SIGILL, no line).
#[cfg(feature = "emulator")]
fn emulator() {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        // The CPU backend's arithmetic rounds every product: so must the kernels here.
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unused-parameter")
        // `#pragma unroll` is for NVRTC; GCC has its own spelling.
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag("-fsanitize=alignment")
        .flag("-fno-sanitize-recover=alignment")
        .opt_level(2)
        .include("cuda/emu")
        .file("cuda/emu/emu.cpp")
        .file("cuda/emu/kernels.cpp");
    match ubsan_dir(&build.get_compiler()) {
        Some(dir) => {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-lib=static=ubsan");
        }
        None => {
            build
                .flag_if_supported("-fsanitize-undefined-trap-on-error")
                .flag_if_supported("-fsanitize-trap=alignment");
        }
    }
    build.compile("bulkhead_cuda_emu");
}

/// The folder of the compiler's undefined-behaviour runtime (GCC's
/// `libubsan.a`), if it has one.
#[cfg(feature = "emulator")]
fn ubsan_dir(compiler: &cc::Tool) -> Option<std::path::PathBuf> {
    let out = compiler
        .to_command()
        .arg("-print-file-name=libubsan.a")
        .output()
        .ok()?;
    // A compiler without it prints the name back, unresolved.
    let path = std::path::PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    if !out.status.success() || !path.is_absolute() || !path.exists() {
        return None;
    }
    Some(path.parent()?.to_path_buf())
}
