//! The `bulkhead` binary as an operator uses it: `generate`, `tokenize`,
//! `quantize` and `bench sampling` on the real SmolLM2 model, and clear errors
//! (never a panic) on bad input.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use support::{bulkhead_exe, repo_root, smollm2};

/// sha256 of `bulkhead quantize --to q8_0` of the default model. The conversion
/// is deterministic; `scripts/models.sh` pins the same digest.
const Q8_0_SHA256: &str = "0c1d3326cd9793cfb7296113c063dd5c24e2bd734b48ec1a3d01b7158eca9387";

/// The binary `scripts/test.sh` builds before the tests run.
fn bulkhead() -> Command {
    Command::new(bulkhead_exe())
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("the binary starts")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A failure that is an error message and exit code 1, not a panic (101).
fn assert_clean_failure(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "expected exit 1, stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
}

#[test]
fn greedy_chat_generation_is_coherent_and_deterministic() {
    let Some(model) = smollm2() else { return };
    let generate = || {
        run(bulkhead().arg("generate").arg("--model").arg(&model).args([
            "--chat",
            "Name three primary colors.",
            "--max-tokens",
            "32",
            "--threads",
            "2",
        ]))
    };
    let first = generate();
    assert!(first.status.success(), "{}", stderr(&first));
    let text = stdout(&first);
    for color in ["Red", "Blue", "Yellow"] {
        assert!(
            text.contains(color),
            "a coherent answer names {color}: {text:?}"
        );
    }
    assert!(
        !text.contains("<|im_end|>"),
        "end-of-turn is not printed: {text:?}"
    );
    assert!(
        stderr(&first).contains("finish: Stop"),
        "{}",
        stderr(&first)
    );
    assert_eq!(
        text,
        stdout(&generate()),
        "greedy generation is deterministic"
    );
}

#[test]
fn sampling_is_reproducible_by_seed() {
    let Some(model) = smollm2() else { return };
    let sample = |seed: &str| {
        let out = run(bulkhead().arg("generate").arg("--model").arg(&model).args([
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "24",
            "--temperature",
            "1.0",
            "--seed",
            seed,
        ]));
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(sample("7"), sample("7"));
    assert_ne!(sample("7"), sample("8"));
}

#[test]
fn bench_sampling_measures_every_option_on_the_real_model() {
    let Some(model) = smollm2() else { return };
    let out = run(bulkhead()
        .args([
            "bench",
            "sampling",
            "--threads",
            "2",
            "--samples",
            "40",
            "--model",
        ])
        .arg(&model));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].contains("vocabulary 49152"), "{text}");
    // Five schemas compiled, timed: the calls of 128 tools, a pydantic
    // model's patterns and format, an HttpUrl (its maxLength of 2,083
    // exact), and two hostile ones refused at the bound on their automata.
    let (compiled, rest): (Vec<&str>, Vec<&str>) = lines[1..]
        .iter()
        .partition(|line| line.starts_with("compiling "));
    assert_eq!(compiled.len(), 5, "{text}");
    for (i, line) in compiled.iter().enumerate() {
        let ms: f64 = line
            .split(" ms (")
            .next()
            .and_then(|before| before.split_whitespace().last()?.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(ms > 0.0, "{line}");
        let outcome = if i < 3 { "(compiled)" } else { "in all)" };
        assert!(line.ends_with(outcome), "{line}");
    }
    // One row per option, the hostile ones included, each with a mean and
    // a worst time that are numbers, the worst no less than the mean.
    let (rest, adjustments) = rest.split_at(rest.len().saturating_sub(1));
    let (options, batches) = rest.split_at(rest.len().saturating_sub(3));
    let rows: Vec<(f64, f64)> = options
        .iter()
        .map(|line| {
            let number = |after: &str| -> f64 {
                let rest = line.split(after).nth(1).expect(after);
                rest.split_whitespace().next().unwrap().parse().unwrap()
            };
            (number(" mean "), number(" max "))
        })
        .collect();
    assert_eq!(rows.len(), 19, "{text}");
    for option in [
        "hostile: JSON mode, temperature 1",
        "JSON schema (a pydantic model), temperature 1",
        "JSON schema, 2 patterns, a date-time (pydantic), temperature 1",
        "hostile: 250 enum values sharing 200 bytes",
        "hostile: 16 alike alternatives read side by side",
        "tool_choice required, 128 tools, temperature 1",
    ] {
        assert!(text.contains(option), "{option}: {text}");
    }
    assert!(
        rows.iter().all(|&(mean, max)| mean > 0.0 && max >= mean),
        "{text}"
    );
    // Then a step's 8 rows, on one thread and on the engine's 2.
    assert_eq!(batches.len(), 3, "{text}");
    for line in batches {
        let ms: Vec<f64> = line
            .split(" ms ")
            .filter_map(|part| part.split_whitespace().last()?.parse().ok())
            .collect();
        assert!(
            line.starts_with("8 rows of ") && line.contains("on the engine's 2"),
            "{line}"
        );
        assert!(ms.len() == 2 && ms.iter().all(|&t| t > 0.0), "{line}");
    }
    // Then 128 sequences' adjustment lists a step, kept and made whole.
    let line = adjustments.first().expect("the adjustments' line");
    assert!(
        line.starts_with("128 picks' adjustments of a 3,000-token prompt"),
        "{line}"
    );
    let ms: Vec<f64> = line
        .split(" ms ")
        .filter_map(|part| part.split_whitespace().last()?.parse().ok())
        .collect();
    assert!(ms.len() == 2 && ms.iter().all(|&t| t > 0.0), "{line}");
    let out = run(bulkhead()
        .args(["bench", "sampling", "--samples", "0", "--model"])
        .arg(&model));
    assert_clean_failure(&out, "--samples is at least 1");
}

#[test]
fn bench_scheduler_times_the_steps_in_which_every_sequence_decodes() {
    let Some(model) = smollm2() else { return };
    let out = run(bulkhead()
        .args([
            "bench",
            "scheduler",
            "--batches",
            "1,4",
            "--prompt-tokens",
            "20",
            "--max-tokens",
            "9",
            "--model",
        ])
        .arg(&model));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("20 prompt tokens, 9 generated a request"),
        "{text}"
    );
    // Each batch: its 8 steps after the first token (which the prompt's
    // step gives), all of them with every sequence decoding.
    for (line, batch) in lines[1..].iter().zip([1, 4]) {
        assert!(
            line.starts_with(&format!("batch {batch:>4}: ")) && line.contains("(median of 8)"),
            "{line}"
        );
        let numbers: Vec<f64> = line
            .split(" us")
            .filter_map(|part| part.split_whitespace().last()?.parse().ok())
            .collect();
        assert_eq!(numbers.len(), 3, "{line}");
        let (median, p90) = (numbers[0], numbers[1]);
        assert!(median > 0.0 && p90 >= median, "{line}");
    }
    assert_eq!(lines.len(), 3, "{text}");
    let out = run(bulkhead()
        .args(["bench", "scheduler", "--max-tokens", "1", "--model"])
        .arg(&model));
    assert_clean_failure(&out, "--max-tokens is at least 2");
}

