//! Tenant partitions of a pool and their capacity arithmetic (I8).
//!
//! Each owner has `pages_reserved` (theirs alone) and `pages_max` (a hard ceiling).
//! What an owner *holds* counts every page it keeps from others:
//!
//! ```text
//! pages_held    = pages_booked (reserved, not yet acquired)
//!               + pages_owned  (acquired, in a page table)
//!               + pages_shared (its prefix cache: read-only, in its tables or kept;
//!                               pages_shared_idle of them in no table, evictable)
//!               + pages_released (released, dirty until scrubbed: still charged to it)
//! pages_claimed = max(pages_held, pages_reserved)   // what the owner keeps from the pool
//!
//! invariant:  Σ pages_claimed ≤ pages_count         // nobody eats anybody's reservation
//!             pages_held ≤ pages_max                // per owner
//! ```
//!
//! Pages beyond every reservation form the shared burst region; its free part is
//! `pages_count - Σ pages_claimed`. An owner may reserve up to its own reserved headroom
//! plus the free burst, never above `pages_max`. Because every owner's claim is at least
//! its reservation, another owner's load can never reduce what an owner can still get up
//! to `pages_reserved`. Dirty pages stay charged to their last owner until scrubbed, so
//! one owner's unscrubbed pages delay only itself.

use super::ids::OwnerTag;
use thiserror::Error;

/// Most partitions (tenants) in one pool.
pub const PARTITIONS_MAX: usize = 1024;

/// One owner's share of a pool, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionConfig {
    /// The owner.
    pub owner: OwnerTag,
    /// Pages no other owner can take.
    pub pages_reserved: u32,
    /// The most pages this owner may hold at once (reserved plus burst), ≥ `pages_reserved`.
    pub pages_max: u32,
}

/// Why a partition set, or a change to one partition, was refused. Nothing changed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PartitionError {
    /// More partitions than `PARTITIONS_MAX`.
    #[error("{count} partitions, above partitions_max {max}")]
    TooMany {
        /// Configured partitions.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// One owner configured twice.
    #[error("owner {owner:?} has two partitions")]
    DuplicateOwner {
        /// The owner.
        owner: OwnerTag,
    },
    /// `pages_max` is zero: the owner could never hold a page.
    #[error("owner {owner:?} has pages_max 0")]
    MaxZero {
        /// The owner.
        owner: OwnerTag,
    },
    /// `pages_max < pages_reserved`.
    #[error("owner {owner:?}: pages_max {pages_max} is below pages_reserved {pages_reserved}")]
    MaxBelowReserved {
        /// The owner.
        owner: OwnerTag,
        /// Its reservation.
        pages_reserved: u32,
        /// Its maximum.
        pages_max: u32,
    },
    /// `pages_max` is above the pool's size: a promise the pool cannot keep.
    #[error("owner {owner:?}: pages_max {pages_max} is above the pool's {pages_count} pages")]
    MaxAbovePool {
        /// The owner.
        owner: OwnerTag,
        /// Its maximum.
        pages_max: u32,
        /// The pool's pages.
        pages_count: u32,
    },
    /// The reservations add up to more than the pool.
    #[error("reservations add up to {pages_reserved_sum} pages, above the pool's {pages_count}")]
    ReservedAbovePool {
        /// Σ pages_reserved.
        pages_reserved_sum: u64,
        /// The pool's pages.
        pages_count: u32,
    },
    /// A change names an owner without a partition.
    #[error("owner {owner:?} has no partition in this pool")]
    UnknownOwner {
        /// The owner.
        owner: OwnerTag,
    },
    /// A new or larger reservation whose pages other owners hold right now (they
    /// burst into the region it would take): granting it would take pages from
    /// under them. Retry once they are released.
    #[error(
        "owner {owner:?} would claim {pages_claimed} pages; {pages_unclaimed} are unclaimed now"
    )]
    ClaimUnavailable {
        /// The owner.
        owner: OwnerTag,
        /// What its partition would claim: max(held, pages_reserved).
        pages_claimed: u32,
        /// Pages no owner claims right now (plus what it claims already).
        pages_unclaimed: u64,
    },
    /// A maximum below what the owner holds now.
    #[error("owner {owner:?} holds {pages_held} pages, above the new pages_max {pages_max}")]
    MaxBelowHeld {
        /// The owner.
        owner: OwnerTag,
        /// What it holds (booked, owned, released).
        pages_held: u32,
        /// The refused maximum.
        pages_max: u32,
    },
    /// Removing a partition that still holds pages: its sequences must finish and
    /// its released pages be scrubbed first.
    #[error("owner {owner:?} still holds {pages_held} pages")]
    StillHeld {
        /// The owner.
        owner: OwnerTag,
        /// What it holds.
        pages_held: u32,
    },
}

