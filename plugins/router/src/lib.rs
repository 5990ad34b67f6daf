//! Routes by header: `x-priority: low` lowers a request's priority in its
//! tenant's queue (batch work waits behind interactive work), and `x-tier`
//! picks a model among those the tenant may use (`fast` → the first candidate
//! whose id ends in `-q8`, `precise` → the first that does not).

#![no_std]

extern crate alloc;

use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use bulkhead::policy::types::{Adjustments, Completion, Decision, RequestView};
use exports::bulkhead::policy::policy::Guest;

/// The priority of batch work (the default is 128; higher runs first).
const LOW_PRIORITY: u8 = 32;

struct Router;

fn header<'r>(request: &'r RequestView, name: &str) -> Option<&'r str> {
    request
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_str())
}

impl Guest for Router {
    fn admit(request: RequestView) -> Decision {
        let low = header(&request, "x-priority") == Some("low");
        Decision::Admit(Adjustments {
            max_tokens: None,
            priority: low.then_some(LOW_PRIORITY),
        })
    }

    fn route(request: RequestView, candidates: Vec<String>) -> Option<String> {
        let fast = match header(&request, "x-tier")? {
            "fast" => true,
            "precise" => false,
            _ => return None,
        };
        candidates.into_iter().find(|m| m.ends_with("-q8") == fast)
    }

    fn on_complete(_completion: Completion) {}
}

export!(Router);
