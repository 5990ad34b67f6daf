//! Caps the size of requests: prompts over `PROMPT_TOKENS_MAX` are refused with
//! a message that says what to do, and generations are cut to at most
//! `MAX_TOKENS_CAP` tokens (an adjustment: it can only lower `max_tokens`).

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({ path: "../../wit", world: "tenant-policy" });

use bulkhead::policy::types::{Adjustments, Completion, Decision, Rejection, RequestView};
use exports::bulkhead::policy::policy::Guest;

const PROMPT_TOKENS_MAX: u32 = 200;
const MAX_TOKENS_CAP: u32 = 64;

struct SizeCap;

impl Guest for SizeCap {
    fn admit(request: RequestView) -> Decision {
        if request.prompt_tokens > PROMPT_TOKENS_MAX {
            return Decision::Reject(Rejection {
                status: 400,
                code: "prompt_too_large".into(),
                message: format!(
                    "prompts are limited to {PROMPT_TOKENS_MAX} tokens on this plan; this one has {}",
                    request.prompt_tokens
                ),
                retry_after_ms: None,
            });
        }
        Decision::Admit(Adjustments {
            max_tokens: Some(request.max_tokens.min(MAX_TOKENS_CAP)),
            priority: None,
        })
    }

    fn route(_request: RequestView, _candidates: Vec<String>) -> Option<String> {
        None
    }

    fn on_complete(_completion: Completion) {}
}

export!(SizeCap);
