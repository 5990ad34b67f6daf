//! The runtime canary guard through the real binary: a canary registered for
//! alpha blocks beta's response that would carry it (streamed or not, no byte
//! of it sent), alpha still reads its own, each block is counted and audited
//! with the request id, and no log line, metric or audit record holds the
//! canary. With the guard off (the default) nothing is scanned.

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;

const PROMPT: &str = "Write a short story about a lighthouse keeper and a storm.";

fn body(stream: bool) -> Value {
    json!({"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 32, "temperature": 0, "stream": stream})
}

/// The text of a non-streamed reply.
fn text_of(reply: &Reply) -> String {
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A 12-byte piece from the middle of `text`: the canary the test plants
/// (what greedy decoding will say again).
fn marker_in(text: &str) -> String {
    assert!(text.len() >= 36, "too short a completion: {text:?}");
    let start = (text.len() / 3..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    let end = (start + 12..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    text[start..end].to_string()
}

/// A streamed completion: the text it sent and its error event, if any.
fn streamed(server: &Server, key: &str) -> (String, Option<Value>) {
    let (status, mut sse) = server.stream("/v1/chat/completions", key, &body(true));
    assert_eq!(status, 200);
    let mut text = String::new();
    for data in sse.rest() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        if !chunk["error"].is_null() {
            return (text, Some(chunk["error"].clone()));
        }
        text.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or(""),
        );
    }
    (text, None)
}

fn audit(server: &Server) -> Vec<Value> {
    let r = server.admin_call("GET", "/admin/v1/audit?limit=1000", None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"].as_array().unwrap().clone()
}

#[test]
fn the_guard_blocks_another_tenants_canary_and_lets_a_tenant_read_its_own() {
    let Some(model) = smollm2() else { return };
    let policy = Policy {
        canary_guard: true,
        ..Policy::default()
    };
    let server = start(&model, &policy);
    // What beta's greedy completion says before any canary exists.
    let before = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false));
    let full = text_of(&before);
    let canary = marker_in(&full);
    let at = full.find(&canary).unwrap();

    let path = "/admin/v1/tenants/alpha/canaries";
    let set = server.admin_call("PUT", path, Some(&json!({ "canaries": [canary] })));
    assert_eq!(set.status, 200, "{}", set.body);
    assert_eq!(
        server.admin_call("GET", path, None).json(),
        json!({ "canaries": [canary], "guard": true })
    );
    // The tenant reads its own, and only its own.
    let own = server.get(&server.inference, "/v1/tenant/canaries", Some(KEY_ALPHA));
    assert_eq!(own.json(), json!({ "canaries": [canary], "guard": true }));
    let other = server.get(&server.inference, "/v1/tenant/canaries", Some(KEY_BETA));
    assert_eq!(other.json(), json!({ "canaries": [], "guard": true }));
    let put = server.call(
        &server.inference,
        "PUT",
        "/v1/tenant/canaries",
        Some(KEY_BETA),
        Some(&json!({ "canaries": ["Sure, here is"] })),
    );
    assert_eq!(
        put.status, 405,
        "registering is the operator's: {}",
        put.body
    );
    let short = server.admin_call("PUT", path, Some(&json!({"canaries": ["short"]})));
    assert_eq!(short.status, 400, "{}", short.body);

    // Beta's same request now carries alpha's canary: blocked, whole.
    let blocked = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false));
    assert_eq!(blocked.status, 500, "{}", blocked.body);
    assert_eq!(blocked.error().1, json!("output_blocked"));
    assert!(!blocked.body.contains(&canary));
    let blocked_id = blocked.request_id.clone().unwrap();
    // Streamed: the text before the canary may go out, no byte of it does.
    let (sent, error) = streamed(&server, KEY_BETA);
    assert_eq!(error.expect("an error event")["code"], "output_blocked");
    assert!(sent.len() <= at, "{sent:?} reaches into the canary at {at}");
    assert!(
        full.starts_with(&sent),
        "{sent:?} is not what beta was writing"
    );
    // Alpha reads its own canary, streamed and not, every byte.
    let own = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body(false));
    assert_eq!(text_of(&own), full);
    assert_eq!(streamed(&server, KEY_ALPHA), (full.clone(), None));

    // Logged as what it was, not as a client that left.
    let log = server.stderr_lines();
    assert!(
        log.iter()
            .any(|l| l.contains(&blocked_id) && l.contains("blocked by the canary guard")),
        "{log:?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("client disconnected")),
        "{log:?}"
    );
    // Counted and audited with the request id; the canary nowhere.
    let hits = r#"bulkhead_canary_hits_total{tenant="beta",owner="alpha"}"#;
    assert_eq!(server.metric(hits), 2.0);
    let blocks = || {
        audit(&server)
            .into_iter()
            .filter(|a| a["action"] == "request.output_blocked")
            .collect::<Vec<_>>()
    };
    assert!(eventually(Duration::from_secs(5), || blocks().len() == 2));
    let first = blocks()
        .into_iter()
        .find(|a| a["target"] == json!(blocked_id))
        .expect("the non-streamed block is audited with its request id");
    assert_eq!(first["detail"]["tenant"], "beta");
    assert_eq!(first["detail"]["canary_owner"], "alpha");
    let registered = audit(&server)
        .into_iter()
        .find(|a| a["action"] == "tenant.canaries")
        .expect("registering is audited");
    assert_eq!(registered["detail"]["count"], 1);
    // The console's overview raises them as alarms, naming both tenants.
    let stats = server.admin_call("GET", "/admin/v1/stats", None).json();
    assert_eq!(stats["alarms_total"], 2, "{stats}");
    assert_eq!(stats["alarms"][0]["kind"], "canary");
    assert_eq!(stats["alarms"][0]["subject"], "beta");
    assert!(stats["alarms"][0]["detail"]
        .as_str()
        .unwrap()
        .contains("alpha"));
    let everything = format!(
        "{}\n{}\n{}\n{}",
        serde_json::to_string(&audit(&server)).unwrap(),
        server.metrics(),
        server.stderr_lines().join("\n"),
        stats
    );
    assert!(
        !everything.contains(&canary),
        "a canary reached the audit log, the metrics, the log or the live stats"
    );

    // Cleared: beta's response passes again.
    let cleared = server.admin_call("PUT", path, Some(&json!({"canaries": []})));
    assert_eq!(cleared.status, 200);
    let again = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false));
    assert_eq!(text_of(&again), full);
}

