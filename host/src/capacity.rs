//! The capacity contract of each model (invariant I2) and the memory budget of
//! the whole catalog.
//!
//! 1. [`Capacity::of_model`] compares the context window a model promises to
//!    clients with every stage that must hold it: the model file's own context,
//!    the per-sequence page limit, the model's KV pool, and the maximum of each
//!    tenant that may use the model. A violation refuses to start (or to apply
//!    an admin change) and names the model and the limit.
//! 2. [`MemoryBudget::check`] adds up every model's weights and KV pool against
//!    `engine.memory_max`, in catalog order, and names the first model that no
//!    longer fits.
//! 3. Both render as tables for `bulkhead check`, the server's start-up log and
//!    the admin API's 409 answers.

use crate::config::ModelSpec;
use crate::tenancy::Quota;
use std::fmt::Write as _;

/// The stage of the capacity table that reports reservations above the pool
/// (I8): a row only when they are, holding no tokens.
pub const RESERVATIONS_STAGE: &str = "reservations";

/// The stage that reports more tenants than sequence slots (each is
/// guaranteed one, and a weighted share of the rest): a row only then,
/// holding no tokens.
pub const SLOTS_STAGE: &str = "sequence slots";

/// One row of the capacity table: a stage and how many tokens it can hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The stage, as printed ("model context", "tenant alpha maximum", ...).
    pub stage: String,
    /// The setting that sets it.
    pub field: String,
    /// Tokens it holds for one sequence.
    pub tokens: u64,
}

/// The capacity contract of one model.
#[derive(Clone, Debug)]
pub struct Capacity {
    /// The model's id.
    pub model: String,
    /// Tokens promised to clients (prompt + completion).
    pub promised_tokens: u64,
    /// Every stage that must hold a promised window.
    pub limits: Vec<Limit>,
    /// Tokens per step, for the table (chunked prefill takes any prompt length).
    pub step_tokens_max: u64,
    /// What the limits were computed from, for [`Capacity::fits_with`].
    pub sizes: Sizes,
}

/// The settings a model's contract is computed from: what a change to make it
/// hold would change.
#[derive(Clone, Debug, Default)]
pub struct Sizes {
    pub page_tokens: u64,
    pub pool_pages: u64,
    pub seq_pages_max: u64,
    pub step_seqs_max: u64,
    /// Each tenant that may use the model: its name, pages_reserved, pages_max.
    pub tenants: Vec<(String, u64, u64)>,
}

/// A promise that some stage cannot keep.
#[derive(Debug, thiserror::Error)]
#[error("capacity contract of model {model} violated: {}\n{}", self.reason(), self.capacity.table())]
pub struct CapacityViolation {
    /// The model.
    pub model: String,
    /// Tokens promised.
    pub promised: u64,
    /// The stage that cannot hold them.
    pub stage: String,
    /// The setting that sets that stage.
    pub field: String,
    /// What that stage holds.
    pub tokens: u64,
    /// The whole contract.
    pub capacity: Box<Capacity>,
    /// The smallest changes that would make it hold, as sentences: each is
    /// enough on its own ([`Capacity::fits_with`]).
    pub fits_with: Vec<String>,
}

impl CapacityViolation {
    /// What breaks, in a sentence: a stage that holds fewer tokens than
    /// promised, or (the reservations and slot stages, which hold no tokens)
    /// the count that does not fit.
    pub fn reason(&self) -> String {
        let what = if self.stage == RESERVATIONS_STAGE || self.stage == SLOTS_STAGE {
            format!("{}: {}", self.stage, self.field)
        } else {
            format!(
                "the promised context of {} tokens exceeds {} ({} tokens, set by {})",
                self.promised, self.stage, self.tokens, self.field
            )
        };
        match self.remedy() {
            Some(remedy) => format!("{what}; {remedy}"),
            None => what,
        }
    }

