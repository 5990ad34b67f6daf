//! Model-based property test of the paged KV pool.
//!
//! Random sequences of operations across four tenants with random reservations and
//! maxima drive a real `Pool` (poison and paranoid modes on) and a trivial model
//! (plain vectors and counters). After every operation the two are compared page by
//! page and counter by counter, `check_page_tables` runs over every live table, and
//! the isolation properties are checked directly:
//!
//! - every reserve is predicted exactly (ok, above max, exhausted, zero);
//! - a tenant can always reserve up to its reserved pages, whatever the others did (I8);
//! - no tenant ever holds more than its maximum;
//! - an acquired page was clean in the model and reads all zeros, even after poison (I4);
//! - reads return exactly what the model says the owner wrote (no page aliasing);
//! - a lease claimed by another tenant or sequence is refused (panics), and a handle
//!   whose lease ended is refused with `StaleHandle`, on read, write and digest (I3);
//! - a partition changed, removed or added while others run (an admin's quota
//!   change) is predicted exactly: a change that would put another tenant's held
//!   pages inside a reservation, or a maximum below what is held, is refused;
//! - shared (prefix-cache) pages: a share, an attach to another sequence of the
//!   same tenant, and an evict are predicted exactly (reference counts, charges,
//!   `InUse`, stale handles after eviction); every holder reads what was written
//!   before the share; a write to a shared page, and an attach or evict by
//!   another tenant, are refused (panic); sequences of another tenant never read it.

use bulkhead_kernels::kv::{
    digest_page, AcquireError, Generation, KvError, KvType, Lease, OwnerTag, PageHandle, PageId,
    PageState, PageTable, PartitionConfig, PartitionError, Pool, PoolGeometry, PoolOptions,
    Reservation, ReserveError, SeqId,
};
use proptest::prelude::*;
use proptest::sample::Index;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

const TENANTS_COUNT: usize = 4;
/// Stale leases remembered for later misuse; older ones are forgotten.
const STALE_LEASES_MAX: usize = 32;

// ---- Expected panics without noise -------------------------------------------------

thread_local! {
    static PANIC_EXPECTED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, which must panic; the panic message is not printed.
fn must_panic(what: &str, f: impl FnOnce()) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !PANIC_EXPECTED.with(Cell::get) {
                default(info);
            }
        }));
    });
    PANIC_EXPECTED.with(|p| p.set(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    PANIC_EXPECTED.with(|p| p.set(false));
    assert!(result.is_err(), "{what} was not refused");
}

// ---- Scenario ----------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Scenario {
    geometry: PoolGeometry,
    partitions: Vec<PartitionConfig>,
    ops: Vec<Op>,
}

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence: reserve `pages` for a tenant (may be refused).
    Reserve { tenant: usize, pages: u32 },
    /// Acquire one page from a sequence's reservation.
    Acquire { seq: Index },
    /// Write one token slot of one page.
    Write {
        seq: Index,
        page: Index,
        layer: u32,
        slot: u32,
        seed: u16,
    },
    /// Read a layer of a page and compare with the model.
    Read { seq: Index, page: Index, layer: u32 },
    /// Digest a page and compare with the model's contents.
    Digest {
        seq: Index,
        page: Index,
        tokens: u32,
    },
    /// Release a sequence's last page.
    ReleaseLast { seq: Index },
    /// Return a sequence's unacquired booking.
    ReleaseReservation { seq: Index },
    /// Finish a sequence: release its pages and its reservation.
    Finish { seq: Index },
    /// Scrub every released page.
    Scrub,
    /// Use a lease whose page was released: must be `StaleHandle` everywhere.
    StaleAccess { lease: Index },
    /// Claim a live page as another tenant or sequence: must be refused.
    CrossAccess {
        seq: Index,
        page: Index,
        tenant: usize,
    },
    /// A tenant asks for all of its remaining reserved pages: must succeed.
    ProbeReserved { tenant: usize },
    /// Change a tenant's reservation and maximum (may be refused).
    Repartition {
        tenant: usize,
        pages_reserved: u32,
        pages_max: u32,
    },
    /// Remove a tenant's partition (refused while it holds pages) and add it
    /// back with a new reservation (or, if that is refused, the old one).
    Rejoin { tenant: usize, pages_reserved: u32 },
    /// Share one page of a sequence (a prefix-cache page).
    Share { seq: Index, page: Index },
    /// Attach a shared page to a sequence (of its tenant, or another: refused).
    Attach { shared: Index, seq: Index },
    /// Evict a shared page (refused while held, stale once evicted).
    Evict { shared: Index },
}

