//! The operator console (`/console/` on the admin listener): its files and
//! their security headers, the admin API routes it reads (live stats, the
//! filtered audit log), and the whole console driven in a real headless
//! Chromium through Playwright (`scripts/console_check.py`).

mod support;

use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;
use support::*;

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn header(server: &Server, base: &str, path: &str) -> (u16, ureq::Response) {
    let agent = ureq::AgentBuilder::new().redirects(0).build();
    match agent.get(&format!("{base}{path}")).call() {
        Ok(r) => (r.status(), r),
        Err(ureq::Error::Status(code, r)) => (code, r),
        Err(e) => panic!("{e} ({})", server.admin),
    }
}

#[test]
fn the_console_is_served_from_the_binary_with_a_strict_policy_and_only_on_the_admin_listener() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    for (path, kind) in [
        ("/console/", "text/html; charset=utf-8"),
        ("/console/console.js", "text/javascript; charset=utf-8"),
        ("/console/console.css", "text/css; charset=utf-8"),
    ] {
        let (status, r) = header(&server, &server.admin, path);
        assert_eq!(status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(kind), "{path}");
        assert_eq!(r.header("content-security-policy"), Some(CSP), "{path}");
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(r.header("x-frame-options"), Some("DENY"));
        assert_eq!(r.header("referrer-policy"), Some("no-referrer"));
        assert!(r.header("set-cookie").is_none());
    }
    let (status, r) = header(&server, &server.admin, "/console");
    assert_eq!((status, r.header("location")), (308, Some("/console/")));
    // The page carries no data and no secret: no token needed to load it,
    // and what it loads is only from this origin (no CDN).
    let page = server.get(&server.admin, "/console/", None).body;
    assert!(page.contains(r#"<script src="console.js" defer></script>"#));
    assert!(!page.contains("http://") && !page.contains("https://"));
    assert!(!page.contains("<script>") && !page.contains("style="));
    // Nothing of it on the inference listener.
    for path in ["/console/", "/console/console.js", "/console"] {
        assert_eq!(
            server.get(&server.inference, path, None).status,
            404,
            "{path}"
        );
    }
    // A file that is not there is the admin listener's 404.
    assert_eq!(server.get(&server.admin, "/console/x.js", None).status, 404);
    // Every value is rendered as text: the script never builds HTML.
    let script = server.get(&server.admin, "/console/console.js", None).body;
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        "localStorage",
        "document.cookie",
    ] {
        assert!(!script.contains(sink), "console.js uses {sink}");
    }
    assert!(script.contains("sessionStorage"));
}

#[test]
fn live_stats_count_a_completion_and_need_the_admin_token() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let r = server.call(
        &server.admin,
        "GET",
        "/admin/v1/stats",
        Some(KEY_ALPHA),
        None,
    );
    assert_eq!(r.status, 401);
    let before = server.admin_call("GET", "/admin/v1/stats", None).json();
    assert_eq!(before["bucket_ms"], 5000);
    let m = &before["models"][0];
    assert_eq!(m["model"], MODEL_ID);
    assert_eq!(m["ready"], true);
    assert_eq!(m["recent"], json!([]), "{before}");
    assert_eq!(
        (m["queued"].as_u64(), m["running"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(m["pages_count"], 224);

    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &chat_body("Hi", 6));
    assert_eq!(r.status, 200, "{}", r.body);
    let generated = r.json()["usage"]["completion_tokens"].as_u64().unwrap();
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let after = server.admin_call("GET", "/admin/v1/stats", None).json();
    let m = &after["models"][0];
    let sum = |field: &str| -> f64 {
        m["recent"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[field].as_f64().unwrap())
            .sum()
    };
    assert_eq!(sum("requests"), 1.0, "{after}");
    assert_eq!(sum("generated_tokens"), generated as f64);
    assert_eq!(sum("prompt_tokens"), prompt as f64);
    assert_eq!(sum("first_tokens"), 1.0);
    assert!(sum("ttft_ms_sum") > 0.0 && sum("ttft_ms_max") > 0.0);
    // The engine publishes its counters after its loop turn, which may come
    // after the response.
    assert!(eventually(Duration::from_secs(5), || {
        let now = server.admin_call("GET", "/admin/v1/stats", None).json();
        now["models"][0]["tokens_generated_total"].as_u64().unwrap() >= generated
    }));
    for p in m["recent"].as_array().unwrap() {
        let at = p["at_ms"].as_u64().unwrap();
        assert_eq!(at % 5000, 0);
        assert!(at <= after["now_ms"].as_u64().unwrap());
    }
    // Counts only: no request text anywhere in it.
    assert!(!after.to_string().contains("Hi\""));
}

#[test]
fn the_audit_log_filters_by_tenant_action_and_time_and_pages_on() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    free_gamma_reservation(&server);
    for name in ["t1", "t2"] {
        let r = server.admin_call(
            "POST",
            "/admin/v1/tenants",
            Some(&json!({"name": name, "pages_reserved": 0, "pages_max": 64})),
        );
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let mut keys = Vec::new();
    for _ in 0..3 {
        let r = server.admin_call("POST", "/admin/v1/tenants/t1/keys", None);
        keys.push(r.json()["key"]["id"].as_str().unwrap().to_string());
    }
    server.admin_call("POST", "/admin/v1/tenants/t2/keys", None);
    let revoked = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/t1/keys/{}", keys[0]),
        None,
    );
    assert_eq!(revoked.status, 200);
    let get = |query: &str| -> Value {
        let r = server.admin_call("GET", &format!("/admin/v1/audit?{query}"), None);
        assert_eq!(r.status, 200, "{query}: {}", r.body);
        r.json()
    };
    let actions = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{} {}",
                    r["action"].as_str().unwrap(),
                    r["target"].as_str().unwrap()
                )
            })
            .collect()
    };
    let newest = "before=18446744073709551615";
    // One tenant, newest first, every kind.
    let t1 = get(&format!("{newest}&tenant=t1"));
    assert_eq!(
        actions(&t1),
        [
            "key.revoke t1",
            "key.issue t1",
            "key.issue t1",
            "key.issue t1",
            "tenant.create t1"
        ]
    );
    // One kind by prefix, across tenants.
    let issued = get(&format!("{newest}&action=key.issue"));
    assert_eq!(
        actions(&issued),
        [
            "key.issue t2",
            "key.issue t1",
            "key.issue t1",
            "key.issue t1"
        ]
    );
    // Paging a filter: two at a time, each page continuing where the last one
    // stopped, until an empty page.
    let mut seen = Vec::new();
    let mut before = u64::MAX;
    loop {
        let page = get(&format!("before={before}&limit=2&tenant=t1&action=key."));
        if page["data"].as_array().unwrap().is_empty() {
            break;
        }
        seen.extend(actions(&page));
        before = page["next_before"].as_u64().unwrap();
    }
    assert_eq!(
        seen,
        [
            "key.revoke t1",
            "key.issue t1",
            "key.issue t1",
            "key.issue t1"
        ]
    );
    // Oldest first with a filter too.
    let oldest = get("tenant=t2");
    assert_eq!(actions(&oldest), ["tenant.create t2", "key.issue t2"]);
    // A time window: everything is now, so a window in the past has nothing
    // and one around now has everything of t1.
    let at = t1["data"][0]["at_ms"].as_u64().unwrap();
    assert!(get(&format!("{newest}&tenant=t1&to_ms=1000"))["data"]
        .as_array()
        .unwrap()
        .is_empty());
    let window = get(&format!(
        "{newest}&tenant=t1&from_ms={}&to_ms={}",
        at - 60_000,
        at + 1
    ));
    assert_eq!(actions(&window).len(), 5);
    // A tenant's own self-service actions count as that tenant's records.
    assert!(get(&format!("{newest}&tenant=nobody"))["data"]
        .as_array()
        .unwrap()
        .is_empty());
    // Unknown filters are refused, not ignored.
    let r = server.admin_call("GET", "/admin/v1/audit?tenants=t1", None);
    assert_eq!(r.status, 400, "{}", r.body);
}

