//! An NVIDIA GPU through the CUDA driver API (cudarc's raw bindings, loaded
//! dynamically: nothing of CUDA is needed to build, and a machine without a
//! driver gets an error naming what is missing, never a panic).
//!
//! Opening a device:
//! 1. libcuda is looked up by name on the loader path ([`probe`]);
//! 2. the driver is initialised and device `ordinal` is asked for its name,
//!    compute capability, memory and shared-memory limit;
//! 3. its primary context is retained and one non-blocking stream created;
//! 4. the kernel sources are compiled by NVRTC for its architecture
//!    ([`super::nvrtc`]) and loaded as modules, each kernel looked up by name.
//!
//! Every call binds the context to the calling thread first (the engine
//! thread is not the one that opened the device).

use super::device::{Device, DeviceError, DeviceGraph, Fill, Geometry, LaunchTime, Rect};
use super::launch::{shared_opt_in_bytes, SHARED_OPT_IN_KERNEL};
use super::nvrtc::{self, NvrtcError};
use cudarc::driver::result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Why no CUDA device could be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// libcuda is not on the loader path.
    #[error(
        "no NVIDIA driver: libcuda.so.1 was not found on the loader path (install the NVIDIA \
         driver, or run on a machine with one)"
    )]
    NoDriver,
    /// The driver is there but found no device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// The device asked for does not exist.
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    Ordinal {
        /// The device asked for.
        ordinal: u32,
        /// Devices present.
        count: u32,
    },
    /// NVRTC is missing or failed.
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    /// A driver call failed while opening the device.
    #[error(transparent)]
    Driver(#[from] DeviceError),
    /// The process's context was lost earlier ([`lost`]).
    #[error(
        "the GPU's context was lost earlier in this process ({0}): nothing more can run on it \
         until the process restarts"
    )]
    Lost(String),
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Devices the driver sees.
    pub devices: u32,
    /// The first device, if the driver could describe it.
    pub first: Option<ProbedDevice>,
}

/// A device as the driver describes it, without a context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbedDevice {
    /// Its name ("NVIDIA H200").
    pub name: String,
    /// Its architecture ("sm_90").
    pub arch: String,
    /// Its compute capability's major number (9).
    pub compute_major: u32,
    /// Its memory in bytes.
    pub memory_bytes: u64,
}

fn describe_device(device: sys::CUdevice) -> Result<ProbedDevice, DeviceError> {
    let call = |name: &'static str| move |e| driver_error(name, e);
    let name = result::device::get_name(device).map_err(call("cuDeviceGetName"))?;
    let attribute = |attribute| {
        // SAFETY: `device` came from cuDeviceGet.
        unsafe { result::device::get_attribute(device, attribute) }
            .map_err(call("cuDeviceGetAttribute"))
    };
    use sys::CUdevice_attribute::*;
    let major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: as above.
    let memory_bytes =
        unsafe { result::device::total_mem(device) }.map_err(call("cuDeviceTotalMem"))? as u64;
    Ok(ProbedDevice {
        name,
        arch: format!("sm_{major}{minor}"),
        compute_major: major.max(0) as u32,
        memory_bytes,
    })
}

fn driver_error(call: &'static str, error: result::DriverError) -> DeviceError {
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    let text = error
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let message = format!("{name}: {text}");
    if !sticky(error.0) {
        return DeviceError::Driver { call, message };
    }
    // The first is the cause; later calls answer the same.
    let _ = LOST.set(format!("{call}: {message}"));
    DeviceError::Lost { call, message }
}

/// The first sticky error of this process, once one has happened.
static LOST: OnceLock<String> = OnceLock::new();

/// Whether this process's GPU context is lost, and to what (the call and
/// the driver's error): after one of CUDA's sticky errors every later CUDA
/// call fails the same way, so no engine can be rebuilt on the device
/// ([`CudaDevice::open`] refuses) and the server's `/healthz` fails, for
/// the orchestrator to restart the process.
pub fn lost() -> Option<&'static str> {
    LOST.get().map(String::as_str)
}

