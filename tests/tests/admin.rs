//! The live control plane through the real binary: admin changes that apply
//! on the next request, writes that survive SIGKILL, a store that cannot be
//! opened, tenants that cannot reach each other's objects, bad input, the
//! admin token's rules, the OpenAPI document against real responses, and the
//! `bulkhead admin` commands.

mod support;

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;
use support::*;

/// A real plugin component (plugins/size-cap), or None (skipped).
fn component() -> Option<Vec<u8>> {
    plugin_wasm("size_cap").map(|p| std::fs::read(p).unwrap())
}
/// A core module's preamble: refused.
const CORE_MODULE: &[u8] = &[0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];

fn tenant_names(server: &Server) -> BTreeSet<String> {
    let r = server.admin_call("GET", "/admin/v1/tenants", None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

fn audit_actions(server: &Server) -> Vec<String> {
    let r = server.admin_call("GET", "/admin/v1/audit?limit=1000", None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["action"].as_str().unwrap().to_string())
        .collect()
}

/// Issues a key for `tenant` through the admin API: (secret, key id).
fn issue(server: &Server, tenant: &str) -> (String, String) {
    let r = server.admin_call("POST", &format!("/admin/v1/tenants/{tenant}/keys"), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    (
        v["secret"].as_str().unwrap().to_string(),
        v["key"]["id"].as_str().unwrap().to_string(),
    )
}

fn chat(server: &Server, key: &str) -> Reply {
    server.post_json("/v1/chat/completions", Some(key), &chat_body("Say hi.", 4))
}

#[test]
fn changes_apply_on_the_next_request_without_a_restart() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let delta = json!({"name": "delta", "pages_reserved": 16, "pages_max": 64,
                       "queue_depth_max": 4, "running_max": 4});
    // The other tenants reserve 192 of 224 pages: delta could never hold the
    // promised 1024 tokens (64 pages). Refused with the table, nothing written.
    let r = server.admin_call("POST", "/admin/v1/tenants", Some(&delta));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.error().1, json!("capacity_contract_violated"));
    let limits = r.json()["error"]["limits"].as_array().unwrap().clone();
    let broken: Vec<&Value> = limits.iter().filter(|l| l["holds"] == false).collect();
    assert!(
        broken.iter().any(|l| l["stage"] == "tenant delta maximum"),
        "{limits:?}"
    );
    // The refusal names the smallest changes that would fit.
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    for fix in [
        "Nothing was changed; it holds with ",
        &format!("models.{MODEL_ID}.pool_pages at least "),
        &format!("or with tenant delta's models not including {MODEL_ID}"),
    ] {
        assert!(message.contains(fix), "{fix:?} not in {message}");
    }
    assert!(!tenant_names(&server).contains("delta"));

    // Reservations beyond the pool (I8): refused, the row says so.
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/gamma",
        Some(&json!({"pages_reserved": 97, "pages_max": 97})),
    );
    assert_eq!(r.status, 409, "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("over-commit"), "{message}");
    assert!(r.body.contains("add up to 225 pages"), "{}", r.body);
    let gamma = server
        .admin_call("GET", "/admin/v1/tenants/gamma", None)
        .json();
    assert_eq!(gamma["quota"]["pages_reserved"], 64, "nothing written");

    free_gamma_reservation(&server);
    let r = server.admin_call("POST", "/admin/v1/tenants", Some(&delta));
    assert_eq!(r.status, 201, "{}", r.body);
    let delta_id = r.json()["id"].as_u64().unwrap();
    assert!(
        delta_id > 3,
        "ids come from the store's counter: {delta_id}"
    );

    // A new key works on the next request; a revoked one fails on the next.
    let (secret, key_id) = issue(&server, "delta");
    let r = chat(&server, &secret);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/delta/keys/{key_id}"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["revoked_ms"].is_u64());
    assert_eq!(chat(&server, &secret).status, 401);

    // A quota change governs the next admission: one running, one queued.
    let (secret, _) = issue(&server, "delta");
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/delta",
        Some(&json!({"running_max": 1, "queue_depth_max": 1})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["quota"]["running_max"], 1);
    let mut long = chat_body("Write a long story about a dragon.", 400);
    long["stream"] = json!(true);
    let (status, mut running) = server.stream("/v1/chat/completions", &secret, &long);
    assert_eq!(status, 200);
    running.next_data().unwrap();
    running.next_data().unwrap();
    let queued = {
        let server_url = server.inference.clone();
        let secret = secret.clone();
        // (status, body) of the queued request, when it ends.
        std::thread::spawn(move || {
            match ureq::post(&format!("{server_url}/v1/chat/completions"))
                .set("authorization", &format!("Bearer {secret}"))
                .send_string(&chat_body("hi", 4).to_string())
            {
                Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
                Err(ureq::Error::Status(status, r)) => {
                    (status, r.into_string().unwrap_or_default())
                }
                Err(e) => (0, e.to_string()),
            }
        })
    };
    assert!(eventually(Duration::from_secs(10), || {
        let partitions = server
            .admin_call("GET", "/admin/v1/partitions", None)
            .json();
        partitions["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["tenant"] == "delta" && p["queued"] == 1)
    }));
    let r = chat(&server, &secret);
    assert_eq!((r.status, r.error().1), (429, json!("queue_full")));

    let enqueued = r#"bulkhead_enqueued_total{model="smollm2-test",tenant="delta"}"#;
    let enqueued_before = server.metric(enqueued);
    assert!(enqueued_before >= 3.0, "{enqueued_before}");

    // Deleting delta mid-request: its key fails at once, its running and queued
    // requests end with tenant_removed (not a 5xx), its partition goes.
    let r = server.admin_call("DELETE", "/admin/v1/tenants/delta", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["requests_ended"], 2);
    let events = running.rest();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "tenant_removed", "{events:?}");
    let (status, body) = queued.join().unwrap();
    assert_eq!(status, 403, "the queued request: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "tenant_removed");
    assert_eq!(chat(&server, &secret).status, 401);
    let partitions = server
        .admin_call("GET", "/admin/v1/partitions", None)
        .json();
    assert!(partitions["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["tenant"] != "delta"));
    assert!(eventually(Duration::from_secs(5), || {
        server.metric(r#"bulkhead_kv_pool_pages{model="smollm2-test",state="free"}"#) == 224.0
    }));
    // A deleted name can be taken again, by a new id.
    let r = server.admin_call("POST", "/admin/v1/tenants", Some(&delta));
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(
        r.json()["id"].as_u64().unwrap() > delta_id,
        "ids are never reused"
    );
    // Its counters, under the same name, go on from the old tenant's: the
    // new one's counts, begun at zero, held them still (the recorder keeps
    // a counter's largest value) until they passed the old.
    let (secret, _) = issue(&server, "delta");
    assert_eq!(chat(&server, &secret).status, 200);
    assert!(
        eventually(Duration::from_secs(5), || server.metric(enqueued)
            == enqueued_before + 1.0),
        "{} after {enqueued_before}",
        server.metric(enqueued)
    );

    let actions = audit_actions(&server);
    for action in [
        "store.seed",
        "tenant.create",
        "tenant.update",
        "key.issue",
        "key.revoke",
        "tenant.delete",
    ] {
        assert!(actions.iter().any(|a| a == action), "{action}: {actions:?}");
    }
}

#[test]
fn requests_get_random_ids_and_are_counted_and_audited_without_content() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let chat_ids: Vec<u64> = (0..4)
        .map(|_| {
            let r = chat(&server, KEY_ALPHA);
            assert_eq!(r.status, 200);
            r.request_id.unwrap().parse().unwrap()
        })
        .collect();
    for pair in chat_ids.windows(2) {
        assert!(
            pair[0].abs_diff(pair[1]) > 1 << 20,
            "consecutive ids {pair:?} betray a counter"
        );
    }
    // A refusal of an authenticated request is counted and audited: its code
    // and sizes, never its text.
    let canary = format!("CANARY{}zz", std::process::id());
    let r = server.post_json(
        "/v1/chat/completions",
        Some(KEY_ALPHA),
        &chat_body(&format!("{canary} ").repeat(400), 4),
    );
    assert_eq!(r.error().1, json!("context_length_exceeded"));
    let refused_id = r.request_id.unwrap().parse::<u64>().unwrap();
    let usage = || {
        server
            .admin_call("GET", "/admin/v1/usage?tenant=alpha", None)
            .json()
    };
    assert!(
        eventually(Duration::from_secs(5), || usage()["total"]["requests"] == 5),
        "{}",
        usage()
    );
    let total = &usage()["total"];
    assert_eq!(total["outcomes"]["context_length_exceeded"], 1, "{total}");
    assert!(total["completion_tokens"].as_u64().unwrap() >= 4, "{total}");
    let audit = server.admin_call("GET", "/admin/v1/audit?limit=1000", None);
    let refusal = audit.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["action"] == "request.refused")
        .cloned()
        .expect("the refusal is audited");
    assert_eq!(refusal["actor"], "tenant:alpha");
    assert_eq!(refusal["target"], refused_id.to_string());
    assert_eq!(refusal["detail"]["code"], "context_length_exceeded");
    assert!(
        !audit.body.contains(&canary),
        "the audit log carries the prompt"
    );
}

#[test]
fn acknowledged_admin_writes_survive_sigkill() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let server = start(&model, &policy);
    // A burst of writes, each acknowledged with a 2xx before the next.
    for tenant in ["alpha", "beta", "gamma"] {
        let r = server.admin_call(
            "PATCH",
            &format!("/admin/v1/tenants/{tenant}"),
            Some(&json!({"pages_reserved": 0, "weight": 3})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let mut secrets = Vec::new();
    for n in 1..=5 {
        let r = server.admin_call(
            "POST",
            "/admin/v1/tenants",
            Some(&json!({"name": format!("t{n}"), "pages_reserved": 8, "pages_max": 64})),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        secrets.push(issue(&server, &format!("t{n}")));
    }
    let r = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/t1/keys/{}", secrets[0].1),
        None,
    );
    assert_eq!(r.status, 200);
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/t2",
        Some(&json!({"running_max": 2})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        server
            .admin_call("DELETE", "/admin/v1/tenants/t3", None)
            .status,
        200
    );
    // No drain, no flush: the process is gone now.
    let dir = server.kill();

    let server = launch(Launch::new(&model, &policy).dir(&dir));
    let names = tenant_names(&server);
    let expected: BTreeSet<String> = ["alpha", "beta", "gamma", "t1", "t2", "t4", "t5"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(names, expected);
    let alpha = server
        .admin_call("GET", "/admin/v1/tenants/alpha", None)
        .json();
    assert_eq!(alpha["quota"]["weight"], 3);
    assert_eq!(alpha["quota"]["pages_reserved"], 0);
    let t2 = server
        .admin_call("GET", "/admin/v1/tenants/t2", None)
        .json();
    assert_eq!(t2["quota"]["running_max"], 2);
    let models = |key: &str| {
        server
            .get(&server.inference, "/v1/models", Some(key))
            .status
    };
    assert_eq!(models(&secrets[0].0), 401, "a revoked key stays revoked");
    assert_eq!(
        models(&secrets[2].0),
        401,
        "a deleted tenant's key stays dead"
    );
    for (secret, _) in [&secrets[1], &secrets[3], &secrets[4]] {
        assert_eq!(models(secret), 200);
    }
    assert_eq!(chat(&server, &secrets[1].0).status, 200);
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_store_that_cannot_be_opened_stops_start_up_with_its_path_and_cause() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let first = start(&model, &policy);
    // A second server on the same store: sled's lock is held.
    match try_launch(Launch::new(&model, &policy).dir(&first.dir)) {
        Ok(_) => panic!("two servers opened one store"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(stderr.contains("cannot open the store at"), "{stderr}");
            assert!(stderr.contains("another process"), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
    // A store folder below a regular file.
    let dir = first.kill();
    let file = dir.join("not-a-folder");
    std::fs::write(&file, b"x").unwrap();
    let blocked = Policy {
        store_path: Some(file.join("state")),
        ..Policy::default()
    };
    match try_launch(Launch::new(&model, &blocked).dir(&dir)) {
        Ok(_) => panic!("started on an unusable store path"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(stderr.contains("not-a-folder"), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
    // Damaged files: the database's log scrambled past its first bytes (sled
    // would recover an empty or shorter store from it), then every file.
    let store = dir.join("bulkhead-state");
    let db = store.join("db");
    let mut bytes = std::fs::read(&db).unwrap();
    for b in bytes.iter_mut().skip(64) {
        *b ^= 0x5a;
    }
    std::fs::write(&db, bytes).unwrap();
    let refused = |what: &str| match try_launch(Launch::new(&model, &policy).dir(&dir)) {
        Ok(_) => panic!("{what}: started on a damaged store"),
        Err((status, stderr)) => {
            assert!(!status.success(), "{what}");
            assert!(
                stderr.contains("cannot open the store at"),
                "{what}: {stderr}"
            );
            assert!(!stderr.contains("panicked"), "{what}: {stderr}");
            stderr
        }
    };
    let stderr = refused("a scrambled log");
    assert!(stderr.contains("acknowledged"), "{stderr}");
    for entry in std::fs::read_dir(&store).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::write(&path, vec![0xA5; 4096]).unwrap();
        }
    }
    refused("garbage files");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tenants_cannot_reach_each_others_objects_even_by_guessing() {
    let Some(model) = smollm2() else { return };
    let Some(component) = component() else { return };
    let server = start(&model, &Policy::default());
    let base = server.inference.clone();
    // Alpha makes a key and a plugin of its own.
    let r = server.call(&base, "POST", "/v1/tenant/keys", Some(KEY_ALPHA), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let alpha_key = r.json()["key"]["id"].as_str().unwrap().to_string();
    let alpha_secret = r.json()["secret"].as_str().unwrap().to_string();
    let r = server.call_raw(
        &base,
        "PUT",
        "/v1/tenant/plugins/limits",
        Some(KEY_ALPHA),
        "application/wasm",
        &component,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Beta's view: only its own.
    let me = server
        .call(&base, "GET", "/v1/tenant", Some(KEY_BETA), None)
        .json();
    assert_eq!(me["name"], "beta");
    let keys = server.call(&base, "GET", "/v1/tenant/keys", Some(KEY_BETA), None);
    assert!(!keys.body.contains(&alpha_key));
    let plugins = server.call(&base, "GET", "/v1/tenant/plugins", Some(KEY_BETA), None);
    assert_eq!(plugins.json()["data"], json!([]));
    let usage = server.call(&base, "GET", "/v1/tenant/usage", Some(KEY_BETA), None);
    assert_eq!(usage.json()["tenant_id"], me["id"]);

    // Alpha's objects answer exactly what objects that never existed answer.
    let same = |real: &Reply, fake: &Reply, what: &str| {
        assert_eq!(real.status, 404, "{what}: {}", real.body);
        assert_eq!(real.status, fake.status, "{what}");
        assert_eq!(real.error(), fake.error(), "{what}");
    };
    let fake_key = "key_00000000deadbeef";
    for (method, path) in [
        ("DELETE", format!("/v1/tenant/keys/{alpha_key}")),
        ("GET", "/v1/tenant/plugins/limits".to_string()),
        ("DELETE", "/v1/tenant/plugins/limits".to_string()),
        ("POST", "/v1/tenant/plugins/limits/disable".to_string()),
    ] {
        let real = server.call(&base, method, &path, Some(KEY_BETA), None);
        let fake_path = path
            .replace(&alpha_key, fake_key)
            .replace("limits", "nothing");
        let fake = server.call(&base, method, &fake_path, Some(KEY_BETA), None);
        same(&real, &fake, &format!("{method} {path}"));
    }
    // Guessing key ids gets nowhere.
    for guess in 0..20u64 {
        let r = server.call(
            &base,
            "DELETE",
            &format!("/v1/tenant/keys/key_{guess:016x}"),
            Some(KEY_BETA),
            None,
        );
        assert_eq!(r.status, 404);
    }
    // Nothing of alpha's changed; the admin routes are not for tenant keys.
    assert_eq!(chat(&server, &alpha_secret).status, 200);
    let r = server.call(
        &base,
        "GET",
        "/v1/tenant/plugins/limits",
        Some(KEY_ALPHA),
        None,
    );
    assert_eq!(r.json()["enabled"], true);
    assert_eq!(
        server
            .call(
                &server.admin,
                "GET",
                "/admin/v1/tenants",
                Some(KEY_BETA),
                None
            )
            .status,
        401
    );
    // Self-service needs a key.
    assert_eq!(
        server.call(&base, "GET", "/v1/tenant", None, None).status,
        401
    );
}

#[test]
fn bad_input_on_admin_and_self_service_routes_is_a_clear_4xx_and_writes_nothing() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let names_before = tenant_names(&server);
    let audit_before = audit_actions(&server).len();
    let post = |body: &str| {
        server.call_raw(
            &server.admin,
            "POST",
            "/admin/v1/tenants",
            Some(ADMIN_TOKEN),
            "application/json",
            body.as_bytes(),
        )
    };
    let create = |body: Value| server.admin_call("POST", "/admin/v1/tenants", Some(&body));
    let expect = |r: Reply, status: u16, code: &str, what: &str| {
        assert_eq!(r.status, status, "{what}: {}", r.body);
        assert_eq!(r.error().1, json!(code), "{what}: {}", r.body);
    };
    expect(post("{not json"), 400, "invalid_json", "malformed JSON");
    let r = post(r#"{"name":"x1","pages_reserved":0,"pages_max":64,"colour":"red"}"#);
    assert!(
        r.body.contains("colour"),
        "names the unknown field: {}",
        r.body
    );
    expect(r, 400, "invalid_json", "unknown field");
    expect(
        post(&format!(r#"{{"name":"{}"}}"#, "x".repeat(70_000))),
        413,
        "request_too_large",
        "oversized body",
    );
    for name in [
        "bad name",
        "a/b",
        "..",
        "\u{7}bell",
        "1starts-with-digit",
        "",
    ] {
        let r = create(json!({"name": name, "pages_reserved": 0, "pages_max": 64}));
        expect(r, 400, "invalid_value", &format!("name {name:?}"));
    }
    expect(
        create(json!({"name": "alpha", "pages_reserved": 0, "pages_max": 64})),
        409,
        "already_exists",
        "duplicate name",
    );
    for (field, value, code) in [
        ("weight", json!(0), "invalid_value"),
        ("weight", json!(1001), "invalid_value"),
        ("queue_depth_max", json!(0), "invalid_value"),
        ("pending_max", json!(100_000), "invalid_value"),
        ("pages_max", json!(-1), "invalid_json"),
        ("pages_max", json!(1e12), "invalid_json"),
        ("pages_max", json!("64"), "invalid_json"),
    ] {
        let mut body = json!({"name": "x2", "pages_reserved": 0, "pages_max": 64});
        body[field] = value.clone();
        expect(create(body), 400, code, &format!("{field} = {value}"));
    }
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/a%2Fb",
        Some(&json!({"weight": 2})),
    );
    expect(r, 404, "tenant_not_found", "a path separator in a name");
    expect(
        server.admin_call(
            "PATCH",
            "/admin/v1/tenants/alpha",
            Some(&json!({"pages_max": 0})),
        ),
        400,
        "invalid_value",
        "pages_max 0",
    );
    expect(
        server.admin_call("GET", "/admin/v1/usage?tenant=alpha&from_ms=abc", None),
        400,
        "invalid_value",
        "a bad query",
    );
    expect(
        server.admin_call("GET", "/admin/v1/audit?limit=0", None),
        400,
        "invalid_value",
        "limit 0",
    );
    // Plugins that are not components.
    for (bytes, what) in [
        (&b"hello"[..], "not wasm"),
        (CORE_MODULE, "a core module"),
        (&b""[..], "empty"),
    ] {
        let r = server.call_raw(
            &server.inference,
            "PUT",
            "/v1/tenant/plugins/p",
            Some(KEY_ALPHA),
            "application/wasm",
            bytes,
        );
        expect(r, 400, "invalid_value", what);
    }
    assert_eq!(tenant_names(&server), names_before, "nothing half-written");
    assert_eq!(
        audit_actions(&server).len(),
        audit_before,
        "nothing audited"
    );

    // A key for a deleted tenant.
    let r = create(json!({"name": "gone", "pages_reserved": 0, "pages_max": 64}));
    assert_eq!(r.status, 409, "no room yet: {}", r.body);
    free_gamma_reservation(&server);
    assert_eq!(
        create(json!({"name": "gone", "pages_reserved": 0, "pages_max": 64})).status,
        201
    );
    assert_eq!(
        server
            .admin_call("DELETE", "/admin/v1/tenants/gone", None)
            .status,
        200
    );
    expect(
        server.admin_call("POST", "/admin/v1/tenants/gone/keys", None),
        404,
        "tenant_not_found",
        "a key for a deleted tenant",
    );
    // Every admin route needs the token.
    for (method, path) in [
        ("GET", "/admin/v1/tenants"),
        ("GET", "/admin/v1/capacity"),
        ("POST", "/admin/v1/tenants/alpha/keys"),
        ("DELETE", "/admin/v1/tenants/alpha"),
    ] {
        let r = server.call(&server.admin, method, path, Some("wrong-token"), None);
        expect(r, 401, "invalid_api_key", path);
    }
    assert!(tenant_names(&server).contains("alpha"));
}

#[test]
fn the_admin_token_must_be_long_and_unlike_any_tenant_key() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let short = "short-token-0123456789";
    match try_launch(Launch::new(&model, &policy).env("BULKHEAD_ADMIN_TOKEN", Some(short))) {
        Ok(_) => panic!("started with a short admin token"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(stderr.contains("at least 32"), "{stderr}");
        }
    }
    let shared = "the-same-secret-for-both-0123456789abcdef";
    let launch = Launch::new(&model, &policy)
        .env("BULKHEAD_ADMIN_TOKEN", Some(shared))
        .env("BULKHEAD_KEY_ALPHA", Some(shared));
    match try_launch(launch) {
        Ok(_) => panic!("started with an admin token that is a tenant key"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(stderr.contains("also a tenant's API key"), "{stderr}");
            assert!(
                !stderr.contains(shared),
                "the secret is not echoed: {stderr}"
            );
        }
    }
}

#[test]
fn generated_secrets_go_to_the_terminal_never_to_the_log() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let launch_plain = |dir: Option<&std::path::Path>| {
        let mut l = Launch::new(&model, &policy)
            .env("BULKHEAD_ADMIN_TOKEN", None)
            .env("BULKHEAD_KEY_GAMMA", None);
        if let Some(dir) = dir {
            l = l.dir(dir);
        }
        launch(l)
    };
    let server = launch_plain(None);
    assert!(eventually(Duration::from_secs(5), || server
        .stdout_lines()
        .len()
        >= 2));
    let out = server.stdout_lines();
    let secret_of = |prefix: &str| {
        out.iter()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("{prefix}: {out:?}"))
            .to_string()
    };
    let gamma = secret_of("key for tenant gamma");
    let admin = secret_of("admin token");
    for line in server.stderr_lines() {
        assert!(!line.contains(&gamma) && !line.contains(&admin), "{line}");
    }
    assert_eq!(chat(&server, &gamma).status, 200);
    let r = server.call(
        &server.admin,
        "GET",
        "/admin/v1/tenants",
        Some(&admin),
        None,
    );
    assert_eq!(r.status, 200);
    // An issued key's secret is in its response only.
    let issued = server.call(
        &server.admin,
        "POST",
        "/admin/v1/tenants/beta/keys",
        Some(&admin),
        None,
    );
    let beta = issued.json()["secret"].as_str().unwrap().to_string();
    // The next start generates nothing: the stored digests still hold.
    let dir = server.kill();
    let server = launch_plain(Some(&dir));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        server.stdout_lines().is_empty(),
        "{:?}",
        server.stdout_lines()
    );
    assert_eq!(chat(&server, &gamma).status, 200);
    assert_eq!(chat(&server, &beta).status, 200);
    let r = server.call(
        &server.admin,
        "GET",
        "/admin/v1/tenants",
        Some(&admin),
        None,
    );
    assert_eq!(r.status, 200);
    for line in server.stderr_lines() {
        assert!(!line.contains(&beta) && !line.contains(&admin), "{line}");
    }
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `GET /admin/v1/models/{MODEL_ID}/pool`, answered 200.
fn pool_audit(server: &Server) -> Value {
    let r = server.admin_call("GET", &format!("/admin/v1/models/{MODEL_ID}/pool"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

#[test]
fn pool_audit_finds_the_pool_back_at_baseline_after_a_completion() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    assert_eq!(chat(&server, KEY_ALPHA).status, 200);
    // The engine publishes the end before its last scrub: poll.
    let mut audit = Value::Null;
    let settled = eventually(Duration::from_secs(10), || {
        audit = pool_audit(&server);
        audit["at_baseline"] == true
    });
    assert!(settled, "{audit}");
    assert_eq!(audit["model"], MODEL_ID);
    assert!(audit["pool_id"].as_u64().unwrap() > 0, "{audit}");
    assert_eq!(audit["in_flight"], 0);
    let pages_count = audit["pages_count"].as_u64().unwrap();
    assert!(pages_count > 0, "{audit}");
    assert_eq!(
        audit["free_pages_checked"], audit["pages_free"],
        "every free page scanned"
    );
    assert_eq!(audit["free_pages_dirty"], 0);
    assert_eq!(audit["invariants"], "ok");
    assert_eq!(audit["pages_owned"], 0);
    assert_eq!(audit["pages_released"], 0);
    assert_eq!(audit["pages_booked"], 0);
    assert!(
        audit["pages_scrubbed_total"].as_u64().unwrap() > 0,
        "the completion's unshared pages were scrubbed: {audit}"
    );
    // The per-tenant rows account for the prefix cache's pages.
    let tenants = audit["tenants"].as_array().unwrap();
    let shared: u64 = tenants
        .iter()
        .map(|t| t["pages_shared"].as_u64().unwrap())
        .sum();
    assert_eq!(audit["pages_shared"], shared, "{audit}");
    let alpha = tenants.iter().find(|t| t["tenant"] == "alpha").unwrap();
    assert!(alpha["tenant_id"].is_u64(), "{audit}");
    assert_eq!(alpha["pages_owned"], 0);
    assert!(
        alpha["pages_shared"].as_u64().unwrap() > 0,
        "alpha's prompt is cached: {audit}"
    );

    let r = server.admin_call("GET", "/admin/v1/models/no-such-model/pool", None);
    assert_eq!((r.status, r.error().1), (404, json!("model_not_found")));
    let r = server.call(
        &server.admin,
        "GET",
        &format!("/admin/v1/models/{MODEL_ID}/pool"),
        None,
        None,
    );
    assert_eq!(r.status, 401);
}

/// A panic planted in the engine between steps (the test build's
/// `fault/panic` route) ends a running stream with `engine_fault`; the
/// supervisor rebuilds the engine with a new, clean pool and it serves again.
#[test]
fn an_injected_engine_panic_ends_the_stream_and_the_engine_comes_back() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let before = pool_audit(&server);
    let panic = format!("/admin/v1/models/{MODEL_ID}/fault/panic");
    let r = server.admin_call("POST", "/admin/v1/models/no-such-model/fault/panic", None);
    if r.status == 404 && r.error().1 == "unknown_url" {
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
            "BULKHEAD_REQUIRE_MODEL is set but the binary has no fault/panic route: \
             build it with `cargo build -p bulkhead --features fault-injection`"
        );
        eprintln!("skipped: the binary was built without feature fault-injection");
        return;
    }
    assert_eq!((r.status, r.error().1), (404, json!("model_not_found")));
    let r = server.call(&server.admin, "POST", &panic, None, None);
    assert_eq!(r.status, 401);

    let mut long = chat_body("Write a long story about a dragon.", 400);
    long["stream"] = json!(true);
    let (status, mut running) = server.stream("/v1/chat/completions", KEY_ALPHA, &long);
    assert_eq!(status, 200);
    running.next_data().unwrap();
    running.next_data().unwrap();
    let r = server.admin_call("POST", &panic, None);
    assert_eq!(r.status, 202, "{}", r.body);
    assert_eq!(r.json(), json!({"model": MODEL_ID}));
    let events = running.rest();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "engine_fault", "{events:?}");

    // Back after the supervisor's backoff: ready, serving, a new pool.
    assert!(eventually(Duration::from_secs(30), || {
        server.get(&server.inference, "/readyz", None).status == 200
    }));
    let enqueued = r#"bulkhead_enqueued_total{model="smollm2-test",tenant="alpha"}"#;
    assert_eq!(server.metric(enqueued), 1.0);
    assert_eq!(chat(&server, KEY_ALPHA).status, 200);
    // The rebuilt engine's counts go on from the broken one's: begun again
    // at zero, they held the counters still (the recorder keeps a counter's
    // largest value) until they passed the old.
    assert!(
        eventually(Duration::from_secs(5), || server.metric(enqueued) == 2.0),
        "{}",
        server.metric(enqueued)
    );
    let mut after = Value::Null;
    let settled = eventually(Duration::from_secs(10), || {
        after = pool_audit(&server);
        after["at_baseline"] == true
    });
    assert!(settled, "{after}");
    assert_ne!(after["pool_id"], before["pool_id"], "{after}");
    assert_eq!(after["free_pages_dirty"], 0);
    assert_eq!(
        server.metric(r#"bulkhead_engine_faults_total{model="smollm2-test"}"#),
        1.0
    );
    // The console's overview counts it too.
    let stats = server.admin_call("GET", "/admin/v1/stats", None).json();
    let model = &stats["models"][0];
    assert_eq!(model["model"], MODEL_ID, "{stats}");
    assert_eq!(
        (&model["engine_panics"], &model["engine_restarts"]),
        (&json!(1), &json!(1)),
        "{stats}"
    );
    assert_eq!(model["ready"], true);
    assert_eq!(stats["alarms_total"], 1, "{stats}");
    let alarm = &stats["alarms"][0];
    assert_eq!(
        (&alarm["kind"], &alarm["subject"]),
        (&json!("engine_fault"), &json!(MODEL_ID)),
        "{stats}"
    );
}

/// One real response, for the OpenAPI check.
fn sample(samples: &mut Vec<Value>, method: &str, template: &str, r: &Reply) {
    let body = if r.body.is_empty() {
        Value::Null
    } else {
        r.json()
    };
    samples.push(json!({"method": method, "path": template, "status": r.status, "body": body}));
}

#[test]
fn real_responses_match_the_openapi_document() {
    let Some(model) = smollm2() else { return };
    let Some(component) = component() else { return };
    let python_ok = Command::new("python3")
        .args(["-c", "import jsonschema"])
        .status()
        .is_ok_and(|s| s.success());
    if !python_ok {
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
            "BULKHEAD_REQUIRE_MODEL is set but the Python `jsonschema` package is missing"
        );
        eprintln!("skipped: the Python `jsonschema` package is not installed");
        return;
    }
    let server = start(&model, &Policy::default());
    let spec = server.get(&server.admin, "/admin/v1/openapi.json", None);
    assert_eq!(spec.status, 200);
    let mut s = Vec::new();
    let t = "/admin/v1/tenants";
    let one = "/admin/v1/tenants/{tenant}";
    let r = server.admin_call("GET", t, None);
    sample(&mut s, "get", t, &r);
    let r = server.call(&server.admin, "GET", t, Some("nope"), None);
    sample(&mut s, "get", t, &r);
    let r = server.admin_call(
        "POST",
        t,
        Some(&json!({"name": "zeta", "pages_reserved": 0, "pages_max": 64})),
    );
    sample(&mut s, "post", t, &r); // 409 with limits
    let r = server.admin_call("POST", t, Some(&json!({"name": "zeta"})));
    sample(&mut s, "post", t, &r); // 400
    free_gamma_reservation(&server);
    let r = server.admin_call(
        "POST",
        t,
        Some(&json!({"name": "zeta", "pages_reserved": 0, "pages_max": 64})),
    );
    sample(&mut s, "post", t, &r);
    for path in ["/admin/v1/tenants/zeta", "/admin/v1/tenants/nobody"] {
        let r = server.admin_call("GET", path, None);
        sample(&mut s, "get", one, &r);
    }
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/zeta",
        Some(&json!({"weight": 2})),
    );
    sample(&mut s, "patch", one, &r);
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/zeta",
        Some(&json!({"pages_max": 1})),
    );
    sample(&mut s, "patch", one, &r);
    let keys = "/admin/v1/tenants/{tenant}/keys";
    let r = server.admin_call("POST", "/admin/v1/tenants/zeta/keys", None);
    sample(&mut s, "post", keys, &r);
    let key_id = r.json()["key"]["id"].as_str().unwrap().to_string();
    let r = server.admin_call("GET", "/admin/v1/tenants/zeta/keys", None);
    sample(&mut s, "get", keys, &r);
    let revoke = "/admin/v1/tenants/{tenant}/keys/{key}";
    let r = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/zeta/keys/{key_id}"),
        None,
    );
    sample(&mut s, "delete", revoke, &r);
    let r = server.admin_call("DELETE", "/admin/v1/tenants/zeta/keys/key_nope", None);
    sample(&mut s, "delete", revoke, &r);
    let plugin = "/admin/v1/tenants/{tenant}/plugins/{plugin}";
    let r = server.call_raw(
        &server.admin,
        "PUT",
        "/admin/v1/tenants/zeta/plugins/p1",
        Some(ADMIN_TOKEN),
        "application/wasm",
        &component,
    );
    sample(&mut s, "put", plugin, &r);
    let r = server.call_raw(
        &server.admin,
        "PUT",
        "/admin/v1/tenants/zeta/plugins/p1",
        Some(ADMIN_TOKEN),
        "application/wasm",
        CORE_MODULE,
    );
    sample(&mut s, "put", plugin, &r);
    let r = server.admin_call("GET", "/admin/v1/tenants/zeta/plugins/p1", None);
    sample(&mut s, "get", plugin, &r);
    let r = server.admin_call("GET", "/admin/v1/tenants/zeta/plugins", None);
    sample(&mut s, "get", "/admin/v1/tenants/{tenant}/plugins", &r);
    let r = server.admin_call("POST", "/admin/v1/tenants/zeta/plugins/p1/disable", None);
    sample(
        &mut s,
        "post",
        "/admin/v1/tenants/{tenant}/plugins/{plugin}/disable",
        &r,
    );
    let r = server.admin_call("POST", "/admin/v1/tenants/zeta/plugins/p1/enable", None);
    sample(
        &mut s,
        "post",
        "/admin/v1/tenants/{tenant}/plugins/{plugin}/enable",
        &r,
    );
    let r = server.admin_call("DELETE", "/admin/v1/tenants/zeta/plugins/p1", None);
    sample(&mut s, "delete", plugin, &r);
    assert_eq!(chat(&server, KEY_ALPHA).status, 200);
    std::thread::sleep(Duration::from_millis(1200)); // one usage flush
    for path in [
        "/admin/v1/usage?tenant=alpha",
        "/admin/v1/usage?tenant_id=1",
        "/admin/v1/usage",
    ] {
        let r = server.admin_call("GET", path, None);
        sample(&mut s, "get", "/admin/v1/usage", &r);
    }
    for path in [
        "/admin/v1/audit?limit=5",
        "/admin/v1/audit?after=3&limit=2",
        "/admin/v1/audit?limit=5000",
        "/admin/v1/audit?before=18446744073709551615&limit=3&tenant=zeta&action=key.",
        "/admin/v1/audit?tenant=zeta&from_ms=0&to_ms=1",
    ] {
        let r = server.admin_call("GET", path, None);
        sample(&mut s, "get", "/admin/v1/audit", &r);
    }
    for path in [
        "/admin/v1/capacity",
        "/admin/v1/partitions",
        "/admin/v1/stats",
    ] {
        let r = server.admin_call("GET", path, None);
        sample(&mut s, "get", path, &r);
    }
    for model in [MODEL_ID, "no-such-model"] {
        let r = server.admin_call("GET", &format!("/admin/v1/models/{model}/pool"), None);
        sample(&mut s, "get", "/admin/v1/models/{model}/pool", &r);
    }
    let r = server.admin_call("DELETE", "/admin/v1/tenants/zeta", None);
    sample(&mut s, "delete", one, &r);
    let statuses: BTreeSet<u64> = s.iter().map(|x| x["status"].as_u64().unwrap()).collect();
    assert!(statuses.is_superset(&[200, 201, 204, 400, 401, 404, 409].into_iter().collect()));
    let spec_path = server.dir.join("openapi.json");
    let samples_path = server.dir.join("samples.json");
    std::fs::write(&spec_path, &spec.body).unwrap();
    std::fs::write(&samples_path, serde_json::to_vec(&s).unwrap()).unwrap();
    let out = Command::new("python3")
        .arg(repo_root().join("scripts/openapi_check.py"))
        .arg(&spec_path)
        .arg(&samples_path)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains(&format!("{} bodies validated", s.len() - 1)),
        "{report}"
    );
}

#[test]
fn bulkhead_admin_commands_do_the_everyday_tasks() {
    let Some(model) = smollm2() else { return };
    let Some(component) = component() else { return };
    let server = start(&model, &Policy::default());
    let admin = |args: &[&str]| {
        let out = Command::new(bulkhead_exe())
            .arg("admin")
            .args(["--url", &server.admin])
            .args(args)
            .env("BULKHEAD_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let ok = |args: &[&str]| {
        let args: Vec<&str> = std::iter::once("--json")
            .chain(args.iter().copied())
            .collect();
        let (code, stdout, stderr) = admin(&args);
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        serde_json::from_str::<Value>(&stdout).unwrap_or(Value::Null)
    };
    // Without --json: tables and lines for a person.
    let table = |args: &[&str]| {
        let (code, stdout, stderr) = admin(args);
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        assert!(serde_json::from_str::<Value>(&stdout).is_err(), "{stdout}");
        stdout
    };
    let tenants = table(&["tenant", "list"]);
    let header = tenants.lines().next().unwrap();
    assert!(header.starts_with("ID  NAME"), "{tenants}");
    for name in ["alpha", "beta", "gamma"] {
        assert!(
            tenants.lines().any(|l| l.contains(&format!(" {name} "))),
            "{tenants}"
        );
    }
    ok(&["quota", "set", "gamma", "--pages-reserved", "0"]);
    let created = ok(&[
        "tenant",
        "create",
        "zeta",
        "--pages-reserved",
        "0",
        "--pages-max",
        "64",
    ]);
    assert_eq!(created["name"], "zeta");
    let issued = ok(&["key", "issue", "zeta"]);
    let secret = issued["secret"].as_str().unwrap().to_string();
    assert_eq!(chat(&server, &secret).status, 200);
    let keys = ok(&["key", "list", "zeta"]);
    assert!(
        !keys.to_string().contains(&secret),
        "listed without secrets"
    );
    // Model access: none, then every model again.
    let none = ok(&["quota", "set", "zeta", "--models", ""]);
    assert_eq!(none["models"], json!([]));
    assert_eq!(chat(&server, &secret).status, 404);
    // The log says what happened: a partition went, not the tenant.
    let log = server.stderr_lines();
    assert!(
        log.iter()
            .any(|l| l.contains("partition removed from this model") && l.contains("zeta")),
        "{log:?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("\"tenant removed\"")),
        "{log:?}"
    );
    let all = ok(&["quota", "set", "zeta", "--models", "*"]);
    assert_eq!(all["models"], json!(["*"]));
    assert_eq!(all["quota"]["prefix_cache"], true, "on by default");
    let off = ok(&["quota", "set", "zeta", "--prefix-cache", "false"]);
    assert_eq!(off["quota"]["prefix_cache"], false);
    assert_eq!(off["quota"]["pages_max"], 64, "other limits unchanged");
    let reply = chat(&server, &secret);
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let models = ok(&["model", "list"]);
    assert_eq!(models["data"][0]["spec"]["id"], MODEL_ID);
    let (code, _, stderr) = admin(&["model", "remove", "no-such-model"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("404"), "{stderr}");
    let key_id = issued["key"]["id"].as_str().unwrap();
    ok(&["key", "revoke", "zeta", key_id]);
    assert_eq!(chat(&server, &secret).status, 401);
    let file = server.dir.join("plugin.wasm");
    std::fs::write(&file, &component).unwrap();
    let plugin = ok(&["plugin", "upload", "zeta", "limits", file.to_str().unwrap()]);
    assert_eq!(plugin["version"], 1);
    ok(&["plugin", "disable", "zeta", "limits"]);
    let capacity = ok(&["capacity"]);
    assert_eq!(capacity["data"][0]["ok"], true);
    ok(&["partitions"]);
    let pool = ok(&["model", "pool", MODEL_ID]);
    assert_eq!(pool["model"], MODEL_ID);
    assert_eq!(pool["invariants"], "ok");
    ok(&["usage", "alpha"]);
    let audit = ok(&["audit", "--limit", "1000"]);
    assert!(audit.to_string().contains("plugin.disable"));
    // Newest first: the latest admin change (the disable) heads the admin's
    // records. Refusals of tenant requests are flushed by the usage book a
    // moment later, so one may be numbered after it.
    let records = audit["data"].as_array().unwrap();
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] > w[1]), "{seqs:?}");
    let newest_admin = records.iter().find(|r| r["actor"] == "admin").unwrap();
    assert_eq!(newest_admin["action"], "plugin.disable", "{audit}");
    let oldest_first = ok(&["audit", "--after", "0", "--limit", "2"]);
    assert_eq!(oldest_first["data"][0]["seq"], 1);
    // Filtered: zeta's plugin events of the last hour, newest first.
    let plugins = ok(&[
        "audit",
        "--tenant",
        "zeta",
        "--action",
        "plugin.",
        "--minutes",
        "60",
    ]);
    let actions: Vec<&str> = plugins["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["plugin.disable", "plugin.upload"], "{plugins}");
    // A refusal: exit 1 and the server's message, and the table for a 409.
    let (code, _, stderr) = admin(&[
        "tenant",
        "create",
        "zeta",
        "--pages-reserved",
        "0",
        "--pages-max",
        "64",
    ]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("exists already"), "{stderr}");
    let (code, _, stderr) = admin(&["quota", "set", "zeta", "--pages-max", "10"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("tenant zeta maximum"), "{stderr}");
    let (code, _, stderr) = admin(&["--token", "wrong", "tenant", "list"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("401"), "{stderr}");
    ok(&["tenant", "delete", "zeta"]);
}

#[test]
fn bulkhead_check_reads_the_store_the_server_uses() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let mut server = start(&model, &policy);
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/beta",
        Some(&json!({"pages_max": 70})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    server.terminate();
    assert!(server.wait(Duration::from_secs(30)).success());
    let config = server.dir.join("policy.toml");
    let out = Command::new(bulkhead_exe())
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("tenants: the store at"), "{stdout}");
    // beta's maximum as the store has it (70 pages of 16 tokens), not the policy's 96.
    let beta = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("tenant beta maximum"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(beta.contains(" 1120 "), "{beta}");
}

/// The lines of stdout that carry a secret, and each secret.
fn shown_secrets(server: &Server) -> Vec<(String, String)> {
    server
        .stdout_lines()
        .into_iter()
        .filter_map(|line| {
            let (label, secret) = line.rsplit_once(": ")?;
            Some((label.to_string(), secret.to_string()))
        })
        .collect()
}

fn secret(shown: &[(String, String)], prefix: &str) -> String {
    shown
        .iter()
        .find(|(label, _)| label.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in {shown:?}"))
        .1
        .clone()
}

fn admin_get(server: &Server, token: &str) -> u16 {
    server
        .call(&server.admin, "GET", "/admin/v1/tenants", Some(token), None)
        .status
}

#[test]
fn a_start_that_fails_generates_no_secret_and_the_next_one_shows_them() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let dir = temp_dir("failed-starts");
    let plain = || {
        Launch::new(&model, &policy)
            .dir(&dir)
            .env("BULKHEAD_ADMIN_TOKEN", None)
            .env("BULKHEAD_KEY_GAMMA", None)
    };
    // A port in use, then a too-short admin token: both refuse to start,
    // and neither shows nor stores a secret.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let Err((status, stderr)) = try_launch(plain().listen(&port)) else {
        panic!("started on a port in use")
    };
    assert!(!status.success() && stderr.contains(&port), "{stderr}");
    let Err((_, stderr)) =
        try_launch(plain().env("BULKHEAD_ADMIN_TOKEN", Some("short-token-0123456789")))
    else {
        panic!("started with a short admin token")
    };
    assert!(stderr.contains("at least 32"), "{stderr}");
    drop(taken);
    // So the next start still has everything to show, and it works.
    let server = launch(plain());
    assert!(eventually(Duration::from_secs(5), || shown_secrets(
        &server
    )
    .len()
        >= 2));
    let shown = shown_secrets(&server);
    let (gamma, admin) = (
        secret(&shown, "key for tenant gamma"),
        secret(&shown, "admin token"),
    );
    assert_eq!(chat(&server, &gamma).status, 200);
    assert_eq!(admin_get(&server, &admin), 200);
    let audit = server.call(
        &server.admin,
        "GET",
        "/admin/v1/audit?limit=1000",
        Some(&admin),
        None,
    );
    let generated = audit.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "key.generate")
        .count();
    assert_eq!(generated, 1, "one key generated in three starts");
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tenant_whose_keys_were_all_revoked_gets_no_new_one_at_the_next_start() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let no_gamma_env = |dir: Option<&std::path::Path>| {
        let l = Launch::new(&model, &policy).env("BULKHEAD_KEY_GAMMA", None);
        launch(match dir {
            Some(dir) => l.dir(dir),
            None => l,
        })
    };
    let server = no_gamma_env(None);
    assert!(eventually(Duration::from_secs(5), || !shown_secrets(
        &server
    )
    .is_empty()));
    let gamma = secret(&shown_secrets(&server), "key for tenant gamma");
    let keys = server.admin_call("GET", "/admin/v1/tenants/gamma/keys", None);
    let id = keys.json()["data"][0]["id"].as_str().unwrap().to_string();
    let r = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/gamma/keys/{id}"),
        None,
    );
    assert!(r.status < 300, "{}", r.body);
    assert_eq!(chat(&server, &gamma).status, 401);
    let dir = server.kill();
    let server = no_gamma_env(Some(&dir));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        shown_secrets(&server).is_empty(),
        "{:?}",
        server.stdout_lines()
    );
    assert_eq!(chat(&server, &gamma).status, 401);
    let keys = server.admin_call("GET", "/admin/v1/tenants/gamma/keys", None);
    assert_eq!(
        keys.json()["data"].as_array().unwrap().len(),
        1,
        "{}",
        keys.body
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_admin_token_rotates_through_the_environment_and_resets_offline() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let (first, second) = (ADMIN_TOKEN, "rotated-admin-token-0123456789abcdef-2");
    let server = launch(Launch::new(&model, &policy));
    assert_eq!(admin_get(&server, first), 200);
    // A different token in the variable is a rotation: the old one is gone,
    // also once the variable is unset again.
    let dir = server.kill();
    let with = |token: Option<&str>| {
        launch(
            Launch::new(&model, &policy)
                .dir(&dir)
                .env("BULKHEAD_ADMIN_TOKEN", token),
        )
    };
    let server = with(Some(second));
    assert_eq!(admin_get(&server, second), 200);
    assert_eq!(admin_get(&server, first), 401);
    let dir = server.kill();
    let server = with(None);
    assert!(server.stdout_lines().is_empty(), "nothing generated");
    assert_eq!(admin_get(&server, second), 200);
    assert_eq!(admin_get(&server, first), 401);
    // A lost token is replaced offline; not while a server holds the store.
    let reset = || {
        Command::new(bulkhead_exe())
            .args(["reset-admin-token", "--config"])
            .arg(dir.join("policy.toml"))
            .env_remove("BULKHEAD_ADMIN_TOKEN")
            .output()
            .unwrap()
    };
    let held = reset();
    assert!(!held.status.success());
    let stderr = String::from_utf8_lossy(&held.stderr);
    assert!(
        !stderr.contains("panicked") && held.stdout.is_empty(),
        "{stderr}"
    );
    let dir = server.kill();
    let out = reset();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let third = stdout.trim().rsplit(' ').next().unwrap().to_string();
    assert!(third.starts_with("bk-admin-"), "{stdout}");
    let server = with(None);
    assert_eq!(admin_get(&server, third.as_str()), 200);
    assert_eq!(admin_get(&server, second), 401);
    let audit = server.call(
        &server.admin,
        "GET",
        "/admin/v1/audit?limit=1000",
        Some(&third),
        None,
    );
    let kinds: Vec<String> = audit.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap().to_string())
        .collect();
    for kind in ["admin_token.env", "admin_token.rotate", "admin_token.reset"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} not in {kinds:?}");
    }
    for record in audit.json()["data"].as_array().unwrap() {
        let text = record.to_string();
        assert!(!text.contains(second) && !text.contains(&third), "{text}");
    }
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_usage_window_defaults_its_missing_end_and_blames_the_parameter_at_fault() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let usage = |query: &str| {
        server.admin_call("GET", &format!("/admin/v1/usage?tenant=alpha{query}"), None)
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    // A start alone: up to now, at most the 31 days kept.
    let r = usage("&from_ms=0");
    assert_eq!(r.status, 200, "{}", r.body);
    let (from, to) = (
        r.json()["from_ms"].as_u64().unwrap(),
        r.json()["to_ms"].as_u64().unwrap(),
    );
    assert!(to > now && to <= now + 120_000, "{}", r.body);
    assert_eq!((to - from) / 60_000, 31 * 24 * 60, "{}", r.body);
    // An end alone: the hour before it.
    let r = usage(&format!("&to_ms={now}"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["to_ms"].as_u64().unwrap() / 60_000, now / 60_000);
    // A start in the future is the start's fault; a window too wide too.
    let r = usage(&format!("&from_ms={}", now + 3_600_000));
    assert_eq!(
        (r.status, r.error().0),
        (400, json!("from_ms")),
        "{}",
        r.body
    );
    let r = usage(&format!("&from_ms=0&to_ms={now}"));
    assert_eq!(
        (r.status, r.error().0),
        (400, json!("from_ms")),
        "{}",
        r.body
    );
    // An end before the start is the end's.
    let r = usage(&format!("&from_ms={now}&to_ms={}", now - 3_600_000));
    assert_eq!((r.status, r.error().0), (400, json!("to_ms")), "{}", r.body);
}
