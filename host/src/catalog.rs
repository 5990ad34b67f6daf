//! The catalog: the models a server serves, each with its own engine.
//!
//! 1. **Sources.** The policy's `[[models]]` load at every start, in policy
//!    order; models added through the admin API are stored ([`ModelRecord`](crate::store::records::ModelRecord))
//!    and load after them, in id order. An id names one model across both.
//! 2. **Load** ([`load`]): map the GGUF file, build its tokenizer and chat
//!    template, check the model's capacity contract with the tenants that may
//!    use it (I2), then build its engine through [`build::scheduler`] — its own
//!    KV pool with a partition for each of those tenants, its backend, its
//!    scheduler on its own thread. Pages of one model's pool are never another's:
//!    every handle carries its pool's id, and an [`Admission`] only admits for
//!    its own model's pool.
//! 3. **Lookup.** The request path reads one immutable snapshot
//!    ([`Catalog::snapshot`]): a model is there whole, or not at all.
//! 4. **Unload** ([`Catalog::take`], then [`EngineService::shutdown`]): the
//!    model leaves the snapshot first (new requests get 404), its engine stops
//!    accepting, in-flight requests run until the drain deadline and the rest
//!    end with `model_removed`; the engine thread drops the pool, backend and
//!    mapped weights when it exits.
//! 5. **Memory.** Every model's weights and KV pool count against
//!    `engine.memory_max` ([`MemoryBudget`]), checked from the file headers
//!    before anything is allocated.

use crate::capacity::{Capacity, CapacityViolation, MemoryBudget, ModelMemory};
use crate::config::ModelSpec;
use crate::engine::admission::Admission;
use crate::engine::build::{self, EngineSpec};
use crate::engine::chat::ChatTemplate;
use crate::engine::placement::{self, BackendChoice, CudaSwitches, Placement, PlacementError};
use crate::engine::scheduler::{FinishSink, TenantLimits};
use crate::engine::service::{EngineHandle, EngineService, RestartPolicy, Supervision};
use crate::engine::stats::EngineTotals;
use crate::store::records::TenantRecord;
use crate::tenancy::{Quota, TenantId};
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::PoolOptions;
use bulkhead_kernels::model::{Model, ModelConfig};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// Where a model of the catalog comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The policy file's `[[models]]`: loaded at every start; removing it
    /// through the admin API lasts until the next start.
    Policy,
    /// Added through the admin API: stored, loaded at every start until removed.
    Admin,
}