/// Whether `code` is one of the errors after which the CUDA documentation
/// says the context cannot be used again ("the process must be terminated
/// and relaunched").
fn sticky(code: sys::CUresult) -> bool {
    use sys::CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
    )
}

/// Whether a driver and a device are present, without opening a context.
pub fn probe() -> Result<Probe, CudaUnavailable> {
    // SAFETY: only tries to load the library by its candidate names.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    result::init().map_err(|e| CudaUnavailable::NoDevice(driver_error("cuInit", e).to_string()))?;
    let count = result::device::get_count()
        .map_err(|e| CudaUnavailable::NoDevice(driver_error("cuDeviceGetCount", e).to_string()))?;
    if count <= 0 {
        return Err(CudaUnavailable::NoDevice(
            "the driver reports no devices".to_string(),
        ));
    }
    let first = result::device::get(0)
        .ok()
        .and_then(|device| describe_device(device).ok());
    Ok(Probe {
        devices: count as u32,
        first,
    })
}

/// An opened GPU: its context, one stream, and the kernels loaded for it.
pub struct CudaDevice {
    context: sys::CUcontext,
    device: sys::CUdevice,
    stream: sys::CUstream,
    modules: Vec<sys::CUmodule>,
    functions: HashMap<&'static str, sys::CUfunction>,
    name: String,
    arch: String,
    compute_major: u32,
    memory_bytes: u64,
    shared_bytes_max: u32,
    /// The largest pitch a 2D copy or memset takes; a pool's slab stride can
    /// be larger (pages times slab bytes), and then its rows go one by one.
    max_pitch: u64,
    launches: AtomicU64,
    /// While a profile is taken: its events and the launches timed so far.
    profile: Mutex<Option<Profile>>,
}

/// Two events around each launch, and the times they measured.
struct Profile {
    start: sys::CUevent,
    end: sys::CUevent,
    launches: Vec<LaunchTime>,
}

// SAFETY: event handles, used under the device's lock with its context current.
unsafe impl Send for Profile {}

// SAFETY: CUDA driver handles may be used from any thread once the context is
// made current there, which every method does first. Each engine opens its
// own `CudaDevice` (its own stream), and one thread at a time drives it.
unsafe impl Send for CudaDevice {}
// SAFETY: as above.
unsafe impl Sync for CudaDevice {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({}, {})", self.name, self.arch)
    }
}

/// Kernels a device opens (every `KERNEL` in the sources: a test holds
/// them to the PTX's entries).
pub(super) const KERNELS: [&str; 10] = [
    "embed",
    "rms_norm",
    "matmul",
    "matmul_mma",
    "pick",
    "rope_kv",
    "attention",
    "attention_merge",
    "page_digest",
    "draw_weights",
];