/// One owner's partition and its live counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Partition {
    pub(super) config: PartitionConfig,
    pub(super) pages_booked: u32,
    pub(super) pages_owned: u32,
    pub(super) pages_shared: u32,
    /// Of `pages_shared`, those no table holds (only the owner's cache
    /// keeps them): evicted when the owner needs pages.
    pub(super) pages_shared_idle: u32,
    pub(super) pages_released: u32,
}

impl Partition {
    /// A partition of `config` holding nothing.
    fn empty(config: PartitionConfig) -> Partition {
        Partition {
            config,
            pages_booked: 0,
            pages_owned: 0,
            pages_shared: 0,
            pages_shared_idle: 0,
            pages_released: 0,
        }
    }

    /// Pages this owner keeps from everyone else right now, reservation aside.
    pub(super) fn pages_held(&self) -> u32 {
        // Cannot overflow: each term is bounded by pages_max ≤ pages_count ≤ 2^24, and
        // the sum is asserted ≤ pages_max after every change.
        self.pages_booked + self.pages_owned + self.pages_shared + self.pages_released
    }

    /// Pages this owner keeps from the pool: its reservation, or more when bursting.
    pub(super) fn pages_claimed(&self) -> u32 {
        self.pages_held().max(self.config.pages_reserved)
    }
}

/// Every partition of a pool, sorted by owner for lookup.
#[derive(Debug)]
pub(super) struct Partitions {
    pub(super) list: Vec<Partition>,
    pages_count: u32,
}

impl Partitions {
    /// Validates the configured partitions against a pool of `pages_count` pages.
    pub(super) fn new(
        configs: &[PartitionConfig],
        pages_count: u32,
    ) -> Result<Self, PartitionError> {
        if configs.len() > PARTITIONS_MAX {
            return Err(PartitionError::TooMany {
                count: configs.len(),
                max: PARTITIONS_MAX,
            });
        }
        let mut pages_reserved_sum: u64 = 0;
        for config in configs {
            validate_one(config, pages_count)?;
            pages_reserved_sum += u64::from(config.pages_reserved);
        }
        if pages_reserved_sum > u64::from(pages_count) {
            return Err(PartitionError::ReservedAbovePool {
                pages_reserved_sum,
                pages_count,
            });
        }
        let mut list: Vec<Partition> = configs
            .iter()
            .map(|&config| Partition::empty(config))
            .collect();
        list.sort_by_key(|p| p.config.owner);
        if let Some(pair) = list
            .windows(2)
            .find(|w| w[0].config.owner == w[1].config.owner)
        {
            return Err(PartitionError::DuplicateOwner {
                owner: pair[0].config.owner,
            });
        }
        Ok(Partitions { list, pages_count })
    }

    /// The index of an owner's partition.
    pub(super) fn index(&self, owner: OwnerTag) -> Option<usize> {
        self.list
            .binary_search_by_key(&owner, |p| p.config.owner)
            .ok()
    }

    /// Adds a partition for a new owner. Its reservation must be unclaimed now.
    pub(super) fn add(&mut self, config: PartitionConfig) -> Result<(), PartitionError> {
        validate_one(&config, self.pages_count)?;
        let Err(at) = self
            .list
            .binary_search_by_key(&config.owner, |p| p.config.owner)
        else {
            return Err(PartitionError::DuplicateOwner {
                owner: config.owner,
            });
        };
        if self.list.len() >= PARTITIONS_MAX {
            return Err(PartitionError::TooMany {
                count: self.list.len() + 1,
                max: PARTITIONS_MAX,
            });
        }
        self.check_claim(None, &config, 0)?;
        self.list.insert(at, Partition::empty(config));
        Ok(())
    }

    /// Changes an owner's reservation and maximum. A larger claim must be
    /// unclaimed now; the maximum may not fall below what the owner holds.
    pub(super) fn set(&mut self, config: PartitionConfig) -> Result<(), PartitionError> {
        validate_one(&config, self.pages_count)?;
        let owner = config.owner;
        let index = self
            .index(owner)
            .ok_or(PartitionError::UnknownOwner { owner })?;
        let pages_held = self.list[index].pages_held();
        if pages_held > config.pages_max {
            return Err(PartitionError::MaxBelowHeld {
                owner,
                pages_held,
                pages_max: config.pages_max,
            });
        }
        self.check_claim(Some(index), &config, pages_held)?;
        self.list[index].config = config;
        Ok(())
    }

