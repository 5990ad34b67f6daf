//! Hostile load through the real binary (issue: isolation gate, item 1): each
//! attack runs, and meanwhile another client's or tenant's requests succeed
//! within a stated bound.
//!
//! Attackers connect from other loopback addresses (127.0.0.2, ...: all of
//! 127/8 is loopback on Linux), so the per-peer cap tells them from the victim
//! on 127.0.0.1.

mod support;

use serde_json::json;
use socket2::{Domain, Socket, Type};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use support::*;

/// What a victim's small request may take while an attack runs, beyond the
/// attack's own deadline where it has one. A solo request takes well under a
/// second here; the slack absorbs a loaded 2-core CI machine.
const VICTIM_SLACK: Duration = Duration::from_secs(5);

fn addr(url: &str) -> SocketAddr {
    let host = url
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    host.parse().unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// A TCP connection to `url` from the loopback address `from`.
fn connect_from(url: &str, from: Ipv4Addr) -> TcpStream {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::from((from, 0)).into())
        .unwrap_or_else(|e| panic!("bind {from}: {e}"));
    socket.connect(&addr(url).into()).unwrap();
    socket.into()
}

/// How long until the server closes `stream` (reading and dropping whatever
/// it sends), or None if it is still open after `wait`.
fn closed_within(stream: &mut TcpStream, wait: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let left = wait.checked_sub(started.elapsed())?;
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if started.elapsed() >= wait {
                    return None;
                }
            }
            Err(_) => return Some(started.elapsed()),
        }
    }
}

/// A small chat request by `key`, timed.
fn timed_chat(server: &Server, key: &str) -> (u16, Duration) {
    let started = Instant::now();
    let r = server.post_json("/v1/chat/completions", Some(key), &chat_body("Say hi.", 4));
    (r.status, started.elapsed())
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty HTTP/2 SETTINGS frame (length 0, type 4, no flags, stream 0).
const H2_EMPTY_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

#[test]
fn connections_that_say_nothing_are_closed_at_the_handshake_deadline() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let handshake = Duration::from_millis(1000);
    let idle = Duration::from_millis(3000);
    let server = start(
        &model,
        &Policy {
            handshake_timeout_ms: handshake.as_millis() as u64,
            idle_timeout_ms: idle.as_millis() as u64,
            ..Policy::default()
        },
    );
    let local = Ipv4Addr::LOCALHOST;
    // What each stalled client sent before going quiet, on both listeners.
    let stalls: [(&str, &str, Vec<u8>); 5] = [
        ("silent", &server.inference, vec![]),
        ("silent on admin", &server.admin, vec![]),
        (
            "half an HTTP/2 preface",
            &server.inference,
            H2_PREFACE[..8].to_vec(),
        ),
        (
            "an HTTP/2 preface and SETTINGS",
            &server.admin,
            [H2_PREFACE, H2_EMPTY_SETTINGS].concat(),
        ),
        (
            "half the HTTP/1 headers",
            &server.inference,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n".to_vec(),
        ),
    ];
    let threads: Vec<_> = stalls
        .into_iter()
        .map(|(what, url, bytes)| {
            let mut stream = connect_from(url, local);
            stream.write_all(&bytes).unwrap();
            std::thread::spawn(move || (what, closed_within(&mut stream, handshake * 4)))
        })
        .collect();
    // A keep-alive client that asked once and then went quiet lasts until the
    // idle deadline, not the handshake one.
    let mut kept = connect_from(&server.inference, local);
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut first = [0u8; 12];
    kept.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let idle_closed = closed_within(&mut kept, idle * 3);

    for thread in threads {
        let (what, closed) = thread.join().unwrap();
        let closed = closed.unwrap_or_else(|| panic!("{what}: still open"));
        assert!(
            closed >= handshake.mul_f32(0.8) && closed <= handshake + VICTIM_SLACK,
            "{what}: closed after {closed:?}, deadline {handshake:?}"
        );
    }
    let idle_closed = idle_closed.expect("an idle keep-alive connection is closed");
    assert!(
        idle_closed >= idle.mul_f32(0.8) && idle_closed <= idle + VICTIM_SLACK,
        "idle connection closed after {idle_closed:?}, deadline {idle:?}"
    );
    let metrics = server.metrics();
    let closed = |listener: &str, reason: &str| {
        metric_value(
            &metrics,
            &format!(
                r#"bulkhead_connections_closed_total{{listener="{listener}",reason="{reason}"}}"#
            ),
        )
    };
    assert!(closed("inference", "handshake_timeout") >= 3.0, "{metrics}");
    assert!(closed("admin", "handshake_timeout") >= 2.0, "{metrics}");
    assert!(closed("inference", "idle_timeout") >= 1.0, "{metrics}");
}

