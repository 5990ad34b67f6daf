//! The CUDA kernels and backend, run on the emulator (the same sources,
//! compiled for this CPU), against the CPU's reference code:
//!
//! - the emulator's own canaries: a reduction it must get right, barrier
//!   misuse it must report, and a schedule that changes with the seed;
//! - every argument struct the size the sources declare;
//! - page digests bit for bit the host's, at every XXH3 length class;
//! - the storage conformance suite on device storage, as on host storage;
//! - embedding rows, RMSNorm and quantization, and matrix products of every
//!   weight type against the scalar references;
//! - the whole backend against the CPU backend on tiny models (prefill
//!   chunks, decode tokens split and merged, several sequences at once), with
//!   and without graphs;
//! - hostile page tables refused before any launch.
//!
//! Tests that need a real GPU run where one is present and print "skipped"
//! elsewhere.

use super::device::{Device, DeviceBuffer, DeviceError, Geometry};
use super::emulator::Emulator;
use super::launch::*;
use super::pack::{
    decode_span, decode_splits_max, draw_words, AdjustPlan, DRAW_WORDS, SCORE_WORDS,
};
use super::storage::DeviceStorage;
use super::{
    attention_rows, CudaBackend, CudaOptions, DependentLaunches, Fusions, SPLIT_POSITIONS,
};
use crate::backend::adjust::ADJUST_WORDS;
use crate::backend::{Adjust, Backend, Draw, Pick, SeqStep, StepError};
use crate::gguf::Gguf;
use crate::kv::storage::host_storage;
use crate::kv::{KvType, PageLayout, PageStorage, PageTable, Pool, PoolGeometry};
use crate::model::Model;
use crate::quant::{self, GgmlType, Isa, QuantizedActivations};
use crate::rng::SplitMix64;
use crate::testing::{tiny_llama, TinySpec};
use std::sync::Arc;

fn emulator(seed: u64) -> Arc<dyn Device> {
    Emulator::new(seed)
}

fn uniform(rng: &mut SplitMix64) -> f32 {
    rng.next_f64() as f32 * 2.0 - 1.0
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn read_floats(buffer: &DeviceBuffer, count: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; count * 4];
    buffer.read(0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn launch<A: KernelArgs>(device: &Arc<dyn Device>, grid: u32, block: u32, shared: u32, args: &A) {
    let geometry = Geometry {
        grid,
        block,
        shared_bytes: shared,
    };
    // SAFETY: each test sizes its buffers for the launch it makes.
    unsafe { device.launch(A::KERNEL, geometry, args.bytes()) }.unwrap();
}

// ---------------------------------------------------------------- emulator

#[repr(C)]
#[derive(Clone, Copy)]
struct SelfTestArgs {
    out: u64,
    mode: u32,
    unused: u32,
}
impl KernelArgs for SelfTestArgs {
    const KERNEL: &'static str = "emu_selftest";
}

fn selftest(
    device: &Arc<dyn Device>,
    mode: u32,
    grid: u32,
    block: u32,
) -> Result<Vec<f32>, String> {
    let out = DeviceBuffer::zeroed(device, 4 * 1024).unwrap();
    let args = SelfTestArgs {
        out: out.at(0),
        mode,
        unused: 0,
    };
    let geometry = Geometry {
        grid,
        block,
        shared_bytes: 0,
    };
    // SAFETY: the kernel writes at most 1024 floats of `out`.
    unsafe { device.launch(SelfTestArgs::KERNEL, geometry, args.bytes()) }
        .map_err(|e| e.to_string())?;
    Ok(read_floats(&out, 1024))
}

#[test]
fn the_emulator_reduces_across_warps_and_blocks() {
    let device = emulator(1);
    let out = selftest(&device, 0, 3, 256).unwrap();
    let want = (0..256).sum::<u32>() as f32;
    assert_eq!(&out[..3], &[want, want, want]);
}

#[test]
fn the_emulator_reports_a_barrier_half_the_block_never_reaches() {
    let error = selftest(&emulator(1), 1, 1, 64).unwrap_err();
    assert!(error.contains("exited"), "{error}");
}

#[test]
fn the_emulator_reports_a_shuffle_with_lanes_that_returned() {
    let error = selftest(&emulator(1), 2, 1, 64).unwrap_err();
    assert!(error.contains("lanes that exited"), "{error}");
}

#[test]
fn the_emulators_schedule_changes_with_the_seed_so_a_race_shows() {
    let outcomes: std::collections::HashSet<u32> = (0..32)
        .map(|seed| selftest(&emulator(seed), 3, 1, 64).unwrap()[0].to_bits())
        .collect();
    assert_eq!(
        outcomes.len(),
        2,
        "the unsynchronised read saw only one order"
    );
}

#[test]
fn the_emulator_runs_a_launchs_blocks_in_an_order_drawn_from_its_seed() {
    let orders: std::collections::HashSet<Vec<u32>> = (0..16)
        .map(|seed| {
            let ran = selftest(&emulator(seed), 4, 8, 32).unwrap();
            let order: Vec<u32> = ran[..8].iter().map(|&n| n as u32).collect();
            // Each block once: a permutation of 0..8.
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..8).collect::<Vec<u32>>(), "{order:?}");
            order
        })
        .collect();
    assert!(orders.len() > 8, "{} orders in 16 seeds", orders.len());
}

#[test]
fn the_devices_draw_weights_are_the_hosts_bits() {
    // The pick kernel's weights are exp_rn's; a draw is the host's only
    // where they are the same bits (the emulator's C++ against the Rust).
    let report = super::check::draw_weights(&emulator(1)).unwrap();
    assert!(report.values > 270_000, "{report:?}");
    assert_eq!(report.equal, report.values, "{report:?}");
    assert_eq!(report.first_apart, None);
}

#[test]
fn the_emulator_refuses_shared_memory_past_a_kernels_limit_as_a_gpu_does() {
    let device = emulator(1);
    let out = DeviceBuffer::zeroed(&device, 4 * 1024).unwrap();
    let args = SelfTestArgs {
        out: out.at(0),
        mode: 0,
        unused: 0,
    };
    let run = |kernel: &'static str, shared_bytes: u32| {
        let geometry = Geometry {
            grid: 1,
            block: 64,
            shared_bytes,
        };
        // SAFETY: the self-test writes one float of `out`; the refused
        // launches run nothing.
        unsafe { device.launch(kernel, geometry, args.bytes()) }.map_err(|e| e.to_string())
    };
    // Up to the default 48 KiB any kernel may take; past it only attention,
    // which opts in, up to what it opts in to.
    run(SelfTestArgs::KERNEL, SHARED_DEFAULT_BYTES).unwrap();
    let refused = run(SelfTestArgs::KERNEL, SHARED_DEFAULT_BYTES + 4).unwrap_err();
    assert!(
        refused.contains("past the 49152") && refused.contains("only attention opts in"),
        "{refused}"
    );
    let opt_in = device.shared_bytes_max();
    assert_eq!(opt_in, shared_opt_in_bytes(227 * 1024));
    assert!(opt_in > SHARED_DEFAULT_BYTES);
    let refused = run(AttentionArgs::KERNEL, opt_in + 4).unwrap_err();
    assert!(refused.contains(&format!("past the {opt_in}")), "{refused}");
}

#[test]
fn the_emulator_refuses_all_but_launches_while_capturing_as_a_gpus_stream_does() {
    let device = emulator(1);
    let buffer = DeviceBuffer::zeroed(&device, 64).unwrap();
    let mut bytes = [0u8; 4];
    // Each would run at once here, where a GPU refuses it or would replay it.
    let refused = [
        device.capture(&mut || buffer.write(0, &[1, 2, 3, 4])),
        device.capture(&mut || buffer.read(0, &mut bytes)),
        device.capture(&mut || device.synchronize()),
        device.capture(&mut || DeviceBuffer::zeroed(&device, 16).map(drop)),
    ];
    for (result, call) in refused.into_iter().zip([
        "cuMemcpyHtoDAsync",
        "cuMemcpyDtoHAsync",
        "cuStreamSynchronize",
        "cuMemAlloc",
    ]) {
        let error = result.err().expect("refused").to_string();
        assert!(
            error.contains(call) && error.contains("stream is capturing"),
            "{error}"
        );
    }
    // Nothing was written, and the device is usable again.
    buffer.read(0, &mut bytes).unwrap();
    assert_eq!(bytes, [0; 4]);
    buffer.write(0, &[5; 4]).unwrap();
    // A capture of launches alone is kept and replays.
    let out = DeviceBuffer::zeroed(&device, 4 * 1024).unwrap();
    let args = SelfTestArgs {
        out: out.at(0),
        mode: 0,
        unused: 0,
    };
    let graph = device
        .capture(&mut || {
            let geometry = Geometry {
                grid: 1,
                block: 32,
                shared_bytes: 0,
            };
            // SAFETY: the self-test writes one float of `out`.
            unsafe { device.launch(SelfTestArgs::KERNEL, geometry, args.bytes()) }
        })
        .unwrap();
    assert_eq!(read_floats(&out, 1)[0], 0.0, "captured, not run");
    graph.replay().unwrap();
    assert_eq!(read_floats(&out, 1)[0], (0..32).sum::<u32>() as f32);
}

#[test]
fn a_lost_device_fails_the_step_as_lost_and_other_device_errors_as_failed() {
    let lost = DeviceError::Lost {
        call: "cuStreamSynchronize",
        message: "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered".into(),
    };
    match CudaBackend::device_error(lost) {
        StepError::DeviceLost(why) => assert!(why.contains("ILLEGAL_ADDRESS"), "{why}"),
        other => panic!("{other:?}"),
    }
    let refused = DeviceError::Driver {
        call: "cuLaunchKernel",
        message: "CUDA_ERROR_INVALID_VALUE: invalid argument".into(),
    };
    assert!(matches!(
        CudaBackend::device_error(refused),
        StepError::Device(_)
    ));
}

#[test]
fn argument_structs_are_the_size_the_kernel_sources_declare() {
    let sizes = [
        (EmbedArgs::KERNEL, std::mem::size_of::<EmbedArgs>()),
        (NormArgs::KERNEL, std::mem::size_of::<NormArgs>()),
        (MatmulArgs::KERNEL, std::mem::size_of::<MatmulArgs>()),
        (MatmulMmaArgs::KERNEL, std::mem::size_of::<MatmulMmaArgs>()),
        (RopeKvArgs::KERNEL, std::mem::size_of::<RopeKvArgs>()),
        (AttentionArgs::KERNEL, std::mem::size_of::<AttentionArgs>()),
        (MergeArgs::KERNEL, std::mem::size_of::<MergeArgs>()),
        (DigestArgs::KERNEL, std::mem::size_of::<DigestArgs>()),
        (PickArgs::KERNEL, std::mem::size_of::<PickArgs>()),
        (
            DrawWeightsArgs::KERNEL,
            std::mem::size_of::<DrawWeightsArgs>(),
        ),
    ];
    for (kernel, size) in sizes {
        assert_eq!(Emulator::args_bytes(kernel), Some(size), "{kernel}");
    }
    assert_eq!(Emulator::args_bytes("no_such_kernel"), None);
}

#[test]
fn attention_rows_are_whole_groups_within_the_shared_memory() {
    // head_dim 64, group 3 (SmolLM2): 30 rows, 10 queries an item.
    assert_eq!(attention_rows(64, 3, 48 * 1024), Some(30));
    // head_dim 256 at H100/H200's 227 KiB: all 32 rows; at 99 KiB fewer.
    assert_eq!(attention_rows(256, 4, 227 * 1024), Some(32));
    let rows = attention_rows(256, 4, 99 * 1024).unwrap();
    assert!(rows.is_multiple_of(4) && rows < 32);
    assert!(attention_shared_bytes(256, rows, ATTENTION_TILE) <= 99 * 1024);
    assert!(attention_shared_bytes(256, rows + 4, ATTENTION_TILE) > 99 * 1024);
    // A group wider than what fits: refused, not mis-run.
    assert_eq!(attention_rows(256, 16, 16 * 1024), None);
}

// ---------------------------------------------------------------- storage

fn layout(
    pages: u32,
    page_tokens: u32,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    kv_type: KvType,
) -> PageLayout {
    PoolGeometry {
        pages_count: pages,
        page_tokens,
        layers,
        kv_heads,
        head_dim,
        kv_type,
    }
    .layout()
    .unwrap()
}

/// Fills every slot of every page of both storages with the same random values.
fn fill_both(
    layout: &PageLayout,
    a: &mut dyn PageStorage,
    b: &mut dyn PageStorage,
    rng: &mut SplitMix64,
) {
    let g = layout.geometry();
    let kv_dim = layout.kv_dim();
    for page in 0..g.pages_count as usize {
        for layer in 0..g.layers {
            for slot in 0..g.page_tokens {
                let k: Vec<f32> = (0..kv_dim).map(|_| uniform(rng) * 3.0).collect();
                let v: Vec<f32> = (0..kv_dim).map(|_| uniform(rng)).collect();
                let (k_at, v_at) = (
                    layout.k_offset(layer) + layout.slot_offset(slot),
                    layout.v_offset(layer) + layout.slot_offset(slot),
                );
                a.write_token(page, k_at, v_at, &k, &v);
                b.write_token(page, k_at, v_at, &k, &v);
            }
        }
    }
}

#[test]
fn device_digests_are_the_hosts_bit_for_bit_at_every_length_class() {
    let device = emulator(7);
    let mut rng = SplitMix64(11);
    // Wire bytes per used slot: 2 * layers * kv_dim * value bytes. These cover
    // 0 bytes, 1..=16, 17..=128, 129..=240, one XXH3 block and several.
    let shapes = [
        (1, 1, 1, KvType::F16, 4),  // 4 bytes a slot
        (1, 1, 3, KvType::F16, 8),  // 12 bytes a slot, 8 slots: up to 96
        (2, 1, 5, KvType::F32, 6),  // 80 a slot: 160, 240, 320, 400, 480
        (3, 2, 8, KvType::F16, 16), // 192 a slot, up to 3 KiB
        (2, 3, 6, KvType::F16, 5),  // odd slab widths: reads straddle slabs
    ];
    for (layers, kv_heads, head_dim, kv_type, page_tokens) in shapes {
        let layout = layout(3, page_tokens, layers, kv_heads, head_dim, kv_type);
        let mut host = host_storage(layout);
        let mut dev = DeviceStorage::new(&device, layout).unwrap();
        fill_both(&layout, &mut *host, &mut dev, &mut rng);
        for page in 0..3 {
            for used in 0..=page_tokens {
                assert_eq!(
                    dev.digest(page, used),
                    host.digest(page, used),
                    "{layers} layers, {kv_heads}x{head_dim} {kv_type:?}, page {page}, {used} used"
                );
            }
        }
    }
}

/// The storage trait's behaviour, for any storage: every value of every
/// slab has a place of its own, scrub and poison touch one page only, reads
/// give back what was written, and `holds_rows` answers for the stored bits.
fn storage_conformance(make: &dyn Fn(PageLayout) -> Box<dyn PageStorage>) {
    for kv_type in [KvType::F16, KvType::F32] {
        let layout = layout(3, 2, 2, 1, 3, kv_type);
        let mut storage = make(layout);
        let mut reference = host_storage(layout);
        let mut rng = SplitMix64(5);
        fill_both(&layout, &mut *storage, &mut *reference, &mut rng);
        let rows = |s: &dyn PageStorage, page, used| {
            let mut out = Vec::new();
            s.read_rows(page, used, &mut out);
            out
        };
        for page in 0..3 {
            assert_eq!(
                rows(&*storage, page, 2),
                rows(&*reference, page, 2),
                "{kv_type:?}"
            );
            assert!(!storage.is_zero(page));
        }
        storage.scrub(1);
        assert!(storage.is_zero(1), "{kv_type:?}: scrubbed");
        assert_eq!(
            rows(&*storage, 0, 2),
            rows(&*reference, 0, 2),
            "scrub touched page 0"
        );
        assert_eq!(
            rows(&*storage, 2, 2),
            rows(&*reference, 2, 2),
            "scrub touched page 2"
        );
        storage.poison(2);
        let poisoned = rows(&*storage, 2, 2);
        let poison_value = match kv_type {
            KvType::F16 => crate::kv::POISON_BITS_F16.to_le_bytes().to_vec(),
            KvType::F32 => crate::kv::POISON_BITS.to_le_bytes().to_vec(),
        };
        assert!(poisoned
            .chunks(poison_value.len())
            .all(|c| c == poison_value));
        assert_eq!(
            rows(&*storage, 0, 2),
            rows(&*reference, 0, 2),
            "poison touched page 0"
        );
        // write_rows then holds_rows, for exactly those bits.
        let length = 2 * 2 * 2 * 3 * kv_type.bytes() as usize;
        let bytes: Vec<u8> = (0..length).map(|i| (i * 37 + 11) as u8).collect();
        storage.write_rows(1, 2, &bytes);
        assert_eq!(rows(&*storage, 1, 2), bytes);
        let digest = crate::kv::xxh3_64(&bytes, 2);
        assert!(storage.holds_rows(1, 2, &bytes, digest), "{kv_type:?}");
        let mut flipped = bytes.clone();
        flipped[length / 2] ^= 1;
        let flipped_digest = crate::kv::xxh3_64(&flipped, 2);
        assert!(
            !storage.holds_rows(1, 2, &flipped, flipped_digest),
            "a flipped bit"
        );
        assert!(
            !storage.holds_rows(1, 2, &bytes[..length - 1], digest),
            "another length"
        );
        assert!(!storage.holds_rows(0, 2, &bytes, digest), "another page");
    }
}

