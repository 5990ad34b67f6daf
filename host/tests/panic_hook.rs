//! The server's panic hook keeps a panic's message out of the log: where it
//! happened and which request it was serving, nothing it says. Its own test
//! binary, since the hook and the log subscriber are process-wide.

use bulkhead::lane::{Lane, LaneStopped};
use bulkhead::telemetry;
use bulkhead::tenancy::TenantId;
use std::io::Write;
use std::sync::{Arc, Mutex};

/// What the subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_panic_logs_its_place_and_request_id_and_never_its_message() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .json()
        .with_writer(move || writer.clone())
        .with_current_span(true)
        .init();
    telemetry::install_panic_hook();
    let lane = Lane::new("bulkhead-lane", "request", 1, 64).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // A tokenization job that panics quoting its prompt, in its request's span
    // (as the API layer runs it).
    let failed = runtime.block_on(tracing::Instrument::instrument(
        lane.run(TenantId(1), |_| -> u32 {
            panic!("CANARY-7f3e quoted from the prompt")
        }),
        tracing::info_span!("request", request_id = 4242u64),
    ));
    assert_eq!(failed, Err(LaneStopped));
    // A panic on a thread of its own, outside any request.
    let thread = std::thread::Builder::new()
        .name("bulkhead-engine".into())
        .spawn(|| panic!("CANARY-7f3e again"))
        .unwrap();
    assert!(thread.join().is_err());

    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        !log.contains("CANARY"),
        "a panic message reached the log:\n{log}"
    );
    let panics: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .filter(|event: &serde_json::Value| {
            event["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("panicked"))
        })
        .collect();
    assert_eq!(panics.len(), 2, "{log}");
    let (job, engine) = (&panics[0], &panics[1]);
    assert_eq!(job["span"]["request_id"], 4242, "{job}");
    assert_eq!(job["fields"]["thread"], "bulkhead-lane-0");
    assert_eq!(engine["fields"]["thread"], "bulkhead-engine");
    assert!(engine.get("span").is_none(), "{engine}");
    for event in [job, engine] {
        let location = event["fields"]["location"].as_str().unwrap();
        assert!(
            location.starts_with("host/tests/panic_hook.rs:"),
            "{location}"
        );
        assert_eq!(event["level"], "ERROR");
    }
}
