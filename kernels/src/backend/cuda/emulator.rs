//! The emulated device: the kernels of `kernels/cuda/` compiled for this CPU
//! (`kernels/cuda/emu/`, built by `build.rs` with the `emulator` feature)
//! and run one block at a time, each block's threads as fibers switched at
//! barriers, in an order drawn afresh from a seed at every round.
//!
//! Device memory is host memory, each allocation ending just before an
//! inaccessible page (an access past its end faults). Graphs record their
//! launches, arguments by value, and replay them: what a captured launch
//! reads must come from device memory, as on a GPU.
//!
//! It runs the kernels' arithmetic, indexing and barriers, and stops at an
//! access a GPU would fault on for its alignment (`kernels/build.rs`); it
//! cannot show races between blocks, the GPU's memory model or its speed.
//! Tests only.

use super::device::{Device, DeviceError, DeviceGraph, Fill, Geometry, LaunchTime, Rect};
use super::launch::{shared_opt_in_bytes, SHARED_DEFAULT_BYTES, SHARED_OPT_IN_KERNEL};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

extern "C" {
    fn bulkhead_emu_alloc(bytes: usize) -> *mut c_void;
    fn bulkhead_emu_free(ptr: *mut c_void, bytes: usize);
    fn bulkhead_emu_args_bytes(name: *const c_char) -> usize;
    fn bulkhead_emu_kernels_linked() -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn bulkhead_emu_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: u32,
        args: *const c_void,
        args_bytes: usize,
        seed: u64,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// Device memory the emulator offers (a cap on tests, not a real size).
const MEMORY_BYTES: u64 = 4 << 30;
/// The opt-in limit of dynamic shared memory per block, as on an H100/H200
/// (of which attention takes what [`shared_opt_in_bytes`] says, as on a GPU).
const SHARED_OPT_IN_MAX: u32 = 227 * 1024;

/// One recorded launch of a captured graph: its arguments by value.
struct Recorded {
    kernel: &'static str,
    geometry: Geometry,
    args: Vec<u8>,
    /// Launched as a dependent of the launch before it.
    dependent: bool,
}

/// The emulated device.
pub struct Emulator {
    /// Launches so far; also the seed of each launch's schedule.
    launches: AtomicU64,
    /// Of them, those launched as dependents ([`Device::launch_dependent`]).
    dependents: AtomicU64,
    /// Whether the last work queued (or captured) was a launch: a
    /// dependent launch must follow one ([`Device::launch_dependent`]'s
    /// promise), which the emulator holds the backend to.
    after_launch: AtomicBool,
    /// Set while a graph is being captured: launches are recorded, not run.
    capturing: Mutex<Option<Vec<Recorded>>>,
    /// One launch runs at a time (the runtime keeps one launch's state).
    running: Mutex<()>,
    /// While a profile is taken, the launches timed so far (by the host's clock).
    profile: Mutex<Option<Vec<LaunchTime>>>,
    seed: u64,
    /// Whether launches run their kernels ([`Emulator::host_only`]: not).
    kernels: bool,
    /// Itself, for the graphs it captures.
    this: Weak<Emulator>,
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Emulator(seed {})", self.seed)
    }
}

impl Emulator {
    /// An emulated device whose launches' schedules derive from `seed`.
    pub fn new(seed: u64) -> Arc<Emulator> {
        Emulator::with_kernels(seed, true)
    }

    /// An emulated device whose launches are checked, counted and recorded
    /// as [`Emulator::new`]'s, and run nothing: what a step costs the host
    /// (packing, checks, copies, launches) without the device's work.
    pub fn host_only(seed: u64) -> Arc<Emulator> {
        Emulator::with_kernels(seed, false)
    }

    fn with_kernels(seed: u64, kernels: bool) -> Arc<Emulator> {
        // SAFETY: a function without arguments; referencing it links the kernels in.
        let linked = unsafe { bulkhead_emu_kernels_linked() };
        assert_eq!(linked, 1, "the emulator's kernels are linked");
        Arc::new_cyclic(|this| Emulator {
            launches: AtomicU64::new(0),
            dependents: AtomicU64::new(0),
            after_launch: AtomicBool::new(false),
            capturing: Mutex::new(None),
            running: Mutex::new(()),
            profile: Mutex::new(None),
            seed,
            kernels,
            this: this.clone(),
        })
    }

    /// Bytes of `kernel`'s argument struct as the compiled sources declare
    /// it, or `None` if no kernel has that name.
    pub fn args_bytes(kernel: &str) -> Option<usize> {
        let name = CString::new(kernel).ok()?;
        // SAFETY: `name` is a valid C string for the duration of the call.
        let bytes = unsafe { bulkhead_emu_args_bytes(name.as_ptr()) };
        (bytes > 0).then_some(bytes)
    }

