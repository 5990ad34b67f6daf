//! Paged KV pool (work in progress).
