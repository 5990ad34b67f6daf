//! GGUF reader (work in progress).