#[test]
fn host_storage_passes_the_storage_conformance_suite() {
    storage_conformance(&|layout| host_storage(layout));
}

#[test]
fn emulated_device_storage_passes_the_storage_conformance_suite() {
    let device = emulator(3);
    storage_conformance(&|layout| Box::new(DeviceStorage::new(&device, layout).unwrap()));
}

/// A real GPU, when this machine has one and its driver.
fn gpu() -> Option<Arc<dyn Device>> {
    match super::CudaDevice::open(0) {
        Ok(device) => Some(Arc::new(super::Cuda(device))),
        Err(why) => {
            eprintln!("skipped: no CUDA device here ({why})");
            None
        }
    }
}

#[test]
fn gpu_device_storage_passes_the_storage_conformance_suite() {
    let Some(device) = gpu() else { return };
    storage_conformance(&|layout| Box::new(DeviceStorage::new(&device, layout).unwrap()));
}

// ---------------------------------------------------------------- kernels

/// Every type the device kernels run.
const TYPES: [GgmlType; 11] = super::DEVICE_TYPES;

/// `rows` random rows of `k` weights in `ty` blocks.
fn random_matrix(ty: GgmlType, rows: usize, k: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let row_bytes = k / ty.block_len() * ty.block_bytes();
    let mut bytes = vec![0u8; rows * row_bytes];
    for row in bytes.chunks_exact_mut(row_bytes) {
        let values: Vec<f32> = (0..k).map(|_| uniform(rng)).collect();
        quant::quantize_row(ty, &values, row).unwrap();
    }
    bytes
}

#[test]
fn embedding_rows_are_the_hosts_dequantization_bit_for_bit() {
    let device = emulator(2);
    let mut rng = SplitMix64(3);
    let (rows, width) = (5usize, 512usize);
    for ty in TYPES {
        let table = random_matrix(ty, rows, width, &mut rng);
        let row_bytes = table.len() / rows;
        let tokens: [u32; 4] = [4, 0, 2, 99]; // 99: past the table, zeros
        let table_dev = DeviceBuffer::from_bytes(&device, &table).unwrap();
        let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let tokens_dev = DeviceBuffer::from_bytes(&device, &token_bytes).unwrap();
        let out = DeviceBuffer::zeroed(&device, (4 * tokens.len() * width) as u64).unwrap();
        launch(
            &device,
            tokens.len() as u32,
            ROW_BLOCK,
            0,
            &EmbedArgs {
                table: table_dev.at(0),
                tokens: tokens_dev.at(0),
                out: out.at(0),
                ty: ty as u32,
                width: width as u32,
                row_bytes: row_bytes as u32,
                rows: rows as u32,
                scale: 1.0,
                unused: 0,
            },
        );
        let got = read_floats(&out, tokens.len() * width);
        for (i, &token) in tokens.iter().enumerate() {
            let mut want = vec![0.0f32; width];
            if (token as usize) < rows {
                let row = &table[token as usize * row_bytes..][..row_bytes];
                quant::dequantize_row(ty, row, &mut want).unwrap();
            }
            let got = &got[i * width..(i + 1) * width];
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{}: token {token}", ty.name());
        }
    }
}

/// Runs rms_norm (quantize only, no gain) on `x` and returns the device's
/// quants, scales and sums alongside the buffers for a matmul.
struct DeviceActivations {
    xn: DeviceBuffer,
    qs: DeviceBuffer,
    d: DeviceBuffer,
    sums: DeviceBuffer,
}

fn quantize_on_device(
    device: &Arc<dyn Device>,
    x: &[f32],
    tokens: usize,
    k: usize,
    block_len: u32,
    gain: Option<&[f32]>,
) -> DeviceActivations {
    let x_dev = DeviceBuffer::from_bytes(device, &to_bytes(x)).unwrap();
    let gain_dev = gain.map(|g| DeviceBuffer::from_bytes(device, &to_bytes(g)).unwrap());
    let acts = DeviceActivations {
        xn: DeviceBuffer::zeroed(device, (4 * tokens * k) as u64).unwrap(),
        qs: DeviceBuffer::zeroed(device, (tokens * k) as u64).unwrap(),
        d: DeviceBuffer::zeroed(device, (4 * tokens * k / 32) as u64).unwrap(),
        sums: DeviceBuffer::zeroed(device, (4 * tokens * k / 16) as u64).unwrap(),
    };
    launch(
        device,
        tokens as u32,
        NORM_BLOCK,
        0,
        &NormArgs {
            x: x_dev.at(0),
            gather: 0,
            gain: gain_dev.as_ref().map_or(0, |g| g.at(0)),
            out: acts.xn.at(0),
            qs: acts.qs.at(0),
            d: acts.d.at(0),
            sums: acts.sums.at(0),
            width: k as u32,
            block_len,
            eps: 1e-5,
            accumulate: 0,
        },
    );
    acts
}