    /// "it holds with A, or with B": the smallest changes, each enough alone.
    pub fn remedy(&self) -> Option<String> {
        if self.fits_with.is_empty() {
            return None;
        }
        Some(format!(
            "it holds with {}",
            self.fits_with.join(", or with ")
        ))
    }
}

impl Capacity {
    /// The contract of `spec`, a model whose file holds `model_context_tokens`,
    /// with `tenants`: the name and limits of each tenant that may use it.
    pub fn of_model(
        spec: &ModelSpec,
        model_context_tokens: u64,
        tenants: &[(String, Quota)],
    ) -> Capacity {
        let id = &spec.id;
        let page_tokens = u64::from(spec.page_tokens);
        let pool_pages = u64::from(spec.pool_pages);
        let mut limits = vec![
            Limit {
                stage: "model context".into(),
                field: format!("the file of model {id} (context_length)"),
                tokens: model_context_tokens,
            },
            Limit {
                stage: "per-sequence page limit".into(),
                field: format!("models.{id}.seq_pages_max"),
                tokens: u64::from(spec.seq_pages_max) * page_tokens,
            },
            Limit {
                stage: "KV pool".into(),
                field: format!("models.{id}.pool_pages"),
                tokens: pool_pages * page_tokens,
            },
        ];
        let reserved_total: u64 = tenants
            .iter()
            .map(|(_, q)| u64::from(q.pages_reserved))
            .sum();
        if reserved_total > pool_pages {
            // I8: no tenant's reservation may be another's burst.
            limits.push(Limit {
                stage: RESERVATIONS_STAGE.into(),
                field: format!(
                    "the pages_reserved of the tenants that may use model {id} add up to {reserved_total} pages; models.{id}.pool_pages is {pool_pages}"
                ),
                tokens: 0,
            });
        }
        if tenants.len() as u64 > u64::from(spec.step_seqs_max) {
            // Each tenant is guaranteed one sequence slot and a weighted share
            // of the rest; a guarantee of none would starve it as surely as a
            // page limit.
            limits.push(Limit {
                stage: SLOTS_STAGE.into(),
                field: format!(
                    "{} tenants may use model {id}; models.{id}.step_seqs_max is {} (each is guaranteed at least one sequence slot)",
                    tenants.len(),
                    spec.step_seqs_max
                ),
                tokens: 0,
            });
        }
        for (name, quota) in tenants {
            // A tenant can never take pages other tenants have reserved (I8),
            // nor more than the pool (its partition is capped there).
            let others_reserved = reserved_total - u64::from(quota.pages_reserved);
            let reachable = pool_pages.saturating_sub(others_reserved);
            let (pages, field) = if u64::from(quota.pages_max) <= reachable {
                (
                    u64::from(quota.pages_max),
                    format!("tenants.{name}.pages_max"),
                )
            } else {
                (
                    reachable,
                    format!("models.{id}.pool_pages minus other tenants' pages_reserved"),
                )
            };
            limits.push(Limit {
                stage: format!("tenant {name} maximum"),
                field,
                tokens: pages * page_tokens,
            });
        }
        Capacity {
            model: id.clone(),
            promised_tokens: u64::from(spec.context_tokens),
            limits,
            step_tokens_max: u64::from(spec.step_tokens_max),
            sizes: Sizes {
                page_tokens,
                pool_pages,
                seq_pages_max: u64::from(spec.seq_pages_max),
                step_seqs_max: u64::from(spec.step_seqs_max),
                tenants: tenants
                    .iter()
                    .map(|(name, q)| {
                        (
                            name.clone(),
                            u64::from(q.pages_reserved),
                            u64::from(q.pages_max),
                        )
                    })
                    .collect(),
            },
        }
    }

