//! Page storage: the bytes of a pool's pages, apart from its page book.
//!
//! The [`Pool`](super::Pool) keeps the book: partitions, page states,
//! generations, leases and every invariant check. Behind it a [`PageStorage`]
//! holds the values and knows only pages by index, so it makes no isolation
//! decision: the pool checks a lease before it asks storage for anything.
//!
//! Storage operations are the ones whose cost or encoding depends on where and
//! how the values live: write one token's K and V, scrub (zero) a page, poison
//! it, test it for zero, digest its used slots, and (host storage only) lend a
//! page's slabs to the CPU kernels. Host storage comes in two value types:
//!
//! ```text
//! KvType  bytes   what it is for
//! F16     2       the default: half the memory and half the bytes attention reads;
//!                 values round to nearest even (11 significant bits) and
//!                 saturate at ±65504
//! F32     4       the reference: exactly the activations the backend computed
//! ```
//!
//! The CUDA backend's device storage (`backend::cuda::DeviceStorage`) sits
//! behind the same trait: it lends no host slabs ([`PageStorage::host`] is
//! `None`, and the CPU backend refuses such a pool) but names its device
//! memory ([`PageStorage::device`]) for the kernels.

use super::digest::Xxh64;
use super::geometry::PageLayout;
use half::f16;
use half::vec::HalfBitsVecExt;

/// How one KV value is stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// IEEE half precision, round to nearest even: the default.
    #[default]
    F16,
    /// IEEE single precision: the reference.
    F32,
}

impl KvType {
    /// Bytes per value.
    pub const fn bytes(self) -> u64 {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }

    /// "f16" or "f32".
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        }
    }

    /// The value storage of this type returns for `x`: what a read gives back
    /// after `x` is written.
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvType::F16 => <f16 as KvValue>::from_f32(x).to_f32(),
            KvType::F32 => x,
        }
    }
}

/// A value type host storage can hold. Sealed: f32 and half's f16.
pub trait KvValue: Copy + Send + Sync + std::fmt::Debug + sealed::Sealed + 'static {
    /// Its [`KvType`].
    const TYPE: KvType;
    /// Zero (all bits clear).
    const ZERO: Self;
    /// What released pages are filled with in poison mode: a quiet NaN whose
    /// payload reads "DEAD" (as much of it as fits), so a read before a write
    /// shows up in any output it reaches.
    const POISON: Self;
    /// Rounds `x` to this type (nearest even; f16 saturates at ±65504).
    fn from_f32(x: f32) -> Self;
    /// `len` zeros, allocated zeroed (calloc), so pages never written take
    /// no resident memory: a pool is sized for its whole promise, not its load.
    fn zeroed(len: usize) -> Vec<Self>;
    /// The exact f32 value; branch-free, so loops over it vectorize.
    fn to_f32(self) -> f32;
    /// Whether every bit is clear (-0.0 and NaN count as set).
    fn is_zero_bits(self) -> bool;
    /// Feeds the values' bits, little-endian, in order, to `hasher`.
    fn hash_into(values: &[Self], hasher: &mut Xxh64);
    /// Appends the values' stored bits, little-endian (a transfer's page bytes).
    fn put_bits(values: &[Self], out: &mut Vec<u8>);
    /// Sets `values` from little-endian stored bits (`bytes` is exactly
    /// `values.len()` values long).
    fn set_bits(values: &mut [Self], bytes: &[u8]);
    /// Whether `values` are exactly the little-endian stored bits `bytes`
    /// (false for another length).
    fn same_bits(values: &[Self], bytes: &[u8]) -> bool;
    /// The slab view over a slice of this type.
    fn slab(values: &[Self]) -> KvSlab<'_>;
    /// The values of a slab of this type (`None` for the other type).
    fn values(slab: KvSlab<'_>) -> Option<&[Self]>;
}

/// The largest finite f16.
const F16_MAX: f32 = 65504.0;

/// The bit pattern of [`KvValue::POISON`] for f32.
pub const POISON_BITS: u32 = 0x7FC0_DEAD;
/// The bit pattern of [`KvValue::POISON`] for f16 (a quiet NaN, payload 0xAD).
pub const POISON_BITS_F16: u16 = 0x7EAD;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

