//! GGUF reader over a memory map.
//!
//! A GGUF file is a header, a metadata table, a tensor table and an aligned data
//! section:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count   × { key: string, type: u32, value }
//! tensor_count × { name: string, n_dims: u32, dims: u64[n_dims], type: u32, offset: u64 }
//! padding to `general.alignment` (default 32)
//! data: each tensor at data_start + offset
//! ```
//!
//! Invariants this reader keeps, so that no later stage has to:
//!
//! 1. Every length and count is checked against the bytes that remain *before*
//!    anything is allocated from it, and everything the header decodes to is
//!    charged to a memory budget proportional to the file's size
//!    ([`DECODED_BYTES_PER_FILE_BYTE_MAX`], [`decoded_bytes_max`]); an absurd
//!    header gives [`GgufError`], never an allocation sized by an unchecked
//!    field or larger than the file can pay for, and never a panic.
//! 2. Every tensor has a supported type, at most [`TENSOR_DIMS_MAX`] non-zero
//!    dimensions whose product does not overflow, a whole number of blocks, an
//!    aligned offset, and bytes that lie inside the file.
//! 3. No two tensors overlap, and no two tensors or keys share a name.
//!
//! The reader does not interpret the metadata; [`crate::model`] checks that the
//! shapes agree with the architecture. [`GgufWriter`] and [`GgufStreamWriter`]
//! write files; [`requantize_q8_0`] derives a Q8_0 file from any readable one.

mod reader;
mod requantize;
mod writer;

use std::collections::HashMap;
use std::path::Path;

pub use reader::decoded_bytes_max;
pub use requantize::{
    requantize_q8_0, RequantizeError, RequantizeReport, FILE_TYPE_KEY, FILE_TYPE_MOSTLY_Q8_0,
    Q8_0_ABS_MAX, ROW_LEN_MAX,
};
pub use writer::{GgufStreamWriter, GgufWriter, TensorEntry};

use crate::quant::GgmlType;

/// Most tensors a file may declare.
pub const TENSORS_COUNT_MAX: u64 = 1 << 16;
/// Most metadata entries a file may declare.
pub const KV_COUNT_MAX: u64 = 1 << 16;
/// Longest string (key, value or tensor name) accepted, in bytes.
pub const STRING_BYTES_MAX: u64 = 16 << 20;
/// Longest tensor name or metadata key, in bytes.
pub const NAME_BYTES_MAX: u64 = 1 << 16;
/// Most dimensions of a tensor.
pub const TENSOR_DIMS_MAX: u32 = 4;
/// Deepest nesting of metadata arrays.
pub const ARRAY_DEPTH_MAX: u32 = 2;
/// Largest alignment a file may ask for.
pub const ALIGNMENT_MAX: u64 = 1 << 16;
/// Alignment when `general.alignment` is absent.
pub const ALIGNMENT_DEFAULT: u64 = 32;
/// Most bytes of memory the header (metadata, tensor table and their indexes)
/// may decode to per byte of file. The densest legitimate arrays, per-token
/// i32 types and f32 scores, take 32 bytes of memory (one [`Value`]) per 4
/// bytes of file: 8 accepts any file of them, and refuses a file that is one
/// long array of 1- or 2-byte items, which would otherwise decode to up to
/// 32 times its size.
pub const DECODED_BYTES_PER_FILE_BYTE_MAX: u64 = 8;
/// The memory budget of the smallest files, so that a hand-made test file of a
/// few hundred bytes is never refused for its fixed per-entry costs.
pub const DECODED_BYTES_MIN: u64 = 64 << 10;

