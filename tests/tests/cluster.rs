//! Many servers on one control plane: a real etcd (Debian's `etcd-server`)
//! on loopback, and the store over it as a library and as three `bulkhead
//! serve` processes. Without etcd installed each test says "skipped".

mod support;

use bulkhead::store::etcd_storage::EtcdStorage;
use bulkhead::store::records::{AuditRecord, UsageRecord};
use bulkhead::store::sled_storage::SledStorage;
use bulkhead::store::{Batch, Expect, Storage, Store, StoreError, Write};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use support::etcd::Etcd;
use support::*;

fn skipped(test: &str) {
    eprintln!("skipped: {test}: etcd is not installed (scripts/setup.sh installs etcd-server)");
}

fn put(key: &str, value: &str) -> Write {
    Write::Put {
        key: key.as_bytes().to_vec(),
        value: value.as_bytes().to_vec(),
    }
}

/// What every storage backend must do, checked on one.
fn storage_conformance(storage: &dyn Storage) {
    storage
        .commit(vec![
            put("t/a", "1"),
            put("t/b", "2"),
            put("t/c", "3"),
            put("u/a", "x"),
        ])
        .unwrap();
    assert_eq!(storage.get(b"t/b").unwrap(), Some(b"2".to_vec()));
    assert_eq!(storage.get(b"t/z").unwrap(), None);
    let keys = |entries: Vec<(Vec<u8>, Vec<u8>)>| -> Vec<String> {
        entries
            .into_iter()
            .map(|(k, _)| String::from_utf8(k).unwrap())
            .collect()
    };
    assert_eq!(
        keys(storage.scan(b"t/", None, 10).unwrap()),
        ["t/a", "t/b", "t/c"]
    );
    assert_eq!(
        keys(storage.scan(b"t/", Some(b"t/a"), 10).unwrap()),
        ["t/b", "t/c"]
    );
    assert_eq!(keys(storage.scan(b"t/", Some(b"t/a"), 1).unwrap()), ["t/b"]);
    assert_eq!(
        keys(storage.scan(b"t/", Some(b"a"), 10).unwrap()),
        ["t/a", "t/b", "t/c"]
    );
    assert!(storage.scan(b"t/", Some(b"t/c"), 10).unwrap().is_empty());
    assert_eq!(
        storage.last(b"t/").unwrap().map(|(k, _)| k),
        Some(b"t/c".to_vec())
    );
    assert_eq!(storage.last(b"v/").unwrap(), None);

    // A commit whose expectations hold lands whole.
    let expect = [
        Expect {
            key: b"t/a".to_vec(),
            value: Some(b"1".to_vec()),
        },
        Expect {
            key: b"t/new".to_vec(),
            value: None,
        },
    ];
    storage
        .commit_if(
            &expect,
            vec![
                put("t/a", "10"),
                Write::Delete {
                    key: b"t/b".to_vec(),
                },
                put("t/new", "n"),
            ],
        )
        .unwrap();
    assert_eq!(storage.get(b"t/a").unwrap(), Some(b"10".to_vec()));
    assert_eq!(storage.get(b"t/b").unwrap(), None);
    // One that does not hold (a value changed, a key that exists expected
    // absent) writes nothing.
    for stale in [
        Expect {
            key: b"t/a".to_vec(),
            value: Some(b"1".to_vec()),
        },
        Expect {
            key: b"t/new".to_vec(),
            value: None,
        },
    ] {
        let refused = storage.commit_if(&[stale], vec![put("t/a", "99"), put("t/d", "4")]);
        assert!(matches!(refused, Err(StoreError::Conflict)), "{refused:?}");
        assert_eq!(storage.get(b"t/a").unwrap(), Some(b"10".to_vec()));
        assert_eq!(storage.get(b"t/d").unwrap(), None);
    }
    // The last write of a key in one commit wins.
    storage
        .commit(vec![put("t/e", "first"), put("t/e", "second")])
        .unwrap();
    assert_eq!(storage.get(b"t/e").unwrap(), Some(b"second".to_vec()));
}