impl KvValue for f32 {
    const TYPE: KvType = KvType::F32;
    const ZERO: f32 = 0.0;
    const POISON: f32 = f32::from_bits(POISON_BITS);
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn zeroed(len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn is_zero_bits(self) -> bool {
        self.to_bits() == 0
    }
    fn hash_into(values: &[f32], hasher: &mut Xxh64) {
        let mut bytes = [0u8; 1024];
        for chunk in values.chunks(256) {
            for (out, value) in bytes.chunks_exact_mut(4).zip(chunk) {
                out.copy_from_slice(&value.to_bits().to_le_bytes());
            }
            hasher.write(&bytes[..chunk.len() * 4]);
        }
    }
    fn put_bits(values: &[f32], out: &mut Vec<u8>) {
        out.reserve(values.len() * 4);
        for x in values {
            out.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }
    fn set_bits(values: &mut [f32], bytes: &[u8]) {
        assert_eq!(bytes.len(), values.len() * 4, "bytes of another length");
        for (x, b) in values.iter_mut().zip(bytes.chunks_exact(4)) {
            *x = f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        }
    }
    fn same_bits(values: &[f32], bytes: &[u8]) -> bool {
        // Differences folded, not a short-circuit: the loop vectorizes.
        bytes.len() == values.len() * 4
            && values
                .iter()
                .zip(bytes.chunks_exact(4))
                .fold(0u32, |diff, (x, b)| {
                    diff | (x.to_bits() ^ u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                })
                == 0
    }
    fn slab(values: &[f32]) -> KvSlab<'_> {
        KvSlab::F32(values)
    }
    fn values(slab: KvSlab<'_>) -> Option<&[f32]> {
        match slab {
            KvSlab::F32(values) => Some(values),
            KvSlab::F16(_) => None,
        }
    }
}

impl KvValue for f16 {
    const TYPE: KvType = KvType::F16;
    const ZERO: f16 = f16::from_bits(0);
    const POISON: f16 = f16::from_bits(POISON_BITS_F16);
    fn from_f32(x: f32) -> f16 {
        // Saturate rather than overflow: an infinite key would turn every
        // score of its position into NaN. NaN stays NaN.
        f16::from_f32(x.clamp(-F16_MAX, F16_MAX))
    }
    fn zeroed(len: usize) -> Vec<f16> {
        // `vec![f16::ZERO; len]` would write every element (the zeroed
        // allocation is only taken for types std knows to be zero bits).
        vec![0u16; len].reinterpret_into()
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.to_bits())
    }
    fn is_zero_bits(self) -> bool {
        self.to_bits() == 0
    }
    fn hash_into(values: &[f16], hasher: &mut Xxh64) {
        use half::slice::HalfFloatSliceExt;
        hasher.write_u16s(values.reinterpret_cast());
    }
    fn put_bits(values: &[f16], out: &mut Vec<u8>) {
        out.reserve(values.len() * 2);
        for x in values {
            out.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }
    fn set_bits(values: &mut [f16], bytes: &[u8]) {
        assert_eq!(bytes.len(), values.len() * 2, "bytes of another length");
        for (x, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
            *x = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
    }
    fn same_bits(values: &[f16], bytes: &[u8]) -> bool {
        bytes.len() == values.len() * 2
            && values
                .iter()
                .zip(bytes.chunks_exact(2))
                .fold(0u16, |diff, (x, b)| {
                    diff | (x.to_bits() ^ u16::from_le_bytes([b[0], b[1]]))
                })
                == 0
    }
    fn slab(values: &[f16]) -> KvSlab<'_> {
        KvSlab::F16(values)
    }
    fn values(slab: KvSlab<'_>) -> Option<&[f16]> {
        match slab {
            KvSlab::F16(values) => Some(values),
            KvSlab::F32(_) => None,
        }
    }
}

/// f16 bits to the exact f32, without branches (a select the compiler turns
/// into a blend), so attention loops over f16 pages vectorize: shift exponent
/// and mantissa into place and rescale by 2^112, which also turns f16
/// subnormals into f32 normals exactly; infinities and NaNs keep an all-ones
/// exponent.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    const TWO_POW_112: f32 = f32::from_bits((127 + 112) << 23);
    let bits = u32::from(bits);
    let magnitude = (bits & 0x7FFF) << 13;
    let finite = f32::from_bits(magnitude) * TWO_POW_112;
    let special = f32::from_bits(magnitude | 0x7F80_0000);
    let value = if bits & 0x7C00 == 0x7C00 {
        special
    } else {
        finite
    };
    f32::from_bits(value.to_bits() | ((bits & 0x8000) << 16))
}

/// One layer's K (or V) of one page, `// [page_tokens][kv_dim]`, in its stored type.
#[derive(Clone, Copy, Debug)]
pub enum KvSlab<'a> {
    /// f16 values.
    F16(&'a [f16]),
    /// f32 values.
    F32(&'a [f32]),
}

impl KvSlab<'_> {
    /// Values in the slab.
    pub fn len(&self) -> usize {
        match self {
            KvSlab::F16(values) => values.len(),
            KvSlab::F32(values) => values.len(),
        }
    }

    /// Whether the slab is empty (never, for a real page).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every value as f32 (exact).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            KvSlab::F16(values) => values.iter().map(|v| v.to_f32()).collect(),
            KvSlab::F32(values) => values.to_vec(),
        }
    }

    /// Whether every bit of every value is clear.
    pub fn is_zero(&self) -> bool {
        match self {
            KvSlab::F16(values) => values.iter().all(|v| v.is_zero_bits()),
            KvSlab::F32(values) => values.iter().all(|v| v.is_zero_bits()),
        }
    }
}