#[test]
fn tokenize_prints_the_reference_ids() {
    let Some(model) = smollm2() else { return };
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("kernels/tests/fixtures/tokens_smollm2.json"))
            .unwrap(),
    )
    .unwrap();
    for case in fixture["cases"].as_array().unwrap().iter().take(6) {
        let text = case["text"].as_str().unwrap();
        let out = run(bulkhead()
            .arg("tokenize")
            .arg("--model")
            .arg(&model)
            .args(["--text", text]));
        assert!(out.status.success(), "{}", stderr(&out));
        let ids: serde_json::Value =
            serde_json::from_str(stdout(&out).trim()).expect("one JSON array");
        assert_eq!(ids, case["ids"], "text {text:?}");
    }
    // Special-token text is plain text unless asked.
    let plain = run(bulkhead()
        .arg("tokenize")
        .arg("--model")
        .arg(&model)
        .args(["--text", "<|im_start|>"]));
    let parsed = run(bulkhead().arg("tokenize").arg("--model").arg(&model).args([
        "--text",
        "<|im_start|>",
        "--parse-special",
    ]));
    assert_eq!(stdout(&parsed).trim(), "[1]");
    assert!(
        stdout(&plain).trim().len() > 3,
        "split into ordinary pieces"
    );
}

#[test]
fn refuses_a_missing_or_hostile_model_file_with_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("bulkhead-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = run(bulkhead().args([
        "tokenize",
        "--model",
        "/nonexistent/model.gguf",
        "--text",
        "x",
    ]));
    assert_clean_failure(&missing, "cannot read");

    let hostile = dir.join("hostile.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    bytes.extend_from_slice(&0u64.to_le_bytes());
    std::fs::write(&hostile, &bytes).unwrap();
    let out = run(bulkhead()
        .arg("generate")
        .arg("--model")
        .arg(&hostile)
        .args(["--prompt", "x"]));
    assert_clean_failure(&out, "absurd tensor count");

    let text = dir.join("not-a-model.gguf");
    std::fs::write(&text, "hello, I am not a model").unwrap();
    let out = run(bulkhead()
        .arg("generate")
        .arg("--model")
        .arg(&text)
        .args(["--prompt", "x"]));
    assert_clean_failure(&out, "bad magic");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn refuses_prompts_that_cannot_fit_and_bad_arguments() {
    let Some(model) = smollm2() else { return };
    let out = run(bulkhead().arg("generate").arg("--model").arg(&model).args([
        "--prompt",
        "hello",
        "--max-tokens",
        "9000",
    ]));
    assert_clean_failure(&out, "maximum context length is 8192");
    let out = run(bulkhead().arg("generate").arg("--model").arg(&model).args([
        "--prompt",
        "hello",
        "--temperature=-1",
    ]));
    assert_clean_failure(&out, "--temperature");
    let out = run(bulkhead()
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args(["--prompt", ""]));
    assert_clean_failure(&out, "empty");
    let both = run(bulkhead()
        .arg("generate")
        .arg("--model")
        .arg(&model)
        .args(["--prompt", "a", "--chat", "b"]));
    assert_eq!(both.status.code(), Some(2), "clap usage error");
}

/// `check` says where each model computes, and with `--backend cuda` on a
/// machine without a GPU refuses, naming what is missing (exit 1, no panic).
#[test]
fn check_names_each_models_backend_and_refuses_cuda_without_a_gpu() {
    let Some(_model) = smollm2() else { return };
    let demo = repo_root().join("policies/demo.toml");
    let out = run(bulkhead()
        .arg("check")
        .arg("--config")
        .arg(&demo)
        .args(["--backend", "cpu"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("model smollm2-135m-instruct: backend cpu"),
        "{}",
        stdout(&out)
    );
    let out = run(bulkhead()
        .arg("check")
        .arg("--config")
        .arg(&demo)
        .args(["--backend", "cuda"]));
    if out.status.success() {
        eprintln!("skipped: this machine can run the CUDA backend");
        return;
    }
    assert_clean_failure(
        &out,
        "backend cuda: no NVIDIA driver: libcuda.so.1 was not found",
    );
    let out = run(bulkhead()
        .arg("check")
        .arg("--config")
        .arg(&demo)
        .args(["--backend", "gpu"]));
    assert_eq!(
        out.status.code(),
        Some(2),
        "a value clap refuses: {}",
        stderr(&out)
    );
}

/// The GPU check's binary beside this build's `bulkhead` (`cargo test`
/// builds it, with the kernels' fault-injection and emulator features), or
/// `None`, reported as skipped, where it is missing and not required.
fn gpu_check_binary() -> Option<std::path::PathBuf> {
    let check = bulkhead_exe()
        .parent()
        .expect("target dir")
        .join("examples/gpu_check");
    if check.exists() {
        return Some(check);
    }
    assert!(
        std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
        "{} is missing",
        check.display()
    );
    eprintln!("skipped: {} is missing", check.display());
    None
}

/// The rows of the GPU check's final table (printed after its rows as
/// they were measured), its header left out.
fn table_rows(out: &str) -> Vec<&str> {
    out.lines()
        .skip_while(|l| !l.starts_with("| check |"))
        .filter(|l| l.starts_with("| ") && !l.starts_with("| check |"))
        .collect()
}

/// The server's part of the GPU check (`scripts/gpu_server_check.py`), run
/// here on the CPU with this build's binaries: its flow works end to end, and
/// without a GPU its `auto` row fails, naming the missing driver, as its
/// `eager` server's start does.
#[test]
fn the_gpu_checks_server_part_serves_and_says_when_auto_chose_no_gpu() {
    let Some(_model) = smollm2() else { return };
    let exe = bulkhead_exe();
    let Some(writer) = gpu_check_binary() else {
        return;
    };
    let check = |backends: &[&str]| {
        run(Command::new("python3")
            .arg(repo_root().join("scripts/gpu_server_check.py"))
            .args(backends)
            .env("BULKHEAD_BIN", &exe)
            .env("GPU_CHECK_BIN", &writer))
    };
    let out = check(&["cpu"]);
    let table = stdout(&out);
    assert!(out.status.success(), "{table}{}", stderr(&out));
    for row in [
        "| server --backend cpu: starts | ready in",
        "| server (cpu): greedy completion | 32 tokens in",
        "| server (cpu): greedy completion under penalties, biases and min_tokens | 32 tokens,",
        "| server (cpu): greedy completion with log probabilities | 32 tokens' log probabilities, 32 lists",
        "| server (cpu): prompt scored (echo, max_tokens 0) |",
        "| server (cpu): streamed chat completion | status 200,",
        "| server (cpu): a seeded sampled completion, twice | status [200, 200],",
    ] {
        let line = table.lines().find(|l| l.starts_with(row));
        assert!(
            line.is_some_and(|l| l.ends_with("| pass |")),
            "{row}: {table}"
        );
    }
    assert!(table.contains("server: 0 checks failed"), "{table}");
    let out = check(&["auto"]);
    let table = stdout(&out);
    if out.status.success() {
        eprintln!("skipped: this machine's auto chose the GPU");
        return;
    }
    let row = table
        .lines()
        .find(|l| l.starts_with("| server --backend auto: chooses the GPU |"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.ends_with("| FAIL |") && row.contains("backend auto chose cpu: no NVIDIA driver"),
        "{row}"
    );
    // `eager` (--backend cuda --enforce-eager --no-tensor-cores
    // --no-dependent-launches: every CUDA switch off) parses, and refuses
    // to start without a GPU.
    let out = check(&["eager"]);
    let table = stdout(&out);
    assert!(!out.status.success(), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("| server --backend cuda, every CUDA switch off: starts |"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.ends_with("| FAIL |") && row.contains("backend cuda: no NVIDIA driver"),
        "{row}"
    );
}

/// The GPU check's `--budget`: rows not begun within it are listed as not
/// measured, neither passed nor failed, and the table still ends whole (run
/// on the CPU emulator: `--dry-run`).
#[test]
fn the_gpu_check_lists_the_rows_past_its_budget_as_not_measured() {
    let Some(check) = gpu_check_binary() else {
        return;
    };
    let dry = |budget: &str| run(Command::new(&check).args(["--dry-run", "--budget", budget]));
    let required = std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_some();
    let out = dry("0");
    let table = stdout(&out);
    if table.contains("needs the emulator feature") && !required {
        eprintln!(
            "skipped: {} was built without the emulator",
            check.display()
        );
        return;
    }
    assert!(out.status.success(), "{table}{}", stderr(&out));
    let rows = table_rows(&table);
    assert!(rows.len() > 20, "{table}");
    for row in &rows {
        assert!(
            row.ends_with("| not measured: the check's budget of 0 s was spent |  |"),
            "{row}"
        );
    }
    for row in [
        "| device-to-device copy |",
        "| isolation |",
        "| tiny model: CPU vs CUDA |",
        "| decode batch 2 depth 40: the host's part |",
    ] {
        assert!(rows.iter().any(|r| r.starts_with(row)), "{row}: {table}");
    }
    assert!(
        table.contains(&format!(
            "{} rows not measured: the budget was spent",
            rows.len()
        )) && table.contains("0 checks failed"),
        "{table}"
    );
    let out = dry("soon");
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("--budget: \"soon\" is not a number of seconds"),
        "{}",
        stderr(&out)
    );
}

/// The GPU check's `--host-part`: the backend's own work a decode step,
/// with no kernel run, measured on any machine (here at the dry run's sizes).
#[test]
fn the_gpu_checks_host_part_times_steps_without_a_gpu() {
    let Some(check) = gpu_check_binary() else {
        return;
    };
    let out = run(Command::new(&check).args(["--host-part", "--dry-run"]));
    let table = stdout(&out);
    assert!(out.status.success(), "{table}{}", stderr(&out));
    let rows = table_rows(&table);
    // The dry run's batches (1, 2) at its depth (40), and nothing else.
    assert_eq!(rows.len(), 2, "{table}");
    for (row, batch) in rows.iter().zip([1, 2]) {
        let prefix = format!("| decode batch {batch} depth 40: the host's part | ");
        let us: f64 = row
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split(" us a step").next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{row}"));
        assert!(us > 0.0 && us < 1e6, "{row}");
    }
    assert!(!table.contains("FAIL"), "{table}");
}

#[test]
fn check_prints_the_capacity_table_and_refuses_a_broken_promise() {
    let Some(_model) = smollm2() else { return };
    let demo = repo_root().join("policies/demo.toml");
    let out = run(bulkhead().arg("check").arg("--config").arg(&demo));
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    for stage in [
        "promised context",
        "model context",
        "per-sequence page limit",
        "KV pool",
        "tenant alpha maximum",
        "tenant beta maximum",
    ] {
        assert!(table.contains(stage), "{stage}: {table}");
    }

    // The same policy promising more than the model's 8192 tokens.
    let dir = std::env::temp_dir().join(format!("bulkhead-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(&demo)
        .unwrap()
        .replace("context_tokens = 8192", "context_tokens = 16384")
        .replace(
            "../.cache",
            &repo_root().join(".cache").display().to_string(),
        );
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, text).unwrap();
    let out = run(bulkhead().arg("check").arg("--config").arg(&broken));
    assert_clean_failure(&out, "exceeds model context");
    assert!(
        stdout(&out).contains("NO"),
        "the table marks the stage: {}",
        stdout(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn check_with_a_role_prints_the_chain_through_both_processes() {
    let Some(model) = smollm2() else { return };
    let demo = repo_root().join("policies/demo.toml");
    let fingerprint = format!(
        "{:016x}",
        bulkhead_kernels::gguf::Gguf::open(&model)
            .unwrap()
            .fingerprint()
    );
    let out = run(bulkhead()
        .args(["check", "--role", "decode", "--config"])
        .arg(&demo));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let chain = text
        .split("chain of model smollm2-135m-instruct as role decode\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no chain for the model: {text}"));
    let lines: Vec<&str> = chain.lines().take(4).collect();
    for (line, stage) in lines.iter().zip(["front", "prefill", "transfer", "decode"]) {
        assert!(line.trim_start().starts_with(stage), "{stage}: {line}");
    }
    // What a peer must pair with, what travels, who the tenants are.
    assert!(lines[1].contains(&fingerprint), "{}", lines[1]);
    assert!(lines[1].contains("alpha=1"), "{}", lines[1]);
    assert!(
        lines[2].contains("512 pages"),
        "8191 tokens of 16: {}",
        lines[2]
    );
    assert!(lines[2].contains("360.0 KiB a page"), "{}", lines[2]);
    let out = run(bulkhead()
        .args(["check", "--role", "prefill", "--config"])
        .arg(&demo));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("421 prefill_only"),
        "{}",
        stdout(&out)
    );
    // One process: no chain.
    let out = run(bulkhead().args(["check", "--config"]).arg(&demo));
    assert!(!stdout(&out).contains("chain of model"), "{}", stdout(&out));
    let out = run(bulkhead()
        .args(["check", "--role", "sideways", "--config"])
        .arg(&demo));
    assert_eq!(out.status.code(), Some(2), "clap refuses an unknown role");
}

/// A fresh temporary folder for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bulkhead-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn sha256(path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    assert!(out.status.success(), "sha256sum: {}", stderr(&out));
    stdout(&out).split_whitespace().next().unwrap().to_string()
}

fn quantize(input: &Path, output: &Path) -> Output {
    run(bulkhead()
        .args(["quantize", "--to", "q8_0"])
        .arg(input)
        .arg(output))
}

/// Neither OUT nor its temporary `OUT.partial` exists.
fn assert_nothing_at(output: &Path) {
    let mut partial = output.as_os_str().to_owned();
    partial.push(".partial");
    for path in [output.to_path_buf(), PathBuf::from(partial)] {
        assert!(!path.exists(), "{} was left behind", path.display());
    }
}

#[test]
fn quantize_to_q8_0_writes_the_pinned_file_and_it_generates() {
    let Some(model) = smollm2() else { return };
    let script = std::fs::read_to_string(repo_root().join("scripts/models.sh")).unwrap();
    assert!(
        script.contains(&format!("q8_sha256=\"{Q8_0_SHA256}\"")),
        "scripts/models.sh pins the same digest as this test"
    );
    let dir = temp_dir("quantize");
    let output = dir.join("model.Q8_0.gguf");
    let out = quantize(&model, &output);
    assert!(out.status.success(), "{}", stderr(&out));
    let report = stderr(&out);
    assert!(
        report.contains("converted to Q8_0: 210 (Q4_1: 210)"),
        "{report}"
    );
    assert!(
        report.contains("kept as they were: 62 (Q8_0: 1, F32: 61)"),
        "{report}"
    );
    assert_eq!(sha256(&output), Q8_0_SHA256, "deterministic output");
    assert!(!dir.join("model.Q8_0.gguf.partial").exists());

    let out = run(bulkhead()
        .arg("generate")
        .arg("--model")
        .arg(&output)
        .args([
            "--chat",
            "Name three primary colors.",
            "--max-tokens",
            "32",
            "--threads",
            "2",
        ]));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        ["Red", "Blue", "Yellow"].iter().all(|c| text.contains(c)),
        "a coherent answer: {text:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_refuses_hostile_and_non_gguf_files_and_leaves_nothing() {
    let dir = temp_dir("quantize-hostile");
    let output = dir.join("out.gguf");

    let text = dir.join("not-a-model.gguf");
    std::fs::write(&text, "hello, I am not a model").unwrap();
    assert_clean_failure(&quantize(&text, &output), "bad magic");
    assert_nothing_at(&output);

    let mut hostile = b"GGUF".to_vec();
    hostile.extend_from_slice(&3u32.to_le_bytes());
    hostile.extend_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    hostile.extend_from_slice(&0u64.to_le_bytes());
    let hostile_path = dir.join("hostile.gguf");
    std::fs::write(&hostile_path, &hostile).unwrap();
    assert_clean_failure(&quantize(&hostile_path, &output), "absurd tensor count");
    assert_nothing_at(&output);

    assert_clean_failure(&quantize(&dir.join("missing.gguf"), &output), "cannot read");
    assert_nothing_at(&output);

    // A well-formed file that fails half-way, after OUT.partial was created: a
    // 32x1 F32 matrix holding a NaN, which Q8_0 cannot carry.
    let nan = dir.join("nan.gguf");
    std::fs::write(&nan, gguf_with_one_f32_matrix(f32::NAN)).unwrap();
    assert_clean_failure(&quantize(&nan, &output), "not finite");
    assert_nothing_at(&output);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_refuses_to_write_over_its_input() {
    let dir = temp_dir("quantize-self");
    let input = dir.join("in.gguf");
    let bytes = gguf_with_one_f32_matrix(0.5);
    std::fs::write(&input, &bytes).unwrap();
    // The same file by its own name, by another spelling, and as the temporary
    // file of an output named without the suffix.
    let spelled = dir.join(".").join("in.gguf");
    for output in [input.clone(), spelled] {
        assert_clean_failure(&quantize(&input, &output), "over the input");
    }
    let partial = dir.join("out.gguf.partial");
    std::fs::write(&partial, &bytes).unwrap();
    assert_clean_failure(&quantize(&partial, &dir.join("out.gguf")), "over the input");
    assert!(!dir.join("out.gguf").exists());
    assert_eq!(
        std::fs::read(&input).unwrap(),
        bytes,
        "the input is untouched"
    );
    assert_eq!(
        std::fs::read(&partial).unwrap(),
        bytes,
        "the input is untouched"
    );

    // The refusal is about identity: a different output works.
    let out = quantize(&input, &dir.join("out.gguf"));
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GGUF file with no metadata and one 32x1 F32 tensor "w" whose first weight
/// is `first` (the rest 0.25), laid out by hand as in the GGUF spec.
fn gguf_with_one_f32_matrix(first: f32) -> Vec<u8> {
    const ALIGNMENT: usize = 32;
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes()); // version
    bytes.extend_from_slice(&1u64.to_le_bytes()); // tensor count
    bytes.extend_from_slice(&0u64.to_le_bytes()); // metadata count
    bytes.extend_from_slice(&1u64.to_le_bytes()); // name length
    bytes.extend_from_slice(b"w");
    bytes.extend_from_slice(&2u32.to_le_bytes()); // dimensions
    bytes.extend_from_slice(&32u64.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes()); // F32
    bytes.extend_from_slice(&0u64.to_le_bytes()); // offset in the data section
    bytes.resize(bytes.len().next_multiple_of(ALIGNMENT), 0);
    bytes.extend_from_slice(&first.to_le_bytes());
    for _ in 1..32 {
        bytes.extend_from_slice(&0.25f32.to_le_bytes());
    }
    bytes
}

#[test]
fn serve_model_serves_one_file_to_one_tenant_with_a_policy_derived_from_it() {
    let Some(model) = smollm2() else { return };
    let store = temp_dir("single-model");
    // `check --model` prints the derived policy and checks it.
    let out = run(bulkhead()
        .args(["check", "--model"])
        .arg(&model)
        .args(["--memory-max", "1 GiB", "--store"])
        .arg(&store));
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    for line in [
        "id = \"smollm2-135m-instruct.q4_1\"",
        "context_tokens = 8192  # the file holds 8192",
        "[tenants.default]",
        "ok: 1 models",
    ] {
        assert!(text.contains(line), "{line:?} missing from\n{text}");
    }
    // A budget that cannot hold the weights: refused, saying what to give.
    let out = run(bulkhead()
        .args(["check", "--model"])
        .arg(&model)
        .args(["--memory-max", "64 MiB"]));
    assert_clean_failure(&out, "give --memory-max more");

    // A key too short to be a secret is refused by the flag's own name.
    let out = run(bulkhead()
        .args(["serve", "--model"])
        .arg(&model)
        .args(["--api-key", "short", "--store"])
        .arg(&store));
    assert_clean_failure(&out, "--api-key has 5 bytes");
    // `serve --model --api-key`: that key works at once.
    let key = "single-model-key-0123456789abcdef";
    let mut child = bulkhead()
        .args(["serve", "--model"])
        .arg(&model)
        .args(["--api-key", key, "--memory-max", "1 GiB", "--store"])
        .arg(&store)
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("BULKHEAD_ADMIN_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read stderr to its end (a closed pipe would fail the server's writes).
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr_pipe = std::io::BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(stderr_pipe).map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("listening: inference ") {
                let _ = tx.send(url.to_string());
            }
        }
    });
    let inference = rx.recv_timeout(std::time::Duration::from_secs(120)).ok();
    let inference = inference.expect("the server listens");
    let agent = ureq::AgentBuilder::new()
        .timeout(std::time::Duration::from_secs(120))
        .build();
    let answer = agent
        .post(&format!("{inference}/v1/chat/completions"))
        .set("Authorization", &format!("Bearer {key}"))
        .send_string(
            r#"{"model":"smollm2-135m-instruct.q4_1","messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#,
        )
        .unwrap()
        .into_string()
        .unwrap();
    assert!(answer.contains("\"completion_tokens\":"), "{answer}");
    let wrong = agent
        .get(&format!("{inference}/v1/models"))
        .set("Authorization", "Bearer not-the-key-0123456789abcdef")
        .call();
    assert!(matches!(wrong, Err(ureq::Error::Status(401, _))));
    let _ = child.kill();
    let _ = child.wait();
    // The admin token was generated and shown once, on stdout.
    let mut shown = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut shown).unwrap();
    assert!(shown.contains("admin token (generated"), "{shown}");
    assert!(!shown.contains(key), "{shown}");
    std::fs::remove_dir_all(&store).unwrap();
}

/// `check` sizes KV by the file's own geometry: a qwen3 model whose heads are
/// 32 wide (its `attention.key_length`), not embedding / heads = 16, needs
/// 2 layers x (K, V) x 2 KV heads x 32 x 2 bytes = 512 bytes per position, so
/// the derived pool of 64 pages of 16 positions holds 512 KiB.
#[test]
fn check_sizes_kv_by_the_files_own_head_width() {
    let dir = temp_dir("qwen3-geometry");
    let model = dir.join("qwen3.gguf");
    std::fs::write(
        &model,
        bulkhead_kernels::testing::conformance_model("qwen3-f32"),
    )
    .unwrap();
    let out = run(bulkhead().arg("check").arg("--model").arg(&model));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("pool_pages = 64"), "{text}");
    let memory = text
        .lines()
        .find(|l| l.trim_start().starts_with("qwen3 "))
        .unwrap_or_else(|| panic!("no memory row: {text}"));
    assert!(memory.contains("512.0 KiB"), "{memory}");
    assert!(
        text.contains("model qwen3: qwen3, 2 layers, 4 query and 2 KV heads of width 32\n"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `check` says which of a Gemma 2 model's layers are local and what they
/// see (the conformance model: layer 0 of 2 local, a window of 8).
#[test]
fn check_names_a_models_local_layers_and_their_window() {
    let dir = temp_dir("gemma2-window");
    let model = dir.join("gemma2.gguf");
    std::fs::write(
        &model,
        bulkhead_kernels::testing::conformance_model("gemma2-f32"),
    )
    .unwrap();
    let out = run(bulkhead().arg("check").arg("--model").arg(&model));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("model gemma2: gemma2, 2 layers, 4 query and 2 KV heads of width 16; 1 of 2 layers local, attending to the last 8 positions"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