/// Why a file was refused. Each variant names the problem and where it was found.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The cause (in the message, so not also a `source`: a chain of
        /// causes would print it twice).
        cause: std::io::Error,
    },
    /// The first four bytes are not "GGUF".
    #[error("not a GGUF file: bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this reader does not speak.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// A read ran past the end of the file.
    #[error("truncated file: {what} needs {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Where.
        offset: u64,
        /// How many bytes it needed.
        needed: u64,
        /// File length.
        len: u64,
    },
    /// A count or length is larger than any valid file could hold.
    #[error("absurd {what}: {value} (limit {limit})")]
    Absurd {
        /// Which field.
        what: &'static str,
        /// The value read.
        value: u64,
        /// The limit it broke.
        limit: u64,
    },
    /// A string is not UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    BadUtf8 {
        /// Which string.
        what: &'static str,
        /// Where.
        offset: u64,
    },
    /// A metadata value type this reader does not know.
    #[error("metadata key {key:?}: unknown value type {value_type}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type number.
        value_type: u32,
    },
    /// The same key twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    /// The same tensor name twice.
    #[error("duplicate tensor {0:?}")]
    DuplicateTensor(String),
    /// A tensor type this engine does not implement.
    #[error("tensor {name:?}: unsupported tensor type {type_id}")]
    UnknownTensorType {
        /// The tensor.
        name: String,
        /// The type number.
        type_id: u32,
    },
    /// Dimensions that are zero, too many, overflowing or not whole blocks.
    #[error("tensor {name:?}: bad shape {dims:?}: {reason}")]
    BadShape {
        /// The tensor.
        name: String,
        /// The dimensions read.
        dims: Vec<u64>,
        /// What is wrong.
        reason: &'static str,
    },
    /// `general.alignment` that is zero, not a power of two or too large.
    #[error("bad alignment {0}")]
    BadAlignment(u64),
    /// A tensor whose offset is not aligned or whose bytes leave the file.
    #[error(
        "tensor {name:?}: bytes {start}..{end} outside data section of {len} bytes or misaligned"
    )]
    TensorOutOfBounds {
        /// The tensor.
        name: String,
        /// Start, relative to the data section.
        start: u64,
        /// End, relative to the data section.
        end: u64,
        /// Length of the data section.
        len: u64,
    },
    /// Two tensors share bytes.
    #[error("tensors {first:?} and {second:?} overlap")]
    Overlap {
        /// One tensor.
        first: String,
        /// The other.
        second: String,
    },
    /// A metadata key the caller needs is absent or has the wrong type.
    #[error("metadata key {key:?}: {reason}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: every element has the same type.
    Array(Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float when it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// One tensor's header.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Its name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (ggml order): `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Start of its bytes, relative to the data section.
    pub offset: u64,
    /// Length of its bytes.
    pub bytes_len: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elements_count(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// A parsed, validated GGUF file.
pub struct Gguf {
    backing: Backing,
    /// Format version (2 or 3).
    pub version: u32,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata_count", &self.metadata.len())
            .field("tensors_count", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps and validates a file.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |cause| GgufError::Io {
            path: path.display().to_string(),
            cause,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process. A file changed
        // underneath us by another process could change bytes we have validated;
        // model files are immutable by deployment convention (they are verified by
        // digest when installed), and every later read is bounds-checked against the
        // slice length, so the worst case is wrong numbers, not memory unsafety
        // beyond what any concurrent truncation (SIGBUS) would cause.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Gguf::from_backing(Backing::Mapped(map))
    }

    /// Validates a file held in memory (tests and tools).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Gguf::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(backing: Backing) -> Result<Gguf, GgufError> {
        let bytes: &[u8] = match &backing {
            Backing::Mapped(map) => map,
            Backing::Owned(vec) => vec,
        };
        let parsed = reader::parse(bytes)?;
        let metadata_index = parsed
            .metadata
            .iter()
            .enumerate()
            .map(|(index, (key, _))| (key.clone(), index))
            .collect();
        let tensor_index = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(index, tensor)| (tensor.name.clone(), index))
            .collect();
        Ok(Gguf {
            backing,
            version: parsed.version,
            metadata: parsed.metadata,
            metadata_index,
            tensors: parsed.tensors,
            tensor_index,
            data_start: parsed.data_start,
        })
    }

    fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mapped(map) => map,
            Backing::Owned(vec) => vec,
        }
    }

    /// XXH64 of the whole file: its architecture, metadata, tokenizer and
    /// every tensor's bytes (what two processes compare before they exchange
    /// KV: ~10 ms per 100 MB).
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = crate::kv::Xxh64::new();
        hasher.write(self.bytes());
        hasher.finish()
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// All tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A tensor's header.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Where the data section starts in the file: every tensor's bytes are at
    /// `data_start() + offset`, within the file (validated at parse time).
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// A tensor's bytes. The range was validated at parse time.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_start + info.offset) as usize;
        &self.bytes()[start..start + info.bytes_len as usize]
    }

    /// Drops this process's resident pages of a tensor's bytes, for a tensor
    /// the engine keeps in another layout (the repacked Q4_K matrices): a
    /// hint that returns the memory; a later read faults the same bytes in
    /// again from the file. A no-op for a file held in memory.
    pub fn release(&self, info: &TensorInfo) {
        #[cfg(unix)]
        if let Backing::Mapped(map) = &self.backing {
            let start = (self.data_start + info.offset) as usize;
            // SAFETY: the map is private and read-only, so MADV_DONTNEED
            // discards no writes: the next access reads the file's bytes, the
            // same ones. memmap2 widens the range to whole pages; a neighbour's
            // bytes on those pages fault back in the same way. Only a hint:
            // its failure changes nothing.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    info.bytes_len as usize,
                )
            };
        }
    }

    /// A required unsigned integer.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        self.require(key)?
            .as_u64()
            .ok_or_else(|| metadata_error(key, "not a non-negative integer"))
    }

    /// A required number.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        self.require(key)?
            .as_f64()
            .ok_or_else(|| metadata_error(key, "not a number"))
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            _ => Err(metadata_error(key, "not a string")),
        }
    }

    /// A required array.
    pub fn array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.require(key)? {
            Value::Array(items) => Ok(items),
            _ => Err(metadata_error(key, "not an array")),
        }
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| metadata_error(key, "missing"))
    }
}

/// A metadata error for `key`.
pub fn metadata_error(key: &str, reason: impl Into<String>) -> GgufError {
    GgufError::Metadata {
        key: key.to_string(),
        reason: reason.into(),
    }
}