/// Where device storage keeps a pool's values, for the backend running on
/// that device: kernels address pages from `at` in the layer-major layout
/// `// [layer][k|v][pages_count][page_tokens][kv_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceValues {
    /// The device's identity (the backend compares it with its own).
    pub device: u64,
    /// Device address of the pool's first value.
    pub at: u64,
}

/// The bytes of a pool's pages, addressed by page index (`0..pages_count`)
/// and value offsets from the pool's [`PageLayout`]. Makes no ownership
/// decision: the pool checks every lease before it calls in.
pub trait PageStorage: std::fmt::Debug + Send + Sync {
    /// The value type.
    fn kv_type(&self) -> KvType;

    /// Writes one token's K and V (`[kv_dim]` each) at value offsets `k_at`
    /// and `v_at` of `page`, rounding to the stored type.
    fn write_token(&mut self, page: usize, k_at: usize, v_at: usize, k: &[f32], v: &[f32]);

    /// Zeroes every value of `page`.
    fn scrub(&mut self, page: usize);

    /// Fills `page` with the type's poison.
    fn poison(&mut self, page: usize);

    /// Whether every value of `page` is zero, bit for bit.
    fn is_zero(&self, page: usize) -> bool;

    /// The digest of the first `tokens_used` slots of `page` (see
    /// [`super::digest`]).
    fn digest(&self, page: usize, tokens_used: u32) -> u64;

    /// K and V of `layer` in `page`, if the values are in host memory.
    fn host(&self, page: usize, layer: u32) -> Option<(KvSlab<'_>, KvSlab<'_>)>;

    /// Where the values live on a device, if they do (device storage only):
    /// the pool's first value, in the layer-major layout of [`HostStorage`].
    fn device(&self) -> Option<DeviceValues> {
        None
    }

    /// Appends the first `tokens_used` slots of `page` as a transfer carries
    /// them: the digest's order without its length prefix (see
    /// [`super::transfer`]).
    fn read_rows(&self, page: usize, tokens_used: u32, out: &mut Vec<u8>);

    /// Sets the first `tokens_used` slots of `page` from `bytes`, laid out as
    /// [`PageStorage::read_rows`] writes them (the pool checks the length).
    fn write_rows(&mut self, page: usize, tokens_used: u32, bytes: &[u8]);