#[test]
fn rms_norm_matches_the_cpu_and_quantizes_as_the_cpu_does() {
    let device = emulator(4);
    let mut rng = SplitMix64(8);
    let (tokens, k) = (3usize, 768usize);
    let x: Vec<f32> = (0..tokens * k).map(|_| uniform(&mut rng) * 4.0).collect();
    let gain: Vec<f32> = (0..k).map(|_| 0.5 + uniform(&mut rng)).collect();
    for block_len in [32u32, 256] {
        let acts = quantize_on_device(&device, &x, tokens, k, block_len, Some(&gain));
        let xn = read_floats(&acts.xn, tokens * k);
        // The CPU's rmsnorm: a sequential sum of squares; the device's is a
        // tree, so the values agree to rounding, not bits.
        for t in 0..tokens {
            let row = &x[t * k..(t + 1) * k];
            let mean_square = row.iter().map(|v| v * v).sum::<f32>() / k as f32;
            let inv = 1.0 / (mean_square + 1e-5).sqrt();
            for i in 0..k {
                let want = row[i] * inv * gain[i];
                let got = xn[t * k + i];
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }
        // Quantizing the device's normalised values on the CPU gives the device's quants.
        let ty = if block_len == 32 {
            GgmlType::Q8_0
        } else {
            GgmlType::Q4_K
        };
        let mut cpu = QuantizedActivations::new();
        cpu.quantize(ty, &xn, tokens, k).unwrap();
        let mut qs = vec![0u8; tokens * k];
        acts.qs.read(0, &mut qs).unwrap();
        let d = read_floats(&acts.d, tokens * k / block_len as usize);
        let mut sums_bytes = vec![0u8; 4 * tokens * k / 16];
        acts.sums.read(0, &mut sums_bytes).unwrap();
        let sums: Vec<i32> = sums_bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for t in 0..tokens {
            for b in 0..k / block_len as usize {
                let (quants, scale): (Vec<i8>, f32) = if block_len == 32 {
                    let (quants, d, _) = cpu.q8_1_block(t, b);
                    (quants.to_vec(), d)
                } else {
                    let (qs, d) = cpu.q8_k_row(t);
                    (qs[b * 256..(b + 1) * 256].to_vec(), d[b])
                };
                let got: Vec<i8> = qs[t * k + b * block_len as usize..][..block_len as usize]
                    .iter()
                    .map(|&q| q as i8)
                    .collect();
                assert_eq!(got, quants, "block_len {block_len} token {t} block {b}");
                assert_eq!(d[t * k / block_len as usize + b].to_bits(), scale.to_bits());
            }
            for g in 0..k / 16 {
                let want: i32 = qs[t * k + g * 16..][..16]
                    .iter()
                    .map(|&q| i32::from(q as i8))
                    .sum();
                assert_eq!(sums[t * k / 16 + g], want);
            }
        }
    }
}

#[test]
fn argmax_picks_each_rows_id_as_the_cpus_argmax_does() {
    let device = emulator(21);
    // Not a multiple of the block: the last round has idle threads.
    let vocab = 1000usize;
    let mut rng = SplitMix64(5);
    let mut random = |levels: u64| -> Vec<f32> {
        (0..vocab)
            .map(|_| (rng.next_u64() % levels) as f32 - 2.0)
            .collect()
    };
    let with = |mut row: Vec<f32>, at: &[(usize, f32)]| {
        for &(i, v) in at {
            row[i] = v;
        }
        row
    };
    let rows: Vec<Vec<f32>> = vec![
        // Ties everywhere: the lowest id of the largest.
        random(5),
        random(3),
        random(1000),
        // The largest at the last id, and tied with an earlier one.
        with(random(4), &[(999, 50.0)]),
        with(random(4), &[(999, 50.0), (640, 50.0)]),
        // A NaN at 0 is never exceeded; elsewhere a NaN never wins.
        with(random(4), &[(0, f32::NAN), (10, 80.0)]),
        with(random(4), &[(5, f32::NAN), (6, 9.0), (700, f32::NAN)]),
        // Equal zeros of either sign: the lower id.
        with(vec![-1.0; vocab], &[(7, -0.0), (3, 0.0)]),
        with(vec![-1.0; vocab], &[(3, -0.0), (7, 0.0)]),
        // Infinities, and rows of nothing larger than the first.
        with(random(4), &[(300, f32::INFINITY), (301, f32::INFINITY)]),
        vec![f32::NEG_INFINITY; vocab],
        vec![f32::NAN; vocab],
        with(vec![f32::NAN; vocab], &[(400, 1.0)]),
    ];
    let flat: Vec<f32> = rows.concat();
    let logits = DeviceBuffer::from_bytes(&device, &to_bytes(&flat)).unwrap();
    let out = DeviceBuffer::zeroed(&device, 4 * rows.len() as u64).unwrap();
    let args = PickArgs {
        logits: logits.at(0),
        out: out.at(0),
        draws: 0,
        adjusts: 0,
        scores: 0,
        originals: 0,
        vocab: vocab as u32,
        unused: 0,
    };
    launch(&device, rows.len() as u32, PICK_BLOCK, 0, &args);
    let mut bytes = vec![0u8; 4 * rows.len()];
    out.read(0, &mut bytes).unwrap();
    for (i, row) in rows.iter().enumerate() {
        let got = u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(got, crate::backend::argmax(row), "row {i}");
    }
    // The cases mean what they say.
    let want = |i: usize| crate::backend::argmax(&rows[i]);
    assert_eq!((want(3), want(4), want(5)), (999, 640, 0));
    assert_eq!((want(7), want(8), want(9)), (3, 3, 300));
    assert_eq!((want(10), want(11), want(12)), (0, 0, 0));
}

/// Each row's draw on the device, against [`Draw::pick`] on the host.
fn device_draws(
    device: &Arc<dyn Device>,
    vocab: usize,
    rows: &[(Vec<f32>, Option<Draw>)],
) -> Vec<u32> {
    let rows: Vec<PickCase> = rows
        .iter()
        .map(|(row, draw)| (row.clone(), *draw, Vec::new(), None))
        .collect();
    device_picks(device, vocab, &rows, &[]).0
}

/// A row to pick on the device: its logits, its draw (none: its argmax),
/// its adjustments, and the log probabilities it asks for.
type PickCase = (Vec<f32>, Option<Draw>, Vec<Adjust>, Option<u8>);

/// Each row's token picked on the device after its adjustments (or, where
/// `targets` names one for it, that token, scored and not picked), the
/// rows as the device left them (adjusted where they lay), and each row's
/// log probabilities where it asked for them.
fn device_picks(
    device: &Arc<dyn Device>,
    vocab: usize,
    rows: &[PickCase],
    targets: &[Option<u32>],
) -> (Vec<u32>, Vec<f32>, Vec<Option<crate::backend::Logprobs>>) {
    let flat: Vec<f32> = rows
        .iter()
        .flat_map(|(row, ..)| row.iter().copied())
        .collect();
    let (mut words, mut entries) = (Vec::new(), Vec::new());
    for (i, (_, draw, adjust, logprobs)) in rows.iter().enumerate() {
        // As the packer lays them out: ids sharing an adjustment a word each.
        let at = entries.len();
        let (plan, laid) = AdjustPlan::laid_out(adjust);
        entries.extend(laid);
        words.extend(draw_words(
            draw.as_ref(),
            (at / ADJUST_WORDS) as u32,
            plan.counts(),
            *logprobs,
            targets.get(i).copied().flatten(),
        ));
    }
    entries.push(0); // never an empty buffer
    let bytes = |words: &[u32]| -> Vec<u8> { words.iter().flat_map(|w| w.to_le_bytes()).collect() };
    let logits = DeviceBuffer::from_bytes(device, &to_bytes(&flat)).unwrap();
    let draws = DeviceBuffer::from_bytes(device, &bytes(&words)).unwrap();
    let adjusts = DeviceBuffer::from_bytes(device, &bytes(&entries)).unwrap();
    let out = DeviceBuffer::zeroed(device, 4 * rows.len() as u64).unwrap();
    let scores = DeviceBuffer::zeroed(device, (4 * SCORE_WORDS * rows.len()) as u64).unwrap();
    // What an earlier step left there: never read for this one.
    let stale = vec![1.0e30f32; entries.len() + ADJUST_WORDS];
    let originals = DeviceBuffer::from_bytes(device, &to_bytes(&stale)).unwrap();
    let args = PickArgs {
        logits: logits.at(0),
        out: out.at(0),
        draws: draws.at(0),
        adjusts: adjusts.at(0),
        scores: scores.at(0),
        originals: originals.at(0),
        vocab: vocab as u32,
        unused: 0,
    };
    launch(device, rows.len() as u32, PICK_BLOCK, 0, &args);
    let mut picked = vec![0u8; 4 * rows.len()];
    out.read(0, &mut picked).unwrap();
    let mut after = vec![0u8; 4 * flat.len()];
    logits.read(0, &mut after).unwrap();
    let words = |b: &[u8]| -> Vec<u32> {
        b.chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let after = words(&after).into_iter().map(f32::from_bits).collect();
    let picked = words(&picked);
    let mut scored = vec![0u8; 4 * SCORE_WORDS * rows.len()];
    scores.read(0, &mut scored).unwrap();
    let scored = words(&scored);
    let scored = (rows.iter().enumerate())
        .map(|(i, (.., logprobs))| {
            logprobs.map(|_| {
                super::scores_of(picked[i], &scored[i * SCORE_WORDS..(i + 1) * SCORE_WORDS])
            })
        })
        .collect();
    (picked, after, scored)
}

#[test]
fn a_picked_rows_log_probabilities_on_the_device_are_the_hosts() {
    // Under several of the emulator's thread orders (see
    // `the_emulators_schedule_changes_with_the_seed_so_a_race_shows`).
    for seed in [37, 1, 2, 3] {
        picked_rows_log_probabilities_on(&emulator(seed));
    }
}

fn picked_rows_log_probabilities_on(device: &Arc<dyn Device>) {
    use crate::backend::Logprobs;
    let mut rng = SplitMix64(41);
    let vocab = 1000usize;
    let mut rows: Vec<PickCase> = Vec::new();
    let draw = |rng: &mut SplitMix64| Draw {
        inv_t: 1.0,
        top_k: 0,
        top_p: 0.9,
        min_p: 0.0,
        u: rng.next_f64(),
    };
    for (n, top) in [0u8, 1, 5, 20].into_iter().enumerate() {
        for levels in [0u64, 4] {
            // Continuous logits, and logits of four levels (ties at every
            // place in the top list).
            let row: Vec<f32> = (0..vocab)
                .map(|_| match levels {
                    0 => (rng.next_f64() * 30.0 - 15.0) as f32,
                    l => (rng.next_u64() % l) as f32 * 0.5,
                })
                .collect();
            let drawn = (n % 2 == 1).then(|| draw(&mut rng));
            rows.push((row, drawn, Vec::new(), Some(top)));
        }
    }
    // A NaN among them, infinities, a row of -inf; one that asks nothing.
    let mut with = |at: &[(usize, f32)]| {
        let mut row: Vec<f32> = (0..vocab).map(|_| rng.next_f64() as f32).collect();
        for &(i, v) in at {
            row[i] = v;
        }
        row
    };
    rows.push((with(&[(7, f32::NAN)]), None, Vec::new(), Some(5)));
    rows.push((with(&[(3, f32::INFINITY)]), None, Vec::new(), Some(5)));
    rows.push((with(&[(9, f32::NEG_INFINITY)]), None, Vec::new(), Some(5)));
    rows.push((vec![f32::NEG_INFINITY; vocab], None, Vec::new(), Some(3)));
    rows.push((with(&[]), None, Vec::new(), None));
    let close = |a: f32, b: f32| {
        (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0)
    };
    let check = |picks: &[u32], scored: &[Option<Logprobs>]| {
        for (i, ((row, .., logprobs), scored)) in rows.iter().zip(scored).enumerate() {
            let Some(top) = logprobs else {
                assert!(scored.is_none(), "row {i} asked for none");
                continue;
            };
            let want = Logprobs::of(row, picks[i], usize::from(*top));
            let got = scored.as_ref().expect("asked for");
            assert_eq!(got.token, want.token, "row {i}");
            assert!(
                close(got.logprob, want.logprob),
                "row {i}: {got:?} vs {want:?}"
            );
            let ids = |l: &Logprobs| l.top.iter().map(|&(id, _)| id).collect::<Vec<_>>();
            assert_eq!(ids(got), ids(&want), "row {i}");
            for (&(_, g), &(_, w)) in got.top.iter().zip(&want.top) {
                assert!(close(g, w), "row {i}: {g} vs {w}");
            }
        }
    };
    let (picks, _, scored) = device_picks(device, vocab, &rows, &[]);
    check(&picks, &scored);
    // The same rows as a prompt's, each scored for a given token (the NaN,
    // the infinities among them) and none picked: that token is the row's.
    let targets: Vec<Option<u32>> = (rows.iter().enumerate())
        .map(|(i, (.., logprobs))| logprobs.map(|_| (i as u32 * 37 + 1) % vocab as u32))
        .collect();
    let mut targets_at = targets.clone();
    let (n, nan, inf, neg) = (rows.len(), rows.len() - 5, rows.len() - 4, rows.len() - 3);
    targets_at[nan] = Some(7);
    targets_at[inf] = Some(3);
    targets_at[neg] = Some(9);
    for targets in [targets, targets_at] {
        let (scored_picks, _, scored) = device_picks(device, vocab, &rows, &targets);
        let want: Vec<u32> = (0..n).map(|i| targets[i].unwrap_or(picks[i])).collect();
        assert_eq!(scored_picks, want);
        check(&scored_picks, &scored);
    }
    // The cases mean what they say: 20 alternatives, ties in order.
    let tied = scored[7].as_ref().unwrap();
    assert_eq!(tied.top.len(), 20);
    assert!(tied
        .top
        .windows(2)
        .any(|w| w[0].1 == w[1].1 && w[0].0 < w[1].0));
    // SmolLM2's vocabulary, its 20 likeliest.
    let vocab = 49152;
    let row: Vec<f32> = (0..vocab)
        .map(|_| (rng.next_f64() * 20.0 - 10.0) as f32)
        .collect();
    let cases = [(row, Some(draw(&mut rng)), Vec::new(), Some(20))];
    let (picks, _, scored) = device_picks(device, vocab, &cases, &[]);
    let want = Logprobs::of(&cases[0].0, picks[0], 20);
    let got = scored[0].as_ref().unwrap();
    assert_eq!(
        got.top.iter().map(|t| t.0).collect::<Vec<_>>(),
        want.top.iter().map(|t| t.0).collect::<Vec<_>>()
    );
    assert!(close(got.logprob, want.logprob));
}

#[test]
fn an_adjusted_row_on_the_device_is_the_hosts_adjusted_row_and_picks_its_token() {
    // Under several of the emulator's thread orders: without the barrier
    // between scoring a row and adjusting it, 18 of 20 orders fail.
    for seed in [29, 1, 2, 3] {
        adjusted_rows_on(&emulator(seed));
    }
}

fn adjusted_rows_on(device: &Arc<dyn Device>) {
    let mut rng = SplitMix64(31);
    let vocab = 1000usize;
    let greedy = None;
    let drawn = |rng: &mut SplitMix64| {
        Some(Draw {
            inv_t: 1.0 / 0.8,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            u: rng.next_f64(),
        })
    };
    let random_row = |rng: &mut SplitMix64| -> Vec<f32> {
        (0..vocab)
            .map(|_| (rng.next_f64() * 12.0 - 6.0) as f32)
            .collect()
    };
    // Distinct ascending ids, `n` of them, each adjusted by `f`.
    let list = |rng: &mut SplitMix64, n: usize, f: &dyn Fn(u32, &mut SplitMix64) -> Adjust| {
        let mut ids: Vec<u32> = (0..vocab as u32).collect();
        for i in 0..n {
            let j = i + (rng.next_u64() as usize) % (ids.len() - i);
            ids.swap(i, j);
        }
        let mut ids = ids[..n].to_vec();
        ids.sort_unstable();
        ids.into_iter().map(|id| f(id, rng)).collect::<Vec<_>>()
    };
    let mut rows: Vec<PickCase> = Vec::new();
    for pick in 0..2 {
        let draw = |rng: &mut SplitMix64| if pick == 0 { greedy } else { drawn(rng) };
        // Repetition over many tokens (either sign of logit), then a
        // frequency-style penalty, then biases, each alone and together.
        let repetition = list(&mut rng, 400, &|id, _| Adjust {
            repetition: 1.3,
            ..Adjust::none(id)
        });
        let penalties = list(&mut rng, 100, &|id, rng| Adjust {
            penalty: 0.4 + 0.6 * (rng.next_u64() % 5) as f32,
            ..Adjust::none(id)
        });
        let everything = list(&mut rng, 1500.min(vocab), &|id, rng| {
            let r = rng.next_u64();
            Adjust {
                id,
                repetition: if r & 1 == 1 { 0.7 } else { 1.0 },
                penalty: if r & 2 == 2 { -0.35 } else { 0.0 },
                bias: if r & 4 == 4 {
                    (r >> 8) as f32 % 7.0 - 3.0
                } else {
                    0.0
                },
                ban: r % 97 == 0,
            }
        });
        for adjust in [repetition, penalties, everything] {
            let row = random_row(&mut rng);
            rows.push((row, draw(&mut rng), adjust, None));
        }
        // The row's likeliest banned: the next likeliest wins.
        let row = random_row(&mut rng);
        let best = crate::backend::argmax(&row);
        let ban = vec![Adjust {
            ban: true,
            ..Adjust::none(best)
        }];
        rows.push((row, draw(&mut rng), ban, None));
        // A bias of +100 forces a token; ids past the vocabulary change
        // nothing; every token banned: the argmax of -inf, token 0.
        let row = random_row(&mut rng);
        let forced = vec![
            Adjust {
                bias: 100.0,
                ..Adjust::none(17)
            },
            Adjust {
                bias: 100.0,
                ..Adjust::none(vocab as u32 + 5)
            },
        ];
        rows.push((row, draw(&mut rng), forced, None));
        let all = (0..vocab as u32)
            .map(|id| Adjust {
                ban: true,
                ..Adjust::none(id)
            })
            .collect();
        rows.push((random_row(&mut rng), draw(&mut rng), all, None));
        // No adjustment: the row as it was.
        rows.push((random_row(&mut rng), draw(&mut rng), Vec::new(), None));
    }
    // Own entries before shared ids, a shared id forced (+100): its log
    // probability is of its logit before, kept after the own entries'.
    for draw in [greedy, drawn(&mut rng)] {
        let mut list: Vec<Adjust> = (0..6)
            .map(|id| Adjust {
                bias: 0.1 * id as f32 + 0.1,
                ..Adjust::none(id)
            })
            .collect();
        list.extend([10, 20, 30].map(|id| Adjust {
            bias: 100.0,
            ..Adjust::none(id)
        }));
        rows.push((random_row(&mut rng), draw, list, None));
    }
    // Laid out as the packer lays them: the repetition's 400 ids a word
    // each after its one entry; the mixed lists' most common adjustment so
    // too, the rest each its own entry; two biases their own.
    let counts = |row: usize| AdjustPlan::of(&rows[row].2).counts();
    assert_eq!(counts(0), (0, 400));
    assert!(counts(1).0 > 0 && counts(1).1 >= 20, "{:?}", counts(1));
    assert!(counts(2).0 > 800 && counts(2).1 >= 100, "{:?}", counts(2));
    assert_eq!((counts(4), counts(5)), ((2, 0), (0, vocab as u32)));
    assert_eq!(counts(14), (6, 3));
    let (picks, after, _) = device_picks(device, vocab, &rows, &[]);
    let mut candidates = Vec::new();
    let mut moved = 0;
    for (i, ((row, draw, list, _), &got)) in rows.iter().zip(&picks).enumerate() {
        let mut adjusted = row.clone();
        crate::backend::adjust::adjust(&mut adjusted, list);
        // Bit for bit, the row the host adjusts.
        let on_device = &after[i * vocab..(i + 1) * vocab];
        for (id, (&d, &h)) in on_device.iter().zip(&adjusted).enumerate() {
            assert_eq!(d.to_bits(), h.to_bits(), "row {i} token {id}: {d} vs {h}");
        }
        let pick = |row: &[f32], candidates: &mut Vec<(u32, f32)>| match draw {
            Some(draw) => draw.pick(row, candidates),
            None => crate::backend::argmax(row),
        };
        let want = pick(&adjusted, &mut candidates);
        assert_eq!(got, want, "row {i}: {draw:?}");
        moved += usize::from(want != pick(row, &mut candidates));
    }
    // The cases mean what they say.
    let banned_best = rows[3].2[0].id;
    assert_ne!(picks[3], banned_best);
    assert_eq!((picks[4], picks[5]), (17, 0));
    assert_eq!((picks[11], picks[12]), (17, 0));
    assert!(moved >= 6, "adjustments that change the token: {moved}");
    // Again, each row asking for its log probabilities: the same tokens,
    // each scored in the row as it was before its adjustments (a forced
    // token's own logit among them, not its +100).
    for row in &mut rows {
        row.3 = Some(3);
    }
    let (again, _, scored) = device_picks(device, vocab, &rows, &[]);
    assert_eq!(again, picks);
    for (i, ((row, ..), scored)) in rows.iter().zip(&scored).enumerate() {
        let want = crate::backend::Logprobs::of(row, picks[i], 3);
        let got = scored.as_ref().expect("asked for");
        let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        assert_eq!(got.token, want.token, "row {i}");
        assert!(
            close(got.logprob, want.logprob),
            "row {i}: {got:?} vs {want:?}"
        );
        assert_eq!(got.top.len(), want.top.len(), "row {i}");
        for (g, w) in got.top.iter().zip(&want.top) {
            assert!(
                g.0 == w.0 && close(g.1, w.1),
                "row {i}: {got:?} vs {want:?}"
            );
        }
    }
    let forced = scored[4].as_ref().unwrap();
    assert!(forced.logprob < -1.0, "17's own: {forced:?}");
    for row in [14, 15] {
        assert!([10, 20, 30].contains(&picks[row]), "{}", picks[row]);
        let shared = scored[row].as_ref().unwrap();
        assert!(shared.logprob < -1.0, "its own: {shared:?}");
    }
}

#[test]
fn a_draw_on_the_device_picks_the_token_the_hosts_draw_picks() {
    let device = emulator(23);
    let mut rng = SplitMix64(17);
    // Continuous logits, and logits of few levels (ties at every boundary).
    let mut rows: Vec<(Vec<f32>, Option<Draw>)> = Vec::new();
    let vocab = 1000usize;
    let settings: [(f32, u32, f32, f32); 12] = [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 0.9, 0.0),
        (0.8, 40, 0.95, 0.0),
        (1.0, 7, 1.0, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.5, 0, 1.0, 0.05),
        (0.6, 0, 0.5, 0.1),
        (1.0, 0, 0.0, 0.0),
        (2.0, 999, 0.99, 0.0),
        (1.0, 1000, 1.0, 0.0),
        (1.0, 5000, 0.3, 0.0),
        (0.2, 3, 0.6, 0.5),
    ];
    for (n, &(temperature, top_k, top_p, min_p)) in settings.iter().enumerate() {
        for levels in [0u64, 5, 40] {
            for u in [0.0, rng.next_f64(), rng.next_f64(), 1.0 - 1e-9] {
                let row: Vec<f32> = (0..vocab)
                    .map(|_| match levels {
                        0 => (rng.next_f64() * 12.0 - 6.0) as f32,
                        l => (rng.next_u64() % l) as f32 * 0.25,
                    })
                    .collect();
                let draw = Draw {
                    inv_t: 1.0 / temperature,
                    top_k,
                    top_p,
                    min_p,
                    u,
                };
                // A few rows without a draw (their argmax), among drawn ones.
                rows.push((row, (n % 5 != 4 || levels != 5).then_some(draw)));
            }
        }
    }
    // Rows that draw nothing: a NaN, an infinite logit, all -inf.
    let any = rows[0].1;
    let mut with = |at: usize, v: f32| {
        let mut row: Vec<f32> = (0..vocab).map(|_| rng.next_f64() as f32).collect();
        row[at] = v;
        row
    };
    rows.push((with(300, f32::NAN), any));
    rows.push((with(301, f32::INFINITY), any));
    rows.push((with(302, f32::NEG_INFINITY), any));
    rows.push((vec![f32::NEG_INFINITY; vocab], any));
    // Two logits of the same weight (1), the larger the likelier (a nucleus
    // of one keeps it); and min-p where exp_rn falls as x rises (it keeps
    // the larger logit, weighing an ulp below min_p).
    let exp_rn = crate::backend::draw::exp_rn;
    let fall = -0.249_998_12f32;
    let below = (1..64)
        .map(|ulps| f32::from_bits(fall.to_bits() + ulps))
        .find(|&x| exp_rn(x) > exp_rn(fall))
        .expect("exp_rn falls at -0.24999812");
    let mut ties = vec![-9.0f32; vocab];
    (ties[10], ties[11]) = (-2e-9, -1e-9);
    let mut falls = vec![-9.0f32; vocab];
    (falls[12], falls[13], falls[14]) = (0.0, fall, below);
    for (row, top_p, min_p) in [(ties, 0.3, 0.0), (falls, 1.0, exp_rn(below))] {
        for u in [0.0, 0.5, 1.0 - 1e-9] {
            let draw = Draw {
                inv_t: 1.0,
                top_k: 0,
                top_p,
                min_p,
                u,
            };
            rows.push((row.clone(), Some(draw)));
        }
    }
    let picks = device_draws(&device, vocab, &rows);
    let mut candidates = Vec::new();
    let mut drawn_elsewhere = 0;
    for (i, ((row, draw), &got)) in rows.iter().zip(&picks).enumerate() {
        let want = match draw {
            Some(draw) => draw.pick(row, &mut candidates),
            None => crate::backend::argmax(row),
        };
        assert_eq!(got, want, "row {i}: {draw:?}");
        drawn_elsewhere += usize::from(want != crate::backend::argmax(row));
    }
    // The draws mean something: most rows do not give their argmax.
    assert!(
        drawn_elsewhere > rows.len() / 2,
        "{drawn_elsewhere} of {}",
        rows.len()
    );
    // SmolLM2's vocabulary: many tokens a thread, and the full walk.
    let vocab = 49152;
    let rows: Vec<(Vec<f32>, Option<Draw>)> = [
        (0.8, 0, 0.95, 0.0),
        (1.0, 50, 1.0, 0.0),
        (1.0, 0, 1.0, 0.02),
    ]
    .iter()
    .map(|&(temperature, top_k, top_p, min_p)| {
        let row = (0..vocab)
            .map(|_| (rng.next_f64() * 20.0 - 10.0) as f32)
            .collect();
        let draw = Draw {
            inv_t: 1.0 / temperature,
            top_k,
            top_p,
            min_p,
            u: rng.next_f64(),
        };
        (row, Some(draw))
    })
    .collect();
    let picks = device_draws(&device, vocab, &rows);
    for ((row, draw), got) in rows.iter().zip(picks) {
        assert_eq!(got, draw.unwrap().pick(row, &mut candidates), "{draw:?}");
    }
}

#[test]
fn a_product_makes_its_own_activations_for_a_few_tokens_within_the_default_shared_memory() {
    use super::fused_shared_bytes;
    use crate::quant::ActivationFormat::{F32, Q8_1, Q8_K};
    // SmolLM2: every product of a decode step of up to 8 sequences but the
    // head (49,152 rows: a norm launch does it once for its 12,288 blocks).
    for k in [576, 1536] {
        for tokens in 1..=8 {
            let bytes = fused_shared_bytes(tokens, k, 1536, Q8_1).expect("fused");
            assert_eq!(bytes, tokens * (k + k / 8 + k / 4));
        }
        assert_eq!(
            fused_shared_bytes(9, k, 1536, Q8_1),
            None,
            "a prefill chunk"
        );
        assert_eq!(fused_shared_bytes(1, k, 1536, F32), None, "float weights");
    }
    assert_eq!(fused_shared_bytes(1, 576, 49_152, Q8_1), None, "the head");
    assert!(fused_shared_bytes(1, 576, 16_384, Q8_1).is_some());
    // Q8_K's scales are one per 256.
    assert_eq!(
        fused_shared_bytes(2, 512, 960, Q8_K),
        Some(2 * (512 + 8 + 128))
    );
    // A wide FFN (8192: Llama 3.2 1B's down) fits alone, not 8 at a time.
    assert!(fused_shared_bytes(1, 8192, 2048, Q8_1).is_some());
    assert_eq!(fused_shared_bytes(8, 8192, 2048, Q8_1), None);
    assert!(fused_shared_bytes(8, 4352, 2048, Q8_1).unwrap() <= 47 * 1024);
}

/// `ty`'s product of `w` with the rows `x` (RMS-normalised with `gain`
/// where given), its activations made by a norm launch (`fused` false) or by
/// the product's own blocks; the outputs' bits.
#[allow(clippy::too_many_arguments)]
fn product_bits(
    device: &Arc<dyn Device>,
    ty: GgmlType,
    w: &DeviceBuffer,
    rows: usize,
    x: &[f32],
    tokens: usize,
    k: usize,
    gain: Option<&[f32]>,
    fused: bool,
) -> Vec<u32> {
    let block_len = match quant::ActivationFormat::for_weights(ty) {
        quant::ActivationFormat::Q8_K => 256,
        _ => 32,
    };
    let acts = quantize_on_device(device, x, tokens, k, block_len, gain);
    let x_dev = DeviceBuffer::from_bytes(device, &to_bytes(x)).unwrap();
    let gain_dev = gain.map(|g| DeviceBuffer::from_bytes(device, &to_bytes(g)).unwrap());
    let out = DeviceBuffer::zeroed(device, (4 * tokens * rows) as u64).unwrap();
    let mut seg = [MatSeg::default(); MATMUL_SEGS_MAX];
    seg[0] = MatSeg {
        w: w.at(0),
        out: out.at(0),
        ty: ty as u32,
        rows: rows as u32,
        row_bytes: (k / ty.block_len() * ty.block_bytes()) as u32,
        out_stride: rows as u32,
        ..MatSeg::default()
    };
    let k32 = k as u32;
    let shared = tokens as u32 * (k32 + 4 * k32 / block_len + 4 * k32 / 16);
    let args = MatmulArgs {
        seg,
        qs: acts.qs.at(0),
        d: acts.d.at(0),
        sums: acts.sums.at(0),
        norm_x: if fused { x_dev.at(0) } else { 0 },
        norm_gain: gain_dev.as_ref().map_or(0, |g| g.at(0)),
        segs: 1,
        k: k32,
        tokens: tokens as u32,
        mode: mode::STORE,
        block_len,
        eps: 1e-5,
        ..MatmulArgs::default()
    };
    let blocks = matmul_blocks(rows as u32, tokens as u32, mode::STORE);
    launch(
        device,
        blocks,
        MATMUL_WARPS * 32,
        if fused { shared } else { 0 },
        &args,
    );
    read_floats(&out, tokens * rows)
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn a_product_that_makes_its_own_activations_gives_the_norm_launchs_bits() {
    let device = emulator(6);
    let mut rng = SplitMix64(10);
    let rows = 9usize;
    // 576 is not a whole number of rms_norm's 256-wide chunks.
    for (k, tokens) in [(576usize, 1usize), (576, 3), (512, 8), (768, 2)] {
        let x: Vec<f32> = (0..tokens * k).map(|_| uniform(&mut rng) * 3.0).collect();
        let gain: Vec<f32> = (0..k).map(|_| 0.5 + uniform(&mut rng)).collect();
        for ty in TYPES {
            let format = quant::ActivationFormat::for_weights(ty);
            if format == quant::ActivationFormat::F32 || k % ty.block_len() != 0 {
                continue;
            }
            let w = random_matrix(ty, rows, k, &mut rng);
            let w_dev = DeviceBuffer::from_bytes(&device, &w).unwrap();
            for gain in [None, Some(&gain[..])] {
                let bits =
                    |fused| product_bits(&device, ty, &w_dev, rows, &x, tokens, k, gain, fused);
                assert_eq!(
                    bits(true),
                    bits(false),
                    "{} k {k} tokens {tokens} gain {}",
                    ty.name(),
                    gain.is_some()
                );
            }
        }
    }
}

#[test]
fn matrix_products_of_every_weight_type_match_the_scalar_reference() {
    let device = emulator(5);
    let mut rng = SplitMix64(9);
    let (rows, k) = (37usize, 512usize);
    for tokens in [1usize, 3, 11] {
        let x: Vec<f32> = (0..tokens * k).map(|_| uniform(&mut rng) * 2.0).collect();
        for ty in TYPES {
            let w = random_matrix(ty, rows, k, &mut rng);
            let row_bytes = w.len() / rows;
            let block_len = match quant::ActivationFormat::for_weights(ty) {
                quant::ActivationFormat::Q8_K => 256,
                _ => 32,
            };
            let acts = quantize_on_device(&device, &x, tokens, k, block_len, None);
            let w_dev = DeviceBuffer::from_bytes(&device, &w).unwrap();
            let out = DeviceBuffer::zeroed(&device, (4 * tokens * rows) as u64).unwrap();
            let mut seg = [MatSeg::default(); MATMUL_SEGS_MAX];
            seg[0] = MatSeg {
                w: w_dev.at(0),
                out: out.at(0),
                bias: 0,
                cap: 0.0,
                unused: 0,
                ty: ty as u32,
                rows: rows as u32,
                row_bytes: row_bytes as u32,
                out_stride: rows as u32,
            };
            launch(
                &device,
                matmul_blocks(rows as u32, tokens as u32, mode::STORE),
                MATMUL_WARPS * 32,
                0,
                &MatmulArgs {
                    seg,
                    x: acts.xn.at(0),
                    qs: acts.qs.at(0),
                    d: acts.d.at(0),
                    sums: acts.sums.at(0),
                    segs: 1,
                    k: k as u32,
                    tokens: tokens as u32,
                    mode: mode::STORE,
                    block_len,
                    ..MatmulArgs::default()
                },
            );
            let got = read_floats(&out, tokens * rows);
            let mut xq = QuantizedActivations::new();
            xq.quantize(ty, &x, tokens, k).unwrap();
            let mut want = vec![0.0f32; tokens * rows];
            quant::matmul(Isa::Scalar, ty, &w, k, 0..rows, &xq, &mut want);
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-5 * scale,
                    "{} tokens {tokens} output {i}: {g} vs {w}",
                    ty.name()
                );
            }
        }
    }
}