fn op() -> impl Strategy<Value = Op> {
    let tenant = 0..TENANTS_COUNT;
    prop_oneof![
        4 => (tenant.clone(), 0u32..=5).prop_map(|(tenant, pages)| Op::Reserve { tenant, pages }),
        6 => any::<Index>().prop_map(|seq| Op::Acquire { seq }),
        4 => (any::<Index>(), any::<Index>(), 0u32..2, 0u32..3, any::<u16>())
            .prop_map(|(seq, page, layer, slot, seed)| Op::Write { seq, page, layer, slot, seed }),
        2 => (any::<Index>(), any::<Index>(), 0u32..2)
            .prop_map(|(seq, page, layer)| Op::Read { seq, page, layer }),
        1 => (any::<Index>(), any::<Index>(), 0u32..=3)
            .prop_map(|(seq, page, tokens)| Op::Digest { seq, page, tokens }),
        2 => any::<Index>().prop_map(|seq| Op::ReleaseLast { seq }),
        1 => any::<Index>().prop_map(|seq| Op::ReleaseReservation { seq }),
        2 => any::<Index>().prop_map(|seq| Op::Finish { seq }),
        2 => Just(Op::Scrub),
        2 => any::<Index>().prop_map(|lease| Op::StaleAccess { lease }),
        1 => (any::<Index>(), any::<Index>(), tenant.clone())
            .prop_map(|(seq, page, tenant)| Op::CrossAccess { seq, page, tenant }),
        1 => tenant.clone().prop_map(|tenant| Op::ProbeReserved { tenant }),
        1 => (tenant.clone(), 0u32..=8, 0u32..=26).prop_map(|(tenant, pages_reserved, pages_max)| {
            Op::Repartition { tenant, pages_reserved, pages_max }
        }),
        1 => (tenant, 0u32..=8).prop_map(|(tenant, pages_reserved)| Op::Rejoin { tenant, pages_reserved }),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(seq, page)| Op::Share { seq, page }),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(shared, seq)| Op::Attach { shared, seq }),
        2 => any::<Index>().prop_map(|shared| Op::Evict { shared }),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let kv_type = prop_oneof![Just(KvType::F16), Just(KvType::F32)];
    let geometry = (8u32..=24, 1u32..=3, 1u32..=2, 1u32..=2, 1u32..=3, kv_type).prop_map(
        |(pages_count, page_tokens, layers, kv_heads, head_dim, kv_type)| PoolGeometry {
            pages_count,
            page_tokens,
            layers,
            kv_heads,
            head_dim,
            kv_type,
        },
    );
    geometry.prop_flat_map(|geometry| {
        let pages_count = geometry.pages_count;
        // Each reservation ≤ pages/4, so Σ reserved ≤ pages; max in [reserved, pages].
        let partition = (0..=pages_count / 4)
            .prop_flat_map(move |reserved| (Just(reserved), reserved.max(1)..=pages_count));
        let partitions = proptest::collection::vec(partition, TENANTS_COUNT).prop_map(|parts| {
            parts
                .into_iter()
                .enumerate()
                .map(|(i, (pages_reserved, pages_max))| PartitionConfig {
                    owner: owner_of(i),
                    pages_reserved,
                    pages_max,
                })
                .collect::<Vec<_>>()
        });
        let ops = proptest::collection::vec(op(), 1..150);
        (Just(geometry), partitions, ops).prop_map(|(geometry, partitions, ops)| Scenario {
            geometry,
            partitions,
            ops,
        })
    })
}

fn owner_of(tenant: usize) -> OwnerTag {
    // Not 0..4: tags are opaque, and unsorted ones exercise the partition lookup.
    OwnerTag(1000 - 7 * tenant as u32)
}

// ---- The model ---------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ModelState {
    Free,
    Owned { tenant: usize, seq: SeqId },
    Shared { tenant: usize, refs: u32 },
    Released { tenant: usize },
}

#[derive(Clone, Debug)]
struct ModelPage {
    state: ModelState,
    generation: u32,
    /// What the owner wrote: `// [layer][k|v][page_tokens][kv_dim]`, zero when clean.
    floats: Vec<f32>,
}