/// Why a model could not be loaded. Nothing of it stays loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file is missing, unreadable, hostile, or not a model this engine runs.
    #[error("model {id}: {path}: {message}")]
    File {
        /// The model's id.
        id: String,
        /// Its file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// Its capacity contract does not hold (the message names the limit).
    #[error(transparent)]
    Capacity(#[from] CapacityViolation),
    /// Its engine could not be built (KV pool geometry, a partition).
    #[error("model {id}: engine: {message}")]
    Engine {
        /// The model's id.
        id: String,
        /// What went wrong.
        message: String,
    },
    /// Its backend cannot run here (`cuda` without a driver, a device or NVRTC).
    #[error("model {id}: {error}")]
    Backend {
        /// The model's id.
        id: String,
        /// What is missing.
        error: PlacementError,
    },
    /// The engine thread could not start.
    #[error("model {id}: {cause}")]
    Thread {
        /// The model's id.
        id: String,
        /// The cause.
        cause: std::io::Error,
    },
}

/// One loaded model, as the request path uses it.
pub struct Served {
    /// What was loaded (its path resolved).
    pub spec: ModelSpec,
    /// Where it comes from.
    pub source: Source,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// `tokenizer.text_bytes_per_token_max()`: a prompt's bytes over this are
    /// the fewest tokens it can be.
    pub text_bytes_per_token_max: u64,
    /// Its chat template, if it has one that compiles.
    pub template: Option<ChatTemplate>,
    /// The static admission check for its pool.
    pub admission: Admission,
    /// Its engine thread.
    pub engine: EngineHandle,
    /// The context its file holds (for its capacity contract).
    pub file_context_tokens: u64,
    /// Its weights and KV pool.
    pub memory: ModelMemory,
    /// Unix seconds when it was loaded (the `created` of `/v1/models`).
    pub created: u64,
    /// Its part in disaggregation (none with role `both`).
    pub transfer: Option<ModelTransfer>,
    /// Where it computes.
    pub placement: Placement,
    /// That in words, with the backend's modes where it has them ("cpu",
    /// "cuda (NVIDIA H200, sm_90): graphs on, ...").
    pub backend: String,
}

/// A model's transfer state with role `prefill` or `decode`.
pub struct ModelTransfer {
    /// What it pairs as (fingerprint, page shape, context, tenants at load).
    pub pairing: Arc<crate::transfer::wire::Pairing>,
    /// Decode role: the scheduler's prefill jobs, until the link takes them.
    pub jobs:
        Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<crate::engine::handoff::PrefillRequest>>>,
    /// Decode role: whether a prefill peer pairs.
    pub link: Arc<crate::transfer::DecodeLink>,
    /// Whether this is the decode side.
    pub decode: bool,
}

/// A model loaded, its engine running, not yet in a catalog.
pub struct Loaded {
    /// What requests use.
    pub served: Arc<Served>,
    /// Its engine thread, to shut down at unload.
    pub service: EngineService,
}

/// What a model's file says before anything is allocated: the numbers its
/// capacity contract and memory need.
pub struct Inspected {
    /// The context the file holds.
    pub file_context_tokens: u64,
    /// Its weights and KV pool.
    pub memory: ModelMemory,
    /// Its pool's page shape (what a transfer's pages are).
    pub shape: bulkhead_kernels::kv::PageShape,
    /// Where it would compute.
    pub placement: Placement,
    /// Its blueprint in a line ([`ModelConfig::describe`]).
    pub blueprint: String,
}

fn file_error(spec: &ModelSpec, message: impl ToString) -> LoadError {
    LoadError::File {
        id: spec.id.clone(),
        path: spec.path.display().to_string(),
        message: message.to_string(),
    }
}

/// Refuses a path that is not a regular file before opening it (a FIFO or a
/// device would block or never end).
fn regular_file(spec: &ModelSpec) -> Result<(), LoadError> {
    match std::fs::metadata(&spec.path) {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(_) => Err(file_error(spec, "not a regular file")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(file_error(
            spec,
            "no such file: fix the model's `path` (a relative one resolves against the policy file's folder) or put the file there (the demo's two models: scripts/setup.sh, then scripts/models.sh)",
        )),
        Err(e) => Err(file_error(spec, e)),
    }
}

/// Where `spec` computes on this machine, its own `backend` first, else
/// `default`. Where a GPU is present, the file is read to ask whether the
/// CUDA kernels run its model (`auto` chooses the CPU where they do not).
pub fn placement_of(
    spec: &ModelSpec,
    default: BackendChoice,
) -> Result<(Placement, String), LoadError> {
    let runs = || {
        let model = Model::open(&spec.path).map_err(|e| e.to_string())?;
        bulkhead_kernels::backend::cuda::runs(&model)
    };
    placement::resolve_for(spec.backend.unwrap_or(default), runs).map_err(|error| {
        LoadError::Backend {
            id: spec.id.clone(),
            error,
        }
    })
}

/// The memory of `spec` given its parsed file: on the device where it computes there.
fn memory_of(
    spec: &ModelSpec,
    gguf: &Gguf,
    config: &ModelConfig,
    placement: &Placement,
) -> Result<ModelMemory, LoadError> {
    let file_bytes: u64 = gguf
        .tensors()
        .iter()
        .map(|t| gguf.tensor_bytes(t).len() as u64)
        .sum();
    // The CPU backend on AVX-512 keeps its matrices in 16-row layouts (Q4_K:
    // 1/36 more than their file bytes; the file's pages of them are given
    // back once repacked; a tied embedding is kept beside its packed copy).
    let repacked = match placement {
        Placement::Cpu
            if bulkhead_kernels::quant::Isa::detect() == bulkhead_kernels::quant::Isa::Avx512 =>
        {
            bulkhead_kernels::model::repack_overhead_bytes(gguf)
        }
        _ => 0,
    };
    let weights_bytes = file_bytes + repacked;
    let layout = config
        .pool_geometry(spec.pool_pages, spec.page_tokens, spec.kv_type.into())
        .layout()
        .map_err(|e| LoadError::Engine {
            id: spec.id.clone(),
            message: format!("kv pool: {e}"),
        })?;
    Ok(ModelMemory {
        model: spec.id.clone(),
        weights_bytes,
        kv_bytes: layout.pool_bytes(),
        device: match placement {
            Placement::Cpu => None,
            Placement::Cuda(gpu) => Some(gpu.name.clone()),
        },
    })
}

/// Reads `spec`'s file header: its context and memory, nothing allocated;
/// `default` is the backend of a model that names none.
pub fn inspect(spec: &ModelSpec, default: BackendChoice) -> Result<Inspected, LoadError> {
    regular_file(spec)?;
    let (placement, _) = placement_of(spec, default)?;
    let gguf = Gguf::open(&spec.path).map_err(|e| file_error(spec, e))?;
    let config = ModelConfig::from_gguf(&gguf).map_err(|e| file_error(spec, e))?;
    let geometry = config.pool_geometry(spec.pool_pages, spec.page_tokens, spec.kv_type.into());
    Ok(Inspected {
        file_context_tokens: config.context_len as u64,
        memory: memory_of(spec, &gguf, &config, &placement)?,
        shape: bulkhead_kernels::kv::PageShape::of(&geometry),
        placement,
        blueprint: config.describe(),
    })
}

/// The tenants of `tenants` that may use model `spec`, with their limits.
pub fn quotas_for<'a>(
    spec: &ModelSpec,
    tenants: impl IntoIterator<Item = &'a TenantRecord>,
) -> Vec<(String, Quota)> {
    tenants
        .into_iter()
        .filter(|t| t.models.allows(&spec.id))
        .map(|t| (t.name.clone(), t.quota))
        .collect()
}

/// The engine's view of `tenant` in model `spec`'s engine: its quota, with
/// `pages_max` capped at the model's pool.
pub fn tenant_limits(tenant: &TenantRecord, spec: &ModelSpec) -> TenantLimits {
    TenantLimits {
        id: TenantId(tenant.id),
        name: tenant.name.clone(),
        weight: tenant.quota.weight,
        queue_depth_max: tenant.quota.queue_depth_max,
        running_max: tenant.quota.running_max,
        pages_reserved: tenant.quota.pages_reserved,
        pages_max: tenant.quota.pages_max.min(spec.pool_pages),
        prefix_cache: tenant.quota.prefix_cache,
    }
}

/// The engine of `spec`, computing on `placement` (`cuda`: how, on a GPU).
pub fn engine_spec(spec: &ModelSpec, placement: Placement, cuda: CudaSwitches) -> EngineSpec {
    EngineSpec {
        pool_pages: spec.pool_pages,
        page_tokens: spec.page_tokens,
        kv_type: spec.kv_type.into(),
        threads: spec.threads as usize,
        step_tokens_max: spec.step_tokens_max,
        step_seqs_max: spec.step_seqs_max,
        pool_options: PoolOptions::default(),
        placement,
        cuda,
    }
}

/// Loads `spec` and starts its engine, with a partition for each of `tenants`
/// that may use it; every request's end goes to `finishes`. `config` gives
/// the backend of a model that names none, and how CUDA models run. The
/// engine's counts go on from `carried`, the totals of the engine the
/// model's id had before ([`Catalog::retired_totals`]), so that none of its
/// counters begins again.
pub fn load(
    spec: ModelSpec,
    source: Source,
    tenants: &[TenantRecord],
    finishes: Arc<dyn FinishSink>,
    role: crate::transfer::Role,
    config: &crate::config::EngineConfig,
    carried: Option<EngineTotals>,
) -> Result<Loaded, LoadError> {
    regular_file(&spec)?;
    let (placement, why) = placement_of(&spec, config.backend)?;
    tracing::info!(model = %spec.id, backend = %placement, "{why}");
    let model = Arc::new(Model::open(&spec.path).map_err(|e| file_error(&spec, e))?);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&model.gguf).map_err(|e| file_error(&spec, e))?);
    let file_context_tokens = model.config.context_len as u64;
    Capacity::of_model(&spec, file_context_tokens, &quotas_for(&spec, tenants)).check()?;
    let memory = memory_of(&spec, &model.gguf, &model.config, &placement)?;
    let limits = tenants
        .iter()
        .filter(|t| t.models.allows(&spec.id))
        .map(|t| tenant_limits(t, &spec))
        .collect();
    let engine = engine_spec(&spec, placement, config.cuda);
    let mut scheduler =
        build::scheduler(&model, &tokenizer, &engine, limits).map_err(|e| LoadError::Engine {
            id: spec.id.clone(),
            message: e.to_string(),
        })?;
    // What the backend chose at start-up (the tensor cores' probe) is the
    // operator's to see in /readyz.
    let placement = engine.placement.clone();
    let backend = match scheduler.backend().modes() {
        Some(modes) => format!("{}: {modes}", engine.placement),
        None => engine.placement.to_string(),
    };
    scheduler.set_finish_sink(finishes);
    scheduler.set_model_id(&spec.id);
    if let Some(totals) = &carried {
        scheduler.carry_totals(totals);
    }
    let admission = scheduler.admission(spec.context_tokens);
    let (transfer, remote) = transfer_of(&spec, &model, &scheduler, role);
    if let Some(remote) = &remote {
        scheduler.set_remote_prefill(remote.clone());
    }
    let template = match ChatTemplate::from_model(&model.gguf, &tokenizer) {
        Ok(template) => template,
        Err(error) => {
            tracing::warn!(model = %spec.id, %error, "the model's chat template does not compile; chat is disabled");
            None
        }
    };
    // After a panic the engine is rebuilt the same way, for the tenants it
    // then has (the supervisor sets the finish sink again).
    let rebuild = {
        let (model, tokenizer) = (Arc::clone(&model), Arc::clone(&tokenizer));
        let id = spec.id.clone();
        Box::new(move |tenants| {
            let mut scheduler = build::scheduler(&model, &tokenizer, &engine, tenants)
                .map_err(|e| e.to_string())?;
            scheduler.set_model_id(&id);
            if let Some(remote) = &remote {
                scheduler.set_remote_prefill(remote.clone());
            }
            Ok(scheduler)
        })
    };
    let supervision = Supervision {
        model: spec.id.clone(),
        policy: RestartPolicy::default(),
        rebuild,
    };
    let service = EngineService::start_supervised(scheduler, supervision).map_err(|cause| {
        LoadError::Thread {
            id: spec.id.clone(),
            cause,
        }
    })?;
    let served = Served {
        text_bytes_per_token_max: tokenizer.text_bytes_per_token_max() as u64,
        tokenizer,
        template,
        admission,
        engine: service.handle(),
        file_context_tokens,
        memory,
        created: crate::clock::now_ms() / 1000,
        spec,
        source,
        transfer,
        placement,
        backend,
    };
    Ok(Loaded {
        served: Arc::new(served),
        service,
    })
}