#[test]
fn sled_and_etcd_storage_keep_the_same_contract() {
    let dir = temp_dir("conformance-sled");
    storage_conformance(&SledStorage::open(&dir.join("db")).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let Some(etcd) = Etcd::start("conformance") else {
        return skipped("sled_and_etcd_storage_keep_the_same_contract (etcd half)");
    };
    let storage = EtcdStorage::connect(&etcd.options("one/")).unwrap();
    storage_conformance(&storage);
    // Another prefix on the same etcd sees none of it.
    let other = EtcdStorage::connect(&etcd.options("two/")).unwrap();
    assert!(other.scan(b"t/", None, 10).unwrap().is_empty());
    assert_eq!(other.get(b"t/a").unwrap(), None);
    // Over its transaction limit: refused whole, named.
    let small = EtcdStorage::connect(&bulkhead::store::etcd_storage::EtcdOptions {
        txn_ops_max: 4,
        ..etcd.options("one/")
    })
    .unwrap();
    let many: Vec<Write> = (0..5).map(|i| put(&format!("t/m{i}"), "m")).collect();
    let refused = small.commit(many).unwrap_err().to_string();
    assert!(refused.contains("max-txn-ops"), "{refused}");
    assert_eq!(storage.get(b"t/m0").unwrap(), None);
    // Over its request size: refused whole, named, before etcd sees it; and
    // etcd itself takes a value just under its own default limit.
    let narrow = EtcdStorage::connect(&bulkhead::store::etcd_storage::EtcdOptions {
        request_bytes_max: 32 << 10,
        ..etcd.options("one/")
    })
    .unwrap();
    let big = |key: &str, bytes: usize| Write::Put {
        key: key.as_bytes().to_vec(),
        value: vec![7; bytes],
    };
    let refused = narrow
        .commit(vec![put("t/n0", "n"), big("t/n1", 20 << 10)])
        .unwrap_err()
        .to_string();
    assert!(refused.contains("max-request-bytes"), "{refused}");
    assert_eq!(narrow.get(b"t/n0").unwrap(), None);
    let room = storage.commit_bytes_max() - 64;
    storage.commit(vec![big("t/large", room)]).unwrap();
    assert_eq!(
        storage.get(b"t/large").unwrap().map(|v| v.len()),
        Some(room)
    );
}

/// Connecting to `addr` fails within the timeout (500 ms; 5 s allowed on a
/// loaded machine), with an error naming it.
fn refused_quickly(addr: std::net::SocketAddr) {
    let started = Instant::now();
    let error = EtcdStorage::connect(&bulkhead::store::etcd_storage::EtcdOptions {
        endpoints: vec![format!("http://{addr}")],
        timeout_ms: 500,
        ..Default::default()
    })
    .err()
    .expect("no etcd there");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "{addr}: {took:?}");
    assert!(error.to_string().contains(&addr.to_string()), "{error}");
}

#[test]
fn an_etcd_that_is_away_silent_or_not_etcd_is_a_clear_error_within_the_timeout() {
    // A port nothing listens on.
    let away = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // Accepts connections and never says a word.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    // Speaks HTTP/1.1, not gRPC.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http_addr = http.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in http.incoming().flatten() {
            let mut stream = stream;
            let _ = std::io::Write::write_all(
                &mut stream,
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno",
            );
        }
    });
    let _keep = std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().take(8).collect();
        std::thread::sleep(Duration::from_secs(30));
        drop(held);
    });
    for addr in [away, silent_addr, http_addr] {
        refused_quickly(addr);
    }
}

fn audit(action: &str) -> AuditRecord {
    AuditRecord {
        seq: 0,
        at_ms: bulkhead::clock::now_ms(),
        actor: "admin".into(),
        action: action.into(),
        target: "t".into(),
        detail: Default::default(),
    }
}

