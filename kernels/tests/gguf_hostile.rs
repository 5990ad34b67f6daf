//! The GGUF reader against well-formed, truncated, corrupt and hostile files.
//! Every bad file must give a typed error naming the problem, never a panic and
//! never an allocation sized by an unchecked header field.

use bulkhead_kernels::gguf::{Gguf, GgufError, GgufWriter, Value};
use bulkhead_kernels::quant::GgmlType;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn small_file() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("answer", Value::U32(42))
        .metadata("pi", Value::F32(3.25))
        .metadata("flag", Value::Bool(true))
        .metadata("big", Value::I64(-7))
        .metadata(
            "names",
            Value::Array(vec![Value::String("a".into()), Value::String("βγ".into())]),
        )
        .metadata(
            "nested",
            Value::Array(vec![Value::Array(vec![Value::U8(1), Value::U8(2)])]),
        )
        .tensor("a", &[4], GgmlType::F32, f32_bytes(&[1.0, 2.0, 3.0, 4.0]))
        .tensor("b", &[32, 2], GgmlType::Q8_0, vec![7u8; 68]);
    w
}

fn header_len(bytes: &[u8]) -> usize {
    // Data start is after the last tensor info, aligned to 32; find it by parsing.
    let gguf = Gguf::from_bytes(bytes.to_vec()).expect("well-formed");
    let total: u64 = gguf
        .tensors()
        .iter()
        .map(|t| t.bytes_len.next_multiple_of(32))
        .sum();
    bytes.len() - total as usize
}

#[test]
fn reads_every_value_type_and_tensor_bytes() {
    let bytes = small_file().to_bytes();
    let gguf = Gguf::from_bytes(bytes).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.str("general.architecture").unwrap(), "llama");
    assert_eq!(gguf.u64("answer").unwrap(), 42);
    assert_eq!(gguf.f64("pi").unwrap(), 3.25);
    assert_eq!(gguf.get("flag"), Some(&Value::Bool(true)));
    assert_eq!(gguf.get("big"), Some(&Value::I64(-7)));
    assert!(
        gguf.u64("big").is_err(),
        "a negative value is not an unsigned integer"
    );
    assert_eq!(gguf.array("names").unwrap()[1], Value::String("βγ".into()));
    let a = gguf.tensor("a").unwrap();
    assert_eq!(gguf.tensor_bytes(a), &f32_bytes(&[1.0, 2.0, 3.0, 4.0])[..]);
    let b = gguf.tensor("b").unwrap();
    assert_eq!(b.ty, GgmlType::Q8_0);
    assert_eq!(b.bytes_len, 68);
    assert!(matches!(
        gguf.str("missing"),
        Err(GgufError::Metadata { .. })
    ));
}

#[test]
fn reads_version_2() {
    let mut bytes = small_file().to_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(Gguf::from_bytes(bytes).unwrap().version, 2);
}

#[test]
fn rejects_bad_magic_and_versions() {
    let mut bytes = small_file().to_bytes();
    bytes[0] = b'X';
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::BadMagic(_))
    ));
    for version in [0u32, 1, 4, 0x0300_0000] {
        let mut bytes = small_file().to_bytes();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        assert!(
            matches!(Gguf::from_bytes(bytes), Err(GgufError::UnsupportedVersion(v)) if v == version)
        );
    }
}

#[test]
fn every_truncation_is_a_typed_error() {
    let bytes = small_file().to_bytes();
    for len in 0..bytes.len() {
        let result = Gguf::from_bytes(bytes[..len].to_vec());
        assert!(
            result.is_err(),
            "a file cut at {len} of {} bytes was accepted",
            bytes.len()
        );
    }
}

#[test]
fn every_single_byte_corruption_is_refused_or_parsed_without_panic() {
    let bytes = small_file().to_bytes();
    let header = header_len(&bytes);
    for at in 0..header {
        for value in [0x00, 0xff, 0x7f, 0x80] {
            let mut bad = bytes.clone();
            bad[at] = value;
            let _ = Gguf::from_bytes(bad);
        }
    }
}

fn patch_u64_after(bytes: &mut [u8], needle: &[u8], skip: usize, value: u64) {
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("needle")
        + needle.len()
        + skip;
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn rejects_absurd_counts_before_allocating() {
    let mut bytes = small_file().to_bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::Absurd {
            what: "tensor count",
            ..
        })
    ));
    let mut bytes = small_file().to_bytes();
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::Absurd { .. })
    ));
    let mut bytes = small_file().to_bytes();
    bytes[16..24].copy_from_slice(&60_000u64.to_le_bytes());
    assert!(
        matches!(Gguf::from_bytes(bytes), Err(GgufError::Absurd { .. })),
        "more entries than bytes"
    );
    // An array claiming 2^60 strings.
    let mut bytes = small_file().to_bytes();
    patch_u64_after(&mut bytes, b"names", 4 + 4, 1 << 60);
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::Absurd {
            what: "metadata array length",
            ..
        })
    ));
    // A string claiming 2^62 bytes.
    let mut bytes = small_file().to_bytes();
    patch_u64_after(&mut bytes, b"general.architecture", 4, 1 << 62);
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::Absurd { .. })
    ));
}