/// A matrix of a test launch: its type, rows, weights and bias.
type TestSeg<'a> = (GgmlType, usize, &'a DeviceBuffer, Option<&'a DeviceBuffer>);

/// One launch of `mode` over the matrices `segs` (type, rows, bytes, bias)
/// with the activations `acts` of `tokens` tokens of `k`, on the tensor
/// cores (`mma`) or a warp a row; each matrix's output, every token's row,
/// starting from `start` (a residual stream for ADD, a gate for SILU_MUL).
#[allow(clippy::too_many_arguments)]
fn segment_products(
    device: &Arc<dyn Device>,
    segs: &[TestSeg<'_>],
    acts: &DeviceActivations,
    tokens: usize,
    k: usize,
    mode: u32,
    start: &[f32],
    mma: bool,
) -> Vec<Vec<f32>> {
    let ty = segs[0].0;
    let block_len = match quant::ActivationFormat::for_weights(ty) {
        quant::ActivationFormat::Q8_K => 256,
        _ => 32,
    };
    let outs: Vec<DeviceBuffer> = segs
        .iter()
        .map(|&(_, rows, ..)| {
            DeviceBuffer::from_bytes(device, &to_bytes(&start[..tokens * rows])).unwrap()
        })
        .collect();
    let mut seg = [MatSeg::default(); MATMUL_SEGS_MAX];
    for (i, &(ty, rows, w, bias)) in segs.iter().enumerate() {
        seg[i] = MatSeg {
            w: w.at(0),
            out: outs[i].at(0),
            bias: bias.map_or(0, |b| b.at(0)),
            ty: ty as u32,
            rows: rows as u32,
            row_bytes: (k / ty.block_len() * ty.block_bytes()) as u32,
            out_stride: rows as u32,
            ..MatSeg::default()
        };
    }
    let swiglu = mode == mode::SWIGLU || mode == mode::GEGLU;
    let rows: usize = if swiglu {
        segs[0].1
    } else {
        segs.iter().map(|s| s.1).sum()
    };
    let args = MatmulArgs {
        seg,
        qs: acts.qs.at(0),
        d: acts.d.at(0),
        sums: acts.sums.at(0),
        segs: segs.len() as u32,
        k: k as u32,
        tokens: tokens as u32,
        mode,
        block_len,
        ..MatmulArgs::default()
    };
    let (rows, tokens32) = (rows as u32, tokens as u32);
    if mma {
        let blocks = matmul_mma_blocks(rows, tokens32);
        launch(device, blocks, MATMUL_WARPS * 32, 0, &MatmulMmaArgs(args));
    } else {
        let blocks = matmul_blocks(rows, tokens32, mode);
        launch(device, blocks, MATMUL_WARPS * 32, 0, &args);
    }
    // SWIGLU and GEGLU store into the gate's output alone.
    let stored = if swiglu { 1 } else { segs.len() };
    outs.iter()
        .zip(segs)
        .take(stored)
        .map(|(out, s)| read_floats(out, tokens * s.1))
        .collect()
}

#[test]
fn the_tensor_cores_product_is_the_warps_product_for_every_weight_type_and_mode() {
    let device = emulator(7);
    let mut rng = SplitMix64(11);
    let k = 512usize;
    // Tokens past one 8-token tile and past one 32-token block, each with a
    // part-filled tile; rows not a whole 16-row tile, segments apart.
    for tokens in [9usize, 37] {
        let x: Vec<f32> = (0..tokens * k).map(|_| uniform(&mut rng) * 2.0).collect();
        let start: Vec<f32> = (0..tokens * 64).map(|_| uniform(&mut rng)).collect();
        for ty in TYPES {
            let format = quant::ActivationFormat::for_weights(ty);
            if format == quant::ActivationFormat::F32 {
                continue;
            }
            let block_len = if format == quant::ActivationFormat::Q8_K {
                256
            } else {
                32
            };
            let acts = quantize_on_device(&device, &x, tokens, k, block_len, None);
            let matrix = |rows, ty, rng: &mut SplitMix64| {
                DeviceBuffer::from_bytes(&device, &random_matrix(ty, rows, k, rng)).unwrap()
            };
            // A Q8_K launch whose last matrix is Q6_K: a warp's rows that
            // scale their halves apart and rows that do not.
            let other = if format == quant::ActivationFormat::Q8_K {
                GgmlType::Q6_K
            } else {
                ty
            };
            let (a, b, c) = (
                matrix(21, ty, &mut rng),
                matrix(12, ty, &mut rng),
                matrix(30, other, &mut rng),
            );
            let bias_values: Vec<f32> = (0..21).map(|_| uniform(&mut rng)).collect();
            let bias = DeviceBuffer::from_bytes(&device, &to_bytes(&bias_values)).unwrap();
            let cases: [(u32, Vec<TestSeg<'_>>); 5] = [
                (
                    mode::STORE,
                    vec![
                        (ty, 21, &a, Some(&bias)),
                        (ty, 12, &b, None),
                        (other, 30, &c, None),
                    ],
                ),
                (mode::ADD, vec![(other, 30, &c, None)]),
                (mode::SWIGLU, vec![(ty, 21, &a, None), (ty, 21, &a, None)]),
                (mode::GEGLU, vec![(ty, 21, &a, None), (ty, 21, &a, None)]),
                (mode::SILU_MUL, vec![(ty, 12, &b, None)]),
            ];
            for (mode, segs) in &cases {
                let products =
                    |mma| segment_products(&device, segs, &acts, tokens, k, *mode, &start, mma);
                let (warps, cores) = (products(false), products(true));
                for (s, (want, got)) in warps.iter().zip(&cores).enumerate() {
                    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    assert!(scale > 0.0);
                    for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
                        assert!(
                            (w - g).abs() <= 1e-5 * scale,
                            "{} mode {mode} tokens {tokens} matrix {s} output {i}: {g} vs {w}",
                            ty.name()
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the backend

fn tiny_model(spec: &TinySpec) -> Arc<Model> {
    let gguf = Gguf::from_bytes(tiny_llama(spec)).unwrap();
    Arc::new(Model::load(Arc::new(gguf)).unwrap())
}

fn pool_with_tables(
    model: &Model,
    kv_type: KvType,
    page_tokens: u32,
    seqs: u32,
    per_seq: u32,
    device: Option<&Arc<dyn Device>>,
) -> (Pool, Vec<PageTable>) {
    super::check::pool_with_tables(model, kv_type, page_tokens, seqs, per_seq, device, true)
}

/// A CUDA backend for `model` on `device`, steps of at most `tokens` tokens
/// of `seqs` sequences, with or without graphs.
fn backend(
    model: &Arc<Model>,
    device: &Arc<dyn Device>,
    tokens: usize,
    seqs: usize,
    graphs: bool,
) -> CudaBackend {
    let options = CudaOptions {
        step_tokens_max: tokens,
        step_seqs_max: seqs,
        graphs,
        tensor_cores: true,
        dependent_launches: true,
    };
    CudaBackend::new(Arc::clone(model), Arc::clone(device), options).unwrap()
}

/// The CPU and CUDA backends in lockstep over the prompts and `decode_steps`
/// greedy tokens (`check::agreement`): every logit row within `tolerance`
/// of the CPU's (relative to its largest), greedy tokens equal but at near
/// ties. Returns the worst relative error.
fn compare_with_cpu(
    spec: &TinySpec,
    kv_type: KvType,
    page_tokens: u32,
    prompts: &[usize],
    decode_steps: usize,
    graphs: bool,
    tolerance: f32,
) -> f32 {
    let run = super::check::AgreementRun {
        kv_type,
        page_tokens,
        prompts,
        decode_steps,
        graphs,
        cpu_threads: 1,
        // The scalar reference: its sums are the ones the device's
        // quantization rounds after, so a 1-ulp difference that flips one Q8
        // quant (and moves logits by ~1e-3) does not hide a kernel's error.
        cpu_isa: Some(Isa::Scalar),
        seed: spec.seed ^ 77,
        tolerance,
        // By tiles: a tile's sums run in the CPU's order, so a logit that
        // parts from the CPU's by more than `tolerance` is a kernel's
        // error, not one Q8 rounding flipped by a last-bit difference.
        // By warps: `a_decode_tokens_attention_by_warps_is_the_tiles_and_the_reference`
        // and `the_backend_matches_the_cpu_backend_with_decode_attention_by_warps`.
        decode_by_warps: false,
        tensor_cores: true,
    };
    compare_run(spec, &run)
}

/// [`compare_with_cpu`] of `run` on `spec`'s model.
fn compare_run(spec: &TinySpec, run: &super::check::AgreementRun) -> f32 {
    compare_run_on(spec, run, &emulator(spec.seed))
}

/// [`compare_run`] on `device`.
fn compare_run_on(
    spec: &TinySpec,
    run: &super::check::AgreementRun,
    device: &Arc<dyn Device>,
) -> f32 {
    let (prompts, tolerance) = (run.prompts, run.tolerance);
    let model = tiny_model(spec);
    let agreement = super::check::agreement(&model, device, run);
    assert_eq!(agreement.rows, prompts.len() * (run.decode_steps + 1));
    // And each prompt's positions before its last (as a prompt's log
    // probabilities ask for them), within the looser bound.
    let share = 1 + crate::backend::SCORED_ROWS_MAX / prompts.len();
    let scored: usize = prompts.iter().map(|&len| len.min(share) - 1).sum();
    assert!(scored > 0, "some prompt asks for several rows");
    assert_eq!(agreement.scored_rows, scored);
    assert!(agreement.worst_relative <= tolerance, "{agreement:?}");
    assert!(agreement.worst_relative_scored <= 1e-2, "{agreement:?}");
    assert_eq!(
        agreement.greedy_agree + agreement.near_ties,
        agreement.rows,
        "{agreement:?}"
    );
    assert_eq!(agreement.picks_agree, agreement.rows, "{agreement:?}");
    assert_eq!(agreement.draws_agree, agreement.rows, "{agreement:?}");
    assert_eq!(
        agreement.prompt_scores_agree, agreement.scored_rows,
        "{agreement:?}"
    );
    eprintln!(
        "worst relative error of the logits: {:.2e}",
        agreement.worst_relative
    );
    agreement.worst_relative
}

#[test]
fn the_backend_matches_the_cpu_backend_on_a_tiny_q4_1_model() {
    let spec = TinySpec::default();
    compare_with_cpu(&spec, KvType::F16, 16, &[5, 17, 1], 6, false, 1e-4);
}

#[test]
fn the_backend_matches_the_cpu_backend_with_a_large_steps_products_a_warp_a_row() {
    // The first step has 23 tokens: on the tensor cores by default (every
    // other agreement test), here as steps of at most 8 tokens run, with
    // RoPE and the KV store in the Q/K/V product.
    let spec = TinySpec::default();
    let run = super::check::AgreementRun {
        kv_type: KvType::F16,
        page_tokens: 16,
        prompts: &[5, 17, 1],
        decode_steps: 2,
        graphs: false,
        cpu_threads: 1,
        cpu_isa: Some(Isa::Scalar),
        seed: spec.seed ^ 77,
        tolerance: 1e-4,
        decode_by_warps: false,
        tensor_cores: false,
    };
    compare_run(&spec, &run);
}

/// The emulator, but for what a test makes go wrong: its tensor cores'
/// products leave a step's last token unwritten (as a fragment laid out
/// otherwise would leave outputs wrong), or its dependent launches are
/// refused by the driver, or are dropped (run nothing, as a kernel that
/// ran before the one it depends on would leave its outputs stale). Counts
/// tensor-core and dependent launches asked of it.
#[derive(Debug)]
struct FaultyDevice {
    inner: Arc<dyn Device>,
    wrong_mma: bool,
    dependents: Option<DependentFault>,
    mma_launches: std::sync::atomic::AtomicU64,
    dependent_launches: std::sync::atomic::AtomicU64,
}

/// What goes wrong of a [`FaultyDevice`]'s dependent launches.
#[derive(Clone, Copy, Debug, PartialEq)]
enum DependentFault {
    Refused,
    Dropped,
}

impl FaultyDevice {
    fn new(seed: u64, wrong_mma: bool, dependents: Option<DependentFault>) -> Arc<FaultyDevice> {
        Arc::new(FaultyDevice {
            inner: emulator(seed),
            wrong_mma,
            dependents,
            mma_launches: 0.into(),
            dependent_launches: 0.into(),
        })
    }

    fn mma_launches(&self) -> u64 {
        self.mma_launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn dependent_launches_asked(&self) -> u64 {
        self.dependent_launches
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Device for FaultyDevice {
    fn describe(&self) -> String {
        "CUDA emulator with faults".into()
    }
    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }
    fn shared_bytes_max(&self) -> u32 {
        self.inner.shared_bytes_max()
    }
    fn tensor_cores(&self) -> bool {
        true
    }
    fn alloc(&self, bytes: u64) -> Result<u64, super::DeviceError> {
        self.inner.alloc(bytes)
    }
    unsafe fn free(&self, at: u64, bytes: u64) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.free(at, bytes) }
    }
    unsafe fn write(&self, at: u64, src: &[u8]) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write(at, src) }
    }
    unsafe fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.read(at, dst) }
    }
    unsafe fn copy(&self, dst: u64, src: u64, bytes: u64) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy(dst, src, bytes) }
    }
    unsafe fn fill(
        &self,
        rect: super::device::Rect,
        fill: super::device::Fill,
    ) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.fill(rect, fill) }
    }
    unsafe fn read_rect(
        &self,
        rect: super::device::Rect,
        dst: &mut [u8],
    ) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.read_rect(rect, dst) }
    }
    unsafe fn write_rect(
        &self,
        rect: super::device::Rect,
        src: &[u8],
    ) -> Result<(), super::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write_rect(rect, src) }
    }
    unsafe fn launch(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), super::DeviceError> {
        let mut args = args.to_vec();
        if self.wrong_mma && kernel == MatmulMmaArgs::KERNEL {
            self.mma_launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let at = std::mem::offset_of!(MatmulArgs, tokens);
            let tokens = u32::from_le_bytes(args[at..at + 4].try_into().unwrap());
            args[at..at + 4].copy_from_slice(&(tokens - 1).to_le_bytes());
        }
        // SAFETY: the caller's promise, for fewer tokens than it made.
        unsafe { self.inner.launch(kernel, geometry, &args) }
    }
    unsafe fn launch_dependent(
        &self,
        kernel: &'static str,
        geometry: Geometry,
        args: &[u8],
    ) -> Result<(), super::DeviceError> {
        self.dependent_launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.dependents {
            Some(DependentFault::Refused) => Err(super::DeviceError::Launch {
                kernel,
                message: "cuLaunchKernelEx: CUDA_ERROR_NOT_SUPPORTED: operation not supported"
                    .into(),
            }),
            Some(DependentFault::Dropped) => Ok(()),
            // SAFETY: the caller's promise, passed on.
            None => unsafe { self.launch(kernel, geometry, args) },
        }
    }
    fn dependent_launches(&self) -> bool {
        self.dependents.is_some()
    }
    fn synchronize(&self) -> Result<(), super::DeviceError> {
        self.inner.synchronize()
    }
    fn capture(
        &self,
        record: &mut dyn FnMut() -> Result<(), super::DeviceError>,
    ) -> Result<Box<dyn super::DeviceGraph>, super::DeviceError> {
        self.inner.capture(record)
    }
    fn launches(&self) -> u64 {
        self.inner.launches()
    }
}

