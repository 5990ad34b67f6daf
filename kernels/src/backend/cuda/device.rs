//! The device the CUDA backend runs on, behind one trait: an NVIDIA GPU
//! through the CUDA driver ([`super::driver`]), or the emulator that runs the
//! same kernel sources on the CPU in tests (`super::emulator`, with the
//! `emulator` feature).
//!
//! The trait is deliberately raw: device memory is addressed by 64-bit
//! device addresses, and kernels take their one argument struct as bytes.
//! [`DeviceBuffer`] is the owned, bounds-checked allocation everything else
//! uses; the raw methods are `unsafe` because a wrong address is a wild write
//! into device memory (and, on the emulator, into this process).
//!
//! One device has one stream: every operation is ordered after the previous
//! one, `read` waits for everything before it, and a captured graph replays
//! its launches in the order they were captured.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// Why a device operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The CUDA driver answered with an error.
    #[error("CUDA driver: {call}: {message}")]
    Driver {
        /// The call that failed.
        call: &'static str,
        /// The driver's name and description of the error.
        message: String,
    },
    /// The driver answered with one of CUDA's sticky errors (a kernel's
    /// illegal or misaligned address, a failed launch, an uncorrectable ECC
    /// error): the process's context is unusable and every later call fails
    /// the same way until the process restarts ([`super::driver::lost`]).
    #[error(
        "CUDA driver: {call}: {message} (the GPU's context is lost: every later CUDA call of \
         this process fails; the process must restart)"
    )]
    Lost {
        /// The call that failed.
        call: &'static str,
        /// The driver's name and description of the error.
        message: String,
    },
    /// The device has no memory left for an allocation.
    #[error("device memory: {bytes} bytes could not be allocated ({message})")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// What the device said.
        message: String,
    },
    /// Host memory for copies from the device ([`Device::alloc_host`])
    /// could not be had.
    #[error("host memory for device reads: {bytes} bytes could not be allocated ({message})")]
    HostOutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// What the driver or the allocator said.
        message: String,
    },
    /// A kernel launch was refused or failed.
    #[error("kernel {kernel}: {message}")]
    Launch {
        /// The kernel.
        kernel: &'static str,
        /// Why.
        message: String,
    },
    /// An access outside a buffer (a programming error caught before it reached the device).
    #[error("device buffer access [{offset}, +{len}) outside its {bytes} bytes")]
    OutOfBounds {
        /// Offset of the access.
        offset: u64,
        /// Its length.
        len: u64,
        /// The buffer's size.
        bytes: u64,
    },
}

/// A value a 2D fill writes into every element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// All bits clear.
    Zero,
    /// This 16-bit pattern (width must be whole u16s).
    U16(u16),
    /// This 32-bit pattern (width must be whole u32s).
    U32(u32),
}

/// A rectangle of device memory: `rows` rows of `width` bytes, `pitch`
/// bytes apart, from `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rect {
    /// Device address of the first row.
    pub at: u64,
    /// Bytes from one row to the next.
    pub pitch: u64,
    /// Bytes of each row.
    pub width: u64,
    /// Rows.
    pub rows: u64,
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Blocks, x.
    pub grid: u32,
    /// Threads per block, x.
    pub block: u32,
    /// Dynamic shared memory per block.
    pub shared_bytes: u32,
}

/// A captured sequence of launches, replayed as one (a CUDA graph).
pub trait DeviceGraph: Send {
    /// Runs the captured launches again, in order, with the arguments they
    /// were captured with (so what changes from one replay to the next must
    /// live in device memory the launches read).
    fn replay(&self) -> Result<(), DeviceError>;
}

/// A device: memory, copies, fills and kernel launches on one stream.
pub trait Device: Send + Sync + fmt::Debug {
    /// What the device is, for logs and `/readyz` ("NVIDIA H200, sm_90").
    fn describe(&self) -> String;

    /// Total device memory in bytes.
    fn memory_bytes(&self) -> u64;

    /// Largest dynamic shared memory one block may use.
    fn shared_bytes_max(&self) -> u32;