#[test]
fn one_peer_cannot_take_every_connection_slot() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start(
        &model,
        &Policy {
            connections_max: 16,
            connections_per_peer_max: 4,
            // Long: here only the per-peer cap may free the victim's way.
            handshake_timeout_ms: 60_000,
            ..Policy::default()
        },
    );
    let attacker = Ipv4Addr::new(127, 0, 0, 2);
    let mut held: Vec<TcpStream> = (0..16)
        .map(|_| connect_from(&server.inference, attacker))
        .collect();
    // Four are served; the other twelve are closed at once.
    let closed = held
        .iter_mut()
        .map(|s| closed_within(s, Duration::from_millis(700)))
        .filter(Option::is_some)
        .count();
    assert_eq!(closed, 12, "the per-peer cap is 4");
    let (status, took) = timed_chat(&server, KEY_ALPHA);
    assert_eq!(status, 200);
    assert!(took < VICTIM_SLACK, "the victim waited {took:?}");
    assert_eq!(
        server.metric(
            r#"bulkhead_connections_closed_total{listener="inference",reason="peer_limit"}"#
        ),
        12.0
    );
}

#[test]
fn many_peers_holding_every_slot_are_cleared_by_the_handshake_deadline() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let handshake = Duration::from_millis(1500);
    let server = start(
        &model,
        &Policy {
            connections_max: 16,
            connections_per_peer_max: 4,
            handshake_timeout_ms: handshake.as_millis() as u64,
            ..Policy::default()
        },
    );
    // Four peers take all 16 slots and reconnect as soon as they are closed.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attackers: Vec<_> = (2..6)
        .flat_map(|last| std::iter::repeat_n(last, 4))
        .map(|last| {
            let url = server.inference.clone();
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                let stopped = || stop.load(std::sync::atomic::Ordering::Relaxed);
                while !stopped() {
                    // Hold the connection, saying nothing, until the server closes it.
                    let mut stream = connect_from(&url, Ipv4Addr::new(127, 0, 0, last));
                    while !stopped()
                        && closed_within(&mut stream, Duration::from_millis(100)).is_none()
                    {
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (status, took) = timed_chat(&server, KEY_ALPHA);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(status, 200);
    assert!(
        took <= handshake + VICTIM_SLACK,
        "the victim waited {took:?} behind the attack"
    );
    for attacker in attackers {
        attacker.join().unwrap();
    }
    assert!(
        server.metric(
            r#"bulkhead_connections_closed_total{listener="inference",reason="handshake_timeout"}"#
        ) >= 16.0
    );
}

/// A streamed chat completion asked for over HTTP/2 from `from`, with a
/// stream window of zero that the client never opens: the response starts
/// (its HEADERS need no window) and no byte of its body can be sent.
fn zero_window_stream(server: &Server, from: Ipv4Addr) -> TcpStream {
    let mut stream = connect_from(&server.inference, from);
    stream
        .write_all(&h2::open(&[(h2::INITIAL_WINDOW_SIZE, 0)]))
        .unwrap();
    let mut body = chat_body("Write a long story about a lighthouse.", 64);
    body["stream"] = json!(true);
    let post = h2::post(
        1,
        "/v1/chat/completions",
        KEY_ALPHA,
        &[],
        body.to_string().as_bytes(),
    );
    stream.write_all(&post).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // Acknowledge the server's SETTINGS; wait for the response to start.
    loop {
        let (kind, flags, id, _) = h2::read_frame(&mut stream).expect("the response starts");
        if kind == h2::SETTINGS && flags & h2::ACK == 0 {
            h2::ack_settings(&mut stream).unwrap();
        }
        if kind == h2::HEADERS && id == 1 {
            return stream;
        }
    }
}

/// The send deadline under test: short, so the tests are.
const SEND_STALL: Duration = Duration::from_millis(2000);

fn stall_policy() -> Policy {
    Policy {
        connections_max: 16,
        connections_per_peer_max: 4,
        alpha_pending_max: 64,
        server_toml: format!(
            "send_stall_timeout_ms = {}\nsend_rate_min_bytes_per_s = 1024\n",
            SEND_STALL.as_millis()
        ),
        ..Policy::default()
    }
}

#[test]
fn clients_that_never_open_their_http2_window_cannot_hold_the_listener() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start(&model, &stall_policy());
    // Four peers take all 16 slots with responses that cannot be sent.
    let mut held: Vec<TcpStream> = (2..6)
        .flat_map(|last| std::iter::repeat_n(last, 4))
        .map(|last| zero_window_stream(&server, Ipv4Addr::new(127, 0, 0, last)))
        .collect();
    let held_at = Instant::now();
    // The victim's connection waits for a slot; the send deadline frees them.
    let (status, took) = timed_chat(&server, KEY_BETA);
    assert_eq!(status, 200);
    assert!(
        took <= SEND_STALL + VICTIM_SLACK,
        "the victim waited {took:?} behind the held responses"
    );
    for stream in &mut held {
        let left = (SEND_STALL + VICTIM_SLACK).saturating_sub(held_at.elapsed());
        assert!(
            closed_within(stream, left + Duration::from_secs(2)).is_some(),
            "a held connection is closed"
        );
    }
    assert!(
        server.metric(
            r#"bulkhead_connections_closed_total{listener="inference",reason="send_stall"}"#
        ) >= 16.0
    );
    // Their requests ended with their connections: the pool is back at baseline.
    assert!(eventually(Duration::from_secs(10), || {
        server
            .admin_call("GET", &format!("/admin/v1/models/{MODEL_ID}/pool"), None)
            .json()["at_baseline"]
            == true
    }));
}

#[test]
fn a_slow_but_steady_http2_reader_is_not_cut() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start(&model, &stall_policy());
    // A client that opens its window a little at a time, but steadily, gets
    // its whole answer, however long past the stall deadline it takes. (An
    // HTTP/1 client that never reads is closed the same way: the unit tests
    // of server/accept.rs show it over a small in-memory pipe, since over
    // loopback the kernel buffers more than our model's longest stream.)
    let mut stream = zero_window_stream(&server, Ipv4Addr::LOCALHOST);
    let started = Instant::now();
    let mut ended = false;
    while !ended {
        std::thread::sleep(Duration::from_millis(200));
        let update = h2::frame(h2::WINDOW_UPDATE, 0, 1, &512u32.to_be_bytes());
        stream.write_all(&update).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        while let Some((kind, flags, id, _)) = h2::read_frame(&mut stream) {
            if kind == h2::SETTINGS && flags & h2::ACK == 0 {
                h2::ack_settings(&mut stream).unwrap();
            }
            assert_ne!(kind, h2::GOAWAY, "cut after {:?}", started.elapsed());
            assert_ne!(kind, h2::RST_STREAM, "cut after {:?}", started.elapsed());
            ended |= id == 1 && flags & h2::END_STREAM != 0;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no end");
    }
    eprintln!("the steady reader took {:?}", started.elapsed());
    assert!(
        started.elapsed() > SEND_STALL,
        "it was slower than the stall deadline"
    );
    assert_eq!(
        server.metric(
            r#"bulkhead_connections_closed_total{listener="inference",reason="send_stall"}"#
        ),
        0.0
    );
}

/// Starts a chat request whose body never finishes arriving.
fn slow_body(server: &Server, key: &str) -> TcpStream {
    let mut stream = connect_from(&server.inference, Ipv4Addr::LOCALHOST);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\":"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

#[test]
fn one_tenants_slow_bodies_cannot_hold_another_tenants_requests() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start(
        &model,
        &Policy {
            beta_pending_max: 2,
            ..Policy::default()
        },
    );
    let slow: Vec<TcpStream> = (0..2).map(|_| slow_body(&server, KEY_BETA)).collect();
    std::thread::sleep(Duration::from_millis(300));
    // Beta's third request before admission is refused at once ...
    let r = server.post_json("/v1/chat/completions", Some(KEY_BETA), &chat_body("hi", 4));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.error().1, json!("too_many_pending"));
    assert_eq!(r.retry_after.as_deref(), Some("1"));
    // ... while alpha is served as usual.
    let (status, took) = timed_chat(&server, KEY_ALPHA);
    assert_eq!(status, 200);
    assert!(took < VICTIM_SLACK, "alpha waited {took:?}");
    // Beta's permits come back when its slow clients go away.
    drop(slow);
    assert!(eventually(Duration::from_secs(5), || {
        timed_chat(&server, KEY_BETA).0 == 200
    }));
}

/// A server taking bodies of up to 4 MiB: room for [`huge_text`].
fn start_with_room(model: &std::path::Path) -> Server {
    let policy = Policy {
        body_bytes_max: 4 << 20,
        ..Policy::default()
    };
    start(model, &policy)
}

/// 3.6 MB of text: more than 1024 tokens, whatever it says, by its size alone.
fn huge_text() -> String {
    "lorem ipsum ".repeat(300_000)
}

#[test]
fn an_oversized_prompt_is_refused_by_its_size_before_it_is_tokenized() {
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start_with_room(&model);
    // 1024 promised tokens: a few MiB of text cannot be fewer, whatever it says.
    let huge = huge_text();
    for (path, body) in [
        ("/v1/chat/completions", chat_body(&huge, 4)),
        (
            "/v1/completions",
            json!({"model": MODEL_ID, "prompt": huge, "max_tokens": 4}),
        ),
    ] {
        let r = server.post_json(path, Some(KEY_BETA), &body);
        assert_eq!(r.status, 400, "{path}");
        assert_eq!(r.error().1, json!("context_length_exceeded"));
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains("the prompt is at least"), "{message}");
    }
    // Below the byte bound, tokenizing stops at the budget: the same answer.
    let r = server.post_json(
        "/v1/chat/completions",
        Some(KEY_BETA),
        &chat_body(&"hello ".repeat(5000), 4),
    );
    assert_eq!(r.error().1, json!("context_length_exceeded"));
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("the prompt is at least 1021 tokens"),
        "1024 - 4 + 1: {message}"
    );
    assert_eq!(timed_chat(&server, KEY_BETA).0, 200);
}