#[test]
fn the_start_up_probe_keeps_tensor_cores_that_agree_and_refuses_others() {
    let spec = TinySpec::default();
    let model = tiny_model(&spec);
    // The emulator's agree: every quantized type the model has, in the
    // model's order (Q4_1 blocks, the tied Q8_0 head).
    let good = emulator(spec.seed);
    let cuda = backend(&model, &good, 64, 4, true);
    match cuda.tensor_cores_probe() {
        super::TensorCoresProbe::Agreed { types, worst } => {
            assert_eq!(types, &[GgmlType::Q4_1, GgmlType::Q8_0]);
            assert!(*worst <= 1e-5, "{worst}");
        }
        other => panic!("{other:?}"),
    }
    assert!(cuda.tensor_cores);
    assert_eq!(
        cuda.modes().unwrap(),
        "graphs on, tensor cores on, dependent launches on"
    );
    // Steps of at most 8 tokens never take them: not probed.
    let wrong = FaultyDevice::new(spec.seed, true, None);
    let device: Arc<dyn Device> = wrong.clone();
    let small = backend(&model, &device, 8, 8, true);
    assert_eq!(small.tensor_cores_probe(), &super::TensorCoresProbe::Unused);
    assert_eq!(wrong.mma_launches(), 0);
    // Wrong ones are refused at the first type, after one launch, and stay
    // off whatever is asked.
    let mut cuda = backend(&model, &device, 64, 4, true);
    match cuda.tensor_cores_probe() {
        super::TensorCoresProbe::Refused { ty, worst } => {
            assert_eq!(*ty, GgmlType::Q4_1);
            assert!(*worst > super::PROBE_TOLERANCE, "{worst}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(wrong.mma_launches(), 1);
    cuda.set_tensor_cores(true);
    assert!(!cuda.tensor_cores);
    assert_eq!(
        cuda.modes().unwrap(),
        "graphs on, tensor cores refused by the start-up probe, dependent launches not supported"
    );
    drop(cuda);
    // Turned off by the options (the operator's `[engine.cuda]`): not
    // probed, and off whatever is asked later.
    let options = CudaOptions {
        step_tokens_max: 64,
        step_seqs_max: 4,
        graphs: false,
        tensor_cores: false,
        dependent_launches: true,
    };
    let mut off = CudaBackend::new(Arc::clone(&model), Arc::clone(&device), options).unwrap();
    assert_eq!(off.tensor_cores_probe(), &super::TensorCoresProbe::Off);
    assert!(!off.tensor_cores);
    assert_eq!(wrong.mma_launches(), 1);
    off.set_tensor_cores(true);
    assert!(!off.tensor_cores);
    assert_eq!(
        off.modes().unwrap(),
        "graphs off, tensor cores off, dependent launches not supported"
    );
    drop(off);
    // A backend on them then matches the CPU's, prompts of 23 tokens and
    // decode steps of 12 sequences, without launching them again.
    let prompts = [5, 17, 1];
    let twelve = [3, 9, 1, 4, 2, 7, 1, 5, 2, 6, 1, 3];
    for (prompts, graphs) in [(&prompts[..], false), (&twelve[..], true)] {
        let run = super::check::AgreementRun {
            kv_type: KvType::F16,
            page_tokens: 16,
            prompts,
            decode_steps: 2,
            graphs,
            cpu_threads: 1,
            cpu_isa: Some(Isa::Scalar),
            seed: spec.seed ^ 77,
            tolerance: 1e-4,
            decode_by_warps: false,
            tensor_cores: true,
        };
        compare_run_on(&spec, &run, &device);
    }
    assert_eq!(wrong.mma_launches(), 3, "only the probes launched them");
}

/// One decode step of `tables`' sequences at `position` on `cuda`: the
/// launches it made and, of them, those the emulator ran as dependents.
fn launches_of_a_step(
    cuda: &mut CudaBackend,
    pool: &mut Pool,
    tables: &[PageTable],
    position: usize,
    emulator: &Emulator,
) -> (u64, u64) {
    let inputs: Vec<[u32; 1]> = (0..tables.len()).map(|s| [s as u32 + 1]).collect();
    let steps: Vec<SeqStep> = tables
        .iter()
        .zip(&inputs)
        .map(|(table, input)| SeqStep::new(table, position, input))
        .collect();
    let (launches, dependents) = (emulator.launches(), emulator.dependent_launches_run());
    cuda.step(&steps, pool).unwrap();
    (
        emulator.launches() - launches,
        emulator.dependent_launches_run() - dependents,
    )
}

#[test]
fn a_steps_launches_after_its_first_are_dependents_and_change_no_bit() {
    let spec = TinySpec {
        seed: 29,
        ..TinySpec::default()
    };
    // Prefill, decode in graphs with a padding sequence, a decode token
    // split and merged, page digests: the same bits either way.
    let on = run_bits(&spec, KvType::F16, &|_| {});
    let off = run_bits(&spec, KvType::F16, &|cuda| {
        cuda.set_dependent_launches(false)
    });
    assert_eq!(on, off);
    // Every launch of a step but its first is a dependent, queued or
    // replayed in a graph; none once they are turned off.
    let model = tiny_model(&spec);
    let emu = Emulator::new(spec.seed);
    let device: Arc<dyn Device> = emu.clone();
    let (mut pool, tables) = pool_with_tables(&model, KvType::F16, 16, 2, 1, Some(&device));
    for graphs in [false, true] {
        let mut cuda = backend(&model, &device, 16, 2, graphs);
        assert_eq!(cuda.dependent_launches(), &DependentLaunches::Agreed);
        assert!(cuda.modes().unwrap().ends_with(", dependent launches on"));
        for (position, on) in [(0, true), (1, true), (2, true), (3, false), (4, true)] {
            cuda.set_dependent_launches(on);
            let (launched, dependents) =
                launches_of_a_step(&mut cuda, &mut pool, &tables, position, &emu);
            assert!(launched > 10, "{launched}");
            let want = if on { launched - 1 } else { 0 };
            assert_eq!(dependents, want, "graphs {graphs}, step {position}");
        }
        cuda.set_dependent_launches(false);
        assert!(cuda.modes().unwrap().ends_with(", dependent launches off"));
    }
    // Turned off by the options: not probed, never on.
    let options = CudaOptions {
        step_tokens_max: 16,
        step_seqs_max: 2,
        graphs: true,
        tensor_cores: true,
        dependent_launches: false,
    };
    let mut off = CudaBackend::new(Arc::clone(&model), Arc::clone(&device), options).unwrap();
    assert_eq!(off.dependent_launches(), &DependentLaunches::Off);
    off.set_dependent_launches(true);
    let (launched, dependents) = launches_of_a_step(&mut off, &mut pool, &tables, 5, &emu);
    assert!(launched > 10 && dependents == 0, "{launched} {dependents}");
    assert!(off.modes().unwrap().ends_with(", dependent launches off"));
}

#[test]
fn the_start_up_probe_keeps_dependent_launches_that_come_out_whole_and_refuses_others() {
    let spec = TinySpec::default();
    let model = tiny_model(&spec);
    let run = super::check::AgreementRun {
        kv_type: KvType::F16,
        page_tokens: 16,
        prompts: &[5, 17, 1],
        decode_steps: 2,
        graphs: true,
        cpu_threads: 1,
        cpu_isa: Some(Isa::Scalar),
        seed: spec.seed ^ 91,
        tolerance: 1e-4,
        decode_by_warps: true,
        tensor_cores: true,
    };
    // A driver that refuses them, and one that drops them (as a kernel that
    // ran before the one it depends on would leave stale outputs): both
    // refused, and steps then launch as before, with no dependent asked.
    for (fault, why) in [
        (DependentFault::Refused, "CUDA_ERROR_NOT_SUPPORTED"),
        (DependentFault::Dropped, "gave another value at float 0"),
    ] {
        let faulty = FaultyDevice::new(spec.seed, false, Some(fault));
        let device: Arc<dyn Device> = faulty.clone();
        let mut cuda = backend(&model, &device, 16, 2, true);
        match cuda.dependent_launches() {
            DependentLaunches::Refused { why: found } => {
                assert!(found.contains(why), "{fault:?}: {found}")
            }
            other => panic!("{fault:?}: {other:?}"),
        }
        cuda.set_dependent_launches(true);
        assert!(
            cuda.modes()
                .unwrap()
                .ends_with(", dependent launches refused by the start-up probe"),
            "{:?}",
            cuda.modes()
        );
        let asked = faulty.dependent_launches_asked();
        assert!(asked > 0);
        let (mut pool, tables) = pool_with_tables(&model, KvType::F16, 16, 2, 1, Some(&device));
        let inputs = [[3u32], [4u32]];
        for position in 0..3 {
            let steps: Vec<SeqStep> = tables
                .iter()
                .zip(&inputs)
                .map(|(table, input)| SeqStep::new(table, position, input))
                .collect();
            cuda.step(&steps, &mut pool).unwrap();
        }
        assert_eq!(faulty.dependent_launches_asked(), asked, "{fault:?}");
        // And what those steps compute is the CPU's.
        compare_run_on(&spec, &run, &device);
    }
    // A device without them: not probed.
    let plain: Arc<dyn Device> = FaultyDevice::new(spec.seed, false, None);
    let cuda = backend(&model, &plain, 16, 2, true);
    assert_eq!(cuda.dependent_launches(), &DependentLaunches::Unsupported);
    assert!(cuda
        .modes()
        .unwrap()
        .ends_with(", dependent launches not supported"));
}

#[test]
fn the_emulator_refuses_a_dependent_launch_that_follows_anything_but_a_launch() {
    let emu = Emulator::new(3);
    let device: Arc<dyn Device> = emu.clone();
    let (a, b) = (
        DeviceBuffer::zeroed(&device, 4 * 256).unwrap(),
        DeviceBuffer::zeroed(&device, 4 * 256).unwrap(),
    );
    let copy = NormArgs {
        x: a.at(0),
        gather: 0,
        gain: 0,
        out: b.at(0),
        qs: 0,
        d: 0,
        sums: 0,
        width: 256,
        block_len: 32,
        eps: 0.0,
        accumulate: 0,
    };
    let geometry = Geometry {
        grid: 1,
        block: NORM_BLOCK,
        shared_bytes: 0,
    };
    // SAFETY (each launch below): `copy` reads and writes 256 floats of a
    // and b, which hold them.
    let dependent = || unsafe { device.launch_dependent(NormArgs::KERNEL, geometry, copy.bytes()) };
    let plain = || unsafe { device.launch(NormArgs::KERNEL, geometry, copy.bytes()) };
    a.write(0, &to_bytes(&[1.5; 256])).unwrap();
    let refused = dependent().unwrap_err().to_string();
    assert!(refused.contains("other than a launch"), "{refused}");
    plain().unwrap();
    dependent().unwrap();
    assert_eq!(read_floats(&b, 256), vec![1.5; 256]);
    assert_eq!(emu.dependent_launches_run(), 1);
    // The first launch of a capture follows nothing in its graph.
    assert!(device.capture(&mut || dependent()).is_err());
    let graph = device
        .capture(&mut || {
            plain()?;
            dependent()
        })
        .unwrap();
    graph.replay().unwrap();
    assert_eq!(emu.dependent_launches_run(), 2);
}

#[test]
fn decode_steps_of_more_than_8_sequences_match_the_cpu_backend_in_graphs() {
    // Ten sequences: each decode step's products take the tensor cores'
    // kernel and its Q/K/V a rope_kv launch, captured and replayed.
    let spec = TinySpec::default();
    compare_with_cpu(
        &spec,
        KvType::F16,
        4,
        &[3, 1, 4, 1, 5, 2, 6, 1, 2, 3],
        3,
        true,
        1e-4,
    );
}

#[test]
fn the_backend_matches_the_cpu_backend_with_f32_pages_and_q8_0_weights() {
    let spec = TinySpec {
        seed: 3,
        matrix_type: GgmlType::Q8_0,
        embedding_type: GgmlType::F16,
        separate_output: true,
        ..TinySpec::default()
    };
    compare_with_cpu(&spec, KvType::F32, 4, &[9, 2], 5, false, 1e-4);
}

#[test]
fn the_backend_matches_the_cpu_backend_on_k_quants() {
    let spec = TinySpec {
        seed: 5,
        embedding_len: 256,
        heads: 4,
        kv_heads: 1,
        ffn_len: 512,
        matrix_type: GgmlType::Q4_K,
        embedding_type: GgmlType::Q6_K,
        ..TinySpec::default()
    };
    compare_with_cpu(&spec, KvType::F16, 8, &[12, 3], 3, false, 1e-4);
}

#[test]
fn decode_attention_split_over_many_spans_is_merged_as_the_cpu_computes_it() {
    // A prompt past two splits, so every decode token's attention is split
    // into three or more items and merged.
    let spec = TinySpec {
        seed: 9,
        layers: 1,
        context_len: 1024,
        ..TinySpec::default()
    };
    let prompt = 2 * SPLIT_POSITIONS as usize + 30;
    compare_with_cpu(&spec, KvType::F16, 16, &[prompt, 4], 3, false, 1e-4);
}

#[test]
fn graphs_replay_decode_steps_with_the_same_results_as_launches() {
    let spec = TinySpec {
        seed: 13,
        ..TinySpec::default()
    };
    // Three sequences: a bucket of four with one padding sequence.
    let with = compare_with_cpu(&spec, KvType::F16, 16, &[5, 9, 2], 6, true, 1e-4);
    let without = compare_with_cpu(&spec, KvType::F16, 16, &[5, 9, 2], 6, false, 1e-4);
    assert_eq!(
        with.to_bits(),
        without.to_bits(),
        "graphs change no arithmetic"
    );
}

/// The bits of every logit of a run on the emulator of a backend as
/// `configure` sets it, and the digest of every page after it: three
/// prompts in one step (52 tokens: norm launches), then decode steps of the
/// three (products that make their own activations; the longest sequence's
/// attention split in two and merged) as a captured graph with a padding
/// sequence.
fn run_bits(
    spec: &TinySpec,
    kv_type: KvType,
    configure: &dyn Fn(&mut CudaBackend),
) -> (Vec<u32>, Vec<u64>) {
    let model = tiny_model(spec);
    let device = emulator(spec.seed);
    let (page_tokens, prompts, decode_steps) = (4u32, [9usize, 3, 40], 3);
    let longest = prompts.iter().max().unwrap() + decode_steps;
    let per_seq = (longest as u32).div_ceil(page_tokens);
    let (mut pool, tables) =
        pool_with_tables(&model, kv_type, page_tokens, 3, per_seq, Some(&device));
    let mut cuda = backend(&model, &device, 64, 4, true);
    configure(&mut cuda);
    let mut rng = SplitMix64(spec.seed);
    let vocab = model.config.vocab_len as u64;
    let inputs: Vec<Vec<u32>> = prompts
        .iter()
        .map(|&n| {
            (0..n + decode_steps)
                .map(|_| (rng.next_u64() % vocab) as u32)
                .collect()
        })
        .collect();
    let mut bits = Vec::new();
    for i in 0..=decode_steps {
        let steps: Vec<SeqStep> = (0..3)
            .map(|s| {
                let (pos_start, len) = match i {
                    0 => (0, prompts[s]),
                    _ => (prompts[s] + i - 1, 1),
                };
                SeqStep {
                    logits: len.min(2),
                    ..SeqStep::new(
                        &tables[s],
                        pos_start,
                        &inputs[s][pos_start..pos_start + len],
                    )
                }
            })
            .collect();
        let logits = cuda.step(&steps, &mut pool).unwrap();
        bits.extend(logits.values.iter().map(|v| v.to_bits()));
    }
    let digests = tables
        .iter()
        .flat_map(|table| (0..per_seq as usize).map(move |i| table.lease(i).unwrap()))
        .map(|lease| pool.digest(lease, page_tokens).unwrap())
        .collect();
    (bits, digests)
}

#[test]
fn each_fusion_gives_the_bits_of_the_launches_it_replaces() {
    // The Q/K/V product that turns Q and K and stores K and V, on every
    // RoPE layout; attention folding its own splits; products making their
    // own activations: each on its own and all together.
    use crate::model::Architecture;
    let cases = [
        ("llama (adjacent pairs)", TinySpec::default(), KvType::F16),
        (
            "qwen2 (halves, biases)",
            TinySpec {
                seed: 52,
                architecture: Architecture::Qwen2,
                ..TinySpec::default()
            },
            KvType::F32,
        ),
        // RoPE on half of each 16-wide head, with Llama 3's table.
        (
            "llama 3 (partial)",
            TinySpec {
                seed: 53,
                rope_dim: Some(8),
                rope_freqs: true,
                ..TinySpec::default()
            },
            KvType::F16,
        ),
        (
            "qwen2 (partial halves)",
            TinySpec {
                seed: 54,
                architecture: Architecture::Qwen2,
                rope_dim: Some(8),
                ..TinySpec::default()
            },
            KvType::F16,
        ),
    ];
    for (name, spec, kv_type) in cases {
        let model = tiny_model(&spec);
        assert_eq!(
            model.config.rope_dim,
            spec.rope_dim.map_or(16, |r| r as usize)
        );
        let fused = run_bits(&spec, kv_type, &|_| {});
        // 3 prompts' last 2 rows, then 3 decode rows a step, 3 steps.
        assert_eq!(fused.0.len(), (6 + 9) * model.config.vocab_len, "{name}");
        // 12, 6 and 43 positions written: 16 pages, each its own values,
        // and 17 pages of zeros.
        let distinct: std::collections::HashSet<u64> = fused.1.iter().copied().collect();
        assert_eq!((fused.1.len(), distinct.len()), (33, 17), "{name}");
        let all = Fusions::default();
        let each_off = [
            Fusions { rope: false, ..all },
            Fusions {
                merge: false,
                ..all
            },
            Fusions {
                norms: false,
                ..all
            },
            Fusions::NONE,
        ];
        for fusions in each_off {
            let other = run_bits(&spec, kv_type, &|c| c.set_fusions(fusions));
            let logit = fused.0.iter().zip(&other.0).position(|(a, b)| a != b);
            assert_eq!(logit, None, "{name}, {fusions:?}: the first logit apart");
            assert_eq!(fused.1, other.1, "{name}, {fusions:?}: page digests");
        }
    }
}

#[test]
fn a_prefill_chunks_attention_in_smaller_items_gives_the_same_logits() {
    // The tiny model's group is 2: items of 16 queries by default (32 rows),
    // and its prompts are 9, 3 and 40 tokens: in items of 5, no item of one
    // query, whose rows are read by warps as a decode token's are (in
    // another order: within 1e-5), and every row's sums in the same order.
    let spec = TinySpec::default();
    let model = tiny_model(&spec);
    let default = run_bits(&spec, KvType::F16, &|_| {});
    for queries in [1, 2, 5, 7] {
        let other = run_bits(&spec, KvType::F16, &|c| c.set_prefill_item_queries(queries));
        if queries == 5 {
            // A layer's K and V come from the attention of the layer before.
            assert_eq!(default.1, other.1, "items of 5: page digests");
        }
        let vocab = model.config.vocab_len;
        for (row, (want, got)) in default
            .0
            .chunks(vocab)
            .zip(other.0.chunks(vocab))
            .enumerate()
        {
            if queries == 5 {
                assert_eq!(want, got, "items of 5, row {row}: the same bits");
            }
            let value = |bits: &u32| f32::from_bits(*bits);
            let scale = want.iter().map(value).fold(0.0f32, |m, v| m.max(v.abs()));
            for (w, g) in want.iter().map(value).zip(got.iter().map(value)) {
                assert!(
                    (w - g).abs() <= 1e-5 * scale,
                    "items of {queries}, row {row}: {g} vs {w}"
                );
            }
        }
    }
    // More items, each a block: the profile counts their blocks.
    let device = emulator(4);
    let blocks = |queries: u32| {
        let mut cuda = backend(&model, &device, 64, 1, false);
        cuda.set_prefill_item_queries(queries);
        let (mut pool, tables) = pool_with_tables(&model, KvType::F16, 16, 1, 4, Some(&device));
        let tokens: Vec<u32> = (0..40).collect();
        device.profile_start();
        cuda.step(&[SeqStep::new(&tables[0], 0, &tokens)], &mut pool)
            .unwrap();
        let launches = device.profile_take();
        let attention = launches.iter().find(|l| l.kernel == "attention").unwrap();
        attention.grid
    };
    let kv_heads = model.config.kv_heads_count as u32;
    let most = blocks(u32::MAX);
    assert_eq!(blocks(5), kv_heads * 40u32.div_ceil(5));
    assert!(most < blocks(5), "{most}");
}

#[test]
fn host_floats_are_zeroed_and_take_a_read_from_the_device() {
    let device = emulator(1);
    let mut host = super::HostFloats::zeroed(&device, 1000).unwrap();
    assert_eq!(host.len(), 1000);
    assert!(host.as_slice().iter().all(|&v| v == 0.0));
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let buffer = DeviceBuffer::from_bytes(&device, &to_bytes(&values)).unwrap();
    buffer
        .read(0, super::le_bytes_mut(host.as_mut_slice()))
        .unwrap();
    assert_eq!(host.as_slice(), &values[..]);
    assert!(super::HostFloats::zeroed(&device, 0).unwrap().is_empty());
}

#[test]
fn a_decode_steps_rows_are_read_into_page_locked_memory_and_more_rows_are_not() {
    // Page-locked memory for a row a sequence: a decode step's rows go
    // there; a prompt's many rows (log probabilities) into the Vec. Either
    // way the same values as a backend with no page-locked memory at all.
    let model = tiny_model(&TinySpec::default());
    let device = emulator(5);
    let run = |pinned: bool| {
        let (mut pool, tables) = pool_with_tables(&model, KvType::F16, 16, 2, 1, Some(&device));
        let mut cuda = backend(&model, &device, 16, 2, false);
        let vocab = model.config.vocab_len;
        let locked = cuda
            .pinned
            .as_ref()
            .map(|p| (p.as_slice().as_ptr(), p.len()));
        assert_eq!(locked.map(|(_, len)| len), Some(2 * vocab));
        if !pinned {
            cuda.pinned = None;
        }
        let prompt = [3u32, 1, 4, 1, 5];
        let mut out = Vec::new();
        for (pos_start, len, rows) in [(0, 5, 5), (5, 1, 1)] {
            let steps: Vec<SeqStep> = tables
                .iter()
                .map(|table| SeqStep {
                    logits: rows,
                    ..SeqStep::new(
                        table,
                        pos_start,
                        if len == 5 { &prompt } else { &prompt[..1] },
                    )
                })
                .collect();
            let logits = cuda.step(&steps, &mut pool).unwrap();
            assert_eq!(logits.values.len(), 2 * rows * vocab);
            let at = logits.values.as_ptr();
            let in_locked = locked.is_some_and(|(p, _)| std::ptr::eq(p, at));
            assert_eq!(in_locked, pinned && rows == 1, "{rows} rows a sequence");
            out.push(logits.values.to_vec());
        }
        out
    };
    let (with, without) = (run(true), run(false));
    assert!(with == without, "the same values either way");
}

// ---------------------------------------------------------------- hostile tables

#[test]
fn scrub_and_hostile_page_tables_hold_on_the_device() {
    // Released pages read back zero from device memory; a stale, a
    // foreign-pool and a cross-tenant table entry are refused before any
    // launch (the last stops the engine with the page book's message).
    let model = tiny_model(&TinySpec::default());
    let outcomes = super::check::isolation(&model, &emulator(1));
    let names: Vec<&str> = outcomes.iter().map(|o| o.name).collect();
    assert_eq!(
        names,
        [
            "released pages read back scrubbed",
            "stale page-table entry",
            "foreign-pool page-table entry",
            "cross-tenant page-table entry"
        ]
    );
    for outcome in outcomes {
        assert!(outcome.pass, "{}: {}", outcome.name, outcome.detail);
    }
}

#[test]
fn a_host_pool_is_refused_by_the_cuda_backend() {
    let model = tiny_model(&TinySpec::default());
    let device = emulator(1);
    let (mut pool, tables) = pool_with_tables(&model, KvType::F16, 16, 1, 2, None);
    let mut cuda = backend(&model, &device, 64, 4, false);
    let tokens = [1u32];
    let step = SeqStep::new(&tables[0], 0, &tokens);
    assert_eq!(
        cuda.step(&[step], &mut pool).err().unwrap(),
        StepError::DeviceStorage
    );
}

#[test]
fn the_backend_matches_the_cpu_backend_on_q5_and_bf16_weights() {
    // The 32-weight types with a fifth bit (a K-quant file's attention and
    // FFN matrices are often Q5_0), and bf16 through the float path.
    for (seed, ty) in [
        (21, GgmlType::Q5_0),
        (22, GgmlType::Q5_1),
        (23, GgmlType::BF16),
    ] {
        let spec = TinySpec {
            seed,
            matrix_type: ty,
            embedding_type: ty,
            separate_output: true,
            ..TinySpec::default()
        };
        eprintln!("{}:", ty.name());
        compare_with_cpu(&spec, KvType::F16, 16, &[7, 2], 4, false, 1e-4);
    }
    // Q5_K needs rows of whole 256-blocks. Its seed as in
    // `kernels/tests/backend_cpu.rs`: on about half the seeds of this shape
    // one Q8_K activation rounds apart between any two paths, the CPU's own
    // AVX2 and AVX-512 against its scalar ones included (3e-3 of the largest
    // logit); on this one they all agree.
    let spec = TinySpec {
        seed: 27,
        embedding_len: 256,
        heads: 4,
        kv_heads: 1,
        ffn_len: 512,
        matrix_type: GgmlType::Q5_K,
        embedding_type: GgmlType::Q4_K,
        ..TinySpec::default()
    };
    compare_with_cpu(&spec, KvType::F16, 8, &[12, 3], 3, false, 1e-4);
}

#[test]
fn the_backend_matches_the_cpu_backend_on_llama_3_qwen_and_phi_3_options() {
    use crate::model::Architecture;
    let cases = [
        // Llama 3's frequency table and linear RoPE scaling.
        (
            "llama 3 rope",
            TinySpec {
                seed: 31,
                rope_freqs: true,
                rope_linear: Some(4.0),
                rope_base: 500_000.0,
                ..TinySpec::default()
            },
        ),
        // RoPE on halves and Q/K/V biases.
        (
            "qwen2",
            TinySpec {
                seed: 32,
                architecture: Architecture::Qwen2,
                ..TinySpec::default()
            },
        ),
        // Per-head Q/K norms, and heads wider than d / heads (q_len > d).
        (
            "qwen3",
            TinySpec {
                seed: 33,
                architecture: Architecture::Qwen3,
                head_dim: Some(32),
                ..TinySpec::default()
            },
        ),
        (
            "phi3",
            TinySpec {
                seed: 34,
                architecture: Architecture::Phi3,
                ..TinySpec::default()
            },
        ),
    ];
    for (name, spec) in cases {
        eprintln!("{name}:");
        assert_eq!(super::runs(&tiny_model(&spec)), Ok(()), "{name}");
        compare_with_cpu(&spec, KvType::F16, 16, &[9, 3], 4, false, 1e-4);
    }
}

#[test]
fn the_backend_matches_the_cpu_backend_on_gemma_options() {
    use crate::model::Architecture;
    let cases = [
        // The embedding scale and the GELU gate.
        (
            "gemma",
            TinySpec {
                seed: 41,
                architecture: Architecture::Gemma,
                ..TinySpec::default()
            },
        ),
        // Post-norms, attention and final soft caps, and a window of 6 on
        // every other layer: prompts of 9 and a decode past them cross it.
        (
            "gemma2",
            TinySpec {
                seed: 42,
                architecture: Architecture::Gemma2,
                sliding_window: Some((6, 2)),
                softcaps: (Some(1.5), Some(3.0)),
                ..TinySpec::default()
            },
        ),
        // Q/K norms, and the local layers' own RoPE base (10,000 against
        // the global layers' 1,000,000, as in Gemma 3's files).
        (
            "gemma3",
            TinySpec {
                seed: 43,
                architecture: Architecture::Gemma3,
                sliding_window: Some((5, 2)),
                rope_base: 1_000_000.0,
                ..TinySpec::default()
            },
        ),
    ];
    for (name, spec) in cases {
        eprintln!("{name}:");
        assert_eq!(super::runs(&tiny_model(&spec)), Ok(()), "{name}");
        compare_with_cpu(&spec, KvType::F16, 4, &[9, 3], 5, false, 1e-4);
    }
}

#[test]
fn gate_and_up_of_different_activation_formats_run_as_two_launches() {
    // Q4_K gate (Q8_K activations) and Q8_0 up (Q8_1): the gate is stored,
    // then gated by up's product; SiLU and GELU. Seeds where no Q8_K
    // activation rounds apart (see the_backend_matches_the_cpu_backend_on_q5_and_bf16_weights:
    // on this shape about half the seeds show one, 3e-3 of the largest
    // logit, with gate and up of one format as much as of two).
    for (seed, architecture) in [
        (45, crate::model::Architecture::Llama),
        (47, crate::model::Architecture::Gemma),
    ] {
        let spec = TinySpec {
            seed,
            architecture,
            embedding_len: 256,
            heads: 4,
            kv_heads: 1,
            ffn_len: 512,
            matrix_type: GgmlType::Q4_K,
            ffn_up_type: Some(GgmlType::Q8_0),
            embedding_type: GgmlType::Q8_0,
            separate_output: true,
            ..TinySpec::default()
        };
        assert_eq!(super::runs(&tiny_model(&spec)), Ok(()));
        compare_with_cpu(&spec, KvType::F16, 8, &[12, 3], 3, false, 1e-4);
    }
}

#[test]
fn the_backend_matches_the_cpu_backend_with_decode_attention_by_warps() {
    // The server's way. Its sums run in another order than the CPU's, so a
    // last-bit difference may flip one Q8 rounding of the next product's
    // activations and move a logit by ~1e-3 (the GPU check's bound, 1e-2);
    // greedy tokens still agree, and the attention itself is within 1e-5
    // of an f64 reference (the test above).
    use crate::model::Architecture;
    let specs = [
        (TinySpec::default(), KvType::F16, vec![5, 9, 2], 1e-2),
        (
            TinySpec {
                seed: 3,
                matrix_type: GgmlType::Q8_0,
                embedding_type: GgmlType::F16,
                separate_output: true,
                ..TinySpec::default()
            },
            KvType::F32,
            vec![9, 2],
            1e-2,
        ),
        // Group 4 of head_dim 64; the first sequence's decode tokens split
        // into three spans of 32 and folded by the last to finish.
        (
            TinySpec {
                seed: 9,
                embedding_len: 256,
                heads: 4,
                kv_heads: 1,
                ffn_len: 512,
                layers: 1,
                ..TinySpec::default()
            },
            KvType::F16,
            vec![70, 4],
            1e-2,
        ),
        // Scores capped at 1.5 and logits at 3: a flipped rounding weighs
        // more against the row's largest (1.03e-2 here; the GPU check's
        // tiny gemma2 parted from an AVX-512 CPU by 8.5e-3 on the H100).
        (
            TinySpec {
                seed: 42,
                architecture: Architecture::Gemma2,
                sliding_window: Some((6, 2)),
                softcaps: (Some(1.5), Some(3.0)),
                ..TinySpec::default()
            },
            KvType::F16,
            vec![12, 3],
            2e-2,
        ),
    ];
    for (i, (spec, kv_type, prompts, tolerance)) in specs.into_iter().enumerate() {
        // Graphs (their captured arguments say "by warps" too) on the first.
        let modes: &[bool] = if i == 0 { &[false, true] } else { &[false] };
        for &graphs in modes {
            let run = super::check::AgreementRun {
                kv_type,
                page_tokens: 16,
                prompts: &prompts,
                decode_steps: 4,
                graphs,
                cpu_threads: 1,
                cpu_isa: Some(Isa::Scalar),
                seed: spec.seed ^ 77,
                tolerance,
                decode_by_warps: true,
                tensor_cores: true,
            };
            compare_run(&spec, &run);
        }
    }
}

/// A decode token's attention on one case of
/// [`a_decode_tokens_attention_by_warps_is_the_tiles_and_the_reference`].
#[derive(Clone, Copy, Debug)]
struct AttnCase {
    head_dim: u32,
    heads: u32,
    kv_heads: u32,
    kv_f16: bool,
    positions: u32,
    window: u32,
    softcap: f32,
}

/// `case`'s attention for one query at the last of its positions, by warps
/// or by tiles: per KV head one item over every position (the normalised
/// output, `[heads][head_dim]`), and three over thirds of them, folded here
/// from their (m, l, o) partials. K and V sit in pages of 16 positions
/// listed in reverse, among pages of other values no table lists.
fn attend(case: AttnCase, by_warps: bool, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let AttnCase {
        head_dim: hd,
        heads,
        kv_heads,
        positions,
        ..
    } = case;
    let device = emulator(seed);
    let mut rng = SplitMix64(seed);
    let (group, kv_dim, page_tokens) = (heads / kv_heads, kv_heads * hd, 16u32);
    let pages_count = positions.div_ceil(page_tokens) + 2;
    let values = (2 * pages_count * page_tokens * kv_dim) as usize;
    let kv: Vec<f32> = (0..values).map(|_| uniform(&mut rng)).collect();
    let kv_bytes: Vec<u8> = if case.kv_f16 {
        kv.iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect()
    } else {
        to_bytes(&kv)
    };
    let q: Vec<f32> = (0..heads * hd).map(|_| 2.0 * uniform(&mut rng)).collect();
    let table: Vec<u32> = (0..positions.div_ceil(page_tokens))
        .map(|i| pages_count - 1 - i)
        .collect();
    let pos0 = positions - 1;
    let cuts = [0, positions / 3, 2 * positions / 3, positions];
    let mut items = Vec::new();
    for kv_head in 0..kv_heads {
        let whole = AttnItem {
            seq: 0,
            kv_head,
            t0: 0,
            t1: 1,
            pos0,
            p0: 0,
            p1: positions,
            partial: NO_SEQ,
            merge: NO_SEQ,
            unused: 0,
        };
        items.push(whole);
        for s in 0..3 {
            items.push(AttnItem {
                p0: cuts[s],
                p1: cuts[s + 1],
                partial: kv_head * 3 + s as u32,
                merge: 0,
                ..whole
            });
        }
    }
    let item_words: Vec<u32> = items.iter().flat_map(|i| i.words()).collect();
    let words = |w: &[u32]| -> Vec<u8> { w.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let q_buf = DeviceBuffer::from_bytes(&device, &to_bytes(&q)).unwrap();
    let kv_buf = DeviceBuffer::from_bytes(&device, &kv_bytes).unwrap();
    let items_buf = DeviceBuffer::from_bytes(&device, &words(&item_words)).unwrap();
    let seq_pages = DeviceBuffer::from_bytes(&device, &words(&[0])).unwrap();
    let pages = DeviceBuffer::from_bytes(&device, &words(&table)).unwrap();
    let out = DeviceBuffer::zeroed(&device, 4 * u64::from(heads * hd)).unwrap();
    let part_floats = (kv_heads * 3 * group * (2 + hd)) as usize;
    let partials = DeviceBuffer::zeroed(&device, 4 * part_floats as u64).unwrap();
    let args = AttentionArgs {
        q: q_buf.at(0),
        kv: kv_buf.at(0),
        items: items_buf.at(0),
        seq_pages: seq_pages.at(0),
        pages: pages.at(0),
        out: out.at(0),
        partials: partials.at(0),
        merges: 0,
        counters: 0,
        heads,
        kv_heads,
        head_dim: hd,
        layer: 0,
        pages_count,
        page_tokens,
        kv_f16: u32::from(case.kv_f16),
        rows_max: group,
        tile: ATTENTION_TILE,
        scale: 1.0 / (hd as f32).sqrt(),
        window: case.window,
        softcap: case.softcap,
        by_warps: u32::from(by_warps),
        unused: 0,
    };
    let shared = attention_shared_bytes(hd, group, ATTENTION_TILE);
    launch(&device, items.len() as u32, ATTENTION_BLOCK, shared, &args);
    let whole = read_floats(&out, (heads * hd) as usize);
    let part = read_floats(&partials, part_floats);
    let mut folded = vec![0.0f32; (heads * hd) as usize];
    for kv_head in 0..kv_heads {
        for g in 0..group {
            let slot = |s: u32| ((kv_head * 3 + s) * group + g) * (2 + hd);
            let best = (0..3)
                .map(|s| part[slot(s) as usize])
                .fold(f32::NEG_INFINITY, f32::max);
            let weight = |s: u32| {
                let m = part[slot(s) as usize];
                if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m - best).exp()
                }
            };
            let l: f32 = (0..3).map(|s| part[slot(s) as usize + 1] * weight(s)).sum();
            for i in 0..hd {
                let o: f32 = (0..3)
                    .map(|s| part[(slot(s) + 2 + i) as usize] * weight(s))
                    .sum();
                folded[((kv_head * group + g) * hd + i) as usize] = o / l;
            }
        }
    }
    // The reference, in f64 from the values as the pages hold them.
    let held = |v: f32| {
        if case.kv_f16 {
            f64::from(half::f16::from_f32(v).to_f32())
        } else {
            f64::from(v)
        }
    };
    let at = |kv: u32, p: u32, i: u32| {
        let page = table[(p / page_tokens) as usize];
        (((kv * pages_count + page) * page_tokens + p % page_tokens) * kv_dim + i) as usize
    };
    let lo = if case.window > 0 && pos0 + 1 > case.window {
        pos0 + 1 - case.window
    } else {
        0
    };
    let mut want = vec![0.0f32; (heads * hd) as usize];
    for head in 0..heads {
        let kv_head = head / group;
        let scores: Vec<f64> = (lo..positions)
            .map(|p| {
                let dot: f64 = (0..hd)
                    .map(|i| {
                        f64::from(q[(head * hd + i) as usize])
                            * held(kv[at(0, p, kv_head * hd + i)])
                    })
                    .sum();
                let score = dot / f64::from(hd).sqrt();
                let cap = f64::from(case.softcap);
                if cap > 0.0 {
                    cap * (score / cap).tanh()
                } else {
                    score
                }
            })
            .collect();
        let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - best).exp()).collect();
        let total: f64 = weights.iter().sum();
        for i in 0..hd {
            let o: f64 = (lo..positions)
                .zip(&weights)
                .map(|(p, w)| w * held(kv[at(1, p, kv_head * hd + i)]))
                .sum();
            want[(head * hd + i) as usize] = (o / total) as f32;
        }
    }
    // NaN counts as the worst (f32::max would pass it over).
    let worst = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |w, d| if d.is_nan() { f32::INFINITY } else { w.max(d) },
            )
    };
    let (whole_err, folded_err) = (worst(&whole), worst(&folded));
    assert!(
        whole_err < 1e-5 && folded_err < 1e-5,
        "{case:?}, by warps {by_warps}: whole {whole_err:e}, folded {folded_err:e}"
    );
    (whole, folded)
}

