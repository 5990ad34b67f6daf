//! The bounds-checked parser behind [`super::Gguf`].
//!
//! Two budgets bound what a file can make this parser allocate, and both are
//! checked before the allocation they pay for:
//!
//! 1. **Bytes of file.** A count or length must fit in the bytes that remain
//!    (an array of `n` u32 needs `4 n` more bytes), so nothing is sized by a
//!    field the file cannot back.
//! 2. **Bytes of memory.** What the header decodes to is charged to a budget
//!    of [`DECODED_BYTES_PER_FILE_BYTE_MAX`] bytes per byte of file (at least
//!    [`DECODED_BYTES_MIN`]). The first budget alone is not enough: every
//!    array item is a 32-byte [`Value`], so a file that is one long array of
//!    u8 decoded to 32 times its size (a 10 MB file raised RSS by 320 MB).
//!    The charges ([`heap_bytes`], [`hash_slot_bytes`]) are what the
//!    allocator hands out, not what is asked for, so the budget bounds RSS.

use super::{
    GgufError, TensorInfo, Value, ALIGNMENT_DEFAULT, ALIGNMENT_MAX, ARRAY_DEPTH_MAX,
    DECODED_BYTES_MIN, DECODED_BYTES_PER_FILE_BYTE_MAX, KV_COUNT_MAX, NAME_BYTES_MAX,
    STRING_BYTES_MAX, TENSORS_COUNT_MAX, TENSOR_DIMS_MAX,
};
use crate::quant::GgmlType;
use std::collections::HashSet;
use std::mem::size_of;

const MAGIC: [u8; 4] = *b"GGUF";

/// What [`parse`] found.
pub struct Parsed {
    /// Format version.
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor headers in file order.
    pub tensors: Vec<TensorInfo>,
    /// Offset of the data section in the file.
    pub data_start: u64,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    offset: usize,
    /// Bytes of memory the rest of the header may still decode to (budget 2
    /// of the module doc).
    decoded_bytes_left: u64,
}

/// What the allocator really takes for a heap block of `len` bytes: glibc
/// rounds a request plus its 8-byte header up to 16 bytes, and hands out 32
/// at least. Charging this rather than `len` makes a file of many one-byte
/// strings pay for the memory it really costs.
fn heap_bytes(len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    len.saturating_add(8).next_multiple_of(16).max(32)
}

/// Memory per entry of a hash table whose slots are `slot` bytes: the slot
/// and its control byte, times the worst load (a power-of-two table at most
/// 7/8 full holds up to 16/7 slots per entry, and growing it briefly holds
/// the old table too): 3 is a round upper bound.
const fn hash_slot_bytes(slot: usize) -> u64 {
    3 * (slot as u64 + 1)
}

/// Memory of one metadata entry besides its key's and value's heap blocks:
/// its `(String, Value)`, its slot in the duplicate check while parsing, and
/// its slot in [`super::Gguf`]'s index.
const ENTRY_BYTES: u64 = size_of::<(String, Value)>() as u64
    + hash_slot_bytes(size_of::<&str>())
    + hash_slot_bytes(size_of::<(String, usize)>());

/// Memory of one tensor header besides its name's and dimensions' heap
/// blocks: the [`TensorInfo`], its slots in the duplicate check and the
/// index, and its place in the overlap check's sorted order.
const TENSOR_BYTES: u64 = size_of::<TensorInfo>() as u64
    + hash_slot_bytes(size_of::<&str>())
    + hash_slot_bytes(size_of::<(String, usize)>())
    + size_of::<&TensorInfo>() as u64;

impl<'a> Cursor<'a> {
    /// Charges `bytes` of memory to the budget before they are allocated.
    fn charge(&mut self, bytes: u64) -> Result<(), GgufError> {
        let budget = decoded_bytes_max(self.bytes.len());
        if bytes > self.decoded_bytes_left {
            return Err(GgufError::Absurd {
                what: "decoded header bytes",
                value: (budget - self.decoded_bytes_left).saturating_add(bytes),
                limit: budget,
            });
        }
        self.decoded_bytes_left -= bytes;
        Ok(())
    }

