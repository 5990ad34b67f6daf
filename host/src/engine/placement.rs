//! Where a model computes: on the CPU, or on an NVIDIA GPU through the CUDA
//! backend.
//!
//! Each model's choice is its `[[models]] backend`, else the process's
//! (`--backend`, `[engine] backend`), else `auto`:
//!
//! ```text
//! cpu    the CPU backend, always available
//! cuda   the CUDA backend on device 0 (the first GPU the driver shows
//!        the process: `CUDA_VISIBLE_DEVICES` chooses); a start-up error
//!        naming what is missing (the driver, a device, NVRTC) where it
//!        cannot run
//! auto   cuda when a driver, a device and NVRTC are all present and the
//!        CUDA kernels run the model (every family and weight type the CPU
//!        runs, in widths of whole 32-blocks), else cpu; the log and the
//!        admin /readyz say which, and why
//! ```
//!
//! The machine is probed once per process (the driver loaded by name, no
//! context created); each engine then opens its own stream on the device.

use bulkhead_kernels::backend::cuda::{self, nvrtc};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::OnceLock;

/// A model's backend, as configured.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA where it can run, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// An NVIDIA GPU; refused at start-up where none can be used.
    Cuda,
}

impl BackendChoice {
    /// "auto", "cpu" or "cuda".
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        }
    }
}

/// How CUDA models run, for the whole server (`[engine.cuda]`): both on by
/// default. Each is a way to take a suspected fault out of the path without
/// a rebuild, at the cost of speed (what each costs is the GPU check's
/// with/without rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaSwitches {
    /// Decode steps run as captured CUDA graphs; off, each kernel is
    /// launched on its own every step (vLLM's `--enforce-eager`).
    pub graphs: bool,
    /// Steps of more than 8 tokens (prefill chunks, large batches) multiply
    /// by the quantized weights on the tensor cores, where the device has
    /// them and the start-up probe finds them agreeing with the warps'
    /// products; off, those products run a warp a row and nothing is probed.
    pub tensor_cores: bool,
    /// A step's launches after its first may begin before the kernel before
    /// them ends (CUDA's programmatic dependent launch, compute capability
    /// 9.0 and later), where a start-up probe finds them sound; off, each
    /// kernel starts once the one before it has ended and nothing is probed.
    pub dependent_launches: bool,
}

impl Default for CudaSwitches {
    fn default() -> CudaSwitches {
        CudaSwitches {
            graphs: true,
            tensor_cores: true,
            dependent_launches: true,
        }
    }
}

/// Where a model computes, once resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend on a device.
    Cuda(Gpu),
}

/// The GPU a model runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// The device's index.
    pub ordinal: u32,
    /// Its name and architecture ("NVIDIA H200, sm_90").
    pub name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Cpu => write!(f, "cpu"),
            Placement::Cuda(gpu) => write!(f, "cuda ({})", gpu.name),
        }
    }
}

/// Why `cuda` cannot run here: the message names what is missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("backend cuda: {0}")]
pub struct PlacementError(pub String);

/// What the machine offers, probed once: a usable GPU, or why there is none.
fn machine() -> &'static Result<Gpu, String> {
    static MACHINE: OnceLock<Result<Gpu, String>> = OnceLock::new();
    MACHINE.get_or_init(|| {
        let probe = cuda::probe().map_err(|e| e.to_string())?;
        let device = probe
            .first
            .ok_or_else(|| "no CUDA device: the driver reports none".to_string())?;
        if !nvrtc::is_present() {
            return Err(nvrtc::NvrtcError::Missing.to_string());
        }
        Ok(Gpu {
            ordinal: 0,
            name: format!("{}, {}", device.name, device.arch),
            memory_bytes: device.memory_bytes,
        })
    })
}

/// Resolves `choice` on this machine for a model the CUDA kernels run: the
/// placement, and a sentence saying why (for the log).
pub fn resolve(choice: BackendChoice) -> Result<(Placement, String), PlacementError> {
    resolve_for(choice, || Ok(()))
}

/// Resolves `choice` on this machine for a model: `runs` says whether the
/// CUDA kernels run it (`Err`: what they lack), asked only where a GPU is
/// there to run it on.
pub fn resolve_for(
    choice: BackendChoice,
    runs: impl FnOnce() -> Result<(), String>,
) -> Result<(Placement, String), PlacementError> {
    decide(choice, machine(), runs)
}

