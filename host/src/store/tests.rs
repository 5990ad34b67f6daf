//! The store on real sled files: records round-trip inside their version
//! envelope, a record of another version or a broken one is a typed error
//! naming its key, audit sequence numbers follow commits and the oldest go
//! first, usage counters add up, and opening fails cleanly.

use super::records::{AuditRecord, KeyRecord, KeySource, ModelRecord, TenantRecord, UsageRecord};
use super::sled_storage::SledStorage;
use super::usage::UsageBook;
use super::*;
use crate::config::ModelSpec;
use crate::tenancy::{ModelAccess, Quota, TenantId};
use std::path::PathBuf;

fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("bulkhead-store-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tenant(id: u32, name: &str) -> TenantRecord {
    TenantRecord {
        id,
        name: name.into(),
        quota: Quota {
            weight: 2,
            pages_reserved: 4,
            pages_max: 8,
            queue_depth_max: 4,
            running_max: 2,
            pending_max: 2,
            prefix_cache: true,
        },
        models: ModelAccess::All,
        canaries: Vec::new(),
        objective: None,
        created_ms: 1,
        updated_ms: 2,
    }
}

fn audit(action: &str) -> AuditRecord {
    AuditRecord {
        seq: 0,
        at_ms: 5,
        actor: "admin".into(),
        action: action.into(),
        target: "alpha".into(),
        detail: Default::default(),
    }
}

