//! A token bucket per end user: at most `REQUESTS_PER_MINUTE` requests and
//! `TOKENS_PER_MINUTE` tokens (prompt plus completion) per minute for each
//! value of the `x-user` header (requests without it share one bucket).
//!
//! It trusts `x-user` as the client sent it: deploy it behind a gateway that
//! authenticates end users and sets the header itself (stripping client
//! copies), or any client can claim any user.
//!
//! Both budgets are booked at admission through the host's `budget`
//! interface: the host books atomically, so concurrent requests can never
//! overrun them, and gives back the tokens a request did not use when it ends.

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use bulkhead::policy::budget::{self, BudgetError, Unit};
use bulkhead::policy::types::{Adjustments, Completion, Decision, Rejection, RequestView};
use exports::bulkhead::policy::policy::Guest;

const REQUESTS_PER_MINUTE: u64 = 20;
const TOKENS_PER_MINUTE: u64 = 4000;
const MINUTE_MS: u32 = 60_000;

struct RateLimit;

fn user(request: &RequestView) -> &str {
    request
        .headers
        .iter()
        .find(|h| h.name == "x-user")
        .map_or("anonymous", |h| h.value.as_str())
}

fn limited(what: &str, retry_after_ms: u32) -> Decision {
    Decision::Reject(Rejection {
        status: 429,
        code: "rate_limited".into(),
        message: format!("{what} per minute for this user are used up"),
        retry_after_ms: Some(retry_after_ms),
    })
}

impl Guest for RateLimit {
    fn admit(request: RequestView) -> Decision {
        let user = user(&request);
        let requests = format!("requests:{user}");
        match budget::reserve(&requests, REQUESTS_PER_MINUTE, MINUTE_MS, Unit::Requests, 1) {
            Ok(_) => {}
            Err(BudgetError::Exhausted(ms)) => return limited("requests", ms),
            Err(other) => return reject_internal(other),
        }
        let tokens = format!("tokens:{user}");
        let worst = u64::from(request.prompt_tokens) + u64::from(request.max_tokens);
        match budget::reserve(&tokens, TOKENS_PER_MINUTE, MINUTE_MS, Unit::Tokens, worst) {
            Ok(_) => Decision::Admit(Adjustments {
                max_tokens: None,
                priority: None,
            }),
            // The request booking above is given back by the host: this
            // request is refused.
            Err(BudgetError::Exhausted(ms)) => limited("tokens", ms),
            Err(other) => reject_internal(other),
        }
    }

    fn route(_request: RequestView, _candidates: Vec<String>) -> Option<String> {
        None
    }

    fn on_complete(_completion: Completion) {}
}

fn reject_internal(error: BudgetError) -> Decision {
    Decision::Reject(Rejection {
        status: 429,
        code: "rate_limited".into(),
        message: format!("the rate limit cannot be checked: {error:?}"),
        retry_after_ms: Some(1000),
    })
}

export!(RateLimit);