    fn take(&mut self, needed: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let remaining = (self.bytes.len() - self.offset) as u64;
        if needed > remaining {
            return Err(GgufError::Truncated {
                what,
                offset: self.offset as u64,
                needed,
                len: self.bytes.len() as u64,
            });
        }
        let start = self.offset;
        // `needed <= remaining`, so this fits in usize.
        self.offset += needed as usize;
        Ok(&self.bytes[start..self.offset])
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.offset) as u64
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let slice = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A string borrowed from the file (nothing allocated, nothing charged).
    fn str(&mut self, what: &'static str, bytes_max: u64) -> Result<&'a str, GgufError> {
        let len = self.u64(what)?;
        if len > bytes_max {
            return Err(GgufError::Absurd {
                what,
                value: len,
                limit: bytes_max,
            });
        }
        let offset = self.offset as u64;
        let raw = self.take(len, what)?;
        std::str::from_utf8(raw).map_err(|_| GgufError::BadUtf8 { what, offset })
    }

    /// A string of its own, charged `copies` heap blocks: a name is kept
    /// twice (in its entry and in the index), a value once.
    fn string(
        &mut self,
        what: &'static str,
        bytes_max: u64,
        copies: u64,
    ) -> Result<String, GgufError> {
        let text = self.str(what, bytes_max)?;
        self.charge(copies * heap_bytes(text.len() as u64))?;
        Ok(text.to_owned())
    }
}

/// The memory budget of a file of `file_len` bytes (budget 2 of the module doc).
pub fn decoded_bytes_max(file_len: usize) -> u64 {
    (file_len as u64)
        .saturating_mul(DECODED_BYTES_PER_FILE_BYTE_MAX)
        .max(DECODED_BYTES_MIN)
}

/// Parses and validates the header, metadata and tensor table of `bytes`.
pub fn parse(bytes: &[u8]) -> Result<Parsed, GgufError> {
    let mut cursor = Cursor {
        bytes,
        offset: 0,
        decoded_bytes_left: decoded_bytes_max(bytes.len()),
    };
    let magic = cursor.array::<4>("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = cursor.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensors_count = bounded(
        cursor.u64("tensor count")?,
        "tensor count",
        TENSORS_COUNT_MAX,
    )?;
    let kv_count = bounded(
        cursor.u64("metadata count")?,
        "metadata count",
        KV_COUNT_MAX,
    )?;

    let metadata = parse_metadata(&mut cursor, kv_count)?;
    let alignment = alignment(&metadata)?;
    let mut tensors = parse_tensor_infos(&mut cursor, tensors_count)?;

    let data_start = (cursor.offset as u64).next_multiple_of(alignment);
    let data_len = (bytes.len() as u64).saturating_sub(data_start);
    check_tensor_ranges(&mut tensors, alignment, data_len)?;
    Ok(Parsed {
        version,
        metadata,
        tensors,
        data_start,
    })
}

fn bounded(value: u64, what: &'static str, limit: u64) -> Result<u64, GgufError> {
    if value > limit {
        return Err(GgufError::Absurd { what, value, limit });
    }
    Ok(value)
}

fn parse_metadata(cursor: &mut Cursor, kv_count: u64) -> Result<Vec<(String, Value)>, GgufError> {
    // Each entry takes at least a key length, a type and one byte of value.
    let entry_bytes_min = 8 + 4 + 1;
    bounded(
        kv_count,
        "metadata count",
        cursor.remaining() / entry_bytes_min,
    )?;
    // `kv_count` is at most KV_COUNT_MAX, so the product cannot overflow.
    cursor.charge(kv_count * ENTRY_BYTES)?;
    let mut metadata = Vec::with_capacity(kv_count as usize);
    let mut seen = HashSet::new();
    for _ in 0..kv_count {
        let key = cursor.str("metadata key", NAME_BYTES_MAX)?;
        if !seen.insert(key) {
            return Err(GgufError::DuplicateKey(key.to_owned()));
        }
        cursor.charge(2 * heap_bytes(key.len() as u64))?;
        let value_type = cursor.u32("metadata value type")?;
        let value = parse_value(cursor, key, value_type, 0)?;
        metadata.push((key.to_owned(), value));
    }
    Ok(metadata)
}

/// Smallest encoding of one value of `value_type`, or `None` for an unknown type.
fn value_bytes_min(value_type: u32) -> Option<u64> {
    Some(match value_type {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

fn parse_value(
    cursor: &mut Cursor,
    key: &str,
    value_type: u32,
    depth: u32,
) -> Result<Value, GgufError> {
    let what = "metadata value";
    Ok(match value_type {
        0 => Value::U8(u8::from_le_bytes(cursor.array(what)?)),
        1 => Value::I8(i8::from_le_bytes(cursor.array(what)?)),
        2 => Value::U16(u16::from_le_bytes(cursor.array(what)?)),
        3 => Value::I16(i16::from_le_bytes(cursor.array(what)?)),
        4 => Value::U32(u32::from_le_bytes(cursor.array(what)?)),
        5 => Value::I32(i32::from_le_bytes(cursor.array(what)?)),
        6 => Value::F32(f32::from_le_bytes(cursor.array(what)?)),
        7 => match cursor.array::<1>(what)?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            other => {
                return Err(super::metadata_error(
                    key,
                    format!("bool byte {other} is neither 0 nor 1"),
                ))
            }
        },
        8 => Value::String(cursor.string("metadata string", STRING_BYTES_MAX, 1)?),
        9 => parse_array(cursor, key, depth)?,
        10 => Value::U64(u64::from_le_bytes(cursor.array(what)?)),
        11 => Value::I64(i64::from_le_bytes(cursor.array(what)?)),
        12 => Value::F64(f64::from_le_bytes(cursor.array(what)?)),
        _ => {
            return Err(GgufError::UnknownValueType {
                key: key.to_string(),
                value_type,
            })
        }
    })
}

fn parse_array(cursor: &mut Cursor, key: &str, depth: u32) -> Result<Value, GgufError> {
    if depth >= ARRAY_DEPTH_MAX {
        return Err(GgufError::Absurd {
            what: "metadata array nesting",
            value: u64::from(depth) + 1,
            limit: u64::from(ARRAY_DEPTH_MAX),
        });
    }
    let item_type = cursor.u32("array item type")?;
    let count = cursor.u64("array length")?;
    let Some(item_bytes_min) = value_bytes_min(item_type) else {
        return Err(GgufError::UnknownValueType {
            key: key.to_string(),
            value_type: item_type,
        });
    };
    // Refuse before allocating: the items must fit in what is left of the file.
    bounded(
        count,
        "metadata array length",
        cursor.remaining() / item_bytes_min,
    )?;
    // Each item of any type is a whole `Value` in memory, 32 bytes however
    // few it takes in the file: charged before the vector is allocated.
    // `count` is at most the file's length, so the product cannot overflow.
    cursor.charge(heap_bytes(count * size_of::<Value>() as u64))?;
    let mut items = Vec::with_capacity(count as usize);
    for _ in 0..count {
        items.push(parse_value(cursor, key, item_type, depth + 1)?);
    }
    Ok(Value::Array(items))
}

fn alignment(metadata: &[(String, Value)]) -> Result<u64, GgufError> {
    let Some((_, value)) = metadata.iter().find(|(key, _)| key == "general.alignment") else {
        return Ok(ALIGNMENT_DEFAULT);
    };
    let Some(alignment) = value.as_u64() else {
        return Err(super::metadata_error("general.alignment", "not an integer"));
    };
    if alignment == 0 || !alignment.is_power_of_two() || alignment > ALIGNMENT_MAX {
        return Err(GgufError::BadAlignment(alignment));
    }
    Ok(alignment)
}

fn parse_tensor_infos(cursor: &mut Cursor, count: u64) -> Result<Vec<TensorInfo>, GgufError> {
    // name length + n_dims + one dim + type + offset.
    let info_bytes_min = 8 + 4 + 8 + 4 + 8;
    bounded(count, "tensor count", cursor.remaining() / info_bytes_min)?;
    // `count` is at most TENSORS_COUNT_MAX, so the product cannot overflow.
    cursor.charge(count * TENSOR_BYTES)?;
    let mut tensors = Vec::with_capacity(count as usize);
    let mut seen = HashSet::new();
    for _ in 0..count {
        let name = cursor.str("tensor name", NAME_BYTES_MAX)?;
        if !seen.insert(name) {
            return Err(GgufError::DuplicateTensor(name.to_owned()));
        }
        cursor.charge(2 * heap_bytes(name.len() as u64))?;
        let name = name.to_owned();
        let dims_count = cursor.u32("tensor dimension count")?;
        if dims_count == 0 || dims_count > TENSOR_DIMS_MAX {
            return Err(GgufError::BadShape {
                name,
                dims: Vec::new(),
                reason: "dimension count must be 1..=4",
            });
        }
        cursor.charge(heap_bytes(u64::from(dims_count) * 8))?;
        let mut dims = Vec::with_capacity(dims_count as usize);
        for _ in 0..dims_count {
            dims.push(cursor.u64("tensor dimension")?);
        }
        let type_id = cursor.u32("tensor type")?;
        let offset = cursor.u64("tensor offset")?;
        let Some(ty) = GgmlType::from_u32(type_id) else {
            return Err(GgufError::UnknownTensorType { name, type_id });
        };
        let bytes_len = tensor_bytes_len(&name, &dims, ty)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            bytes_len,
        });
    }
    Ok(tensors)
}

fn tensor_bytes_len(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    let bad = |reason| GgufError::BadShape {
        name: name.to_string(),
        dims: dims.to_vec(),
        reason,
    };
    if dims.contains(&0) {
        return Err(bad("a dimension is zero"));
    }
    if !dims[0].is_multiple_of(ty.block_len() as u64) {
        return Err(bad("row length is not a whole number of blocks"));
    }
    let count = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("element count overflows"))?;
    ty.bytes_for(count)
        .ok_or_else(|| bad("byte size overflows"))
}

fn check_tensor_ranges(
    tensors: &mut [TensorInfo],
    alignment: u64,
    data_len: u64,
) -> Result<(), GgufError> {
    for tensor in tensors.iter() {
        let end = tensor.offset.checked_add(tensor.bytes_len);
        let in_bounds = matches!(end, Some(end) if end <= data_len);
        if !in_bounds || tensor.offset % alignment != 0 {
            return Err(GgufError::TensorOutOfBounds {
                name: tensor.name.clone(),
                start: tensor.offset,
                end: end.unwrap_or(u64::MAX),
                len: data_len,
            });
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        if pair[0].offset + pair[0].bytes_len > pair[1].offset {
            return Err(GgufError::Overlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}
