//! The README's and docs/plugins.md's shell examples, run as written against
//! the demo policy, so the documentation cannot drift from the product.
//!
//! A fenced `sh` block that follows the line `<!-- example -->` is an example:
//! each runs, in the documents' order, in one bash with `set -euo pipefail`,
//! in a folder laid out like a clone (`policies/`, `.cache/models/`,
//! `target/release/bulkhead`, `plugins/`, `scripts/`), with the environment
//! the README's Serving section sets. What differs from a reader's shell:
//! the listeners are on free ports (the examples' 127.0.0.1:8080 and :8081
//! are rewritten to them), and `curl` fails on an HTTP error
//! (`--fail-with-body`), so an example that answers 4xx fails the test with
//! the server's answer.

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use support::{bulkhead_exe, repo_root, smollm2, smollm2_q8, ADMIN_TOKEN, KEY_ALPHA, KEY_BETA};

/// The line that marks the next `sh` block as an example.
const MARK: &str = "<!-- example -->";

/// The examples of one document: (the line its block starts on, its text).
fn examples(document: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(document).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    let mut at = 0;
    while at < lines.len() {
        if lines[at].trim() == MARK {
            let fence = at + 1;
            assert_eq!(
                lines.get(fence).map(|l| l.trim()),
                Some("```sh"),
                "{}:{}: an example mark not followed by a ```sh block",
                document.display(),
                at + 1
            );
            let end = (fence + 1..lines.len())
                .find(|&i| lines[i].trim() == "```")
                .expect("the example's block ends");
            found.push((fence + 2, lines[fence + 1..end].join("\n")));
            at = end;
        }
        at += 1;
    }
    found
}

/// A folder laid out like a clone, its big parts linked to this one's.
fn clone_like(dir: &Path) {
    let root = repo_root();
    let link = |from: &Path, to: &str| {
        let to = dir.join(to);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(from, to).unwrap();
    };
    link(&root.join(".cache/models"), ".cache/models");
    link(&bulkhead_exe(), "target/release/bulkhead");
    link(&root.join("plugins"), "plugins");
    link(&root.join("scripts"), "scripts");
    link(&root.join("wit"), "wit");
    std::fs::create_dir_all(dir.join("policies")).unwrap();
    std::fs::copy(
        root.join("policies/demo.toml"),
        dir.join("policies/demo.toml"),
    )
    .unwrap();
}

/// `bulkhead serve --config policies/demo.toml` in `dir`, on free ports.
struct Demo {
    child: Child,
    inference: String,
    admin: String,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve_demo(dir: &Path) -> Demo {
    let mut child = Command::new(dir.join("target/release/bulkhead"))
        .current_dir(dir)
        .args(["serve", "--config", "policies/demo.toml"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env("BULKHEAD_KEY_ALPHA", KEY_ALPHA)
        .env("BULKHEAD_KEY_BETA", KEY_BETA)
        .env("BULKHEAD_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("server: {line}");
            if let Some(rest) = line.strip_prefix("listening: ") {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    let (mut inference, mut admin) = (None, None);
    while inference.is_none() || admin.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the demo server starts");
        let (name, url) = line.split_once(' ').unwrap();
        let url = url.trim_start_matches("http://").to_string();
        match name {
            "inference" => inference = Some(url),
            "admin" => admin = Some(url),
            other => panic!("unknown listener {other}"),
        }
    }
    Demo {
        child,
        inference: inference.unwrap(),
        admin: admin.unwrap(),
    }
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bulkhead-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_example_in_the_readme_and_the_plugin_guide_works_as_written() {
    let Some(_) = smollm2() else { return };
    let Some(_) = smollm2_q8() else { return };
    if Command::new("curl").arg("--version").output().is_err() {
        // scripts/test.sh installs curl; a bare `cargo test` may lack it.
        assert!(
            std::env::var_os("BULKHEAD_REQUIRE_MODEL").is_none(),
            "curl is missing"
        );
        eprintln!("skipped: curl is missing");
        return;
    }
    let root = repo_root();
    let mut blocks = Vec::new();
    for document in ["README.md", "docs/plugins.md"] {
        for (line, text) in examples(&root.join(document)) {
            blocks.push((format!("{document}:{line}"), text));
        }
    }
    // Every example section is marked: losing a mark would silently stop
    // testing its block.
    assert!(blocks.len() >= 6, "only {} examples found", blocks.len());
    let dir = temp_dir();
    clone_like(&dir);
    let demo = serve_demo(&dir);
    for (at, text) in &blocks {
        let script = text
            .replace("127.0.0.1:8080", &demo.inference)
            .replace("127.0.0.1:8081", &demo.admin);
        eprintln!("example at {at}");
        let out = Command::new("bash")
            .current_dir(&dir)
            .arg("-c")
            .arg(format!(
                "set -euo pipefail\n\
                 curl() {{ command curl --fail-with-body --show-error \"$@\"; }}\n\
                 set -x\n{script}"
            ))
            .env("BULKHEAD_KEY_ALPHA", KEY_ALPHA)
            .env("BULKHEAD_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("BULKHEAD_ADMIN_URL", format!("http://{}", demo.admin))
            .output()
            .expect("bash runs");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "the example at {at} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            out.status
        );
    }
    drop(demo);
    let _ = std::fs::remove_dir_all(&dir);
}
