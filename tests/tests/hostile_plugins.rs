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
    let _beside = beside();
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
    let _alone = alone();
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    // Deadlines with room (250 ms a call, 1 s a request): what is shown is a
    // call stuck in a host call abandoned at its deadline, not the default
    // 20 ms, which a call of this test missed in CI while another test of
    // this binary ran on the same 2 cores (a 503 where 200 was due).
    let Some(policy) = tolerant_two_models("deadline_ms = 250\nrequest_budget_ms = 1000\n") else {
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

    // The stall ends: the stuck calls return, their workers leave, alpha is
    // served (its admit making host calls again), and the request sets what
    // alpha's on-complete will do.
    stall(&server, "alpha", 0);
    assert!(eventually(Duration::from_secs(10), || {
        server.metric("bulkhead_plugin_workers_stuck") == 0.0
    }));
    let ok = || server.metric(r#"bulkhead_plugin_calls_total{outcome="ok"}"#);
    let before = ok();
    let r = ask(
        &server,
        KEY_ALPHA,
        &[("x-probe", "clock"), ("x-probe-complete", "clock")],
        1,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // Its on-complete runs after the answer is sent: wait for it (route,
    // admit and on-complete, three calls), or the stall below may catch it
    // and hold alpha's worker past the next admit's deadline (a 503 where
    // this test expects 200; seen in CI on 2 busy cores).
    assert!(
        eventually(Duration::from_secs(10), || ok() >= before + 3.0),
        "alpha's on-complete ran: {} calls ok since",
        ok() - before
    );

    // on-complete: alpha's (reading its behaviour from state: a host call)
    // sticks; beta's on-complete still runs and records its request at once.
    stall(&server, "alpha", 120_000);
    let r = ask(&server, KEY_ALPHA, &[], 1);
    assert_eq!(
        r.status,
        200,
        "admit makes no host call: {} {:?}",
        r.body,
        server
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("fault"))
            .collect::<Vec<_>>()
    );
    // This request's on-complete is abandoned, and only it.
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
    let _alone = alone();
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
    // A request with plugins and a choice of two models: three jobs on the
    // request lane (parsing and tokenizing, route, admit).
    let jobs = request_lane_jobs(&server, KEY_ALPHA);
    assert_eq!(ask(&server, KEY_ALPHA, &[], 1).status, 200);
    assert_eq!(request_lane_jobs(&server, KEY_ALPHA) - jobs, 3.0);
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
    // clients): a request of beta's (no plugins) takes one job on the
    // request lane (reading and tokenizing it), which waits for at most one
    // of alpha's, which takes at most alpha's 60 ms budget; beyond that
    // wait, beta may take twice its solo time, plus 100 ms of scheduling on
    // the shared cores. Alpha's 640 ms unbounded, a lane that served alpha's
    // four queued jobs before beta's, or beta's request in two jobs (each
    // waiting for one of alpha's) would be over it.
    assert!(
        during <= solo * 2 + Duration::from_millis(60 + 100),
        "beta p50 {during:?} against {solo:?} alone"
    );
}

#[test]
fn one_tenants_slow_on_complete_delays_nobody_elses_and_its_queue_is_bounded() {
    let _alone = alone();
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let Some(policy) = tolerant_two_models(
        "complete_queue_max = 16\ncomplete_threads = 1\nrequest_budget_ms = 300\n",
    ) else {
        return;
    };
    let server = Arc::new(start(&model, &policy));
    for i in 0..4 {
        uploaded(&server, "alpha", &format!("p{i}"), &probe);
    }
    uploaded(&server, "beta", "probe", &probe);
    // Every on-complete of alpha's four plugins spins until just under its
    // deadline: ~300 ms per ended request (the request budget), so alpha's
    // requests end faster than the one completion thread runs them however
    // loaded the machine.
    let r = ask(&server, KEY_ALPHA, &[("x-probe-complete", "spin-under")], 1);
    assert_eq!(r.status, 200, "{}", r.body);
    let flood: Vec<_> = (0..30)
        .map(|_| {
            let server = Arc::clone(&server);
            std::thread::spawn(move || {
                let mut answered = 0u32;
                for _ in 0..2 {
                    // On 2 loaded cores an admission can run past the
                    // request's plugin budget and fail closed: that is the
                    // budget working, not what this test is about.
                    let r = ask(&server, KEY_ALPHA, &[], 1);
                    match r.status {
                        200 => answered += 1,
                        503 => assert_eq!(code(&r), "policy_unavailable", "{}", r.body),
                        status => panic!("{status}: {}", r.body),
                    }
                }
                answered
            })
        })
        .collect();
    let answered: u32 = flood.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!("alpha's flood: {answered} of 60 answered");
    // Enough ended requests to overflow alpha's 16 queued completions.
    assert!(
        answered >= 24,
        "only {answered} of alpha's 60 were answered"
    );
    // Alpha's backlog is seconds long (17 requests x ~300 ms) on the one
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

/// The files of the store's plugin code (`<store>/plugin-code`).
fn code_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("bulkhead-state/plugin-code"))
        .map(|entries| entries.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Bytes of every file under `dir`.
fn tree_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| {
                    let e = e.unwrap();
                    let meta = e.metadata().unwrap();
                    if meta.is_dir() {
                        tree_bytes(&e.path())
                    } else {
                        meta.len()
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

fn audited(server: &Server, action: &str) -> Vec<serde_json::Value> {
    server
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["action"] == action)
        .cloned()
        .collect()
}

#[test]
fn plugin_code_belongs_to_its_tenant_and_code_that_cannot_load_fails_closed() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let Some(cap) = wasm("size_cap") else { return };
    let policy = Policy::default();
    let long = "word ".repeat(300);
    let capped = |server: &Server| code(&ask_prompt(server, KEY_ALPHA, &[], &long, 4));
    let server = start(&model, &policy);
    // The same bytes, two tenants: two owners.
    uploaded(&server, "alpha", "gate", &cap);
    uploaded(&server, "beta", "gate", &cap);
    assert_eq!(
        code_files(&server.dir).len(),
        4,
        "two components, two compiled forms"
    );
    let r = server.admin_call("DELETE", "/admin/v1/tenants/beta/plugins/gate", None);
    assert_eq!(r.status, 204, "{}", r.body);
    // Beta's delete took nothing of alpha's: alpha disables and enables its own.
    for action in ["disable", "enable"] {
        let r = server.admin_call(
            "POST",
            &format!("/admin/v1/tenants/alpha/plugins/gate/{action}"),
            None,
        );
        assert_eq!(r.status, 200, "{action}: {}", r.body);
    }
    assert_eq!(capped(&server), "prompt_too_large");
    // And after a restart, alpha's plugin still applies.
    let dir = server.kill();
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    assert_eq!(capped(&server), "prompt_too_large");
    assert_eq!(code_files(&dir).len(), 2);
    // Its code gone (a broken disk, a bad restore): alpha fails closed, and
    // says why; beta is served.
    let dir = server.kill();
    for file in code_files(&dir) {
        std::fs::remove_file(file).unwrap();
    }
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    let r = ask_prompt(&server, KEY_ALPHA, &[], "Hello", 4);
    assert_eq!(
        (r.status, code(&r).as_str()),
        (503, "policy_unavailable"),
        "{}",
        r.body
    );
    assert_eq!(ask(&server, KEY_BETA, &[], 4).status, 200);
    let view = server
        .admin_call("GET", "/admin/v1/tenants/alpha/plugins/gate", None)
        .json();
    assert_eq!(view["enabled"], true);
    assert!(
        view["unloadable"]
            .as_str()
            .unwrap_or("")
            .contains("missing"),
        "{view}"
    );
    let unavailable = audited(&server, "plugin.unavailable");
    assert_eq!(unavailable.len(), 1, "{unavailable:?}");
    assert_eq!(unavailable[0]["actor"], "system");
    assert_eq!(unavailable[0]["target"], "alpha");
    // Enabling it again cannot bring it back; uploading it can.
    let r = server.admin_call("POST", "/admin/v1/tenants/alpha/plugins/gate/enable", None);
    assert_eq!(r.status, 400, "{}", r.body);
    uploaded(&server, "alpha", "gate", &cap);
    assert_eq!(capped(&server), "prompt_too_large");
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A component holding one core module of `functions` empty functions.
fn component_of_empty_functions(functions: u64) -> Vec<u8> {
    fn leb(mut n: u64, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    fn section(id: u8, body: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        leb(body.len() as u64, out);
        out.extend_from_slice(body);
    }
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    section(1, &[1, 0x60, 0, 0], &mut module);
    let mut funcs = Vec::new();
    leb(functions, &mut funcs);
    funcs.extend(std::iter::repeat_n(0u8, functions as usize));
    section(3, &funcs, &mut module);
    let mut code = Vec::new();
    leb(functions, &mut code);
    for _ in 0..functions {
        code.extend_from_slice(&[2, 0, 0x0b]);
    }
    section(10, &code, &mut module);
    let mut component = b"\0asm\x0d\0\x01\0".to_vec();
    section(1, &module, &mut component);
    component
}

#[test]
fn uploads_are_bounded_before_compiling_and_hold_no_one_elses_writes() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let (Some(probe), Some(cap)) = (wasm("probe"), wasm("size_cap")) else {
        return;
    };
    let server = Arc::new(start(
        &model,
        &Policy {
            plugins_toml: "[plugins]\nuploads_per_minute = 1000\ntenant_code_bytes_max = 1000000\n"
                .into(),
            ..Policy::default()
        },
    ));
    // 200,000 empty functions (1.2 MB): refused by its shape, at once.
    let started = Instant::now();
    let r = upload(
        &server,
        "alpha",
        "huge",
        &component_of_empty_functions(200_000),
        "",
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        message(&r).contains("more functions than a plugin may"),
        "{}",
        r.body
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A big component within the limits compiles outside the write lock:
    // beta's own writes meanwhile are not held.
    let big = component_of_empty_functions(9_000);
    let uploading = {
        let (server, big) = (Arc::clone(&server), big.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let r = upload(&server, "alpha", "big", &big, "");
            (r.status, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(30));
    let issued = Instant::now();
    let r = server.post("/v1/tenant/keys", Some(KEY_BETA), b"");
    let beta_took = issued.elapsed();
    let (status, compile_took) = uploading.join().unwrap();
    eprintln!("the big upload took {compile_took:?}; beta's key meanwhile {beta_took:?}");
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(
        beta_took < Duration::from_millis(500) || beta_took * 2 < compile_took,
        "beta's write waited {beta_took:?} (the upload took {compile_took:?})"
    );
    // (Not a policy: it exports nothing. Refused after compiling.)
    assert_eq!(status, 400);
    // Sixty uploads to one name: the store keeps one version's code.
    let before = tree_bytes(&server.dir);
    for i in 0..60 {
        uploaded(
            &server,
            "alpha",
            "swap",
            if i % 2 == 0 { &probe } else { &cap },
        );
    }
    let after = tree_bytes(&server.dir);
    eprintln!("the store before {before} bytes, after 60 uploads {after}");
    assert_eq!(
        code_files(&server.dir).len(),
        2,
        "{:?}",
        code_files(&server.dir)
    );
    assert!(after < before + (16 << 20), "{before} -> {after}");
    // The tenant's code quota (1 MB here): more plugins are refused, naming it.
    let mut refused = None;
    for i in 0..16 {
        let r = upload(&server, "alpha", &format!("p{i}"), &probe, "");
        if r.status != 200 {
            refused = Some(r);
            break;
        }
    }
    let r = refused.expect("the quota binds");
    assert_eq!(
        (r.status, code(&r).as_str()),
        (409, "quota_exceeded"),
        "{}",
        r.body
    );
    assert!(message(&r).contains("1000000"), "{}", r.body);
}

#[test]
fn uploads_per_tenant_are_rate_limited() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let Some(cap) = wasm("size_cap") else { return };
    let server = start(
        &model,
        &Policy {
            plugins_toml: "[plugins]\nuploads_per_minute = 3\n".into(),
            ..Policy::default()
        },
    );
    for _ in 0..3 {
        uploaded(&server, "alpha", "gate", &cap);
    }
    let r = upload(&server, "alpha", "gate", &cap, "");
    assert_eq!(
        (r.status, code(&r).as_str()),
        (429, "rate_limited"),
        "{}",
        r.body
    );
    assert!(r.retry_after.is_some());
    // Another tenant's uploads are its own.
    uploaded(&server, "beta", "gate", &cap);
}

#[test]
fn a_tenant_cannot_take_or_reset_an_operator_plugins_name() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let (Some(rate_path), Some(probe)) = (plugin_wasm("rate_limit"), wasm("probe")) else {
        return;
    };
    let server = start(
        &model,
        &Policy {
            alpha_pending_max: 64,
            plugins_toml: format!(
                "[[plugins.operator]]\nname = \"limits\"\npath = \"{}\"\n",
                rate_path.display()
            ),
            ..Policy::default()
        },
    );
    // The operator's limit: 20 requests a minute per user.
    for _ in 0..20 {
        assert_eq!(ask(&server, KEY_ALPHA, &[("x-user", "bob")], 1).status, 200);
    }
    let limited = || code(&ask(&server, KEY_ALPHA, &[("x-user", "bob")], 1));
    assert_eq!(limited(), "rate_limited");
    // Its name is the operator's.
    let r = upload(&server, "alpha", "limits", &probe, "");
    assert_eq!(
        (r.status, code(&r).as_str()),
        (409, "name_reserved"),
        "{}",
        r.body
    );
    // A plugin of alpha's own, uploaded and deleted, resets nothing of it.
    uploaded(&server, "alpha", "mine", &probe);
    let r = server.admin_call("DELETE", "/admin/v1/tenants/alpha/plugins/mine", None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(limited(), "rate_limited");
}

#[test]
fn an_operator_plugin_trips_only_for_the_tenant_whose_requests_make_it_fault() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let Some(probe_path) = plugin_wasm("probe") else {
        return;
    };
    for (on_trip, alpha_after) in [("fail_closed", 503), ("skip", 200)] {
        let server = start(
            &model,
            &Policy {
                plugins_toml: format!(
                    "[plugins]\nfaults_max = 3\n[[plugins.operator]]\nname = \"probe\"\n\
                     path = \"{}\"\non_trip = \"{on_trip}\"\n",
                    probe_path.display()
                ),
                ..Policy::default()
            },
        );
        for _ in 0..3 {
            let r = ask(&server, KEY_ALPHA, &[("x-probe", "trap")], 1);
            assert_eq!(code(&r), "policy_unavailable");
        }
        // Tripped for alpha: it fails closed (or is skipped) for alpha alone.
        let r = ask(&server, KEY_ALPHA, &[("x-probe", "stats")], 1);
        assert_eq!(r.status, alpha_after, "{on_trip}: {}", r.body);
        // Beta still runs it: its answer is the probe's own.
        let r = ask(&server, KEY_BETA, &[("x-probe", "stats")], 1);
        assert_eq!(code(&r), "stats", "{on_trip}: {}", r.body);
        // Audited by the control plane's trip thread, soon after.
        assert!(eventually(Duration::from_secs(5), || !audited(
            &server,
            "plugin.trip"
        )
        .is_empty()));
        let trips = audited(&server, "plugin.trip");
        assert_eq!(trips.len(), 1, "{trips:?}");
        assert_eq!(trips[0]["target"], "alpha");
        assert_eq!(trips[0]["detail"]["on_trip"], on_trip);
        assert_eq!(trips[0]["detail"]["plugin"], "probe");
    }
}

#[test]
fn a_plugins_memory_cap_holds_and_credentials_never_reach_it() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let Some(probe) = wasm("probe") else { return };
    let server = start(
        &model,
        &Policy {
            plugins_toml: "[plugins]\nfaults_max = 1000\nmemory_bytes = 8388608\n".into(),
            ..Policy::default()
        },
    );
    // The deployment's cap (8 MiB): 4 MiB fits, 12 MiB does not.
    uploaded(&server, "alpha", "probe", &probe);
    let alloc = |key: &str, mib: &str| {
        ask(
            server_ref(&server),
            key,
            &[("x-probe", "alloc"), ("x-probe-mib", mib)],
            1,
        )
    };
    assert_eq!(alloc(KEY_ALPHA, "4").status, 200);
    let r = alloc(KEY_ALPHA, "12");
    assert_eq!(
        (r.status, code(&r).as_str()),
        (503, "policy_unavailable"),
        "{}",
        r.body
    );
    // A plugin's own lower cap (2 MiB, asked at upload) holds below it.
    let r = upload(&server, "beta", "probe", &probe, "?memory_bytes=2097152");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(code(&alloc(KEY_BETA, "4")), "policy_unavailable");
    assert!(server.metric(r#"bulkhead_plugin_calls_total{outcome="memory"}"#) >= 2.0);
    // Less than its own instance needs is refused at upload, naming the limit.
    let r = upload(&server, "beta", "tiny", &probe, "?memory_bytes=65536");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(message(&r).contains("memory_bytes"), "{}", r.body);
    // Credentials are never passed; other headers are.
    let r = ask(
        &server,
        KEY_ALPHA,
        &[
            ("x-probe", "headers"),
            ("cookie", "session=secret"),
            ("proxy-authorization", "Basic c2VjcmV0"),
            ("x-api-key", "secret"),
            ("x-team", "red"),
        ],
        1,
    );
    assert_eq!(code(&r), "headers", "{}", r.body);
    let names: Vec<String> = message(&r).split(',').map(str::to_string).collect();
    assert!(names.contains(&"x-team".to_string()), "{names:?}");
    for credential in [
        "authorization",
        "cookie",
        "proxy-authorization",
        "x-api-key",
    ] {
        assert!(
            !names.contains(&credential.to_string()),
            "{credential} reached the plugin: {names:?}"
        );
    }
}

fn server_ref(server: &Server) -> &Server {
    server
}

#[test]
fn other_versions_of_the_contract_and_invisible_characters_are_refused() {
    let _beside = beside();
    let Some(model) = smollm2() else { return };
    let (Some(skew), Some(probe)) = (wasm("version_skew"), wasm("probe")) else {
        return;
    };
    let server = start(&model, &tolerant_two_models("").unwrap_or_default());
    // 0.1.1 is semver-compatible with 0.1.0, and still not this contract.
    let r = upload(&server, "alpha", "skew", &skew, "");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        message(&r).contains("@0.1.1, which the tenant-policy world"),
        "{}",
        r.body
    );
    // A rejection message loses control and invisible format characters
    // (bidirectional overrides, zero-width ones) on its way to the client.
    uploaded(&server, "alpha", "probe", &probe);
    let r = ask(&server, KEY_ALPHA, &[("x-probe", "bidi")], 1);
    assert_eq!(code(&r), "bidi", "{}", r.body);
    assert_eq!(message(&r), "okgnp.exe!", "{}", r.body);
    // A request that static admission refuses never reaches route (I1):
    // an empty prompt is refused with nothing of the plugin asked.
    let before = server.metric(r#"bulkhead_plugin_calls_total{outcome="ok"}"#);
    let r = ask_prompt(&server, KEY_ALPHA, &[("x-probe-route", "clock")], "", 4);
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        server.metric(r#"bulkhead_plugin_calls_total{outcome="ok"}"#),
        before
    );
}
