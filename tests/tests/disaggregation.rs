//! Prefill/decode disaggregation across processes: `serve --role prefill`
//! and `serve --role decode` from one seeded policy, joined over a Unix
//! socket and over TCP, with the real binary and SmolLM2. The decode side
//! answers exactly what a `--role both` server answers; the prefill side
//! serves no client; a peer without the secret pairs with nothing; a
//! prefill process that dies fails the request with a 5xx and leaves the
//! decode side's pool at its baseline.

mod support;

use serde_json::Value;
use std::time::Duration;
use support::*;

const SECRET: &str = "transfer-secret-for-the-tests-0123456789";

fn pool_at_baseline(server: &Server) -> Value {
    let mut audit = Value::Null;
    let settled = eventually(Duration::from_secs(10), || {
        let r = server.admin_call("GET", &format!("/admin/v1/models/{MODEL_ID}/pool"), None);
        assert_eq!(r.status, 200, "{}", r.body);
        audit = r.json();
        audit["at_baseline"] == true
    });
    assert!(settled, "pool not back at baseline: {audit}");
    audit
}

/// The stderr of a start that was refused (panics if it started).
fn refused(launch: Launch) -> String {
    match try_launch(launch) {
        Ok(_) => panic!("the server started"),
        Err((_, stderr)) => stderr,
    }
}

fn ready(server: &Server) -> bool {
    server.get(&server.inference, "/readyz", None).status == 200
}

struct Pair {
    prefill: Server,
    decode: Server,
}

/// A prefill and a decode process of `policy`, joined at `peer` (the
/// prefill side listens there).
fn pair(model: &std::path::Path, policy: &Policy, peer: &str, secret: &str) -> Pair {
    let prefill = launch(
        Launch::new(model, policy)
            .arg("--role")
            .arg("prefill")
            .arg("--transfer-listen")
            .arg(peer)
            .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
    );
    let decode = launch(
        Launch::new(model, policy)
            .arg("--role")
            .arg("decode")
            .arg("--prefill-peer")
            .arg(peer)
            .env("BULKHEAD_TRANSFER_SECRET", Some(secret)),
    );
    Pair { prefill, decode }
}

fn answer(server: &Server, prompt: &str) -> (u16, Value) {
    let mut body = chat_body(prompt, 24);
    body["temperature"] = 0.into();
    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    let status = r.status;
    (status, serde_json::from_str(&r.body).unwrap_or(Value::Null))
}

#[test]
fn a_decode_process_answers_what_one_process_answers_with_kv_from_its_peer() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let dir = temp_dir("disagg");
    let socket = format!("unix:{}", dir.join("transfer.sock").display());
    let p = pair(&model, &policy, &socket, SECRET);
    assert!(
        eventually(Duration::from_secs(10), || ready(&p.decode)),
        "the decode side pairs and becomes ready"
    );
    let both = start(&model, &policy);
    for prompt in [
        "Name three primary colors.",
        "Write one sentence about the sea, and then another one about mountains and rivers.",
    ] {
        let (status, split) = answer(&p.decode, prompt);
        assert_eq!(status, 200, "{split}");
        let (status, alone) = answer(&both, prompt);
        assert_eq!(status, 200, "{alone}");
        assert_eq!(
            split["choices"][0]["message"]["content"], alone["choices"][0]["message"]["content"],
            "the same greedy text"
        );
        // The same counts; cached tokens are the decode side's own cache
        // (a prompt from a peer attaches none), so they may differ.
        for field in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(split["usage"][field], alone["usage"][field], "{field}");
        }
    }
    // The transfer was verified, counted, logged without content.
    let verified: f64 = p
        .decode
        .metrics()
        .lines()
        .filter(|l| l.starts_with("bulkhead_transfers_total{") && l.contains("result=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(verified >= 2.0, "{}", p.decode.metrics());
    assert!(p.decode.logged("transfer received"));
    assert!(p.prefill.logged("transfer sent"));
    for line in p
        .decode
        .stderr_lines()
        .iter()
        .chain(&p.prefill.stderr_lines())
    {
        assert!(!line.contains("primary colors"), "{line}");
    }
    pool_at_baseline(&p.decode);
    pool_at_baseline(&p.prefill);
    // The prefill side serves no client.
    let r = p.prefill.post_json(
        "/v1/chat/completions",
        Some(KEY_ALPHA),
        &chat_body("hello", 4),
    );
    assert_eq!(r.status, 421, "{}", r.body);
    assert_eq!(code(&r), "prefill_only");
}

#[test]
fn a_dead_prefill_peer_fails_requests_with_a_5xx_and_unreadies_the_decode_side() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let peer = format!("127.0.0.1:{port}");
    let p = pair(&model, &policy, &peer, SECRET);
    assert!(eventually(Duration::from_secs(10), || ready(&p.decode)));
    let (status, _) = answer(&p.decode, "Name three primary colors.");
    assert_eq!(status, 200);
    let Pair { prefill, decode } = p;
    drop(prefill);
    let r = decode.post_json(
        "/v1/chat/completions",
        Some(KEY_ALPHA),
        &chat_body("Name three primary colors.", 8),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(code(&r), "kv_transfer_failed");
    pool_at_baseline(&decode);
    assert!(
        eventually(Duration::from_secs(5), || !ready(&decode)),
        "no peer pairs: not ready"
    );
}

#[test]
fn a_decode_process_without_the_secret_pairs_with_nothing() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let dir = temp_dir("disagg-secret");
    let socket = format!("unix:{}", dir.join("transfer.sock").display());
    let p = pair(
        &model,
        &policy,
        &socket,
        "another-secret-of-enough-length-0123456789",
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(!ready(&p.decode), "never paired");
    let r = p.decode.post_json(
        "/v1/chat/completions",
        Some(KEY_ALPHA),
        &chat_body("Name three primary colors.", 8),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(p.decode.logged("no prefill peer pairs"));
    assert!(p.prefill.logged("did not prove the shared secret"));
    pool_at_baseline(&p.decode);
    pool_at_baseline(&p.prefill);
}

#[test]
fn a_role_without_its_peer_or_secret_refuses_to_start() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let err = refused(Launch::new(&model, &policy).arg("--role").arg("decode"));
    assert!(err.contains("--prefill-peer"), "{err}");
    let err = refused(
        Launch::new(&model, &policy)
            .arg("--role")
            .arg("prefill")
            .arg("--transfer-listen")
            .arg("127.0.0.1:0")
            .env("BULKHEAD_TRANSFER_SECRET", None),
    );
    assert!(err.contains("BULKHEAD_TRANSFER_SECRET"), "{err}");
    let err = refused(
        Launch::new(&model, &policy)
            .arg("--role")
            .arg("prefill")
            .arg("--transfer-listen")
            .arg("127.0.0.1:0")
            .env("BULKHEAD_TRANSFER_SECRET", Some("short")),
    );
    assert!(err.contains("at least 32"), "{err}");
}
