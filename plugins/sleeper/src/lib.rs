//! A test fixture: a plugin built with `std` that blocks in every export on a
//! 31-year timer (`std::thread::sleep` subscribes to a monotonic-clock
//! pollable and blocks on `wasi:io/poll`). A host that linked WASI would sleep
//! inside that host call, where neither fuel nor the epoch deadline reaches;
//! this host links no WASI and refuses it at upload, naming the import.

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use bulkhead::policy::types::{Adjustments, Completion, Decision, RequestView};
use exports::bulkhead::policy::policy::Guest;
use std::time::Duration;

const THIRTY_ONE_YEARS: Duration = Duration::from_secs(31 * 365 * 24 * 3600);

struct Sleeper;

impl Guest for Sleeper {
    fn admit(_request: RequestView) -> Decision {
        std::thread::sleep(THIRTY_ONE_YEARS);
        Decision::Admit(Adjustments {
            max_tokens: None,
            priority: None,
        })
    }

    fn route(_request: RequestView, _candidates: Vec<String>) -> Option<String> {
        std::thread::sleep(THIRTY_ONE_YEARS);
        None
    }

    fn on_complete(_completion: Completion) {
        std::thread::sleep(THIRTY_ONE_YEARS);
    }
}

export!(Sleeper);
