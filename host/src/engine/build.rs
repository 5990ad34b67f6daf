//! The one place an engine stack is assembled: a model's weights → its KV pool
//! (the model's page geometry) → the backend (CPU, or CUDA with the pool in
//! device memory) → the scheduler with its tenants' partitions. The catalog
//! (every served model), `bulkhead generate`, the benchmarks and the tests
//! all build through here, so they run the same stack.

use super::placement::{CudaSwitches, Gpu, Placement};
use super::scheduler::{BatchLimits, Scheduler, TenantChangeError, TenantLimits};
use bulkhead_kernels::backend::cpu::{CpuBackend, CpuOptions};
use bulkhead_kernels::backend::cuda::{
    Cuda, CudaBackend, CudaDevice, CudaOptions, DependentLaunches, Device, DeviceStorage,
    TensorCoresProbe,
};
use bulkhead_kernels::backend::Backend;
use bulkhead_kernels::kv::{KvType, Pool, PoolError, PoolOptions};
use bulkhead_kernels::model::{Model, ModelError};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::Arc;

/// The backend an engine runs, whichever it is.
pub type EngineBackend = Box<dyn Backend>;

/// What an engine is made of, besides the model and its tenants.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// Pages in the KV pool (allocated once, here).
    pub pool_pages: u32,
    /// Token positions per page.
    pub page_tokens: u32,
    /// How the pool stores each KV value.
    pub kv_type: KvType,
    /// Compute threads.
    pub threads: usize,
    /// Most tokens in one step.
    pub step_tokens_max: u32,
    /// Most sequences in one step.
    pub step_seqs_max: u32,
    /// Pool test switches (poison, paranoid); off when serving.
    pub pool_options: PoolOptions,
    /// Where it computes.
    pub placement: Placement,
    /// How, where that is a GPU.
    pub cuda: CudaSwitches,
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The pool's geometry (see the message).
    #[error("kv pool: {0}")]
    Pool(#[from] PoolError),
    /// A tenant's partition (see the message).
    #[error("tenant: {0}")]
    Tenant(#[from] TenantChangeError),
    /// The model file's tokenizer and weights disagree.
    #[error("model: {0}")]
    Model(#[from] ModelError),
    /// The CUDA backend could not be set up (the device, NVRTC, the model).
    #[error("cuda: {0}")]
    Cuda(String),
}

/// The KV pool for `model` in host memory, with no partitions yet.
pub fn pool(model: &Model, spec: &EngineSpec) -> Result<Pool, PoolError> {
    let geometry = model
        .config
        .pool_geometry(spec.pool_pages, spec.page_tokens, spec.kv_type);
    Pool::new(geometry, &[], spec.pool_options)
}

/// The CPU backend for `model` (the pool in host memory).
pub fn backend(model: &Arc<Model>, spec: &EngineSpec) -> CpuBackend {
    CpuBackend::new(
        Arc::clone(model),
        CpuOptions {
            threads_count: spec.threads,
            step_tokens_max: spec.step_tokens_max as usize,
            step_seqs_max: spec.step_seqs_max as usize,
            isa: None,
        },
    )
}

/// The CUDA backend for `model` on `gpu`, and its pool in that device's
/// memory: the engine's own stream on the device, one allocation for the pool.
fn cuda_parts(
    model: &Arc<Model>,
    spec: &EngineSpec,
    gpu: &Gpu,
) -> Result<(EngineBackend, Pool), BuildError> {
    let cuda = |e: &dyn std::fmt::Display| BuildError::Cuda(e.to_string());
    let device: Arc<dyn Device> =
        Arc::new(Cuda(CudaDevice::open(gpu.ordinal).map_err(|e| cuda(&e))?));
    let layout = model
        .config
        .pool_geometry(spec.pool_pages, spec.page_tokens, spec.kv_type)
        .layout()
        .map_err(PoolError::from)?;
    let storage = DeviceStorage::new(&device, layout).map_err(|e| cuda(&e))?;
    let pool = Pool::with_storage(layout, &[], spec.pool_options, Box::new(storage))?;
    let options = CudaOptions {
        step_tokens_max: spec.step_tokens_max as usize,
        step_seqs_max: spec.step_seqs_max as usize,
        graphs: spec.cuda.graphs,
        tensor_cores: spec.cuda.tensor_cores,
        dependent_launches: spec.cuda.dependent_launches,
    };
    let backend = CudaBackend::new(Arc::clone(model), device, options).map_err(|e| cuda(&e))?;
    // Wrong products of large steps would fail nothing: say it loudly.
    match backend.tensor_cores_probe() {
        probe @ TensorCoresProbe::Refused { .. } => {
            tracing::warn!(gpu = %gpu.name, "tensor cores {probe}")
        }
        probe => tracing::info!(gpu = %gpu.name, "tensor cores: {probe}"),
    }
    match backend.dependent_launches() {
        probe @ DependentLaunches::Refused { .. } => {
            tracing::warn!(gpu = %gpu.name, "dependent launches {probe}")
        }
        probe => tracing::info!(gpu = %gpu.name, "dependent launches: {probe}"),
    }
    if !spec.cuda.graphs {
        tracing::info!(gpu = %gpu.name, "cuda graphs: off, as configured");
    }
    Ok((Box::new(backend), pool))
}

/// The whole stack: pool, backend, and a scheduler with a partition per tenant.
pub fn scheduler(
    model: &Arc<Model>,
    tokenizer: &Arc<Tokenizer>,
    spec: &EngineSpec,
    tenants: Vec<TenantLimits>,
) -> Result<Scheduler<EngineBackend>, BuildError> {
    model.check_tokenizer(tokenizer)?;
    let (backend, pool): (EngineBackend, Pool) = match &spec.placement {
        Placement::Cpu => (Box::new(backend(model, spec)), pool(model, spec)?),
        Placement::Cuda(gpu) => cuda_parts(model, spec, gpu)?,
    };
    let limits = BatchLimits {
        step_tokens_max: spec.step_tokens_max,
        step_seqs_max: spec.step_seqs_max,
    };
    Ok(Scheduler::new(
        backend,
        pool,
        Arc::clone(tokenizer),
        limits,
        tenants,
    )?)
}