    /// Whether the first `tokens_used` slots of `page` hold exactly `bytes`
    /// (laid out as [`PageStorage::read_rows`] writes them), whose digest is
    /// `digest`. Host storage compares the stored bits with the bytes, which
    /// the receiver already hashed to `digest` as they arrived; storage whose
    /// values are not in host memory may hash them where they are instead.
    /// Either way the answer is about what is stored, not what was sent.
    fn holds_rows(&self, page: usize, tokens_used: u32, bytes: &[u8], digest: u64) -> bool;
}

/// Pages in host memory, allocated once and zeroed.
///
/// Laid out layer-major, K apart from V, not page-major:
/// `// [layer][k|v][pages_count][page_tokens][kv_dim]`. A page is still
/// `layers` pairs of K and V slabs, but one layer's K slabs of every page sit
/// together, and its V slabs likewise, so attention over a long sequence (one
/// layer at a time, K for the scores then V for the weighted sums) reads two
/// contiguous runs where a sequence's pages are in order, which the
/// hardware's prefetch follows: at 8k positions, the difference between
/// streaming and a TLB miss per slab (layer-major against page-major), and
/// again between one run and slabs a slab apart (K apart from V).
#[derive(Debug)]
pub struct HostStorage<T: KvValue> {
    layout: PageLayout,
    values: Vec<T>,
}

impl<T: KvValue> HostStorage<T> {
    /// Every page of `layout`, zeroed.
    pub fn new(layout: PageLayout) -> HostStorage<T> {
        HostStorage {
            layout,
            values: T::zeroed(layout.pool_values()),
        }
    }

    /// Where `page`'s K slab (`kv` 0) or V slab (`kv` 1) of `layer` starts.
    fn slab_at(&self, page: usize, layer: u32, kv: usize) -> usize {
        let geometry = self.layout.geometry();
        assert!(
            page < geometry.pages_count as usize,
            "page {page} out of range"
        );
        assert!(layer < geometry.layers, "layer {layer} out of range");
        let pages_count = geometry.pages_count as usize;
        ((layer as usize * 2 + kv) * pages_count + page) * self.layout.slab_values()
    }

    /// `page`'s K or V slab of `layer`.
    fn slab_mut(&mut self, page: usize, layer: u32, kv: usize) -> &mut [T] {
        let at = self.slab_at(page, layer, kv);
        &mut self.values[at..at + self.layout.slab_values()]
    }

    /// `page`'s (K, V) slabs of `layer`.
    fn slabs(&self, page: usize, layer: u32) -> (&[T], &[T]) {
        let slab = self.layout.slab_values();
        let (k, v) = (self.slab_at(page, layer, 0), self.slab_at(page, layer, 1));
        (&self.values[k..k + slab], &self.values[v..v + slab])
    }

    /// `page`'s (K, V) slabs, layer by layer.
    fn layers(&self, page: usize) -> impl Iterator<Item = (&[T], &[T])> {
        (0..self.layout.geometry().layers).map(move |layer| self.slabs(page, layer))
    }

    /// Writes `x` at logical page offset `at` (a position in the page's
    /// `// [layer][k|v][page_tokens][kv_dim]` view, never crossing a slab).
    fn write_row(&mut self, page: usize, at: usize, x: &[f32]) {
        let slab = self.layout.slab_values();
        let (layer, kv, within) = (at / (2 * slab), at / slab % 2, at % slab);
        let values = self.slab_mut(page, layer as u32, kv);
        for (dst, &x) in values[within..within + x.len()].iter_mut().zip(x) {
            *dst = T::from_f32(x);
        }
    }

    fn fill(&mut self, page: usize, value: T) {
        for layer in 0..self.layout.geometry().layers {
            for kv in 0..2 {
                self.slab_mut(page, layer, kv).fill(value);
            }
        }
    }
}

impl<T: KvValue> PageStorage for HostStorage<T> {
    fn kv_type(&self) -> KvType {
        T::TYPE
    }

    fn write_token(&mut self, page: usize, k_at: usize, v_at: usize, k: &[f32], v: &[f32]) {
        self.write_row(page, k_at, k);
        self.write_row(page, v_at, v);
    }

    fn scrub(&mut self, page: usize) {
        self.fill(page, T::ZERO);
    }

    fn poison(&mut self, page: usize) {
        self.fill(page, T::POISON);
    }