#[test]
fn records_round_trip_and_survive_a_reopen() {
    let dir = temp_dir("roundtrip");
    {
        let store = Store::open(&dir).unwrap();
        assert!(store.meta().unwrap().is_none());
        let mut batch = Batch::default();
        batch
            .put_tenant(&tenant(3, "alpha"))
            .put_tenant(&tenant(12, "beta"))
            .put_tenant_id_next(13)
            .put_key(&KeyRecord {
                id: "key_1".into(),
                tenant: 3,
                sha256: "ab".repeat(32),
                prefix: "bk-alpha-".into(),
                source: KeySource::Env { var: "K".into() },
                created_ms: 9,
                revoked_ms: Some(10),
            })
            .audit(audit("tenant.create"));
        store.commit(batch).unwrap();
    }
    let store = Store::open(&dir).unwrap();
    let tenants = store.tenants().unwrap();
    assert_eq!(tenants, vec![tenant(3, "alpha"), tenant(12, "beta")]);
    assert_eq!(store.tenant_id_next().unwrap(), 13);
    let keys = store.keys().unwrap();
    assert_eq!(keys[0].source, KeySource::Env { var: "K".into() });
    assert_eq!(keys[0].revoked_ms, Some(10));
    let log = store.audit(0, 10).unwrap();
    assert_eq!((log.len(), log[0].seq), (1, 1));
    // Deleting a tenant frees its name.
    let mut batch = Batch::default();
    batch.delete_tenant(&tenant(3, "alpha"));
    store.commit(batch).unwrap();
    assert_eq!(store.tenants().unwrap(), vec![tenant(12, "beta")]);
    assert!(store
        .get::<u32>(&tenant_name_key("alpha"))
        .unwrap()
        .is_none());
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_format_1_tenant_reads_as_one_that_may_use_every_model() {
    let dir = temp_dir("format1");
    let storage = SledStorage::open(&dir).unwrap();
    let v1 = br#"{"v": 1, "record": {"id": 3, "name": "alpha", "quota": {"weight": 2,
        "pages_reserved": 4, "pages_max": 8, "queue_depth_max": 4, "running_max": 2,
        "pending_max": 2}, "created_ms": 1, "updated_ms": 2}}"#;
    storage
        .commit(vec![Write::Put {
            key: tenant_key(3),
            value: v1.to_vec(),
        }])
        .unwrap();
    let store = Store::with_storage(Box::new(storage), "test".into()).unwrap();
    assert_eq!(store.tenants().unwrap(), vec![tenant(3, "alpha")]);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn model_records_round_trip_in_id_order() {
    let dir = temp_dir("models");
    let store = Store::open(&dir).unwrap();
    let record = |id: &str| ModelRecord {
        spec: ModelSpec {
            id: id.into(),
            path: format!("/models/{id}.gguf").into(),
            context_tokens: 2048,
            threads: 2,
            page_tokens: 16,
            pool_pages: 256,
            seq_pages_max: 128,
            step_tokens_max: 256,
            step_seqs_max: 8,
            kv_type: Default::default(),
            backend: None,
        },
        added_ms: 7,
    };
    let mut batch = Batch::default();
    batch
        .put_model(&record("zeta"))
        .put_model(&record("alpha-q8"));
    store.commit(batch).unwrap();
    assert_eq!(
        store.models().unwrap(),
        vec![record("alpha-q8"), record("zeta")]
    );
    let mut batch = Batch::default();
    batch.delete_model("zeta");
    store.commit(batch).unwrap();
    assert_eq!(store.models().unwrap(), vec![record("alpha-q8")]);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_record_of_another_version_or_broken_is_an_error_naming_its_key() {
    let dir = temp_dir("version");
    let storage = SledStorage::open(&dir).unwrap();
    storage
        .commit(vec![
            Write::Put {
                key: tenant_key(1),
                value: br#"{"v": 99, "record": {}}"#.to_vec(),
            },
            Write::Put {
                key: tenant_key(2),
                value: b"{not json".to_vec(),
            },
        ])
        .unwrap();
    let store = Store::with_storage(Box::new(storage), "test".into()).unwrap();
    match store.get::<TenantRecord>(&tenant_key(1)) {
        Err(StoreError::Version { key, version }) => {
            assert_eq!(version, 99);
            assert!(key.starts_with("tenant/"), "{key}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.get::<TenantRecord>(&tenant_key(2)),
        Err(StoreError::Corrupt { .. })
    ));
    assert!(store.tenants().is_err(), "a scan meets the same records");
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_record_under_another_records_key_is_refused_as_corrupt() {
    // Found by fuzzing (fuzz/regressions/store_records/): tenant 4's plugin
    // key holding a record of tenant 8's plugin was listed as tenant 4's,
    // and written back it moved to tenant 8. A record is its key's.
    let dir = temp_dir("misfiled");
    let storage = SledStorage::open(&dir).unwrap();
    let store = Store::with_storage(Box::new(storage), "test".into()).unwrap();
    let mut batch = Batch::default();
    batch.put_tenant(&tenant(1, "alpha"));
    store.commit(batch).unwrap();
    let misfiled = tenant(2, "beta");
    store
        .storage
        .commit(vec![Write::Put {
            key: tenant_key(3),
            value: encode(&misfiled),
        }])
        .unwrap();
    match store.tenants() {
        Err(StoreError::Corrupt { key, cause }) => {
            assert_eq!(key, printable(&tenant_key(3)));
            assert!(cause.contains(&printable(&tenant_key(2))), "{cause}");
        }
        other => panic!("{other:?}"),
    }
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_store_of_another_format_refuses_to_open() {
    let dir = temp_dir("format");
    let storage = SledStorage::open(&dir).unwrap();
    storage
        .commit(vec![Write::Put {
            key: META_FORMAT.to_vec(),
            value: br#"{"v": 7, "record": {"created_ms": 1, "seeded_from": "x"}}"#.to_vec(),
        }])
        .unwrap();
    let error = Store::with_storage(Box::new(storage), "test".into())
        .err()
        .expect("refused");
    assert!(error.to_string().contains("format version 7"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn audit_numbers_follow_commits_and_the_oldest_go_first() {
    let dir = temp_dir("audit");
    let store = Store::open(&dir).unwrap().with_audit_max(5);
    for i in 0..8 {
        let mut batch = Batch::default();
        batch.audit(audit(&format!("a{i}")));
        store.commit(batch).unwrap();
    }
    let log = store.audit(0, 100).unwrap();
    let seqs: Vec<u64> = log.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![4, 5, 6, 7, 8], "the five newest");
    assert_eq!(log[0].action, "a3");
    // Paging.
    let page = store.audit(5, 2).unwrap();
    assert_eq!(page.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![6, 7]);
    // Newest first, below a number; the oldest kept is where it ends.
    let seqs = |records: Vec<AuditRecord>| records.iter().map(|r| r.seq).collect::<Vec<_>>();
    assert_eq!(
        seqs(store.audit_before(u64::MAX, 3).unwrap()),
        vec![8, 7, 6]
    );
    assert_eq!(seqs(store.audit_before(6, 3).unwrap()), vec![5, 4]);
    assert_eq!(seqs(store.audit_before(4, 3).unwrap()), Vec::<u64>::new());
    // Numbering continues after a reopen.
    drop(store);
    let store = Store::open(&dir).unwrap().with_audit_max(5);
    let mut batch = Batch::default();
    batch.audit(audit("after"));
    store.commit(batch).unwrap();
    let log = store.audit(0, 100).unwrap();
    assert_eq!(
        log.last().map(|r| (r.seq, r.action.as_str())),
        Some((9, "after"))
    );
    assert_eq!(log.len(), 5);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn usage_counters_add_up_across_flushes_and_windows() {
    let dir = temp_dir("usage");
    let store = Store::open(&dir).unwrap();
    let book = UsageBook::default();
    let minute = 60_000;
    book.record(TenantId(1), minute, "stop", 10, 5);
    book.record(TenantId(1), minute + 30_000, "length", 20, 7);
    book.record(TenantId(1), 3 * minute, "queue_full", 0, 0);
    book.record(TenantId(2), minute, "stop", 100, 100);
    assert_eq!(book.flush(&store).unwrap(), 0);
    book.record(TenantId(1), minute, "stop", 1, 1);
    book.flush(&store).unwrap();
    let usage = store.usage(1, 0, 10).unwrap();
    assert_eq!(usage.len(), 2);
    let (m, first) = &usage[0];
    assert_eq!(*m, 1);
    assert_eq!(
        (first.requests, first.prompt_tokens, first.completion_tokens),
        (3, 31, 13)
    );
    assert_eq!(first.outcomes["stop"], 2);
    assert_eq!(usage[1].1.outcomes["queue_full"], 1);
    // Windows are half-open, and tenant 2's minutes are its own.
    assert_eq!(store.usage(1, 2, 3).unwrap().len(), 0);
    assert_eq!(store.usage(1, 3, 4).unwrap().len(), 1);
    assert_eq!(store.usage(2, 0, 10).unwrap()[0].1.requests, 1);
    let mut total = UsageRecord::default();
    for (_, u) in &usage {
        total.add(u);
    }
    assert_eq!(total.requests, 4);
    // Retention: minutes before the cutoff go, of every tenant id ever handed out.
    let mut batch = Batch::default();
    batch.put_tenant_id_next(3);
    store.commit(batch).unwrap();
    assert_eq!(
        store.purge_usage_before(2).unwrap(),
        2,
        "minute 1 of tenants 1 and 2"
    );
    assert_eq!(store.usage(1, 0, 10).unwrap().len(), 1);
    assert!(store.usage(2, 0, 10).unwrap().is_empty());
    assert_eq!(store.purge_usage_before(2).unwrap(), 0);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// sled with a small transaction limit, whose commits fail once `fail_after`
/// more have landed.
struct Limited {
    inner: SledStorage,
    fail_after: std::sync::Arc<std::sync::Mutex<Option<u32>>>,
}

impl Storage for Limited {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.inner.scan(prefix, after, limit)
    }
    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        self.inner.last(prefix)
    }
    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError> {
        assert!(
            writes.len() <= 9,
            "a commit over the limit: {}",
            writes.len()
        );
        let mut left = self.fail_after.lock().unwrap();
        match &mut *left {
            Some(0) => return Err(StoreError::Io("planted".into())),
            Some(n) => *n -= 1,
            None => {}
        }
        self.inner.commit_if(expect, writes)
    }
    fn writes_max(&self) -> usize {
        9
    }
}

#[test]
fn a_flush_in_several_commits_that_fails_midway_writes_the_rest_once_later() {
    let dir = temp_dir("flush-chunks");
    let fail_after = std::sync::Arc::new(std::sync::Mutex::new(Some(3)));
    let storage = Limited {
        inner: SledStorage::open(&dir).unwrap(),
        fail_after: std::sync::Arc::clone(&fail_after),
    };
    let store = Store::with_storage(Box::new(storage), "limited".into()).unwrap();
    assert_eq!(store.records_per_commit(), 2);
    let book = UsageBook::new(1);
    for tenant in 1..=4 {
        book.record(TenantId(tenant), 60_000, "stop", 10, 1);
        for _ in 0..3 {
            book.refused(
                TenantId(tenant),
                &format!("t{tenant}"),
                "queue_full",
                audit("request.refused"),
            );
        }
    }
    book.security(audit("request.output_blocked"));
    // 4 usage minutes, 1 security record, 4 listed refusals, 4 summaries:
    // 7 commits; the fourth fails.
    assert!(book.flush(&store).is_err());
    assert_eq!(
        store.audit(0, 100).unwrap().len(),
        2,
        "the three commits that landed"
    );
    // The rest, once: nothing counted twice, nothing lost.
    *fail_after.lock().unwrap() = None;
    book.record(TenantId(1), 60_000, "stop", 10, 1);
    assert_eq!(book.flush(&store).unwrap(), 8);
    for tenant in 1..=4u32 {
        let expected = if tenant == 1 { 2 } else { 1 };
        assert_eq!(
            store.usage_minute(tenant, 1).unwrap().requests,
            expected,
            "tenant {tenant}"
        );
    }
    let records = store.audit(0, 100).unwrap();
    let count = |action: &str| records.iter().filter(|r| r.action == action).count();
    assert_eq!(count("request.output_blocked"), 1);
    assert_eq!(count("request.refused"), 4);
    assert_eq!(count("request.refused_summary"), 4);
    let summarized: u64 = records
        .iter()
        .filter(|r| r.action == "request.refused_summary")
        .map(|r| r.detail["refused"].as_u64().unwrap())
        .sum();
    assert_eq!(summarized, 8, "each tenant's two counted refusals, once");
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn opening_fails_cleanly_on_a_held_lock_or_a_path_below_a_file() {
    let dir = temp_dir("open");
    let held = Store::open(&dir).unwrap();
    match Store::open(&dir) {
        Err(StoreError::Open { path, cause }) => {
            assert_eq!(path, dir.display().to_string());
            assert!(cause.contains("another process"), "{cause}");
        }
        other => panic!("{:?}", other.err()),
    }
    drop(held);
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    match Store::open(&file.join("below")) {
        Err(StoreError::Open { path, .. }) => assert!(path.ends_with("below"), "{path}"),
        other => panic!("{:?}", other.err()),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_database_that_lost_acknowledged_commits_refuses_to_open() {
    let dir = temp_dir("lost");
    {
        let store = Store::open(&dir).unwrap();
        for i in 0..3 {
            let mut batch = Batch::default();
            batch.put_tenant(&tenant(i, &format!("t{i}")));
            store.commit(batch).unwrap();
        }
    }
    let count = dir.join(sled_storage::COMMITS_FILE);
    assert_eq!(std::fs::read_to_string(&count).unwrap().trim(), "3");
    // As if sled had recovered only part of its log.
    std::fs::write(&count, "5\n").unwrap();
    match Store::open(&dir) {
        Err(StoreError::Open { cause, .. }) => {
            assert!(cause.contains("holds 3 commits, but 5 were"), "{cause}")
        }
        other => panic!("{:?}", other.err()),
    }
    // A database ahead of the file (a crash between the two) opens.
    std::fs::write(&count, "2\n").unwrap();
    assert_eq!(Store::open(&dir).unwrap().tenants().unwrap().len(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn format_2_plugins_move_to_their_owners_code_and_identities_once() {
    use super::records::{PluginRecord, PluginStateRecord};
    let dir = temp_dir("migrate");
    let store = Store::open(&dir).unwrap();
    let plugin = |tenant: u32, name: &str| PluginRecord {
        id: 0,
        tenant,
        name: name.into(),
        version: 2,
        sha256: "ab".repeat(32),
        size_bytes: 4,
        enabled: true,
        uploaded_ms: 1,
        order: 0,
        limits: Default::default(),
    };
    let state = |v: &str| PluginStateRecord {
        value_hex: v.into(),
        expires_ms: None,
    };
    // Format 2: alpha and beta uploaded the same bytes (one shared copy);
    // alpha's plugin has state under its name, and the operator plugin
    // "limits" under its name in beta's space.
    let mut batch = Batch::default();
    batch
        .put_tenant(&tenant(1, "alpha"))
        .put_tenant(&tenant(2, "beta"))
        .put_plugin(&plugin(1, "gate"))
        .put_plugin(&plugin(2, "gate"))
        .put_plugin_state(1, "gate", "k", &state("01"))
        .put_plugin_state(2, "limits", "bucket", &state("02"));
    let digest = "ab".repeat(32);
    batch.writes.push(Write::Put {
        key: [LEGACY_WASM_PREFIX, digest.as_bytes()].concat(),
        value: b"wasm".to_vec(),
    });
    batch.writes.push(Write::Put {
        key: [LEGACY_COMPILED_PREFIX, digest.as_bytes()].concat(),
        value: b"sealed".to_vec(),
    });
    store.commit(batch).unwrap();

    assert_eq!(store.migrate_plugins(&["limits".to_string()]).unwrap(), 2);
    let (alpha, beta) = (&store.plugins(1).unwrap()[0], &store.plugins(2).unwrap()[0]);
    assert!(alpha.id != 0 && beta.id != 0 && alpha.id != beta.id);
    let code = store.code().unwrap();
    for p in [alpha, beta] {
        let owner = CodeOwner {
            tenant: p.tenant,
            plugin: p.id,
            version: p.version,
        };
        assert_eq!(
            code.get(owner, CodeKind::Wasm).unwrap().as_deref(),
            Some(&b"wasm"[..])
        );
        assert_eq!(
            code.get(owner, CodeKind::Sealed).unwrap().as_deref(),
            Some(&b"sealed"[..])
        );
    }
    let alpha_identity = format!("#{}", alpha.id);
    assert!(store
        .plugin_state(1, &alpha_identity, "k")
        .unwrap()
        .is_some());
    assert!(store.plugin_state(1, "gate", "k").unwrap().is_none());
    assert!(store
        .plugin_state(2, "@limits", "bucket")
        .unwrap()
        .is_some());
    assert!(store.plugin_state(2, "limits", "bucket").unwrap().is_none());
    assert!(store.keys_after(LEGACY_WASM_PREFIX).unwrap().is_empty());
    assert!(store.keys_after(LEGACY_COMPILED_PREFIX).unwrap().is_empty());
    assert!(store.plugin_id_next().unwrap() > alpha.id.max(beta.id));
    // Once: a second start moves nothing.
    assert_eq!(store.migrate_plugins(&["limits".to_string()]).unwrap(), 0);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn refusal(at_ms: u64, code: &str) -> AuditRecord {
    let mut record = audit("request.refused");
    record.at_ms = at_ms;
    record.detail.insert("code".into(), code.into());
    record
}

#[test]
fn a_tenants_refusal_flood_is_summarized_and_security_events_are_all_kept() {
    let dir = temp_dir("flood");
    let store = Store::open(&dir).unwrap();
    let book = UsageBook::new(4);
    for i in 0..1000 {
        let code = if i % 2 == 0 {
            "invalid_value"
        } else {
            "queue_full"
        };
        book.refused(TenantId(1), "alpha", code, refusal(10 + i, code));
    }
    book.refused(TenantId(2), "beta", "queue_full", refusal(50, "queue_full"));
    for _ in 0..3000 {
        book.security(audit("engine.fault"));
    }
    assert_eq!(book.flush(&store).unwrap(), 996, "summarized, not listed");
    let log = store.audit(0, 10_000).unwrap();
    let count = |action: &str| log.iter().filter(|r| r.action == action).count();
    assert_eq!(count("engine.fault"), 3000, "no security event dropped");
    assert_eq!(count("request.refused"), 5, "four of alpha's, beta's one");
    let summary = log
        .iter()
        .find(|r| r.action == "request.refused_summary")
        .expect("alpha's summary");
    assert_eq!(summary.target, "alpha");
    assert_eq!(summary.detail["refused"], 996);
    assert_eq!(summary.detail["codes"]["invalid_value"], 498);
    assert_eq!(summary.detail["codes"]["queue_full"], 498);
    assert_eq!(
        (
            summary.detail["from_ms"].as_u64(),
            summary.detail["to_ms"].as_u64()
        ),
        (Some(14), Some(1009))
    );
    // The next interval lists again.
    book.refused(
        TenantId(1),
        "alpha",
        "queue_full",
        refusal(2000, "queue_full"),
    );
    assert_eq!(book.flush(&store).unwrap(), 0);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tenants_refusals_past_its_cap_push_out_its_own_oldest_refusals_only() {
    let dir = temp_dir("refusal-cap");
    let store = Store::open(&dir).unwrap().with_refusals_per_tenant_max(10);
    let book = UsageBook::new(1000);
    book.refused(TenantId(2), "beta", "queue_full", refusal(1, "queue_full"));
    let mut batch = Batch::default();
    batch.audit(audit("tenant.update"));
    store.commit(batch).unwrap();
    book.security(audit("request.output_blocked"));
    book.flush(&store).unwrap();
    for round in 0..5 {
        for i in 0..7 {
            book.refused(
                TenantId(1),
                "alpha",
                "queue_full",
                refusal(100 * round + i, "queue_full"),
            );
        }
        book.flush(&store).unwrap();
    }
    let log = store.audit(0, 10_000).unwrap();
    let of = |tenant: u64| {
        log.iter()
            .filter(|r| r.action == "request.refused" && r.detail["tenant_id"] == tenant)
            .count()
    };
    assert_eq!(of(1), 10, "alpha's newest ten of 35");
    assert_eq!(of(2), 1, "beta's own is kept");
    assert!(log.iter().any(|r| r.action == "tenant.update"));
    assert!(log.iter().any(|r| r.action == "request.output_blocked"));
    let oldest_alpha = log
        .iter()
        .filter(|r| r.detail.get("tenant_id") == Some(&1.into()))
        .map(|r| r.at_ms)
        .min();
    assert_eq!(oldest_alpha, Some(304), "the oldest went first");
    // And a reopen counts the same.
    drop(store);
    let store = Store::open(&dir).unwrap().with_refusals_per_tenant_max(10);
    let book = UsageBook::new(1000);
    book.refused(
        TenantId(1),
        "alpha",
        "queue_full",
        refusal(900, "queue_full"),
    );
    book.flush(&store).unwrap();
    let log = store.audit(0, 10_000).unwrap();
    assert_eq!(
        log.iter()
            .filter(|r| r.detail.get("tenant_id") == Some(&1.into()))
            .count(),
        10
    );
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn audit_records_past_retention_go_and_newer_ones_stay() {
    let dir = temp_dir("retention");
    let store = Store::open(&dir).unwrap();
    let book = UsageBook::new(1000);
    for at_ms in [10, 20, 30, 40] {
        book.refused(
            TenantId(1),
            "alpha",
            "queue_full",
            refusal(at_ms, "queue_full"),
        );
    }
    book.flush(&store).unwrap();
    assert_eq!(store.purge_audit_before(35).unwrap(), 3);
    let log = store.audit(0, 100).unwrap();
    assert_eq!(log.iter().map(|r| r.at_ms).collect::<Vec<_>>(), vec![40]);
    assert_eq!(store.purge_audit_before(35).unwrap(), 0);
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_key_record_is_read_past_a_scans_page() {
    let dir = temp_dir("keys");
    let store = Store::open(&dir).unwrap();
    let mut batch = Batch::default();
    let n = SCAN_RECORDS_MAX + 5;
    for i in 0..n {
        batch.put_key(&KeyRecord {
            id: format!("key_{i:08}"),
            tenant: 1,
            sha256: "00".repeat(32),
            prefix: "bk-".into(),
            source: KeySource::Issued,
            created_ms: 1,
            revoked_ms: (i == n - 1).then_some(2),
        });
    }
    store.commit(batch).unwrap();
    let keys = store.keys().unwrap();
    assert_eq!(keys.len(), n);
    assert_eq!(
        keys.last().unwrap().revoked_ms,
        Some(2),
        "the last one, revoked, is read"
    );
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}
