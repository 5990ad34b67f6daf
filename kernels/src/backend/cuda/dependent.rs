//! Dependent launches (CUDA's programmatic dependent launch, compute
//! capability 9.0 and later): within a step, every launch after the first
//! may begin before the kernel before it ends, and waits in the kernel for
//! it (`common.cuh`'s `grid_dependency`, before any memory is touched;
//! `nvrtc.rs` checks every kernel's PTX for it). A small decode step is a
//! chain of some 150 short kernels, each otherwise started only once the
//! one before has ended and drained: the gap between two is what this
//! saves, not any kernel's own time.
//!
//! A backend's start-up probe runs a chain of copies (each launch reading
//! what the launch before it wrote) queued one by one and replayed as a
//! captured graph, and keeps dependent launches only where the driver took
//! them and every copy came out whole ([`DependentLaunches::Refused`]
//! otherwise: launched as before, and a warning in the log).

use super::launch::{NormArgs, NORM_BLOCK};
use super::{CudaBackend, DeviceBuffer, DeviceError};
use std::fmt;

/// Links of the probe's chain, and the rows and width each copies.
const PROBE_LINKS: usize = 12;
const PROBE_ROWS: u32 = 16;
const PROBE_WIDTH: u32 = 1024;

/// What the start-up probe found of dependent launches
/// ([`CudaBackend::dependent_launches`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DependentLaunches {
    /// The device launches nothing as a dependent (before compute
    /// capability 9.0): not probed, launches as before.
    Unsupported,
    /// Turned off by the backend's options
    /// ([`super::CudaOptions::dependent_launches`]): not probed, and off
    /// whatever [`CudaBackend::set_dependent_launches`] asks.
    Off,
    /// The chain came out whole, queued and replayed: on.
    Agreed,
    /// The driver refused a dependent launch, or a copy of the chain came
    /// out otherwise than queued one after another: off, whatever
    /// [`CudaBackend::set_dependent_launches`] asks.
    Refused {
        /// What went wrong.
        why: String,
    },
}

impl fmt::Display for DependentLaunches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DependentLaunches::Unsupported => write!(f, "not supported by the device"),
            DependentLaunches::Off => write!(f, "off, as configured"),
            DependentLaunches::Agreed => write!(
                f,
                "a chain of {PROBE_LINKS} dependent launches came out whole, queued and in a graph"
            ),
            DependentLaunches::Refused { why } => {
                write!(f, "refused: {why}; kernels launch one after another")
            }
        }
    }
}

impl CudaBackend {
    /// What the start-up probe found of dependent launches.
    pub fn dependent_launches(&self) -> &DependentLaunches {
        &self.dependent_probe
    }

    /// Runs the probe (`new`, once): on a refusal dependent launches are
    /// off. Only a lost context is an error (nothing more runs).
    pub(super) fn probe_dependent_launches(&mut self) -> Result<DependentLaunches, DeviceError> {
        if !self.options.dependent_launches {
            return Ok(DependentLaunches::Off);
        }
        if !self.device.dependent_launches() {
            return Ok(DependentLaunches::Unsupported);
        }
        self.dependent = true;
        let probed = self.probe_chain();
        self.dependent = false;
        let found = match probed {
            Ok(None) => DependentLaunches::Agreed,
            Ok(Some(why)) => DependentLaunches::Refused { why },
            Err(lost @ DeviceError::Lost { .. }) => return Err(lost),
            Err(error) => DependentLaunches::Refused {
                why: error.to_string(),
            },
        };
        self.dependent = found == DependentLaunches::Agreed;
        Ok(found)
    }

    /// The probe's chain: `x` copied link by link, every launch but the
    /// first a dependent, queued and then captured and replayed (a new `x`
    /// each time). `Some(why)` where a copy came out otherwise.
    fn probe_chain(&mut self) -> Result<Option<String>, DeviceError> {
        let floats = (PROBE_ROWS * PROBE_WIDTH) as usize;
        let buffers = (0..=PROBE_LINKS)
            .map(|_| DeviceBuffer::zeroed(&self.device, 4 * floats as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let chain = |this: &CudaBackend| -> Result<(), DeviceError> {
            this.chained(|| {
                for link in buffers.windows(2) {
                    let args = NormArgs {
                        x: link[0].at(0),
                        gather: 0,
                        gain: 0,
                        out: link[1].at(0),
                        qs: 0,
                        d: 0,
                        sums: 0,
                        width: PROBE_WIDTH,
                        block_len: 32,
                        eps: 0.0,
                        accumulate: 0,
                    };
                    this.launch(PROBE_ROWS, NORM_BLOCK, 0, &args)?;
                }
                Ok(())
            })
        };
        let graph = {
            let this = &*self;
            this.device.capture(&mut || chain(this))?
        };
        for round in 0..3u32 {
            // Each round's values apart from the last's and from zero, so
            // that a link that read before the one before it wrote shows.
            let x: Vec<f32> = (0..floats)
                .map(|i| 1.0 + (i as u32 ^ round.wrapping_mul(0x9E37_79B9)) as f32)
                .collect();
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            buffers[0].write(0, &bytes)?;
            let way = match round {
                0 => {
                    chain(self)?;
                    "queued one by one"
                }
                _ => {
                    graph.replay()?;
                    "replayed in a graph"
                }
            };
            let mut out = vec![0u8; bytes.len()];
            buffers[PROBE_LINKS].read(0, &mut out)?;
            if let Some(at) = out
                .chunks_exact(4)
                .zip(bytes.chunks_exact(4))
                .position(|(a, b)| a != b)
            {
                return Ok(Some(format!(
                    "a chain of {PROBE_LINKS} copies {way} gave another value at float {at} of {floats}"
                )));
            }
        }
        Ok(None)
    }
}
