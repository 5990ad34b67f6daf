//! The control plane over a real sled store and a real engine (a tiny
//! generated model), with the store's commits made to fail on demand: a change
//! whose commit fails leaves the engine and the registry as they were, and a
//! crash between the engine change and the commit is repaired by the next
//! start, which builds the engine from the store.

use bulkhead::catalog::{self, Catalog, Source};
use bulkhead::config::Config;
use bulkhead::engine::request::{FinishReason, RequestId, Usage};
use bulkhead::engine::scheduler::FinishSink;
use bulkhead::engine::service::{EngineHandle, TenantChange};
use bulkhead::policy::PolicyRuntime;
use bulkhead::store::sled_storage::SledStorage;
use bulkhead::store::usage::UsageBook;
use bulkhead::store::{Entry, Expect, Storage, Store, StoreError, Write};
use bulkhead::tenancy::control::{
    self, Actor, Control, ControlError, Parts, TenantPatch, TenantRef,
};
use bulkhead::tenancy::seed;
use bulkhead::tenancy::{Directory, ModelAccess, Quota, Registry, TenantId};
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// sled, with commits that fail while `fail` is set (a full disk, say).
struct Flaky {
    inner: SledStorage,
    fail: Arc<AtomicBool>,
}

impl Storage for Flaky {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Entry>, StoreError> {
        self.inner.scan(prefix, after, limit)
    }
    fn last(&self, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        self.inner.last(prefix)
    }
    fn commit_if(&self, expect: &[Expect], writes: Vec<Write>) -> Result<(), StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Io("no space left on device (planted)".into()));
        }
        self.inner.commit_if(expect, writes)
    }
}

const POLICY: &str = r#"
[[models]]
id = "tiny"
path = "tiny.gguf"
context_tokens = 32
threads = 1
page_tokens = 8
pool_pages = 32
seq_pages_max = 8
step_tokens_max = 64
step_seqs_max = 4

[tenants.alpha]
pages_reserved = 8
pages_max = 16
key_env = "KEY_ALPHA"

[tenants.beta]
pages_reserved = 8
pages_max = 16
"#;

const KEY_ALPHA: &str = "alpha-secret-0123456789abcdef";

struct Plane {
    control: Control,
    fail: Arc<AtomicBool>,
}

impl Plane {
    /// The engine of the policy's one model.
    fn engine(&self) -> EngineHandle {
        let snapshot = self.control.catalog().snapshot();
        snapshot.get("tiny").expect("loaded").engine.clone()
    }

    /// Stops every engine, as the server does at exit.
    fn stop(&self) {
        for (_, service) in self.control.catalog().take_all() {
            service.shutdown(std::time::Duration::ZERO, FinishReason::Shutdown);
        }
    }
}

/// Nobody listens for request ends here.
struct NoSink;

