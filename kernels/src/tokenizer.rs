//! Tokenizers from GGUF metadata (work in progress).
