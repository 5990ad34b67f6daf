//! The kernel sources, compiled at start-up through NVRTC to machine code
//! (CUBIN) for the device present, and cached per architecture.
//!
//! CUBIN rather than PTX: the driver loads machine code for its own device
//! as it is, where PTX from an NVRTC newer than the driver would be refused.
//! NVRTC needs no GPU, so CI compiles every source for `sm_90` on a machine
//! without one (`every_source_compiles_for_sm_90`), with the library from
//! PyPI's `nvidia-cuda-nvrtc` wheel that `scripts/setup.sh` installs.
//!
//! NVRTC is loaded dynamically (cudarc's `dynamic-loading`): it is looked up
//! by name through the loader path when first needed, and its absence is an
//! error here, never a panic.

use cudarc::nvrtc::sys;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// A kernel source file and its name for NVRTC's messages.
pub struct Source {
    /// The file name (as in `kernels/cuda/`).
    pub name: &'static str,
    /// Its text.
    pub text: &'static str,
}

/// Headers every source includes, by the name it includes them as.
const HEADERS: [Source; 3] = [
    Source {
        name: "common.cuh",
        text: include_str!("../../../cuda/common.cuh"),
    },
    Source {
        name: "args.cuh",
        text: include_str!("../../../cuda/args.cuh"),
    },
    Source {
        name: "kv.cuh",
        text: include_str!("../../../cuda/kv.cuh"),
    },
];

/// Every kernel source, one module each.
pub const SOURCES: [Source; 4] = [
    Source {
        name: "attention.cu",
        text: include_str!("../../../cuda/attention.cu"),
    },
    Source {
        name: "pages.cu",
        text: include_str!("../../../cuda/pages.cu"),
    },
    Source {
        name: "quant.cu",
        text: include_str!("../../../cuda/quant.cu"),
    },
    Source {
        name: "sample.cu",
        text: include_str!("../../../cuda/sample.cu"),
    },
];

/// Why the kernels could not be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvrtcError {
    /// libnvrtc is not on the loader path.
    #[error(
        "NVRTC (libnvrtc.so.13) was not found on the loader path: install CUDA 13's NVRTC \
         (the CUDA toolkit, or PyPI's nvidia-cuda-nvrtc 13.0 wheel) and add its lib folder \
         to LD_LIBRARY_PATH"
    )]
    Missing,
    /// An NVRTC call failed.
    #[error("NVRTC {call}: {message}")]
    Call {
        /// The call.
        call: &'static str,
        /// NVRTC's error string.
        message: String,
    },
    /// A source did not compile.
    #[error("NVRTC could not compile {source_name} for {arch}:\n{log}")]
    Compile {
        /// The file.
        source_name: &'static str,
        /// The target architecture.
        arch: String,
        /// The compiler's log.
        log: String,
    },
}

/// Whether libnvrtc can be loaded.
pub fn is_present() -> bool {
    // SAFETY: only tries to load the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32), NvrtcError> {
    if !is_present() {
        return Err(NvrtcError::Missing);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the out-pointers are valid.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

fn check(call: &'static str, result: sys::nvrtcResult) -> Result<(), NvrtcError> {
    if result == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string for any result.
    let message = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(result)) };
    Err(NvrtcError::Call {
        call,
        message: message.to_string_lossy().into_owned(),
    })
}

/// A created NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

impl Program {
    fn log(&self) -> String {
        let mut len = 0usize;
        // SAFETY: a live program; the out-pointer is valid.
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut len) }
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        let mut log = vec![0u8; len.max(1)];
        // SAFETY: `log` holds the size NVRTC reported.
        unsafe { sys::nvrtcGetProgramLog(self.0, log.as_mut_ptr().cast::<c_char>()) };
        CStr::from_bytes_until_nul(&log)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// Set (to anything), [`compile`] prints ptxas's account of each kernel
/// (registers, stack frame, spills) to standard error:
/// `BULKHEAD_PTXAS_INFO=1 cargo test -p bulkhead-kernels --lib every_source -- --nocapture`.
pub const PTXAS_INFO: &str = "BULKHEAD_PTXAS_INFO";