#[derive(Clone, Copy, Debug, Default)]
struct ModelTenant {
    booked: u32,
    owned: u32,
    shared: u32,
    released: u32,
}

impl ModelTenant {
    fn held(&self) -> u32 {
        self.booked + self.owned + self.shared + self.released
    }
}

/// A live sequence: the real reservation and table, and the model's view.
struct Sequence {
    tenant: usize,
    reservation: Option<Reservation>,
    table: PageTable,
}

struct Harness {
    pool: Pool,
    partitions: Vec<PartitionConfig>,
    pages: Vec<ModelPage>,
    tenants: [ModelTenant; TENANTS_COUNT],
    sequences: Vec<Sequence>,
    stale: Vec<Lease>,
    /// Every handle a share returned, with its tenant (evicted ones too: they
    /// must stay refused).
    shared: Vec<(usize, PageHandle)>,
    seq_next: u64,
}

impl Harness {
    fn new(scenario: &Scenario) -> Harness {
        let options = PoolOptions {
            poison_released: true,
            paranoid: true,
        };
        let pool = Pool::new(scenario.geometry, &scenario.partitions, options).unwrap();
        let page = ModelPage {
            state: ModelState::Free,
            generation: 0,
            floats: vec![0.0; pool.layout().page_values()],
        };
        Harness {
            pool,
            partitions: scenario.partitions.clone(),
            pages: vec![page; scenario.geometry.pages_count as usize],
            tenants: [ModelTenant::default(); TENANTS_COUNT],
            sequences: Vec::new(),
            stale: Vec::new(),
            shared: Vec::new(),
            seq_next: 1,
        }
    }

    fn pages_count(&self) -> u32 {
        self.pages.len() as u32
    }