impl CudaDevice {
    /// Opens device `ordinal` and loads the kernels for it.
    pub fn open(ordinal: u32) -> Result<Arc<CudaDevice>, CudaUnavailable> {
        if let Some(why) = lost() {
            return Err(CudaUnavailable::Lost(why.to_string()));
        }
        let probe = probe()?;
        if ordinal >= probe.devices {
            return Err(CudaUnavailable::Ordinal {
                ordinal,
                count: probe.devices,
            });
        }
        let call = |name: &'static str| move |e| driver_error(name, e);
        let device = result::device::get(ordinal as i32).map_err(call("cuDeviceGet"))?;
        let ProbedDevice {
            name,
            arch,
            compute_major,
            memory_bytes,
        } = describe_device(device)?;
        // SAFETY: `device` came from cuDeviceGet.
        let shared_bytes_max = unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
        }
        .map_err(call("cuDeviceGetAttribute"))?;
        // SAFETY: as above.
        let max_pitch = unsafe {
            result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH,
            )
        }
        .map_err(call("cuDeviceGetAttribute"))?;
        let images = nvrtc::modules(&arch)?;
        // SAFETY: `device` came from cuDeviceGet; released in Drop.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(call("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: a retained context.
        unsafe { result::ctx::set_current(context) }.map_err(call("cuCtxSetCurrent"))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(call("cuStreamCreate"))?;
        let mut opened = CudaDevice {
            context,
            device,
            stream,
            modules: Vec::new(),
            functions: HashMap::new(),
            name,
            arch,
            compute_major,
            memory_bytes,
            shared_bytes_max: shared_bytes_max.max(0) as u32,
            max_pitch: max_pitch.max(0) as u64,
            launches: AtomicU64::new(0),
            profile: Mutex::new(None),
        };
        for image in images.iter() {
            // SAFETY: a CUBIN image NVRTC produced for this architecture.
            let module = unsafe { result::module::load_data(image.as_ptr().cast::<c_void>()) }
                .map_err(call("cuModuleLoadData"))?;
            opened.modules.push(module);
        }
        for kernel in KERNELS {
            let name = CString::new(kernel).expect("kernel names have no NUL");
            let function = opened
                .modules
                .iter()
                // SAFETY: live modules.
                .find_map(|&module| {
                    unsafe { result::module::get_function(module, name.clone()) }.ok()
                })
                .ok_or_else(|| {
                    CudaUnavailable::Driver(DeviceError::Launch {
                        kernel,
                        message: "not found in the compiled modules".to_string(),
                    })
                })?;
            opened.functions.insert(kernel, function);
        }
        // Attention's tiles may need more than the default 48 KiB of shared memory.
        let attention = opened.functions[SHARED_OPT_IN_KERNEL];
        let wanted = shared_opt_in_bytes(opened.shared_bytes_max);
        // SAFETY: a live function.
        unsafe {
            result::function::set_function_attribute(
                attention,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                wanted as i32,
            )
        }
        .map_err(call("cuFuncSetAttribute"))?;
        opened.shared_bytes_max = opened.shared_bytes_max.min(wanted);
        Ok(Arc::new(opened))
    }

    /// The device's architecture ("sm_90").
    pub fn arch(&self) -> &str {
        &self.arch
    }

    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: the context is retained for the device's life.
        unsafe { result::ctx::set_current(self.context) }
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    fn check(call: &'static str, result: sys::CUresult) -> Result<(), DeviceError> {
        result.result().map_err(|e| driver_error(call, e))
    }

    fn copy_2d(&self, copy: &sys::CUDA_MEMCPY2D) -> Result<(), DeviceError> {
        // SAFETY: the caller built `copy` from ranges it vouched for.
        Self::check("cuMemcpy2DAsync", unsafe {
            sys::cuMemcpy2DAsync_v2(copy, self.stream)
        })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: handles created in `open`, destroyed once, after the stream drained.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            if let Some(profile) = self.profile.get_mut().ok().and_then(Option::take) {
                let _ = result::event::destroy(profile.start);
                let _ = result::event::destroy(profile.end);
            }
            for &module in &self.modules {
                let _ = result::module::unload(module);
            }
            let _ = result::stream::destroy(self.stream);
            let _ = result::primary_ctx::release(self.device);
        }
    }
}

/// A 2D copy description from memory of `src` type to memory of `dst` type,
/// every other field zero or null (offsets, arrays unused). Written out, not
/// `mem::zeroed`: `CUmemorytype` has no zero value, so a zeroed description
/// is not a valid value of the struct (Rust aborts on making one).
fn memcpy_2d(src: sys::CUmemorytype, dst: sys::CUmemorytype) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: src,
        srcHost: std::ptr::null(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: dst,
        dstHost: std::ptr::null_mut(),
        dstDevice: 0,
        dstArray: std::ptr::null_mut(),
        dstPitch: 0,
        WidthInBytes: 0,
        Height: 0,
    }
}

