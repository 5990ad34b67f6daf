//! `bulkhead serve` end to end: the real binary, the real SmolLM2, a small
//! policy, plain HTTP. Each test starts its own server so metrics are its own.

mod support;

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;
use support::*;

fn data_json(data: &str) -> Value {
    serde_json::from_str(data).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {data}"))
}

#[test]
fn chat_and_completions_answer_in_openai_shape_with_usage() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());

    let r = server.post_json(
        "/v1/chat/completions",
        Some(KEY_ALPHA),
        &chat_body("Name three primary colors.", 24),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    // One id everywhere: the response's is the header's (and the log's).
    let id = r.request_id.clone().unwrap();
    assert_eq!(v["id"], format!("chatcmpl-{id}"), "{v}");
    assert!(
        server
            .stderr_lines()
            .iter()
            .any(|l| l.contains(&format!("\"request_id\":{id}"))),
        "request {id} not in the log"
    );
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap();
    assert!(text.contains("Red") || text.contains("red"), "{text:?}");
    let usage = &v["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 5 && prompt < 64, "{usage}");
    assert!((1..=24).contains(&completion), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
    let reason = choice["finish_reason"].as_str().unwrap();
    assert!(
        (reason == "length") == (completion == 24),
        "{reason} {completion}"
    );

    let r = server.post_json(
        "/v1/completions",
        Some(KEY_BETA),
        &json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(!v["choices"][0]["text"].as_str().unwrap().is_empty());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(
        v["usage"]["prompt_tokens"], 4,
        "'Once upon a time' is 4 tokens"
    );

    let r = server.get(&server.inference, "/v1/models", Some(KEY_ALPHA));
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], MODEL_ID);
    assert_eq!(r.json()["data"][0]["max_model_len"], 1024);
    let r = server.get(&server.inference, "/healthz", None);
    assert_eq!(r.status, 200);
    let r = server.get(&server.admin, "/readyz", None);
    assert_eq!(r.status, 200);

    // Finished requests and their tokens are counted by tenant.
    let metrics = server.metrics();
    assert_eq!(
        metric_value(
            &metrics,
            r#"bulkhead_generated_tokens_total{model="smollm2-test",tenant="beta"}"#
        ),
        8.0
    );
    assert_eq!(
        metric_value(
            &metrics,
            r#"bulkhead_prompt_tokens_total{model="smollm2-test",tenant="beta"}"#
        ),
        4.0
    );
    assert!(metrics.contains("bulkhead_time_to_first_token_seconds_bucket"));

    // The engine's steps, with their tokens and their time by phase; each
    // tenant's sampling time is its own (gamma sent nothing). Published
    // after each engine turn: wait for the one after the last request.
    let tokens = r#"bulkhead_engine_step_tokens_total{model="smollm2-test"}"#;
    // Alpha's prompt, beta's 4-token prompt and the 7 of its 8 tokens fed back.
    let least = (prompt + 4 + 7) as f64;
    assert!(eventually(Duration::from_secs(5), || server.metric(tokens) >= least));
    let metrics = server.metrics();
    let steps = r#"bulkhead_engine_steps_total{model="smollm2-test"}"#;
    assert!(metric_value(&metrics, steps) >= 9.0, "{metrics}");
    for phase in ["forward", "sampling"] {
        let time = format!(
            r#"bulkhead_engine_step_microseconds_total{{model="smollm2-test",phase="{phase}"}}"#
        );
        assert!(metric_value(&metrics, &time) > 0.0, "{time}: {metrics}");
    }
    let sampling = |tenant: &str| {
        let name = format!(
            r#"bulkhead_sampling_microseconds_total{{model="smollm2-test",tenant="{tenant}"}}"#
        );
        metric_value(&metrics, &name)
    };
    assert!(
        sampling("alpha") > 0.0 && sampling("beta") > 0.0,
        "{metrics}"
    );
    assert_eq!(sampling("gamma"), 0.0, "{metrics}");
}

#[test]
fn streams_follow_openai_sse_and_match_the_whole_answer() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let body = chat_body("What is the capital of France?", 16);
    let whole = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    let whole_text = whole["choices"][0]["message"]["content"].as_str().unwrap();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, mut sse) = server.stream("/v1/chat/completions", KEY_ALPHA, &streamed);
    assert_eq!(status, 200);
    let events = sse.rest();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|d| data_json(d))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text, whole_text,
        "greedy: the stream says what the body says"
    );
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]), "usage chunk has no choices");
    // The same prompt a second time: every full page but the one holding its
    // last token comes from alpha's prefix cache (16-token pages).
    let mut expected = whole["usage"].clone();
    assert_eq!(expected["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt_tokens = expected["prompt_tokens"].as_u64().unwrap();
    expected["prompt_tokens_details"]["cached_tokens"] = json!((prompt_tokens - 1) / 16 * 16);
    assert_eq!(usage["usage"], expected);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(
        finish["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert!(chunks[1..chunks.len() - 2]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // Completions stream, without usage.
    let (status, mut sse) = server.stream(
        "/v1/completions",
        KEY_BETA,
        &json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 6,
                "temperature": 0, "stream": true}),
    );
    assert_eq!(status, 200);
    let events = sse.rest();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|d| data_json(d))
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[test]
fn sampling_draws_a_fresh_seed_per_request_unless_one_is_given() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let text = |extra: Value| {
        let mut body = json!({
            "model": MODEL_ID,
            "prompt": "Once upon a time",
            "max_tokens": 24,
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    // The default temperature (1) with no seed: retries are new samples.
    // Four 24-token samples at temperature 1 all equal would be a repeat,
    // not chance.
    let free: BTreeSet<String> = (0..4).map(|_| text(json!({}))).collect();
    assert!(
        free.len() > 1,
        "four unseeded samples were one text: {free:?}"
    );
    // A given seed reproduces its text; so does temperature 0.
    assert_eq!(text(json!({"seed": 7})), text(json!({"seed": 7})));
    assert_eq!(
        text(json!({"temperature": 0})),
        text(json!({"temperature": 0}))
    );
}

/// The model's token ids of `text` (`bulkhead tokenize`; special-token
/// text as special tokens where `special`).
fn tokenize(model: &std::path::Path, text: &str, special: bool) -> Vec<u64> {
    let mut command = Command::new(bulkhead_exe());
    command
        .arg("tokenize")
        .arg("--model")
        .arg(model)
        .args(["--text", text]);
    if special {
        command.arg("--parse-special");
    }
    let out = command.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice::<Vec<u64>>(&out.stdout).unwrap()
}

fn token_ids(model: &std::path::Path, text: &str) -> Vec<u64> {
    tokenize(model, text, false)
}

/// The chat template's end-of-turn token (an end-of-generation token).
fn end_of_turn(model: &std::path::Path) -> u64 {
    let ids = tokenize(model, "<|im_end|>", true);
    assert_eq!(ids.len(), 1, "{ids:?}");
    ids[0]
}

#[test]
fn logit_bias_and_penalties_reach_the_sampler_and_bad_ones_are_refused() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let bang = token_ids(&model, "!");
    assert_eq!(bang.len(), 1, "{bang:?}");
    let bang = bang[0];
    let completion = |extra: Value| {
        let mut body = json!({
            "model": MODEL_ID,
            "prompt": "The capital of France is",
            "max_tokens": 48,
            "temperature": 0,
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let free = completion(json!({}));
    let forced = json!({ bang.to_string(): 100 });
    // +100 outweighs every logit the model has: every token is "!".
    assert_eq!(completion(json!({"logit_bias": forced})), "!".repeat(48));
    // -100 on the greedy text's first token: another text.
    let first = token_ids(&model, &free)[0];
    let banned = completion(json!({"logit_bias": {first.to_string(): -100}}));
    assert_ne!(banned, free);
    // A frequency penalty of 2 takes 2 off "!" per time it was generated:
    // its +100 is spent after 50, and within 128 tokens it loses whatever
    // lead the model's own logits gave it (far less than 28), so the text
    // starts with "!" but is no longer "!" alone. A presence penalty takes 2
    // once, which 100 outweighs.
    let penalized = completion(json!({
        "logit_bias": forced, "frequency_penalty": 2, "max_tokens": 128,
    }));
    assert!(penalized.starts_with(&"!".repeat(10)), "{penalized:?}");
    assert!(penalized.chars().any(|c| c != '!'), "{penalized:?}");
    assert_eq!(
        completion(json!({"logit_bias": forced, "presence_penalty": 2})),
        "!".repeat(48)
    );
    // ignore_eos: the end forced first, and still max_tokens of it (no text).
    let end = end_of_turn(&model);
    for (ignore_eos, tokens, reason) in [(false, 0, "stop"), (true, 12, "length")] {
        let mut body = chat_body("hi", 12);
        body["logit_bias"] = json!({ end.to_string(): 100 });
        body["ignore_eos"] = json!(ignore_eos);
        let v = server
            .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
            .json();
        assert_eq!(v["choices"][0]["finish_reason"], reason, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], tokens, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], "", "{v}");
    }
    // min_p 1 at temperature 2 is greedy; repetition_penalty changes the text.
    let greedy = completion(json!({}));
    assert_eq!(
        completion(json!({"temperature": 2, "min_p": 1, "seed": 3})),
        greedy
    );
    assert_ne!(completion(json!({"repetition_penalty": 1.5})), greedy);
    // Ids past the vocabulary, and out-of-range values, are 400s naming them.
    for (extra, param) in [
        (json!({"logit_bias": {"49152": 1}}), "logit_bias"),
        (json!({"logit_bias": {"1": 101}}), "logit_bias"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
        (json!({"min_p": -0.1}), "min_p"),
        (json!({"repetition_penalty": 3}), "repetition_penalty"),
    ] {
        chat_refused(&server, &extra, param);
    }
}

/// Alpha's short chat with `extra`'s fields is a 400 naming `param`.
fn chat_refused(server: &Server, extra: &Value, param: &str) {
    let mut body = chat_body("hi", 4);
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(r.status, 400, "{extra}: {}", r.body);
    assert_eq!(r.error().0, param, "{extra}: {}", r.body);
}

#[test]
fn stop_token_ids_end_the_output_and_min_tokens_holds_every_end_back() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let bang = token_ids(&model, "!");
    assert_eq!(bang.len(), 1, "{bang:?}");
    let bang = bang[0];
    // Every token is "!" unless something withholds it.
    let forced = json!({ bang.to_string(): 100 });
    let completion = |extra: Value| {
        let mut body = json!({
            "model": MODEL_ID,
            "prompt": "The capital of France is",
            "max_tokens": 12,
            "temperature": 0,
            "logit_bias": forced,
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let choice = &v["choices"][0];
        (
            choice["text"].as_str().unwrap().to_string(),
            choice["finish_reason"].as_str().unwrap().to_string(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        )
    };
    assert_eq!(completion(json!({})), ("!".repeat(12), "length".into(), 12));
    // A stop token ends the output as an end of generation does: not shown,
    // not counted.
    assert_eq!(
        completion(json!({"stop_token_ids": [bang]})),
        (String::new(), "stop".into(), 0)
    );
    // min_tokens: the stop token is withheld from the first 3, then ends it.
    let (text, reason, tokens) = completion(json!({"stop_token_ids": [bang], "min_tokens": 3}));
    assert_eq!((reason.as_str(), tokens), ("stop", 3), "{text:?}");
    assert!(!text.is_empty() && !text.contains('!'), "{text:?}");
    // A stop sequence is looked for from the min_tokens-th token's text on.
    assert_eq!(
        completion(json!({"stop": ["!"]})),
        (String::new(), "stop".into(), 1)
    );
    assert_eq!(
        completion(json!({"stop": ["!"], "min_tokens": 3})),
        ("!!".into(), "stop".into(), 3)
    );
    // The end of generation, forced, is withheld as long.
    let end = end_of_turn(&model);
    let mut body = chat_body("hi", 12);
    body["logit_bias"] = json!({ end.to_string(): 100 });
    body["min_tokens"] = json!(5);
    let v = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    // Ids past the vocabulary, min_tokens past max_tokens or with JSON mode:
    // 400s naming them.
    for (extra, param) in [
        (json!({"stop_token_ids": [1, 49152]}), "stop_token_ids"),
        (json!({"min_tokens": 5}), "min_tokens"),
        (
            json!({"min_tokens": 1, "response_format": {"type": "json_object"}}),
            "min_tokens",
        ),
    ] {
        chat_refused(&server, &extra, param);
    }
}

#[test]
fn tokenize_counts_what_the_completion_endpoints_would_and_detokenize_reads_it_back() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let text = "The capital of France is Paris.";
    let r = server.post_json(
        "/tokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": text}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.request_id.is_some(), "{r:?}");
    let v = r.json();
    let tokens: Vec<u64> = serde_json::from_value(v["tokens"].clone()).unwrap();
    // The CLI's tokenizer, the same ids.
    assert_eq!(tokens, token_ids(&model, text));
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], 1024);
    let r = server.post_json(
        "/detokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "tokens": tokens}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["prompt"], text);
    // A conversation: as many tokens as the chat endpoint reports for it.
    let body = chat_body("What is 2 + 2?", 1);
    let counted = server.post_json(
        "/tokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "messages": body["messages"]}),
    );
    assert_eq!(counted.status, 200, "{}", counted.body);
    let chat = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    assert_eq!(
        counted.json()["count"],
        chat["usage"]["prompt_tokens"],
        "{chat}"
    );
    // With tools and an earlier call and its result: as the chat counts them.
    let mut body = chat_body("What is the weather in Oslo?", 1);
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
               "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c", "content": "rain"}),
    ]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let with_tools = server.post_json(
        "/tokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "messages": body["messages"], "tools": tools}),
    );
    assert_eq!(with_tools.status, 200, "{}", with_tools.body);
    body["tools"] = tools.clone();
    body["tool_choice"] = json!("none");
    let chat = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    assert_eq!(
        with_tools.json()["count"],
        chat["usage"]["prompt_tokens"],
        "{chat}"
    );
    let r = server.post_json(
        "/tokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "hi", "tools": tools}),
    );
    assert_eq!((r.status, r.error().0), (400, json!("tools")), "{}", r.body);
    // The template's text, special tokens and all, read back.
    let ids = counted.json()["tokens"].clone();
    let r = server.post_json(
        "/detokenize",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "tokens": ids}),
    );
    let rendered = r.json()["prompt"].as_str().unwrap().to_string();
    assert!(
        rendered.contains("<|im_start|>user\nWhat is 2 + 2?<|im_end|>"),
        "{rendered:?}"
    );
    // As a completion would be refused: too long for the context, a model
    // the tenant may not use (none here), ids past the vocabulary, no key.
    for (path, key, body, status, param, code) in [
        (
            "/tokenize",
            Some(KEY_ALPHA),
            json!({"model": MODEL_ID, "prompt": "hello ".repeat(1500)}),
            400,
            json!("prompt"),
            json!("context_length_exceeded"),
        ),
        (
            "/tokenize",
            Some(KEY_ALPHA),
            json!({"model": "nope", "prompt": "hi"}),
            404,
            json!("model"),
            json!("model_not_found"),
        ),
        (
            "/tokenize",
            Some(KEY_ALPHA),
            json!({"model": MODEL_ID, "prompt": "hi", "messages": []}),
            400,
            json!("messages"),
            json!(null),
        ),
        (
            "/detokenize",
            Some(KEY_ALPHA),
            json!({"model": MODEL_ID, "tokens": [1, 49152]}),
            400,
            json!("tokens"),
            json!(null),
        ),
        (
            "/detokenize",
            Some(KEY_ALPHA),
            json!({"model": MODEL_ID, "tokens": vec![1; 1025]}),
            400,
            json!("tokens"),
            json!(null),
        ),
        (
            "/detokenize",
            None,
            json!({"model": MODEL_ID, "tokens": [1]}),
            401,
            json!(null),
            json!(null),
        ),
    ] {
        let r = server.post_json(path, key, &body);
        assert_eq!(r.status, status, "{path}: {}", r.body);
        let (got_param, got_code) = r.error();
        assert_eq!(got_param, param, "{path}: {}", r.body);
        if !code.is_null() {
            assert_eq!(got_code, code, "{path}: {}", r.body);
        }
    }
}

