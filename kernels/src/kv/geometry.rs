//! Pool geometry: how many pages, and how one page's values are laid out.
//!
//! A page holds K and V for `page_tokens` positions across every layer, each
//! value a [`KvType`] (f16 by default, f32 as the reference):
//!
//! ```text
//! page   // [layer][k|v][page_tokens][kv_heads * head_dim]
//!
//!   layer 0                          layer 1
//!   ┌──────────────┬──────────────┐  ┌──────────────┬──────────────┐
//!   │ K [t][kv_dim]│ V [t][kv_dim]│  │ K [t][kv_dim]│ V [t][kv_dim]│ ...
//!   └──────────────┴──────────────┘  └──────────────┴──────────────┘
//!   ^ layer_offset(0)                ^ layer_offset(1)
//! ```
//!
//! K (and V) for one layer is contiguous `[page_tokens][kv_dim]`, so attention reads one
//! slice per page and layer. [`PoolGeometry`] is the configuration; [`PageLayout`] is
//! the validated form with every size precomputed (in values, and in bytes where
//! a name says so), and is the only way to get offsets. Offsets are in a page's
//! logical view above; where the values sit in memory is the storage's choice
//! (host storage is layer-major, K apart from V, see [`super::storage`]).

use super::storage::KvType;
use thiserror::Error;

/// Most pages in one pool. Leaves `PageId(u32)` headroom and bounds the page arrays.
pub const PAGES_COUNT_MAX: u32 = 1 << 24;
/// Most token positions in one page.
pub const PAGE_TOKENS_MAX: u32 = 1024;
/// Most transformer layers.
pub const LAYERS_MAX: u32 = 256;
/// Most KV heads per layer.
pub const KV_HEADS_MAX: u32 = 256;
/// Most values per head.
pub const HEAD_DIM_MAX: u32 = 1024;
/// Most bytes of KV storage in one pool (host memory, allocated once at startup).
pub const POOL_BYTES_MAX: u64 = 64 << 30;
/// The widest stored KV value, in bytes (f32).
const VALUE_BYTES_MAX: u64 = KvType::F32.bytes();

// The product of every per-field maximum (times 2 for K and V) fits in u64, so the
// checked size computation below can only fail on the named limits.
const _: () = assert!(
    (PAGES_COUNT_MAX as u128)
        * (PAGE_TOKENS_MAX as u128)
        * (LAYERS_MAX as u128)
        * (KV_HEADS_MAX as u128)
        * (HEAD_DIM_MAX as u128)
        * 2
        * (VALUE_BYTES_MAX as u128)
        <= u64::MAX as u128
);

/// The shape of a pool, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Pages in the pool.
    pub pages_count: u32,
    /// Token positions per page.
    pub page_tokens: u32,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Values per head.
    pub head_dim: u32,
    /// How each value is stored.
    pub kv_type: KvType,
}

/// Why a geometry was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GeometryError {
    /// A dimension is zero.
    #[error("pool geometry field `{field}` is zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A dimension is above its named limit.
    #[error("pool geometry field `{field}` is {value}, above its maximum {max}")]
    AboveMax {
        /// The field's name.
        field: &'static str,
        /// The configured value.
        value: u32,
        /// The limit.
        max: u32,
    },
    /// The whole pool is larger than `POOL_BYTES_MAX`.
    #[error("pool needs {bytes} bytes, above pool_bytes_max {max}")]
    PoolTooLarge {
        /// Bytes the geometry needs.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The pool does not fit this machine's address space.
    #[error("pool needs {bytes} bytes, more than this target can address")]
    AddressSpace {
        /// Bytes the geometry needs.
        bytes: u64,
    },
}

impl PoolGeometry {
    /// Validates every field and the total size, and precomputes the page layout.
    pub fn layout(&self) -> Result<PageLayout, GeometryError> {
        let fields = [
            ("pages_count", self.pages_count, PAGES_COUNT_MAX),
            ("page_tokens", self.page_tokens, PAGE_TOKENS_MAX),
            ("layers", self.layers, LAYERS_MAX),
            ("kv_heads", self.kv_heads, KV_HEADS_MAX),
            ("head_dim", self.head_dim, HEAD_DIM_MAX),
        ];
        for (field, value, max) in fields {
            if value == 0 {
                return Err(GeometryError::Zero { field });
            }
            if value > max {
                return Err(GeometryError::AboveMax { field, value, max });
            }
        }
        // Cannot overflow: every factor is at most its maximum (const assert above).
        let kv_dim = u64::from(self.kv_heads) * u64::from(self.head_dim);
        let slab_values = u64::from(self.page_tokens) * kv_dim;
        let page_values = u64::from(self.layers) * 2 * slab_values;
        let pool_values = u64::from(self.pages_count) * page_values;
        let bytes = pool_values * self.kv_type.bytes();
        if bytes > POOL_BYTES_MAX {
            return Err(GeometryError::PoolTooLarge {
                bytes,
                max: POOL_BYTES_MAX,
            });
        }
        let to_usize =
            |n: u64| usize::try_from(n).map_err(|_| GeometryError::AddressSpace { bytes });
        // Every other size divides the byte count, so converting that is enough.
        to_usize(bytes)?;
        Ok(PageLayout {
            geometry: *self,
            kv_dim: to_usize(kv_dim)?,
            slab_values: to_usize(slab_values)?,
            page_values: to_usize(page_values)?,
            pool_values: to_usize(pool_values)?,
        })
    }
}

