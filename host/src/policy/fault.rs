//! Test builds only (feature `fault-injection`): host calls of a tenant's
//! plugins that block, so the end-to-end tests can show that a plugin call
//! stuck inside a host function is abandoned at its deadline and nobody else
//! waits for it (no host function of a release build is known to block; this
//! stands in for the one that someday might: a store write on a stalled disk).

use crate::tenancy::TenantId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static STALLS: Mutex<Option<HashMap<TenantId, Instant>>> = Mutex::new(None);

/// From now on for `duration`, every host call of `tenant`'s plugins (and
/// operator plugins running for its requests) blocks until then; zero clears.
pub fn stall_host_calls(tenant: TenantId, duration: Duration) {
    let mut stalls = STALLS.lock().unwrap_or_else(|p| p.into_inner());
    let stalls = stalls.get_or_insert_with(HashMap::new);
    if duration.is_zero() {
        stalls.remove(&tenant);
    } else {
        stalls.insert(tenant, Instant::now() + duration);
    }
}

/// Blocks the calling host function while `tenant`'s stall lasts (ending it
/// early releases calls blocked here).
pub fn stall(tenant: TenantId) {
    loop {
        let until = STALLS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(|s| s.get(&tenant).copied());
        match until {
            Some(until) if until > Instant::now() => {
                std::thread::sleep(Duration::from_millis(5));
            }
            _ => return,
        }
    }
}
