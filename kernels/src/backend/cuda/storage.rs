//! KV pages in device memory: one allocation per pool, in the host storage's
//! layer-major layout, `// [layer][k|v][pages_count][page_tokens][kv_dim]`,
//! so a page is `2 * layers` slabs at a fixed stride.
//!
//! Storage operations on the device:
//!
//! ```text
//! scrub, poison   one 2D memset over the page's slabs (pitch: the slab stride)
//! is_zero, reads  a 2D copy of the page's slabs to the host (audits, tests, transfers)
//! writes          a 2D copy from the host (a transfer's pages, tests)
//! digest          the page_digest kernel: the host's XXH3 over the transfer's
//!                 bytes, computed where the values are (kernels/cuda/pages.cu)
//! ```
//!
//! The page book makes every decision before it calls in; storage makes
//! none. A failed device operation panics: the device's state is then
//! unknown, and the engine's supervisor restarts the engine rather than serve
//! from it.

use super::device::{Device, DeviceBuffer, DeviceError, Fill, Geometry};
use super::launch::{DigestArgs, KernelArgs};
use crate::kv::{
    DeviceValues, KvSlab, KvType, PageLayout, PageStorage, POISON_BITS, POISON_BITS_F16,
};
use half::f16;
use std::sync::{Arc, Mutex};

/// A pool's pages on a device.
pub struct DeviceStorage {
    layout: PageLayout,
    values: DeviceBuffer,
    /// Entries (page, used) and outputs of digest launches, one page at a time.
    digest: Mutex<DeviceBuffer>,
}

impl std::fmt::Debug for DeviceStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceStorage({:?}, {:?})",
            self.layout.geometry(),
            self.values
        )
    }
}

/// The identity of a device, as [`DeviceValues::device`] carries it.
pub fn device_identity(device: &Arc<dyn Device>) -> u64 {
    Arc::as_ptr(device).cast::<()>() as u64
}

/// Panics with the failed operation: see the module doc.
fn expect_device<T>(result: Result<T, DeviceError>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("device storage: {what}: {e}"))
}

impl DeviceStorage {
    /// Every page of `layout` on `device`, zeroed.
    pub fn new(device: &Arc<dyn Device>, layout: PageLayout) -> Result<DeviceStorage, DeviceError> {
        Ok(DeviceStorage {
            values: DeviceBuffer::zeroed(device, layout.pool_bytes())?,
            digest: Mutex::new(DeviceBuffer::zeroed(device, 16)?),
            layout,
        })
    }

    fn value_bytes(&self) -> u64 {
        self.layout.geometry().kv_type.bytes()
    }

    fn slab_bytes(&self) -> u64 {
        self.layout.slab_values() as u64 * self.value_bytes()
    }

    /// The page's slabs as rows of a rectangle: (offset, pitch, rows).
    fn page_rows(&self, page: usize) -> (u64, u64, u64) {
        let geometry = self.layout.geometry();
        assert!(
            page < geometry.pages_count as usize,
            "page {page} out of range"
        );
        let slab = self.slab_bytes();
        (
            page as u64 * slab,
            u64::from(geometry.pages_count) * slab,
            2 * u64::from(geometry.layers),
        )
    }

    fn fill(&self, page: usize, fill: Fill) {
        let (offset, pitch, rows) = self.page_rows(page);
        expect_device(
            self.values
                .fill(offset, pitch, self.slab_bytes(), rows, fill),
            "fill",
        );
    }

    /// The page's first `tokens_used` slots of every slab, in the transfer's order.
    fn used_rows(&self, page: usize, tokens_used: u32) -> Vec<u8> {
        let (offset, pitch, rows) = self.page_rows(page);
        let width = u64::from(tokens_used) * self.layout.kv_dim() as u64 * self.value_bytes();
        let mut out = vec![0u8; (width * rows) as usize];
        expect_device(
            self.values.read_rect(offset, pitch, width, rows, &mut out),
            "read",
        );
        out
    }

    /// Stores `values` (f32) at logical page offset `at` of the
    /// `// [layer][k|v][page_tokens][kv_dim]` view, never crossing a slab.
    fn write_row(&self, page: usize, at: usize, values: &[f32]) {
        let slab = self.layout.slab_values();
        let (layer, kv, within) = (at / (2 * slab), at / slab % 2, at % slab);
        let pages = self.layout.geometry().pages_count as usize;
        let index = ((layer * 2 + kv) * pages + page) * slab + within;
        let bytes: Vec<u8> = match self.layout.geometry().kv_type {
            KvType::F16 => values
                .iter()
                .flat_map(|&x| {
                    <f16 as crate::kv::KvValue>::from_f32(x)
                        .to_bits()
                        .to_le_bytes()
                })
                .collect(),
            KvType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        expect_device(
            self.values.write(index as u64 * self.value_bytes(), &bytes),
            "write",
        );
    }
}

impl PageStorage for DeviceStorage {
    fn kv_type(&self) -> KvType {
        self.layout.geometry().kv_type
    }

