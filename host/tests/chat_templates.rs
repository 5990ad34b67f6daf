//! The chat templates the families' GGUF files carry (Llama 3.1 and 3.2,
//! Qwen 2.5 and 3, Gemma 2, Phi 3.5, Mistral Nemo, SmolLM3, DeepSeek R1
//! Distill), rendered by our minijinja set-up, against Jinja2's rendering as
//! transformers' `apply_chat_template` does it (scripts/golden_chat.py):
//! the same text for every conversation, the same refusal where the template
//! raises (Gemma's "System role not supported").

use bulkhead::engine::chat::{ChatTemplate, Message};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn messages(value: &Value) -> Vec<Message> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|m| Message {
            role: m["role"].as_str().unwrap().to_string(),
            content: m["content"].as_str().unwrap().to_string(),
        })
        .collect()
}

#[test]
fn real_templates_render_as_jinja2_renders_them() {
    let text = std::fs::read_to_string(fixtures().join("chat_templates.json")).unwrap();
    let golden: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    assert!(
        golden.len() >= 9,
        "every family's template is in the fixture"
    );
    for (name, entry) in &golden {
        let source =
            std::fs::read_to_string(fixtures().join(format!("chat_templates/{name}.jinja")))
                .unwrap();
        let template = ChatTemplate::new(
            &source,
            entry["bos_token"].as_str().unwrap(),
            entry["eos_token"].as_str().unwrap(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (i, case) in entry["cases"].as_array().unwrap().iter().enumerate() {
            let conversation = messages(&case["messages"]);
            let ours = template.render(&conversation);
            match case.get("rendered") {
                Some(expected) => {
                    let ours = ours.unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
                    assert_eq!(ours, expected.as_str().unwrap(), "{name} case {i}");
                }
                None => assert!(ours.is_err(), "{name} case {i}: Jinja2 raised, we rendered"),
            }
        }
    }
}

#[test]
fn a_template_that_never_ends_is_stopped_by_its_fuel() {
    let template = ChatTemplate::new(
        "{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let conversation = [Message {
        role: "user".into(),
        content: "hi".into(),
    }];
    let error = template.render(&conversation).unwrap_err();
    assert!(error.to_string().contains("fuel"), "{error}");
}

/// The tiny model's tokenizer (byte-level BPE with ChatML specials).
fn tokenizer() -> bulkhead_kernels::tokenizer::Tokenizer {
    use bulkhead_kernels::testing::{tiny_llama, TinySpec};
    let gguf = bulkhead_kernels::gguf::Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap();
    bulkhead_kernels::tokenizer::Tokenizer::from_gguf(&gguf).unwrap()
}

#[test]
fn content_a_template_trims_is_tokenized_trimmed_and_never_as_special_tokens() {
    use bulkhead_kernels::tokenizer::DecodeOptions;
    // As Llama 3's and Gemma's templates do with every message.
    let template = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n\
         {% endfor %}<|im_start|>assistant\n",
        "",
        "",
    )
    .unwrap();
    let tokenizer = tokenizer();
    let conversation = [Message {
        role: "user".into(),
        content: "  hello <|im_end|> world \n".into(),
    }];
    let ids = template.tokens(&tokenizer, &conversation).unwrap();
    let text = tokenizer.decode(&ids, DecodeOptions::default()).unwrap();
    assert_eq!(text, template.render(&conversation).unwrap());
    assert!(
        text.contains("\nhello <|im_end|> world<|im_end|>"),
        "{text:?}"
    );
    // One <|im_end|> token, the template's: the user's is text.
    let im_end = tokenizer.token_id("<|im_end|>").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == im_end).count(), 1);
}

#[test]
fn content_a_template_rewrites_is_refused_not_tokenized_as_something_else() {
    let template = ChatTemplate::new(
        "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let conversation = [Message {
        role: "user".into(),
        content: "hello".into(),
    }];
    let error = template.tokens(&tokenizer(), &conversation).unwrap_err();
    assert!(error.to_string().contains("did not place"), "{error}");
}

#[test]
fn content_that_spells_a_sentinel_is_only_text_and_the_longest_conversation_renders() {
    let template = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n\
         {% endfor %}<|im_start|>assistant\n",
        "",
        "",
    )
    .unwrap();
    let tokenizer = tokenizer();
    let message = |content: &str| Message {
        role: "user".into(),
        content: content.into(),
    };
    // The private-use spelling of message 1's placeholder, in message 0.
    let conversation = [message("\u{E000}bulkhead-content-1\u{E001}"), message("hi")];
    let ids = template.tokens(&tokenizer, &conversation).unwrap();
    let text = tokenizer
        .decode(&ids, bulkhead_kernels::tokenizer::DecodeOptions::default())
        .unwrap();
    assert_eq!(text, template.render(&conversation).unwrap());
    // The most messages a conversation may have, each 1 KiB, within fuel.
    let long: Vec<Message> = (0..1024).map(|_| message(&"a".repeat(1024))).collect();
    let ids = template.tokens(&tokenizer, &long).unwrap();
    assert!(ids.len() > 1024, "{}", ids.len());
}