/// [`resolve_for`] on a given machine.
fn decide(
    choice: BackendChoice,
    machine: &Result<Gpu, String>,
    runs: impl FnOnce() -> Result<(), String>,
) -> Result<(Placement, String), PlacementError> {
    match (choice, machine) {
        (BackendChoice::Cpu, _) => Ok((Placement::Cpu, "backend cpu, as configured".into())),
        (BackendChoice::Cuda, Ok(gpu)) => match runs() {
            Ok(()) => Ok((
                Placement::Cuda(gpu.clone()),
                format!("backend cuda on {}, as configured", gpu.name),
            )),
            Err(lacks) => Err(PlacementError(format!(
                "{} is present, but the CUDA kernels do not run this model: {lacks} \
                 (choose backend cpu for it)",
                gpu.name
            ))),
        },
        (BackendChoice::Cuda, Err(why)) => Err(PlacementError(why.clone())),
        (BackendChoice::Auto, Ok(gpu)) => match runs() {
            Ok(()) => Ok((
                Placement::Cuda(gpu.clone()),
                format!("backend auto chose cuda: {} is present", gpu.name),
            )),
            Err(lacks) => Ok((
                Placement::Cpu,
                format!(
                    "backend auto chose cpu: {} is present, but the CUDA kernels do not run \
                     this model: {lacks}",
                    gpu.name
                ),
            )),
        },
        (BackendChoice::Auto, Err(why)) => {
            Ok((Placement::Cpu, format!("backend auto chose cpu: {why}")))
        }
    }
}

/// The device memory CUDA models may take together: `configured`, else 90 %
/// of the GPU's (the rest for the CUDA context, scratch and graphs); `None`
/// where there is no GPU.
pub fn device_memory_max(configured: Option<u64>) -> Option<u64> {
    configured.or_else(|| machine().as_ref().ok().map(|gpu| gpu.memory_bytes / 10 * 9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_the_cpu_and_auto_follows_the_machine() {
        assert_eq!(resolve(BackendChoice::Cpu).unwrap().0, Placement::Cpu);
        let (auto, why) = resolve(BackendChoice::Auto).unwrap();
        match machine() {
            Ok(gpu) => {
                assert_eq!(auto, Placement::Cuda(gpu.clone()));
                assert_eq!(resolve(BackendChoice::Cuda).unwrap().0, auto);
            }
            Err(missing) => {
                // No GPU here: auto says why it chose the CPU, cuda refuses with the same reason.
                assert_eq!(auto, Placement::Cpu);
                assert!(
                    why.starts_with("backend auto chose cpu: ") && why.ends_with(missing.as_str()),
                    "{why}"
                );
                let refused = resolve(BackendChoice::Cuda).unwrap_err();
                assert_eq!(refused.to_string(), format!("backend cuda: {missing}"));
                assert_eq!(device_memory_max(None), None);
            }
        }
        assert_eq!(device_memory_max(Some(7)), Some(7));
    }

    #[test]
    fn auto_falls_back_to_the_cpu_for_a_model_the_cuda_kernels_do_not_run() {
        let gpu = Gpu {
            ordinal: 0,
            name: "NVIDIA H200, sm_90".into(),
            memory_bytes: 140 << 30,
        };
        let machine = Ok(gpu.clone());
        let lacks = || {
            Err("widths (d, q_len, ffn: [100, 100, 300]) that are not whole 32-blocks".to_string())
        };
        let (placement, why) = decide(BackendChoice::Auto, &machine, lacks).unwrap();
        assert_eq!(placement, Placement::Cpu);
        assert!(why.contains("H200") && why.ends_with("32-blocks"), "{why}");
        let refused = decide(BackendChoice::Cuda, &machine, lacks).unwrap_err();
        assert!(refused.to_string().contains("32-blocks"), "{refused}");
        let (placement, _) = decide(BackendChoice::Auto, &machine, || Ok(())).unwrap();
        assert_eq!(placement, Placement::Cuda(gpu));
        // Without a GPU the model is never asked about.
        let none = Err("no CUDA driver".to_string());
        let never = || -> Result<(), String> { panic!("asked without a GPU") };
        assert_eq!(
            decide(BackendChoice::Auto, &none, never).unwrap().0,
            Placement::Cpu
        );
        assert_eq!(
            decide(BackendChoice::Cpu, &machine, never).unwrap().0,
            Placement::Cpu
        );
    }

    #[test]
    fn choices_parse_from_policy_text_and_a_model_may_name_none() {
        let choice: BackendChoice = serde_json::from_str("\"cuda\"").unwrap();
        assert_eq!(choice, BackendChoice::Cuda);
        assert!(serde_json::from_str::<BackendChoice>("\"gpu\"").is_err());
        assert_eq!(BackendChoice::default().name(), "auto");
    }
}
