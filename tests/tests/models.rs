//! Several models in one server, through the real binary: two models served
//! at once, each tenant seeing and reaching only the models it may use (a
//! forbidden model answers exactly as an unknown one), a model added and
//! removed through the admin API while the other one serves load, the memory
//! budget refusing a catalog that does not fit, and routing plugins choosing
//! between models.

mod support;

use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::*;

/// Sets its flag when dropped, also when a test panics.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Both models: the test policy's own, and the Q8_0 one as [`Q8_ID`].
fn two_models(q8: &Path) -> Policy {
    Policy {
        beta_models: Some(format!("[\"{MODEL_ID}\"]")),
        alpha_pending_max: 32,
        extra_toml: model_toml(Q8_ID, q8, 224),
        ..Policy::default()
    }
}

fn completion(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
           "temperature": 0})
}

fn model_ids(server: &Server, key: &str) -> Vec<String> {
    let r = server.get(&server.inference, "/v1/models", Some(key));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// The error object with the model's name replaced, to compare two 404s.
fn error_shape(r: &Reply, model: &str) -> Value {
    let mut error = r.json()["error"].clone();
    let message = error["message"].as_str().unwrap().replace(model, "<model>");
    error["message"] = message.into();
    json!({"status": r.status, "error": error})
}

#[test]
fn two_models_serve_at_once_and_each_tenant_reaches_only_its_own() {
    let (Some(model), Some(q8)) = (smollm2(), smollm2_q8()) else {
        return;
    };
    let server = start(&model, &two_models(&q8));
    assert_eq!(model_ids(&server, KEY_ALPHA), [MODEL_ID, Q8_ID]);
    assert_eq!(model_ids(&server, KEY_BETA), [MODEL_ID]);

    // Beta asking for the model it may not use gets exactly what it gets for
    // a model that does not exist: nothing tells it the model is there.
    let completions = "/v1/completions";
    let forbidden = server.post_json(completions, Some(KEY_BETA), &completion(Q8_ID, 4));
    let unknown = server.post_json(completions, Some(KEY_BETA), &completion("nope-q8", 4));
    assert_eq!(forbidden.status, 404, "{}", forbidden.body);
    assert_eq!(forbidden.error().1, json!("model_not_found"));
    assert_eq!(
        error_shape(&forbidden, Q8_ID),
        error_shape(&unknown, "nope-q8")
    );
    let forbidden = server.get(
        &server.inference,
        &format!("/v1/models/{Q8_ID}"),
        Some(KEY_BETA),
    );
    let unknown = server.get(&server.inference, "/v1/models/nope-q8", Some(KEY_BETA));
    assert_eq!(
        error_shape(&forbidden, Q8_ID),
        error_shape(&unknown, "nope-q8")
    );
    let alpha_sees = server.get(
        &server.inference,
        &format!("/v1/models/{Q8_ID}"),
        Some(KEY_ALPHA),
    );
    assert_eq!(alpha_sees.json()["id"], Q8_ID);
    // The inference listener's readiness names no model; the admin one does.
    let ready = server.get(&server.inference, "/readyz", None);
    assert_eq!(ready.status, 200);
    assert!(!ready.body.contains(Q8_ID), "{}", ready.body);
    let ready = server.get(&server.admin, "/readyz", None).json();
    assert_eq!(ready["models"][MODEL_ID], "ready");
    assert_eq!(ready["models"][Q8_ID], "ready");

    // Both models at once: alpha on each, beta on its one, in parallel.
    let server = Arc::new(server);
    let workers: Vec<_> = [
        (KEY_ALPHA, MODEL_ID),
        (KEY_ALPHA, Q8_ID),
        (KEY_BETA, MODEL_ID),
    ]
    .into_iter()
    .flat_map(|job| [job, job])
    .map(|(key, model)| {
        let server = Arc::clone(&server);
        std::thread::spawn(move || {
            let r = server.post_json("/v1/completions", Some(key), &completion(model, 12));
            assert_eq!(r.status, 200, "{model}: {}", r.body);
            assert_eq!(r.json()["model"], model);
            r.json()["choices"][0]["text"].as_str().unwrap().to_string()
        })
    })
    .collect();
    let texts: Vec<String> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert!(texts.iter().all(|t| !t.is_empty()), "{texts:?}");
    // The same greedy question to each model: both answer; each is its own file.
    assert!(
        texts[0].contains("Paris") && texts[2].contains("Paris"),
        "{texts:?}"
    );

    // Per-model metrics, labelled by the catalog's ids.
    let metrics = server.metrics();
    for (model, tenant, count) in [
        (MODEL_ID, "alpha", 2.0),
        (Q8_ID, "alpha", 2.0),
        (MODEL_ID, "beta", 2.0),
    ] {
        let finished = format!(
            r#"bulkhead_requests_total{{model="{model}",tenant="{tenant}",reason="length"}}"#
        );
        let stopped = finished.replace("length", "stop");
        let total = metric_value(&metrics, &finished) + metric_value(&metrics, &stopped);
        assert_eq!(total, count, "{finished}");
    }
    assert_eq!(
        metric_value(
            &metrics,
            &format!(r#"bulkhead_kv_pool_pages{{model="{Q8_ID}",state="total"}}"#)
        ),
        224.0
    );
    // Beta has no partition in the model it may not use.
    let partitions = server
        .admin_call("GET", "/admin/v1/partitions", None)
        .json();
    let rows = partitions["data"].as_array().unwrap();
    assert!(rows
        .iter()
        .any(|p| p["model"] == Q8_ID && p["tenant"] == "alpha"));
    assert!(!rows
        .iter()
        .any(|p| p["model"] == Q8_ID && p["tenant"] == "beta"));
    assert!(rows
        .iter()
        .any(|p| p["model"] == MODEL_ID && p["tenant"] == "beta"));
}

#[test]
fn access_changes_through_the_admin_api_apply_on_the_next_request() {
    let (Some(model), Some(q8)) = (smollm2(), smollm2_q8()) else {
        return;
    };
    let server = start(&model, &two_models(&q8));
    let grant = json!({"models": [MODEL_ID, Q8_ID]});
    let r = server.admin_call("PATCH", "/admin/v1/tenants/beta", Some(&grant));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["models"], json!([MODEL_ID, Q8_ID]));
    assert_eq!(model_ids(&server, KEY_BETA), [MODEL_ID, Q8_ID]);
    let r = server.post_json("/v1/completions", Some(KEY_BETA), &completion(Q8_ID, 4));
    assert_eq!(r.status, 200, "{}", r.body);
    // Revoked again: beta's partition in that model goes, and so does access.
    let revoke = json!({"models": [MODEL_ID]});
    assert_eq!(
        server
            .admin_call("PATCH", "/admin/v1/tenants/beta", Some(&revoke))
            .status,
        200
    );
    let r = server.post_json("/v1/completions", Some(KEY_BETA), &completion(Q8_ID, 4));
    assert_eq!(r.status, 404, "{}", r.body);
    // An id the catalog does not hold is refused (a typo grants nothing).
    let typo = json!({"models": ["smollm2-tset"]});
    let r = server.admin_call("PATCH", "/admin/v1/tenants/beta", Some(&typo));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.error().0, json!("models"));
    let r = server.admin_call(
        "PATCH",
        "/admin/v1/tenants/beta",
        Some(&json!({"models": ["*", "x"]})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let audit = server
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .body;
    assert!(audit.contains("models_after"), "{audit}");
}

#[test]
fn a_model_added_and_removed_under_load_leaves_the_other_model_untouched() {
    let (Some(model), Some(q8)) = (smollm2(), smollm2_q8()) else {
        return;
    };
    let policy = Policy {
        beta_models: Some(format!("[\"{MODEL_ID}\"]")),
        alpha_pending_max: 32,
        ..Policy::default()
    };
    let server = Arc::new(start(&model, &policy));
    // Load on the policy's model for the whole test; every answer must be 200.
    let stop = Arc::new(AtomicBool::new(false));
    // If an assertion below fails, the load stops too (and with it the last
    // holder of the server, which then stops it).
    let _stop_on_exit = StopOnDrop(Arc::clone(&stop));
    let served = Arc::new(AtomicU32::new(0));
    let load: Vec<_> = [KEY_ALPHA, KEY_BETA]
        .into_iter()
        .map(|key| {
            let (server, stop, served) =
                (Arc::clone(&server), Arc::clone(&stop), Arc::clone(&served));
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let r =
                        server.post_json("/v1/completions", Some(key), &completion(MODEL_ID, 8));
                    assert_eq!(r.status, 200, "under load: {}", r.body);
                    served.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();

    let add = json!({"id": "hot-q8", "path": q8, "context_tokens": 1024, "threads": 1,
                     "page_tokens": 16, "pool_pages": 224, "seq_pages_max": 64,
                     "step_tokens_max": 256, "step_seqs_max": 8});
    let r = server.admin_call("POST", "/admin/v1/models", Some(&add));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["source"], "admin");
    assert!(r.json()["kv_bytes"].as_u64().unwrap() > 0);
    // The same id again is a conflict; nothing changes.
    let again = server.admin_call("POST", "/admin/v1/models", Some(&add));
    assert_eq!(again.status, 409, "{}", again.body);
    // Alpha (every model) reaches it at once; beta (a list) does not.
    assert!(model_ids(&server, KEY_ALPHA).contains(&"hot-q8".to_string()));
    assert_eq!(model_ids(&server, KEY_BETA), [MODEL_ID]);
    let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &completion("hot-q8", 6));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["model"], "hot-q8");
    assert_eq!(
        server
            .post_json("/v1/completions", Some(KEY_BETA), &completion("hot-q8", 6))
            .status,
        404
    );

    // A long request on it, then an unload that gives it no time: it ends
    // with `model_removed`, the model is gone, its memory freed.
    let (started, running) = std::sync::mpsc::channel();
    let streaming = {
        let server = Arc::clone(&server);
        std::thread::spawn(move || {
            let mut body = completion("hot-q8", 600);
            body["stream"] = true.into();
            body["prompt"] = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,".into();
            let (status, mut sse) = server.stream("/v1/completions", KEY_ALPHA, &body);
            assert_eq!(status, 200);
            let first = sse.next_data().expect("a first event");
            started.send(()).unwrap();
            format!("{first}\n{}", sse.rest().join("\n"))
        })
    };
    running
        .recv_timeout(Duration::from_secs(60))
        .expect("the long request is generating");
    let r = server.admin_call("DELETE", "/admin/v1/models/hot-q8?drain_ms=0", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["requests_ended"], 1);
    let stream = streaming.join().unwrap();
    assert!(stream.contains("model_removed"), "{stream}");
    assert!(!model_ids(&server, KEY_ALPHA).contains(&"hot-q8".to_string()));
    let gone = server.post_json("/v1/completions", Some(KEY_ALPHA), &completion("hot-q8", 4));
    assert_eq!(gone.status, 404);
    assert_eq!(
        server
            .admin_call("DELETE", "/admin/v1/models/hot-q8", None)
            .status,
        404
    );
    let ready = server.get(&server.admin, "/readyz", None).json();
    assert!(ready["models"].get("hot-q8").is_none(), "{ready}");

    // Added again (after the unload freed its memory), then removed with a
    // drain: nothing was running, so nothing is ended.
    assert_eq!(
        server
            .admin_call("POST", "/admin/v1/models", Some(&add))
            .status,
        201
    );
    // Its counters go on from the first engine's (a completion and the
    // stream, then one more): begun again at zero, they held still at the
    // largest value a scrape had seen until the new engine passed it.
    let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &completion("hot-q8", 4));
    assert_eq!(r.status, 200, "{}", r.body);
    let enqueued = r#"bulkhead_enqueued_total{model="hot-q8",tenant="alpha"}"#;
    assert!(
        eventually(Duration::from_secs(5), || server.metric(enqueued) == 3.0),
        "{}",
        server.metric(enqueued)
    );
    // The endpoint picker's view (vLLM's gauge names): served, then not.
    let picker = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                l.starts_with("vllm:cache_config_info{") && l.contains("model_name=\"hot-q8\"")
            })
            .map(str::to_string)
            .collect()
    };
    let served_now = picker(&server.metrics());
    assert!(
        served_now.len() == 1 && served_now[0].ends_with(" 1"),
        "{served_now:?}"
    );
    let r = server.admin_call("DELETE", "/admin/v1/models/hot-q8", None);
    assert_eq!(r.json()["requests_ended"], 0, "{}", r.body);
    let text = server.metrics();
    let gone = picker(&text);
    assert!(
        gone.len() == 1 && gone[0].ends_with(" 0"),
        "no longer the served shape: {gone:?}"
    );
    for name in ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"] {
        assert_eq!(
            metric_value(&text, &format!(r#"{name}{{model_name="hot-q8"}}"#)),
            0.0
        );
    }

    stop.store(true, Ordering::SeqCst);
    for worker in load {
        worker.join().expect("no request on the other model failed");
    }
    assert!(served.load(Ordering::SeqCst) >= 4);
    let audit = server
        .admin_call("GET", "/admin/v1/audit?limit=1000", None)
        .body;
    for action in ["model.add", "model.remove"] {
        assert!(audit.contains(action), "{action}: {audit}");
    }
}

