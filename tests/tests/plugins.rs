//! Policy plugins through the real binary: the examples a tenant would use,
//! each hostile guest contained while another tenant is served, no memory
//! carried between calls, bad uploads refused, state and budgets that belong
//! to their plugin, hot swap, the circuit breaker, operator plugins, and
//! sealed artifacts across a restart. The components come from plugins/
//! (`scripts/plugins.sh`).

mod support;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

/// A policy whose plugins do not get disabled by the faults a test provokes.
fn tolerant(extra: &str) -> Policy {
    Policy {
        alpha_pending_max: 64,
        plugins_toml: format!("[plugins]\nfaults_max = 1000\n{extra}"),
        ..Policy::default()
    }
}

#[test]
fn the_example_plugins_work_end_to_end() {
    let Some(model) = smollm2() else { return };
    let (Some(rate), Some(cap), Some(router), Some(allow)) = (
        wasm("rate_limit"),
        wasm("size_cap"),
        wasm("router"),
        wasm("allow_list"),
    ) else {
        return;
    };
    let server = Arc::new(start(&model, &tolerant("")));

    // rate-limit: 20 requests per minute per user, booked atomically: of 32
    // concurrent requests exactly 20 pass.
    uploaded(&server, "alpha", "rate", &rate);
    let statuses: Vec<(u16, Option<String>, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..32)
            .map(|_| {
                let server = Arc::clone(&server);
                scope.spawn(move || {
                    let r = ask(&server, KEY_ALPHA, &[("x-user", "bob")], 2);
                    let c = code(&r);
                    (r.status, r.retry_after, c)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = statuses.iter().filter(|s| s.0 == 200).count();
    assert_eq!(ok, 20, "{statuses:?}");
    for (status, retry_after, code) in statuses.iter().filter(|s| s.0 != 200) {
        assert_eq!((*status, code.as_str()), (429, "rate_limited"));
        assert!(retry_after.is_some(), "429 carries Retry-After");
    }
    assert_eq!(
        ask(&server, KEY_ALPHA, &[("x-user", "carol")], 2).status,
        200
    );
    assert_eq!(
        ask(&server, KEY_BETA, &[("x-user", "bob")], 2).status,
        200,
        "beta has no plugin"
    );

    // size-cap: a long prompt is refused with its message; generation is cut.
    uploaded(&server, "beta", "cap", &cap);
    let r = ask_prompt(&server, KEY_BETA, &[], &"word ".repeat(300), 4);
    assert_eq!((r.status, code(&r).as_str()), (400, "prompt_too_large"));
    assert!(message(&r).contains("limited to 200 tokens"), "{}", r.body);
    let r = ask(&server, KEY_BETA, &[], 100);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() <= 64);
    // A tenant with plugins cannot ask for several choices: the plugins'
    // contract sees one sequence's sizes and usage per request.
    let mut body = chat_body("hi", 2);
    body["n"] = json!(2);
    let r = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error().0, "n", "{}", r.body);
    // Nor a batch of prompts, for the same reason.
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_BETA),
        &json!({"model": MODEL_ID, "prompt": ["hi", "ho"], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error().0, "prompt", "{}", r.body);
    assert!(message(&r).contains("batch"), "{}", r.body);

    // router: x-priority: low lowers the request's priority.
    uploaded(&server, "gamma", "router", &router);
    let r = ask(&server, KEY_GAMMA, &[("x-priority", "low")], 2);
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.request_id.unwrap();
    let admitted = server
        .stderr_lines()
        .into_iter()
        .find(|l| l.contains(&id) && l.contains("\"admitted\""))
        .expect("an admitted line");
    assert!(admitted.contains("\"priority\":32"), "{admitted}");

    // allow-list: only allowed teams.
    uploaded(&server, "gamma", "allow", &allow);
    let r = ask(&server, KEY_GAMMA, &[], 2);
    assert_eq!((r.status, code(&r).as_str()), (403, "team_not_allowed"));
    assert_eq!(ask(&server, KEY_GAMMA, &[("x-team", "red")], 2).status, 200);
    assert!(server.metric(r#"bulkhead_plugin_calls_total{outcome="ok"}"#) > 40.0);
}

/// Latencies of `n` small requests by `key`, one after another.
fn latencies(server: &Server, key: &str, n: usize) -> Vec<Duration> {
    (0..n)
        .map(|_| {
            let started = Instant::now();
            let r = ask(server, key, &[], 4);
            assert_eq!(r.status, 200, "{}", r.body);
            started.elapsed()
        })
        .collect()
}

fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[((samples.len() as f64) * 0.99).ceil() as usize - 1]
}

#[test]
fn hostile_plugins_fail_closed_while_another_tenant_is_served() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let server = Arc::new(start(&model, &tolerant("")));
    uploaded(&server, "alpha", "probe", &probe);
    let solo = p99(latencies(&server, KEY_BETA, 12));

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hostile = {
        let server = Arc::clone(&server);
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut seen: BTreeMap<String, (u16, String)> = BTreeMap::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for mode in [
                    "loop",
                    "host-loop",
                    "memory",
                    "trap",
                    "handles",
                    "state-flood",
                ] {
                    let r = ask(&server, KEY_ALPHA, &[("x-probe", mode)], 2);
                    seen.insert(mode.to_string(), (r.status, code(&r)));
                }
            }
            seen
        })
    };
    let during = p99(latencies(&server, KEY_BETA, 12));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = hostile.join().unwrap();
    for mode in [
        "loop",
        "host-loop",
        "memory",
        "trap",
        "handles",
        "state-flood",
    ] {
        assert_eq!(
            seen[mode],
            (503, "policy_unavailable".to_string()),
            "{mode} fails closed"
        );
    }
    // The stated bound: beta's p99 under the attack stays within 3x its solo
    // p99 plus 1 s (2 cores shared by the server, the attack and the clients).
    eprintln!("beta p99 solo {solo:?}, during the hostile plugin {during:?}");
    assert!(
        during <= solo * 3 + Duration::from_secs(1),
        "beta p99 {during:?} against solo {solo:?}"
    );
    // Each kind of fault is counted.
    let metrics = server.metrics();
    for outcome in ["fuel", "host_limit", "memory", "trap"] {
        let n = metric_value(
            &metrics,
            &format!(r#"bulkhead_plugin_calls_total{{outcome="{outcome}"}}"#),
        );
        assert!(n >= 1.0, "{outcome}: {metrics}");
    }
    // A huge answer is cut to the contract's bounds.
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "big")], 2);
    assert_eq!(r.status, 403, "an invalid status becomes 403");
    assert_eq!(code(&r), "policy_rejected", "an invalid code is replaced");
    assert!(message(&r).len() <= 256, "{}", message(&r).len());
    assert!(r.retry_after.is_none());
}