    /// Launches run so far as dependents of the launch before them (graph
    /// replays count theirs): the emulator runs one launch after another,
    /// so a dependent one runs as any other.
    pub fn dependent_launches_run(&self) -> u64 {
        self.dependents.load(Ordering::Relaxed)
    }

    fn run(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
        dependent: bool,
    ) -> Result<(), DeviceError> {
        let _running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let launch = self.launches.fetch_add(1, Ordering::Relaxed);
        if dependent {
            self.dependents.fetch_add(1, Ordering::Relaxed);
        }
        if !self.kernels {
            return Ok(());
        }
        let name = CString::new(kernel).expect("kernel names have no NUL");
        let grid = [geometry.grid, 1, 1];
        let block = [geometry.block, 1, 1];
        let mut error = [0 as c_char; 512];
        // SAFETY: pointers are valid for the call; the caller of `launch`
        // vouched for the device addresses inside `args`.
        let failed = unsafe {
            bulkhead_emu_launch(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                geometry.shared_bytes,
                args.as_ptr().cast(),
                args.len(),
                self.seed ^ launch,
                error.as_mut_ptr(),
                error.len(),
            )
        };
        if failed != 0 {
            // SAFETY: the runtime wrote a NUL-terminated message into `error`.
            let message = unsafe { CStr::from_ptr(error.as_ptr()) };
            return Err(DeviceError::Launch {
                kernel,
                message: message.to_string_lossy().into_owned(),
            });
        }
        Ok(())
    }
}

struct EmulatedGraph {
    device: Arc<Emulator>,
    launches: Vec<Recorded>,
}

impl DeviceGraph for EmulatedGraph {
    fn replay(&self) -> Result<(), DeviceError> {
        self.device.after_launch.store(false, Ordering::Relaxed);
        for launch in &self.launches {
            self.device.run(
                launch.kernel,
                launch.geometry,
                &launch.args,
                launch.dependent,
            )?;
        }
        Ok(())
    }
}

/// Rows of a rectangle as host slices.
///
/// # Safety
/// Every row lies within one live allocation (host memory on the emulator).
unsafe fn rows(rect: Rect) -> impl Iterator<Item = *mut u8> {
    (0..rect.rows).map(move |row| (rect.at + row * rect.pitch) as *mut u8)
}

impl Emulator {
    /// Refuses `call` while launches are being captured, as a GPU's stream
    /// does for what may not be captured (a copy from pageable memory, a
    /// synchronisation, an allocation): and a copy or a fill the GPU would
    /// capture into the graph would run here at once, not at each replay,
    /// so none may come between the launches of a capture
    /// ([`Device::capture`]).
    fn outside_capture(&self, call: &'static str) -> Result<(), DeviceError> {
        // What comes next follows this call, not a launch.
        self.after_launch.store(false, Ordering::Relaxed);
        if self
            .capturing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return Err(DeviceError::Driver {
                call,
                message: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: operation not permitted \
                          when stream is capturing (only launches are captured)"
                    .to_string(),
            });
        }
        Ok(())
    }

    /// Checks, records or runs a launch (see [`Device::launch`]).
    fn launch_as(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
        dependent: bool,
    ) -> Result<(), DeviceError> {
        if dependent && !self.after_launch.load(Ordering::Relaxed) {
            return Err(DeviceError::Launch {
                kernel,
                message: "launched as a dependent of something other than a launch (a copy, a \
                          fill, a wait, a graph, or nothing in this capture)"
                    .to_string(),
            });
        }
        // A GPU refuses a launch past its kernel's shared memory limit
        // (CUDA_ERROR_INVALID_VALUE): the default, but for the kernel that
        // opts in to more.
        let limit = match kernel {
            SHARED_OPT_IN_KERNEL => self.shared_bytes_max(),
            _ => SHARED_DEFAULT_BYTES,
        };
        if geometry.shared_bytes > limit {
            return Err(DeviceError::Launch {
                kernel,
                message: format!(
                    "{} bytes of dynamic shared memory, past the {limit} a launch of it may \
                     take (only {SHARED_OPT_IN_KERNEL} opts in to more)",
                    geometry.shared_bytes
                ),
            });
        }
        // Queued (or captured): what comes next follows a launch.
        self.after_launch.store(true, Ordering::Relaxed);
        let mut capturing = self.capturing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(recorded) = capturing.as_mut() {
            recorded.push(Recorded {
                kernel,
                geometry,
                args: args.to_vec(),
                dependent,
            });
            return Ok(());
        }
        drop(capturing);
        let started = std::time::Instant::now();
        self.run(kernel, geometry, args, dependent)?;
        if let Some(launches) = self
            .profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            launches.push(LaunchTime {
                kernel,
                grid: geometry.grid,
                secs: started.elapsed().as_secs_f64(),
            });
        }
        Ok(())
    }
}