#[test]
fn a_request_of_a_tenant_without_plugins_takes_one_turn_of_the_request_lane() {
    // Its parsing and its prompt's tokens are one job: behind a tenant
    // flooding the lane it waits for one job of that tenant, not two. Each
    // job is counted for its tenant, with its time.
    let _load = beside();
    let Some(model) = smollm2() else { return };
    let server = start_with_room(&model);
    let jobs = || request_lane_jobs(&server, KEY_BETA);
    let mut counted = jobs();
    let mut took = |what: &str, expected: f64| {
        let now = jobs();
        assert_eq!(now - counted, expected, "lane jobs of {what}");
        counted = now;
    };
    // One prompt, chat or completions: one job.
    assert_eq!(timed_chat(&server, KEY_BETA).0, 200);
    took("a chat request", 1.0);
    let one = json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 2});
    assert_eq!(
        server
            .post_json("/v1/completions", Some(KEY_BETA), &one)
            .status,
        200
    );
    took("a completion", 1.0);
    // A batch of two prompts: the parsing, then each prompt in its turn.
    let two = json!({"model": MODEL_ID, "prompt": ["Once upon", "a time"], "max_tokens": 2});
    assert_eq!(
        server
            .post_json("/v1/completions", Some(KEY_BETA), &two)
            .status,
        200
    );
    took("a batch of two", 3.0);
    // Refused before tokenizing (by its size; malformed): the parsing only.
    let huge = json!({"model": MODEL_ID, "prompt": huge_text(), "max_tokens": 4});
    assert_eq!(
        server
            .post_json("/v1/completions", Some(KEY_BETA), &huge)
            .status,
        400
    );
    took("a prompt too long by its size", 1.0);
    let r = server.post("/v1/chat/completions", Some(KEY_BETA), b"{\"model\": ");
    assert_eq!(r.status, 400);
    took("malformed JSON", 1.0);
    let beta = server
        .call(&server.inference, "GET", "/v1/tenant", Some(KEY_BETA), None)
        .json();
    let busy = server.metric(&format!(
        r#"bulkhead_lane_busy_microseconds_total{{lane="request",tenant_id="{}"}}"#,
        beta["id"]
    ));
    assert!(busy > 0.0, "the jobs' time is counted");
    // Another tenant's count is its own.
    assert_eq!(timed_chat(&server, KEY_ALPHA).0, 200);
    took("another tenant's request", 0.0);
}