/// With role `prefill` or `decode`: the model's pairing (its file's
/// fingerprint, hashed here: ~10 ms per 100 MB) and, for `decode`, the job
/// queue its scheduler sends to.
fn transfer_of<B: bulkhead_kernels::backend::Backend>(
    spec: &ModelSpec,
    model: &Model,
    scheduler: &crate::engine::scheduler::Scheduler<B>,
    role: crate::transfer::Role,
) -> (
    Option<ModelTransfer>,
    Option<crate::engine::handoff::RemotePrefill>,
) {
    use crate::transfer::Role;
    if role == Role::Both {
        return (None, None);
    }
    let fingerprint = model.gguf.fingerprint();
    let pairing = crate::transfer::link::pairing_of(
        &spec.id,
        fingerprint,
        scheduler.pool().page_shape(),
        spec.context_tokens,
        scheduler
            .tenant_limits()
            .into_iter()
            .map(|t| (t.id.0, t.name)),
    );
    let (jobs, remote) = if role == Role::Decode {
        let (jobs, queue) = tokio::sync::mpsc::unbounded_channel();
        (
            Some(queue),
            Some(crate::engine::handoff::RemotePrefill {
                model: fingerprint,
                jobs,
            }),
        )
    } else {
        (None, None)
    };
    let transfer = ModelTransfer {
        pairing: Arc::new(pairing),
        decode: jobs.is_some(),
        jobs: Mutex::new(jobs),
        link: Arc::default(),
    };
    (Some(transfer), remote)
}