/// Compiles `source` to CUBIN for `arch` (e.g. "sm_90").
pub fn compile(source: &Source, arch: &str) -> Result<Vec<u8>, NvrtcError> {
    let ptxas_info = std::env::var_os(PTXAS_INFO).is_some();
    let (cubin, log) = compile_reporting(source, arch, ptxas_info)?;
    if ptxas_info {
        eprintln!("{} for {arch}:\n{log}", source.name);
    }
    Ok(cubin)
}

/// [`compile`], with NVRTC's log; `ptxas_info` adds ptxas's account of each
/// kernel to it (registers, stack frame, spills, static shared memory).
fn compile_reporting(
    source: &Source,
    arch: &str,
    ptxas_info: bool,
) -> Result<(Vec<u8>, String), NvrtcError> {
    let (program, log) = compiled(source, arch, ptxas_info)?;
    let mut len = 0usize;
    // SAFETY: a compiled program; the out-pointer is valid.
    check("nvrtcGetCUBINSize", unsafe {
        sys::nvrtcGetCUBINSize(program.0, &mut len)
    })?;
    let mut cubin = vec![0u8; len];
    // SAFETY: `cubin` holds the size NVRTC reported.
    check("nvrtcGetCUBIN", unsafe {
        sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast::<c_char>())
    })?;
    Ok((cubin, log))
}

/// `source` compiled for `arch` ("sm_90": machine code; "compute_90": PTX
/// alone), with NVRTC's log.
fn compiled(
    source: &Source,
    arch: &str,
    ptxas_info: bool,
) -> Result<(Program, String), NvrtcError> {
    if !is_present() {
        return Err(NvrtcError::Missing);
    }
    let text = CString::new(source.text).expect("sources have no NUL");
    let name = CString::new(source.name).expect("names have no NUL");
    let header_texts: Vec<CString> = HEADERS
        .iter()
        .map(|h| CString::new(h.text).expect("headers have no NUL"))
        .collect();
    let header_names: Vec<CString> = HEADERS
        .iter()
        .map(|h| CString::new(h.name).expect("names have no NUL"))
        .collect();
    let texts: Vec<*const c_char> = header_texts.iter().map(|h| h.as_ptr()).collect();
    let names: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
    let mut raw = std::ptr::null_mut();
    // SAFETY: every pointer is a live C string for the call; NVRTC copies them.
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            text.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as c_int,
            texts.as_ptr(),
            names.as_ptr(),
        )
    })?;
    let program = Program(raw);
    // Precise division and square roots (the CPU's arithmetic), no fast math.
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--extra-device-vectorization".to_string(),
    ];
    // Each kernel's registers, stack frame and spills, from ptxas (a launch
    // of many threads needs few registers a thread; a stack frame is local
    // memory).
    if ptxas_info {
        options.push("--ptxas-options=-v".to_string());
    }
    let options: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and live option strings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(program.0, pointers.len() as c_int, pointers.as_ptr()) };
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(NvrtcError::Compile {
            source_name: source.name,
            arch: arch.to_string(),
            log: program.log(),
        });
    }
    let log = program.log();
    Ok((program, log))
}

/// The CUBIN image of every source, in [`SOURCES`] order.
pub type Modules = Arc<Vec<Vec<u8>>>;

