//! A real etcd (Debian's `etcd-server`) for the many-server tests: one
//! member on loopback ports, its data in a temporary folder, killed and
//! removed when dropped. `scripts/setup.sh` installs it; without it the
//! tests that need it report themselves skipped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a fresh member may take to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Etcd {
    child: Option<Child>,
    pub client_url: String,
    client_port: u16,
    peer_port: u16,
    pub dir: PathBuf,
}

/// A port free now (the member binds it a moment later).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The etcd binary, when installed.
pub fn etcd_exe() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("etcd"))
        .find(|exe| exe.is_file())
}

impl Etcd {
    /// Starts a member, or None (reported as skipped by the caller) when
    /// etcd is not installed.
    pub fn start(tag: &str) -> Option<Etcd> {
        etcd_exe()?;
        let dir = super::temp_dir(&format!("etcd-{tag}"));
        let mut etcd = Etcd {
            child: None,
            client_url: String::new(),
            client_port: free_port(),
            peer_port: free_port(),
            dir,
        };
        etcd.client_url = format!("http://127.0.0.1:{}", etcd.client_port);
        etcd.run();
        Some(etcd)
    }

    /// Starts (or starts again) the member on its ports and folder, and
    /// waits until it answers.
    pub fn run(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(etcd_exe().expect("etcd is installed"))
            .args(["--name", "bulkhead-test"])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.client_url])
            .args(["--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("bulkhead-test={peer}")])
            .args(["--max-txn-ops", "1024"])
            .args(["--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let health = ureq::get(&format!("{}/health", self.client_url))
                .timeout(Duration::from_secs(1))
                .call();
            if health.is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "etcd did not answer in time");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: no goodbye to its clients, nothing flushed but what etcd
    /// already made durable.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The `[store]` lines of a policy on this member under `prefix`.
    pub fn store_toml(&self, prefix: &str) -> String {
        format!(
            "backend = \"etcd\"\n[store.etcd]\nendpoints = [\"{}\"]\nprefix = \"{prefix}\"\ntxn_ops_max = 1024\ntimeout_ms = 1000\n",
            self.client_url
        )
    }

    /// The options of a store on this member under `prefix`.
    pub fn options(&self, prefix: &str) -> bulkhead::store::etcd_storage::EtcdOptions {
        bulkhead::store::etcd_storage::EtcdOptions {
            endpoints: vec![self.client_url.clone()],
            prefix: prefix.into(),
            timeout_ms: 1000,
            txn_ops_max: 1024,
            ..Default::default()
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