#[test]
fn n_choices_are_seeded_apart_streamed_by_index_and_summed_in_usage() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let completion = |n: u32, seed: u64| {
        let body = json!({
            "model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 12,
            "temperature": 1, "seed": seed, "n": n,
        });
        let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    // Choice i is what the request alone says with seed + i.
    let alone: Vec<Value> = (0..3).map(|i| completion(1, 40 + i)).collect();
    let three = completion(3, 40);
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{three}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i, "{three}");
        assert_eq!(choice["text"], alone[i]["choices"][0]["text"], "{three}");
        assert_eq!(
            choice["finish_reason"], alone[i]["choices"][0]["finish_reason"],
            "{three}"
        );
    }
    let texts: std::collections::HashSet<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(texts.len() > 1, "three seeds, one text: {three}");
    // The log names the other choices' ids under the request's.
    let id = three["id"].as_str().unwrap().strip_prefix("cmpl-").unwrap();
    assert_eq!(other_sequences_finished(&server, id), 2);
    // The prompt once, every choice's tokens.
    let generated: u64 = alone
        .iter()
        .map(|v| v["usage"]["completion_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(three["usage"]["completion_tokens"], generated, "{three}");
    assert_eq!(three["usage"]["prompt_tokens"], 4, "{three}");
    assert_eq!(three["usage"]["total_tokens"], generated + 4, "{three}");

    // Streamed: each choice's chunks carry its index, and say what the
    // whole response says; one usage chunk, then [DONE].
    let mut body = chat_body("Tell me a story.", 10);
    body["temperature"] = json!(1);
    body["seed"] = json!(7);
    body["n"] = json!(2);
    let whole = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, mut sse) = server.stream("/v1/chat/completions", KEY_ALPHA, &body);
    assert_eq!(status, 200);
    let events = sse.rest();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| data_json(e))
        .collect();
    let mut texts = [String::new(), String::new()];
    let (mut roles, mut finishes, mut usages) = (0, 0, Vec::new());
    for chunk in &chunks {
        if chunk["choices"].as_array().unwrap().is_empty() {
            usages.push(chunk["usage"].clone());
            continue;
        }
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        roles += usize::from(choice["delta"]["role"] == "assistant");
        finishes += usize::from(!choice["finish_reason"].is_null());
        if let Some(text) = choice["delta"]["content"].as_str() {
            texts[index].push_str(text);
        }
    }
    assert_eq!((roles, finishes), (2, 2), "{chunks:?}");
    for (i, text) in texts.iter().enumerate() {
        assert_eq!(
            whole["choices"][i]["message"]["content"], *text,
            "{whole} {chunks:?}"
        );
    }
    // (The stream's prompt was in the prefix cache: only that differs.)
    assert_eq!(usages.len(), 1, "{chunks:?}");
    for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usages[0][count], whole["usage"][count], "{chunks:?}");
    }
    // n is 1 to 16; and a tenant's queue limits count each choice: gamma,
    // whose queue holds one, cannot take three (a 400 that says so: no
    // retry would fit them), and is left able to run.
    for n in [0, 17] {
        let mut body = chat_body("hi", 4);
        body["n"] = json!(n);
        let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
        assert_eq!((r.status, r.error().0), (400, json!("n")), "{}", r.body);
    }
    let mut body = chat_body("hi", 4);
    body["n"] = json!(3);
    let r = server.post_json("/v1/chat/completions", Some(KEY_GAMMA), &body);
    assert_eq!((r.status, r.error().0), (400, json!("n")), "{}", r.body);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue holds 1"),
        "{}",
        r.body
    );
    body["n"] = json!(1);
    let r = server.post_json("/v1/chat/completions", Some(KEY_GAMMA), &body);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// How many other sequences the log's `choices` line of request `id` names,