/// Every data event of a streamed chat completion but `[DONE]`.
fn stream_chunks(server: &Server, key: &str, body: &Value) -> Vec<Value> {
    let (status, mut sse) = server.stream("/v1/chat/completions", key, body);
    assert_eq!(status, 200);
    sse.rest()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn log_probabilities_are_held_to_the_end_and_scanned_whole_under_the_guard() {
    let Some(model) = smollm2() else { return };
    let policy = Policy {
        canary_guard: true,
        ..Policy::default()
    };
    let server = start(&model, &policy);
    let full = text_of(&server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false)));
    let canary = marker_in(&full);
    let at = full.find(&canary).unwrap();
    // A stop sequence from the canary's tail that first occurs there: the
    // text is cut before the canary is whole, but the token that completed
    // the stop holds the rest, and a log probability shows a whole token.
    let stop = (3..=6)
        .map(|n| canary[canary.len() - n..].to_string())
        .find(|stop| full.find(stop.as_str()) == Some(at + canary.len() - stop.len()))
        .expect("a tail of the canary that first occurs in it");
    let set = server.admin_call(
        "PUT",
        "/admin/v1/tenants/alpha/canaries",
        Some(&json!({ "canaries": [canary] })),
    );
    assert_eq!(set.status, 200, "{}", set.body);
    let mut request = body(false);
    request["stop"] = json!([stop]);
    // Without logprobs the cut text carries no canary: it passes.
    let cut = text_of(&server.post_json("/v1/chat/completions", Some(KEY_BETA), &request));
    assert_eq!(cut, full[..at + canary.len() - stop.len()]);
    // With them, the tokens would complete it: blocked, whole.
    request["logprobs"] = json!(true);
    let blocked = server.post_json("/v1/chat/completions", Some(KEY_BETA), &request);
    assert_eq!(blocked.status, 500, "{}", blocked.body);
    assert_eq!(blocked.error().1, json!("output_blocked"));
    assert!(!blocked.body.contains(&canary));
    // Streamed: text goes out as it passes, log probabilities not before
    // the end, and then not at all.
    request["stream"] = json!(true);
    let chunks = stream_chunks(&server, KEY_BETA, &request);
    assert_eq!(chunks.last().unwrap()["error"]["code"], "output_blocked");
    assert!(
        chunks.iter().all(|c| c["choices"][0]["logprobs"].is_null()),
        "{chunks:?}"
    );
    // Alpha, whose canary it is, gets every token's, in the last chunk.
    let chunks = stream_chunks(&server, KEY_ALPHA, &request);
    let with: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(with.len(), 1, "{chunks:?}");
    assert_eq!(with[0]["choices"][0]["finish_reason"], "stop");
    let bytes: Vec<u8> = with[0]["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
        })
        .collect();
    assert!(String::from_utf8_lossy(&bytes).contains(&canary));
}

#[test]
fn with_the_guard_off_registered_canaries_block_nothing() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let before = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false));
    let full = text_of(&before);
    let canaries = json!({ "canaries": [marker_in(&full)] });
    let set = server.admin_call("PUT", "/admin/v1/tenants/alpha/canaries", Some(&canaries));
    assert_eq!(set.status, 200, "{}", set.body);
    // The answer says nothing scans for them.
    assert_eq!(set.json()["guard"], false);
    assert!(
        set.json()["note"]
            .as_str()
            .unwrap()
            .contains("canary guard is off"),
        "{}",
        set.body
    );
    let after = server.post_json("/v1/chat/completions", Some(KEY_BETA), &body(false));
    assert_eq!(text_of(&after), full);
    assert_eq!(streamed(&server, KEY_BETA), (full, None));
}