    /// The model's answer to "how many pages could `tenant` reserve now".
    fn available(&self, tenant: usize) -> u32 {
        let claimed = |u: usize| {
            self.tenants[u]
                .held()
                .max(self.partitions[u].pages_reserved)
        };
        let claimed_by_others: u32 = (0..TENANTS_COUNT)
            .filter(|&u| u != tenant)
            .map(claimed)
            .sum();
        let room = self.pages_count() - claimed_by_others - self.tenants[tenant].held();
        room.min(self.partitions[tenant].pages_max - self.tenants[tenant].held())
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Reserve { tenant, pages } => self.reserve(*tenant, *pages),
            Op::Acquire { seq } => self.acquire(*seq),
            Op::Write {
                seq,
                page,
                layer,
                slot,
                seed,
            } => self.write(*seq, *page, *layer, *slot, *seed),
            Op::Read { seq, page, layer } => self.read(*seq, *page, *layer),
            Op::Digest { seq, page, tokens } => self.digest(*seq, *page, *tokens),
            Op::ReleaseLast { seq } => self.release_last(*seq),
            Op::ReleaseReservation { seq } => self.release_reservation(*seq),
            Op::Finish { seq } => self.finish(*seq),
            Op::Scrub => self.scrub(),
            Op::StaleAccess { lease } => self.stale_access(*lease),
            Op::CrossAccess { seq, page, tenant } => self.cross_access(*seq, *page, *tenant),
            Op::ProbeReserved { tenant } => self.probe_reserved(*tenant),
            Op::Repartition {
                tenant,
                pages_reserved,
                pages_max,
            } => self.repartition(*tenant, *pages_reserved, *pages_max),
            Op::Rejoin {
                tenant,
                pages_reserved,
            } => self.rejoin(*tenant, *pages_reserved),
            Op::Share { seq, page } => self.share(*seq, *page),
            Op::Attach { shared, seq } => self.attach(*shared, *seq),
            Op::Evict { shared } => self.evict(*shared),
        }
    }

    fn share(&mut self, seq: Index, page: Index) {
        let Some(at) = self.pick_seq(seq) else { return };
        let sequence = &self.sequences[at];
        if sequence.table.is_empty() {
            return;
        }
        let index = page.index(sequence.table.pages_count());
        let lease = sequence.table.lease(index).unwrap();
        let model = &mut self.pages[lease.handle.page.0 as usize];
        if !matches!(model.state, ModelState::Owned { .. }) {
            // Already shared (attached here, or shared before): nothing to do.
            return;
        }
        let tenant = sequence.tenant;
        let handle = self.pool.share(&sequence.table, index);
        assert_eq!(handle, lease.handle);
        model.state = ModelState::Shared { tenant, refs: 1 };
        self.tenants[tenant].owned -= 1;
        self.tenants[tenant].shared += 1;
        self.shared.push((tenant, handle));
    }

    fn attach(&mut self, shared: Index, seq: Index) {
        if self.shared.is_empty() {
            return;
        }
        let Some(at) = self.pick_seq(seq) else { return };
        let (tenant, handle) = self.shared[shared.index(self.shared.len())];
        let sequence = &mut self.sequences[at];
        let model = &mut self.pages[handle.page.0 as usize];
        let live = model.generation == handle.generation.0
            && matches!(model.state, ModelState::Shared { .. });
        if !live {
            let result = self.pool.attach(&mut sequence.table, handle);
            assert!(
                matches!(result, Err(KvError::StaleHandle { .. })),
                "{result:?}"
            );
            return;
        }
        if sequence.tenant != tenant {
            // I7: never another tenant's page, whatever the handle says.
            let (pool, table) = (&mut self.pool, &mut sequence.table);
            must_panic("cross-tenant attach", || {
                let _ = pool.attach(table, handle);
            });
            return;
        }
        if sequence.table.handles().contains(&handle) {
            return; // Once per table.
        }
        self.pool.attach(&mut sequence.table, handle).unwrap();
        let ModelState::Shared { refs, .. } = &mut model.state else {
            unreachable!()
        };
        *refs += 1;
    }

    fn evict(&mut self, shared: Index) {
        if self.shared.is_empty() {
            return;
        }
        let (tenant, handle) = self.shared[shared.index(self.shared.len())];
        self.evict_handle(tenant, handle);
    }

    fn evict_handle(&mut self, tenant: usize, handle: PageHandle) {
        let model = &mut self.pages[handle.page.0 as usize];
        let result = self.pool.evict(owner_of(tenant), handle);
        match model.state {
            ModelState::Shared { refs, .. } if model.generation == handle.generation.0 => {
                if refs > 0 {
                    assert_eq!(
                        result,
                        Err(KvError::InUse {
                            page: handle.page,
                            refs
                        })
                    );
                    return;
                }
                result.unwrap();
                model.state = ModelState::Released { tenant };
                model.floats.fill(0.0);
                self.tenants[tenant].shared -= 1;
                self.tenants[tenant].released += 1;
                if self.stale.len() == STALE_LEASES_MAX {
                    self.stale.remove(0);
                }
                self.stale.push(Lease {
                    handle,
                    owner: owner_of(tenant),
                    seq: SeqId(0),
                });
            }
            _ => assert!(
                matches!(result, Err(KvError::StaleHandle { .. })),
                "{result:?}"
            ),
        }
    }

    /// The model's answer to a change of `tenant`'s partition to `config`
    /// (`present`: the tenant has a partition now).
    fn predict_partition(
        &self,
        tenant: usize,
        config: &PartitionConfig,
    ) -> Result<(), &'static str> {
        let pages_count = self.pages_count();
        if config.pages_max == 0 {
            return Err("max zero");
        }
        if config.pages_max < config.pages_reserved {
            return Err("max below reserved");
        }
        if config.pages_max > pages_count {
            return Err("max above pool");
        }
        let held = self.tenants[tenant].held();
        if held > config.pages_max {
            return Err("max below held");
        }
        let others = (0..TENANTS_COUNT).filter(|&u| u != tenant);
        let reserved: u32 = others
            .clone()
            .map(|u| self.partitions[u].pages_reserved)
            .sum();
        if reserved + config.pages_reserved > pages_count {
            return Err("reserved above pool");
        }
        let claimed: u32 = others
            .map(|u| {
                self.tenants[u]
                    .held()
                    .max(self.partitions[u].pages_reserved)
            })
            .sum();
        if claimed + held.max(config.pages_reserved) > pages_count {
            return Err("claim unavailable");
        }
        Ok(())
    }

    fn partition_error_kind(error: &PartitionError) -> &'static str {
        match error {
            PartitionError::MaxZero { .. } => "max zero",
            PartitionError::MaxBelowReserved { .. } => "max below reserved",
            PartitionError::MaxAbovePool { .. } => "max above pool",
            PartitionError::MaxBelowHeld { .. } => "max below held",
            PartitionError::ReservedAbovePool { .. } => "reserved above pool",
            PartitionError::ClaimUnavailable { .. } => "claim unavailable",
            other => panic!("unexpected {other:?}"),
        }
    }

    fn repartition(&mut self, tenant: usize, pages_reserved: u32, pages_max: u32) {
        let config = PartitionConfig {
            owner: owner_of(tenant),
            pages_reserved,
            pages_max,
        };
        let expected = self.predict_partition(tenant, &config);
        let result = self.pool.set_partition(config);
        assert_eq!(
            result.as_ref().map_err(Self::partition_error_kind),
            expected.map(|_| &()),
            "set_partition({config:?})"
        );
        if result.is_ok() {
            self.partitions[tenant] = config;
        }
    }

    fn rejoin(&mut self, tenant: usize, pages_reserved: u32) {
        let owner = owner_of(tenant);
        let held = self.tenants[tenant].held();
        let removed = self.pool.remove_partition(owner);
        if held > 0 {
            assert_eq!(
                removed,
                Err(PartitionError::StillHeld {
                    owner,
                    pages_held: held
                })
            );
            return;
        }
        removed.unwrap();
        // While it is gone, it cannot book anything.
        assert_eq!(
            self.pool.reserve(owner, 1).map(|_| ()).unwrap_err(),
            ReserveError::UnknownOwner { owner }
        );
        let old = self.partitions[tenant];
        let new = PartitionConfig {
            pages_reserved,
            pages_max: old.pages_max.max(pages_reserved),
            ..old
        };
        let expected = self.predict_partition(tenant, &new);
        let added = self.pool.add_partition(new);
        assert_eq!(
            added.as_ref().map_err(Self::partition_error_kind),
            expected.map(|_| &()),
            "add_partition({new:?})"
        );
        if added.is_ok() {
            self.partitions[tenant] = new;
        } else {
            // Its old claim was its own until a moment ago: it is still free.
            self.pool.add_partition(old).unwrap();
        }
    }

    fn reserve(&mut self, tenant: usize, pages: u32) {
        let owner = owner_of(tenant);
        let model = &self.tenants[tenant];
        let limit = &self.partitions[tenant];
        let headroom = limit.pages_reserved.saturating_sub(model.held());
        let result = self.pool.reserve(owner, pages);
        match &result {
            Err(ReserveError::ZeroPages) => assert_eq!(pages, 0),
            Err(ReserveError::AboveMax { .. }) => assert!(model.held() + pages > limit.pages_max),
            Err(ReserveError::Exhausted {
                pages_available, ..
            }) => {
                assert!(model.held() + pages <= limit.pages_max);
                assert_eq!(*pages_available, self.available(tenant));
                assert!(pages > self.available(tenant));
                // I8: a request within the reserved headroom is never refused.
                assert!(pages > headroom, "reserved pages taken by another tenant");
            }
            Err(other) => panic!("unexpected {other:?}"),
            Ok(_) => assert!(pages > 0 && pages <= self.available(tenant)),
        }
        let Ok(reservation) = result else { return };
        self.tenants[tenant].booked += pages;
        let seq = SeqId(self.seq_next);
        self.seq_next += 1;
        let table = self.pool.page_table(&reservation, seq);
        assert_eq!((table.owner(), table.seq()), (owner, seq));
        self.sequences.push(Sequence {
            tenant,
            reservation: Some(reservation),
            table,
        });
    }

    fn acquire(&mut self, seq: Index) {
        let Some(at) = self.pick_seq(seq) else { return };
        let sequence = &mut self.sequences[at];
        let Some(reservation) = sequence.reservation.as_mut() else {
            return;
        };
        let booked = reservation.pages_booked();
        let result = self.pool.acquire(reservation, &mut sequence.table);
        let tenant = sequence.tenant;
        if booked == 0 {
            let owner = owner_of(tenant);
            assert_eq!(result, Err(AcquireError::ReservationExhausted { owner }));
            return;
        }
        let handle = result.unwrap();
        assert_eq!(reservation.pages_booked(), booked - 1);
        let model = &mut self.pages[handle.page.0 as usize];
        // I4: only a clean page is handed out.
        assert_eq!(
            model.state,
            ModelState::Free,
            "dirty or owned page handed out"
        );
        assert!(model.floats.iter().all(|f| f.to_bits() == 0));
        model.generation += 1;
        assert_eq!(handle.generation, Generation(model.generation));
        model.state = ModelState::Owned {
            tenant,
            seq: sequence.table.seq(),
        };
        self.tenants[tenant].booked -= 1;
        self.tenants[tenant].owned += 1;
        // A fresh page reads all zeros, even though released pages are poisoned.
        let lease = sequence
            .table
            .lease(sequence.table.pages_count() - 1)
            .unwrap();
        for layer in 0..self.pool.layout().geometry().layers {
            let (k, v) = self.pool.page_kv(lease, layer).unwrap();
            assert!(k.is_zero() && v.is_zero(), "fresh page not zero");
        }
    }

    fn write(&mut self, seq: Index, page: Index, layer: u32, slot: u32, seed: u16) {
        let Some(lease) = self.pick_lease(seq, page) else {
            return;
        };
        let layout = *self.pool.layout();
        let geometry = layout.geometry();
        let (layer, slot) = (layer % geometry.layers, slot % geometry.page_tokens);
        let k: Vec<f32> = (0..layout.kv_dim())
            .map(|i| f32::from(seed) + i as f32 * 0.5)
            .collect();
        let v: Vec<f32> = k.iter().map(|x| -x - 1.0).collect();
        if matches!(
            self.pages[lease.handle.page.0 as usize].state,
            ModelState::Shared { .. }
        ) {
            assert_eq!(self.pool.is_writable(lease), Ok(false));
            let pool = &mut self.pool;
            must_panic("write to a shared page", || {
                let _ = pool.write_kv(lease, layer, slot, &k, &v);
            });
            return;
        }
        assert_eq!(self.pool.is_writable(lease), Ok(true));
        self.pool.write_kv(lease, layer, slot, &k, &v).unwrap();
        // The model keeps what storage of this type gives back.
        let kv_type = geometry.kv_type;
        let floats = &mut self.pages[lease.handle.page.0 as usize].floats;
        let k_at = layout.k_offset(layer) + layout.slot_offset(slot);
        let v_at = layout.v_offset(layer) + layout.slot_offset(slot);
        for (dst, &x) in floats[k_at..k_at + k.len()].iter_mut().zip(&k) {
            *dst = kv_type.round(x);
        }
        for (dst, &x) in floats[v_at..v_at + v.len()].iter_mut().zip(&v) {
            *dst = kv_type.round(x);
        }
    }

    fn read(&mut self, seq: Index, page: Index, layer: u32) {
        let Some(lease) = self.pick_lease(seq, page) else {
            return;
        };
        let layout = *self.pool.layout();
        let layer = layer % layout.geometry().layers;
        let (k, v) = self.pool.page_kv(lease, layer).unwrap();
        let floats = &self.pages[lease.handle.page.0 as usize].floats;
        let k_at = layout.k_offset(layer);
        let v_at = layout.v_offset(layer);
        assert_eq!(k.to_f32_vec(), &floats[k_at..k_at + layout.slab_values()]);
        assert_eq!(v.to_f32_vec(), &floats[v_at..v_at + layout.slab_values()]);
    }

    fn digest(&mut self, seq: Index, page: Index, tokens: u32) {
        let Some(lease) = self.pick_lease(seq, page) else {
            return;
        };
        let layout = *self.pool.layout();
        let tokens = tokens.min(layout.geometry().page_tokens);
        let floats = &self.pages[lease.handle.page.0 as usize].floats;
        let expected = match layout.geometry().kv_type {
            KvType::F32 => digest_page(&layout, floats, tokens),
            KvType::F16 => {
                let halves: Vec<half::f16> =
                    floats.iter().map(|&x| half::f16::from_f32(x)).collect();
                digest_page(&layout, &halves, tokens)
            }
        };
        assert_eq!(self.pool.digest(lease, tokens), Ok(expected));
    }

    fn release_last(&mut self, seq: Index) {
        let Some(at) = self.pick_seq(seq) else { return };
        let sequence = &mut self.sequences[at];
        let tenant = sequence.tenant;
        let last = sequence.table.pages_count().checked_sub(1);
        let lease = last.and_then(|i| sequence.table.lease(i));
        let released = self.pool.release_last(&mut sequence.table);
        assert_eq!(released, lease.map(|l| l.handle));
        if let Some(lease) = lease {
            self.model_release(tenant, lease);
        }
    }

    fn model_release(&mut self, tenant: usize, lease: Lease) {
        let model = &mut self.pages[lease.handle.page.0 as usize];
        if let ModelState::Shared { refs, .. } = &mut model.state {
            // One holder less; the page stays shared (and its handle live).
            *refs -= 1;
            return;
        }
        assert_eq!(
            model.state,
            ModelState::Owned {
                tenant,
                seq: lease.seq
            }
        );
        model.state = ModelState::Released { tenant };
        model.floats.fill(0.0); // The model's view once scrubbed; unreadable until then.
        self.tenants[tenant].owned -= 1;
        self.tenants[tenant].released += 1;
        if self.stale.len() == STALE_LEASES_MAX {
            self.stale.remove(0);
        }
        self.stale.push(lease);
    }

    fn release_reservation(&mut self, seq: Index) {
        if let Some(at) = self.pick_seq(seq) {
            self.release_reservation_at(at);
        }
    }

    fn release_reservation_at(&mut self, at: usize) {
        let sequence = &mut self.sequences[at];
        let Some(reservation) = sequence.reservation.take() else {
            return;
        };
        let booked = reservation.pages_booked();
        assert_eq!(self.pool.release_reservation(reservation), booked);
        self.tenants[sequence.tenant].booked -= booked;
    }

    fn finish(&mut self, seq: Index) {
        if let Some(at) = self.pick_seq(seq) {
            self.finish_at(at);
        }
    }

    /// The I6 path: the reservation's booking, then every page, go back.
    fn finish_at(&mut self, at: usize) {
        self.release_reservation_at(at);
        let mut sequence = self.sequences.swap_remove(at);
        let leases: Vec<Lease> = (0..sequence.table.pages_count())
            .map(|i| sequence.table.lease(i).unwrap())
            .collect();
        let released = self.pool.release(&mut sequence.table);
        assert_eq!(released as usize, leases.len());
        assert!(sequence.table.is_empty());
        for lease in leases {
            self.model_release(sequence.tenant, lease);
        }
    }

    fn scrub(&mut self) {
        let dirty = self
            .pages
            .iter()
            .filter(|p| matches!(p.state, ModelState::Released { .. }));
        let expected = dirty.count() as u32;
        assert_eq!(self.pool.scrub_released(), expected);
        for page in &mut self.pages {
            if let ModelState::Released { tenant } = page.state {
                page.state = ModelState::Free;
                self.tenants[tenant].released -= 1;
            }
        }
    }

    fn stale_access(&mut self, lease: Index) {
        if self.stale.is_empty() {
            return;
        }
        let lease = self.stale[lease.index(self.stale.len())];
        let stale = Err(KvError::StaleHandle {
            page: lease.handle.page,
            generation: lease.handle.generation,
        });
        let layout = *self.pool.layout();
        let row = vec![9.0; layout.kv_dim()];
        assert_eq!(self.pool.page_kv(lease, 0).map(|_| ()), stale);
        assert_eq!(self.pool.digest(lease, 0).map(|_| ()), stale);
        assert_eq!(self.pool.write_kv(lease, 0, 0, &row, &row), stale);
    }

    fn cross_access(&mut self, seq: Index, page: Index, tenant: usize) {
        let Some(lease) = self.pick_lease(seq, page) else {
            return;
        };
        let intruder = if owner_of(tenant) == lease.owner {
            Lease {
                seq: SeqId(lease.seq.0 + 1_000_000),
                ..lease
            }
        } else {
            Lease {
                owner: owner_of(tenant),
                ..lease
            }
        };
        let shared = matches!(
            self.pages[lease.handle.page.0 as usize].state,
            ModelState::Shared { .. }
        );
        let pool = &mut self.pool;
        let row = vec![9.0; pool.layout().kv_dim()];
        if shared && intruder.owner == lease.owner {
            // Another sequence of the same tenant: a shared page is for reading.
            assert!(pool.page_kv(intruder, 0).is_ok());
            must_panic("write to a shared page", || {
                let _ = pool.write_kv(intruder, 0, 0, &row, &row);
            });
            return;
        }
        must_panic("cross read", || {
            let _ = pool.page_kv(intruder, 0);
        });
        must_panic("cross digest", || {
            let _ = pool.digest(intruder, 0);
        });
        must_panic("cross write", || {
            let _ = pool.write_kv(intruder, 0, 0, &row, &row);
        });
    }

    fn probe_reserved(&mut self, tenant: usize) {
        let held = self.tenants[tenant].held();
        let headroom = self.partitions[tenant].pages_reserved.saturating_sub(held);
        if headroom == 0 {
            return;
        }
        // I8: whatever the other tenants did, the reserved pages are still there.
        let reservation = self.pool.reserve(owner_of(tenant), headroom).unwrap();
        assert_eq!(self.pool.release_reservation(reservation), headroom);
    }

    fn pick_seq(&self, seq: Index) -> Option<usize> {
        (!self.sequences.is_empty()).then(|| seq.index(self.sequences.len()))
    }

    fn pick_lease(&self, seq: Index, page: Index) -> Option<Lease> {
        let table = &self.sequences[self.pick_seq(seq)?].table;
        if table.is_empty() {
            return None;
        }
        table.lease(page.index(table.pages_count()))
    }

    /// Compares the pool with the model and runs the checker.
    fn check(&self) {
        let tables: Vec<&PageTable> = self.sequences.iter().map(|s| &s.table).collect();
        self.pool.check_page_tables(&tables).unwrap();
        for (index, model) in self.pages.iter().enumerate() {
            let meta = self.pool.page_meta(PageId(index as u32)).unwrap();
            let expected = match model.state {
                ModelState::Free => PageState::Free,
                ModelState::Owned { tenant, seq } => PageState::Owned {
                    owner: owner_of(tenant),
                    seq,
                },
                ModelState::Shared { tenant, refs } => PageState::Shared {
                    owner: owner_of(tenant),
                    refs,
                },
                ModelState::Released { tenant } => PageState::Released {
                    owner: owner_of(tenant),
                },
            };
            assert_eq!(meta.state, expected, "page {index}");
            assert_eq!(
                meta.generation,
                Generation(model.generation),
                "page {index}"
            );
        }
        let (mut owned, mut released, mut booked, mut shared) = (0, 0, 0, 0);
        for (tenant, model) in self.tenants.iter().enumerate() {
            let stats = self.pool.partition_stats(owner_of(tenant)).unwrap();
            assert_eq!(stats.pages_booked, model.booked, "tenant {tenant} booked");
            assert_eq!(stats.pages_owned, model.owned, "tenant {tenant} owned");
            assert_eq!(stats.pages_shared, model.shared, "tenant {tenant} shared");
            assert_eq!(
                stats.pages_released, model.released,
                "tenant {tenant} released"
            );
            assert_eq!(
                stats.pages_available,
                self.available(tenant),
                "tenant {tenant} available"
            );
            let limit = &self.partitions[tenant];
            assert!(
                model.held() <= limit.pages_max,
                "tenant {tenant} above its maximum"
            );
            let headroom = limit.pages_reserved.saturating_sub(model.held());
            assert!(
                stats.pages_available >= headroom,
                "tenant {tenant} lost reserved pages"
            );
            (owned, released, booked, shared) = (
                owned + model.owned,
                released + model.released,
                booked + model.booked,
                shared + model.shared,
            );
        }
        let stats = self.pool.stats();
        assert_eq!(
            (
                stats.pages_owned,
                stats.pages_released,
                stats.pages_booked,
                stats.pages_shared
            ),
            (owned, released, booked, shared)
        );
        assert_eq!(
            stats.pages_free + owned + released + shared,
            self.pages_count()
        );
    }

    /// Finishes every sequence and scrubs: the pool must be back to all free.
    fn drain(&mut self) {
        while !self.sequences.is_empty() {
            self.finish_at(0);
            self.check();
        }
        // The caches go too: every shared page, no longer held, evicts.
        for (tenant, handle) in self.shared.clone() {
            self.evict_handle(tenant, handle);
        }
        self.check();
        self.scrub();
        self.check();
        let stats = self.pool.stats();
        assert_eq!(stats.pages_free, self.pages_count());
        assert_eq!(stats.pages_booked, 0);
    }
}

proptest! {
    // 256 cases by default; PROPTEST_CASES=N runs more.
    #[test]
    fn pool_matches_model_after_every_event(scenario in scenario()) {
        let mut harness = Harness::new(&scenario);
        harness.check();
        for op in &scenario.ops {
            harness.apply(op);
            harness.check();
        }
        harness.drain();
    }
}
