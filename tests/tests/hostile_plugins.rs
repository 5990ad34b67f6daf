//! Hostile plugins that try to hold the host, through the real binary: a
//! guest that would sleep on a WASI timer (refused at upload: the host links
//! no WASI), a call stuck inside a host function in `admit`, `route` and
//! `on-complete` (abandoned at its deadline, its worker replaced, the request
//! failed closed, nobody else kept waiting, and SIGTERM still stops the
//! server), sixteen plugins that each take just under their deadline (one time
//! budget per request for all of a tenant's plugins), and a flood of slow
//! `on-complete` calls (each tenant's queue bounded, tenants in turn). The
//! host-call stall is the test build's fault injection
//! (`POST /admin/v1/tenants/{t}/fault/plugin-stall`).

mod support;

use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

/// A policy whose plugins are not disabled by the faults a test provokes,
/// with fuel enough to spin until their deadline, and a second model so that
/// `route` is asked.
fn tolerant_two_models(extra_plugins: &str) -> Option<Policy> {
    let q8 = smollm2_q8()?;
    Some(Policy {
        alpha_pending_max: 64,
        beta_pending_max: 64,
        plugins_toml: format!(
            "[plugins]\nfaults_max = 100000\nfuel = 10000000000\n{extra_plugins}"
        ),
        extra_toml: model_toml(Q8_ID, &q8, 224),
        ..Policy::default()
    })
}

fn stall(server: &Server, tenant: &str, ms: u64) {
    let r = server.admin_call(
        "POST",
        &format!("/admin/v1/tenants/{tenant}/fault/plugin-stall"),
        Some(&json!({ "ms": ms })),
    );
    assert_eq!(r.status, 202, "{}", r.body);
}