#[test]
fn a_decode_tokens_attention_by_warps_is_the_tiles_and_the_reference() {
    let case = |head_dim, heads, kv_heads, kv_f16, positions| AttnCase {
        head_dim,
        heads,
        kv_heads,
        kv_f16,
        positions,
        window: 0,
        softcap: 0.0,
    };
    // Cases the warps take: SmolLM2's heads (8 values a lane, 8 lanes a
    // position, group 3) past one split's span; 2 lanes a position; f32
    // pages, 4 values a lane, groups of 4 and 8 (with a window and soft
    // caps); 32 lanes of 8 values, f16 and f32 (two loads a lane); a whole
    // span of 256.
    let by_warps = [
        case(64, 9, 3, true, 300),
        case(16, 4, 2, true, 37),
        case(64, 8, 2, false, 100),
        AttnCase {
            window: 20,
            softcap: 30.0,
            ..case(32, 16, 2, false, 70)
        },
        case(256, 8, 2, true, 60),
        AttnCase {
            softcap: 50.0,
            ..case(256, 4, 2, false, 50)
        },
        case(128, 4, 1, true, 256),
        // A window shorter than the first third: that split reads nothing.
        AttnCase {
            window: 9,
            ..case(64, 6, 2, true, 40)
        },
        // The tiny gemma2's: a window of 6, scores capped at 1.5.
        AttnCase {
            window: 6,
            softcap: 1.5,
            ..case(16, 4, 2, true, 14)
        },
    ];
    // Cases left to the tiles: a group wider than a lane's registers, lanes
    // not a power of two (head_dim 96), scores past the tiles' region.
    let by_tiles = [
        case(64, 12, 2, true, 50),
        case(96, 2, 1, true, 50),
        case(16, 8, 2, true, 400),
    ];
    for (i, case) in by_warps.iter().chain(&by_tiles).enumerate() {
        let warps = attend(*case, true, 40 + i as u64);
        let tiles = attend(*case, false, 40 + i as u64);
        // Each within 1e-5 of the reference (in `attend`); the same bits
        // only where the warps left the case to the tiles: the flag takes
        // the other path where it can, and only there.
        let same = warps
            .0
            .iter()
            .zip(&tiles.0)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert_eq!(same, i >= by_warps.len(), "{case:?}");
    }
}