#[test]
fn abandoned_requests_take_their_queued_work_and_their_permits_with_them() {
    let _load = alone();
    let Some(model) = smollm2() else { return };
    // The most context the test pool can promise: a prompt's tokenization
    // may run to 1,536 tokens of work.
    let server = std::sync::Arc::new(start(
        &model,
        &Policy {
            context_tokens: 1536,
            seq_pages_max: 96,
            body_bytes_max: 64 << 10,
            alpha_pending_max: 64,
            ..Policy::default()
        },
    ));
    // Random letters (no word is one token): tokenized up to the context's
    // budget, milliseconds of the one lane thread each.
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let text: String = (0..25_000)
        .map(|i| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if i % 7 == 6 {
                ' '
            } else {
                char::from(b'a' + (seed >> 59) as u8 % 26)
            }
        })
        .collect();
    let body = chat_body(&text, 4).to_string();
    let one = Instant::now();
    let r = server.post("/v1/chat/completions", Some(KEY_ALPHA), body.as_bytes());
    assert_eq!(r.error().1, json!("context_length_exceeded"), "{}", r.body);
    let one = one.elapsed();
    // Over HTTP/2, each cancelled (RST_STREAM) 2 ms after it is sent, while
    // it waits its turn on the lane: the server drops a cancelled stream's
    // handler at once (an HTTP/1 handler runs on until it writes). (At 20 ms
    // most were answered first: the lane keeps up with 32 such clients, and
    // some runs saw none abandoned.)
    let request = [
        h2::open(&[]),
        h2::post(1, "/v1/chat/completions", KEY_ALPHA, &[], body.as_bytes()),
    ]
    .concat();
    let cancel = h2::frame(h2::RST_STREAM, 0, 1, &h2::CANCEL.to_be_bytes());
    let rss_before = server.rss_bytes();
    let started = Instant::now();
    let flood: Vec<_> = (0..32)
        .map(|_| {
            let (server, request, cancel) = (
                std::sync::Arc::clone(&server),
                request.clone(),
                cancel.clone(),
            );
            std::thread::spawn(move || {
                let mut sent = 0u32;
                while started.elapsed() < Duration::from_secs(4) {
                    let mut stream = TcpStream::connect(addr(&server.inference)).unwrap();
                    if stream.write_all(&request).is_ok() {
                        sent += 1;
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    let _ = stream.write_all(&cancel);
                    // Dropped: the client leaves before any answer.
                }
                sent
            })
        })
        .collect();
    let sent: u32 = flood.into_iter().map(|h| h.join().unwrap()).sum();
    // The queued work left with its requests: the server goes quiet at once,
    // rather than tokenizing the abandoned prompts for a minute.
    std::thread::sleep(Duration::from_millis(500));
    let cpu_at_end = server.cpu_time();
    std::thread::sleep(Duration::from_secs(3));
    let cpu_after = server.cpu_time() - cpu_at_end;
    let rss_after = server.rss_bytes();
    let abandoned = server.metric(r#"bulkhead_requests_abandoned_total{tenant="alpha"}"#);
    eprintln!(
        "one such request: {one:?}; {sent} sent and cancelled, {abandoned} before an answer; \
         server CPU in the 3 s after: {cpu_after:?}; RSS {} -> {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
    assert!(sent > 100, "the flood ran: {sent}");
    assert!(cpu_after < Duration::from_millis(600), "{cpu_after:?}");
    assert!(
        rss_after < rss_before + (150 << 20),
        "RSS {rss_before} -> {rss_after}"
    );
    // Counted, and in the tenant's usage as cancelled.
    assert!(abandoned >= 1.0, "abandoned requests are counted");
    assert!(eventually(Duration::from_secs(5), || {
        server
            .admin_call("GET", "/admin/v1/usage?tenant=alpha", None)
            .json()["total"]["outcomes"]["cancelled"]
            .as_f64()
            .is_some_and(|n| n >= abandoned)
    }));
    // Every permit came back: alpha's pending_max (64) requests at once pass.
    let statuses: Vec<u16> = (0..64)
        .map(|_| {
            let server = std::sync::Arc::clone(&server);
            std::thread::spawn(move || timed_chat(&server, KEY_ALPHA).0)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert_eq!(statuses, vec![200; 64]);
}

#[test]
fn a_flooding_tenant_cannot_503_or_starve_another() {
    let _load = alone();
    let Some(model) = smollm2() else { return };
    let server = std::sync::Arc::new(start(&model, &Policy::default()));
    let flood_for = Duration::from_secs(6);
    let started = Instant::now();
    // Beta: 8 clients sending as fast as they are answered (on this machine the
    // clients' own CPU is the server's too), small requests, prompts that
    // will be refused for their length, and schemas whose patterns cost the
    // most to compile (refused at the bound on their automata).
    let costly = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": (0..64)
            .map(|i| (format!("p{i}"), json!({"type": "string", "pattern": "(a|b)*a(a|b){9}$"})))
            .collect::<serde_json::Map<_, _>>()}}});
    let flood: Vec<_> = (0..8)
        .map(|i| {
            let server = std::sync::Arc::clone(&server);
            let costly = costly.clone();
            std::thread::spawn(move || {
                let mut statuses = Vec::new();
                while started.elapsed() < flood_for {
                    let body = match i % 4 {
                        0 => chat_body(&"hello ".repeat(3000), 4),
                        1 => {
                            let mut body = chat_body("Write a short poem.", 8);
                            body["response_format"] = costly.clone();
                            body
                        }
                        _ => chat_body("Write a short poem.", 8),
                    };
                    statuses.push(
                        server
                            .post_json("/v1/chat/completions", Some(KEY_BETA), &body)
                            .status,
                    );
                }
                statuses
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut alpha = Vec::new();
    while started.elapsed() < flood_for {
        alpha.push(timed_chat(&server, KEY_ALPHA));
    }
    let beta: Vec<u16> = flood.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let count = |status: u16| beta.iter().filter(|&&s| s == status).count();
    eprintln!(
        "alpha: {} requests, slowest {:?}; beta: {} answered 200, {} refused 400, {} refused 429",
        alpha.len(),
        alpha.iter().map(|(_, took)| *took).max(),
        count(200),
        count(400),
        count(429)
    );
    assert!(!alpha.is_empty());
    for (status, took) in &alpha {
        assert_eq!(*status, 200, "alpha during beta's flood");
        assert!(*took < VICTIM_SLACK, "alpha waited {took:?}");
    }
    assert!(
        beta.iter().all(|s| [200, 400, 429].contains(s)),
        "beta is answered or refused, never failed: {beta:?}"
    );
    assert!(beta.contains(&200), "beta is served too");
}

#[test]
fn a_refusal_flood_cannot_hide_a_security_event_or_another_tenants_history() {
    let _load = alone();
    let Some(model) = smollm2() else { return };
    let server = std::sync::Arc::new(start(
        &model,
        &Policy {
            alpha_pending_max: 64,
            store_toml: "audit_refusals_per_tenant_max = 200\n".into(),
            ..Policy::default()
        },
    ));
    // Beta's history: three refusals, and an admin change about it.
    for _ in 0..3 {
        assert_eq!(
            server.post("/v1/completions", Some(KEY_BETA), b"{").status,
            400
        );
    }
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/beta",
        Some(&json!({"weight": 2})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // Alpha floods cheap refusals (a broken body each) from eight clients;
    // meanwhile an engine faults, a security event.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..8)
        .map(|_| {
            let (server, stop) = (std::sync::Arc::clone(&server), std::sync::Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut sent = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    assert_eq!(
                        server.post("/v1/completions", Some(KEY_ALPHA), b"{").status,
                        400
                    );
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let r = server.admin_call(
        "POST",
        &format!("/admin/v1/models/{MODEL_ID}/fault/panic"),
        None,
    );
    assert_eq!(r.status, 202, "{}", r.body);
    std::thread::sleep(Duration::from_millis(2500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent: u64 = flood.into_iter().map(|h| h.join().unwrap()).sum();
    let log = || {
        server
            .admin_call("GET", "/admin/v1/audit?limit=1000", None)
            .json()["data"]
            .as_array()
            .unwrap()
            .clone()
    };
    assert!(
        eventually(Duration::from_secs(5), || log()
            .iter()
            .any(|r| r["action"] == "engine.fault")),
        "the engine fault is in the audit log after {sent} refusals"
    );
    let log = log();
    let listed = |tenant: u64| {
        log.iter()
            .filter(|r| r["action"] == "request.refused" && r["detail"]["tenant_id"] == tenant)
            .count()
    };
    let summarized: u64 = log
        .iter()
        .filter(|r| r["action"] == "request.refused_summary" && r["target"] == "alpha")
        .map(|r| r["detail"]["refused"].as_u64().unwrap())
        .sum();
    eprintln!(
        "{sent} refusals of alpha's: {} listed, {summarized} in summaries, {} records in all",
        listed(1),
        log.len()
    );
    assert!(sent > 1000, "the flood ran: {sent}");
    let alpha_records = log.iter().filter(|r| r["detail"]["tenant_id"] == 1).count();
    assert!(
        alpha_records <= 200,
        "alpha's refusals are capped: {alpha_records}"
    );
    assert_eq!(listed(2), 3, "beta's refusals are all there");
    assert!(log
        .iter()
        .any(|r| r["action"] == "tenant.update" && r["target"] == "beta"));
    // Usage still counts every refusal.
    assert!(eventually(Duration::from_secs(5), || {
        server
            .admin_call("GET", "/admin/v1/usage?tenant=alpha", None)
            .json()["total"]["outcomes"]["invalid_json"]
            .as_u64()
            == Some(sent)
    }));
}