#[test]
fn rejects_unknown_types_and_bad_utf8() {
    let mut w = GgufWriter::new();
    w.tensor("q5", &[32], GgmlType::Q8_0, vec![0; 34]);
    let mut bytes = w.to_bytes();
    // The tensor type follows name, n_dims and one dim.
    let at = bytes.windows(2).position(|w| w == b"q5").unwrap() + 2 + 4 + 8;
    bytes[at..at + 4].copy_from_slice(&16u32.to_le_bytes()); // IQ2_XXS: not supported
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::UnknownTensorType { type_id: 16, .. })
    ));

    let mut bytes = small_file().to_bytes();
    let at = bytes.windows(6).position(|w| w == b"answer").unwrap() + 6;
    bytes[at..at + 4].copy_from_slice(&13u32.to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::UnknownValueType { value_type: 13, .. })
    ));

    let mut bytes = small_file().to_bytes();
    let at = bytes.windows(5).position(|w| w == b"llama").unwrap();
    bytes[at] = 0xff;
    assert!(matches!(
        Gguf::from_bytes(bytes),
        Err(GgufError::BadUtf8 { .. })
    ));
}

#[test]
fn rejects_duplicate_names() {
    let mut w = GgufWriter::new();
    w.metadata("k", Value::U8(1)).metadata("k", Value::U8(2));
    assert!(matches!(
        Gguf::from_bytes(w.to_bytes()),
        Err(GgufError::DuplicateKey(_))
    ));
    let mut w = GgufWriter::new();
    w.tensor("t", &[1], GgmlType::F32, vec![0; 4])
        .tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(matches!(
        Gguf::from_bytes(w.to_bytes()),
        Err(GgufError::DuplicateTensor(_))
    ));
}

#[test]
fn rejects_bad_shapes() {
    let cases: [(&[u64], GgmlType); 4] = [
        (&[0], GgmlType::F32),
        (&[16], GgmlType::Q4_1),                       // not whole blocks
        (&[1 << 32, 1 << 32, 1 << 32], GgmlType::F32), // overflows
        (&[1, 1, 1, 1, 1], GgmlType::F32),             // too many dims
    ];
    for (dims, ty) in cases {
        let mut w = GgufWriter::new();
        w.tensor("t", dims, ty, vec![0; 32]);
        let result = Gguf::from_bytes(w.to_bytes());
        assert!(
            matches!(result, Err(GgufError::BadShape { .. })),
            "{dims:?} {ty:?}: {result:?}"
        );
    }
}

#[test]
fn rejects_tensors_past_the_end_misaligned_or_overlapping() {
    // Declares 4 floats but the file holds none.
    let mut w = GgufWriter::new();
    w.tensor("a", &[4], GgmlType::F32, Vec::new());
    assert!(matches!(
        Gguf::from_bytes(w.to_bytes()),
        Err(GgufError::TensorOutOfBounds { .. })
    ));

    let bytes = small_file().to_bytes();
    // Tensor "b"'s offset: after name, n_dims, two dims and type.
    let at = bytes
        .windows(1 + 8)
        .position(|w| w == b"\x01\x00\x00\x00\x00\x00\x00\x00b")
        .unwrap()
        + 9
        + 4
        + 16
        + 4;
    let mut misaligned = bytes.clone();
    misaligned[at..at + 8].copy_from_slice(&8u64.to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(misaligned),
        Err(GgufError::TensorOutOfBounds { .. })
    ));
    let mut overlapping = bytes.clone();
    overlapping[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(overlapping),
        Err(GgufError::Overlap { .. })
    ));
    let mut huge = bytes;
    huge[at..at + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(matches!(
        Gguf::from_bytes(huge),
        Err(GgufError::TensorOutOfBounds { .. })
    ));
}

#[test]
fn rejects_bad_alignment_and_deep_arrays() {
    for alignment in [0u32, 3, 1 << 20] {
        let mut w = small_file();
        w.metadata("general.alignment", Value::U32(alignment));
        assert!(matches!(
            Gguf::from_bytes(w.to_bytes()),
            Err(GgufError::BadAlignment(_))
        ));
    }
    let mut w = GgufWriter::new();
    let deep = Value::Array(vec![Value::Array(vec![Value::Array(vec![Value::U8(1)])])]);
    w.metadata("deep", deep);
    assert!(matches!(
        Gguf::from_bytes(w.to_bytes()),
        Err(GgufError::Absurd { .. })
    ));
}

#[test]
fn honours_a_larger_alignment() {
    let mut w = small_file();
    w.metadata("general.alignment", Value::U32(64));
    let gguf = Gguf::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(gguf.tensor("b").unwrap().offset % 64, 0);
    assert_eq!(
        gguf.tensor_bytes(gguf.tensor("a").unwrap()),
        &f32_bytes(&[1.0, 2.0, 3.0, 4.0])[..]
    );
}