#[test]
fn no_instance_memory_is_visible_to_the_next_call() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    // Enough fuel and time to scan the whole linear memory.
    let server = start(
        &model,
        &tolerant(
            "fuel = 2000000000
deadline_ms = 2000
",
        ),
    );
    uploaded(&server, "alpha", "probe", &probe);
    uploaded(&server, "beta", "probe", &probe);
    // The checker works: a secret left in the same instance is found.
    let canary = "SECRET-canary-0123456789";
    let r = ask(
        &server,
        KEY_ALPHA,
        &[("x-probe", "snoop-self"), ("x-secret", canary)],
        2,
    );
    assert_eq!((r.status, code(&r).as_str()), (403, "leak"), "{}", r.body);
    assert!(message(&r).contains(canary), "{}", r.body);
    for round in 0..10 {
        let secret = format!("SECRET-{round}-0123456789abcdefghijklmnopqrstuvwxyz");
        let (writer, reader) = if round % 2 == 0 {
            (KEY_ALPHA, KEY_BETA)
        } else {
            (KEY_ALPHA, KEY_ALPHA)
        };
        let w = ask(
            &server,
            writer,
            &[("x-probe", "snoop-write"), ("x-secret", &secret)],
            2,
        );
        assert_eq!(w.status, 200, "{}", w.body);
        let r = ask(&server, reader, &[("x-probe", "snoop-read")], 2);
        assert_eq!(
            r.status, 200,
            "round {round}: the next instance saw memory: {}",
            r.body
        );
    }
}