    fn is_zero(&self, page: usize) -> bool {
        self.layers(page)
            .all(|(k, v)| k.iter().chain(v).all(|x| x.is_zero_bits()))
    }

    fn digest(&self, page: usize, tokens_used: u32) -> u64 {
        super::digest::digest_slabs(&self.layout, tokens_used, self.layers(page))
    }

    fn host(&self, page: usize, layer: u32) -> Option<(KvSlab<'_>, KvSlab<'_>)> {
        let (k, v) = self.slabs(page, layer);
        Some((T::slab(k), T::slab(v)))
    }

    fn read_rows(&self, page: usize, tokens_used: u32, out: &mut Vec<u8>) {
        let used = tokens_used as usize * self.layout.kv_dim();
        for (k, v) in self.layers(page) {
            T::put_bits(&k[..used], out);
            T::put_bits(&v[..used], out);
        }
    }

    fn write_rows(&mut self, page: usize, tokens_used: u32, bytes: &[u8]) {
        let used = tokens_used as usize * self.layout.kv_dim();
        let slab_bytes = used * T::TYPE.bytes() as usize;
        let mut rest = bytes;
        for layer in 0..self.layout.geometry().layers {
            for kv in 0..2 {
                let (these, after) = rest.split_at(slab_bytes);
                T::set_bits(&mut self.slab_mut(page, layer, kv)[..used], these);
                rest = after;
            }
        }
        assert!(rest.is_empty(), "rows of another length");
    }

    fn holds_rows(&self, page: usize, tokens_used: u32, bytes: &[u8], _digest: u64) -> bool {
        let used = tokens_used as usize * self.layout.kv_dim();
        if used == 0 {
            return bytes.is_empty();
        }
        let slab_bytes = used * T::TYPE.bytes() as usize;
        if bytes.len() != 2 * slab_bytes * self.layout.geometry().layers as usize {
            return false;
        }
        let mut rows = bytes.chunks_exact(slab_bytes);
        self.layers(page).all(|(k, v)| {
            [k, v].into_iter().all(|slab| {
                rows.next()
                    .is_some_and(|these| T::same_bits(&slab[..used], these))
            })
        })
    }
}