#[test]
fn an_admin_model_outlives_a_restart_until_it_is_removed() {
    let (Some(model), Some(q8)) = (smollm2(), smollm2_q8()) else {
        return;
    };
    let policy = Policy::default();
    let server = start(&model, &policy);
    let add = json!({"id": "kept-q8", "path": q8, "context_tokens": 1024, "threads": 1,
                     "pool_pages": 224, "seq_pages_max": 64, "step_tokens_max": 256,
                     "step_seqs_max": 8});
    assert_eq!(
        server
            .admin_call("POST", "/admin/v1/models", Some(&add))
            .status,
        201
    );
    let dir = server.kill();
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    assert_eq!(model_ids(&server, KEY_ALPHA), [MODEL_ID, "kept-q8"]);
    let listed = server.admin_call("GET", "/admin/v1/models", None).json();
    assert_eq!(listed["data"][1]["source"], "admin");
    assert_eq!(listed["data"][0]["source"], "policy");
    // A policy model removed through the API is back at the next start; an
    // admin model removed is not.
    for id in [MODEL_ID, "kept-q8"] {
        let r = server.admin_call("DELETE", &format!("/admin/v1/models/{id}"), None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(model_ids(&server, KEY_ALPHA).is_empty());
    // The policy's id stays the policy's, loaded or not.
    let mut again = add.clone();
    again["id"] = MODEL_ID.into();
    let r = server.admin_call("POST", "/admin/v1/models", Some(&again));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(server.get(&server.admin, "/readyz", None).status, 200);
    let dir = server.kill();
    let server = launch(Launch::new(&model, &policy).dir(&dir));
    assert_eq!(model_ids(&server, KEY_ALPHA), [MODEL_ID]);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_models_are_refused_with_a_clear_error_and_nothing_loads() {
    let Some(model) = smollm2() else { return };
    let server = start(&model, &Policy::default());
    let hostile = server.dir.join("hostile.gguf");
    std::fs::write(
        &hostile,
        b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff",
    )
    .unwrap();
    let base = |id: &str, path: &Path| {
        json!({"id": id, "path": path, "context_tokens": 1024, "pool_pages": 224,
               "seq_pages_max": 64})
    };
    let cases = [
        (base("hostile", &hostile), 400, "model_unloadable"),
        (
            base("missing", &server.dir.join("nope.gguf")),
            400,
            "model_unloadable",
        ),
        (
            base("relative", Path::new("models/x.gguf")),
            400,
            "invalid_value",
        ),
        (base("bad/id", &model), 400, "invalid_value"),
        (base(MODEL_ID, &model), 409, "already_exists"),
        (
            json!({"id": "x", "path": model, "context_tokens": 1024, "surprise": 1}),
            400,
            "invalid_json",
        ),
        // Promises more than its pool holds: the table says which stage.
        (
            json!({"id": "tight", "path": model, "context_tokens": 1024, "pool_pages": 32,
                   "seq_pages_max": 64}),
            409,
            "capacity_contract_violated",
        ),
    ];
    for (body, status, code) in cases {
        let r = server.admin_call("POST", "/admin/v1/models", Some(&body));
        assert_eq!(r.status, status, "{body}: {}", r.body);
        assert_eq!(r.error().1, json!(code), "{body}: {}", r.body);
    }
    assert_eq!(model_ids(&server, KEY_ALPHA), [MODEL_ID]);
    let r = server.admin_call("DELETE", "/admin/v1/models/nope?drain_ms=-1", None);
    assert_eq!(r.status, 400, "{}", r.body);
    // The server still serves.
    let r = server.post_json("/v1/completions", Some(KEY_ALPHA), &completion(MODEL_ID, 4));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_memory_budget_that_cannot_hold_both_models_is_refused_naming_the_model() {
    let (Some(model), Some(q8)) = (smollm2(), smollm2_q8()) else {
        return;
    };
    // Each model: its weights (~100-150 MB) and a 224-page pool (~83 MB of
    // f16 KV). 300 MiB holds either one, not both.
    let policy = Policy {
        extra_toml: format!(
            "{}\n[engine]\nmemory_max = \"300 MiB\"\n",
            model_toml(Q8_ID, &q8, 224)
        ),
        ..Policy::default()
    };
    match try_start(&model, &policy) {
        Ok(_) => panic!("started above its memory budget"),
        Err((status, stderr)) => {
            assert!(!status.success());
            assert!(
                stderr.contains(&format!("memory budget exceeded: model {Q8_ID}")),
                "{stderr}"
            );
            assert!(stderr.contains("engine.memory_max"), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }

    // The same budget with one model: it starts, and adding the second
    // through the admin API is refused the same way, until the first goes.
    let one = Policy {
        extra_toml: "[engine]\nmemory_max = \"300 MiB\"\n".into(),
        ..Policy::default()
    };
    let server = start(&model, &one);
    let add = json!({"id": Q8_ID, "path": q8, "context_tokens": 1024, "threads": 1,
                     "pool_pages": 224, "seq_pages_max": 64, "step_tokens_max": 256,
                     "step_seqs_max": 8});
    let r = server.admin_call("POST", "/admin/v1/models", Some(&add));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.error().1, json!("memory_budget_exceeded"));
    assert!(r.body.contains(Q8_ID), "{}", r.body);
    assert_eq!(
        server
            .admin_call("DELETE", &format!("/admin/v1/models/{MODEL_ID}"), None)
            .status,
        200
    );
    let r = server.admin_call("POST", "/admin/v1/models", Some(&add));
    assert_eq!(r.status, 201, "the unload freed the budget: {}", r.body);
}

#[test]
fn a_routing_plugin_picks_among_the_models_its_tenant_may_use() {
    let (Some(model), Some(q8), Some(router)) = (smollm2(), smollm2_q8(), plugin_wasm("router"))
    else {
        return;
    };
    let server = start(&model, &two_models(&q8));
    let router = std::fs::read(router).unwrap();
    for tenant in ["alpha", "beta"] {
        let r = server.call_raw(
            &server.admin,
            "PUT",
            &format!("/admin/v1/tenants/{tenant}/plugins/router"),
            Some(ADMIN_TOKEN),
            "application/wasm",
            &router,
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let ask = |key: &str, model: &str, tier: &str| {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(120))
            .build();
        let response = agent
            .post(&format!("{}/v1/completions", server.inference))
            .set("authorization", &format!("Bearer {key}"))
            .set("x-tier", tier)
            .send_string(&completion(model, 4).to_string())
            .unwrap_or_else(|e| panic!("{e}"));
        let body: Value = serde_json::from_str(&response.into_string().unwrap()).unwrap();
        body["model"].as_str().unwrap().to_string()
    };
    // Alpha may use both: `fast` routes to the -q8 model, `precise` away from it.
    assert_eq!(ask(KEY_ALPHA, MODEL_ID, "fast"), Q8_ID);
    assert_eq!(ask(KEY_ALPHA, Q8_ID, "precise"), MODEL_ID);
    assert_eq!(ask(KEY_ALPHA, Q8_ID, "none"), Q8_ID);
    // Beta may use one model: there is nothing to route between.
    assert_eq!(ask(KEY_BETA, MODEL_ID, "fast"), MODEL_ID);
    let metrics = server.metrics();
    let routed =
        format!(r#"bulkhead_requests_total{{model="{Q8_ID}",tenant="alpha",reason="length"}}"#);
    let stopped = routed.replace("length", "stop");
    let on_q8 = metric_value(&metrics, &routed) + metric_value(&metrics, &stopped);
    assert_eq!(on_q8, 2.0, "{metrics}");
}

/// A file written by llama.cpp's own `llama-quantize` (Q4_K and Q6_K blocks
/// laid out by someone else's code; `kernels/tests/conformance.rs` holds its
/// logits to llama.cpp's) is served through the OpenAI API, and greedy
/// decoding answers with llama.cpp's own continuation.
#[test]
fn a_k_quant_file_from_llama_quantize_is_served_with_llama_cpps_continuation() {
    let fixtures = repo_root().join("kernels/tests/fixtures/conformance");
    serves_llama_cpps_continuation(&fixtures.join("llamacpp-Q4_K_M.gguf"), "llamacpp-Q4_K_M");
}

/// The same for a Gemma 2 model (the conformance suite's: a local layer with
/// a window of 8 positions the prompt and continuation outgrow, soft caps,
/// post-norms, GELU gate, scaled embeddings), served through the whole stack.
#[test]
fn a_gemma2_file_is_served_with_llama_cpps_continuation() {
    let dir = temp_dir("gemma2");
    let model = dir.join("gemma2-f32.gguf");
    std::fs::write(
        &model,
        bulkhead_kernels::testing::conformance_model("gemma2-f32"),
    )
    .unwrap();
    serves_llama_cpps_continuation(&model, "gemma2-f32");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Serves `model` alone and asks for the greedy continuation of the
/// conformance fixture's entry `name`: it must be llama.cpp's.
fn serves_llama_cpps_continuation(model: &Path, name: &str) {
    use bulkhead_kernels::gguf::Gguf;
    use bulkhead_kernels::tokenizer::{DecodeOptions, Tokenizer};
    let fixtures = repo_root().join("kernels/tests/fixtures/conformance");
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("llamacpp.json")).unwrap())
            .unwrap();
    let greedy = &fixture["models"][name]["greedy"];
    // llama.cpp's continuation up to its first near-tie (a margin below 0.1
    // logit), where two engines may part without either being wrong.
    let margins = greedy["top2_margins"].as_array().unwrap();
    let agreed = margins
        .iter()
        .take_while(|m| m.as_f64().unwrap() > 0.1)
        .count();
    assert!(
        agreed >= 4,
        "{name}: the fixture's continuation has {agreed} clear tokens"
    );
    let ids: Vec<u32> = greedy["continuation"].as_array().unwrap()[..agreed]
        .iter()
        .map(|id| id.as_u64().unwrap() as u32)
        .collect();
    let tokenizer = Tokenizer::from_gguf(&Gguf::open(model).unwrap()).unwrap();
    let expected = tokenizer.decode(&ids, DecodeOptions::default()).unwrap();

    let policy = Policy {
        context_tokens: 256,
        seq_pages_max: 16,
        ..Policy::default()
    };
    let server = launch(Launch::new(model, &policy));
    let r = server.post_json(
        "/v1/completions",
        Some(KEY_ALPHA),
        &json!({
            "model": MODEL_ID,
            "prompt": greedy["text"],
            "max_tokens": agreed,
            "temperature": 0,
        }),
    );
    assert_eq!(r.status, 200, "{name}: {}", r.body);
    let body = r.json();
    assert_eq!(
        body["usage"]["completion_tokens"], agreed,
        "{name}: {}",
        r.body
    );
    assert_eq!(
        body["choices"][0]["text"],
        expected.as_str(),
        "{name}: {}",
        r.body
    );
}
