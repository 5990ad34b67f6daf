//! A test fixture: the policy contract at version 0.1.1 — compatible by
//! semver with 0.1.0, and so accepted by a host that matches imports and
//! exports by semver. This host names the version exactly and refuses it.

#![no_std]

extern crate alloc;

use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({
    inline: r#"
package bulkhead:policy@0.1.1;

interface types {
    /// The API a request came in on.
    enum endpoint {
        /// `POST /v1/chat/completions`.
        chat-completions,
        /// `POST /v1/completions`.
        completions,
    }

    /// One request header. Credentials (`authorization`, `cookie`,
    /// `proxy-authorization`, `x-api-key`) are never passed; names are lower
    /// case; at most 64 headers of at most 1 KiB each are passed.
    record header {
        /// The name, lower case.
        name: string,
        /// The value (headers that are not UTF-8 are left out).
        value: string,
    }

    /// What a plugin sees of a request: its identity and sizes, never its text.
    record request-view {
        /// The request's id (random; the same the client sees as `x-request-id`).
        request-id: u64,
        /// The tenant's name: always the plugin's own tenant for tenant plugins.
        tenant: string,
        /// The model: in `route`, the one the client asked for; in `admit`,
        /// the one that will serve the request (a route may have changed it).
        model: string,
        /// Where it came in.
        endpoint: endpoint,
        /// Prompt tokens (after the chat template).
        prompt-tokens: u32,
        /// The most tokens it may generate (after earlier plugins' adjustments).
        max-tokens: u32,
        /// Whether the answer streams.
        %stream: bool,
        /// Its priority within its tenant's queue (0-255; default 128; higher first).
        priority: u8,
        /// Its headers, credentials removed.
        headers: list<header>,
    }

    /// How an admitted request is tightened. Every field can only tighten: a
    /// higher `max-tokens` or `priority` than the request has, or a model the
    /// tenant may not use, is ignored.
    record adjustments {
        /// A lower limit on generated tokens.
        max-tokens: option<u32>,
        /// A lower priority.
        priority: option<u8>,
    }

    /// A refusal. The host allows only statuses 400, 403 and 429 (anything else
    /// becomes 403), a code of at most 64 characters of `[a-z0-9_]` (else
    /// `policy_rejected`), and a message of at most 256 bytes (longer is cut).
    record rejection {
        /// The HTTP status: 400, 403 or 429.
        status: u16,
        /// A short machine-readable code, e.g. `rate_limited`.
        code: string,
        /// A message for the client.
        message: string,
        /// For a 429: when to retry, in milliseconds (sent as `Retry-After`, rounded up to seconds).
        retry-after-ms: option<u32>,
    }

    /// A plugin's answer to `admit`.
    variant decision {
        /// Let the request through, maybe tightened.
        admit(adjustments),
        /// Refuse it; later plugins are not asked.
        reject(rejection),
    }

    /// How a request ended.
    enum outcome {
        /// An end-of-generation token or a stop sequence.
        stop,
        /// `max-tokens` were generated.
        length,
        /// The client went away.
        cancelled,
        /// Its deadline passed.
        timeout,
        /// The engine failed it.
        error,
        /// The server shut down.
        shutdown,
        /// Its tenant was removed.
        tenant-removed,
        /// It was refused after this plugin admitted it (a later plugin, a full queue).
        refused,
    }

    /// A finished request's real usage, for every request the plugin admitted,
    /// streamed or not.
    record completion {
        /// The request's id.
        request-id: u64,
        /// How it ended.
        outcome: outcome,
        /// Prompt tokens.
        prompt-tokens: u32,
        /// Generated tokens.
        completion-tokens: u32,
        /// From arrival to the end, in milliseconds.
        elapsed-ms: u32,
    }
}

/// What a plugin implements.
interface policy {
    use types.{request-view, decision, completion};

    /// Decides whether `request` may run, and how tightly.
    admit: func(request: request-view) -> decision;

    /// Picks a model among `candidates` (the models the tenant may use, in
    /// catalog order; asked only when there are two or more), or none to leave
    /// the choice to later plugins and the client. A name that is not a
    /// candidate is ignored.
    route: func(request: request-view, candidates: list<string>) -> option<string>;

    /// Told how an admitted request ended (informational: it changes nothing).
    on-complete: func(completion: completion);
}

world tenant-policy {
    export policy;
}
"#,
});

use bulkhead::policy::types::{Adjustments, Completion, Decision, RequestView};

struct Skew;

impl exports::bulkhead::policy::policy::Guest for Skew {
    fn admit(_request: RequestView) -> Decision {
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

export!(Skew);
