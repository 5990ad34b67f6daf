//! Admits only requests from allowed teams (the `x-team` header, trusted as
//! sent: set it at an authenticating gateway, never from clients) within
//! opening hours (UTC), and refuses the rest with 403 and a reason.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use bulkhead::policy::host;
use bulkhead::policy::types::{Adjustments, Completion, Decision, Rejection, RequestView};
use exports::bulkhead::policy::policy::Guest;

const TEAMS: [&str; 2] = ["red", "blue"];
/// Open from this hour (UTC, inclusive) ...
const OPENS_HOUR: u64 = 0;
/// ... to this one (exclusive): 0..24 is always open; edit for office hours.
const CLOSES_HOUR: u64 = 24;

struct AllowList;

fn refuse(code: &str, message: String) -> Decision {
    Decision::Reject(Rejection {
        status: 403,
        code: code.into(),
        message,
        retry_after_ms: None,
    })
}

impl Guest for AllowList {
    fn admit(request: RequestView) -> Decision {
        let team = request
            .headers
            .iter()
            .find(|h| h.name == "x-team")
            .map(|h| h.value.as_str());
        match team {
            Some(team) if TEAMS.contains(&team) => {}
            _ => {
                return refuse(
                    "team_not_allowed",
                    "send x-team with an allowed team name".into(),
                )
            }
        }
        let hour = host::now_ms() / 3_600_000 % 24;
        if !(OPENS_HOUR..CLOSES_HOUR).contains(&hour) {
            return refuse(
                "closed",
                format!("open {OPENS_HOUR:02}:00-{CLOSES_HOUR:02}:00 UTC"),
            );
        }
        Decision::Admit(Adjustments {
            max_tokens: None,
            priority: None,
        })
    }

    fn route(_request: RequestView, _candidates: Vec<String>) -> Option<String> {
        None
    }

    fn on_complete(_completion: Completion) {}
}

export!(AllowList);