    fn write_token(&mut self, page: usize, k_at: usize, v_at: usize, k: &[f32], v: &[f32]) {
        self.write_row(page, k_at, k);
        self.write_row(page, v_at, v);
    }

    fn scrub(&mut self, page: usize) {
        self.fill(page, Fill::Zero);
    }

    fn poison(&mut self, page: usize) {
        let fill = match self.kv_type() {
            KvType::F16 => Fill::U16(POISON_BITS_F16),
            KvType::F32 => Fill::U32(POISON_BITS),
        };
        self.fill(page, fill);
    }

    fn is_zero(&self, page: usize) -> bool {
        let (offset, pitch, rows) = self.page_rows(page);
        let width = self.slab_bytes();
        let mut out = vec![0u8; (width * rows) as usize];
        expect_device(
            self.values.read_rect(offset, pitch, width, rows, &mut out),
            "read",
        );
        out.iter().all(|&b| b == 0)
    }

    fn digest(&self, page: usize, tokens_used: u32) -> u64 {
        let geometry = self.layout.geometry();
        assert!(
            page < geometry.pages_count as usize,
            "page {page} out of range"
        );
        assert!(
            tokens_used <= geometry.page_tokens,
            "tokens_used above page_tokens"
        );
        let scratch = self.digest.lock().unwrap_or_else(|e| e.into_inner());
        let mut entry = [0u8; 8];
        entry[..4].copy_from_slice(&(page as u32).to_le_bytes());
        entry[4..].copy_from_slice(&tokens_used.to_le_bytes());
        expect_device(scratch.write(0, &entry), "write");
        let args = DigestArgs {
            kv: self.values.at(0),
            pages: scratch.at(0),
            out: scratch.at(8),
            layers: geometry.layers,
            pages_count: geometry.pages_count,
            page_tokens: geometry.page_tokens,
            kv_dim: self.layout.kv_dim() as u32,
            value_bytes: self.value_bytes() as u32,
            unused: 0,
        };
        let geometry = Geometry {
            grid: 1,
            block: super::launch::DIGEST_BLOCK,
            shared_bytes: 0,
        };
        // SAFETY: the kernel reads the one entry at `pages`, writes 8 bytes
        // at `out`, and reads only the used slots of that page, which lie in
        // `values` (the page is below pages_count, checked above).
        expect_device(
            unsafe {
                self.values
                    .device()
                    .launch(DigestArgs::KERNEL, geometry, args.bytes())
            },
            "digest",
        );
        let mut out = [0u8; 8];
        expect_device(scratch.read(8, &mut out), "read");
        u64::from_le_bytes(out)
    }

    fn host(&self, _page: usize, _layer: u32) -> Option<(KvSlab<'_>, KvSlab<'_>)> {
        None
    }

    fn device(&self) -> Option<DeviceValues> {
        Some(DeviceValues {
            device: device_identity(self.values.device()),
            at: self.values.at(0),
        })
    }

    fn read_rows(&self, page: usize, tokens_used: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.used_rows(page, tokens_used));
    }

    fn write_rows(&mut self, page: usize, tokens_used: u32, bytes: &[u8]) {
        let (offset, pitch, rows) = self.page_rows(page);
        let width = u64::from(tokens_used) * self.layout.kv_dim() as u64 * self.value_bytes();
        assert_eq!(bytes.len() as u64, width * rows, "rows of another length");
        expect_device(
            self.values.write_rect(offset, pitch, width, rows, bytes),
            "write",
        );
    }

    fn holds_rows(&self, page: usize, tokens_used: u32, bytes: &[u8], digest: u64) -> bool {
        // Hashed where the values are; the length is checked here, since the
        // digest of the stored slots says nothing about `bytes` itself.
        let rows = 2 * u64::from(self.layout.geometry().layers);
        let width = u64::from(tokens_used) * self.layout.kv_dim() as u64 * self.value_bytes();
        bytes.len() as u64 == width * rows && self.digest(page, tokens_used) == digest
    }
}