/// each of which the log shows finished under its own id. The log is read
/// as the server writes it, and a choice's line may come after the answer:
/// each is waited for (5 s).
fn other_sequences_finished(server: &Server, id: &str) -> usize {
    let request = format!("\"request_id\":{id}");
    let listed = || {
        let lines = server.stderr_lines();
        let line = lines
            .iter()
            .find(|l| l.contains(&request) && l.contains("choice_ids"));
        line.cloned()
    };
    assert!(
        eventually(Duration::from_secs(5), || listed().is_some()),
        "a choices line"
    );
    let line: Value = serde_json::from_str(&listed().unwrap()).unwrap();
    let others: Vec<u64> =
        serde_json::from_str(line["fields"]["choice_ids"].as_str().unwrap()).unwrap();
    for other in &others {
        let id = format!("\"request_id\":{other}");
        let finished = || {
            let lines = server.stderr_lines();
            lines
                .iter()
                .any(|l| l.contains(&id) && l.contains("request finished"))
        };
        assert!(eventually(Duration::from_secs(5), finished), "{other}");
    }
    others.len()
}

/// Alpha's completion of `body`, answered 200.
fn completion_ok(server: &Server, body: &Value) -> Value {
    let r = server.post_json("/v1/completions", Some(KEY_ALPHA), body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// The chunks of alpha's streamed chat completion, up to `[DONE]`.
fn chat_chunks(server: &Server, body: &Value) -> Vec<Value> {
    chunks(server, "/v1/chat/completions", body)
}

/// The chunks of a streamed request to `path`, up to `[DONE]`.
fn chunks(server: &Server, path: &str, body: &Value) -> Vec<Value> {
    let (status, mut sse) = server.stream(path, KEY_ALPHA, body);
    assert_eq!(status, 200);
    sse.rest()
        .iter()
        .take_while(|data| *data != "[DONE]")
        .map(|data| data_json(data))
        .collect()
}

/// A chat logprobs entry's bytes.
fn bytes_of(entry: &Value) -> Vec<u8> {
    entry["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect()
}

#[test]
fn logprobs_follow_openais_shapes_streamed_or_not_and_are_the_models_own() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let mut body = chat_body("Name three primary colors.", 24);
    body["temperature"] = json!(0);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let whole = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let v = whole.json();
    let choice = &v["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap();
    let content = choice["logprobs"]["content"].as_array().unwrap().clone();
    // One entry per generated token (an end-of-generation token has none,
    // nor is it counted), whose bytes are the text.
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let bytes: Vec<u8> = content.iter().flat_map(bytes_of).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), text);
    for entry in &content {
        let logprob = entry["logprob"].as_f64().unwrap();
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let tops: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(tops.windows(2).all(|w| w[0] >= w[1]), "{entry}");
        assert!(tops.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-5);
        // Greedy: the token is the likeliest, with its own log probability.
        assert!(
            logprob <= 0.0 && (logprob - tops[0]).abs() < 1e-6,
            "{entry}"
        );
        assert_eq!(top[0]["bytes"], entry["bytes"], "{entry}");
    }
    // Streamed: the same entries, spread over the chunks.
    body["stream"] = json!(true);
    let streamed: Vec<Value> = chat_chunks(&server, &body)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(streamed.len(), content.len());
    for (a, b) in streamed.iter().zip(&content) {
        assert_eq!(a["bytes"], b["bytes"]);
        assert!((a["logprob"].as_f64().unwrap() - b["logprob"].as_f64().unwrap()).abs() < 1e-5);
    }
    // No token but the end (its bias forces it first): no entries, not null.
    let end = end_of_turn(&model);
    let mut ended = chat_body("hi", 8);
    ended["logprobs"] = json!(true);
    ended["logit_bias"] = json!({ end.to_string(): 100 });
    let v = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &ended)
        .json();
    assert_eq!(v["choices"][0]["message"]["content"], "", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"],
        json!({"content": [], "refusal": null})
    );
    // Without asking: null, as before.
    let plain = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &chat_body("hi", 4))
        .json();
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);

    // The legacy shape, and the model's own distribution: a token forced by
    // logit_bias is reported with the probability the model gave it.
    let bang = token_ids(&model, "!")[0];
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 6,
                "temperature": 0, "logprobs": 2, "logit_bias": {bang.to_string(): 100}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], "!!!!!!");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["!", "!", "!", "!", "!", "!"]));
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3, 4, 5]));
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!(first < -1.0, "\"!\" after this prompt is unlikely: {first}");
    // The chosen token and the likeliest two (three entries unless "!" is one).
    let top0 = lp["top_logprobs"][0].as_object().unwrap();
    assert!((2..=3).contains(&top0.len()), "{top0:?}");
    assert_eq!(top0["!"].as_f64().unwrap(), first);
}

