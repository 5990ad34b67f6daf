//! GGUF writers: the project generates its own tiny models for tests, writes
//! hostile files to prove the reader refuses them, and re-quantizes real models
//! ([`super::requantize`]).
//!
//! Two front ends share one encoder, so both lay files out identically:
//!
//! 1. [`GgufWriter`] collects metadata and encoded tensors in memory and returns
//!    the file as bytes (small files: tests, fixtures).
//! 2. [`GgufStreamWriter`] writes the header from declared tensor sizes first and
//!    then takes each tensor's bytes in order, so a large file never has to be
//!    held in memory whole.
//!
//! ```text
//! header | metadata | tensor table | pad to alignment | tensor 0 | pad | tensor 1 | ...
//! ```
//!
//! Offsets are decided by the declared byte lengths alone; the stream writer
//! asserts that each tensor it is handed has exactly its declared length.

use std::io::{self, Write};

use super::{Value, ALIGNMENT_DEFAULT};
use crate::quant::GgmlType;

/// The GGUF version every file is written as.
const VERSION: u32 = 3;

/// Builds a GGUF (version 3) file in memory.
///
/// # Panics
/// [`GgufWriter::to_bytes`] panics on an array whose items are not all of
/// one type (the format cannot hold one).
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor; `dims` innermost first, `bytes` already encoded as `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, bytes: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, bytes));
        self
    }

    /// The encoded file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let entries: Vec<TensorEntry> = self
            .tensors
            .iter()
            .map(|(name, dims, ty, bytes)| TensorEntry {
                name: name.clone(),
                dims: dims.clone(),
                ty: *ty,
                bytes_len: bytes.len() as u64,
            })
            .collect();
        // Writing into a Vec<u8> cannot fail, so none of these `expect`s can fire.
        let mut stream = GgufStreamWriter::new(Vec::new(), &self.metadata, &entries)
            .expect("writing to a Vec cannot fail");
        for (_, _, _, bytes) in &self.tensors {
            stream.tensor(bytes).expect("writing to a Vec cannot fail");
        }
        stream.finish().expect("writing to a Vec cannot fail")
    }
}

/// A tensor's header as the stream writer declares it before its bytes exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Dimensions, innermost first.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Length of the bytes [`GgufStreamWriter::tensor`] will be given for it.
    pub bytes_len: u64,
}

/// Writes a GGUF (version 3) file to `W` one tensor at a time.
///
/// Lifecycle:
/// 1. [`GgufStreamWriter::new`] writes the header, metadata and tensor table.
/// 2. [`GgufStreamWriter::tensor`] is called once per declared tensor, in order.
/// 3. [`GgufStreamWriter::finish`] checks every tensor was written and returns `W`.
///
/// Handing it bytes of the wrong length, too many tensors or too few, or an
/// array of mixed item types, is a programmer error and panics; only I/O
/// errors are returned.
pub struct GgufStreamWriter<W: Write> {
    out: W,
    /// `[tensor]`: start of each tensor, relative to the data section.
    offsets: Vec<u64>,
    /// `[tensor]`: declared byte length of each tensor.
    bytes_lens: Vec<u64>,
    /// Index of the next tensor to write.
    tensor_next: usize,
    /// Bytes of the data section written so far, padding included.
    data_written: u64,
}

impl<W: Write> GgufStreamWriter<W> {
    /// Writes everything before the data section to `out`.
    pub fn new(
        mut out: W,
        metadata: &[(String, Value)],
        tensors: &[TensorEntry],
    ) -> io::Result<GgufStreamWriter<W>> {
        let align = alignment(metadata);
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value_type(value).to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(tensors.len());
        for tensor in tensors {
            put_string(&mut header, &tensor.name);
            header.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
            for dim in &tensor.dims {
                header.extend_from_slice(&dim.to_le_bytes());
            }
            header.extend_from_slice(&(tensor.ty as u32).to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + tensor.bytes_len).next_multiple_of(align);
        }
        let data_start = (header.len() as u64).next_multiple_of(align);
        header.resize(data_start as usize, 0);
        out.write_all(&header)?;
        Ok(GgufStreamWriter {
            out,
            offsets,
            bytes_lens: tensors.iter().map(|t| t.bytes_len).collect(),
            tensor_next: 0,
            data_written: 0,
        })
    }

    /// Writes the next declared tensor's bytes, after the padding that aligns it.
    ///
    /// # Panics
    /// If every declared tensor was already written, or `bytes` is not the
    /// declared length.
    pub fn tensor(&mut self, bytes: &[u8]) -> io::Result<()> {
        let index = self.tensor_next;
        assert!(
            index < self.offsets.len(),
            "more tensors written than declared"
        );
        assert_eq!(
            bytes.len() as u64,
            self.bytes_lens[index],
            "tensor {index} is not its declared length"
        );
        self.pad_to(self.offsets[index])?;
        self.out.write_all(bytes)?;
        self.data_written += bytes.len() as u64;
        self.tensor_next += 1;
        Ok(())
    }

    /// Flushes and returns the sink.
    ///
    /// # Panics
    /// If a declared tensor was not written.
    pub fn finish(mut self) -> io::Result<W> {
        assert_eq!(
            self.tensor_next,
            self.offsets.len(),
            "fewer tensors written than declared"
        );
        self.out.flush()?;
        Ok(self.out)
    }

    fn pad_to(&mut self, offset: u64) -> io::Result<()> {
        debug_assert!(offset >= self.data_written, "offsets only grow");
        const ZEROS: [u8; 64] = [0; 64];
        while self.data_written < offset {
            let len = (offset - self.data_written).min(ZEROS.len() as u64);
            self.out.write_all(&ZEROS[..len as usize])?;
            self.data_written += len;
        }
        Ok(())
    }
}

/// The alignment a file with `metadata` is laid out with: `general.alignment`
/// when it is a power of two, else the default. (Hostile test files may carry a
/// bad value on purpose; the layout then stays the default one.)
fn alignment(metadata: &[(String, Value)]) -> u64 {
    metadata
        .iter()
        .find(|(key, _)| key == "general.alignment")
        .and_then(|(_, value)| value.as_u64())
        .filter(|a| a.is_power_of_two())
        .unwrap_or(ALIGNMENT_DEFAULT)
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(value: &Value) -> u32 {
    match value {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            // An empty array is written as an array of u8.
            let item_type = items.first().map_or(0, value_type);
            // The format has one item type per array: a mixed one would be
            // written as bytes no reader can parse.
            assert!(
                items.iter().all(|item| value_type(item) == item_type),
                "a GGUF array holds items of one type"
            );
            out.extend_from_slice(&item_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}