struct CudaGraph {
    device: Arc<CudaDevice>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    launches: u64,
}

// SAFETY: graph handles are used from one thread at a time, as the device is.
unsafe impl Send for CudaGraph {}

impl DeviceGraph for CudaGraph {
    fn replay(&self) -> Result<(), DeviceError> {
        self.device.bind()?;
        self.device
            .launches
            .fetch_add(self.launches, Ordering::Relaxed);
        // SAFETY: a live executable graph on this device's stream.
        unsafe { result::graph::launch(self.exec, self.device.stream) }
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created by `capture`, destroyed once.
            unsafe {
                let _ = result::stream::synchronize(self.device.stream);
                let _ = result::graph::exec_destroy(self.exec);
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

/// The device behind an `Arc`, so captured graphs can hold it.
#[derive(Debug, Clone)]
pub struct Cuda(pub Arc<CudaDevice>);

impl Device for Cuda {
    fn describe(&self) -> String {
        format!("{}, {}", self.0.name, self.0.arch)
    }

    fn memory_bytes(&self) -> u64 {
        self.0.memory_bytes
    }

    fn shared_bytes_max(&self) -> u32 {
        self.0.shared_bytes_max
    }

    fn tensor_cores(&self) -> bool {
        self.0.compute_major >= 8
    }

    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError> {
        self.0.bind()?;
        // SAFETY: a plain device allocation, zeroed below before use.
        let at = unsafe { result::malloc_sync(bytes as usize) }.map_err(|e| {
            DeviceError::OutOfMemory {
                bytes,
                message: driver_error("cuMemAlloc", e).to_string(),
            }
        })?;
        // Zeroed on this device's stream, so every later operation on it
        // (kernels included: the stream does not wait for the legacy one)
        // sees zeros: fresh device memory holds whatever was there before.
        // SAFETY: the allocation just made.
        unsafe { result::memset_d8_async(at, 0, bytes as usize, self.0.stream) }
            .map_err(|e| driver_error("cuMemsetD8Async", e))?;
        Ok(at)
    }

    fn alloc_host(&self, bytes: usize) -> Result<std::ptr::NonNull<u8>, DeviceError> {
        self.0.bind()?;
        let bytes = bytes.max(1);
        // SAFETY: a plain page-locked allocation (flags 0), zeroed below
        // before anything reads it.
        let at =
            unsafe { result::malloc_host(bytes, 0) }.map_err(|e| DeviceError::HostOutOfMemory {
                bytes: bytes as u64,
                message: driver_error("cuMemHostAlloc", e).to_string(),
            })?;
        let at = std::ptr::NonNull::new(at.cast::<u8>()).ok_or(DeviceError::HostOutOfMemory {
            bytes: bytes as u64,
            message: "cuMemHostAlloc gave a null pointer".into(),
        })?;
        // SAFETY: `bytes` bytes just allocated, page-aligned (so 64-byte too).
        unsafe { std::ptr::write_bytes(at.as_ptr(), 0, bytes) };
        Ok(at)
    }

    unsafe fn free_host(&self, at: std::ptr::NonNull<u8>, _bytes: usize) {
        if self.0.bind().is_ok() {
            // SAFETY: the caller passes one earlier `alloc_host`, unused now.
            let _ = unsafe { result::free_host(at.as_ptr().cast()) };
        }
    }

    unsafe fn free(&self, at: u64, _bytes: u64) {
        if self.0.bind().is_ok() {
            // SAFETY: the caller passes one earlier allocation, unused now.
            let _ = unsafe { result::free_sync(at) };
        }
    }

    unsafe fn write(&self, at: u64, src: &[u8]) -> Result<(), DeviceError> {
        self.0.bind()?;
        // SAFETY: the caller vouched for the range. A pageable source is
        // staged before the call returns, so `src` may go away after it.
        unsafe { result::memcpy_htod_async(at, src, self.0.stream) }
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))
    }

    unsafe fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.0.bind()?;
        // SAFETY: the caller vouched for the range; synchronised before returning.
        unsafe {
            result::memcpy_dtoh_async(dst, at, self.0.stream)
                .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
            result::stream::synchronize(self.0.stream)
                .map_err(|e| driver_error("cuStreamSynchronize", e))
        }
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError> {
        self.0.bind()?;
        // SAFETY: the caller vouched both ranges are live and apart.
        unsafe { result::memcpy_dtod_async(dst, src, bytes as usize, self.0.stream) }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))
    }

    unsafe fn fill(&self, rect: Rect, fill: Fill) -> Result<(), DeviceError> {
        self.0.bind()?;
        let stream = self.0.stream;
        let width = rect.width as usize;
        if rect.rows > 1 && rect.pitch > self.0.max_pitch {
            for row in 0..rect.rows {
                let at = rect.at + row * rect.pitch;
                // SAFETY: the caller vouched every row lies in a live allocation.
                let result = unsafe {
                    match fill {
                        Fill::Zero => sys::cuMemsetD8Async(at, 0, width, stream),
                        Fill::U16(value) => sys::cuMemsetD16Async(at, value, width / 2, stream),
                        Fill::U32(value) => sys::cuMemsetD32Async(at, value, width / 4, stream),
                    }
                };
                CudaDevice::check("cuMemsetAsync", result)?;
            }
            return Ok(());
        }
        let (at, pitch, rows) = (rect.at, rect.pitch as usize, rect.rows as usize);
        // SAFETY: the caller vouched every row lies in a live allocation.
        let result = unsafe {
            match fill {
                Fill::Zero => sys::cuMemsetD2D8Async(at, pitch, 0, width, rows, stream),
                Fill::U16(value) => {
                    sys::cuMemsetD2D16Async(at, pitch, value, width / 2, rows, stream)
                }
                Fill::U32(value) => {
                    sys::cuMemsetD2D32Async(at, pitch, value, width / 4, rows, stream)
                }
            }
        };
        CudaDevice::check("cuMemsetD2DAsync", result)
    }

    unsafe fn read_rect(&self, rect: Rect, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.0.bind()?;
        if rect.rows > 1 && rect.pitch > self.0.max_pitch {
            for (row, out) in dst.chunks_exact_mut(rect.width.max(1) as usize).enumerate() {
                // SAFETY: the caller vouched every row lies in a live allocation.
                unsafe {
                    result::memcpy_dtoh_async(out, rect.at + row as u64 * rect.pitch, self.0.stream)
                }
                .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
            }
            return self.synchronize();
        }
        let mut copy = memcpy_2d(
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        );
        copy.srcDevice = rect.at;
        copy.srcPitch = rect.pitch as usize;
        copy.dstHost = dst.as_mut_ptr().cast::<c_void>();
        copy.dstPitch = rect.width as usize;
        copy.WidthInBytes = rect.width as usize;
        copy.Height = rect.rows as usize;
        self.0.copy_2d(&copy)?;
        // SAFETY: the stream is live; `dst` is written by the time it returns.
        unsafe { result::stream::synchronize(self.0.stream) }
            .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    unsafe fn write_rect(&self, rect: Rect, src: &[u8]) -> Result<(), DeviceError> {
        self.0.bind()?;
        if rect.rows > 1 && rect.pitch > self.0.max_pitch {
            for (row, data) in src.chunks_exact(rect.width.max(1) as usize).enumerate() {
                // SAFETY: as above; a pageable source is staged before the call returns.
                unsafe {
                    result::memcpy_htod_async(
                        rect.at + row as u64 * rect.pitch,
                        data,
                        self.0.stream,
                    )
                }
                .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
            }
            return Ok(());
        }
        let mut copy = memcpy_2d(
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        );
        copy.srcHost = src.as_ptr().cast::<c_void>();
        copy.srcPitch = rect.width as usize;
        copy.dstDevice = rect.at;
        copy.dstPitch = rect.pitch as usize;
        copy.WidthInBytes = rect.width as usize;
        copy.Height = rect.rows as usize;
        self.0.copy_2d(&copy)?;
        // A pageable source may be read after the call returns: wait for it.
        // SAFETY: the stream is live.
        unsafe { result::stream::synchronize(self.0.stream) }
            .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    unsafe fn launch(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's promises.
        unsafe { self.launch_as(kernel, geometry, args, false) }
    }

    unsafe fn launch_dependent(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's promises.
        unsafe { self.launch_as(kernel, geometry, args, self.dependent_launches()) }
    }

    fn dependent_launches(&self) -> bool {
        self.0.compute_major >= 9
    }

    fn profile_start(&self) {
        if self.0.bind().is_err() {
            return;
        }
        let mut profile = self.0.profile.lock().unwrap_or_else(|e| e.into_inner());
        if profile.is_some() {
            return;
        }
        let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
        if let (Ok(start), Ok(end)) = (result::event::create(flags), result::event::create(flags)) {
            *profile = Some(Profile {
                start,
                end,
                launches: Vec::new(),
            });
        }
    }

    fn profile_take(&self) -> Vec<LaunchTime> {
        let taken = self
            .0
            .profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(profile) = taken else {
            return Vec::new();
        };
        if self.0.bind().is_ok() {
            // SAFETY: events created by `profile_start`, destroyed once.
            unsafe {
                let _ = result::event::destroy(profile.start);
                let _ = result::event::destroy(profile.end);
            }
        }
        profile.launches
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.0.bind()?;
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(self.0.stream) }
            .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    fn capture(
        &self,
        record: &mut dyn FnMut() -> Result<(), DeviceError>,
    ) -> Result<Box<dyn DeviceGraph>, DeviceError> {
        self.0.bind()?;
        let before = self.0.launches.load(Ordering::Relaxed);
        // SAFETY: a live stream; capture is ended on every path below.
        unsafe {
            result::stream::begin_capture(
                self.0.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
        // A profile's events are not captured: its timing pauses meanwhile.
        let profile = self
            .0
            .profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let recorded = record();
        // SAFETY: capture was begun above.
        let graph = unsafe { result::stream::end_capture(self.0.stream) }
            .map_err(|e| driver_error("cuStreamEndCapture", e));
        *self.0.profile.lock().unwrap_or_else(|e| e.into_inner()) = profile;
        let launches = self.0.launches.load(Ordering::Relaxed) - before;
        // Captured launches did not run.
        self.0.launches.fetch_sub(launches, Ordering::Relaxed);
        recorded?;
        let graph = graph?;
        // SAFETY: a graph just captured.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(|e| {
            // SAFETY: the graph is not used again.
            unsafe {
                let _ = result::graph::destroy(graph);
            }
            driver_error("cuGraphInstantiate", e)
        })?;
        Ok(Box::new(CudaGraph {
            device: Arc::clone(&self.0),
            graph,
            exec,
            launches,
        }))
    }

    fn launches(&self) -> u64 {
        self.0.launches.load(Ordering::Relaxed)
    }
}

impl Cuda {
    /// Queues `kernel`, as a dependent of the launch before it where
    /// `dependent` (see [`Device::launch_dependent`]).
    ///
    /// # Safety
    /// [`Device::launch`]'s, and [`Device::launch_dependent`]'s where `dependent`.
    unsafe fn launch_as(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
        dependent: bool,
    ) -> Result<(), DeviceError> {
        let function = *self.0.functions.get(kernel).ok_or(DeviceError::Launch {
            kernel,
            message: "no such kernel".to_string(),
        })?;
        self.0.bind()?;
        // The kernel's one parameter is its argument struct, by value.
        let mut params = [args.as_ptr() as *mut c_void];
        self.0.launches.fetch_add(1, Ordering::Relaxed);
        let mut profile = self.0.profile.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = profile.as_ref() {
            // SAFETY: an event of this context, recorded on its live stream.
            unsafe { result::event::record(p.start, self.0.stream) }
                .map_err(|e| driver_error("cuEventRecord", e))?;
        }
        // A profile times each kernel alone, after an event: never as a dependent.
        let launched = if dependent && profile.is_none() {
            // The launch may begin before the kernel queued before it ends
            // (each kernel waits for it before touching memory: common.cuh).
            let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
            value.programmaticStreamSerializationAllowed = 1;
            let mut attribute = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value,
            };
            let config = sys::CUlaunchConfig {
                gridDimX: geometry.grid,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: geometry.block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: geometry.shared_bytes,
                hStream: self.0.stream,
                attrs: &mut attribute,
                numAttrs: 1,
            };
            // SAFETY: as below; `config` and its one attribute outlive the
            // call, which copies them.
            unsafe {
                sys::cuLaunchKernelEx(&config, function, params.as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
            .map_err(|e| ("cuLaunchKernelEx", e))
        } else {
            // SAFETY: the caller vouched for the device addresses inside `args`;
            // the driver copies the parameter bytes before returning.
            unsafe {
                result::launch_kernel(
                    function,
                    (geometry.grid, 1, 1),
                    (geometry.block, 1, 1),
                    geometry.shared_bytes,
                    self.0.stream,
                    &mut params,
                )
            }
            .map_err(|e| ("cuLaunchKernel", e))
        };
        launched.map_err(|(call, e)| DeviceError::Launch {
            kernel,
            message: driver_error(call, e).to_string(),
        })?;
        if let Some(p) = profile.as_mut() {
            // SAFETY: events of this context; `start` was recorded above.
            let ms = unsafe {
                result::event::record(p.end, self.0.stream)
                    .and_then(|()| result::event::synchronize(p.end))
                    .and_then(|()| result::event::elapsed(p.start, p.end))
            }
            .map_err(|e| driver_error("cuEventElapsedTime", e))?;
            p.launches.push(LaunchTime {
                kernel,
                grid: geometry.grid,
                secs: f64::from(ms) / 1e3,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_errors_that_lose_the_context_are_told_from_those_that_do_not() {
        use sys::CUresult::*;
        for code in [
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_MISALIGNED_ADDRESS,
            CUDA_ERROR_ILLEGAL_INSTRUCTION,
            CUDA_ERROR_ECC_UNCORRECTABLE,
            CUDA_ERROR_ASSERT,
        ] {
            assert!(sticky(code), "{code:?}");
        }
        // Refused calls the context survives: a step may fail, the next run.
        for code in [
            CUDA_SUCCESS,
            CUDA_ERROR_OUT_OF_MEMORY,
            CUDA_ERROR_INVALID_VALUE,
            CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            CUDA_ERROR_NOT_READY,
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        ] {
            assert!(!sticky(code), "{code:?}");
        }
        // No context was lost in this process: nothing here reached a driver.
        assert_eq!(lost(), None);
        let error = DeviceError::Lost {
            call: "cuStreamSynchronize",
            message: "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered".into(),
        };
        assert!(
            error.to_string().ends_with("the process must restart)"),
            "{error}"
        );
    }

    #[test]
    fn a_2d_copy_description_names_both_memory_types_and_nothing_else() {
        // Made on every audit read and transfer of device pages: a zeroed
        // description (no valid `CUmemorytype`) aborted the process here.
        let (device, host) = (
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        );
        let copy = memcpy_2d(device, host);
        assert_eq!((copy.srcMemoryType, copy.dstMemoryType), (device, host));
        assert!(copy.srcHost.is_null() && copy.dstHost.is_null());
        assert!(copy.srcArray.is_null() && copy.dstArray.is_null());
        assert_eq!((copy.srcDevice, copy.dstDevice, copy.Height), (0, 0, 0));
    }
}