impl FinishSink for NoSink {
    fn finished(&self, _: RequestId, _: TenantId, _: FinishReason, _: Usage) {}
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bulkhead-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Opens the store in `dir` and starts everything from it, as `serve` does:
/// the policy's model (a tiny generated one, written next to the policy) goes
/// through the catalog's one load path.
fn start(dir: &Path) -> Plane {
    let mut config = Config::parse(POLICY).unwrap();
    config.source = dir.join("policy.toml");
    let model_file = dir.join("tiny.gguf");
    if !model_file.exists() {
        std::fs::write(&model_file, tiny_llama(&TinySpec::default())).unwrap();
    }
    let config = Arc::new(config);
    let fail = Arc::new(AtomicBool::new(false));
    let storage = Flaky {
        inner: SledStorage::open(&dir.join("store")).unwrap(),
        fail: Arc::clone(&fail),
    };
    let store =
        Arc::new(Store::with_storage(Box::new(storage), dir.display().to_string()).unwrap());
    let env = |var: &str| match var {
        "KEY_ALPHA" => Some(KEY_ALPHA.to_string()),
        "BULKHEAD_ADMIN_TOKEN" => Some("admin-token-0123456789abcdef0123456789".to_string()),
        _ => None,
    };
    seed::seed_if_empty(&config, &store).unwrap();
    seed::plan(&config, &store, env)
        .unwrap()
        .commit(&store)
        .unwrap();
    let tenants = store.tenants().unwrap();
    let catalog = Arc::new(Catalog::default());
    let sink: Arc<dyn FinishSink> = Arc::new(NoSink);
    for spec in config.model_specs() {
        let loaded = catalog::load(
            spec,
            Source::Policy,
            &tenants,
            Arc::clone(&sink),
            bulkhead::transfer::Role::Both,
            &bulkhead::config::EngineConfig {
                backend: bulkhead::engine::placement::BackendChoice::Cpu,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        catalog.insert(loaded);
    }
    let registry = Arc::new(Registry::new(Directory::build(
        &tenants,
        &store.keys().unwrap(),
        None,
    )));
    let policy = PolicyRuntime::new(&config, Arc::clone(&store), dir).unwrap();
    let control = Control::new(Parts {
        store,
        registry,
        catalog,
        policy,
        usage: Arc::new(UsageBook::default()),
        config,
        finishes: sink,
        tenants,
        admin_token_sha256: [7; 32],
    });
    Plane { control, fail }
}

fn quota(pages_reserved: u32, pages_max: u32) -> Quota {
    Quota {
        weight: 1,
        pages_reserved,
        pages_max,
        queue_depth_max: 4,
        running_max: 2,
        pending_max: 2,
        prefix_cache: true,
    }
}

/// Whether the engine serves tenant `id`, from the stats it publishes after
/// every loop turn (polled: a change shows up within a turn or two).
async fn engine_has(plane: &Plane, id: TenantId) -> bool {
    engine_settles_on(plane, id, true).await
}

/// Whether the engine does not serve tenant `id` (polled likewise: stats
/// published before an undo may still show it for a turn).
async fn engine_lacks(plane: &Plane, id: TenantId) -> bool {
    engine_settles_on(plane, id, false).await
}

/// Whether the engine's published stats show tenant `id` present as `want`
/// within a second.
async fn engine_settles_on(plane: &Plane, id: TenantId, want: bool) -> bool {
    let handle = plane.engine();
    let present = || handle.stats().tenants.iter().any(|t| t.id == id.0);
    for _ in 0..40 {
        if present() == want {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    present() == want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_leaves_the_engine_and_the_registry_as_they_were() {
    let dir = temp_dir("control-undo");
    let plane = start(&dir);
    let actor = Actor::Admin;
    let next_id = plane.control.store().tenant_id_next().unwrap();

    plane.fail.store(true, Ordering::SeqCst);
    let created = plane
        .control
        .create_tenant(&actor, "gamma", quota(4, 8), ModelAccess::All, None)
        .await;
    assert!(
        matches!(created, Err(ControlError::Store(_))),
        "{created:?}"
    );
    plane.fail.store(false, Ordering::SeqCst);
    assert!(
        engine_lacks(&plane, TenantId(next_id)).await,
        "the engine change was undone"
    );
    assert!(plane
        .control
        .registry()
        .snapshot()
        .by_name("gamma")
        .is_none());
    assert_eq!(plane.control.tenants().unwrap().len(), 2);

    // A quota change whose commit fails: the engine goes back to the old limits.
    let before = plane.control.tenant(TenantRef::Name("beta")).unwrap();
    plane.fail.store(true, Ordering::SeqCst);
    let patch = TenantPatch {
        pages_max: Some(8),
        ..TenantPatch::default()
    };
    assert!(plane
        .control
        .update_tenant(&actor, TenantRef::Name("beta"), patch)
        .await
        .is_err());
    plane.fail.store(false, Ordering::SeqCst);
    assert_eq!(
        plane.control.tenant(TenantRef::Name("beta")).unwrap().quota,
        before.quota
    );

    // A deletion whose commit fails: the tenant is served again, key included.
    plane.fail.store(true, Ordering::SeqCst);
    assert!(plane
        .control
        .delete_tenant(&actor, TenantRef::Name("alpha"))
        .await
        .is_err());
    plane.fail.store(false, Ordering::SeqCst);
    let alpha = plane
        .control
        .registry()
        .authenticate(KEY_ALPHA)
        .expect("alpha is back");
    assert_eq!(alpha.name, "alpha");
    assert!(engine_has(&plane, alpha.id).await);

    // And with the disk back, the same changes go through.
    plane
        .control
        .create_tenant(&actor, "gamma", quota(4, 8), ModelAccess::All, None)
        .await
        .unwrap();
    assert!(engine_has(&plane, TenantId(next_id)).await);
    plane.stop();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_engine_and_store_is_repaired_by_the_next_start() {
    let dir = temp_dir("control-crash");
    let plane = start(&dir);
    let actor = Actor::Admin;
    plane
        .control
        .create_tenant(&actor, "gamma", quota(4, 8), ModelAccess::All, None)
        .await
        .unwrap();
    let gamma = plane
        .control
        .registry()
        .snapshot()
        .by_name("gamma")
        .unwrap()
        .id;
    // The crash: the engine has applied a change (delta added, gamma's
    // maximum lowered) that the store never recorded, and the process dies.
    let next_id = plane.control.store().tenant_id_next().unwrap();
    let limits = |id: u32, name: &str, max: u32| bulkhead::engine::scheduler::TenantLimits {
        id: TenantId(id),
        name: name.into(),
        weight: 1,
        queue_depth_max: 4,
        running_max: 2,
        pages_reserved: 0,
        pages_max: max,
        prefix_cache: true,
    };
    let handle = plane.engine();
    handle
        .change_tenant(TenantChange::Add(limits(next_id, "delta", 8)))
        .await
        .unwrap();
    handle
        .change_tenant(TenantChange::Update(limits(gamma.0, "gamma", 4)))
        .await
        .unwrap();
    plane.stop();
    drop(plane.control);

    // The next start builds the engine from the store: what was acknowledged.
    let plane = start(&dir);
    assert!(
        engine_lacks(&plane, TenantId(next_id)).await,
        "delta was never committed"
    );
    let gamma_now = plane.control.tenant(TenantRef::Name("gamma")).unwrap();
    assert_eq!(gamma_now.quota, quota(4, 8));
    assert!(engine_has(&plane, gamma).await);
    let names: Vec<String> = plane
        .control
        .tenants()
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["alpha", "beta", "gamma"]);
    // The id the lost change used is handed out again: it never left the process.
    let delta = plane
        .control
        .create_tenant(&actor, "delta", quota(0, 8), ModelAccess::All, None)
        .await
        .unwrap();
    assert_eq!(delta.id, next_id);
    plane.stop();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issuing_and_revoking_keys_forever_keeps_a_bounded_number_of_records() {
    let dir = temp_dir("control-keys");
    let plane = start(&dir);
    let actor = Actor::Tenant("beta".into());
    let beta = TenantRef::Name("beta");
    for _ in 0..control::KEY_RECORDS_PER_TENANT_MAX + 20 {
        let issued = plane.control.issue_key(&actor, beta).await.unwrap();
        plane
            .control
            .revoke_key(&actor, beta, &issued.key.id)
            .await
            .unwrap();
    }
    let keys = plane.control.keys(beta).unwrap();
    assert!(
        keys.len() <= control::KEY_RECORDS_PER_TENANT_MAX,
        "{}",
        keys.len()
    );
    assert_eq!(
        keys.iter().filter(|k| k.revoked_ms.is_none()).count(),
        1,
        "the generated key"
    );
    // Live keys have their own cap.
    for _ in 1..control::KEYS_PER_TENANT_MAX {
        plane.control.issue_key(&actor, beta).await.unwrap();
    }
    assert!(matches!(
        plane.control.issue_key(&actor, beta).await,
        Err(ControlError::TooMany { .. })
    ));
    plane.stop();
    std::fs::remove_dir_all(&dir).unwrap();
}