    /// Whether the tensor cores take 8-bit integer products (`mma.sync`
    /// m16n8k32 s8: compute capability 8.0 and later), so that
    /// `matmul_mma` may be launched.
    fn tensor_cores(&self) -> bool;

    /// Allocates `bytes` of zeroed device memory (never managed memory).
    fn alloc(&self, bytes: u64) -> Result<u64, DeviceError>;

    /// Frees an allocation.
    ///
    /// # Safety
    /// `at` and `bytes` are exactly one earlier `alloc`'s, not yet freed,
    /// and no queued or captured work uses it any more.
    unsafe fn free(&self, at: u64, bytes: u64);

    /// Allocates `bytes` (at least 1) of zeroed host memory, 64-byte
    /// aligned, that reads from the device copy into at the bus's speed:
    /// page-locked on a GPU, where a read into pageable memory goes through
    /// the driver's own staging buffer at a fraction of it. Plain memory
    /// where nothing is locked (the emulator).
    fn alloc_host(&self, bytes: usize) -> Result<NonNull<u8>, DeviceError> {
        let layout = host_layout(bytes)?;
        // SAFETY: the layout's size is at least 1.
        NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(
            DeviceError::HostOutOfMemory {
                bytes: bytes as u64,
                message: "the host allocator refused".into(),
            },
        )
    }

    /// Frees host memory from [`Device::alloc_host`].
    ///
    /// # Safety
    /// `at` and `bytes` are exactly one earlier `alloc_host`'s, not yet
    /// freed, and no copy into it is queued.
    unsafe fn free_host(&self, at: NonNull<u8>, bytes: usize) {
        if let Ok(layout) = host_layout(bytes) {
            // SAFETY: allocated by the default `alloc_host` with this layout.
            unsafe { std::alloc::dealloc(at.as_ptr(), layout) }
        }
    }

    /// Copies `src` to device address `at`.
    ///
    /// # Safety
    /// `at..at + src.len()` lies within one live allocation.
    unsafe fn write(&self, at: u64, src: &[u8]) -> Result<(), DeviceError>;