    /// The smallest changes that would make the contract hold, each enough
    /// on its own: a promise lowered to what every stage holds, or every
    /// setting that falls short raised just far enough (the pool to the
    /// reservations plus one promised window for each tenant, each short
    /// `pages_max` and the per-sequence limit to one window, the slots to
    /// the tenants). Empty when it holds.
    pub fn fits_with(&self) -> Vec<String> {
        if self.limits.iter().all(|l| l.tokens >= self.promised_tokens) {
            return Vec::new();
        }
        let (id, sizes) = (&self.model, &self.sizes);
        let mut fits = Vec::new();
        let counts_only = self
            .limits
            .iter()
            .any(|l| l.stage == RESERVATIONS_STAGE || l.stage == SLOTS_STAGE);
        let held = self.limits.iter().map(|l| l.tokens).min().unwrap_or(0);
        if !counts_only && held > 0 {
            fits.push(format!(
                "models.{id}.context_tokens at most {held} (now {})",
                self.promised_tokens
            ));
        }
        let window = self.promised_tokens.div_ceil(sizes.page_tokens.max(1));
        let model_holds = self
            .limits
            .iter()
            .find(|l| l.stage == "model context")
            .is_none_or(|l| l.tokens >= self.promised_tokens);
        if !model_holds {
            // The file's own context cannot be raised by a setting.
            return fits;
        }
        let mut raise = Vec::new();
        if sizes.seq_pages_max < window {
            raise.push(format!(
                "models.{id}.seq_pages_max at least {window} (now {})",
                sizes.seq_pages_max
            ));
        }
        let reserved: u64 = sizes.tenants.iter().map(|t| t.1).sum();
        let pool_min = sizes
            .tenants
            .iter()
            .map(|(_, own, _)| window + reserved - own)
            .fold(window.max(reserved), u64::max);
        if pool_min > sizes.pool_pages {
            raise.push(format!(
                "models.{id}.pool_pages at least {pool_min} (now {})",
                sizes.pool_pages
            ));
        }
        for (name, _, max) in &sizes.tenants {
            if *max < window {
                raise.push(format!(
                    "tenant {name}'s pages_max at least {window} (now {max})"
                ));
            }
        }
        if sizes.tenants.len() as u64 > sizes.step_seqs_max {
            raise.push(format!(
                "models.{id}.step_seqs_max at least {} (now {})",
                sizes.tenants.len(),
                sizes.step_seqs_max
            ));
        }
        if !raise.is_empty() {
            fits.push(raise.join(" and "));
        }
        fits
    }

    /// Ok when every stage holds the promised window; otherwise the first stage
    /// that does not, with the whole table.
    pub fn check(&self) -> Result<(), CapacityViolation> {
        match self.limits.iter().find(|l| l.tokens < self.promised_tokens) {
            None => Ok(()),
            Some(l) => Err(CapacityViolation {
                model: self.model.clone(),
                promised: self.promised_tokens,
                stage: l.stage.clone(),
                field: l.field.clone(),
                tokens: l.tokens,
                capacity: Box::new(self.clone()),
                fits_with: self.fits_with(),
            }),
        }
    }

    /// The table of limits, one stage a line, under the model's id.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "model {}", self.model);
        let _ = writeln!(
            out,
            "  {:<32} {:>10}  {:<6} set by",
            "stage", "tokens", "holds"
        );
        let _ = writeln!(
            out,
            "  {:<32} {:>10}  {:<6} models.{}.context_tokens",
            "promised context", self.promised_tokens, "-", self.model
        );
        for l in &self.limits {
            let holds = if l.tokens >= self.promised_tokens {
                "ok"
            } else {
                "NO"
            };
            let _ = writeln!(
                out,
                "  {:<32} {:>10}  {:<6} {}",
                l.stage, l.tokens, holds, l.field
            );
        }
        let _ = writeln!(
            out,
            "  {:<32} {:>10}  {:<6} models.{}.step_tokens_max (chunked: any prompt length)",
            "prefill chunk budget", self.step_tokens_max, "ok", self.model
        );
        out
    }
}

/// What one model holds in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelMemory {
    /// The model's id.
    pub model: String,
    /// Its weights (the tensors of its file, mapped and read on every step).
    pub weights_bytes: u64,
    /// Its KV pool (allocated whole at load).
    pub kv_bytes: u64,
    /// The GPU holding weights and pool (the CUDA backend), or `None` for host memory.
    pub device: Option<String>,
}