#[test]
fn echo_scores_a_prompt_as_the_model_would_generate_it() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let post = |body: &Value| completion_ok(&server, body);
    // The greedy continuation of a context, and its log probability.
    let context = "The capital of France is";
    let v = post(
        &json!({"model": MODEL_ID, "prompt": context, "max_tokens": 1,
                         "temperature": 0, "logprobs": 1}),
    );
    let continuation = v["choices"][0]["text"].as_str().unwrap().to_string();
    let generated = v["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    let context_ids = token_ids(&model, context);
    let ids = token_ids(&model, &format!("{context}{continuation}"));
    assert_eq!(ids.len(), context_ids.len() + 1, "one token more: {ids:?}");
    assert_eq!(ids[..context_ids.len()], context_ids[..]);

    // lm-evaluation-harness's loglikelihood request, as it sends it: the
    // context and continuation as token ids in a batch of one, echo, one
    // token to generate, the chosen tokens' log probabilities.
    let v = post(
        &json!({"model": MODEL_ID, "prompt": [ids], "temperature": 0,
                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}),
    );
    let choice = &v["choices"][0];
    let lp = &choice["logprobs"];
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top_logprobs = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), ids.len() + 1, "{lp}");
    assert_eq!(token_logprobs[0], Value::Null);
    assert_eq!(top_logprobs[0], Value::Null);
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], 1);
    assert!(choice["text"]
        .as_str()
        .unwrap()
        .starts_with(&format!("{context}{continuation}")));
    // The harness's reading: the continuation's log probability (ctxlen to
    // -1) is the one generating it had, and it is greedy (the likeliest).
    let ctxlen = context_ids.len();
    let scored = token_logprobs[ctxlen].as_f64().unwrap();
    assert!(
        (scored - generated).abs() < 1e-4,
        "scored {scored}, generated {generated}"
    );
    let top = top_logprobs[ctxlen].as_object().unwrap();
    let best = top
        .values()
        .map(|l| l.as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert_eq!(scored, best, "{top:?}");
    for (i, logprob) in token_logprobs.iter().enumerate().skip(1) {
        let logprob = logprob.as_f64().unwrap();
        assert!(
            logprob <= 0.0 && logprob.is_finite(),
            "token {i}: {logprob}"
        );
    }

    // Nothing to generate: the prompt's text and its tokens' log
    // probabilities are the answer, streamed or whole, the same twice
    // (its pages in the prefix cache do not stand in for computing them).
    let body = json!({"model": MODEL_ID, "prompt": context, "max_tokens": 0,
                      "echo": true, "logprobs": 2});
    let v = post(&body);
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], context);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), context_ids.len());
    assert_eq!(tokens.concat(), context);
    let offsets: Vec<usize> = tokens
        .iter()
        .scan(0, |at, t| {
            let start = *at;
            *at += t.chars().count();
            Some(start)
        })
        .collect();
    assert_eq!(lp["text_offset"], json!(offsets));
    assert_eq!(
        lp["token_logprobs"].as_array().unwrap()[1..],
        token_logprobs[1..context_ids.len()]
    );
    assert_eq!(post(&body)["choices"][0]["logprobs"], *lp);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = chunks(&server, "/v1/completions", &streamed);
    assert_eq!(chunks[0]["choices"][0]["text"], context, "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["logprobs"], *lp);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    // Echo without logprobs: the text alone.
    let v = post(
        &json!({"model": MODEL_ID, "prompt": context, "max_tokens": 2,
                         "temperature": 0, "echo": true}),
    );
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with(&format!("{context}{continuation}")),
        "{text}"
    );

    // Refused: nothing to generate without echo, a batch of mixed prompts.
    for (body, param) in [
        (
            json!({"model": MODEL_ID, "prompt": context, "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"model": MODEL_ID, "prompt": [[1, 2], "a"], "echo": true}),
            "prompt",
        ),
        (json!({"model": MODEL_ID, "prompt": "a", "echo": 1}), "echo"),
    ] {
        let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
}

#[test]
fn a_batch_of_prompts_answers_each_prompts_choices_as_alone_in_order() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let post = |body: &Value| completion_ok(&server, body);
    let prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"];
    let body = |prompt: Value, n: u32, seed: u64| {
        json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 8,
               "temperature": 1, "seed": seed, "n": n})
    };
    // Choice i of prompt p is the answer's choice p * n + i, and what prompt
    // p alone says with seed + i.
    let batch = post(&body(json!(prompts), 2, 40));
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6, "{batch}");
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (p, prompt) in prompts.iter().enumerate() {
        for i in 0..2 {
            let alone = post(&body(json!(prompt), 1, 40 + i));
            let choice = &choices[p * 2 + i as usize];
            assert_eq!(choice["index"], p * 2 + i as usize, "{batch}");
            assert_eq!(
                choice["text"], alone["choices"][0]["text"],
                "{p} {i}: {batch}"
            );
            assert_eq!(
                choice["finish_reason"], alone["choices"][0]["finish_reason"],
                "{batch}"
            );
            completion_tokens += alone["usage"]["completion_tokens"].as_u64().unwrap();
            if i == 0 {
                prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
            }
        }
    }
    // Each prompt once, every choice's tokens.
    assert_eq!(batch["usage"]["prompt_tokens"], prompt_tokens, "{batch}");
    assert_eq!(batch["usage"]["completion_tokens"], completion_tokens);
    // Every sequence finished under its own id, the log naming the others.
    let id = batch["id"].as_str().unwrap().strip_prefix("cmpl-").unwrap();
    assert_eq!(other_sequences_finished(&server, id), 5);

    // Streamed: each chunk carries its sequence's index; the texts are the
    // whole answer's; one usage chunk, then [DONE].
    let mut streamed = body(json!(prompts), 2, 40);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = chunks(&server, "/v1/completions", &streamed);
    let mut texts = vec![String::new(); 6];
    let mut usages = Vec::new();
    for chunk in &chunks {
        match chunk["choices"].as_array().unwrap().first() {
            None => usages.push(chunk["usage"].clone()),
            Some(choice) => {
                let index = choice["index"].as_u64().unwrap() as usize;
                texts[index].push_str(choice["text"].as_str().unwrap());
            }
        }
    }
    for (i, text) in texts.iter().enumerate() {
        assert_eq!(choices[i]["text"], *text, "{i}: {chunks:?}");
    }
    assert_eq!(usages.len(), 1, "{chunks:?}");
    assert_eq!(usages[0]["prompt_tokens"], prompt_tokens);
    assert_eq!(usages[0]["completion_tokens"], completion_tokens);

    // lm-evaluation-harness at batch size > 1: token-id prompts, echo, one
    // token to generate; each choice scores its own prompt exactly as a
    // request of that prompt alone does.
    let contexts = [
        "The capital of France is Paris",
        "The sky is blue",
        "Water is",
    ];
    let ids: Vec<Vec<u64>> = contexts.iter().map(|c| token_ids(&model, c)).collect();
    let scored = |prompt: Value| {
        post(
            &json!({"model": MODEL_ID, "prompt": prompt, "temperature": 0,
                     "max_tokens": 1, "logprobs": 1, "echo": true}),
        )
    };
    let batch = scored(json!(ids));
    for (p, ids) in ids.iter().enumerate() {
        let alone = scored(json!([ids]));
        let choice = &batch["choices"][p];
        assert_eq!(choice["index"], p);
        assert_eq!(choice["logprobs"], alone["choices"][0]["logprobs"], "{p}");
        assert_eq!(choice["text"], alone["choices"][0]["text"], "{p}");
        assert!(choice["text"].as_str().unwrap().starts_with(contexts[p]));
        let entries = choice["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(entries.len(), ids.len() + 1, "{p}");
    }
    let summed: usize = ids.iter().map(Vec::len).sum();
    assert_eq!(batch["usage"]["prompt_tokens"], summed);
    assert_eq!(batch["usage"]["completion_tokens"], 3);

    // Refused, and nothing of the batch runs: a prompt past the context
    // (the last of three), too many sequences, mixed prompts, and more
    // sequences than the tenant's queue holds (gamma's holds one).
    let enqueued = format!(r#"bulkhead_enqueued_total{{model="{MODEL_ID}",tenant="alpha"}}"#);
    let before = metric_value(&server.metrics(), &enqueued);
    let long = "hi ".repeat(3000);
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": ["a", "b", long], "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        r.error(),
        (json!("prompt"), json!("context_length_exceeded"))
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("the prompt at index 2 of the batch: "),
        "{}",
        r.body
    );
    for (key, body, param) in [
        (KEY_ALPHA, json!({"prompt": vec!["a"; 65]}), "prompt"),
        (
            KEY_ALPHA,
            json!({"prompt": vec!["a"; 17], "n": 4}),
            "prompt",
        ),
        (KEY_ALPHA, json!({"prompt": ["a", [1]]}), "prompt"),
        (KEY_GAMMA, json!({"prompt": ["a", "b"]}), "prompt"),
    ] {
        let mut body = body;
        body["model"] = json!(MODEL_ID);
        body["max_tokens"] = json!(2);
        let r = server.post_json("/v1/completions", Some(key), &body);
        assert_eq!((r.status, r.error().0), (400, json!(param)), "{}", r.body);
    }
    assert_eq!(metric_value(&server.metrics(), &enqueued), before);
}

#[test]
fn json_mode_answers_a_json_object_streamed_or_not() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let prompt = "Describe a cat in JSON, with its name, age and color.";
    for (temperature, seed) in [(0.0, 1), (1.0, 7)] {
        let mut body = chat_body(prompt, 256);
        body["temperature"] = json!(temperature);
        body["seed"] = json!(seed);
        body["response_format"] = json!({"type": "json_object"});
        let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        // Closed well before the limit, and ended there.
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text:?}");
        let object: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(object.is_object(), "{text:?}");
        body["stream"] = json!(true);
        let streamed: String = chat_chunks(&server, &body)
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed, text);
    }
    // Without it the same prompt is free text, which is no JSON object.
    let free = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &{
            let mut body = chat_body(prompt, 64);
            body["temperature"] = json!(0);
            body
        })
        .json();
    let free = free["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<serde_json::Map<String, Value>>(free).is_err(),
        "{free:?}"
    );
}

/// A streamed answer's tool calls put together: `(id, name, arguments)`.
fn streamed_calls(chunks: &[Value]) -> Vec<(String, String, String)> {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for chunk in chunks {
        let delta = &chunk["choices"][0]["delta"];
        for entry in delta["tool_calls"].as_array().into_iter().flatten() {
            let k = entry["index"].as_u64().unwrap() as usize;
            if let Some(id) = entry["id"].as_str() {
                assert_eq!(k, calls.len(), "{entry}");
                assert_eq!(entry["type"], "function");
                let name = entry["function"]["name"].as_str().unwrap();
                calls.push((id.into(), name.into(), String::new()));
            }
            calls[k]
                .2
                .push_str(entry["function"]["arguments"].as_str().unwrap());
        }
    }
    calls
}

#[test]
fn tools_required_or_named_answer_with_calls_of_their_schemas_whole_and_streamed() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let tools = json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "additionalProperties": false,
                "properties": {"city": {"type": "string", "maxLength": 24},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "The time in a time zone.",
            "parameters": {"type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 24}},
                "required": ["zone"]}}}
    ]);
    // Each call's arguments are an instance of its tool's parameters.
    let check = |name: &str, arguments: &str| {
        let a: Value =
            serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments}"));
        let keys: Vec<&str> = a.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        match name {
            "get_weather" => {
                assert_eq!(keys, ["city", "unit"], "{arguments}");
                assert!(a["city"].as_str().is_some_and(|c| c.chars().count() <= 24));
                assert!(["celsius", "fahrenheit"].contains(&a["unit"].as_str().unwrap()));
            }
            "get_time" => {
                assert_eq!(keys, ["zone"], "{arguments}");
                assert!(a["zone"].is_string());
            }
            other => panic!("a call of {other:?}"),
        }
    };
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    for (choice, parallel, temperature, seed) in [
        (json!("required"), true, 0.0, 1),
        (json!("required"), false, 1.0, 7),
        (named.clone(), true, 1.0, 3),
    ] {
        let mut body = chat_body("What is the weather in Paris right now?", 160);
        body["tools"] = tools.clone();
        body["tool_choice"] = choice.clone();
        body["parallel_tool_calls"] = json!(parallel);
        body["temperature"] = json!(temperature);
        body["seed"] = json!(seed);
        let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let answer = &v["choices"][0];
        assert_eq!(answer["finish_reason"], "tool_calls", "{answer}");
        assert!(answer["message"]["content"].is_null(), "{answer}");
        let whole: Vec<(String, String, String)> = answer["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                assert_eq!(c["type"], "function");
                (
                    c["id"].as_str().unwrap().to_string(),
                    c["function"]["name"].as_str().unwrap().to_string(),
                    c["function"]["arguments"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert!(!whole.is_empty(), "{answer}");
        if !parallel || choice == named {
            assert_eq!(whole.len(), 1, "{answer}");
        }
        for (id, name, arguments) in &whole {
            assert!(id.starts_with("call_"), "{id}");
            if choice == named {
                assert_eq!(name, "get_time");
            }
            check(name, arguments);
        }
        // Streamed: the same calls, the name first, the arguments as made.
        body["stream"] = json!(true);
        let chunks = chat_chunks(&server, &body);
        let streamed = streamed_calls(&chunks);
        let names = |calls: &[(String, String, String)]| {
            calls
                .iter()
                .map(|c| (c.1.clone(), c.2.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&streamed), names(&whole));
        assert!(
            chunks.len() > streamed.len() + 2,
            "arguments come in pieces"
        );
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
        assert!(chunks.iter().all(|c| c["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("")
            .is_empty()));
    }
    // The conversation goes on with the call's result; "none" answers in text.
    let call = json!({"id": "call_x", "type": "function",
                      "function": {"name": "get_weather",
                                   "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}});
    let mut body = chat_body("What is the weather in Paris right now?", 24);
    body["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": null, "tool_calls": [call]}),
        json!({"role": "tool", "tool_call_id": "call_x", "content": "18 degrees, sunny"}),
    ]);
    body["tools"] = tools.clone();
    body["tool_choice"] = json!("none");
    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let answer = &r.json()["choices"][0];
    assert!(answer["message"]["content"].is_string(), "{answer}");
    assert!(answer["message"].get("tool_calls").is_none(), "{answer}");
    assert_ne!(answer["finish_reason"], "tool_calls");
    // Refused, naming the field: "auto" (the default with tools), a tool
    // result that answers no call, parameters the engine would not enforce.
    chat_refused(&server, &json!({"tools": tools}), "tool_choice");
    chat_refused(
        &server,
        &json!({"messages": [{"role": "user", "content": "hi"},
                             {"role": "tool", "tool_call_id": "nope", "content": "x"}]}),
        "messages[1].tool_call_id",
    );
    chat_refused(
        &server,
        &json!({"tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object",
                "properties": {"n": {"type": "array", "uniqueItems": true}}}}}]}),
        "tools[0].function.parameters",
    );
}

