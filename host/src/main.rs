//! The `bulkhead` command line (DESIGN.md §10).

use anyhow::{bail, Context, Result};
use bulkhead::bench;
use bulkhead::capacity::{Capacity, MemoryBudget};
use bulkhead::catalog;
use bulkhead::config::Config;
use bulkhead::engine::chat::{ChatTemplate, Message};
use bulkhead::engine::generate::{self, GenerateOptions};
use bulkhead::engine::placement::{self, BackendChoice};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::server::{self, ServeOptions};
use bulkhead::single::{self, Single};
use bulkhead::telemetry::LogFormat;
use bulkhead::tenancy::seed;
use bulkhead_kernels::model::Model;
use bulkhead_kernels::tokenizer::{EncodeOptions, Tokenizer};
use clap::{Parser, Subcommand};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "bulkhead",
    version,
    about = "A multi-tenant LLM inference host"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// One generation to stdout; temperature 0 is greedy.
    Generate {
        /// GGUF model file.
        #[arg(long)]
        model: PathBuf,
        /// Raw prompt text (special-token text in it stays plain text).
        #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
        prompt: Option<String>,
        /// A user message, wrapped in the model's chat template.
        #[arg(long)]
        chat: Option<String>,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Keep only the k most likely tokens (0 = all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Nucleus sampling mass (1 = all).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Seed of the sampler (default: a fresh one, as the server draws).
        #[arg(long)]
        seed: Option<u64>,
        /// Compute threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Token ids of a text as one JSON array, no BOS added.
    Tokenize {
        /// GGUF model file.
        #[arg(long)]
        model: PathBuf,
        /// The text.
        #[arg(long)]
        text: String,
        /// Treat special-token text (e.g. `<|im_start|>`) as special tokens.
        #[arg(long)]
        parse_special: bool,
    },
    /// Serve the OpenAI-compatible API and the admin API until SIGINT/SIGTERM:
    /// a policy file's deployment, or one GGUF file to one tenant (`--model`).
    Serve {
        /// The policy file (e.g. policies/demo.toml).
        #[arg(long, required_unless_present = "model", conflicts_with = "model")]
        config: Option<PathBuf>,
        /// One GGUF file, served to one tenant with a policy derived from the
        /// file (`bulkhead check --model FILE` prints it).
        #[arg(long)]
        model: Option<PathBuf>,
        /// With --model: the tenant's API key (default: generated at the first
        /// start and shown once).
        #[arg(long, requires = "model")]
        api_key: Option<String>,
        /// With --model: the memory budget of weights and KV pool, e.g. "4 GiB"
        /// (default: half of this machine's memory).
        #[arg(long, requires = "model")]
        memory_max: Option<String>,
        /// Log lines as `text` (for a person) or `json` (for a collector);
        /// default: text on a terminal, JSON otherwise.
        #[arg(long, value_parser = ["text", "json"])]
        log_format: Option<String>,
        /// Inference listener address (overrides `server.listen`).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Admin listener address (overrides `server.admin_listen`).
        #[arg(long)]
        admin_listen: Option<SocketAddr>,
        /// The control-plane store's folder (overrides `store.path`).
        #[arg(long)]
        store: Option<PathBuf>,
        /// This process's part in prefill/decode disaggregation: `both`
        /// (default), `prefill` (jobs for decode peers only) or `decode`
        /// (clients, with prompts' KV from prefill peers); overrides
        /// `server.role`. Both sides need BULKHEAD_TRANSFER_SECRET.
        #[arg(long, value_parser = ["both", "prefill", "decode"])]
        role: Option<String>,
        /// With --role prefill: where decode peers connect, `HOST:PORT` or
        /// `unix:PATH` (overrides `server.transfer_listen`).
        #[arg(long)]
        transfer_listen: Option<String>,
        /// With --role decode: a prefill peer, `HOST:PORT` or `unix:PATH`;
        /// repeat for several (replaces `server.prefill_peers`).
        #[arg(long = "prefill-peer")]
        prefill_peers: Vec<String>,
        /// Where models compute unless their policy entry says (`backend`):
        /// `auto` (CUDA where a driver, a device and NVRTC are present, else
        /// the CPU), `cpu` or `cuda` (refused where it cannot run); overrides
        /// `engine.backend`.
        #[arg(long)]
        backend: Option<BackendChoice>,
        /// On CUDA, launch each kernel of a decode step on its own rather
        /// than replaying the step as a captured graph (vLLM's flag; sets
        /// `[engine.cuda] graphs = false`).
        #[arg(long)]
        enforce_eager: bool,
        /// On CUDA, multiply large steps (prefill chunks, batches past 8) a
        /// warp a row rather than on the tensor cores, and probe nothing at
        /// start-up (sets `[engine.cuda] tensor_cores = false`).
        #[arg(long)]
        no_tensor_cores: bool,
        /// On CUDA, start each kernel of a step once the one before it has
        /// ended, rather than letting it begin early and wait in the kernel
        /// (sets `[engine.cuda] dependent_launches = false`).
        #[arg(long)]
        no_dependent_launches: bool,
    },
    /// Print each model's capacity table and the memory budget of a deployment,
    /// as `serve` would check them: the policy's models and those added through
    /// the admin API, with the store's tenants (or, for a store not yet seeded,
    /// the policy's); exit non-zero on a violation.
    Check {
        /// The policy file (e.g. policies/demo.toml).
        #[arg(long, required_unless_present = "model", conflicts_with = "model")]
        config: Option<PathBuf>,
        /// One GGUF file: print the policy `serve --model` would derive, then check it.
        #[arg(long)]
        model: Option<PathBuf>,
        /// With --model: the memory budget, as for `serve --model`.
        #[arg(long, requires = "model")]
        memory_max: Option<String>,
        /// The control-plane store's folder (overrides `store.path`).
        #[arg(long)]
        store: Option<PathBuf>,
        /// Check as this role would serve (overrides `server.role`): for
        /// `prefill` and `decode`, also print each model's chain — front,
        /// prefill, transfer, decode — with what each part must hold.
        #[arg(long)]
        role: Option<bulkhead::transfer::Role>,
        /// Where models compute unless their policy entry says (`backend`):
        /// `auto` (CUDA where a driver, a device and NVRTC are present, else
        /// the CPU), `cpu` or `cuda` (refused where it cannot run); overrides
        /// `engine.backend`.
        #[arg(long)]
        backend: Option<BackendChoice>,
    },
    /// Replace a lost admin token, offline (the server stopped): a new one is
    /// generated, stored as a digest (the old one stops working), audited
    /// (`admin_token.reset`) and printed once to stdout.
    ResetAdminToken {
        /// The policy file (e.g. policies/demo.toml).
        #[arg(long)]
        config: PathBuf,
        /// The control-plane store's folder (overrides `store.path`).
        #[arg(long)]
        store: Option<PathBuf>,
    },
    /// Everyday admin tasks through the admin API of a running server.
    Admin(bulkhead::admin_cli::AdminArgs),
    /// Convert a model file's weight matrices to another type (writes OUT.partial, then renames).
    Quantize(bulkhead::quantize_cli::QuantizeArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Engine throughput: prefill, decode at batch 1, aggregate decode at larger batches.
    Engine(bench::EngineBenchArgs),
    /// Page digests of a transfer's pages: XXH3 against XXH64, FNV-1a and a copy.
    Digest(bench::DigestBenchArgs),
    /// What each sampling option costs per token, beside a decode step.
    Sampling(bench::SamplingBenchArgs),
    /// The host's part of a decode step: the scheduler over a backend that computes nothing.
    Scheduler(bulkhead::bench_scheduler::SchedulerBenchArgs),
    /// Load on an OpenAI-compatible server: throughput and latency per concurrency level.
    Http(bulkhead::bench_http::HttpBenchArgs),
    /// Noisy neighbours: alpha alone, alpha while beta floods, both saturated.
    Noisy(bulkhead::bench_http::NoisyBenchArgs),
    /// Admin write latency against a running server (each write flushed before its answer).
    Admin(bulkhead::admin_cli::AdminBenchArgs),
    /// What the policy chain adds to admission, with 1 and with all given plugins.
    Plugins(bulkhead::bench_plugins::PluginBenchArgs),
}

fn threads_default() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn load(path: &Path) -> Result<(Arc<Model>, Tokenizer)> {
    let model = Model::open(path).with_context(|| format!("loading model {}", path.display()))?;
    let tokenizer =
        Tokenizer::from_gguf(&model.gguf).context("building the tokenizer from the model file")?;
    Ok((Arc::new(model), tokenizer))
}

fn chat_tokens(model: &Model, tokenizer: &Tokenizer, user: &str) -> Result<Vec<u32>> {
    let template = ChatTemplate::from_model(&model.gguf, tokenizer)?
        .context("the model has no chat template; use --prompt")?;
    let messages = [Message {
        role: "user".into(),
        content: user.into(),
        ..Message::default()
    }];
    Ok(template.tokens(tokenizer, &messages)?)
}

fn generate(
    model_path: &Path,
    prompt: Option<String>,
    chat: Option<String>,
    options: GenerateOptions,
) -> Result<()> {
    let (model, tokenizer) = load(model_path)?;
    let prompt_ids = match (prompt, chat) {
        (Some(text), None) => tokenizer.encode(
            &text,
            EncodeOptions {
                add_bos: tokenizer.add_bos(),
                parse_special: false,
            },
        )?,
        (None, Some(user)) => chat_tokens(&model, &tokenizer, &user)?,
        _ => bail!("give exactly one of --prompt and --chat"),
    };
    let mut stdout = std::io::stdout().lock();
    let report = generate::generate(model, Arc::new(tokenizer), prompt_ids, &options, |text| {
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    })?;
    writeln!(stdout)?;
    let u = report.usage;
    eprintln!(
        "[{} prompt tokens, prefill {:.1} tok/s; {} generated, decode {:.1} tok/s; finish: {:?}; backend {}]",
        u.prompt_tokens,
        f64::from(u.prompt_tokens) / report.prefill_secs.max(1e-9),
        u.completion_tokens,
        f64::from(u.completion_tokens.saturating_sub(1)) / report.decode_secs.max(1e-9),
        report.finish,
        report.backend,
    );
    Ok(())
}

fn reset_admin_token(path: &Path, store: Option<PathBuf>) -> Result<()> {
    let mut config = Config::load(path)?;
    if let Some(store) = store {
        config.store.path = std::path::absolute(store)?;
    }
    let store_path = config.store_path();
    let sled = config.store.backend == bulkhead::config::StoreBackend::Sled;
    if sled && !store_path.exists() {
        bail!(
            "no store at {}: the first start of the server generates the admin token",
            store_path.display()
        );
    }
    let store = server::open_store(&config)?;
    let token = seed::reset_admin_token(&store)?;
    println!(
        "admin token (new; shown once, stored as a digest; the old one no longer works): {token}"
    );
    if std::env::var_os(seed::ADMIN_TOKEN_ENV).is_some() {
        eprintln!(
            "note: {} is set here; a server started with it set to another token rotates to that one",
            seed::ADMIN_TOKEN_ENV
        );
    }
    Ok(())
}

/// The (id, name) of the tenants that may use `spec`, as a pairing names them.
fn quotas_ids(
    tenants: &[bulkhead::store::records::TenantRecord],
    spec: &bulkhead::config::ModelSpec,
) -> Vec<(u32, String)> {
    tenants
        .iter()
        .filter(|t| t.models.allows(&spec.id))
        .map(|t| (t.id, t.name.clone()))
        .collect()
}

/// A byte count argument: `6442450944` or `"6 GiB"`.
fn bytes_arg(text: &str) -> Result<u64> {
    bulkhead::config::parse_bytes(text)
        .with_context(|| format!("{text:?} is not a byte count such as 6442450944 or \"6 GiB\""))
}

fn check(
    mut config: Config,
    store: Option<PathBuf>,
    role: Option<bulkhead::transfer::Role>,
    backend: Option<BackendChoice>,
) -> Result<()> {
    if let Some(backend) = backend {
        config.engine.backend = backend;
    }
    if let Some(store) = store {
        config.store.path = std::path::absolute(store)?;
    }
    if let Some(role) = role {
        config.server.role = role;
    }
    // The state the server would use: a seeded store's tenants win over the
    // policy's, and its models join the policy's. Opening the store creates
    // nothing when there is none yet.
    let store_path = config.store_path();
    // A shared store (etcd) is read as it is, a running cluster's included.
    let shared = config.store.backend != bulkhead::config::StoreBackend::Sled;
    let (specs, tenants) = match shared || store_path.exists() {
        true => {
            let store = server::open_store(&config)?;
            let specs = server::catalog_of(&config, &store)?;
            match store.meta()? {
                Some(_) => {
                    println!("tenants: the store at {}", store.path());
                    (specs, store.tenants()?)
                }
                None => (specs, seed::policy_tenants(&config)),
            }
        }
        false => {
            println!(
                "tenants: the policy (the store at {} is not seeded yet)",
                store_path.display()
            );
            let specs = config
                .model_specs()
                .into_iter()
                .map(|spec| (spec, catalog::Source::Policy))
                .collect();
            (specs, seed::policy_tenants(&config))
        }
    };
    let mut memory = MemoryBudget {
        max_bytes: config.engine.memory_max,
        device_max_bytes: placement::device_memory_max(config.engine.device_memory_max),
        models: Vec::new(),
    };
    let mut violation = None;
    for (spec, _) in &specs {
        let inspected = catalog::inspect(spec, config.engine.backend)?;
        println!("model {}: backend {}", spec.id, inspected.placement);
        println!("model {}: {}", spec.id, inspected.blueprint);
        let quotas = catalog::quotas_for(spec, &tenants);
        let capacity = Capacity::of_model(spec, inspected.file_context_tokens, &quotas);
        print!("{}", capacity.table());
        let holds = capacity.check();
        if config.server.role != bulkhead::transfer::Role::Both {
            let fingerprint = bulkhead_kernels::gguf::Gguf::open(&spec.path)
                .with_context(|| format!("{}", spec.path.display()))?
                .fingerprint();
            let chain = bulkhead::transfer::Chain {
                role: config.server.role,
                model: &spec.id,
                context_tokens: spec.context_tokens,
                shape: inspected.shape,
                fingerprint,
                tenants: quotas_ids(&tenants, spec),
                holds: holds.is_ok(),
                server: &config.server,
            };
            print!("{}", chain.text());
        }
        if let Err(v) = holds {
            violation.get_or_insert_with(|| anyhow::Error::from(v));
        }
        memory.models.push(inspected.memory);
    }
    print!("{}", memory.table());
    if let Some(v) = violation {
        return Err(v);
    }
    memory.check()?;
    println!(
        "ok: {} models; every stage of each holds its promised context, and the catalog fits its memory budget",
        specs.len()
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Errors are for the operator at the terminal: the chain of causes, one
    // line, exit status 1 — no backtrace, whatever RUST_BACKTRACE says.
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate {
            model,
            prompt,
            chat,
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            threads,
        } => {
            if !(temperature.is_finite() && temperature >= 0.0) {
                bail!("--temperature must be a finite number >= 0");
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                bail!("--top-p must be in (0, 1]");
            }
            let options = GenerateOptions {
                threads: threads.unwrap_or_else(threads_default),
                max_tokens: u32::try_from(max_tokens).context("--max-tokens is too large")?,
                sampling: SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: seed.unwrap_or_else(|| getrandom::u64().unwrap_or(0)),
                    ..SamplingParams::default()
                },
            };
            generate(&model, prompt, chat, options)
        }
        Command::Tokenize {
            model,
            text,
            parse_special,
        } => {
            let (_, tokenizer) = load(&model)?;
            let ids = tokenizer.encode(
                &text,
                EncodeOptions {
                    add_bos: false,
                    parse_special,
                },
            )?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Command::Serve {
            config,
            model,
            api_key,
            memory_max,
            log_format,
            listen,
            admin_listen,
            store,
            role,
            transfer_listen,
            prefill_peers,
            backend,
            enforce_eager,
            no_tensor_cores,
            no_dependent_launches,
        } => {
            let policy = match &model {
                Some(model) => {
                    if let Some(key) = api_key {
                        let min = bulkhead::tenancy::KEY_BYTES_MIN;
                        if key.len() < min {
                            bail!(
                                "--api-key has {} bytes; a key needs at least {min}",
                                key.len()
                            );
                        }
                        // Read by the start-up as the tenant's key_env, like
                        // any policy tenant's key.
                        std::env::set_var(single::API_KEY_ENV, key);
                    }
                    let single = Single {
                        model,
                        memory_max: memory_max.as_deref().map(bytes_arg).transpose()?,
                        store: store.clone(),
                    };
                    Some(single::derive(&single)?.1)
                }
                None => None,
            };
            Ok(server::serve(ServeOptions {
                config: config.unwrap_or_default(),
                policy,
                listen,
                admin_listen,
                store,
                log_format: log_format.map(|f| match f.as_str() {
                    "text" => LogFormat::Text,
                    _ => LogFormat::Json,
                }),
                role: role
                    .map(|r| r.parse())
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                transfer_listen,
                prefill_peers,
                backend,
                enforce_eager,
                no_tensor_cores,
                no_dependent_launches,
            })?)
        }
        Command::Check {
            config,
            model,
            memory_max,
            store,
            role,
            backend,
        } => match (config, model) {
            (Some(config), _) => check(Config::load(&config)?, store, role, backend),
            (None, Some(model)) => {
                let single = Single {
                    model: &model,
                    memory_max: memory_max.as_deref().map(bytes_arg).transpose()?,
                    store,
                };
                let (toml, config) = single::derive(&single)?;
                println!("{toml}");
                check(config, None, None, backend)
            }
            (None, None) => bail!("give --config or --model"),
        },
        Command::ResetAdminToken { config, store } => reset_admin_token(&config, store),
        Command::Admin(args) => bulkhead::admin_cli::run(args),
        Command::Quantize(args) => bulkhead::quantize_cli::run(&args),
        Command::Bench { which } => match which {
            BenchCommand::Engine(args) => {
                let (model, tokenizer) = load(&args.model)?;
                bench::engine(model, tokenizer, &args)
            }
            BenchCommand::Digest(args) => bench::digest(&args),
            BenchCommand::Sampling(args) => {
                let (model, tokenizer) = load(&args.model)?;
                bench::sampling(model, tokenizer, &args)
            }
            BenchCommand::Scheduler(args) => {
                let (model, tokenizer) = load(&args.model)?;
                bulkhead::bench_scheduler::run(model, tokenizer, &args)
            }
            BenchCommand::Http(args) => bulkhead::bench_http::run(&args),
            BenchCommand::Noisy(args) => bulkhead::bench_http::noisy(&args),
            BenchCommand::Admin(args) => bulkhead::admin_cli::bench(&args),
            BenchCommand::Plugins(args) => bulkhead::bench_plugins::run(&args),
        },
    }
}