impl ModelMemory {
    /// Weights and KV pool together.
    pub fn total(&self) -> u64 {
        self.weights_bytes.saturating_add(self.kv_bytes)
    }
}

/// The memory of every model against the operator's budget: host memory
/// for CPU models, device memory for CUDA models.
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    /// `engine.memory_max`: None when the operator set no budget.
    pub max_bytes: Option<u64>,
    /// `engine.device_memory_max`, else 90 % of the GPU's memory; None without a GPU.
    pub device_max_bytes: Option<u64>,
    /// Every model, in catalog order.
    pub models: Vec<ModelMemory>,
}

/// A catalog that does not fit the memory budget.
#[derive(Debug, thiserror::Error)]
#[error("memory budget exceeded: model {model} needs {} (weights {}, KV pool {}){}; with the models before it that is {}, above {} ({}): lower its pool_pages, or raise {}\n{table}", human_bytes(*.needed), human_bytes(*.weights_bytes), human_bytes(*.kv_bytes), .budget.place(), human_bytes(*.total), .budget.setting(), human_bytes(*.max_bytes), .budget.setting())]
pub struct MemoryViolation {
    /// The first model that does not fit.
    pub model: String,
    /// The budget it breaks.
    pub budget: Budget,
    /// Its weights.
    pub weights_bytes: u64,
    /// Its KV pool.
    pub kv_bytes: u64,
    /// Both.
    pub needed: u64,
    /// Every model up to and including it.
    pub total: u64,
    /// The budget.
    pub max_bytes: u64,
    /// The whole table.
    pub table: String,
}

/// Which memory a budget is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// Host memory: CPU models (`engine.memory_max`).
    Host,
    /// Device memory: CUDA models (`engine.device_memory_max`).
    Device,
}

impl Budget {
    /// The setting that holds it.
    pub fn setting(self) -> &'static str {
        match self {
            Budget::Host => "engine.memory_max",
            Budget::Device => "engine.device_memory_max",
        }
    }

    /// Where the bytes are, for a message.
    fn place(self) -> &'static str {
        match self {
            Budget::Host => "",
            Budget::Device => " in device memory",
        }
    }
}

impl MemoryBudget {
    /// Every host (`on_device` false) or device model's bytes together.
    pub fn total(&self, on_device: bool) -> u64 {
        self.models
            .iter()
            .filter(|m| m.device.is_some() == on_device)
            .fold(0u64, |sum, m| sum.saturating_add(m.total()))
    }

    /// Ok when every model fits its memory; otherwise the first one (in
    /// catalog order) that takes the sum over its budget, host or device.
    pub fn check(&self) -> Result<(), MemoryViolation> {
        for budget in [Budget::Host, Budget::Device] {
            let max_bytes = match budget {
                Budget::Host => self.max_bytes,
                Budget::Device => self.device_max_bytes,
            };
            let Some(max_bytes) = max_bytes else {
                continue;
            };
            self.check_one(budget, max_bytes)?;
        }
        Ok(())
    }

    fn check_one(&self, budget: Budget, max_bytes: u64) -> Result<(), MemoryViolation> {
        let on_device = budget == Budget::Device;
        let mut total = 0u64;
        for m in self
            .models
            .iter()
            .filter(|m| m.device.is_some() == on_device)
        {
            total = total.saturating_add(m.total());
            if total > max_bytes {
                return Err(MemoryViolation {
                    model: m.model.clone(),
                    budget,
                    weights_bytes: m.weights_bytes,
                    kv_bytes: m.kv_bytes,
                    needed: m.total(),
                    total,
                    max_bytes,
                    table: self.table(),
                });
            }
        }
        Ok(())
    }

    /// One line per model, then the sum against the budget.
    pub fn table(&self) -> String {
        let mut out = String::new();
        self.section(&mut out, false);
        if self.models.iter().any(|m| m.device.is_some()) {
            self.section(&mut out, true);
        }
        out
    }