/// Playwright and a system Chromium, or a "skipped:" line (a failure when
/// `BULKHEAD_REQUIRE_BROWSER` is set, as CI sets it).
fn browser_available() -> bool {
    let chromium =
        std::env::var("BULKHEAD_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let playwright = Command::new("python3")
        .args(["-c", "import playwright.sync_api"])
        .status()
        .is_ok_and(|s| s.success());
    let ok = playwright && std::path::Path::new(&chromium).exists();
    if !ok {
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_BROWSER").is_none(),
            "BULKHEAD_REQUIRE_BROWSER is set but Playwright ({playwright}) or Chromium at {chromium} is missing: run scripts/setup.sh --browser"
        );
        eprintln!("skipped: Playwright or Chromium ({chromium}) is missing; run scripts/setup.sh --browser");
    }
    ok
}

#[test]
fn the_console_works_in_a_real_browser() {
    let Some(model) = smollm2() else { return };
    let Some(plugin) = plugin_wasm("size_cap") else {
        return;
    };
    // The second model the browser adds and removes.
    let Some(q8) = smollm2_q8() else { return };
    if !browser_available() {
        return;
    }
    let server = start(&model, &Policy::default());
    // Room for the tenant the browser creates (16 pages reserved).
    free_gamma_reservation(&server);
    let out = repo_root().join("target/console-screenshots");
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new("python3")
        .arg(repo_root().join("scripts/console_check.py"))
        .args([
            &server.admin,
            &server.inference,
            ADMIN_TOKEN,
            KEY_BETA,
            MODEL_ID,
        ])
        .arg(&plugin)
        .arg(&out)
        .arg(&q8)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout.lines().last(), Some("ok"), "{stdout}");
    // Each step left its screenshot.
    let shots = std::fs::read_dir(&out).unwrap().count();
    assert!(shots >= 13, "{shots} screenshots in {}", out.display());
    // Every console action went through the admin API and is in the audit
    // log as the admin's.
    let audited = |filter: &str| -> Vec<Value> {
        let path = format!("/admin/v1/audit?before=18446744073709551615&{filter}");
        let r = server.admin_call("GET", &path, None);
        r.json()["data"].as_array().unwrap().clone()
    };
    let actions: Vec<String> = audited("tenant=delta")
        .iter()
        .filter(|r| r["actor"] == "admin")
        .map(|r| r["action"].as_str().unwrap().to_string())
        .collect();
    let models: Vec<String> = audited("action=model.")
        .iter()
        .map(|r| format!("{} {}", r["action"].as_str().unwrap(), r["target"]))
        .collect();
    assert_eq!(
        models,
        [r#"model.remove "extra-q8""#, r#"model.add "extra-q8""#]
    );
    for action in [
        "tenant.create",
        "key.issue",
        "plugin.upload",
        "plugin.disable",
        "key.revoke",
        "tenant.delete",
    ] {
        assert!(
            actions.iter().any(|a| a == action),
            "{action} missing from {actions:?}"
        );
    }
}