#[test]
fn bad_uploads_are_refused_with_clear_errors_and_change_nothing() {
    let Some(model) = smollm2() else { return };
    let (Some(wrong), Some(bad), Some(good)) =
        (wasm("wrong_world"), wasm("bad_import"), wasm("size_cap"))
    else {
        return;
    };
    let server = start(&model, &Policy::default());
    uploaded(&server, "alpha", "gate", &good);
    let core = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];
    for (bytes, query, needle) in [
        (&b"not wasm at all"[..], "", "not WebAssembly"),
        (&core[..], "", "core WebAssembly module"),
        (
            &wrong[..],
            "",
            "does not export bulkhead:policy/policy@0.1.0",
        ),
        (
            &bad[..],
            "",
            "imports fixture:bad-import/network, which the tenant-policy world",
        ),
        (&good[..], "?fuel=999999999999999", "fuel is at most"),
        (
            &good[..],
            "?deadline_ms=0",
            "deadline_ms must be at least 1",
        ),
        (&good[..], "?colour=red", "colour"),
    ] {
        let r = upload(&server, "alpha", "gate", bytes, query);
        assert_eq!(r.status, 400, "{needle}: {}", r.body);
        assert!(
            message(&r).contains(needle) || r.body.contains(needle),
            "{needle}: {}",
            r.body
        );
    }
    // Over the size limit: refused by its length.
    let huge = vec![0u8; (16 << 20) + 1];
    let r = upload(&server, "alpha", "huge", &huge, "");
    assert_eq!((r.status, code(&r).as_str()), (413, "request_too_large"));
    // The good version still serves, unchanged.
    let plugins = server
        .admin_call("GET", "/admin/v1/tenants/alpha/plugins", None)
        .json();
    assert_eq!(plugins["data"].as_array().unwrap().len(), 1);
    assert_eq!(plugins["data"][0]["version"], 1);
    let r = ask_prompt(&server, KEY_ALPHA, &[], &"word ".repeat(300), 4);
    assert_eq!(code(&r), "prompt_too_large");
}

#[test]
fn a_plugins_state_and_budgets_belong_to_it_alone() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let server = start(&model, &tolerant(""));
    let admin = |method: &str, path: &str| server.admin_call(method, path, None);
    uploaded(&server, "alpha", "p1", &probe);
    uploaded(&server, "alpha", "p2", &probe);
    uploaded(&server, "beta", "p1", &probe);
    // Only alpha's p1 writes.
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/p2/disable").status,
        200
    );
    let r = ask(
        &server,
        KEY_ALPHA,
        &[("x-probe", "state-set"), ("x-value", "alpha-p1-data")],
        2,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "state-get")], 2);
    assert_eq!(message(&r), "alpha-p1-data");
    // Another plugin of the same tenant, and the same name in another tenant,
    // see nothing of it.
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/p1/disable").status,
        200
    );
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/p2/enable").status,
        200
    );
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "state-get")], 2);
    assert_eq!(message(&r), "none", "p2 of alpha");
    let r = ask(&server, KEY_BETA, &[("x-probe", "state-get")], 2);
    assert_eq!(message(&r), "none", "p1 of beta");
    // The partition handle shows the caller's own partition only.
    let r = ask(&server, KEY_BETA, &[("x-probe", "stats")], 2);
    assert!(
        message(&r).starts_with("reserved=64 max=96"),
        "{}",
        message(&r)
    );
    // A deleted plugin's state goes with it.
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/p1/enable").status,
        200
    );
    assert_eq!(
        admin("DELETE", "/admin/v1/tenants/alpha/plugins/p1").status,
        204
    );
    uploaded(&server, "alpha", "p1", &probe);
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/p2/disable").status,
        200
    );
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "state-get")], 2);
    assert_eq!(message(&r), "none", "a re-uploaded p1 starts empty");
}

