//! The tensor cores' start-up probe: before a backend takes its first step,
//! one product of each quantized weight type of its model runs both ways,
//! on the tensor cores (`matmul_mma`) and a warp a row (`matmul`), from the
//! same activations, and the backend keeps the tensor cores only where every
//! pair agrees. `mma.sync`'s fragment layout is the PTX manual's and is
//! followed by the emulator the tests run on; a device (or a driver, or a
//! compiler) that lays fragments out otherwise would make every large step
//! wrong, with nothing failing: the probe turns that into slower steps and
//! a warning in the log ([`TensorCoresProbe::Refused`]).

use super::launch::{mode, MatSeg, MATMUL_TOKENS};
use super::{block_len, CudaBackend, DeviceBuffer, DeviceError, Input};
use crate::quant::{ActivationFormat, GgmlType};
use std::fmt;

/// Rows and tokens of a probe's products: past one 64-row block and one
/// 32-token block of `matmul_mma`, each with a part-filled tile (at most the
/// matrix's rows and the backend's largest step).
const PROBE_ROWS: u32 = 80;
const PROBE_TOKENS: u32 = 40;

/// How far a tensor-core product may part from the warp's, relative to the
/// largest of the warp's: their integer sums are exact either way and only
/// the float sums of units run in another order (last places, ~1e-7); a
/// fragment read from the wrong lanes, or a unit's scale applied to
/// another's sum, moves a product by about its own size.
pub const PROBE_TOLERANCE: f32 = 1e-3;

/// What the start-up probe found of the tensor cores
/// ([`CudaBackend::tensor_cores_probe`]).
#[derive(Clone, Debug, PartialEq)]
pub enum TensorCoresProbe {
    /// Not probed, and not used: the device has no tensor cores for these
    /// products, no step of this backend is past [`MATMUL_TOKENS`] tokens,
    /// or the model has no quantized weights.
    Unused,
    /// Turned off by the backend's options ([`super::CudaOptions::tensor_cores`]):
    /// not probed, and off whatever [`CudaBackend::set_tensor_cores`] asks.
    Off,
    /// Every quantized weight type's product agreed: on.
    Agreed {
        /// The types, in the order the model first uses them.
        types: Vec<GgmlType>,
        /// The largest difference, relative to the largest product.
        worst: f32,
    },
    /// A type's product parted: the backend's products run a warp a row,
    /// whatever [`CudaBackend::set_tensor_cores`] asks.
    Refused {
        /// The type (the first to part, in the model's order).
        ty: GgmlType,
        /// By how much, relative to the largest product (infinite where a
        /// product was not a number).
        worst: f32,
    },
}

impl fmt::Display for TensorCoresProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorCoresProbe::Unused => write!(f, "not used"),
            TensorCoresProbe::Off => write!(f, "off, as configured"),
            TensorCoresProbe::Agreed { types, worst } => {
                let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
                write!(
                    f,
                    "agree with the warps' products for {} (worst {worst:.1e} of the largest)",
                    names.join(", ")
                )
            }
            TensorCoresProbe::Refused { ty, worst } => write!(
                f,
                "refused: a {} product parted from the warps' by {worst:.1e} of the largest \
                 (bound {PROBE_TOLERANCE:.0e}); large steps' products run a warp a row",
                ty.name()
            ),
        }
    }
}

impl CudaBackend {
    /// What the start-up probe found of the tensor cores.
    pub fn tensor_cores_probe(&self) -> &TensorCoresProbe {
        &self.tensor_cores_probe
    }

    /// Runs the probe (`new`, once): on a refusal the tensor cores are off.
    pub(super) fn probe_tensor_cores(&mut self) -> Result<TensorCoresProbe, DeviceError> {
        if !self.options.tensor_cores {
            return Ok(TensorCoresProbe::Off);
        }
        let tokens = (self.options.step_tokens_max as u32).min(PROBE_TOKENS);
        if !self.tensor_cores || tokens <= MATMUL_TOKENS {
            return Ok(TensorCoresProbe::Unused);
        }
        let c = &self.model.config;
        let (d, q_len, ffn) = (c.embedding_len as u32, c.q_len() as u32, c.ffn_len as u32);
        // The first matrix of each quantized weight type, with its width.
        let w = &self.weights;
        let mut firsts: Vec<(GgmlType, MatSeg, u32)> = Vec::new();
        let matrices = w
            .layers
            .iter()
            .flat_map(|l| {
                [
                    (&l.wq, d),
                    (&l.wk, d),
                    (&l.wv, d),
                    (&l.wo, q_len),
                    (&l.w_gate, d),
                    (&l.w_up, d),
                    (&l.w_down, ffn),
                ]
            })
            .chain([(&w.output, d)]);
        for (matrix, k) in matrices {
            if block_len(matrix.format()) != 0 && firsts.iter().all(|(ty, ..)| *ty != matrix.ty) {
                firsts.push((matrix.ty, matrix.seg(0, 0), k));
            }
        }
        if firsts.is_empty() {
            return Ok(TensorCoresProbe::Unused);
        }
        let mut worst = 0.0f32;
        for &(ty, seg, k) in &firsts {
            let rows = seg.rows.min(PROBE_ROWS);
            // Inputs of both signs and many sizes, the same on every run.
            let x: Vec<u8> = (0..(tokens * k) as u64)
                .map(|i| (i.wrapping_mul(2_654_435_761) % 2_001) as f32 / 1_000.0 - 1.0)
                .flat_map(f32::to_le_bytes)
                .collect();
            let x = DeviceBuffer::from_bytes(&self.device, &x)?;
            let input = Input {
                x: x.at(0),
                gather: 0,
                gain: None,
                format: ActivationFormat::for_weights(ty),
            };
            let mut products = [Vec::new(), Vec::new()];
            for (cores, product) in [false, true].into_iter().zip(&mut products) {
                let out = DeviceBuffer::zeroed(&self.device, 4 * u64::from(tokens * rows))?;
                let seg = MatSeg {
                    out: out.at(0),
                    out_stride: rows,
                    rows,
                    ..seg
                };
                self.tensor_cores = cores;
                let ran = self.matmul(&[seg], &input, k, tokens, mode::STORE);
                self.tensor_cores = true;
                ran?;
                let mut bytes = vec![0u8; out.bytes() as usize];
                out.read(0, &mut bytes)?;
                *product = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
            }
            let [warps, cores] = &products;
            let largest = warps.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = if largest > 0.0 { largest } else { 1.0 };
            let parted = warps
                .iter()
                .zip(cores)
                .map(|(w, c)| (w - c).abs() / scale)
                // Not a number parts by everything.
                .map(|e| if e.is_nan() { f32::INFINITY } else { e })
                .fold(0.0f32, f32::max);
            if parted > PROBE_TOLERANCE {
                self.tensor_cores = false;
                return Ok(TensorCoresProbe::Refused { ty, worst: parted });
            }
            worst = worst.max(parted);
        }
        Ok(TensorCoresProbe::Agreed {
            types: firsts.into_iter().map(|(ty, ..)| ty).collect(),
            worst,
        })
    }
}