/// The models loaded at one moment, in catalog order.
#[derive(Default)]
pub struct Snapshot {
    models: Vec<Arc<Served>>,
}

impl Snapshot {
    /// The model `id`.
    pub fn get(&self, id: &str) -> Option<&Arc<Served>> {
        self.models.iter().find(|m| m.spec.id == id)
    }

    /// Every model, in catalog order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Served>> {
        self.models.iter()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Every model's memory against the budgets of `engine`, with `extra`
    /// (a model about to be added) last.
    pub fn memory(
        &self,
        engine: &crate::config::EngineConfig,
        extra: Option<ModelMemory>,
    ) -> MemoryBudget {
        MemoryBudget {
            max_bytes: engine.memory_max,
            device_max_bytes: placement::device_memory_max(engine.device_memory_max),
            models: self
                .models
                .iter()
                .map(|m| m.memory.clone())
                .chain(extra)
                .collect(),
        }
    }
}

/// A lock of plain maps: a poisoned one still holds whole entries.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The live catalog: a snapshot replaced whole on every change, and the
/// engines of the models in it.
#[derive(Default)]
pub struct Catalog {
    current: RwLock<Arc<Snapshot>>,
    services: Mutex<BTreeMap<String, EngineService>>,
    /// The engines of models taken out, by id: one loaded again under the
    /// same id goes on from its last engine's totals.
    retired: Mutex<BTreeMap<String, EngineHandle>>,
}