#[test]
fn on_complete_sees_the_real_counts_of_streamed_requests() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let server = start(&model, &tolerant(""));
    uploaded(&server, "alpha", "probe", &probe);
    let mut body = json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 5,
                          "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    body["stream"] = json!(true);
    let (status, mut sse) = server.stream("/v1/completions", KEY_ALPHA, &body);
    assert_eq!(status, 200);
    let events = sse.rest();
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    let completion_tokens = usage["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(eventually(Duration::from_secs(5), || {
        let r = ask(&server, KEY_ALPHA, &[("x-probe", "report")], 2);
        message(&r).contains(&format!("completion_tokens={completion_tokens}"))
    }));
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "report")], 2);
    assert!(message(&r).contains("prompt_tokens=4"), "{}", message(&r));
}

#[test]
fn uploads_swap_and_disable_and_delete_apply_on_the_next_request() {
    let Some(model) = smollm2() else { return };
    let (Some(cap), Some(allow)) = (wasm("size_cap"), wasm("allow_list")) else {
        return;
    };
    let server = start(&model, &Policy::default());
    let long = "word ".repeat(300);
    uploaded(&server, "alpha", "gate", &cap);
    assert_eq!(
        code(&ask_prompt(&server, KEY_ALPHA, &[], &long, 4)),
        "prompt_too_large"
    );
    // A request already past admission keeps running through the swap.
    let mut stream_body = chat_body("Write a story about a lighthouse.", 40);
    stream_body["stream"] = json!(true);
    let (status, mut running) = server.stream("/v1/chat/completions", KEY_ALPHA, &stream_body);
    assert_eq!(status, 200);
    running.next_data().unwrap();
    // Version 2 under the same name: the next request meets it.
    uploaded(&server, "alpha", "gate", &allow);
    let r = ask(&server, KEY_ALPHA, &[], 2);
    assert_eq!(code(&r), "team_not_allowed");
    assert_eq!(
        running.rest().last().map(String::as_str),
        Some("[DONE]"),
        "the in-flight request finished"
    );
    // An incompatible upload is refused before the swap: version 2 still serves.
    let r = upload(&server, "alpha", "gate", b"\0asm\x01\0\0\0", "");
    assert_eq!(r.status, 400);
    assert_eq!(code(&ask(&server, KEY_ALPHA, &[], 2)), "team_not_allowed");
    let v = server
        .admin_call("GET", "/admin/v1/tenants/alpha/plugins/gate", None)
        .json();
    assert_eq!(v["version"], 2);
    // Disable, enable, delete: each on the next request.
    let admin = |method: &str, path: &str| server.admin_call(method, path, None).status;
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/gate/disable"),
        200
    );
    assert_eq!(ask(&server, KEY_ALPHA, &[], 2).status, 200);
    assert_eq!(
        admin("POST", "/admin/v1/tenants/alpha/plugins/gate/enable"),
        200
    );
    assert_eq!(code(&ask(&server, KEY_ALPHA, &[], 2)), "team_not_allowed");
    assert_eq!(admin("DELETE", "/admin/v1/tenants/alpha/plugins/gate"), 204);
    assert_eq!(ask(&server, KEY_ALPHA, &[], 2).status, 200);
    // The tenant's self-service route uploads its own.
    let r = server.call_raw(
        &server.inference,
        "PUT",
        "/v1/tenant/plugins/gate",
        Some(KEY_BETA),
        "application/wasm",
        &allow,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(code(&ask(&server, KEY_BETA, &[], 2)), "team_not_allowed");
    assert_eq!(
        ask(&server, KEY_ALPHA, &[], 2).status,
        200,
        "alpha is not affected"
    );
}