/// `ask`, and how long it took.
fn timed(server: &Server, key: &str, headers: &[(&str, &str)]) -> (Reply, Duration) {
    let started = Instant::now();
    let r = ask(server, key, headers, 1);
    (r, started.elapsed())
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

#[test]
fn a_plugin_that_imports_wasi_is_refused_at_upload_naming_the_import() {
    let Some(model) = smollm2() else { return };
    let (Some(sleeper), Some(probe)) = (wasm("sleeper"), wasm("probe")) else {
        return;
    };
    let server = start(&model, &Policy::default());
    // Through the admin API and through a tenant's own key alike.
    let admin = upload(&server, "alpha", "sleeper", &sleeper, "");
    let own = server.call_raw(
        &server.inference,
        "PUT",
        "/v1/tenant/plugins/sleeper",
        Some(KEY_BETA),
        "application/wasm",
        &sleeper,
    );
    for r in [&admin, &own] {
        assert_eq!(r.status, 400, "{}", r.body);
        let m = message(r);
        assert!(m.contains("imports wasi:"), "{m}");
        assert!(m.contains("no_std"), "the message says what to do: {m}");
    }
    // Nothing was stored; a plugin importing only the contract is accepted.
    for tenant in ["alpha", "beta"] {
        let listed = server
            .admin_call("GET", &format!("/admin/v1/tenants/{tenant}/plugins"), None)
            .json();
        assert_eq!(listed["data"].as_array().unwrap().len(), 0, "{listed}");
    }
    uploaded(&server, "alpha", "probe", &probe);
    assert_eq!(ask(&server, KEY_ALPHA, &[], 1).status, 200);
}

#[test]
fn a_call_stuck_in_a_host_call_is_abandoned_in_admit_route_and_on_complete() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let Some(policy) = tolerant_two_models("") else {
        return;
    };
    let mut server = start(&model, &policy);
    uploaded(&server, "alpha", "probe", &probe);
    uploaded(&server, "beta", "probe", &probe);
    // Every host call of alpha's plugins now blocks for two minutes.
    stall(&server, "alpha", 120_000);
    let bound = Duration::from_secs(3);

    // admit, then route: each fails closed at its deadline, not in two minutes.
    for header in ["x-probe", "x-probe-route"] {
        let (r, took) = timed(&server, KEY_ALPHA, &[(header, "clock")]);
        assert_eq!(
            (r.status, code(&r).as_str()),
            (503, "policy_unavailable"),
            "{header}: {}",
            r.body
        );
        assert!(took < bound, "{header}: answered after {took:?}");
        // Another tenant's plugin, and a tenant without one, are served meanwhile.
        let (r, took) = timed(&server, KEY_BETA, &[("x-probe", "clock")]);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(took < bound, "beta waited {took:?}");
        assert_eq!(ask(&server, KEY_GAMMA, &[], 1).status, 200);
    }
    assert_eq!(
        server.metric(r#"bulkhead_plugin_calls_total{outcome="abandoned"}"#),
        2.0
    );
    assert_eq!(server.metric("bulkhead_plugin_workers_stuck"), 2.0);
    // Two of alpha's calls are stuck: its next plugin call fails closed at
    // once, without a worker, and counts as no fault of the plugin.
    let (r, took) = timed(&server, KEY_ALPHA, &[("x-probe", "clock")]);
    assert_eq!(code(&r), "policy_unavailable");
    assert!(took < bound, "{took:?}");
    assert!(server.metric(r#"bulkhead_plugin_calls_total{outcome="unavailable"}"#) >= 1.0);
    assert_eq!(
        server.metric(r#"bulkhead_plugin_calls_total{outcome="abandoned"}"#),
        2.0
    );

    // The stall ends: the stuck calls return, their workers leave, alpha is served.
    stall(&server, "alpha", 0);
    assert!(eventually(Duration::from_secs(10), || {
        server.metric("bulkhead_plugin_workers_stuck") == 0.0
    }));
    assert_eq!(
        ask(&server, KEY_ALPHA, &[("x-probe", "clock")], 1).status,
        200
    );

    // on-complete: alpha's (reading its behaviour from state: a host call)
    // sticks; beta's on-complete still runs and records its request at once.
    let r = ask(&server, KEY_ALPHA, &[("x-probe-complete", "clock")], 1);
    assert_eq!(r.status, 200, "{}", r.body);
    stall(&server, "alpha", 120_000);
    assert_eq!(
        ask(&server, KEY_ALPHA, &[], 1).status,
        200,
        "admit makes no host call"
    );
    assert!(eventually(Duration::from_secs(5), || {
        server.metric(r#"bulkhead_plugin_calls_total{outcome="abandoned"}"#) == 3.0
    }));
    let r = ask(&server, KEY_BETA, &[], 1);
    assert_eq!(r.status, 200);
    let id = r.request_id.unwrap();
    assert!(
        eventually(Duration::from_secs(2), || {
            message(&ask(&server, KEY_BETA, &[("x-probe", "report")], 1))
                .contains(&format!("request={id} "))
        }),
        "beta's on-complete ran"
    );

    // A stuck worker does not keep the server from stopping.
    let stopping = Instant::now();
    server.terminate();
    assert!(server.wait(Duration::from_secs(20)).success());
    assert!(stopping.elapsed() < Duration::from_secs(20));
    let lines = server.stderr_lines();
    assert!(
        lines.iter().any(|l| l.contains("\"fault\":\"abandoned\"")),
        "abandoned calls are logged as faults"
    );
}

#[test]
fn a_tenants_plugins_share_one_time_budget_per_request() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let Some(policy) = tolerant_two_models("request_budget_ms = 60\n") else {
        return;
    };
    let server = Arc::new(start(&model, &policy));
    // Three plugins spinning in route until just under their deadlines (20 ms
    // each) spend 54 ms of the 60 ms budget: what route leaves of the budget
    // is all admit gets. The first plugin's own deadline is 20 ms, yet it is
    // told of the budget's last few.
    for i in 0..3 {
        uploaded(&server, "alpha", &format!("p{i}"), &probe);
    }
    let r = ask(
        &server,
        KEY_ALPHA,
        &[("x-probe-route", "spin-under"), ("x-probe", "remaining")],
        1,
    );
    assert_eq!(
        code(&r),
        "remaining",
        "{}: {:?}",
        r.body,
        server
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("plugin call failed"))
            .collect::<Vec<_>>()
    );
    let left: u32 = message(&r)
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("time_ms="))
        .and_then(|v| v.parse().ok())
        .expect("time_ms");
    assert!(
        left <= 8,
        "admit was left {left} ms of a 60 ms budget route spent"
    );
    // Sixteen plugins (the most a tenant may have), each spinning until just
    // under its deadline in route and in admit: unbounded, 16 x 2 x 20 ms;
    // within the budget, one request takes about 60 ms.
    for i in 3..16 {
        uploaded(&server, "alpha", &format!("p{i}"), &probe);
    }
    let slow = [("x-probe", "spin-under"), ("x-probe-route", "spin-under")];
    let (r, took) = timed(&server, KEY_ALPHA, &slow);
    assert!(matches!(r.status, 200 | 503), "{}", r.body);
    assert!(
        took < Duration::from_millis(400),
        "the budget held: {took:?}"
    );

    // Another tenant, measured alone and during a flood of such requests.
    let beta = |n: usize| -> Vec<Duration> {
        (0..n)
            .map(|_| {
                let (r, took) = timed(&server, KEY_BETA, &[]);
                assert_eq!(r.status, 200, "{}", r.body);
                took
            })
            .collect()
    };
    let solo = median(beta(12));
    let stop = Arc::new(AtomicBool::new(false));
    let flood: Vec<_> = (0..4)
        .map(|_| {
            let (server, stop) = (Arc::clone(&server), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut sent = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let r = ask(&server, KEY_ALPHA, &slow, 1);
                    assert!(matches!(r.status, 200 | 503), "{}", r.body);
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = median(beta(12));
    stop.store(true, Ordering::Relaxed);
    let sent: u32 = flood.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!("beta p50 alone {solo:?}, during alpha's flood of {sent} requests {during:?}");
    // The stated bound (2 cores shared by the server, the flood and the
    // clients): beta's median at most twice its solo median plus 150 ms.
    assert!(
        during <= solo * 2 + Duration::from_millis(150),
        "beta p50 {during:?} against {solo:?} alone"
    );
}

#[test]
fn one_tenants_slow_on_complete_delays_nobody_elses_and_its_queue_is_bounded() {
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let Some(policy) = tolerant_two_models("complete_queue_max = 16\ncomplete_threads = 1\n")
    else {
        return;
    };
    let server = Arc::new(start(&model, &policy));
    for i in 0..4 {
        uploaded(&server, "alpha", &format!("p{i}"), &probe);
    }
    uploaded(&server, "beta", "probe", &probe);
    // Every on-complete of alpha's four plugins spins until just under its
    // deadline: ~50 ms per ended request (the request budget).
    let r = ask(&server, KEY_ALPHA, &[("x-probe-complete", "spin-under")], 1);
    assert_eq!(r.status, 200, "{}", r.body);
    let flood: Vec<_> = (0..4)
        .map(|_| {
            let server = Arc::clone(&server);
            std::thread::spawn(move || {
                for _ in 0..15 {
                    assert_eq!(ask(&server, KEY_ALPHA, &[], 1).status, 200);
                }
            })
        })
        .collect();
    for handle in flood {
        handle.join().unwrap();
    }
    // Alpha's backlog is seconds long (60 requests x ~50 ms) on the one
    // completion thread; beta's on-complete takes its turn after at most one
    // of alpha's.
    let r = ask(&server, KEY_BETA, &[], 1);
    assert_eq!(r.status, 200);
    let (id, answered) = (r.request_id.unwrap(), Instant::now());
    assert!(
        eventually(Duration::from_secs(10), || {
            message(&ask(&server, KEY_BETA, &[("x-probe", "report")], 1))
                .contains(&format!("request={id} "))
        }),
        "beta's on-complete ran"
    );
    let late = answered.elapsed();
    eprintln!("beta's on-complete ran {late:?} after its answer");
    assert!(
        late < Duration::from_millis(1500),
        "beta's on-complete waited {late:?}"
    );
    // Past its 16 queued completions, alpha's are dropped and counted.
    assert!(server.metric(r#"bulkhead_plugin_completions_dropped_total{tenant="alpha"}"#) >= 1.0);
    assert_eq!(
        server.metric(r#"bulkhead_plugin_completions_dropped_total{tenant="beta"}"#),
        0.0
    );
}