    /// The host memory table, or the device memory table.
    fn section(&self, out: &mut String, on_device: bool) {
        let models = self
            .models
            .iter()
            .filter(|m| m.device.is_some() == on_device);
        let (title, max_bytes, setting) = match on_device {
            false => ("memory".to_string(), self.max_bytes, "engine.memory_max"),
            true => {
                let gpu = self
                    .models
                    .iter()
                    .find_map(|m| m.device.clone())
                    .unwrap_or_default();
                (
                    format!("device memory ({gpu})"),
                    self.device_max_bytes,
                    "engine.device_memory_max",
                )
            }
        };
        let _ = writeln!(out, "{title}");
        let _ = writeln!(
            out,
            "  {:<32} {:>14} {:>14} {:>14}",
            "model", "weights", "KV pool", "total"
        );
        for m in models {
            let _ = writeln!(
                out,
                "  {:<32} {:>14} {:>14} {:>14}",
                m.model,
                human_bytes(m.weights_bytes),
                human_bytes(m.kv_bytes),
                human_bytes(m.total())
            );
        }
        let total = self.total(on_device);
        let budget = match max_bytes {
            Some(max) => format!(
                "{} ({})",
                human_bytes(max),
                if total <= max { "ok" } else { "NO" }
            ),
            None => format!("not set ({setting})"),
        };
        let _ = writeln!(
            out,
            "  {:<32} {:>44}\n  {:<32} {:>44}",
            "all models",
            human_bytes(total),
            "budget",
            budget
        );
    }
}