/// Host storage of `layout`'s type, zeroed.
pub fn host_storage(layout: PageLayout) -> Box<dyn PageStorage> {
    match layout.geometry().kv_type {
        KvType::F16 => Box::new(HostStorage::<f16>::new(layout)),
        KvType::F32 => Box::new(HostStorage::<f32>::new(layout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_to_f32_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let ours = f16_to_f32(bits);
            let theirs = f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
                assert_eq!(ours.is_sign_negative(), theirs.is_sign_negative());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#06x}");
            }
        }
    }

    /// Three pages of 2 slots, 2 layers of one 3-wide head.
    fn small_layout(kv_type: KvType) -> PageLayout {
        super::super::geometry::PoolGeometry {
            pages_count: 3,
            page_tokens: 2,
            layers: 2,
            kv_heads: 1,
            head_dim: 3,
            kv_type,
        }
        .layout()
        .unwrap()
    }

    /// Every value of every page, layer, K and V, and slot lands in a place
    /// of its own: each reads back through `host` as written, and scrubbing
    /// or poisoning one page changes no value of another, in both types.
    #[test]
    fn every_slab_of_every_page_has_storage_of_its_own() {
        for kv_type in [KvType::F16, KvType::F32] {
            let layout = small_layout(kv_type);
            let mut storage = host_storage(layout);
            // A value no other (page, layer, k|v, slot, i) has, exact in f16.
            let value = |page: usize, layer: u32, kv: usize, slot: u32, i: usize| {
                (1 + page * 100 + layer as usize * 20 + kv * 10 + slot as usize * 3 + i) as f32
            };
            let row = |page, layer, kv, slot| -> Vec<f32> {
                (0..3).map(|i| value(page, layer, kv, slot, i)).collect()
            };
            for page in 0..3 {
                for layer in 0..2 {
                    for slot in 0..2 {
                        let (k_at, v_at) = (
                            layout.k_offset(layer) + layout.slot_offset(slot),
                            layout.v_offset(layer) + layout.slot_offset(slot),
                        );
                        let (k, v) = (row(page, layer, 0, slot), row(page, layer, 1, slot));
                        storage.write_token(page, k_at, v_at, &k, &v);
                    }
                }
            }
            let expect = |storage: &dyn PageStorage, page: usize| {
                for layer in 0..2 {
                    let (k, v) = storage.host(page, layer).unwrap();
                    for (kv, slab) in [k, v].iter().enumerate() {
                        let want: Vec<f32> =
                            (0..2).flat_map(|slot| row(page, layer, kv, slot)).collect();
                        assert_eq!(
                            slab.to_f32_vec(),
                            want,
                            "{kv_type:?} page {page} layer {layer} kv {kv}"
                        );
                    }
                }
            };
            for page in 0..3 {
                expect(&*storage, page);
            }
            storage.scrub(1);
            assert!(storage.is_zero(1));
            storage.poison(2);
            assert!(!storage.is_zero(2));
            expect(&*storage, 0);
            for layer in 0..2 {
                let (k, v) = storage.host(1, layer).unwrap();
                assert!(k.is_zero() && v.is_zero());
            }
        }
    }

    /// `holds_rows` is true only for exactly the stored bits: after
    /// `write_rows` of any bytes (NaN payloads and signed zeros included), not
    /// for another page, one flipped bit, another length, or a value written
    /// over afterwards.
    #[test]
    fn holds_rows_answers_for_the_stored_bits_only() {
        for kv_type in [KvType::F16, KvType::F32] {
            let layout = small_layout(kv_type);
            let mut storage = host_storage(layout);
            let length = 2 * 2 * 2 * 3 * kv_type.bytes() as usize;
            // Every byte value, NaN and negative-zero patterns among them.
            let bytes: Vec<u8> = (0..length).map(|i| (i * 37 + 11) as u8).collect();
            storage.write_rows(1, 2, &bytes);
            let mut read = Vec::new();
            storage.read_rows(1, 2, &mut read);
            assert_eq!(read, bytes, "{kv_type:?}");
            assert!(storage.holds_rows(1, 2, &bytes, 0), "{kv_type:?}");
            assert!(!storage.holds_rows(0, 2, &bytes, 0), "another page");
            assert!(!storage.holds_rows(1, 2, &bytes[..length - 1], 0));
            assert!(!storage.holds_rows(1, 1, &bytes, 0), "another length");
            assert!(storage.holds_rows(1, 0, &[], 0), "no slots, no bytes");
            for at in [0, length / 2, length - 1] {
                let mut flipped = bytes.clone();
                flipped[at] ^= 0x01;
                assert!(!storage.holds_rows(1, 2, &flipped, 0), "bit at {at}");
            }
            // A later write into a used slot: what is stored changed.
            let k_at = layout.k_offset(1) + layout.slot_offset(1);
            let v_at = layout.v_offset(1) + layout.slot_offset(1);
            storage.write_token(1, k_at, v_at, &[0.5; 3], &[0.25; 3]);
            assert!(!storage.holds_rows(1, 2, &bytes, 0), "{kv_type:?}");
        }
    }

    #[test]
    fn poison_is_a_quiet_nan_in_both_types() {
        assert!(<f16 as KvValue>::POISON.to_f32().is_nan());
        assert!(<f32 as KvValue>::POISON.is_nan());
        assert_eq!(<f32 as KvValue>::POISON.to_bits(), POISON_BITS);
    }

    #[test]
    fn round_is_what_a_read_gives_back() {
        assert_eq!(KvType::F32.round(0.1), 0.1);
        assert_eq!(KvType::F16.round(0.1), f16::from_f32(0.1).to_f32());
        assert_ne!(KvType::F16.round(0.1), 0.1);
        // Nearest even, and saturation (not infinity) past f16's range.
        assert_eq!(KvType::F16.round(2049.0), 2048.0);
        assert_eq!(KvType::F16.round(1e6), 65504.0);
        assert_eq!(KvType::F16.round(-1e6), -65504.0);
        assert!(KvType::F16.round(f32::NAN).is_nan());
    }
}
