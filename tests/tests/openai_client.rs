//! The official `openai` Python client (from PyPI) against `bulkhead serve`:
//! chat, streaming, completions and the errors a new user meets first.

mod support;

use std::process::Command;
use support::*;

fn openai_importable() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
            "BULKHEAD_REQUIRE_MODEL is set but the Python `openai` package is missing: \
             pip install -r scripts/requirements.txt"
        );
        eprintln!("skipped: the Python `openai` package is not installed");
    }
    ok
}

#[test]
fn the_official_openai_python_client_works_against_the_server() {
    let Some(model) = smollm2() else { return };
    if !openai_importable() {
        return;
    }
    let server = start(&model, &Policy::default());
    let out = Command::new("python3")
        .arg(repo_root().join("scripts/openai_client_check.py"))
        .args([&server.inference, KEY_ALPHA, MODEL_ID])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout.trim(), "ok");
}