#[test]
fn a_window_reaching_back_past_a_split_decode_span_is_merged_as_the_cpu_does() {
    // Decode attention split into spans, the older ones wholly outside a
    // local layer's window: their partials see nothing and must weigh nothing.
    let spec = TinySpec {
        seed: 44,
        layers: 2,
        context_len: 1024,
        architecture: crate::model::Architecture::Gemma2,
        sliding_window: Some((40, 2)),
        ..TinySpec::default()
    };
    let prompt = 2 * SPLIT_POSITIONS as usize + 30;
    compare_with_cpu(&spec, KvType::F16, 16, &[prompt, 4], 3, true, 1e-4);
}

#[test]
fn a_local_layer_reads_no_position_before_its_window() {
    // Every layer local (period 0), a window of 20: after a prompt of 100,
    // the next token (position 100) sees 81..=100. Positions 0..=80 are then
    // overwritten with NaN through the page book, and that token's logits
    // must be what they were without, on the CPU and the device alike: an
    // attention that read those positions and only masked them would sum
    // 0 × NaN (and on a device, spend a global layer's bandwidth).
    let (prompt, window) = (100usize, 20usize);
    let spec = TinySpec {
        seed: 52,
        context_len: 256,
        architecture: crate::model::Architecture::Gemma2,
        sliding_window: Some((window as u32, 0)),
        ..TinySpec::default()
    };
    let model = tiny_model(&spec);
    assert!(model
        .config
        .sliding_window
        .as_ref()
        .unwrap()
        .local
        .iter()
        .all(|l| *l));
    let device = emulator(spec.seed);
    let page_tokens = 16u32;
    let per_seq = (prompt as u32 + 1).div_ceil(page_tokens);
    let kv_dim = model.config.kv_heads_count * model.config.head_dim;
    let prompt_tokens: Vec<u32> = (0..prompt as u32).map(|t| t * 7 % 50 + 3).collect();
    let next = [11u32];
    let run = |on_device: bool, poisoned: bool| -> Vec<f32> {
        let (mut pool, tables) = pool_with_tables(
            &model,
            KvType::F16,
            page_tokens,
            1,
            per_seq,
            on_device.then_some(&device),
        );
        let mut backend: Box<dyn Backend> = if on_device {
            Box::new(backend(&model, &device, prompt, 1, false))
        } else {
            Box::new(crate::backend::cpu::CpuBackend::new(
                Arc::clone(&model),
                crate::backend::cpu::CpuOptions {
                    threads_count: 1,
                    step_tokens_max: prompt,
                    step_seqs_max: 1,
                    isa: Some(Isa::Scalar),
                },
            ))
        };
        let table = &tables[0];
        let step = |tokens, pos_start| SeqStep::new(table, pos_start, tokens);
        backend.step(&[step(&prompt_tokens, 0)], &mut pool).unwrap();
        if poisoned {
            let nan = vec![f32::NAN; kv_dim];
            for p in 0..=(prompt - window) as u32 {
                let lease = tables[0].lease((p / page_tokens) as usize).unwrap();
                for layer in 0..model.config.layers_count as u32 {
                    pool.write_kv(lease, layer, p % page_tokens, &nan, &nan)
                        .unwrap();
                }
            }
        }
        let logits = backend.step(&[step(&next[..], prompt)], &mut pool).unwrap();
        logits.values.to_vec()
    };
    for on_device in [false, true] {
        let clean = run(on_device, false);
        let poisoned = run(on_device, true);
        assert!(clean.iter().all(|x| x.is_finite()));
        assert_eq!(
            poisoned, clean,
            "a position before the window was read (device: {on_device})"
        );
    }
}