    /// Removes an owner's partition; it must hold no page.
    pub(super) fn remove(&mut self, owner: OwnerTag) -> Result<(), PartitionError> {
        let index = self
            .index(owner)
            .ok_or(PartitionError::UnknownOwner { owner })?;
        let pages_held = self.list[index].pages_held();
        if pages_held > 0 {
            return Err(PartitionError::StillHeld { owner, pages_held });
        }
        self.list.remove(index);
        Ok(())
    }

    /// Whether the partition at `index` (None: a new one) may claim what `config`
    /// says while holding `pages_held`: Σ pages_claimed stays ≤ pages_count, so
    /// no page another owner holds now falls inside a reservation.
    fn check_claim(
        &self,
        index: Option<usize>,
        config: &PartitionConfig,
        pages_held: u32,
    ) -> Result<(), PartitionError> {
        let pages_claimed = pages_held.max(config.pages_reserved);
        let claimed_now = index.map_or(0, |i| u64::from(self.list[i].pages_claimed()));
        // Cannot underflow: claimed_now is part of the sum, which is ≤ pages_count.
        let pages_unclaimed = u64::from(self.pages_count) - self.pages_claimed_sum() + claimed_now;
        let reserved_sum: u64 = self
            .list
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != index)
            .map(|(_, p)| u64::from(p.config.pages_reserved))
            .sum::<u64>()
            + u64::from(config.pages_reserved);
        if reserved_sum > u64::from(self.pages_count) {
            return Err(PartitionError::ReservedAbovePool {
                pages_reserved_sum: reserved_sum,
                pages_count: self.pages_count,
            });
        }
        if u64::from(pages_claimed) > pages_unclaimed {
            return Err(PartitionError::ClaimUnavailable {
                owner: config.owner,
                pages_claimed,
                pages_unclaimed,
            });
        }
        Ok(())
    }

    /// Σ pages_claimed over every owner.
    pub(super) fn pages_claimed_sum(&self) -> u64 {
        self.list.iter().map(|p| u64::from(p.pages_claimed())).sum()
    }

    /// How many more pages the owner at `index` could reserve right now: its reserved
    /// headroom plus the free burst region, never above its `pages_max`.
    pub(super) fn pages_available(&self, index: usize) -> u32 {
        let partition = &self.list[index];
        let claimed_sum = self.pages_claimed_sum();
        assert!(
            claimed_sum <= u64::from(self.pages_count),
            "reservations over-committed"
        );
        let claimed_by_others = claimed_sum - u64::from(partition.pages_claimed());
        // Pages neither claimed by another owner nor already held by this one. Cannot
        // underflow: claimed_by_others + held ≤ claimed_sum ≤ pages_count.
        let room =
            u64::from(self.pages_count) - claimed_by_others - u64::from(partition.pages_held());
        assert!(
            partition.pages_held() <= partition.config.pages_max,
            "owner above pages_max"
        );
        let below_max = partition.config.pages_max - partition.pages_held();
        // Fits u32: room ≤ pages_count.
        (room.min(u64::from(below_max))) as u32
    }
}