#[test]
fn repeated_faults_disable_a_plugin_with_an_audit_event() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let policy = Policy {
        plugins_toml: "[plugins]\nfaults_max = 3\nfault_window_ms = 60000\n".into(),
        ..Policy::default()
    };
    let server = start(&model, &policy);
    uploaded(&server, "alpha", "probe", &probe);
    for _ in 0..3 {
        let r = ask(&server, KEY_ALPHA, &[("x-probe", "trap")], 2);
        assert_eq!((r.status, code(&r).as_str()), (503, "policy_unavailable"));
    }
    // Disabled: the next request runs without it, and the store says so.
    assert!(eventually(Duration::from_secs(5), || {
        ask(&server, KEY_ALPHA, &[("x-probe", "trap")], 2).status == 200
    }));
    assert!(eventually(Duration::from_secs(5), || {
        server
            .admin_call("GET", "/admin/v1/tenants/alpha/plugins/probe", None)
            .json()["enabled"]
            == false
    }));
    // Its view counts the faults in the window and names the last one's kind
    // (what the console's plugins page shows beside the audit's reason).
    let view = server
        .admin_call("GET", "/admin/v1/tenants/alpha/plugins/probe", None)
        .json();
    assert_eq!(view["faults_recent"], 3, "{view}");
    assert_eq!(view["last_fault"], "trap", "{view}");
    // Another tenant's copy of the same code has faults of its own: none.
    uploaded(&server, "beta", "probe", &probe);
    let other = server
        .admin_call("GET", "/admin/v1/tenants/beta/plugins/probe", None)
        .json();
    assert_eq!(
        (&other["faults_recent"], other.get("last_fault")),
        (&json!(0), None)
    );
    let audit = server
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .json();
    let disabled = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["action"] == "plugin.disable")
        .cloned()
        .expect("audited");
    assert_eq!(disabled["actor"], "system");
    assert_eq!(disabled["detail"]["reason"], "faults");
    assert_eq!(server.metric("bulkhead_plugins_disabled_total"), 1.0);
}

#[test]
fn operator_plugins_run_first_for_every_tenant_and_the_first_reject_wins() {
    let Some(model) = smollm2() else { return };
    let (Some(cap_path), Some(rate)) = (plugin_wasm("size_cap"), wasm("rate_limit")) else {
        return;
    };
    let policy = Policy {
        plugins_toml: format!(
            "[[plugins.operator]]\nname = \"cap\"\npath = \"{}\"\n",
            cap_path.display()
        ),
        ..Policy::default()
    };
    let server = start(&model, &policy);
    let long = "word ".repeat(300);
    for key in [KEY_ALPHA, KEY_BETA, KEY_GAMMA] {
        assert_eq!(
            code(&ask_prompt(&server, key, &[], &long, 4)),
            "prompt_too_large"
        );
    }
    // Alpha's own limiter never sees what the operator refused: its 20
    // requests a minute are all still there.
    uploaded(&server, "alpha", "rate", &rate);
    for _ in 0..10 {
        assert_eq!(
            code(&ask_prompt(&server, KEY_ALPHA, &[], &long, 4)),
            "prompt_too_large"
        );
    }
    for i in 0..20 {
        assert_eq!(ask(&server, KEY_ALPHA, &[], 2).status, 200, "request {i}");
    }
    assert_eq!(code(&ask(&server, KEY_ALPHA, &[], 2)), "rate_limited");
    // A tenant cannot upload an operator-world component's powers: an
    // operator plugin file that is not a component stops start-up.
    let broken_dir = std::env::temp_dir().join(format!("bulkhead-op-{}", std::process::id()));
    std::fs::create_dir_all(&broken_dir).unwrap();
    let broken = broken_dir.join("broken.wasm");
    std::fs::write(&broken, b"nope").unwrap();
    let policy = Policy {
        plugins_toml: format!(
            "[[plugins.operator]]\nname = \"broken\"\npath = \"{}\"\n",
            broken.display()
        ),
        ..Policy::default()
    };
    match try_start(&model, &policy) {
        Ok(_) => panic!("started with a broken operator plugin"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(stderr.contains("operator plugin broken"), "{stderr}");
        }
    }
    std::fs::remove_dir_all(&broken_dir).unwrap();
}