#[test]
fn structured_output_answers_an_instance_of_the_schema_or_one_of_the_choices() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    // What pydantic and the OpenAI client send for a model with an enum, a
    // bounded list, a nested optional model (a $ref), an integer and a
    // number with bounds (pydantic's ge, le, gt), and a string with a
    // pattern.
    let schema = json!({
        "$defs": {"Owner": {"properties": {"name": {"type": "string", "maxLength": 12}},
                            "required": ["name"], "type": "object", "additionalProperties": false}},
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "weight_kg": {"type": "number", "exclusiveMinimum": 0, "maximum": 12.5},
            "chip": {"type": "string", "pattern": "^[A-Z]{2}-\\d{4}$"},
            "born": {"type": "string", "format": "date"},
            "color": {"enum": ["black", "white", "orange", "grey"], "type": "string"},
            "toys": {"items": {"type": "string", "maxLength": 16}, "maxItems": 3, "type": "array"},
            "owner": {"anyOf": [{"$ref": "#/$defs/Owner"}, {"type": "null"}]}
        },
        "required": ["name", "age", "weight_kg", "chip", "born", "color", "toys", "owner"],
        "title": "Cat", "type": "object", "additionalProperties": false
    });
    let format = json!({"type": "json_schema",
                        "json_schema": {"name": "Cat", "strict": true, "schema": schema}});
    let prompt = "Describe a cat in JSON.";
    for (temperature, seed) in [(0.0, 1), (1.0, 7), (1.0, 8)] {
        let mut body = chat_body(prompt, 200);
        body["temperature"] = json!(temperature);
        body["seed"] = json!(seed);
        body["response_format"] = format.clone();
        let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text:?}");
        let cat: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        // Every property, in the schema's order, of its type, and no other.
        let keys: Vec<&str> = cat
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(
            keys,
            [
                "name",
                "age",
                "weight_kg",
                "chip",
                "born",
                "color",
                "toys",
                "owner"
            ],
            "{text}"
        );
        assert!(
            cat["name"]
                .as_str()
                .is_some_and(|n| n.chars().count() <= 20),
            "{text}"
        );
        assert!(
            cat["age"].as_i64().is_some_and(|a| (0..=30).contains(&a)),
            "{text}"
        );
        assert!(
            cat["weight_kg"]
                .as_f64()
                .is_some_and(|w| w > 0.0 && w <= 12.5),
            "{text}"
        );
        let chip = cat["chip"].as_str().unwrap_or("").as_bytes();
        assert!(
            chip.len() == 7
                && chip[..2].iter().all(u8::is_ascii_uppercase)
                && chip[2] == b'-'
                && chip[3..].iter().all(u8::is_ascii_digit),
            "{text}"
        );
        // A date (format "date"): a year from 1000, a month, a day it has.
        let born: Vec<u32> = cat["born"]
            .as_str()
            .unwrap_or("")
            .split('-')
            .map(|part| part.parse().unwrap_or(0))
            .collect();
        assert!(
            matches!(born[..], [y, m, d] if (1000..=9999).contains(&y) && (1..=12).contains(&m)
                && (1..=[31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][m as usize - 1]).contains(&d)),
            "{text}"
        );
        assert!(
            ["black", "white", "orange", "grey"].contains(&cat["color"].as_str().unwrap_or("")),
            "{text}"
        );
        let toys = cat["toys"].as_array().unwrap();
        assert!(
            toys.len() <= 3 && toys.iter().all(|t| t.is_string()),
            "{text}"
        );
        let owner = &cat["owner"];
        assert!(
            owner.is_null()
                || owner
                    .as_object()
                    .is_some_and(|o| o.len() == 1 && o["name"].is_string()),
            "{text}"
        );
        body["stream"] = json!(true);
        let streamed: String = chat_chunks(&server, &body)
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed, text);
    }
    // A schema the engine would not enforce is refused before anything
    // runs, naming the keyword; so is one that refers outside itself.
    for (document, says) in [
        (
            json!({"type": "array", "uniqueItems": true}),
            "\"uniqueItems\"",
        ),
        (
            json!({"type": "string", "pattern": "^(?!x)"}),
            "look-around",
        ),
        (
            json!({"$ref": "https://example.com/cat.json"}),
            "within the schema",
        ),
    ] {
        let extra = json!({"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": document}}});
        chat_refused(&server, &extra, "response_format");
        let mut body = chat_body("hi", 4);
        body["response_format"] = extra["response_format"].clone();
        let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(says), "{message}");
    }
    // vLLM's choice: exactly one of the texts, as written, on either endpoint
    // (and its older guided_choice).
    let labels = ["positive", "negative", "neutral"];
    let mut body = chat_body("Classify the sentiment: I love this phone!", 16);
    body["temperature"] = json!(0);
    body["structured_outputs"] = json!({ "choice": labels });
    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let label = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(labels.contains(&label), "{label:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "The sky is", "max_tokens": 16, "temperature": 1,
                "seed": 3, "guided_choice": labels}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(labels.contains(&text.as_str()), "{text:?}");
    // vLLM's regex: a text it matches whole, as written (and its older
    // guided_regex); it ends where nothing may follow.
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "Call us today at", "max_tokens": 24,
                "temperature": 1, "seed": 5,
                "structured_outputs": {"regex": " \\(\\d{3}\\) \\d{3}-\\d{4}"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let phone = v["choices"][0]["text"].as_str().unwrap().as_bytes();
    let digits = |b: &[u8]| b.iter().all(u8::is_ascii_digit);
    assert!(
        phone.len() == 15
            && phone[..2] == *b" ("
            && digits(&phone[2..5])
            && phone[5..7] == *b") "
            && digits(&phone[7..10])
            && phone[10] == b'-'
            && digits(&phone[11..]),
        "{:?}",
        String::from_utf8_lossy(phone)
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut body = chat_body("Is the sky blue? Say yes or no, then why.", 24);
    body["temperature"] = json!(0);
    body["guided_regex"] = json!("(Yes|No)[,.] [a-z ]{1,30}");
    let r = server.post_json("/v1/chat/completions", Some(KEY_ALPHA), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    let rest = answer
        .strip_prefix("Yes")
        .or_else(|| answer.strip_prefix("No"))
        .unwrap_or_else(|| panic!("{answer:?}"));
    assert!(
        (rest.starts_with(", ") || rest.starts_with(". "))
            && (3..=32).contains(&rest.len())
            && rest[2..]
                .bytes()
                .all(|b| b == b' ' || b.is_ascii_lowercase()),
        "{answer:?}"
    );
    // A regex no text of printable ASCII matches is refused, naming it.
    chat_refused(
        &server,
        &json!({"guided_regex": "[^\\x00-\\x7F]+"}),
        "guided_regex",
    );
    // A top-level enum ends with its value (on the completions endpoint too).
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "Is the sky blue? Answer:", "max_tokens": 16,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema":
                    {"name": "answer", "schema": {"enum": ["yes", "no"]}}}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    // (Whitespace may come before a value, as JSON allows.)
    let text = v["choices"][0]["text"].as_str().unwrap().trim_start();
    assert!(text == "\"yes\"" || text == "\"no\"", "{text:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn logs_are_text_for_a_person_or_json_and_busy_models_log_a_summary() {
    let Some(model) = smollm2() else { return };
    let policy = Policy {
        server_toml: "summary_interval_ms = 200\n".into(),
        ..Policy::default()
    };
    let request = |server: &Server| {
        let r = server.post_json(
            "/v1/chat/completions",
            Some(KEY_ALPHA),
            &chat_body("Hi", 48),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    };
    // JSON (stderr is a pipe here), with the summary line of a busy model.
    let server = start(&model, &policy);
    request(&server);
    let summary = |server: &Server| {
        server
            .stderr_lines()
            .into_iter()
            .find(|l| l.contains("kv_pages_used") && l.contains("generation_tokens_per_s"))
    };
    assert!(eventually(Duration::from_secs(5), || summary(&server).is_some()));
    let line = summary(&server).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["fields"]["message"], "engine", "{line}");
    assert_eq!(v["fields"]["model"], MODEL_ID, "{line}");
    drop(server);
    // Text when asked: no JSON lines, the same facts.
    let server = launch(Launch::new(&model, &policy).arg("--log-format").arg("text"));
    request(&server);
    assert!(eventually(Duration::from_secs(5), || summary(&server).is_some()));
    assert!(server.logged("request finished"));
    let lines = server.stderr_lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" INFO ") && l.contains("request finished")),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l.starts_with('{')), "{lines:?}");
    assert!(
        !lines.iter().any(|l| l.contains('\u{1b}')),
        "no colours into a pipe"
    );
}

