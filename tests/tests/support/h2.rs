//! Just enough HTTP/2 (RFC 9113) by hand to play a hostile client: frames
//! written and read on a plain TCP stream, header blocks as HPACK literals
//! without indexing or Huffman coding (RFC 7541 §6.2.2), so a test controls
//! every byte — a zero flow-control window that never opens, a stream
//! abandoned right after its request.

use std::io::{Read, Write};
use std::net::TcpStream;

/// The client connection preface.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
/// The CANCEL error code (of RST_STREAM).
pub const CANCEL: u32 = 0x8;
/// SETTINGS_INITIAL_WINDOW_SIZE.
pub const INITIAL_WINDOW_SIZE: u16 = 0x4;

/// One frame: its type, flags, stream and payload.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The preface and a SETTINGS frame with `settings` (identifier, value).
pub fn open(settings: &[(u16, u32)]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (id, value) in settings {
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(&value.to_be_bytes());
    }
    [PREFACE.to_vec(), frame(SETTINGS, 0, 0, &payload)].concat()
}

fn hpack_length(out: &mut Vec<u8>, len: usize) {
    // A 7-bit prefixed integer, no Huffman (RFC 7541 §5.1).
    if len < 127 {
        out.push(len as u8);
        return;
    }
    out.push(127);
    let mut rest = len - 127;
    while rest >= 128 {
        out.push((rest % 128 + 128) as u8);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A HEADERS frame holding `headers` (pseudo-headers first) on `stream`.
pub fn headers(stream: u32, headers: &[(&str, &str)], end_stream: bool) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in headers {
        block.push(0x00);
        hpack_length(&mut block, name.len());
        block.extend_from_slice(name.as_bytes());
        hpack_length(&mut block, value.len());
        block.extend_from_slice(value.as_bytes());
    }
    let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
    frame(HEADERS, flags, stream, &block)
}

/// A POST of `body` (JSON) to `path` with a bearer `key` and `extra`
/// headers, on `stream`: its
/// HEADERS and DATA frames of at most 16 KiB (the default
/// SETTINGS_MAX_FRAME_SIZE), the last ending the stream. `body` must fit the
/// server's initial stream window (64 KiB).
pub fn post(stream: u32, path: &str, key: &str, extra: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let authorization = format!("Bearer {key}");
    let length = body.len().to_string();
    let mut fields = vec![
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "bulkhead"),
        ("authorization", authorization.as_str()),
        ("content-type", "application/json"),
        ("content-length", length.as_str()),
    ];
    fields.extend_from_slice(extra);
    [headers(stream, &fields, false), data(stream, body)].concat()
}

/// `body` as DATA frames of at most 16 KiB on `stream`, the last ending it.
pub fn data(stream: u32, body: &[u8]) -> Vec<u8> {
    let chunks: Vec<&[u8]> = body.chunks(16 << 10).collect();
    let last = chunks.len().saturating_sub(1);
    if chunks.is_empty() {
        return frame(DATA, END_STREAM, stream, &[]);
    }
    chunks
        .iter()
        .enumerate()
        .flat_map(|(i, chunk)| frame(DATA, if i == last { END_STREAM } else { 0 }, stream, chunk))
        .collect()
}

/// The next frame from `stream`: (type, flags, stream id, payload); None at
/// the end of the connection (or a read error, a timeout included).
pub fn read_frame(stream: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).ok()?;
    let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
    let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).ok()?;
    Some((head[3], head[4], id, payload))
}

/// Acknowledges the server's SETTINGS (a client must, or the server may close).
pub fn ack_settings(stream: &mut TcpStream) -> std::io::Result<()> {
    stream.write_all(&frame(SETTINGS, ACK, 0, &[]))
}