fn validate_one(config: &PartitionConfig, pages_count: u32) -> Result<(), PartitionError> {
    let owner = config.owner;
    if config.pages_max == 0 {
        return Err(PartitionError::MaxZero { owner });
    }
    if config.pages_max < config.pages_reserved {
        return Err(PartitionError::MaxBelowReserved {
            owner,
            pages_reserved: config.pages_reserved,
            pages_max: config.pages_max,
        });
    }
    if config.pages_max > pages_count {
        return Err(PartitionError::MaxAbovePool {
            owner,
            pages_max: config.pages_max,
            pages_count,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(owner: u32, pages_reserved: u32, pages_max: u32) -> PartitionConfig {
        PartitionConfig {
            owner: OwnerTag(owner),
            pages_reserved,
            pages_max,
        }
    }

    #[test]
    fn rejects_reserved_sum_above_pool() {
        let err = Partitions::new(&[part(1, 6, 8), part(2, 5, 8)], 10).unwrap_err();
        assert_eq!(
            err,
            PartitionError::ReservedAbovePool {
                pages_reserved_sum: 11,
                pages_count: 10
            }
        );
    }

    #[test]
    fn rejects_max_below_reserved() {
        let err = Partitions::new(&[part(1, 4, 3)], 10).unwrap_err();
        assert!(matches!(err, PartitionError::MaxBelowReserved { .. }));
    }

    #[test]
    fn rejects_max_above_pool() {
        let err = Partitions::new(&[part(1, 0, 11)], 10).unwrap_err();
        assert!(matches!(err, PartitionError::MaxAbovePool { .. }));
    }

    #[test]
    fn rejects_zero_max() {
        let err = Partitions::new(&[part(1, 0, 0)], 10).unwrap_err();
        assert_eq!(err, PartitionError::MaxZero { owner: OwnerTag(1) });
    }

    #[test]
    fn rejects_duplicate_owner() {
        let err = Partitions::new(&[part(7, 1, 2), part(3, 1, 2), part(7, 0, 2)], 10).unwrap_err();
        assert_eq!(err, PartitionError::DuplicateOwner { owner: OwnerTag(7) });
    }

    #[test]
    fn accepts_an_empty_partition_set_and_adds_to_it() {
        let mut parts = Partitions::new(&[], 10).unwrap();
        parts.add(part(5, 4, 10)).unwrap();
        assert_eq!(parts.pages_available(parts.index(OwnerTag(5)).unwrap()), 10);
    }

    #[test]
    fn a_new_reservation_may_not_take_pages_another_owner_holds_now() {
        // Owner 1 reserves 2 and bursts to 8 of 10 pages.
        let mut parts = Partitions::new(&[part(1, 2, 10)], 10).unwrap();
        parts.list[0].pages_owned = 8;
        assert_eq!(
            parts.add(part(2, 3, 5)),
            Err(PartitionError::ClaimUnavailable {
                owner: OwnerTag(2),
                pages_claimed: 3,
                pages_unclaimed: 2
            })
        );
        parts.add(part(2, 2, 5)).unwrap();
        // Nor may an existing owner grow its reservation into them.
        let two = parts.index(OwnerTag(2)).unwrap();
        assert!(matches!(
            parts.set(part(2, 3, 5)),
            Err(PartitionError::ClaimUnavailable { .. })
        ));
        assert_eq!(parts.list[two].config, part(2, 2, 5), "nothing changed");
        let one = parts.index(OwnerTag(1)).unwrap();
        parts.list[one].pages_owned = 2;
        parts.set(part(2, 6, 8)).unwrap();
        let one = parts.index(OwnerTag(1)).unwrap();
        assert_eq!(
            parts.pages_available(one),
            2,
            "2 held, 6 reserved by owner 2"
        );
    }

    #[test]
    fn refuses_a_maximum_below_what_is_held_and_removing_a_partition_that_holds_pages() {
        let mut parts = Partitions::new(&[part(1, 2, 10), part(2, 2, 10)], 10).unwrap();
        parts.list[0].pages_released = 4;
        assert_eq!(
            parts.set(part(1, 2, 3)),
            Err(PartitionError::MaxBelowHeld {
                owner: OwnerTag(1),
                pages_held: 4,
                pages_max: 3
            })
        );
        parts.set(part(1, 0, 4)).unwrap();
        assert_eq!(
            parts.remove(OwnerTag(1)),
            Err(PartitionError::StillHeld {
                owner: OwnerTag(1),
                pages_held: 4
            })
        );
        parts.list[0].pages_released = 0;
        parts.remove(OwnerTag(1)).unwrap();
        assert_eq!(
            parts.remove(OwnerTag(1)),
            Err(PartitionError::UnknownOwner { owner: OwnerTag(1) })
        );
        assert!(matches!(
            parts.add(part(2, 1, 1)),
            Err(PartitionError::DuplicateOwner { .. })
        ));
        assert!(matches!(
            parts.add(part(3, 9, 10)),
            Err(PartitionError::ReservedAbovePool { .. })
        ));
    }

    #[test]
    fn available_is_reserved_headroom_plus_free_burst_capped_by_max() {
        // 10 pages: owner 1 reserves 3, owner 2 reserves 4, burst = 3.
        let mut parts = Partitions::new(&[part(1, 3, 5), part(2, 4, 10)], 10).unwrap();
        let one = parts.index(OwnerTag(1)).unwrap();
        let two = parts.index(OwnerTag(2)).unwrap();
        assert_eq!(parts.pages_available(one), 5); // 3 + 3 burst, capped at 5
        assert_eq!(parts.pages_available(two), 7); // 4 + 3 burst
        parts.list[two].pages_owned = 7; // owner 2 takes the whole burst
        assert_eq!(parts.pages_available(one), 3); // its reservation is intact
        assert_eq!(parts.pages_available(two), 0);
    }
}