#[test]
fn stop_sequences_end_the_text_before_the_stop() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let body = chat_body("Count from 1 to 10, separated by commas.", 40);
    let free = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &body)
        .json();
    let free_text = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(free_text.contains('4'), "{free_text:?}");
    let mut stopped = body.clone();
    stopped["stop"] = json!(["4"]);
    let v = server
        .post_json("/v1/chat/completions", Some(KEY_ALPHA), &stopped)
        .json();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!text.contains('4'), "{text:?}");
    assert!(free_text.starts_with(text), "{text:?} vs {free_text:?}");
}

#[test]
fn client_errors_are_openai_shaped_and_name_the_parameter() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let chat = "/v1/chat/completions";
    let ok = chat_body("hi", 4);

    let r = server.post_json(chat, None, &ok);
    assert_eq!((r.status, r.error().1), (401, json!("invalid_api_key")));
    let r = server.post_json(chat, Some("not-a-key-0123456789abcdef"), &ok);
    assert_eq!(r.status, 401);
    let r = server.get(&server.inference, "/v1/models", None);
    assert_eq!(r.status, 401);

    let mut wrong_model = ok.clone();
    wrong_model["model"] = json!("gpt-4");
    let r = server.post_json(chat, Some(KEY_ALPHA), &wrong_model);
    assert_eq!((r.status, r.error().1), (404, json!("model_not_found")));

    for body in [
        &b"{not json"[..],
        b"[1,2]",
        b"",
        b"{\"model\":\"\xff\xfe\"}",
    ] {
        let r = server.post(chat, Some(KEY_ALPHA), body);
        assert_eq!(
            (r.status, r.error().1),
            (400, json!("invalid_json")),
            "{body:?}"
        );
    }
    for (field, value, param) in [
        ("max_tokens", json!("ten"), "max_tokens"),
        ("temperature", json!(5), "temperature"),
        ("n", json!(17), "n"),
        (
            "tools",
            json!({"type": "function", "function": {"name": "f"}}),
            "tools",
        ),
        ("top_logprobs", json!(21), "top_logprobs"),
        (
            "response_format",
            json!({"type": "json_schema"}),
            "response_format",
        ),
        ("stop", json!(["a", "b", "c", "d", "e"]), "stop"),
        ("frobnicate", json!(1), "frobnicate"),
        ("messages", json!("hello"), "messages"),
    ] {
        let mut body = ok.clone();
        body[field] = value;
        let r = server.post_json(chat, Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 400, "{field}: {}", r.body);
        assert_eq!(r.error().0, json!(param), "{field}: {}", r.body);
    }
    // Harmless fields clients send are accepted.
    let mut body = ok.clone();
    for (k, v) in [
        ("n", json!(1)),
        ("logprobs", json!(false)),
        ("user", json!("u")),
    ] {
        body[k] = v;
    }
    assert_eq!(server.post_json(chat, Some(KEY_ALPHA), &body).status, 200);

    // Over server.body_bytes_max (32 KiB here).
    let mut big = ok.clone();
    big["messages"][0]["content"] = json!("x".repeat(40_000));
    let r = server.post_json(chat, Some(KEY_ALPHA), &big);
    assert_eq!((r.status, r.error().1), (413, json!("request_too_large")));

    let r = server.get(&server.inference, "/v2/nothing", Some(KEY_ALPHA));
    assert_eq!(r.status, 404);
    r.error();

    // The metrics listener is the admin one; the capacity table needs the token.
    assert_eq!(server.get(&server.inference, "/metrics", None).status, 404);
    assert_eq!(
        server.get(&server.admin, "/admin/v1/capacity", None).status,
        401
    );
    let r = server.get(&server.admin, "/admin/v1/capacity", Some(ADMIN_TOKEN));
    assert_eq!(r.status, 200);
    let model = &r.json()["data"][0];
    assert_eq!(model["model"], MODEL_ID);
    assert_eq!(model["promised_tokens"], 1024);
    assert_eq!(model["ok"], true);

    assert!(
        server.metric(r#"bulkhead_rejections_total{tenant="none",reason="invalid_api_key"}"#)
            >= 2.0
    );
}

#[test]
fn context_length_exceeded_is_refused_before_any_queue_or_page_is_touched() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let chat = "/v1/chat/completions";
    // A request that runs, so the cumulative counters are non-zero.
    assert_eq!(
        server
            .post_json(chat, Some(KEY_ALPHA), &chat_body("hi", 4))
            .status,
        200
    );
    let enqueued = r#"bulkhead_enqueued_total{model="smollm2-test",tenant="alpha"}"#;
    let acquired = r#"bulkhead_kv_pages_acquired_total{model="smollm2-test",tenant="alpha"}"#;
    let owned = r#"bulkhead_kv_pages{model="smollm2-test",tenant="alpha",state="owned"}"#;
    let rejected = r#"bulkhead_rejections_total{tenant="alpha",reason="context_length_exceeded"}"#;
    // The engine publishes its counts after each loop turn: wait for the one
    // after that request finished.
    assert!(eventually(Duration::from_secs(5), || server.metric(owned) == 0.0));
    let before = server.metrics();
    assert_eq!(metric_value(&before, enqueued), 1.0);
    assert!(metric_value(&before, acquired) >= 1.0);

    for body in [
        // A huge max_tokens.
        chat_body("hi", 100_000_000),
        // A prompt longer than the 1024-token context.
        chat_body(&"hello ".repeat(1500), 4),
        // Fits the context alone, not with max_tokens.
        chat_body(&"hello ".repeat(900), 200),
    ] {
        let r = server.post_json(chat, Some(KEY_ALPHA), &body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error().1, json!("context_length_exceeded"));
        assert_eq!(r.error().0, json!("messages"));
    }
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "hi ".repeat(2000)}),
    );
    assert_eq!(r.error().1, json!("context_length_exceeded"));

    let after = server.metrics();
    for counter in [enqueued, acquired, owned] {
        assert_eq!(
            metric_value(&before, counter),
            metric_value(&after, counter),
            "{counter} moved"
        );
    }
    assert_eq!(metric_value(&after, rejected), 4.0);
}

/// Gamma (running_max 1, queue_depth_max 1) with one long stream running
/// (its first text has come) and a second one waiting in its queue.
fn gamma_running_and_queued(server: &Server) -> (SseReader, SseReader) {
    let mut long = chat_body("Write a long story about a dragon.", 400);
    long["stream"] = json!(true);
    let (status, mut running) = server.stream("/v1/chat/completions", KEY_GAMMA, &long);
    assert_eq!(status, 200);
    running.next_data().unwrap(); // role chunk
    running.next_data().unwrap(); // first text: it runs
    let (status, queued) = server.stream("/v1/chat/completions", KEY_GAMMA, &long);
    assert_eq!(status, 200, "the second waits in the queue");
    (running, queued)
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let (_running, _queued) = gamma_running_and_queued(&server);
    let r = server.post_json("/v1/chat/completions", Some(KEY_GAMMA), &chat_body("hi", 4));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.error().1, json!("queue_full"));
    assert_eq!(r.retry_after.as_deref(), Some("1"));
    // Other tenants are not affected.
    assert_eq!(
        server
            .post_json("/v1/chat/completions", Some(KEY_BETA), &chat_body("hi", 4))
            .status,
        200
    );
}