    /// Waits for all queued work, then copies from device address `at` into `dst`.
    ///
    /// # Safety
    /// `at..at + dst.len()` lies within one live allocation.
    unsafe fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Queues a copy of `bytes` from device address `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges lie within live allocations and do not overlap.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: u64) -> Result<(), DeviceError>;

    /// Fills every row of `rect` with `fill` (a device memset).
    ///
    /// # Safety
    /// Every row of `rect` lies within one live allocation.
    unsafe fn fill(&self, rect: Rect, fill: Fill) -> Result<(), DeviceError>;

    /// Waits for queued work, then copies the rows of `rect` into `dst`
    /// (`rect.rows * rect.width` bytes, rows packed).
    ///
    /// # Safety
    /// Every row of `rect` lies within one live allocation.
    unsafe fn read_rect(&self, rect: Rect, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `src` (rows packed) into the rows of `rect`.
    ///
    /// # Safety
    /// Every row of `rect` lies within one live allocation.
    unsafe fn write_rect(&self, rect: Rect, src: &[u8]) -> Result<(), DeviceError>;

    /// Queues kernel `kernel` with its argument struct's bytes.
    ///
    /// # Safety
    /// Every device address in `args`, and every address the kernel derives
    /// from them for this geometry, lies within live allocations.
    unsafe fn launch(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError>;

    /// Queues `kernel` as [`Device::launch`] does, as a dependent of the
    /// launch queued just before it (CUDA's programmatic dependent launch,
    /// compute capability 9.0 and later): its blocks may be placed and begin
    /// while that kernel's last blocks still run, and wait in the kernel
    /// (`common.cuh`'s `grid_dependency`, before any memory is touched) for
    /// it to end. What it computes is the same; what it saves is the gap
    /// between two kernels. A device that has no such launch queues it as
    /// [`Device::launch`] does.
    ///
    /// # Safety
    /// As [`Device::launch`]; and what was queued just before it is a
    /// launch, not a copy or a fill.
    unsafe fn launch_dependent(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's promises are `launch`'s.
        unsafe { self.launch(kernel, geometry, args) }
    }

    /// Whether [`Device::launch_dependent`] launches kernels as dependents
    /// (not merely as [`Device::launch`] does).
    fn dependent_launches(&self) -> bool {
        false
    }

    /// Waits for all queued work.
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Captures the launches `record` queues into a graph instead of running
    /// them. Nothing else may use the device meanwhile.
    fn capture(
        &self,
        record: &mut dyn FnMut() -> Result<(), DeviceError>,
    ) -> Result<Box<dyn DeviceGraph>, DeviceError>;

    /// Counts launches queued so far (graph replays count their launches):
    /// tests use it to show that a refused step launched nothing.
    fn launches(&self) -> u64;

    /// Starts timing launches one by one, for a profile of where a step's
    /// time goes: from here on each launch waits for its kernel to end (so
    /// kernels never overlap, and launch gaps are left out) and keeps its
    /// time, until [`Device::profile_take`]. Captured launches, and so graph
    /// replays, are not timed. A device that cannot time does nothing.
    fn profile_start(&self) {}

    /// The launches timed since [`Device::profile_start`], in order; timing stops.
    fn profile_take(&self) -> Vec<LaunchTime> {
        Vec::new()
    }
}

/// One launch, as a profile timed it (see [`Device::profile_start`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchTime {
    /// The kernel launched.
    pub kernel: &'static str,
    /// Its grid (blocks): the same kernel on different matrices or steps
    /// is told apart by it.
    pub grid: u32,
    /// Seconds the kernel ran, by the device's own clock.
    pub secs: f64,
}

/// An owned device allocation; every access is checked against its size.
pub struct DeviceBuffer {
    device: Arc<dyn Device>,
    at: u64,
    bytes: u64,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.at, self.bytes)
    }
}

impl DeviceBuffer {
    /// `bytes` of zeroed memory on `device`.
    pub fn zeroed(device: &Arc<dyn Device>, bytes: u64) -> Result<DeviceBuffer, DeviceError> {
        let at = device.alloc(bytes.max(1))?;
        Ok(DeviceBuffer {
            device: Arc::clone(device),
            at,
            bytes: bytes.max(1),
        })
    }

    /// A buffer holding `data`.
    pub fn from_bytes(device: &Arc<dyn Device>, data: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let buffer = DeviceBuffer::zeroed(device, data.len() as u64)?;
        buffer.write(0, data)?;
        Ok(buffer)
    }

    /// The device address of byte `offset` (for kernel arguments).
    pub fn at(&self, offset: u64) -> u64 {
        assert!(
            offset <= self.bytes,
            "offset {offset} past {} bytes",
            self.bytes
        );
        self.at + offset
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(DeviceError::OutOfBounds {
                offset,
                len,
                bytes: self.bytes,
            }),
        }
    }

    /// Copies `data` to `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check(offset, data.len() as u64)?;
        // SAFETY: the range was checked to lie within this live allocation.
        unsafe { self.device.write(self.at + offset, data) }
    }

    /// Copies from `offset` into `out`, after all queued work.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check(offset, out.len() as u64)?;
        // SAFETY: as above.
        unsafe { self.device.read(self.at + offset, out) }
    }

    /// Copies the first `bytes` of `src` to the start of this buffer (queued).
    pub fn copy_from(&self, src: &DeviceBuffer, bytes: u64) -> Result<(), DeviceError> {
        self.check(0, bytes)?;
        src.check(0, bytes)?;
        assert!(!std::ptr::eq(self, src), "a copy onto itself");
        // SAFETY: both ranges were checked; two live buffers never overlap.
        unsafe { self.device.copy(self.at, src.at, bytes) }
    }

    /// Checks that every row of a rectangle at `offset` lies in the buffer.
    fn check_rect(
        &self,
        offset: u64,
        pitch: u64,
        width: u64,
        rows: u64,
    ) -> Result<Rect, DeviceError> {
        if rows > 0 {
            let last = (rows - 1)
                .checked_mul(pitch)
                .and_then(|r| r.checked_add(offset))
                .ok_or(DeviceError::OutOfBounds {
                    offset,
                    len: u64::MAX,
                    bytes: self.bytes,
                })?;
            self.check(offset, width)?;
            self.check(last, width)?;
        }
        Ok(Rect {
            at: self.at + offset,
            pitch,
            width,
            rows,
        })
    }

    /// Fills `rows` rows of `width` bytes, `pitch` apart, from `offset`.
    pub fn fill(
        &self,
        offset: u64,
        pitch: u64,
        width: u64,
        rows: u64,
        fill: Fill,
    ) -> Result<(), DeviceError> {
        let rect = self.check_rect(offset, pitch, width, rows)?;
        // SAFETY: every row was checked to lie within this live allocation.
        unsafe { self.device.fill(rect, fill) }
    }

    /// Reads `rows` rows of `width` bytes, `pitch` apart, from `offset` into `out`.
    pub fn read_rect(
        &self,
        offset: u64,
        pitch: u64,
        width: u64,
        rows: u64,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        assert_eq!(
            out.len() as u64,
            width * rows,
            "out is not rows * width bytes"
        );
        let rect = self.check_rect(offset, pitch, width, rows)?;
        // SAFETY: as above.
        unsafe { self.device.read_rect(rect, out) }
    }

    /// Writes `data` (rows packed) into `rows` rows of `width` bytes, `pitch` apart, from `offset`.
    pub fn write_rect(
        &self,
        offset: u64,
        pitch: u64,
        width: u64,
        rows: u64,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        assert_eq!(
            data.len() as u64,
            width * rows,
            "data is not rows * width bytes"
        );
        let rect = self.check_rect(offset, pitch, width, rows)?;
        // SAFETY: as above.
        unsafe { self.device.write_rect(rect, data) }
    }
}

