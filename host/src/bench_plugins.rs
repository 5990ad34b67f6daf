//! `bulkhead bench plugins`: what the policy chain adds to a request's
//! admission, measured in process on the real plugin runtime. Each call runs
//! the whole chain in fresh instances (from pre-instantiated templates, the
//! pooling allocator), with every limit on, as the request path does; the
//! figures go to BENCHMARKS.md.

use crate::catalog;
use crate::config::Config;
use crate::engine::build;
use crate::engine::request::{FinishReason, RequestId};
use crate::engine::service::{EngineHandle, EngineService};
use crate::lane::Cancel;
use crate::policy::{AdmitInput, PolicyRuntime, Verdict};
use crate::store::records::{PluginLimitsRequest, PluginRecord};
use crate::store::Store;
use crate::tenancy::{ModelAccess, TenantId};
use anyhow::{bail, Context, Result};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Arguments of `bulkhead bench plugins`.
#[derive(clap::Args, Clone, Debug)]
pub struct PluginBenchArgs {
    /// The policy file whose `[plugins]` limits apply (e.g. policies/demo.toml).
    #[arg(long)]
    pub config: PathBuf,
    /// Plugin components, in chain order; the chain is measured with the first
    /// one, then with all of them.
    #[arg(long = "plugin", required = true)]
    pub plugins: Vec<PathBuf>,
    /// Admissions per measurement.
    #[arg(long, default_value_t = 2000)]
    pub calls: u32,
}

/// Runs the benchmark and prints one line per chain length.
pub fn run(args: &PluginBenchArgs) -> Result<()> {
    let config = Config::load(&args.config)?;
    let Some(mut spec) = config.model_specs().into_iter().next() else {
        bail!("the policy has no [[models]]");
    };
    // A small pool: the benchmark runs no request, it only needs an engine.
    spec.pool_pages = 16;
    let model = Arc::new(Model::open(&spec.path).context("the policy's first model")?);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&model.gguf)?);
    let dir = std::env::temp_dir().join(format!("bulkhead-bench-plugins-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let store = Arc::new(Store::open(&dir)?);
    let tenant = crate::store::records::TenantRecord {
        id: 1,
        name: "bench".into(),
        quota: crate::tenancy::Quota {
            weight: 1,
            pages_reserved: 0,
            pages_max: spec.pool_pages,
            queue_depth_max: 1,
            running_max: 1,
            pending_max: 1,
            prefix_cache: true,
        },
        models: ModelAccess::All,
        canaries: Vec::new(),
        objective: None,
        created_ms: 0,
        updated_ms: 0,
    };
    let limits = vec![catalog::tenant_limits(&tenant, &spec)];
    let scheduler = build::scheduler(
        &model,
        &tokenizer,
        &catalog::engine_spec(
            &spec,
            crate::engine::placement::Placement::Cpu,
            Default::default(),
        ),
        limits,
    )?;
    let engine = EngineService::start(scheduler)?;
    let runtime = PolicyRuntime::new(&config, Arc::clone(&store), &dir)?;
    println!(
        "bench plugins: {} calls per chain, deadline {} ms, fuel {}, memory {} bytes",
        args.calls, config.plugins.deadline_ms, config.plugins.fuel, config.plugins.memory_bytes
    );
    let none = measure(&runtime, &engine.handle(), args.calls)?;
    report("no plugin", &none);
    let mut chains = vec![1];
    if args.plugins.len() > 1 {
        chains.push(args.plugins.len());
    }
    let mut installed = 0;
    for length in chains {
        while installed < length {
            let path = &args.plugins[installed];
            let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
            let component = runtime
                .compile(&bytes, false)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let record = PluginRecord {
                id: installed as u64 + 1,
                tenant: 1,
                name: format!("p{installed}"),
                version: 1,
                sha256: String::new(),
                size_bytes: bytes.len() as u64,
                enabled: true,
                uploaded_ms: 0,
                order: installed as u32,
                limits: PluginLimitsRequest::default(),
            };
            runtime
                .install(&record, &component)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            installed += 1;
        }
        let samples = measure(&runtime, &engine.handle(), args.calls)?;
        report(
            &format!("{length} plugin{}", if length == 1 { "" } else { "s" }),
            &samples,
        );
    }
    engine.shutdown(Duration::ZERO, FinishReason::Shutdown);
    drop(runtime);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn measure(runtime: &PolicyRuntime, engine: &EngineHandle, calls: u32) -> Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(calls as usize);
    for n in 0..calls {
        let input = AdmitInput {
            request: RequestId(u64::from(n) + 1),
            tenant: TenantId(1),
            tenant_name: "bench".into(),
            model: "m".into(),
            chat: true,
            prompt_tokens: 100,
            max_tokens: 64,
            stream: true,
            headers: vec![("x-user".into(), format!("user-{}", n % 16))],
            prompt_text: None,
            engine: engine.clone(),
            budget: runtime.time_budget(),
        };
        let started = Instant::now();
        let verdict = runtime.admit(input, &Cancel::default());
        samples.push(started.elapsed());
        match verdict {
            Verdict::Admit { .. } => runtime.refused(RequestId(u64::from(n) + 1), 100),
            other => bail!("the chain did not admit: {other:?}"),
        }
    }
    samples.sort();
    Ok(samples)
}

fn report(what: &str, sorted: &[Duration]) {
    let at = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6;
    println!(
        "{what:>10}: admission p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
        at(0.5),
        at(0.99),
        at(1.0)
    );
}