#[test]
fn a_client_disconnect_mid_stream_cancels_and_frees_pages() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let owned = r#"bulkhead_kv_pages{model="smollm2-test",tenant="beta",state="owned"}"#;
    let mut body = chat_body("Write a long story about a dragon.", 500);
    body["stream"] = json!(true);
    let (status, mut sse) = server.stream("/v1/chat/completions", KEY_BETA, &body);
    assert_eq!(status, 200);
    for _ in 0..3 {
        sse.next_data().unwrap();
    }
    assert!(
        server.metric(owned) > 0.0,
        "the running request holds pages"
    );
    drop(sse);
    assert!(
        eventually(Duration::from_secs(10), || server.metric(owned) == 0.0),
        "pages released after the disconnect"
    );
    assert!(eventually(Duration::from_secs(5), || {
        server.metric(r#"bulkhead_kv_pages{model="smollm2-test",tenant="beta",state="released"}"#)
            == 0.0
    }));
    assert!(server.metric(r#"bulkhead_kv_pages_scrubbed_total{model="smollm2-test"}"#) > 0.0);
    let finished = server
        .metric(r#"bulkhead_requests_total{model="smollm2-test",tenant="beta",reason="length"}"#);
    assert_eq!(finished, 0.0, "it did not run to max_tokens");
    let cancelled = server.metric(
        r#"bulkhead_requests_total{model="smollm2-test",tenant="beta",reason="cancelled"}"#,
    );
    assert_eq!(cancelled, 1.0);

    // The tokens the engine spent on it are counted, in the metrics as in
    // the usage store (they were not: a client that left took its tokens
    // out of the metrics, and the console's series, alone).
    let usage = || {
        server
            .admin_call("GET", "/admin/v1/usage?tenant=beta", None)
            .json()
    };
    assert!(
        eventually(Duration::from_secs(5), || usage()["total"]["requests"] == 1),
        "{}",
        usage()
    );
    let total = &usage()["total"];
    assert_eq!(total["outcomes"]["cancelled"], 1, "{total}");
    let generated = total["completion_tokens"].as_f64().unwrap();
    assert!(generated >= 2.0, "two texts were read: {total}");
    let metrics = server.metrics();
    let tokens = |name: &str| {
        metric_value(
            &metrics,
            &format!(r#"bulkhead_{name}_tokens_total{{model="smollm2-test",tenant="beta"}}"#),
        )
    };
    assert_eq!(tokens("generated"), generated, "{total}");
    assert_eq!(tokens("prompt"), total["prompt_tokens"].as_f64().unwrap());
    let stats = server.admin_call("GET", "/admin/v1/stats", None).json();
    let recent = stats["models"][0]["recent"].as_array().unwrap().clone();
    let sum = |field: &str| {
        recent
            .iter()
            .map(|p| p[field].as_f64().unwrap())
            .sum::<f64>()
    };
    assert_eq!(sum("generated_tokens"), generated, "{stats}");
    assert_eq!(sum("requests"), 1.0, "{stats}");
}

#[test]
fn sigterm_lets_in_flight_requests_finish_and_exits_zero() {
    let Some(model) = smollm2() else { return };
    let mut server = start(&model, &Policy::default());
    let mut body = chat_body("Name three primary colors.", 24);
    body["stream"] = json!(true);
    let (status, mut sse) = server.stream("/v1/chat/completions", KEY_ALPHA, &body);
    assert_eq!(status, 200);
    sse.next_data().unwrap();
    server.terminate();
    let events = sse.rest();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let status = server.wait(Duration::from_secs(30));
    assert!(status.success(), "{status}");
    assert!(server.logged("request finished"));
    let lines = server.stderr_lines();
    assert!(lines.iter().any(|l| l.contains("drained")), "{lines:#?}");
}

#[test]
fn serve_refuses_a_policy_that_breaks_the_capacity_contract() {
    let Some(model) = smollm2() else { return };
    // 2048 promised tokens, 64 pages of 16 per sequence: 1024.
    let policy = Policy {
        context_tokens: 2048,
        ..Policy::default()
    };
    match try_start(&model, &policy) {
        Ok(_) => panic!("started despite a broken contract"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(
                stderr.contains(&format!("models.{MODEL_ID}.seq_pages_max")),
                "{stderr}"
            );
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
}

#[test]
fn a_canary_prompt_never_reaches_logs_or_metrics() {
    let Some(model) = smollm2() else { return };
    let mut server = start(
        &model,
        &Policy {
            rust_log: "trace",
            ..Policy::default()
        },
    );
    let canary = format!("CANARY{}xq", std::process::id());
    let chat = "/v1/chat/completions";
    let completions = "/v1/completions";
    let said = format!("Repeat after me: {canary} {canary}");
    let mut chat_req = chat_body(&said, 12);
    let mut completion_req = json!({"model": MODEL_ID, "prompt": format!("{canary} {canary}"), "max_tokens": 12, "temperature": 0});
    for stream in [false, true] {
        chat_req["stream"] = json!(stream);
        completion_req["stream"] = json!(stream);
        if stream {
            let (_, mut sse) = server.stream(chat, KEY_ALPHA, &chat_req);
            sse.rest();
            let (_, mut sse) = server.stream(completions, KEY_BETA, &completion_req);
            sse.rest();
        } else {
            assert_eq!(
                server.post_json(chat, Some(KEY_ALPHA), &chat_req).status,
                200
            );
            assert_eq!(
                server
                    .post_json(completions, Some(KEY_BETA), &completion_req)
                    .status,
                200
            );
        }
    }
    // Error paths: unsupported parameter, wrong type quoting the canary,
    // too long, wrong model, bad key, malformed JSON.
    let mut bad = chat_body(&said, 4);
    bad["n"] = json!(30);
    assert_eq!(server.post_json(chat, Some(KEY_ALPHA), &bad).status, 400);
    let mut bad = chat_body(&said, 4);
    bad["max_tokens"] = json!(canary);
    assert_eq!(server.post_json(chat, Some(KEY_ALPHA), &bad).status, 400);
    let bad = chat_body(&format!("{canary} ").repeat(400), 4);
    assert_eq!(server.post_json(chat, Some(KEY_ALPHA), &bad).status, 400);
    let mut bad = chat_body(&said, 4);
    bad["model"] = json!(canary);
    assert_eq!(server.post_json(chat, Some(KEY_ALPHA), &bad).status, 404);
    assert_eq!(
        server
            .post_json(chat, Some(&canary), &chat_body(&said, 4))
            .status,
        401
    );
    let broken = format!("{{\"model\": \"{canary}");
    assert_eq!(
        server.post(chat, Some(KEY_ALPHA), broken.as_bytes()).status,
        400
    );

    let metrics = server.metrics();
    assert!(!metrics.contains(&canary), "metrics carry the canary");
    server.terminate();
    assert!(server.wait(Duration::from_secs(30)).success());
    assert!(server.logged("request finished"));
    let lines = server.stderr_lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("TRACE") || l.contains("DEBUG")),
        "the log ran at trace level"
    );
    assert!(lines.iter().any(|l| l.contains("request_id")));
    let leaks: Vec<&String> = lines.iter().filter(|l| l.contains(&canary)).collect();
    assert!(leaks.is_empty(), "log lines carry the canary: {leaks:#?}");
}

/// TLS end to end with a self-signed certificate: HTTP/2 and HTTP/1.1 over
/// HTTPS answer, plain HTTP on the same port does not. Uses the `openssl` and
/// `curl` command-line tools (skipped, with a line, where either is missing).
#[test]
fn serves_over_tls_with_http2_and_http1() {
    let Some(model) = smollm2() else { return };
    let runs = |tool: &str, arg: &str| {
        Command::new(tool)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !runs("openssl", "version") || !runs("curl", "--version") {
        eprintln!("skipped: the openssl and curl command-line tools are needed");
        return;
    }
    let dir = std::env::temp_dir().join(format!("bulkhead-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let policy = Policy {
        tls: Some((cert.clone(), key)),
        handshake_timeout_ms: 1000,
        ..Policy::default()
    };
    let server = start(&model, &policy);
    // A client that opens the TLS port and never says hello is closed at the
    // handshake deadline.
    let silent_since = std::time::Instant::now();
    let mut silent =
        std::net::TcpStream::connect(server.inference.trim_start_matches("https://")).unwrap();
    assert!(
        server.inference.starts_with("https://"),
        "{}",
        server.inference
    );
    let body = chat_body("Say hi.", 4).to_string();
    for version in ["--http2", "--http1.1"] {
        let out = Command::new("curl")
            .args(["-sS", version, "--cacert"])
            .arg(&cert)
            .args(["-w", "\n%{http_version} %{http_code}", "-H"])
            .arg(format!("Authorization: Bearer {KEY_ALPHA}"))
            .args(["-H", "Content-Type: application/json", "-d", &body])
            .arg(format!("{}/v1/chat/completions", server.inference))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let (json, status) = text.rsplit_once('\n').unwrap();
        let expected = if version == "--http2" {
            "2 200"
        } else {
            "1.1 200"
        };
        assert_eq!(
            status,
            expected,
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let reply: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(reply["usage"]["completion_tokens"], 4);
    }
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8; 1];
    let read = std::io::Read::read(&mut silent, &mut byte);
    assert!(
        matches!(read, Ok(0) | Err(_)) && silent_since.elapsed() < Duration::from_secs(8),
        "a silent TLS client is closed: {read:?} after {:?}",
        silent_since.elapsed()
    );
    let plain = server.inference.replacen("https://", "http://", 1);
    let out = Command::new("curl")
        .args(["-s", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("{plain}/healthz"))
        .output()
        .unwrap();
    assert_ne!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "plain HTTP must not be served on a TLS port"
    );
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The one sample of `name` whose labels are exactly `labels` (any order),
/// with its value; panics if there is none or more than one.
fn picker_sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (inside, value) = rest.split_once("} ")?;
            let mut got: Vec<(String, String)> = inside
                .split("\",")
                .map(|pair| {
                    let (k, v) = pair.split_once("=\"").expect("label=\"value\"");
                    (k.to_string(), v.trim_end_matches('"').to_string())
                })
                .collect();
            got.sort();
            let mut want: Vec<(String, String)> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            want.sort();
            (got == want).then(|| value.trim().parse().expect("a number"))
        })
        .collect();
    assert_eq!(found.len(), 1, "{name}{labels:?} in:\n{text}");
    found[0]
}

/// The gauges the Gateway API Inference Extension's endpoint picker (llm-d's
/// router) scrapes, under vLLM's exact names, as gauges, one series per model
/// labelled `model_name`: waiting and running requests, the KV pool's use as
/// a 0-1 fraction, and the pool's shape as `cache_config_info`'s labels.
#[test]
fn the_endpoint_pickers_gauges_have_vllms_names_and_meanings() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let m = [("model_name", MODEL_ID)];
    let text = server.metrics();
    for name in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    ] {
        assert!(
            text.lines().any(|l| l == format!("# TYPE {name} gauge")),
            "{name} is a gauge:\n{text}"
        );
    }
    assert_eq!(picker_sample(&text, "vllm:num_requests_waiting", &m), 0.0);
    assert_eq!(picker_sample(&text, "vllm:num_requests_running", &m), 0.0);
    assert_eq!(picker_sample(&text, "vllm:kv_cache_usage_perc", &m), 0.0);
    // The test policy's pool: 224 pages of 16 tokens.
    let config = [
        ("model_name", MODEL_ID),
        ("block_size", "16"),
        ("num_gpu_blocks", "224"),
    ];
    assert_eq!(picker_sample(&text, "vllm:cache_config_info", &config), 1.0);
    let (_running, _queued) = gamma_running_and_queued(&server);
    let mut text = String::new();
    let busy = eventually(Duration::from_secs(10), || {
        text = server.metrics();
        picker_sample(&text, "vllm:num_requests_waiting", &m) == 1.0
            && picker_sample(&text, "vllm:num_requests_running", &m) == 1.0
    });
    assert!(busy, "one waiting, one running:\n{text}");
    let usage = picker_sample(&text, "vllm:kv_cache_usage_perc", &m);
    assert!(
        usage > 0.0 && usage <= 1.0,
        "a fraction of the pool: {usage}"
    );
    // The pages of one running sequence, at most its whole context.
    assert!(usage <= 64.0 / 224.0 + 1e-9, "{usage}");
}

/// A prefix-cache page no sequence holds is free to the picker, as vLLM
/// counts its cached free blocks: its tenant evicts it when it needs the
/// page. Counted in use, an idle pod with a warm cache read as busy (a
/// cache as large as the tenants' reservations, as full).
#[test]
fn an_idle_prefix_cache_is_not_in_use_to_the_endpoint_picker() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let m = [("model_name", MODEL_ID)];
    let cached = r#"bulkhead_kv_pages{model="smollm2-test",tenant="alpha",state="cached"}"#;
    let mut text = String::new();
    let settled = eventually(Duration::from_secs(10), || {
        text = server.metrics();
        metric_value(&text, cached) >= 4.0
            && picker_sample(&text, "vllm:kv_cache_usage_perc", &m) == 0.0
    });
    assert!(settled, "a cached prompt, nothing in use:\n{text}");
    // Held again by a sequence, they are in use (the engine publishes its
    // counts after its turn, which may come after the first text).
    let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 400,
                      "ignore_eos": true, "stream": true});
    let (status, mut sse) = server.stream("/v1/completions", KEY_ALPHA, &body);
    assert_eq!(status, 200);
    sse.next_data().unwrap();
    let mut usage = 0.0;
    let held = eventually(Duration::from_secs(10), || {
        usage = picker_sample(&server.metrics(), "vllm:kv_cache_usage_perc", &m);
        usage >= 4.0 / 224.0
    });
    assert!(held, "{usage}");
}