#[test]
fn two_stores_on_one_etcd_number_audits_apart_refuse_stale_changes_and_add_usage() {
    let Some(etcd) = Etcd::start("two-stores") else {
        return skipped(
            "two_stores_on_one_etcd_number_audits_apart_refuse_stale_changes_and_add_usage",
        );
    };
    let dirs = [temp_dir("two-stores-a"), temp_dir("two-stores-b")];
    let a = Store::open_etcd(&etcd.options("c/"), &dirs[0]).unwrap();
    let b = Store::open_etcd(&etcd.options("c/"), &dirs[1]).unwrap();
    assert!(a.shared());

    // Audit records from both, interleaved and at once: every number once.
    std::thread::scope(|s| {
        for store in [&a, &b] {
            s.spawn(move || {
                for _ in 0..40 {
                    let mut batch = Batch::default();
                    batch.audit(audit("x.one")).audit(audit("x.two"));
                    store.commit(batch).unwrap();
                }
            });
        }
    });
    let seqs: Vec<u64> = a.audit(0, 1000).unwrap().iter().map(|r| r.seq).collect();
    assert_eq!(seqs.len(), 160, "no record lost or overwritten");
    assert_eq!(seqs, (1..=160).collect::<Vec<u64>>());
    // Newest first, from either: the other's records too.
    for store in [&a, &b] {
        let newest: Vec<u64> = store
            .audit_before(u64::MAX, 3)
            .unwrap()
            .iter()
            .map(|r| r.seq)
            .collect();
        assert_eq!(newest, [160, 159, 158]);
    }

    // A change based on a stale read is refused; nothing of it lands.
    let fence_a = a.fence().unwrap();
    let fence_b = b.fence().unwrap();
    assert_eq!(fence_a, fence_b);
    let mut first = Batch::default();
    first.fenced(&fence_b).put_tenant_id_next(7);
    b.commit(first).unwrap();
    let mut stale = Batch::default();
    stale
        .fenced(&fence_a)
        .put_tenant_id_next(9)
        .audit(audit("stale"));
    assert!(matches!(a.commit(stale), Err(StoreError::Conflict)));
    assert_eq!(a.tenant_id_next().unwrap(), 7);
    assert!(
        a.audit(160, 10).unwrap().is_empty(),
        "its audit record neither"
    );
    assert_eq!(a.fence().unwrap().count(), fence_a.count() + 1);

    // Usage flushed by both for the same tenant and minute: both counted
    // (a flush that lost the race is retried, never dropped).
    let delta = UsageRecord {
        requests: 1,
        prompt_tokens: 3,
        ..Default::default()
    };
    std::thread::scope(|s| {
        for store in [&a, &b] {
            let delta = delta.clone();
            s.spawn(move || {
                let mut done = 0;
                while done < 25 {
                    let mut batch = Batch::default();
                    store.add_usage(&mut batch, 4, 99, &delta).unwrap();
                    match store.commit(batch) {
                        Ok(()) => done += 1,
                        Err(StoreError::Conflict) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
    });
    let total = b.usage_minute(4, 99).unwrap();
    assert_eq!((total.requests, total.prompt_tokens), (50, 150));
    for dir in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn a_usage_flush_larger_than_one_etcd_transaction_lands_whole_in_several() {
    let Some(etcd) = Etcd::start("flush") else {
        return skipped("a_usage_flush_larger_than_one_etcd_transaction_lands_whole_in_several");
    };
    let dir = temp_dir("flush");
    // Nine operations a transaction: two records a commit.
    let store = Store::open_etcd(
        &bulkhead::store::etcd_storage::EtcdOptions {
            txn_ops_max: 9,
            ..etcd.options("flush/")
        },
        &dir,
    )
    .unwrap();
    assert_eq!(store.records_per_commit(), 2);
    let book = bulkhead::store::usage::UsageBook::new(2);
    let now = bulkhead::clock::now_ms();
    for tenant in 1..=12u32 {
        book.record(
            bulkhead::store::records::TenantId(tenant),
            now,
            "stop",
            5,
            7,
        );
        for _ in 0..3 {
            book.refused(
                bulkhead::store::records::TenantId(tenant),
                &format!("t{tenant}"),
                "queue_full",
                audit("request.refused"),
            );
        }
    }
    // 12 usage minutes, 24 listed refusals, 12 summaries: 24 commits.
    assert_eq!(
        book.flush(&store).unwrap(),
        12,
        "one refusal a tenant summarized"
    );
    let minute = now / 60_000;
    for tenant in 1..=12u32 {
        let usage = store.usage_minute(tenant, minute).unwrap();
        assert_eq!(
            (usage.requests, usage.prompt_tokens, usage.completion_tokens),
            (1, 5, 7)
        );
    }
    let records = store.audit(0, 1000).unwrap();
    let count = |action: &str| records.iter().filter(|r| r.action == action).count();
    assert_eq!(count("request.refused"), 24);
    assert_eq!(count("request.refused_summary"), 12);
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=36).collect::<Vec<u64>>());
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------
// Three servers.

/// A test policy whose store is `etcd` under `prefix`.
fn cluster_policy(etcd: &Etcd, prefix: &str) -> Policy {
    Policy {
        store_toml: etcd.store_toml(prefix),
        ..Policy::default()
    }
}

fn pods(model: &std::path::Path, policy: &Policy, n: usize) -> Vec<Server> {
    // One after another: the first seeds the store.
    (0..n).map(|_| start(model, policy)).collect()
}

fn chat(server: &Server, key: &str) -> Reply {
    server.post_json("/v1/chat/completions", Some(key), &chat_body("Say hi.", 2))
}

/// Polls `check` every 5 ms for up to 10 s; how long it took to hold.
fn time_until(mut check: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if check() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

fn quota(server: &Server, tenant: &str) -> Value {
    let r = server.admin_call("GET", &format!("/admin/v1/tenants/{tenant}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["quota"].clone()
}

#[test]
fn three_servers_on_one_etcd_share_tenants_keys_and_quotas() {
    let Some(model) = smollm2() else { return };
    let Some(etcd) = Etcd::start("three") else {
        return skipped("three_servers_on_one_etcd_share_tenants_keys_and_quotas");
    };
    let policy = cluster_policy(&etcd, "three/");
    let pods = pods(&model, &policy, 3);
    let (a, b, c) = (&pods[0], &pods[1], &pods[2]);

    // A tenant created on A serves on B and C, with a key issued on A.
    let r = a.admin_call(
        "PATCH",
        "/admin/v1/tenants/gamma",
        Some(&json!({"pages_reserved": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let delta = json!({"name": "delta", "pages_reserved": 16, "pages_max": 64,
                       "queue_depth_max": 4, "running_max": 4});
    let r = a.admin_call("POST", "/admin/v1/tenants", Some(&delta));
    assert_eq!(r.status, 201, "{}", r.body);
    let delta_id = r.json()["id"].as_u64().unwrap();
    let r = a.admin_call("POST", "/admin/v1/tenants/delta/keys", None);
    assert_eq!(r.status, 201, "{}", r.body);
    let secret = r.json()["secret"].as_str().unwrap().to_string();
    let key_id = r.json()["key"]["id"].as_str().unwrap().to_string();
    for pod in [b, c] {
        assert!(
            time_until(|| chat(pod, &secret).status == 200).is_some(),
            "delta's key works on every pod"
        );
        let tenant = pod
            .admin_call("GET", "/admin/v1/tenants/delta", None)
            .json();
        assert_eq!(tenant["id"].as_u64(), Some(delta_id), "one id cluster-wide");
    }
    // Ids are never reused: a tenant made on C after one deleted on B.
    let r = b.admin_call("DELETE", "/admin/v1/tenants/delta", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(time_until(|| chat(a, &secret).status == 401).is_some());
    let r = c.admin_call("POST", "/admin/v1/tenants", Some(&delta));
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(r.json()["id"].as_u64().unwrap() > delta_id);

    // A key revoked on A is refused on B and C within a second.
    let r = a.admin_call("POST", "/admin/v1/tenants/delta/keys", None);
    let secret = r.json()["secret"].as_str().unwrap().to_string();
    let key_id_2 = r.json()["key"]["id"].as_str().unwrap().to_string();
    assert_ne!(key_id, key_id_2);
    for pod in [b, c] {
        assert!(time_until(|| chat(pod, &secret).status == 200).is_some());
    }
    let r = a.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/delta/keys/{key_id_2}"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    for pod in [b, c] {
        let took = time_until(|| chat(pod, &secret).status == 401).expect("refused");
        assert!(took < Duration::from_secs(1), "revocation took {took:?}");
    }

    // A quota change on B is enforced on A: delta may use no model there.
    let r = a.admin_call("POST", "/admin/v1/tenants/delta/keys", None);
    let secret = r.json()["secret"].as_str().unwrap().to_string();
    assert!(time_until(|| chat(a, &secret).status == 200).is_some());
    let r = b.admin_call(
        "PATCH",
        "/admin/v1/tenants/delta",
        Some(&json!({"running_max": 3, "models": []})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        time_until(|| chat(a, &secret).status == 404).is_some(),
        "A no longer serves delta the model"
    );
    assert_eq!(quota(a, "delta")["running_max"], 3);
    assert_eq!(quota(c, "delta")["running_max"], 3);

    // Two pods writing the same tenant at once: each write lands or is
    // refused whole (409 conflict), and the tenant ends as one of them.
    let mut conflicts = 0;
    for round in 0..5u32 {
        let (x, y) = (10 + round * 2, 11 + round * 2);
        let (rx, ry) = std::thread::scope(|s| {
            let hx = s.spawn(|| {
                a.admin_call(
                    "PATCH",
                    "/admin/v1/tenants/delta",
                    Some(&json!({"weight": x})),
                )
            });
            let hy = s.spawn(|| {
                b.admin_call(
                    "PATCH",
                    "/admin/v1/tenants/delta",
                    Some(&json!({"weight": y})),
                )
            });
            (hx.join().unwrap(), hy.join().unwrap())
        });
        for r in [&rx, &ry] {
            assert!(
                r.status == 200 || r.status == 409,
                "{} {}",
                r.status,
                r.body
            );
            if r.status == 409 {
                assert_eq!(r.error().1, json!("conflict"), "{}", r.body);
                conflicts += 1;
            }
        }
        assert!(rx.status == 200 || ry.status == 200, "one of them lands");
        let weight = quota(c, "delta")["weight"].as_u64().unwrap() as u32;
        let landed: Vec<u32> = [(rx.status, x), (ry.status, y)]
            .iter()
            .filter(|(s, _)| *s == 200)
            .map(|(_, w)| *w)
            .collect();
        assert!(
            landed.contains(&weight),
            "weight {weight} is one that landed: {landed:?}"
        );
    }
    eprintln!("concurrent writes: {conflicts} of 10 refused as conflicts");
    // `bulkhead check` reads the cluster's store as it is: delta, which B's
    // change left no model, is in no model's table.
    let out = std::process::Command::new(bulkhead_exe())
        .args(["check", "--config"])
        .arg(a.dir.join("policy.toml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("tenants: the store at etcd {}", etcd.client_url)),
        "{text}"
    );
    assert!(text.contains("tenant gamma maximum"), "{text}");
    assert!(!text.contains("tenant delta"), "{text}");
    // Every acknowledged change is in the one audit log, readable from any pod.
    let audit = c
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .json();
    let creates = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "tenant.create")
        .count();
    assert_eq!(creates, 2, "delta twice, whichever pod made it");
}

#[test]
fn a_pod_keeps_serving_through_an_etcd_restart_and_loses_nothing_acknowledged() {
    let Some(model) = smollm2() else { return };
    let Some(mut etcd) = Etcd::start("restart") else {
        return skipped(
            "a_pod_keeps_serving_through_an_etcd_restart_and_loses_nothing_acknowledged",
        );
    };
    let policy = cluster_policy(&etcd, "restart/");
    let mut pods = pods(&model, &policy, 2);
    // A third that refuses requests while the store is away.
    let refusing = start(
        &model,
        &Policy {
            store_toml: format!("offline = \"refuse\"\n{}", etcd.store_toml("restart/")),
            ..Policy::default()
        },
    );
    let readyz = |server: &Server| {
        let r = server.get(&server.inference, "/readyz", None);
        (
            r.status,
            r.json()["store"].as_str().unwrap_or_default().to_string(),
        )
    };
    assert_eq!(readyz(&refusing), (200, "connected".to_string()));
    // Load runs on A throughout; admin writes go to B while etcd comes and goes.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (acknowledged, served) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut ok = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if chat(&pods[0], KEY_ALPHA).status == 200 {
                    ok += 1;
                }
            }
            ok
        });
        let mut acknowledged = Vec::new();
        let mut refused = 0;
        for i in 0..30u32 {
            if i == 10 {
                etcd.kill();
            }
            if i == 15 {
                // Away: the default pod serves and says so, the other refuses.
                assert_eq!(
                    readyz(&pods[0]),
                    (200, "away (serving with the last state seen)".to_string())
                );
                assert_eq!(
                    readyz(&refusing),
                    (503, "away (refusing requests)".to_string())
                );
                let r = chat(&refusing, KEY_ALPHA);
                assert_eq!(r.status, 503, "{}", r.body);
                assert_eq!(r.error().1, json!("store_unavailable"));
            }
            if i == 20 {
                etcd.run();
            }
            let r = pods[1].admin_call(
                "PATCH",
                "/admin/v1/tenants/beta",
                Some(&json!({"weight": 100 + i})),
            );
            match r.status {
                200 => acknowledged.push(100 + i),
                503 => {
                    assert_eq!(r.error().1, json!("store_unavailable"), "{}", r.body);
                    refused += 1;
                }
                other => panic!("{other}: {}", r.body),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(refused > 0, "writes while etcd was away were refused");
        (acknowledged, load.join().unwrap())
    });
    assert!(served > 0, "A served throughout");
    let last = *acknowledged
        .last()
        .expect("writes before and after the outage landed");
    assert!(acknowledged.iter().any(|w| *w >= 120), "{acknowledged:?}");
    // Both pods back in step, with the last acknowledged write.
    for pod in &pods {
        assert!(
            time_until(|| quota(pod, "beta")["weight"] == last).is_some(),
            "weight {last}"
        );
    }
    assert!(time_until(|| chat(&refusing, KEY_ALPHA).status == 200).is_some());
    assert_eq!(readyz(&refusing), (200, "connected".to_string()));
    // A pod restarted comes up with the cluster's state.
    let r = pods[0].admin_call(
        "PATCH",
        "/admin/v1/tenants/gamma",
        Some(&json!({"weight": 77})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    pods[1].terminate();
    pods[1].wait(Duration::from_secs(30));
    let restarted = launch(Launch::new(&model, &policy).dir(&pods[1].dir));
    assert_eq!(quota(&restarted, "gamma")["weight"], 77);
    assert_eq!(quota(&restarted, "beta")["weight"], last);
    pods.push(restarted);
}

#[test]
fn a_change_that_breaks_another_servers_contract_is_refused_with_that_server_named() {
    let Some(model) = smollm2() else { return };
    let Some(etcd) = Etcd::start("contracts") else {
        return skipped(
            "a_change_that_breaks_another_servers_contract_is_refused_with_that_server_named",
        );
    };
    // A promises 1024 tokens of context, B only 512.
    let wide = cluster_policy(&etcd, "contracts/");
    let narrow = Policy {
        context_tokens: 512,
        ..cluster_policy(&etcd, "contracts/")
    };
    let a = launch(Launch::new(&model, &wide).env("BULKHEAD_SERVER_NAME", Some("pod-a")));
    let b = launch(Launch::new(&model, &narrow).env("BULKHEAD_SERVER_NAME", Some("pod-b")));
    // 40 pages of 16 tokens hold B's 512 but not A's 1024: refused through
    // B, with A's contract.
    let shrink = json!({"pages_reserved": 8, "pages_max": 40});
    let r = b.admin_call("PATCH", "/admin/v1/tenants/beta", Some(&shrink));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.error().1, json!("capacity_contract_violated"));
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("on server pod-a"), "{message}");
    assert_eq!(
        quota(&a, "beta")["pages_max"],
        quota(&b, "beta")["pages_max"]
    );
    assert_ne!(quota(&b, "beta")["pages_max"], 40, "nothing written");
    // Once A is gone (its announcement's lease ends), B alone decides.
    drop(a);
    assert!(
        eventually(Duration::from_secs(20), || b
            .admin_call("PATCH", "/admin/v1/tenants/beta", Some(&shrink))
            .status
            == 200),
        "A's announcement outlived its lease"
    );
}

#[test]
fn a_damaged_or_foreign_etcd_entry_is_skipped_by_the_servers_following_it() {
    let Some(model) = smollm2() else { return };
    let Some(etcd) = Etcd::start("hostile") else {
        return skipped("a_damaged_or_foreign_etcd_entry_is_skipped_by_the_servers_following_it");
    };
    let policy = cluster_policy(&etcd, "hostile/");
    let pods = pods(&model, &policy, 2);
    let beta_id = quota_id(&pods[0], "beta");
    // Another writer of the same prefix: beta's record damaged, a record
    // under a key no tenant has, and the fence bumped so every server reloads.
    let raw = EtcdStorage::connect(&etcd.options("hostile/")).unwrap();
    let fence: u64 = {
        let bytes = raw
            .get(b"meta/control")
            .unwrap()
            .expect("fenced writes happened");
        let value: Value = serde_json::from_slice(&bytes).unwrap();
        value["record"].as_u64().unwrap()
    };
    raw.commit(vec![
        Write::Put {
            key: [b"tenant/".as_slice(), &beta_id.to_be_bytes()].concat(),
            value: b"{\"v\": 3, \"record\": {\"id\": \"not a number\"}}".to_vec(),
        },
        Write::Put {
            key: b"tenant/\xff\xff".to_vec(),
            value: b"\x00\x01 not json".to_vec(),
        },
        Write::Put {
            key: b"meta/control".to_vec(),
            value: bulkhead::store::encode(&(fence + 1)),
        },
    ])
    .unwrap();
    for pod in &pods {
        assert!(
            eventually(Duration::from_secs(5), || pod
                .logged("a store record is refused and skipped")),
            "the damaged records are named in the log"
        );
        // Beta is not taken for deleted: it keeps being served as it was.
        assert_eq!(chat(pod, KEY_BETA).status, 200);
        assert_eq!(chat(pod, KEY_ALPHA).status, 200);
    }
    let logged = pods[1].stderr_lines().join("\n");
    assert!(logged.contains("tenant/"), "the key is named");
    // Admin changes, which read what they are based on, refuse to build on a
    // store they cannot read whole.
    let r = pods[0].admin_call(
        "PATCH",
        "/admin/v1/tenants/alpha",
        Some(&json!({"weight": 3})),
    );
    assert_eq!(r.status, 500, "{}", r.body);
}

#[test]
fn an_admin_token_rotated_through_one_server_is_the_only_one_on_every_server() {
    let Some(model) = smollm2() else { return };
    let Some(etcd) = Etcd::start("token") else {
        return skipped(
            "an_admin_token_rotated_through_one_server_is_the_only_one_on_every_server",
        );
    };
    let policy = cluster_policy(&etcd, "token/");
    let pods = pods(&model, &policy, 2);
    let rotated = "rotated-admin-token-0123456789abcdef";
    // A third server started with another token rotates the cluster's.
    let c = launch(Launch::new(&model, &policy).env("BULKHEAD_ADMIN_TOKEN", Some(rotated)));
    for pod in pods.iter().chain([&c]) {
        let took = time_until(|| {
            pod.call(
                &pod.admin,
                "GET",
                "/admin/v1/tenants",
                Some(ADMIN_TOKEN),
                None,
            )
            .status
                == 401
        })
        .expect("the old token is refused");
        assert!(took < Duration::from_secs(1), "{took:?}");
        let r = pod.call(&pod.admin, "GET", "/admin/v1/tenants", Some(rotated), None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// A tenant's id as the admin API shows it.
fn quota_id(server: &Server, tenant: &str) -> u32 {
    let r = server.admin_call("GET", &format!("/admin/v1/tenants/{tenant}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["id"].as_u64().unwrap() as u32
}

/// `wasm` with a custom section of `pad` bytes appended: the same component,
/// `pad` bytes larger.
fn padded(wasm: &[u8], pad: usize) -> Vec<u8> {
    let name = b"bulkhead-test-padding";
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.resize(body.len() + pad, 0);
    let mut out = wasm.to_vec();
    out.push(0); // custom section
    let mut size = body.len();
    loop {
        let byte = (size & 0x7f) as u8;
        size >>= 7;
        out.push(if size == 0 { byte } else { byte | 0x80 });
        if size == 0 {
            break;
        }
    }
    out.extend_from_slice(&body);
    out
}

/// A prompt over size-cap's 200 tokens: 400 `prompt_too_large` while beta's
/// plugin runs, 200 while it does not.
fn capped(server: &Server) -> u16 {
    ask_prompt(server, KEY_BETA, &[], &"word ".repeat(300), 2).status
}

fn plugin_versions(server: &Server, tenant: &str) -> Vec<(String, u64, bool)> {
    let r = server.admin_call("GET", &format!("/admin/v1/tenants/{tenant}/plugins"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["version"].as_u64().unwrap(),
                p["enabled"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn plugins_and_models_changed_through_one_server_apply_on_every_server_and_a_new_one() {
    let Some(model) = smollm2() else { return };
    let Some(cap) = wasm("size_cap") else { return };
    let Some(etcd) = Etcd::start("plugins") else {
        return skipped(
            "plugins_and_models_changed_through_one_server_apply_on_every_server_and_a_new_one",
        );
    };
    let policy = cluster_policy(&etcd, "plugins/");
    let pods = pods(&model, &policy, 3);
    let (a, b, c) = (&pods[0], &pods[1], &pods[2]);
    for pod in &pods {
        assert_eq!(capped(pod), 200, "no plugin yet");
    }

    // Uploaded through A: it runs on B and C, compiled there from the
    // component in the store.
    uploaded(a, "beta", "cap", &cap);
    assert_eq!(capped(a), 400);
    for pod in [b, c] {
        let took = time_until(|| capped(pod) == 400).expect("the plugin runs on every pod");
        eprintln!("plugin upload applied on another pod in {took:?}");
        assert_eq!(plugin_versions(pod, "beta"), [("cap".into(), 1, true)]);
    }
    // Disabled through B: out of every pod's chain; enabled through C: back.
    let r = b.admin_call("POST", "/admin/v1/tenants/beta/plugins/cap/disable", None);
    assert_eq!(r.status, 200, "{}", r.body);
    for pod in [a, c] {
        assert!(time_until(|| capped(pod) == 200).is_some(), "disabled");
    }
    let r = c.admin_call("POST", "/admin/v1/tenants/beta/plugins/cap/enable", None);
    assert_eq!(r.status, 200, "{}", r.body);
    for pod in [a, b] {
        assert!(time_until(|| capped(pod) == 400).is_some(), "enabled");
    }
    // A second version through C replaces the first everywhere; a pod that
    // starts now, with a folder of its own, runs it from the store.
    uploaded(c, "beta", "cap", &cap);
    assert!(time_until(|| plugin_versions(a, "beta") == [("cap".into(), 2, true)]).is_some());
    let d = start(&model, &policy);
    assert_eq!(capped(&d), 400, "the new pod runs beta's plugin");
    assert_eq!(plugin_versions(&d, "beta"), [("cap".into(), 2, true)]);

    // A component etcd cannot take in one request is refused whole, in
    // words; one just under the limit goes through.
    let r = upload(a, "beta", "big", &padded(&cap, 2 << 20), "");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("request_bytes_max"), "{}", r.body);
    let fits = padded(&cap, 1_400_000);
    let r = upload(a, "beta", "big", &fits, "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(time_until(|| plugin_versions(&d, "beta").len() == 2).is_some());

    // Deleted through A: gone from every pod, and its code from the store.
    for name in ["cap", "big"] {
        let r = a.admin_call(
            "DELETE",
            &format!("/admin/v1/tenants/beta/plugins/{name}"),
            None,
        );
        assert_eq!(r.status, 204, "{}", r.body);
    }
    for pod in [b, c, &d] {
        assert!(time_until(|| capped(pod) == 200).is_some(), "deleted");
        assert!(plugin_versions(pod, "beta").is_empty());
    }
    let store = EtcdStorage::connect(&etcd.options("plugins/")).unwrap();
    let code = store.scan(b"code/", None, 10).unwrap();
    assert!(code.is_empty(), "no component outlives its plugin");

    // A model added through B is served by every pod (the file is at the
    // same path on each); removed through C, it drains and goes everywhere.
    let add = json!({"id": "second", "path": model, "context_tokens": 1024, "threads": 1,
                     "page_tokens": 16, "pool_pages": 224, "seq_pages_max": 64,
                     "step_tokens_max": 256, "step_seqs_max": 8});
    // E's memory budget holds one model, not two.
    let small = Policy {
        extra_toml: "[engine]\nmemory_max = \"300 MiB\"\n".into(),
        ..cluster_policy(&etcd, "plugins/")
    };
    let e = start(&model, &small);
    let r = b.admin_call("POST", "/admin/v1/models", Some(&add));
    assert_eq!(r.status, 201, "{}", r.body);
    let second = |pod: &Server| {
        pod.post_json(
            "/v1/completions",
            Some(KEY_ALPHA),
            &json!({"model": "second", "prompt": "Hi", "max_tokens": 2}),
        )
        .status
    };
    for pod in [a, c, &d] {
        let took = time_until(|| second(pod) == 200).expect("every pod serves the new model");
        eprintln!("model add applied on another pod in {took:?}");
    }
    // E does not load it: logged and counted, and E serves on as it was.
    assert!(e.logged("a model added through another server does not load here"));
    assert!(e.stderr_lines().iter().any(|l| l.contains("memory budget")));
    assert_eq!(e.metric("bulkhead_store_reload_refused_total"), 1.0);
    assert_eq!(second(&e), 404);
    assert_eq!(chat(&e, KEY_ALPHA).status, 200);
    let r = c.admin_call("DELETE", "/admin/v1/models/second", None);
    assert_eq!(r.status, 200, "{}", r.body);
    for pod in [a, b, &d] {
        assert!(time_until(|| second(pod) == 404).is_some(), "removed");
    }
    // No pod failed to load any plugin version.
    let audit = a
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .json();
    assert!(!audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["action"] == "plugin.unavailable"));
}