#[test]
fn deadlines_and_fuel_stop_a_plugin_and_it_can_see_what_is_left() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    // Fuel too plentiful to run out first: the deadline stops the loop.
    let server = start(
        &model,
        &tolerant("fuel = 1000000000000\ndeadline_ms = 50\n"),
    );
    uploaded(&server, "alpha", "probe", &probe);
    let started = Instant::now();
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "loop")], 2);
    assert_eq!((r.status, code(&r).as_str()), (503, "policy_unavailable"));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(server.metric(r#"bulkhead_plugin_calls_total{outcome="deadline"}"#) >= 1.0);
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "remaining")], 2);
    let left = message(&r);
    let time_ms: u64 = left
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("time_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX);
    assert!(time_ms <= 50, "{left}");
    // A plugin that asks for less fuel runs out of fuel instead.
    let r = upload(&server, "alpha", "probe", &probe, "?fuel=1000000");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "loop")], 2);
    assert_eq!(r.status, 503);
    assert!(server.metric(r#"bulkhead_plugin_calls_total{outcome="fuel"}"#) >= 1.0);
}

#[test]
fn compiled_plugins_are_reused_across_a_restart_only_when_sealed_by_this_host() {
    let Some(model) = smollm2() else { return };
    let Some(cap) = wasm("size_cap") else { return };
    let policy = Policy::default();
    let server = start(&model, &policy);
    uploaded(&server, "alpha", "cap", &cap);
    let dir = server.kill();
    let loaded = |server: &Server| {
        server
            .stderr_lines()
            .into_iter()
            .find(|l| l.contains("plugin loaded"))
            .unwrap_or_default()
    };
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    assert!(
        loaded(&server).contains("\"compiled\":false"),
        "{}",
        loaded(&server)
    );
    assert_eq!(
        code(&ask_prompt(
            &server,
            KEY_ALPHA,
            &[],
            &"word ".repeat(300),
            4
        )),
        "prompt_too_large"
    );
    // Another secret: the sealed form no longer opens, the plugin is compiled again.
    let dir = server.kill();
    std::fs::remove_file(dir.join("bulkhead-state/plugin-artifacts.key")).unwrap();
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    assert!(
        loaded(&server).contains("\"compiled\":true"),
        "{}",
        loaded(&server)
    );
    assert_eq!(
        code(&ask_prompt(
            &server,
            KEY_ALPHA,
            &[],
            &"word ".repeat(300),
            4
        )),
        "prompt_too_large"
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A new version is built before the old one leaves the chain: requests sent
/// while a plugin is uploaded again and again all find one version of it,
/// never none (a request in that gap would run without the tenant's policy).
#[test]
fn a_plugin_swapped_under_load_leaves_no_request_without_it() {
    let Some(model) = smollm2() else { return };
    let Some(cap) = wasm("size_cap") else { return };
    let server = Arc::new(start(&model, &tolerant("uploads_per_minute = 1000\n")));
    uploaded(&server, "beta", "cap", &cap);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probes: Vec<_> = (0..2)
        .map(|_| {
            let (server, done) = (Arc::clone(&server), Arc::clone(&done));
            std::thread::spawn(move || {
                let (mut refused, mut through) = (0u32, 0u32);
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = ask_prompt(&server, KEY_BETA, &[], &"word ".repeat(300), 1);
                    match r.status {
                        400 => refused += 1,
                        _ => through += 1,
                    }
                }
                (refused, through)
            })
        })
        .collect();
    for _ in 0..40 {
        uploaded(&server, "beta", "cap", &cap);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut refused, mut through) = (0, 0);
    for probe in probes {
        let (r, t) = probe.join().unwrap();
        refused += r;
        through += t;
    }
    eprintln!("{refused} requests refused by one version or another, {through} not");
    assert!(refused > 40, "the probes ran during the swaps: {refused}");
    assert_eq!(through, 0, "requests ran without the tenant's plugin");
}
