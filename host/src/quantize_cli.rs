//! `bulkhead quantize --to q8_0 IN OUT`: derives a model file of another weight
//! type from one the engine reads (`bulkhead_kernels::gguf::requantize_q8_0`).
//!
//! Lifecycle, so that OUT is only ever absent, its old content, or complete:
//!
//! 1. Refuse an OUT that is IN, or whose temporary name `OUT.partial` is IN
//!    (by path and, when both exist, by device and inode), before opening
//!    anything: writing there would truncate the mapped input.
//! 2. Map and validate IN; the reader refuses hostile files with typed errors.
//! 3. Write `OUT.partial`, sync it, and re-open it with the reader as a check.
//! 4. Rename it to OUT (atomic on one file system) and sync the folder.
//!
//! Any error on the way removes `OUT.partial`; a crash may leave it behind, and
//! the next run overwrites it.

use anyhow::{bail, Context, Result};
use bulkhead_kernels::gguf::{self, Gguf, RequantizeReport};
use bulkhead_kernels::quant::GgmlType;
use clap::{Args, ValueEnum};
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Suffix of the file written before the rename.
const PARTIAL_SUFFIX: &str = ".partial";
/// Write buffer: large enough that each tensor goes out in few system calls.
const WRITE_BUFFER_BYTES: usize = 1 << 20;
/// Bytes per MiB, for the report.
const MIB: f64 = (1u64 << 20) as f64;

/// `bulkhead quantize` arguments.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Weight type to convert the matrices to.
    #[arg(long, value_enum)]
    pub to: QuantizeTarget,
    /// The GGUF model file to read.
    pub input: PathBuf,
    /// The GGUF file to write (replaced atomically; never the input).
    pub output: PathBuf,
}

/// A weight type `bulkhead quantize` can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantizeTarget {
    /// llama.cpp's Q8_0: blocks of 32 signed bytes and an f16 scale.
    #[value(name = "q8_0")]
    Q8_0,
}

/// Runs `bulkhead quantize`; prints what it did to stderr.
pub fn run(args: &QuantizeArgs) -> Result<()> {
    let QuantizeTarget::Q8_0 = args.to;
    let (input, output) = (&args.input, &args.output);
    let partial = partial_path(output);
    if is_same_file(input, output)? || is_same_file(input, &partial)? {
        bail!(
            "refusing to write {} over the input {}: choose another output path",
            output.display(),
            input.display()
        );
    }
    let started = Instant::now();
    let gguf = Gguf::open(input).with_context(|| format!("reading {}", input.display()))?;
    let mut guard = PartialFile {
        path: partial.clone(),
        committed: false,
    };
    let report = write_q8_0(&gguf, &partial)?;
    let written = Gguf::open(&partial)
        .with_context(|| format!("re-reading the written file {}", partial.display()))?;
    if written.tensors().len() != gguf.tensors().len() {
        bail!("the written file has a different tensor count than the input (a writer bug)");
    }
    drop(written);
    std::fs::rename(&partial, output)
        .with_context(|| format!("renaming {} to {}", partial.display(), output.display()))?;
    guard.committed = true;
    sync_parent(output);
    print_report(args, &report, started);
    Ok(())
}

/// Writes `gguf` as Q8_0 to `path` and syncs it to disk.
fn write_q8_0(gguf: &Gguf, path: &Path) -> Result<RequantizeReport> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
    let report = gguf::requantize_q8_0(gguf, &mut writer)
        .with_context(|| format!("writing {}", path.display()))?;
    let file = writer
        .into_inner()
        .map_err(|error| error.into_error())
        .with_context(|| format!("writing {}", path.display()))?;
    file.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    Ok(report)
}

/// `OUT.partial`, next to OUT so that the rename stays on one file system.
fn partial_path(output: &Path) -> PathBuf {
    let mut name = OsString::from(output.as_os_str());
    name.push(PARTIAL_SUFFIX);
    PathBuf::from(name)
}

/// Whether `a` (which should exist) and `b` (which may not) name the same file:
/// equal after resolving links and `..`, or, when both exist, the same inode.
fn is_same_file(a: &Path, b: &Path) -> Result<bool> {
    let Ok(a_meta) = std::fs::metadata(a) else {
        // A missing input is reported by the reader, with its path.
        return Ok(false);
    };
    if let Ok(b_meta) = std::fs::metadata(b) {
        return Ok(same_inode(&a_meta, &b_meta));
    }
    let a = std::fs::canonicalize(a).with_context(|| format!("resolving {}", a.display()))?;
    Ok(resolve_missing(b).is_some_and(|b| a == b))
}

#[cfg(unix)]
fn same_inode(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

#[cfg(not(unix))]
fn same_inode(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    false
}

/// The canonical path a file that does not exist yet would have: its folder
/// resolved, its name appended. `None` when the folder cannot be resolved (the
/// create that follows reports that).
fn resolve_missing(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(parent).ok()?.join(name))
}

/// Makes the rename durable. Best effort: the file itself is already synced,
/// and some file systems refuse to open or sync a folder.
fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Ok(folder) = File::open(parent) {
            let _ = folder.sync_all();
        }
    }
}

/// Removes the temporary file on every early return.
struct PartialFile {
    path: PathBuf,
    committed: bool,
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// "N (TYPE: n, ...)", or "0" when nothing was counted.
fn counts(counts: &[(GgmlType, u32)]) -> String {
    let total: u32 = counts.iter().map(|(_, n)| n).sum();
    if counts.is_empty() {
        return total.to_string();
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|(ty, n)| format!("{}: {n}", ty.name()))
        .collect();
    format!("{total} ({})", parts.join(", "))
}

fn print_report(args: &QuantizeArgs, report: &RequantizeReport, started: Instant) {
    let file_bytes = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len());
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "quantize: tensors converted to Q8_0: {}; kept as they were: {}",
        counts(&report.converted),
        counts(&report.kept),
    );
    let _ = writeln!(
        err,
        "quantize: tensor data {:.1} MiB -> {:.1} MiB; wrote {} ({:.1} MiB) in {:.2} s",
        report.tensor_bytes_in as f64 / MIB,
        report.tensor_bytes_out as f64 / MIB,
        args.output.display(),
        file_bytes(&args.output) as f64 / MIB,
        started.elapsed().as_secs_f64(),
    );
}