/// `bytes` in the largest binary unit that keeps it at least 1 (`1.5 GiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec {
            id: "m".into(),
            path: "m.gguf".into(),
            context_tokens: 4096,
            threads: 1,
            page_tokens: 16,
            pool_pages: 1024,
            seq_pages_max: 256,
            step_tokens_max: 512,
            step_seqs_max: 32,
            kv_type: Default::default(),
            backend: None,
        }
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

    fn tenants(list: &[(&str, u32, u32)]) -> Vec<(String, Quota)> {
        list.iter()
            .map(|&(name, reserved, max)| (name.to_string(), quota(reserved, max)))
            .collect()
    }

    fn violation(spec: &ModelSpec, context: u64, t: &[(&str, u32, u32)]) -> CapacityViolation {
        Capacity::of_model(spec, context, &tenants(t))
            .check()
            .expect_err("a violation")
    }

    #[test]
    fn a_model_that_holds_its_promise_prints_every_stage() {
        let capacity = Capacity::of_model(
            &spec(),
            8192,
            &tenants(&[("alpha", 256, 512), ("beta", 256, 512)]),
        );
        capacity.check().unwrap();
        let table = capacity.table();
        for stage in [
            "model m",
            "promised context",
            "model context",
            "per-sequence page limit",
            "KV pool",
            "tenant alpha maximum",
            "tenant beta maximum",
            "prefill chunk budget",
        ] {
            assert!(table.contains(stage), "{stage} missing from\n{table}");
        }
        assert!(!table.contains("NO"));
    }

    #[test]
    fn refusals_name_the_model_and_the_limit() {
        let v = violation(&spec(), 2048, &[]);
        assert_eq!((v.model.as_str(), v.stage.as_str()), ("m", "model context"));
        assert!(v.to_string().contains("model m") && v.to_string().contains("NO"));

        let short = ModelSpec {
            seq_pages_max: 255,
            ..spec()
        };
        let v = violation(&short, 8192, &[]);
        assert_eq!(v.field, "models.m.seq_pages_max");

        let v = violation(&spec(), 8192, &[("alpha", 0, 255)]);
        assert_eq!(
            (v.stage.as_str(), v.field.as_str()),
            ("tenant alpha maximum", "tenants.alpha.pages_max")
        );

        // beta reserves 800 of 1024 pages: alpha can never hold more than 224.
        let v = violation(&spec(), 8192, &[("alpha", 200, 512), ("beta", 800, 1024)]);
        assert_eq!(v.stage, "tenant alpha maximum");
        assert!(
            v.field.contains("other tenants' pages_reserved"),
            "{}",
            v.field
        );

        let small = ModelSpec {
            context_tokens: 9700,
            pool_pages: 600,
            seq_pages_max: 1000,
            ..spec()
        };
        let v = violation(&small, 16384, &[("alpha", 0, 600)]);
        assert_eq!(
            (v.stage.as_str(), v.field.as_str()),
            ("KV pool", "models.m.pool_pages")
        );

        let v = violation(&spec(), 8192, &[("alpha", 600, 600), ("beta", 600, 600)]);
        assert_eq!(v.stage, RESERVATIONS_STAGE);

        // Three tenants, two slots: one of them would be guaranteed none.
        let two_slots = ModelSpec {
            step_seqs_max: 2,
            ..spec()
        };
        let three = [("a", 0, 512), ("b", 0, 512), ("c", 0, 512)];
        let v = violation(&two_slots, 8192, &three);
        assert_eq!(v.stage, SLOTS_STAGE);
        assert!(
            v.to_string().starts_with(
                "capacity contract of model m violated: sequence slots: 3 tenants may use model m"
            ),
            "{v}"
        );
        assert!(
            v.field.contains("models.m.step_seqs_max is 2"),
            "{}",
            v.field
        );
        let ok = Capacity::of_model(&two_slots, 8192, &tenants(&three[..2]));
        assert!(ok.check().is_ok());
    }

    #[test]
    fn a_refusal_names_the_smallest_changes_that_would_fit_and_each_does() {
        // The README's case: a fourth tenant on a pool alpha mostly reserves.
        let mut m = spec();
        (m.context_tokens, m.pool_pages, m.seq_pages_max) = (8192, 1280, 512);
        let t = [
            ("alpha", 768, 1280),
            ("gamma", 128, 640),
            ("delta", 128, 640),
        ];
        let v = violation(&m, 8192, &t);
        assert_eq!(
            v.fits_with,
            [
                "models.m.context_tokens at most 6144 (now 8192)",
                "models.m.pool_pages at least 1408 (now 1280)",
            ]
        );
        assert!(v.reason().ends_with(
            "; it holds with models.m.context_tokens at most 6144 (now 8192), or with models.m.pool_pages at least 1408 (now 1280)"
        ), "{}", v.reason());
        // Each suggestion is enough, and none asks for more than needed.
        let holds = |m: &ModelSpec| Capacity::of_model(m, 8192, &tenants(&t)).check().is_ok();
        let (mut lower, mut bigger) = (m.clone(), m.clone());
        (lower.context_tokens, bigger.pool_pages) = (6144, 1408);
        assert!(holds(&lower) && holds(&bigger));
        (lower.context_tokens, bigger.pool_pages) = (6145, 1407);
        assert!(!holds(&lower) && !holds(&bigger));

        // Reservations above the pool: no lower promise helps, only the pool.
        let mut small = spec();
        (small.context_tokens, small.pool_pages) = (2048, 256);
        let v = violation(&small, 8192, &[("alpha", 768, 1280), ("delta", 128, 640)]);
        assert_eq!(v.fits_with, ["models.m.pool_pages at least 896 (now 256)"]);

        // Several settings short at once are named together, as one change.
        let mut short = spec();
        (short.seq_pages_max, short.step_seqs_max) = (64, 1);
        let v = violation(&short, 8192, &[("alpha", 0, 128), ("beta", 0, 512)]);
        assert_eq!(
            v.fits_with,
            ["models.m.seq_pages_max at least 256 (now 64) and tenant alpha's pages_max at least 256 (now 128) and models.m.step_seqs_max at least 2 (now 1)"]
        );

        // The file's own context: only a lower promise.
        let v = violation(&spec(), 2048, &[("alpha", 0, 512)]);
        assert_eq!(
            v.fits_with,
            ["models.m.context_tokens at most 2048 (now 4096)"]
        );
    }

    #[test]
    fn sizes_read_as_a_person_would_write_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn a_pages_max_above_the_pool_is_capped_by_the_pool() {
        let capacity = Capacity::of_model(&spec(), 8192, &tenants(&[("alpha", 0, 5000)]));
        let alpha = capacity
            .limits
            .iter()
            .find(|l| l.stage == "tenant alpha maximum")
            .unwrap();
        assert_eq!(alpha.tokens, 1024 * 16);
        assert!(alpha.field.starts_with("models.m.pool_pages"));
    }

    #[test]
    fn the_memory_budget_names_the_first_model_that_does_not_fit() {
        let models = vec![
            ModelMemory {
                model: "small".into(),
                weights_bytes: 100,
                kv_bytes: 50,
                device: None,
            },
            ModelMemory {
                model: "large".into(),
                weights_bytes: 200,
                kv_bytes: 100,
                device: None,
            },
        ];
        let fits = MemoryBudget {
            max_bytes: Some(450),
            device_max_bytes: None,
            models: models.clone(),
        };
        fits.check().unwrap();
        assert!(fits.table().contains("450 B (ok)"), "{}", fits.table());
        let tight = MemoryBudget {
            max_bytes: Some(449),
            device_max_bytes: None,
            models: models.clone(),
        };
        let v = tight.check().unwrap_err();
        assert_eq!((v.model.as_str(), v.needed, v.total), ("large", 300, 450));
        assert!(v.to_string().contains("model large") && v.table.contains("NO"));
        let unset = MemoryBudget {
            max_bytes: None,
            device_max_bytes: None,
            models,
        };
        unset.check().unwrap();
        assert!(unset.table().contains("not set"));
    }

    #[test]
    fn a_models_own_backend_wins_over_the_servers_default() {
        use crate::engine::placement::{BackendChoice, Placement};
        let own_cpu = ModelSpec {
            backend: Some(BackendChoice::Cpu),
            ..spec()
        };
        // Even with `--backend cuda` (which this machine may not run), the
        // model that names the CPU computes there.
        let (placement, _) = crate::catalog::placement_of(&own_cpu, BackendChoice::Cuda).unwrap();
        assert_eq!(placement, Placement::Cpu);
        let (default, _) = crate::catalog::placement_of(&spec(), BackendChoice::Cpu).unwrap();
        assert_eq!(default, Placement::Cpu);
    }

    #[test]
    fn device_models_count_against_device_memory_and_not_the_hosts() {
        let model = |name: &str, bytes: u64, device: bool| ModelMemory {
            model: name.into(),
            weights_bytes: bytes,
            kv_bytes: bytes,
            device: device.then(|| "NVIDIA H200, sm_90".to_string()),
        };
        let budget = MemoryBudget {
            max_bytes: Some(300),
            device_max_bytes: Some(1000),
            models: vec![
                model("cpu", 100, false),
                model("gpu-a", 400, true),
                model("gpu-b", 100, true),
            ],
        };
        // Host: 200 of 300; device: 1000 of 1000.
        budget.check().unwrap();
        let table = budget.table();
        assert!(
            table.contains("device memory (NVIDIA H200, sm_90)"),
            "{table}"
        );
        assert!(
            table.contains("300 B (ok)") && table.contains("1000 B (ok)"),
            "{table}"
        );
        let full = MemoryBudget {
            device_max_bytes: Some(999),
            ..budget.clone()
        };
        let v = full.check().unwrap_err();
        assert_eq!((v.model.as_str(), v.budget), ("gpu-b", Budget::Device));
        let message = v.to_string();
        assert!(
            message.contains("in device memory") && message.contains("engine.device_memory_max"),
            "{message}"
        );
        // The host budget alone is not broken by device bytes.
        let host_tight = MemoryBudget {
            max_bytes: Some(200),
            device_max_bytes: None,
            ..budget
        };
        host_tight.check().unwrap();
    }
}