/// Every source compiled for `arch`, compiled once per process and architecture.
pub fn modules(arch: &str) -> Result<Modules, NvrtcError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Modules>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(modules) = cache.get(arch) {
        return Ok(Arc::clone(modules));
    }
    let modules = Arc::new(
        SOURCES
            .iter()
            .map(|source| compile(source, arch))
            .collect::<Result<Vec<_>, _>>()?,
    );
    cache.insert(arch.to_string(), Arc::clone(&modules));
    Ok(modules)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether NVRTC is here. Without it a test is skipped, and says so,
    /// unless `BULKHEAD_REQUIRE_NVRTC` is set (CI sets it): then it fails.
    fn nvrtc_here() -> bool {
        if is_present() {
            return true;
        }
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_NVRTC").is_none(),
            "BULKHEAD_REQUIRE_NVRTC is set but NVRTC is not on the loader path"
        );
        eprintln!("skipped: NVRTC is not on the loader path (scripts/setup.sh installs it)");
        false
    }

    #[test]
    fn every_source_compiles_for_sm_90() {
        if !nvrtc_here() {
            return;
        }
        let (major, minor) = version().unwrap();
        for source in &SOURCES {
            let cubin =
                compile(source, "sm_90").unwrap_or_else(|e| panic!("NVRTC {major}.{minor}: {e}"));
            // An ELF image.
            assert_eq!(&cubin[..4], b"\x7fELF", "{}", source.name);
        }
    }

    /// What ptxas reports of one kernel.
    #[derive(Debug, Default)]
    struct Resources {
        registers: u32,
        static_shared: u32,
        spill_stores: u32,
    }

    /// The number before `unit` in `line` ("Used 96 registers" → 96).
    fn number_before(line: &str, unit: &str) -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split_whitespace().last()?.parse().ok()
    }

    /// Each kernel's resources, from ptxas's report in NVRTC's log.
    fn resources(log: &str) -> Vec<(String, Resources)> {
        let mut kernels: Vec<(String, Resources)> = Vec::new();
        for line in log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let name = rest.split('\'').next().unwrap_or_default();
                kernels.push((name.to_string(), Resources::default()));
            } else if let Some((_, r)) = kernels.last_mut() {
                if let Some(n) = number_before(line, " registers") {
                    r.registers = n;
                }
                if let Some(n) = number_before(line, " bytes smem") {
                    r.static_shared = n;
                }
                if let Some(n) = number_before(line, " bytes spill stores") {
                    r.spill_stores = n;
                }
            }
        }
        kernels
    }

    #[test]
    fn every_kernel_fits_the_launches_the_backend_makes_of_it_on_sm_90() {
        use super::super::launch::*;
        if !nvrtc_here() {
            return;
        }
        // Each kernel's threads a block and the most dynamic shared memory
        // the backend launches it with.
        let fused = super::super::SHARED_DEFAULT_MAX as u32;
        let opt_in = shared_opt_in_bytes(227 * 1024);
        let launches: [(&str, u32, u32); 10] = [
            (EmbedArgs::KERNEL, ROW_BLOCK, 0),
            (NormArgs::KERNEL, NORM_BLOCK, 0),
            (MatmulArgs::KERNEL, MATMUL_WARPS * 32, fused),
            (MatmulMmaArgs::KERNEL, MATMUL_WARPS * 32, 0),
            (RopeKvArgs::KERNEL, ROW_BLOCK, 0),
            (AttentionArgs::KERNEL, ATTENTION_BLOCK, opt_in),
            (MergeArgs::KERNEL, ATTENTION_BLOCK, 0),
            (PickArgs::KERNEL, PICK_BLOCK, 0),
            (DigestArgs::KERNEL, DIGEST_BLOCK, 0),
            (DrawWeightsArgs::KERNEL, ROW_BLOCK, 0),
        ];
        let mut seen = Vec::new();
        for source in &SOURCES {
            let (_, log) = compile_reporting(source, "sm_90", true).unwrap();
            for (kernel, r) in resources(&log) {
                let &(_, threads, dynamic) = launches
                    .iter()
                    .find(|(name, ..)| *name == kernel)
                    .unwrap_or_else(|| panic!("{kernel} ({}) has no launch here", source.name));
                eprintln!(
                    "{kernel}: {} registers x {threads} threads, {} + {dynamic} bytes of shared memory, {} bytes spilled",
                    r.registers, r.static_shared, r.spill_stores
                );
                // sm_90: at most 255 registers a thread, given out a warp at
                // a time in units of 256 (8 a thread), 64 Ki a block; else
                // the launch fails ("too many resources requested").
                assert!(r.registers > 0 && r.registers <= 255, "{kernel}: {r:?}");
                let given = r.registers.div_ceil(8) * 8;
                assert!(
                    given * threads <= 64 * 1024,
                    "{kernel}: {given} registers x {threads} threads is past a block's 65,536"
                );
                // Static and dynamic shared memory together within the
                // default 48 KiB, or the opt-in limit for the kernel that
                // opts in.
                let limit = if kernel == SHARED_OPT_IN_KERNEL {
                    227 * 1024
                } else {
                    SHARED_DEFAULT_BYTES
                };
                assert!(
                    r.static_shared + dynamic <= limit,
                    "{kernel}: {} + {dynamic} bytes of shared memory, past {limit}",
                    r.static_shared
                );
                seen.push(kernel);
            }
        }
        seen.sort_unstable();
        let mut wanted: Vec<String> = launches.iter().map(|(k, ..)| k.to_string()).collect();
        wanted.sort_unstable();
        assert_eq!(
            seen, wanted,
            "ptxas reported every kernel the backend launches"
        );
    }

    /// `source`'s PTX for `compute_90`.
    fn ptx(source: &Source) -> String {
        let (program, _) = compiled(source, "compute_90", false).unwrap();
        let mut len = 0usize;
        // SAFETY: a compiled program; the out-pointer is valid.
        check("nvrtcGetPTXSize", unsafe {
            sys::nvrtcGetPTXSize(program.0, &mut len)
        })
        .unwrap();
        let mut text = vec![0u8; len.max(1)];
        // SAFETY: `text` holds the size NVRTC reported.
        check("nvrtcGetPTX", unsafe {
            sys::nvrtcGetPTX(program.0, text.as_mut_ptr().cast::<c_char>())
        })
        .unwrap();
        CStr::from_bytes_until_nul(&text)
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    /// Each kernel (`.entry`) of `ptx` with its body's instructions.
    fn entries(ptx: &str) -> Vec<(String, Vec<&str>)> {
        let mut entries: Vec<(String, Vec<&str>)> = Vec::new();
        let mut inside = false;
        for line in ptx.lines() {
            if let Some(rest) = line.split(".entry ").nth(1) {
                let name = rest.split('(').next().unwrap_or_default().trim();
                entries.push((name.to_string(), Vec::new()));
                inside = true;
            } else if inside && line.starts_with('}') {
                inside = false;
            } else if let (true, Some((_, body))) = (inside, entries.last_mut()) {
                let instruction = line.trim();
                if !instruction.is_empty() && !instruction.starts_with("//") {
                    body.push(instruction);
                }
            }
        }
        entries
    }

    #[test]
    fn every_kernel_waits_for_the_kernel_before_it_before_touching_memory() {
        if !nvrtc_here() {
            return;
        }
        // A dependent launch may begin while the kernel before it runs
        // (common.cuh's grid_dependency): before its wait a kernel may read
        // its parameters and the step buffer's words through the read-only
        // path (load_step_word: no kernel writes them) and ask for lines in
        // L2 (prefetch_l2: a hint that reads no value), nothing else, nor
        // write, nor call.
        let touches = [
            "ld.", "st.", "atom.", "red.", "call", "cp.", "tex.", "prefetch",
        ];
        let allowed = ["ld.param", "ld.global.nc.", "prefetch.global.L2 "];
        let mut prefetching = Vec::new();
        let mut kernels = Vec::new();
        for source in &SOURCES {
            let ptx = ptx(source);
            for (kernel, body) in entries(&ptx) {
                kernels.push(kernel.to_string());
                let wait = body
                    .iter()
                    .position(|i| i.starts_with("griddepcontrol.wait"))
                    .unwrap_or_else(|| panic!("{kernel} ({}) never waits", source.name));
                let before = &body[..wait];
                assert!(
                    before
                        .iter()
                        .any(|i| i.starts_with("griddepcontrol.launch_dependents")),
                    "{kernel} does not let the next kernel begin before it waits"
                );
                for i in before {
                    let early = touches.iter().any(|t| i.starts_with(t))
                        && !allowed.iter().any(|a| i.starts_with(a));
                    assert!(!early, "{kernel}: `{i}` before its wait");
                }
                if before.iter().any(|i| i.starts_with("prefetch.")) {
                    prefetching.push(kernel);
                }
            }
        }
        // Every kernel, and each one a device opens by name.
        kernels.sort_unstable();
        let mut opened = super::super::driver::KERNELS.map(String::from);
        opened.sort_unstable();
        assert_eq!(
            kernels, opened,
            "the sources' kernels, and those a device opens"
        );
        // Attention asks for its K and V lines, the products for their
        // weights', before they wait.
        assert_eq!(prefetching, ["attention", "matmul"]);
    }

    #[test]
    fn a_source_with_an_error_is_refused_with_the_compilers_log() {
        if !nvrtc_here() {
            return;
        }
        let broken = Source {
            name: "broken.cu",
            text: "#include \"common.cuh\"\nextern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n",
        };
        let error = compile(&broken, "sm_90").unwrap_err();
        match error {
            NvrtcError::Compile {
                source_name, log, ..
            } => {
                assert_eq!(source_name, "broken.cu");
                assert!(log.contains("undefined_name"), "{log}");
            }
            other => panic!("{other}"),
        }
    }
}
