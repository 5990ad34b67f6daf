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
    // Each of n choices is a sequence of its own, its prompt's KV from the
    // peer: greedy, both say what one process says.
    let prompt = "Name three primary colors.";
    let mut body = chat_body(prompt, 24);
    body["temperature"] = 0.into();
    body["n"] = 2.into();
    let r = p
        .decode
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let (_, alone) = answer(&both, prompt);
    for i in 0..2 {
        assert_eq!(
            r.json()["choices"][i]["message"]["content"],
            alone["choices"][0]["message"]["content"],
            "choice {i}"
        );
    }
    // A schema constrains the decode side's sampling as one process's:
    // the same instance, its prompt's KV from the peer.
    let mut body = chat_body("Describe a cat in JSON.", 64);
    body["temperature"] = 0.into();
    body["response_format"] = serde_json::json!({"type": "json_schema", "json_schema": {
        "name": "cat", "schema": {"type": "object", "required": ["name", "age"],
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "age": {"type": "integer"}}}}});
    let split = p
        .decode
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    let alone = both.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(split.status, 200, "{}", split.body);
    let text = split.json()["choices"][0]["message"]["content"].clone();
    assert_eq!(text, alone.json()["choices"][0]["message"]["content"]);
    let cat: serde_json::Value = serde_json::from_str(text.as_str().unwrap()).unwrap();
    assert!(cat["name"].is_string() && cat["age"].is_i64(), "{cat}");
    // The transfers were verified, counted, logged without content.
    let verified: f64 = p
        .decode
        .metrics()
        .lines()
        .filter(|l| l.starts_with("bulkhead_transfers_total{") && l.contains("result=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(verified >= 5.0, "{}", p.decode.metrics());
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

/// A client that leaves while its prompt is being prefilled on the peer:
/// the decode side drops the job's connection, and the prefill process
/// cancels the job rather than compute a prompt nobody waits for (before
/// this, it ran to the end, up to 300 s, holding its pages); both pools
/// return to baseline and no transfer is sent.
#[test]
fn a_client_leaving_mid_prefill_cancels_the_job_on_the_prefill_side() {
    let Some(model) = smollm2() else { return };
    // Room for a ~1,300-token prompt: seconds of prefill on one thread
    // (every tenant of the test policy can hold 1,536 tokens).
    let policy = Policy {
        context_tokens: 1536,
        seq_pages_max: 96,
        ..Policy::default()
    };
    let dir = temp_dir("disagg-leave");
    let socket = format!("unix:{}", dir.join("transfer.sock").display());
    let p = pair(&model, &policy, &socket, SECRET);
    assert!(
        eventually(Duration::from_secs(10), || ready(&p.decode)),
        "the decode side pairs and becomes ready"
    );
    let prompt = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(90);
    let body = chat_body(&prompt, 4).to_string();
    let addr = p.decode.inference.trim_start_matches("http://").to_string();
    let mut client = std::net::TcpStream::connect(addr).unwrap();
    use std::io::Write as _;
    write!(
        client,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bulkhead\r\nAuthorization: Bearer {KEY_ALPHA}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The prefill side is computing the prompt: its pool holds pages.
    let prefilling = eventually(Duration::from_secs(30), || {
        let r = p
            .prefill
            .admin_call("GET", &format!("/admin/v1/models/{MODEL_ID}/pool"), None);
        r.json()["at_baseline"] == false
    });
    assert!(prefilling, "the prefill side never started the prompt");
    drop(client);
    assert!(
        eventually(Duration::from_secs(15), || p
            .prefill
            .logged("prefill job cancelled: the decode peer left")),
        "the prefill side kept computing: {:?}",
        p.prefill.stderr_lines()
    );
    pool_at_baseline(&p.prefill);
    pool_at_baseline(&p.decode);
    assert!(!p.prefill.logged("transfer sent"), "nothing was sent");
    assert_eq!(
        metric_value(
            &p.prefill.metrics(),
            "bulkhead_prefill_jobs_abandoned_total"
        ),
        1.0
    );
    // The pair still serves the next request.
    let (status, reply) = answer(&p.decode, "Name three primary colors.");
    assert_eq!(status, 200, "{reply}");
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

/// Runs `openssl` with `args`; panics with its stderr if it fails.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`{ca}.pem`, `{ca}-key.pem`) in `dir`.
fn make_ca(dir: &std::path::Path, ca: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={ca}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{ca}-key.pem"),
            "-out",
            &format!("{ca}.pem"),
        ],
    );
}

/// A leaf certificate `{name}.pem` (key `{name}-key.pem`) signed by `ca`,
/// for 127.0.0.1, usable as a TLS server and client.
fn make_leaf(dir: &std::path::Path, ca: &str, name: &str) {
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}-key.pem"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

/// The `[server]` line that gives a process `name`'s certificate and `ca`.
fn transfer_tls(dir: &std::path::Path, name: &str, ca: &str) -> String {
    format!(
        "transfer_tls = {{ cert_pem = \"{0}/{name}.pem\", key_pem = \"{0}/{name}-key.pem\", ca_pem = \"{0}/{ca}.pem\" }}\n",
        dir.display()
    )
}

#[test]
fn with_mutual_tls_only_a_peer_with_a_certificate_of_the_ca_pairs() {
    let Some(model) = smollm2() else { return };
    let has_openssl = std::process::Command::new("openssl")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_openssl {
        eprintln!("skipped: the openssl command-line tool makes the certificates");
        return;
    }
    let dir = temp_dir("disagg-mtls");
    make_ca(&dir, "ca");
    make_ca(&dir, "rogue-ca");
    make_leaf(&dir, "ca", "prefill");
    make_leaf(&dir, "ca", "decode");
    make_leaf(&dir, "rogue-ca", "intruder");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let peer = format!("127.0.0.1:{port}");
    let with = |name: &str, ca: &str| Policy {
        server_toml: transfer_tls(&dir, name, ca),
        ..Policy::default()
    };
    let prefill_policy = with("prefill", "ca");
    let prefill = launch(
        Launch::new(&model, &prefill_policy)
            .arg("--role")
            .arg("prefill")
            .arg("--transfer-listen")
            .arg(&peer)
            .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
    );
    let decode_as = |policy: &Policy| {
        launch(
            Launch::new(&model, policy)
                .arg("--role")
                .arg("decode")
                .arg("--prefill-peer")
                .arg(&peer)
                .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
        )
    };
    // A decode process with the CA's certificate pairs and answers.
    let decode_policy = with("decode", "ca");
    let decode = decode_as(&decode_policy);
    assert!(
        eventually(Duration::from_secs(10), || ready(&decode)),
        "paired over mutual TLS"
    );
    let (status, body) = answer(&decode, "Name three primary colors.");
    assert_eq!(status, 200, "{body}");
    assert!(decode.logged("transfer received"));
    drop(decode);
    // One whose certificate another CA signed, and one without TLS, never
    // pair, even with the right secret; the prefill side says why.
    let intruder_policy = with("intruder", "ca");
    let plain = Policy::default();
    for policy in [&intruder_policy, &plain] {
        let decode = decode_as(policy);
        std::thread::sleep(Duration::from_secs(2));
        assert!(!ready(&decode), "never paired");
        let r = decode.post_json(
            "/v1/chat/completions",
            Some(KEY_ALPHA),
            &chat_body("Name three primary colors.", 8),
        );
        assert_eq!(r.status, 502, "{}", r.body);
        pool_at_baseline(&decode);
    }
    assert!(prefill.logged("TLS handshake failed"));
    pool_at_baseline(&prefill);
    // A unix: peer has no host name for the certificate: the start says
    // which setting names it.
    let err = refused(
        Launch::new(&model, &decode_policy)
            .arg("--role")
            .arg("decode")
            .arg("--prefill-peer")
            .arg("unix:/nonexistent/transfer.sock")
            .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
    );
    assert!(err.contains("server.transfer_tls.server_name"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// llm-d's prefill/decode routing: the picker names the prefill pod in
/// `x-prefiller-host-port`. A decode process asks that peer only when it is
/// one of its own (configured, and authenticated on every connection);
/// anything else is ignored, counted, and never connected to.
#[test]
fn a_decode_process_takes_the_pickers_prefill_choice_only_among_its_own_peers() {
    let Some(model) = smollm2() else { return };
    let policy = Policy::default();
    let free = || {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("127.0.0.1:{port}")
    };
    let (first, second) = (free(), free());
    let prefill = |addr: &str| {
        launch(
            Launch::new(&model, &policy)
                .arg("--role")
                .arg("prefill")
                .arg("--transfer-listen")
                .arg(addr)
                .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
        )
    };
    let (p1, p2) = (prefill(&first), prefill(&second));
    let decode = launch(
        Launch::new(&model, &policy)
            .arg("--role")
            .arg("decode")
            .arg("--prefill-peer")
            .arg(&first)
            .arg("--prefill-peer")
            .arg(&second)
            .env("BULKHEAD_TRANSFER_SECRET", Some(SECRET)),
    );
    assert!(eventually(Duration::from_secs(10), || ready(&decode)));
    let sent = |p: &Server| -> f64 {
        p.metrics()
            .lines()
            .filter(|l| l.starts_with("bulkhead_transfers_sent_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let hints = |result: &str| {
        metric_value(
            &decode.metrics(),
            &format!("bulkhead_prefiller_hints_total{{result=\"{result}\"}}"),
        )
    };
    // Named, the second peer gets every job.
    let before = (sent(&p1), sent(&p2));
    for _ in 0..3 {
        let r = ask(&decode, KEY_ALPHA, &[("x-prefiller-host-port", &second)], 4);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(sent(&p2) - before.1, 3.0, "the picker's choice");
    assert_eq!(sent(&p1), before.0, "and no other");
    assert_eq!(hints("taken"), 3.0);
    // The picker names a pod by its IP and serving port: the peer at that IP,
    // on its own transfer port.
    let r = ask(
        &decode,
        KEY_ALPHA,
        &[("x-prefiller-host-port", "127.0.0.1:1")],
        4,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(hints("taken"), 4.0);
    // An address of the client's choosing: ignored (served by a peer in
    // turn), counted, and never connected to.
    let bait = std::net::TcpListener::bind("127.0.0.2:0").unwrap();
    bait.set_nonblocking(true).unwrap();
    let bait_addr = bait.local_addr().unwrap().to_string();
    for hint in [bait_addr.as_str(), "evil.example:9090"] {
        let r = ask(&decode, KEY_ALPHA, &[("x-prefiller-host-port", hint)], 4);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(
        matches!(bait.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing connected to the client's address"
    );
    assert_eq!(hints("not_a_peer"), 2.0);
    let r = ask(
        &decode,
        KEY_ALPHA,
        &[("x-prefiller-host-port", "not an address")],
        4,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(hints("unparsable"), 1.0);
    assert!(decode.logged("x-prefiller-host-port names none of this process's prefill peers"));
}