/// The tiny model (4 heads over 2 KV heads, group 2) at a context of
/// 1,024, on the emulator, with a pool of two sequences of 40 pages of 16.
fn two_sequences_of_40_pages() -> (Arc<Model>, Arc<dyn Device>, Pool, Vec<PageTable>) {
    let spec = TinySpec {
        context_len: 1024,
        ..TinySpec::default()
    };
    let model = tiny_model(&spec);
    let device = emulator(1);
    let (pool, tables) = pool_with_tables(&model, KvType::F16, 16, 2, 40, Some(&device));
    (model, device, pool, tables)
}

#[test]
fn a_step_packs_only_the_pages_it_reaches_with_items_merges_and_logit_rows() {
    let (model, device, mut pool, tables) = two_sequences_of_40_pages();
    let mut cuda = backend(&model, &device, 64, 4, true);
    let layout = *pool.layout();
    cuda.ensure_step_buffer(&layout).unwrap();
    // Sequence 0: a prefill chunk of 40 tokens at positions 0..40 (3 pages
    // of its 40); sequence 1: one decode token at position 600 (page 37 of
    // 40), past two splits.
    let prefill: Vec<u32> = (0..40).collect();
    let decode = [7u32];
    let steps = [
        SeqStep {
            logits: 0,
            ..SeqStep::new(&tables[0], 0, &prefill)
        },
        SeqStep::new(&tables[1], 600, &decode),
    ];
    let view = pool.step_view(&[&tables[0], &tables[1]]).unwrap();
    let rows = cuda.attention_rows;
    let counts = cuda.pack(&steps, &view, None);
    let l = cuda.step.as_ref().unwrap().layout;
    let w = &cuda.staging;
    let word = |at: u64| w[at as usize];
    // Tokens, positions, sequences.
    assert_eq!(counts.tokens, 41);
    assert_eq!(word(l.tokens + 40), 7);
    assert_eq!((word(l.positions + 39), word(l.positions + 40)), (39, 600));
    assert_eq!((word(l.token_seq), word(l.token_seq + 40)), (0, 1));
    // Pages: sequence 0's first 3, then sequence 1's first 38 (through
    // position 600), each the page id the view checked.
    assert_eq!((word(l.seq_pages), word(l.seq_pages + 1)), (0, 3));
    for (i, page) in view.page_ids(0)[..3].iter().enumerate() {
        assert_eq!(word(l.pages + i as u64), page.0);
    }
    for (i, page) in view.page_ids(1)[..38].iter().enumerate() {
        assert_eq!(word(l.pages + 3 + i as u64), page.0);
    }
    assert_eq!(
        word(l.pages + 41),
        0,
        "nothing past the pages the step reaches"
    );
    // One logit row: the decode token's (token 40).
    assert_eq!((counts.wanted, word(l.gather)), (1, 40));
    // Prefill items: per KV head, blocks of rows / group queries, final outputs;
    // decode: per KV head its splits into partial slots, and one merge each.
    // A step of two sequences and two KV heads splits its 601 positions
    // 64 ways at most, in whole tiles: 19 splits of 32.
    let per_item = rows / model.config.kv_group() as u32;
    let prefill_items = 2 * 40u32.div_ceil(per_item);
    let span = decode_span(601, 2, 2);
    assert_eq!((span, 601u32.div_ceil(span)), (32, 19));
    assert_eq!(counts.items, prefill_items + 2 * 19);
    assert_eq!(
        counts.item_queries_max, per_item,
        "shared memory for a prefill item"
    );
    let words = ITEM_WORDS as u64;
    let item = |n: u32| -> Vec<u32> {
        (0..words)
            .map(|i| word(l.items + words * u64::from(n) + i))
            .collect()
    };
    let prefill = [0, 0, 0, per_item, 0, 0, per_item, NO_SEQ, NO_SEQ, 0];
    assert_eq!(item(0), prefill);
    let first_decode = item(prefill_items);
    assert_eq!(first_decode, [1, 0, 40, 41, 600, 0, 32, 0, 0, 0]);
    assert_eq!(item(prefill_items + 18)[5..9], [18 * 32, 601, 18, 0]);
    assert_eq!(
        item(prefill_items + 19)[..2],
        [1, 1],
        "then the second KV head's"
    );
    assert_eq!(item(prefill_items + 19)[7..9], [19, 1], "into merge 1");
    assert_eq!(counts.merges, 2);
    // Counters for attention to count each merge's finished splits: zero.
    assert_eq!((word(l.counters), word(l.counters + 1)), (0, 0));
    let merge: Vec<u32> = (0..4).map(|i| word(l.merges + i)).collect();
    assert_eq!(merge, vec![40, 0, 0, 19]);
    copied_ranges_hold_the_step(&cuda, &counts);
    drop(view);
    // As a graph bucket of 2 (decode only): padded to the bucket's capacity.
    let one = [3u32, 4];
    let steps = [SeqStep::new(&tables[0], 40, &one[..1])];
    let view = pool.step_view(&[&tables[0]]).unwrap();
    let bucket = cuda.graph_bucket(&steps).unwrap();
    assert_eq!(bucket, 1);
    let counts = cuda.pack(&steps, &view, Some(2));
    let w = &cuda.staging;
    assert_eq!(
        w[(l.token_seq + 1) as usize],
        NO_SEQ,
        "the padding token stores nothing"
    );
    assert_eq!(counts.tokens, 2);
    assert_eq!(counts.items, 2 * 2 * decode_splits_max(2, 2, 1024));
    assert_eq!(
        counts.item_queries_max, 1,
        "a decode step's blocks, a query each"
    );
    // The step's own items: two KV heads of 41 positions in splits of 32.
    let real = 2 * 41u32.div_ceil(decode_span(41, 2, 2));
    assert_eq!(real, 4);
    let padding_item = (l.items + words * u64::from(real)) as usize;
    let previous = padding_item - ITEM_WORDS;
    assert_ne!(
        w[previous + 2],
        w[previous + 3],
        "the last real item has its query"
    );
    assert_eq!(
        w[padding_item + 2],
        w[padding_item + 3],
        "padding items have no queries"
    );
    // What this step reads is copied, and the prefill's items, pages and
    // rows were zeroed again (`pack` asserts it in debug builds).
    copied_ranges_hold_the_step(&cuda, &counts);
}

#[test]
fn past_a_step_the_devices_step_buffer_holds_that_step_alone() {
    // A large step (a prefill chunk over 3 pages, a decode token over 38
    // in 2 x 19 splits), then steps far smaller: the device's step buffer
    // after each is the host's staging bit for bit, which is zero but for
    // the step's own words. No page id, token or item of an earlier step
    // (another tenant's, in a server) stays on the device past it.
    let (model, device, mut pool, tables) = two_sequences_of_40_pages();
    for graphs in [false, true] {
        let mut cuda = backend(&model, &device, 64, 4, graphs);
        let prefill: Vec<u32> = (0..40).collect();
        let one = [7u32];
        let large = [
            SeqStep::new(&tables[0], 0, &prefill),
            SeqStep {
                pick: Pick::Argmax,
                ..SeqStep::new(&tables[1], 600, &one)
            },
        ];
        let small = |pos| {
            [SeqStep {
                pick: Pick::Argmax,
                ..SeqStep::new(&tables[0], pos, &one)
            }]
        };
        let mut nonzero_words = Vec::new();
        for (i, steps) in [&large[..], &small(40), &small(41), &large[..], &small(42)]
            .into_iter()
            .enumerate()
        {
            cuda.step(steps, &mut pool).unwrap();
            let step = cuda.step.as_ref().unwrap();
            let mut bytes = vec![0u8; 4 * step.layout.words as usize];
            step.buffer.read(0, &mut bytes).unwrap();
            let on_device: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let differ = on_device
                .iter()
                .zip(&cuda.staging)
                .position(|(d, h)| d != h);
            assert_eq!(differ, None, "graphs {graphs}, step {i}");
            nonzero_words.push(on_device.iter().filter(|&&w| w != 0).count());
        }
        // The large steps leave many more words than the small ones.
        assert!(nonzero_words[0] > 4 * nonzero_words[1], "{nonzero_words:?}");
        assert_eq!(nonzero_words[0], nonzero_words[3]);
        assert_eq!(nonzero_words[1], nonzero_words[4]);
    }
}

/// The step buffer's copied ranges ([`Packer::used`]) after a pack: in
/// order and apart, every word the packer wrote within them (the rest of
/// the staging zero), and every region's part a launch of `counts` reads.
fn copied_ranges_hold_the_step(cuda: &CudaBackend, counts: &super::pack::Counts) {
    let (staged, words) = (&cuda.staged, &cuda.staging);
    assert!(
        staged.windows(2).all(|p| p[0].end < p[1].start),
        "{staged:?}"
    );
    let copied = |at: u64| staged.iter().any(|r| r.contains(&(at as usize)));
    for (i, &w) in words.iter().enumerate() {
        assert!(w == 0 || copied(i as u64), "word {i} packed but not copied");
    }
    let l = cuda.step.as_ref().unwrap().layout;
    let last = |start: u64, len: u64| start + len - 1;
    let tokens = u64::from(counts.tokens);
    for at in [
        last(l.tokens, tokens),
        last(l.positions, tokens),
        last(l.token_seq, tokens),
        last(l.gather, u64::from(counts.wanted)),
        last(l.draws, DRAW_WORDS as u64 * u64::from(counts.wanted)),
        last(l.items, ITEM_WORDS as u64 * u64::from(counts.items)),
        last(l.merges, 4 * u64::from(counts.merges)),
        last(l.counters, u64::from(counts.merges)),
    ] {
        assert!(copied(at), "word {at} read but not copied");
    }
}

#[test]
fn a_profile_times_every_launch_of_its_steps_and_none_of_a_captured_graph() {
    let model = tiny_model(&TinySpec::default());
    let device = emulator(3);
    // Nothing is timed before a profile starts.
    assert!(device.profile_take().is_empty());
    let run = super::check::DecodeRun::new(2, 40, 3, false, 32);
    let profile = super::check::decode_profile(&model, &device, &run);
    // Every kernel of a decode step, each launch counted once a step; its
    // products make their own activations (2 tokens), with no norm launch,
    // the Q/K/V product turns Q and K and stores K and V, with no rope_kv
    // launch, and attention folds its splits (two a token at depth 40),
    // with no merge launch.
    let names: Vec<&str> = profile.kernels.iter().map(|k| k.kernel).collect();
    for kernel in ["embed", "matmul", "attention", "pick"] {
        assert!(names.contains(&kernel), "{kernel} missing from {names:?}");
    }
    assert!(!names.contains(&"rms_norm"), "{names:?}");
    assert!(!names.contains(&"rope_kv"), "{names:?}");
    assert!(!names.contains(&"attention_merge"), "{names:?}");
    let layers = model.config.layers_count as f64;
    let launches_of = |profile: &super::check::StepProfile, kernel: &str| {
        let found = profile.kernels.iter().find(|k| k.kernel == kernel);
        found.map(|k| (k.launches, k.grid))
    };
    let without = |fusions: Fusions| {
        let run = super::check::DecodeRun { fusions, ..run };
        super::check::decode_profile(&model, &device, &run)
    };
    // Norms on their own: before each of a layer's four products and the head.
    let separate = without(Fusions {
        norms: false,
        ..Fusions::default()
    });
    let norms = launches_of(&separate, "rms_norm");
    assert_eq!(
        norms.map(|(launches, _)| launches),
        Some(4.0 * layers + 1.0)
    );
    assert_eq!(separate.launches(), profile.launches() + 4.0 * layers + 1.0);
    // RoPE and the KV store on their own: a launch a layer, a block a token.
    let separate = without(Fusions {
        rope: false,
        ..Fusions::default()
    });
    assert_eq!(launches_of(&separate, "rope_kv"), Some((layers, 2)));
    assert_eq!(separate.launches(), profile.launches() + layers);
    // The merge of split attention on its own: a launch a layer, a block a
    // token's KV head.
    let separate = without(Fusions {
        merge: false,
        ..Fusions::default()
    });
    assert_eq!(launches_of(&separate, "attention_merge"), Some((layers, 4)));
    assert_eq!(separate.launches(), profile.launches() + layers);
    let none = without(Fusions::NONE);
    assert_eq!(none.launches(), profile.launches() + 6.0 * layers + 1.0);
    // An output head past FUSED_ROWS_MAX rows (a real vocabulary) takes its
    // activations from a norm launch, a block a token; the layers' products
    // still make their own.
    let wide = tiny_model(&TinySpec {
        filler_tokens: 16_400,
        ..TinySpec::default()
    });
    let head = super::check::decode_profile(&wide, &device, &run);
    assert!(wide.config.vocab_len > 16_384);
    assert_eq!(launches_of(&head, "rms_norm"), Some((1.0, 2)));
    assert_eq!(head.launches(), profile.launches() + 1.0);
    // Every step launches alike: a whole number of launches a step.
    let launches = profile.launches();
    assert!((launches - launches.round()).abs() < 1e-9, "{launches}");
    // The costliest first, each timed.
    assert!(profile.kernels.windows(2).all(|w| w[0].secs >= w[1].secs));
    assert!(profile.kernels.iter().all(|k| k.secs > 0.0));
    assert!(profile.step_secs > 0.0);
    // Taking stopped it; a graph's capture and replay are not timed.
    assert!(device.profile_take().is_empty());
    device.profile_start();
    let out = DeviceBuffer::zeroed(&device, 4).unwrap();
    let graph = device
        .capture(&mut || {
            let args = NormArgs {
                x: out.at(0),
                gather: 0,
                gain: 0,
                out: out.at(0),
                qs: 0,
                d: 0,
                sums: 0,
                width: 1,
                block_len: 32,
                eps: 0.0,
                accumulate: 0,
            };
            // SAFETY: one float in, the same float out, within `out`.
            unsafe {
                device.launch(
                    NormArgs::KERNEL,
                    Geometry {
                        grid: 1,
                        block: 32,
                        shared_bytes: 0,
                    },
                    args.bytes(),
                )
            }
        })
        .unwrap();
    graph.replay().unwrap();
    assert!(device.profile_take().is_empty());
}

#[test]
fn a_head_width_the_attention_loads_cannot_take_is_refused_before_the_device() {
    // 8 heads of 12: whole 32-blocks of q (96), yet a head's K row is not
    // whole 16-byte loads.
    let spec = TinySpec {
        heads: 8,
        kv_heads: 2,
        head_dim: Some(12),
        ..TinySpec::default()
    };
    let model = tiny_model(&spec);
    let refused = super::runs(&model).unwrap_err();
    assert!(refused.contains("head width (12)"), "{refused}");
    let options = CudaOptions {
        step_tokens_max: 8,
        step_seqs_max: 1,
        graphs: false,
        tensor_cores: true,
        dependent_launches: true,
    };
    let made = CudaBackend::new(model, emulator(1), options);
    assert!(
        matches!(&made, Err(super::CudaError::Unsupported(why)) if why.contains("head width")),
        "{:?}",
        made.err()
    );
    assert!(super::runs(&tiny_model(&TinySpec::default())).is_ok());
}

#[test]
fn the_cpus_own_drift_is_measured_on_the_agreements_prompt_rows() {
    let model = tiny_model(&TinySpec::default());
    let run = super::check::AgreementRun {
        kv_type: KvType::F16,
        page_tokens: 16,
        prompts: &[5, 40, 1],
        decode_steps: 0,
        graphs: false,
        cpu_threads: 1,
        cpu_isa: None,
        seed: 7,
        tolerance: 1e-3,
        decode_by_warps: true,
        tensor_cores: true,
    };
    let drift = super::check::cpu_drift(&model, &run);
    // A two-layer model: the scalar and fastest paths part by at most a few
    // Q8 roundings (the GPU check's bound for tiny models is 1e-2).
    assert!(drift.is_finite() && (0.0..1e-2).contains(&drift), "{drift}");
    // The agreement compares those rows (each prompt's last positions, up
    // to 1 + 64 / 3 of each), then one a decode step.
    let agreement = super::check::agreement(&model, &emulator(2), &run);
    assert_eq!(agreement.rows + agreement.scored_rows, 5 + 22 + 1);
}