/// The layout of the default [`Device::alloc_host`]'s memory.
fn host_layout(bytes: usize) -> Result<Layout, DeviceError> {
    Layout::from_size_align(bytes.max(1), 64).map_err(|_| DeviceError::HostOutOfMemory {
        bytes: bytes as u64,
        message: "past the host's address space".into(),
    })
}

/// Floats in host memory that reads from the device copy into directly
/// ([`Device::alloc_host`]: page-locked on a GPU), zeroed when made.
pub struct HostFloats {
    device: Arc<dyn Device>,
    at: NonNull<f32>,
    len: usize,
}

// SAFETY: the memory is this value's alone, read and written only through
// `&self` and `&mut self`, as a Vec's would be.
unsafe impl Send for HostFloats {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for HostFloats {}

impl fmt::Debug for HostFloats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostFloats({} floats)", self.len)
    }
}

impl HostFloats {
    /// `len` zeroed floats for reads from `device`.
    pub fn zeroed(device: &Arc<dyn Device>, len: usize) -> Result<HostFloats, DeviceError> {
        let bytes = len.checked_mul(4).ok_or(DeviceError::HostOutOfMemory {
            bytes: u64::MAX,
            message: "past the host's address space".into(),
        })?;
        let at = device.alloc_host(bytes)?;
        Ok(HostFloats {
            device: Arc::clone(device),
            at: at.cast(),
            len,
        })
    }

    /// How many floats it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its floats.
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `len` floats, 64-byte aligned, zeroed when allocated and
        // written only as floats since; this value owns them.
        unsafe { std::slice::from_raw_parts(self.at.as_ptr(), self.len) }
    }

    /// Its floats, to write (a read from the device among them).
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as above, borrowed mutably once.
        unsafe { std::slice::from_raw_parts_mut(self.at.as_ptr(), self.len) }
    }
}

impl Drop for HostFloats {
    fn drop(&mut self) {
        // SAFETY: this value owns the allocation; reads into it wait for
        // their copy before they return, so none is queued.
        unsafe { self.device.free_host(self.at.cast(), self.len * 4) };
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Work queued on the buffer ends before it is freed.
        let _ = self.device.synchronize();
        // SAFETY: this buffer owns the allocation, and nothing queued uses it now.
        unsafe { self.device.free(self.at, self.bytes) };
    }
}
