//! A test fixture: a component exporting a different version of the policy
//! interface (`bulkhead:policy@0.2.0`). The host refuses it at upload.

wit_bindgen::generate!({
    inline: r#"
        package bulkhead:policy@0.2.0;

        interface policy {
            admit: func(prompt-tokens: u32) -> bool;
        }

        world tenant-policy {
            export policy;
        }
    "#,
});

struct Wrong;

impl exports::bulkhead::policy::policy::Guest for Wrong {
    fn admit(_prompt_tokens: u32) -> bool {
        true
    }
}

export!(Wrong);
