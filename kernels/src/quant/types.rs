//! The ggml tensor types this engine understands, with their block geometry.

// ggml spells the K-quants with an underscore; GGUF tooling and logs use those names.
#![allow(non_camel_case_types)]

/// A ggml tensor type, numbered as in GGUF files.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    /// 32-bit float.
    F32 = 0,
    /// IEEE half float.
    F16 = 1,
    /// 32 weights: f16 scale `d`, 16 bytes of 4-bit quants; w = d * (q - 8).
    Q4_0 = 2,
    /// 32 weights: f16 scale `d`, f16 min `m`, 16 bytes of 4-bit quants; w = d * q + m.
    Q4_1 = 3,
    /// 32 weights: f16 scale `d`, 32 high bits, 16 bytes of low nibbles; w = d * (q - 16).
    Q5_0 = 6,
    /// 32 weights: f16 `d`, f16 min `m`, 32 high bits, 16 bytes of low nibbles; w = d * q + m.
    Q5_1 = 7,
    /// 32 weights: f16 scale `d`, 32 signed bytes; w = d * q.
    Q8_0 = 8,
    /// 256 weights in 8 sub-blocks of 32, 6-bit sub-scales and mins (144 bytes).
    Q4_K = 12,
    /// 256 weights in 8 sub-blocks of 32, Q4_K's scales plus one high bit per weight (176 bytes).
    Q5_K = 13,
    /// 256 weights in 16 sub-blocks of 16, 8-bit sub-scales, 6-bit quants (210 bytes).
    Q6_K = 14,
    /// bfloat16: the top half of an f32.
    BF16 = 30,
}

impl GgmlType {
    /// Every type this engine runs, in GGUF number order.
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ];

    /// Maps a GGUF type number to a supported type; `None` for any other number.
    pub fn from_u32(value: u32) -> Option<GgmlType> {
        Some(match value {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// Number of weights in one block.
    pub const fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes in one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    /// Bytes for `count` weights, or `None` when `count` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, count: u64) -> Option<u64> {
        let block_len = self.block_len() as u64;
        if !count.is_multiple_of(block_len) {
            return None;
        }
        (count / block_len).checked_mul(self.block_bytes() as u64)
    }

    /// The name GGUF tools print.
    pub const fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::BF16 => "BF16",
        }
    }
}