/// Envoy's `ext_authz` HTTP protocol under `/ext-authz/`: a valid key gets
/// 200 with the picker's fairness id set to its tenant's registry id
/// (whatever the client sent) and the other client-settable picker headers
/// listed for removal; a missing, wrong or revoked key gets 401 and no
/// fairness id; a pod itself ignores a client's copies of those headers.
#[test]
fn ext_authz_gives_the_gateway_the_tenants_id_never_the_clients() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let check = |method: &str, path: &str, key: Option<&str>| -> ureq::Response {
        let mut request = agent
            .request(method, &format!("{}/ext-authz{path}", server.inference))
            .set("x-llm-d-inference-fairness-id", "999")
            .set("x-llm-d-inference-objective", "critical");
        if let Some(key) = key {
            request = request.set("authorization", &format!("Bearer {key}"));
        }
        match request.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("transport error: {e}"),
        }
    };
    let id_of = |key: &str| {
        server
            .get(&server.inference, "/v1/tenant", Some(key))
            .json()["id"]
            .clone()
    };
    let (alpha, beta) = (id_of(KEY_ALPHA), id_of(KEY_BETA));
    assert!(
        alpha.is_u64() && beta.is_u64() && alpha != beta,
        "{alpha} {beta}"
    );
    for (method, path, key, id) in [
        ("POST", "/v1/chat/completions", KEY_ALPHA, &alpha),
        ("POST", "/v1/completions", KEY_BETA, &beta),
        ("GET", "/v1/models", KEY_ALPHA, &alpha),
        ("GET", "", KEY_BETA, &beta),
    ] {
        let r = check(method, path, Some(key));
        assert_eq!(r.status(), 200, "{method} {path}");
        assert_eq!(
            r.header("x-llm-d-inference-fairness-id"),
            Some(id.to_string().as_str()),
            "the tenant's id, not the client's 999"
        );
        let removed: Vec<&str> = r
            .header("x-envoy-auth-headers-to-remove")
            .expect("the removal list")
            .split(", ")
            .collect();
        for name in [
            "x-llm-d-inference-objective",
            "x-gateway-inference-fairness-id",
            "x-gateway-inference-objective",
            "x-prefiller-host-port",
        ] {
            assert!(removed.contains(&name), "{name} in {removed:?}");
        }
        assert!(!removed.contains(&"x-llm-d-inference-fairness-id"));
    }
    for key in [None, Some("not-a-key-of-anyone-0123456789abcdef")] {
        let r = check("POST", "/v1/chat/completions", key);
        assert_eq!(r.status(), 401, "{key:?}");
        assert_eq!(r.header("x-llm-d-inference-fairness-id"), None);
        let body: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    }
    // A key issued and revoked through the admin API: 200, then 401.
    let issued = server
        .admin_call("POST", "/admin/v1/tenants/alpha/keys", Some(&json!({})))
        .json();
    let secret = issued["secret"]
        .as_str()
        .expect("the secret, once")
        .to_string();
    assert_eq!(check("GET", "/v1/models", Some(&secret)).status(), 200);
    let key_id = issued["key"]["id"].as_str().unwrap();
    let r = server.admin_call(
        "DELETE",
        &format!("/admin/v1/tenants/alpha/keys/{key_id}"),
        None,
    );
    assert!(r.status == 200 || r.status == 204, "{}", r.body);
    assert_eq!(check("GET", "/v1/models", Some(&secret)).status(), 401);
    // The objective comes from the tenant's record, never from the client:
    // set, it replaces the client's copy (and is not removed); cleared, the
    // client's copy is removed again.
    let objective = |value: &str| {
        server.admin_call(
            "PATCH",
            "/admin/v1/tenants/alpha",
            Some(&json!({ "objective": value })),
        )
    };
    let r = objective("Not_A_Name");
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error().1, json!("invalid_value"));
    let r = objective("premium-tier");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["objective"], "premium-tier");
    let removed = |r: &ureq::Response| -> Vec<String> {
        r.header("x-envoy-auth-headers-to-remove")
            .unwrap()
            .split(", ")
            .map(str::to_string)
            .collect()
    };
    let r = check("POST", "/v1/chat/completions", Some(KEY_ALPHA));
    assert_eq!(
        r.header("x-llm-d-inference-objective"),
        Some("premium-tier")
    );
    assert!(!removed(&r).contains(&"x-llm-d-inference-objective".to_string()));
    let r = check("POST", "/v1/chat/completions", Some(KEY_BETA));
    assert_eq!(
        r.header("x-llm-d-inference-objective"),
        None,
        "beta has none"
    );
    assert!(removed(&r).contains(&"x-llm-d-inference-objective".to_string()));
    assert_eq!(objective("").status, 200);
    let r = check("POST", "/v1/chat/completions", Some(KEY_ALPHA));
    assert_eq!(r.header("x-llm-d-inference-objective"), None, "cleared");
    // Sent straight to the pod, the headers change nothing.
    let spoofed = [
        ("x-llm-d-inference-fairness-id", "999"),
        ("x-prefiller-host-port", "127.0.0.1:1"),
    ];
    let r = ask(&server, KEY_ALPHA, &spoofed, 2);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Whether this machine has an NVIDIA driver (libcuda loads).
fn nvidia_driver_present() -> bool {
    let name = std::ffi::CString::new("libcuda.so.1").unwrap();
    // SAFETY: dlopen with a valid C string; the handle is closed at once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}

/// `--backend cuda` on a machine without a GPU refuses to start, naming what
/// is missing, before it listens or writes a secret; `--backend auto` serves
/// on the CPU, says so in the log, and the admin `/readyz` names each
/// model's backend.
#[test]
fn backend_cuda_without_a_gpu_is_refused_and_auto_serves_on_the_cpu() {
    let Some(model) = smollm2() else { return };
    if nvidia_driver_present() {
        eprintln!(
            "skipped: this machine has an NVIDIA driver (the refusal is for machines without)"
        );
        return;
    }
    let policy = Policy::default();
    let (status, stderr) =
        match try_launch(Launch::new(&model, &policy).arg("--backend").arg("cuda")) {
            Ok(server) => panic!(
                "served with --backend cuda:\n{}",
                server.stderr_lines().join("\n")
            ),
            Err(refused) => refused,
        };
    assert!(!status.success());
    assert!(
        stderr.contains(
            "backend cuda: no NVIDIA driver: libcuda.so.1 was not found on the loader path"
        ),
        "{stderr}"
    );
    assert!(
        !stderr.contains("listening:") && !stderr.contains("panicked"),
        "{stderr}"
    );

    let server = launch(Launch::new(&model, &policy).arg("--backend").arg("auto"));
    assert!(
        server.logged("backend auto chose cpu: no NVIDIA driver"),
        "{:?}",
        server.stderr_lines()
    );
    let ready = server.get(&server.admin, "/readyz", None);
    assert_eq!(ready.status, 200, "{}", ready.body);
    assert_eq!(ready.json()["backends"][MODEL_ID], "cpu", "{}", ready.body);
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}