impl Device for Emulator {
    fn describe(&self) -> String {
        "CUDA emulator (CPU)".to_string()
    }

    fn memory_bytes(&self) -> u64 {
        MEMORY_BYTES
    }

    fn shared_bytes_max(&self) -> u32 {
        shared_opt_in_bytes(SHARED_OPT_IN_MAX)
    }

    fn tensor_cores(&self) -> bool {
        true
    }

    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError> {
        self.outside_capture("cuMemAlloc")?;
        let out_of_memory = || DeviceError::OutOfMemory {
            bytes,
            message: "emulator".to_string(),
        };
        let len = usize::try_from(bytes).map_err(|_| out_of_memory())?;
        // SAFETY: allocates zeroed pages; a null result is handled.
        let ptr = unsafe { bulkhead_emu_alloc(len) };
        if ptr.is_null() {
            return Err(out_of_memory());
        }
        Ok(ptr as u64)
    }

    unsafe fn free(&self, at: u64, bytes: u64) {
        // SAFETY: the caller passes one earlier allocation, unused now.
        unsafe { bulkhead_emu_free(at as *mut c_void, bytes as usize) }
    }

    unsafe fn write(&self, at: u64, src: &[u8]) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpyHtoDAsync")?;
        // SAFETY: the caller vouched the range is one live allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpyDtoHAsync")?;
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpyDtoDAsync")?;
        // SAFETY: the caller vouched both ranges are live and apart.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize) };
        Ok(())
    }

    unsafe fn fill(&self, rect: Rect, fill: Fill) -> Result<(), DeviceError> {
        self.outside_capture("cuMemsetD2D8Async")?;
        // SAFETY: the caller vouched every row is within one live allocation.
        for row in unsafe { rows(rect) } {
            // SAFETY: as above; rows of u16/u32 fills are whole values.
            let bytes = unsafe { std::slice::from_raw_parts_mut(row, rect.width as usize) };
            match fill {
                Fill::Zero => bytes.fill(0),
                Fill::U16(value) => {
                    for chunk in bytes.chunks_exact_mut(2) {
                        chunk.copy_from_slice(&value.to_le_bytes());
                    }
                }
                Fill::U32(value) => {
                    for chunk in bytes.chunks_exact_mut(4) {
                        chunk.copy_from_slice(&value.to_le_bytes());
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn read_rect(&self, rect: Rect, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpy2DAsync")?;
        let width = rect.width as usize;
        // SAFETY: the caller vouched every row is within one live allocation.
        for (row, out) in unsafe { rows(rect) }.zip(dst.chunks_exact_mut(width.max(1))) {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(row, out.as_mut_ptr(), width) };
        }
        Ok(())
    }

    unsafe fn write_rect(&self, rect: Rect, src: &[u8]) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpy2DAsync")?;
        let width = rect.width as usize;
        // SAFETY: as above.
        for (row, data) in unsafe { rows(rect) }.zip(src.chunks_exact(width.max(1))) {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), row, width) };
        }
        Ok(())
    }

    unsafe fn launch(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError> {
        self.launch_as(kernel, geometry, args, false)
    }

    unsafe fn launch_dependent(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError> {
        self.launch_as(kernel, geometry, args, true)
    }

    fn dependent_launches(&self) -> bool {
        true
    }

    fn profile_start(&self) {
        let mut profile = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        profile.get_or_insert_with(Vec::new);
    }

    fn profile_take(&self) -> Vec<LaunchTime> {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.outside_capture("cuStreamSynchronize")?;
        Ok(())
    }

    fn capture(
        &self,
        record: &mut dyn FnMut() -> Result<(), DeviceError>,
    ) -> Result<Box<dyn DeviceGraph>, DeviceError> {
        *self.capturing.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
        // A capture's first launch has nothing before it in the graph.
        self.after_launch.store(false, Ordering::Relaxed);
        let result = record();
        self.after_launch.store(false, Ordering::Relaxed);
        let launches = self
            .capturing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        result?;
        Ok(Box::new(EmulatedGraph {
            device: self.this.upgrade().expect("a device outlives its calls"),
            launches,
        }))
    }

    fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }
}