impl Catalog {
    /// The models now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        // A poisoned lock means a panic while swapping an Arc: the value is
        // still a whole snapshot.
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Adds a loaded model last. Its id must be new (the caller checked, under
    /// the control plane's write lock).
    pub fn insert(&self, loaded: Loaded) {
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        debug_assert!(current.get(&loaded.served.spec.id).is_none());
        lock(&self.retired).remove(&loaded.served.spec.id);
        let mut models = current.models.clone();
        models.push(loaded.served);
        lock(&self.services).insert(models[models.len() - 1].spec.id.clone(), loaded.service);
        *current = Arc::new(Snapshot { models });
    }

    /// The totals of model `id`'s last engine, if it was taken out since
    /// the process started: a model loaded again under its id goes on from
    /// them (read once the old engine is shut down, its last counts
    /// published).
    pub fn retired_totals(&self, id: &str) -> Option<EngineTotals> {
        lock(&self.retired)
            .get(id)
            .map(|handle| handle.stats().totals())
    }

    /// Takes model `id` out: new requests no longer find it. Its engine is
    /// the caller's to shut down (draining what runs).
    pub fn take(&self, id: &str) -> Option<(Arc<Served>, EngineService)> {
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        let at = current.models.iter().position(|m| m.spec.id == id)?;
        let mut models = current.models.clone();
        let served = models.remove(at);
        *current = Arc::new(Snapshot { models });
        let service = lock(&self.services).remove(id)?;
        lock(&self.retired).insert(id.to_string(), service.handle());
        Some((served, service))
    }

    /// Takes every model out (shutdown).
    pub fn take_all(&self) -> Vec<(Arc<Served>, EngineService)> {
        let ids: Vec<String> = self.snapshot().all().map(|m| m.spec.id.clone()).collect();
        ids.iter().filter_map(|id| self.take(id)).collect()
    }
}
