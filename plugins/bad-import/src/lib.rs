//! A test fixture: a component of the right world that also imports an
//! interface the host does not offer (a network). The host refuses it at
//! upload.

#![no_std]

extern crate alloc;

use alloc::string::String;
use alloc::vec::Vec;
use bulkhead_guest as _;

wit_bindgen::generate!({
    inline: r#"
        package fixture:bad-import;

        interface network {
            send: func(host: string, bytes: list<u8>);
        }

        world bad {
            import network;
            include bulkhead:policy/tenant-policy@0.1.0;
        }
    "#,
    path: "../../wit",
    world: "fixture:bad-import/bad",
    generate_all,
});

use bulkhead::policy::types::{Adjustments, Completion, Decision, RequestView};

struct Bad;

impl exports::bulkhead::policy::policy::Guest for Bad {
    fn admit(request: RequestView) -> Decision {
        fixture::bad_import::network::send("203.0.113.1", request.tenant.as_bytes());
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

export!(Bad);