/// A validated geometry with every size in values (`usize`, for indexing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLayout {
    geometry: PoolGeometry,
    /// `kv_heads * head_dim`: values per token per K (or V) per layer.
    kv_dim: usize,
    /// `page_tokens * kv_dim`: one layer's K (or V) in one page.
    slab_values: usize,
    /// `layers * 2 * slab_values`: one page.
    page_values: usize,
    /// `pages_count * page_values`: the pool.
    pool_values: usize,
}

impl PageLayout {
    /// The geometry this layout was validated from.
    pub fn geometry(&self) -> PoolGeometry {
        self.geometry
    }

    /// Values per token in one layer's K (or V): `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Values in one layer's K (or V) within a page: `[page_tokens][kv_dim]`.
    pub fn slab_values(&self) -> usize {
        self.slab_values
    }

    /// Values in one page.
    pub fn page_values(&self) -> usize {
        self.page_values
    }

    /// Bytes in one page.
    pub fn page_bytes(&self) -> usize {
        // Cannot overflow: the pool's byte size was checked to fit usize.
        self.page_values * self.geometry.kv_type.bytes() as usize
    }

    /// Values in the whole pool.
    pub fn pool_values(&self) -> usize {
        self.pool_values
    }

    /// Bytes in the whole pool.
    pub fn pool_bytes(&self) -> u64 {
        self.pool_values as u64 * self.geometry.kv_type.bytes()
    }

    /// KV bytes one token position takes, across every layer (K and V).
    pub fn position_bytes(&self) -> u64 {
        (self.page_values / self.geometry.page_tokens as usize) as u64
            * self.geometry.kv_type.bytes()
    }

    /// Where a page starts in the pool's storage.
    pub fn page_offset(&self, page: usize) -> usize {
        assert!(
            page < self.geometry.pages_count as usize,
            "page {page} out of range"
        );
        page * self.page_values
    }

    /// Where a layer's K starts within a page.
    pub fn layer_offset(&self, layer: u32) -> usize {
        assert!(layer < self.geometry.layers, "layer {layer} out of range");
        layer as usize * 2 * self.slab_values
    }

    /// Where a layer's K starts within a page (same as `layer_offset`).
    pub fn k_offset(&self, layer: u32) -> usize {
        self.layer_offset(layer)
    }

    /// Where a layer's V starts within a page.
    pub fn v_offset(&self, layer: u32) -> usize {
        self.layer_offset(layer) + self.slab_values
    }

    /// Where a token slot starts within one K (or V) slab.
    pub fn slot_offset(&self, slot: u32) -> usize {
        assert!(slot < self.geometry.page_tokens, "slot {slot} out of range");
        slot as usize * self.kv_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> PoolGeometry {
        PoolGeometry {
            pages_count: 4,
            page_tokens: 3,
            layers: 2,
            kv_heads: 2,
            head_dim: 5,
            kv_type: KvType::F32,
        }
    }

    #[test]
    fn layout_sizes_follow_the_shape_comment() {
        let layout = small().layout().unwrap();
        assert_eq!(layout.kv_dim(), 10);
        assert_eq!(layout.slab_values(), 30);
        assert_eq!(layout.page_values(), 2 * 2 * 30);
        assert_eq!(layout.page_bytes(), 120 * 4);
        assert_eq!(layout.pool_values(), 4 * 120);
        assert_eq!(layout.pool_bytes(), 4 * 120 * 4);
        assert_eq!(layout.position_bytes(), 40 * 4);
        assert_eq!(layout.page_offset(3), 360);
        let half = PoolGeometry {
            kv_type: KvType::F16,
            ..small()
        }
        .layout()
        .unwrap();
        assert_eq!(half.page_values(), 120);
        assert_eq!(half.page_bytes(), 120 * 2);
        assert_eq!(half.pool_bytes(), 4 * 120 * 2);
    }

    #[test]
    fn layer_slabs_tile_the_page_without_overlap() {
        let layout = small().layout().unwrap();
        let mut covered = vec![0u8; layout.page_values()];
        for layer in 0..2 {
            for start in [layout.k_offset(layer), layout.v_offset(layer)] {
                for slot in 0..3 {
                    let at = start + layout.slot_offset(slot);
                    covered[at..at + layout.kv_dim()]
                        .iter_mut()
                        .for_each(|c| *c += 1);
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
    }

    #[test]
    fn rejects_zero_dimension() {
        let geometry = PoolGeometry {
            head_dim: 0,
            ..small()
        };
        assert_eq!(
            geometry.layout(),
            Err(GeometryError::Zero { field: "head_dim" })
        );
    }

    #[test]
    fn rejects_dimension_above_its_max() {
        let geometry = PoolGeometry {
            layers: LAYERS_MAX + 1,
            ..small()
        };
        assert!(matches!(
            geometry.layout(),
            Err(GeometryError::AboveMax {
                field: "layers",
                ..
            })
        ));
    }

    #[test]
    fn rejects_pool_above_bytes_max() {
        let geometry = PoolGeometry {
            pages_count: PAGES_COUNT_MAX,
            page_tokens: PAGE_TOKENS_MAX,
            layers: LAYERS_MAX,
            kv_heads: KV_HEADS_MAX,
            head_dim: HEAD_DIM_MAX,
            kv_type: KvType::F32,
        };
        assert!(matches!(
            geometry.layout(),
            Err(GeometryError::PoolTooLarge { .. })
        ));
    }

    #[test]
    #[should_panic(expected = "layer 2 out of range")]
    fn layer_offset_asserts_its_range() {
        small().layout().unwrap().layer_offset(2);
    }
}
