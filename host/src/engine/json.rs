//! JSON mode (`response_format: {"type": "json_object"}`): a byte-level
//! recognizer of JSON text whose top-level value is an object, fed the bytes
//! of each generated token, so the sampler can refuse a token that would make
//! the output anything but a prefix of such a text, and end it once the object
//! is closed.
//!
//! It is a pushdown automaton over RFC 8259's grammar: a stack of open
//! containers and the position within the current token of JSON (string,
//! escape, number, literal). Strings must be well-formed UTF-8 and hold no
//! control characters. Whitespace between tokens is limited to
//! [`WHITESPACE_RUN_MAX`] bytes in a row and nesting to [`DEPTH_MAX`]
//! containers, so a model cannot stall in blank space or deepen forever.
//!
//! [`Json::accepts`] tries a token's bytes without changing the recognizer and
//! without allocating (pushes past the stack's top go to a small overlay), as
//! the sampler asks it of many candidate tokens per step.

/// Most whitespace bytes in a row between JSON tokens.
pub const WHITESPACE_RUN_MAX: u32 = 64;
/// Most containers open at once.
pub const DEPTH_MAX: usize = 64;

/// A container on the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

/// Where the next byte falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the top-level object (whitespace, then `{`).
    Start,
    /// A value must come (after `:`, `,` in an array, or `[`); `close`: `]` may too.
    Value { close: bool },
    /// A key must come (after `,` in an object, or `{`); `close`: `}` may too.
    Key { close: bool },
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the container's close.
    AfterValue,
    /// In a string; `key`: an object's key (a `:` follows it).
    Str {
        key: bool,
        escape: Escape,
        utf8: Utf8,
    },
    /// In a number.
    Number(Num),
    /// In `true`, `false` or `null`: the literal and how far.
    Literal { word: &'static [u8], at: u8 },
    /// The top-level object is closed: whitespace only.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Escape {
    None,
    /// After `\`.
    Backslash,
    /// After `\u` and this many hex digits.
    Unicode(u8),
}

/// UTF-8 inside a string: continuation bytes still due, and the range the
/// next one must fall in (for the second byte of E0, ED, F0 and F4 leads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Utf8 {
    due: u8,
    low: u8,
    high: u8,
}

const UTF8_NONE: Utf8 = Utf8 {
    due: 0,
    low: 0x80,
    high: 0xBF,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    /// After `-`.
    Minus,
    /// A lone `0` (no more integer digits).
    Zero,
    /// Integer digits.
    Int,
    /// After `.`.
    Point,
    /// Fraction digits.
    Frac,
    /// After `e` or `E`.
    Exp,
    /// After the exponent's sign.
    ExpSign,
    /// Exponent digits.
    ExpDigits,
}

impl Num {
    /// Whether a number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }
}

/// The recognizer's state at one point of the output.
#[derive(Clone, Debug)]
pub struct Json {
    stack: Vec<Container>,
    mode: Mode,
    whitespace: u32,
}

/// The stack as a token's bytes see it: the recognizer's, less what they
/// closed (`depth`), plus what they opened (`pushed`, at most a token's bytes
/// deep: a token longer than the overlay is tried the slow way).
struct Overlay<'a> {
    base: &'a [Container],
    depth: usize,
    pushed: [Container; 32],
    pushed_len: usize,
}

/// What stepping one byte needs of a stack.
trait Stack {
    fn len(&self) -> usize;
    fn top(&self) -> Option<Container>;
    /// False when it cannot take another.
    fn push(&mut self, c: Container) -> bool;
    fn pop(&mut self) -> Option<Container>;
}

impl Stack for Vec<Container> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn top(&self) -> Option<Container> {
        self.last().copied()
    }
    fn push(&mut self, c: Container) -> bool {
        Vec::push(self, c);
        true
    }
    fn pop(&mut self) -> Option<Container> {
        Vec::pop(self)
    }
}

impl Stack for Overlay<'_> {
    fn len(&self) -> usize {
        self.depth + self.pushed_len
    }
    fn top(&self) -> Option<Container> {
        match self.pushed_len {
            0 => self.depth.checked_sub(1).map(|i| self.base[i]),
            n => Some(self.pushed[n - 1]),
        }
    }
    fn push(&mut self, c: Container) -> bool {
        if self.pushed_len == self.pushed.len() {
            return false;
        }
        self.pushed[self.pushed_len] = c;
        self.pushed_len += 1;
        true
    }
    fn pop(&mut self) -> Option<Container> {
        if self.pushed_len > 0 {
            self.pushed_len -= 1;
            return Some(self.pushed[self.pushed_len]);
        }
        self.depth = self.depth.checked_sub(1)?;
        Some(self.base[self.depth])
    }
}

fn is_whitespace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl Default for Json {
    fn default() -> Self {
        Json::new()
    }
}

impl Json {
    /// Before any output.
    pub fn new() -> Json {
        Json {
            stack: Vec::new(),
            mode: Mode::Start,
            whitespace: 0,
        }
    }

    /// Whether the top-level object is closed (only whitespace may follow,
    /// and the output should end).
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Whether `bytes` may follow the output so far (an empty token may).
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        let mut mode = self.mode;
        let mut whitespace = self.whitespace;
        let mut stack = Overlay {
            base: &self.stack,
            depth: self.stack.len(),
            pushed: [Container::Object; 32],
            pushed_len: 0,
        };
        bytes
            .iter()
            .all(|&b| step(&mut mode, &mut whitespace, &mut stack, b))
    }

    /// Takes `bytes` (which [`Json::accepts`]); returns false, changing
    /// nothing, where they do not fit.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        let (mut mode, mut whitespace, mut stack) =
            (self.mode, self.whitespace, self.stack.clone());
        if !bytes
            .iter()
            .all(|&b| step(&mut mode, &mut whitespace, &mut stack, b))
        {
            return false;
        }
        (self.mode, self.whitespace, self.stack) = (mode, whitespace, stack);
        true
    }
}

/// One byte: false where it cannot follow.
fn step(mode: &mut Mode, whitespace: &mut u32, stack: &mut impl Stack, b: u8) -> bool {
    if let Mode::Number(num) = *mode {
        if let Some(next) = number_next(num, b) {
            *mode = Mode::Number(next);
            return true;
        }
        // The number ends here, if it may: the byte is the next JSON token's.
        if !num.complete() {
            return false;
        }
        *mode = Mode::AfterValue;
    }
    // Whitespace between JSON tokens (not inside strings, numbers or literals).
    let between = !matches!(
        mode,
        Mode::Str { .. } | Mode::Number(_) | Mode::Literal { .. }
    );
    if between && is_whitespace(b) {
        *whitespace += 1;
        return *whitespace <= WHITESPACE_RUN_MAX;
    }
    *whitespace = 0;
    match *mode {
        Mode::Start => {
            if b != b'{' {
                return false;
            }
            open(mode, stack, Container::Object)
        }
        Mode::Value { close } => {
            if close && b == b']' {
                return close_container(mode, stack, Container::Array);
            }
            begin_value(mode, stack, b)
        }
        Mode::Key { close } => match b {
            b'}' if close => close_container(mode, stack, Container::Object),
            b'"' => {
                *mode = Mode::Str {
                    key: true,
                    escape: Escape::None,
                    utf8: UTF8_NONE,
                };
                true
            }
            _ => false,
        },
        Mode::Colon => {
            if b != b':' {
                return false;
            }
            *mode = Mode::Value { close: false };
            true
        }
        Mode::AfterValue => after_value(mode, stack, b),
        Mode::Str { key, escape, utf8 } => string_byte(mode, key, escape, utf8, b),
        // (Stepped above: a number continues or has ended by here.)
        Mode::Number(_) => false,
        Mode::Literal { word, at } => {
            if word.get(at as usize) != Some(&b) {
                return false;
            }
            *mode = if at as usize + 1 == word.len() {
                Mode::AfterValue
            } else {
                Mode::Literal { word, at: at + 1 }
            };
            true
        }
        Mode::Done => false,
    }
}

fn open(mode: &mut Mode, stack: &mut impl Stack, container: Container) -> bool {
    if stack.len() >= DEPTH_MAX || !stack.push(container) {
        return false;
    }
    *mode = match container {
        Container::Object => Mode::Key { close: true },
        Container::Array => Mode::Value { close: true },
    };
    true
}

fn close_container(mode: &mut Mode, stack: &mut impl Stack, container: Container) -> bool {
    if stack.pop() != Some(container) {
        return false;
    }
    *mode = if stack.len() == 0 {
        Mode::Done
    } else {
        Mode::AfterValue
    };
    true
}

fn begin_value(mode: &mut Mode, stack: &mut impl Stack, b: u8) -> bool {
    *mode = match b {
        b'{' => return open(mode, stack, Container::Object),
        b'[' => return open(mode, stack, Container::Array),
        b'"' => Mode::Str {
            key: false,
            escape: Escape::None,
            utf8: UTF8_NONE,
        },
        b'-' => Mode::Number(Num::Minus),
        b'0' => Mode::Number(Num::Zero),
        b'1'..=b'9' => Mode::Number(Num::Int),
        b't' => Mode::Literal {
            word: b"true",
            at: 1,
        },
        b'f' => Mode::Literal {
            word: b"false",
            at: 1,
        },
        b'n' => Mode::Literal {
            word: b"null",
            at: 1,
        },
        _ => return false,
    };
    true
}

fn after_value(mode: &mut Mode, stack: &mut impl Stack, b: u8) -> bool {
    match (b, stack.top()) {
        (b',', Some(Container::Object)) => {
            *mode = Mode::Key { close: false };
            true
        }
        (b',', Some(Container::Array)) => {
            *mode = Mode::Value { close: false };
            true
        }
        (b'}', Some(Container::Object)) => close_container(mode, stack, Container::Object),
        (b']', Some(Container::Array)) => close_container(mode, stack, Container::Array),
        _ => false,
    }
}

fn string_byte(mode: &mut Mode, key: bool, escape: Escape, utf8: Utf8, b: u8) -> bool {
    let at = |escape, utf8| Mode::Str { key, escape, utf8 };
    if utf8.due > 0 {
        if !(utf8.low..=utf8.high).contains(&b) {
            return false;
        }
        *mode = at(
            escape,
            Utf8 {
                due: utf8.due - 1,
                ..UTF8_NONE
            },
        );
        return true;
    }
    match escape {
        Escape::Backslash => {
            *mode = match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => at(Escape::None, utf8),
                b'u' => at(Escape::Unicode(0), utf8),
                _ => return false,
            };
            true
        }
        Escape::Unicode(n) => {
            if !b.is_ascii_hexdigit() {
                return false;
            }
            *mode = at(
                if n == 3 {
                    Escape::None
                } else {
                    Escape::Unicode(n + 1)
                },
                utf8,
            );
            true
        }
        Escape::None => {
            *mode = match b {
                b'"' if key => Mode::Colon,
                b'"' => Mode::AfterValue,
                b'\\' => at(Escape::Backslash, utf8),
                0x00..=0x1F | 0x7F => return false,
                0x20..=0x7E => at(Escape::None, utf8),
                // UTF-8 leads (RFC 3629): no overlong forms, no surrogates,
                // nothing past U+10FFFF.
                0xC2..=0xDF => at(
                    Escape::None,
                    Utf8 {
                        due: 1,
                        ..UTF8_NONE
                    },
                ),
                0xE0 => at(
                    Escape::None,
                    Utf8 {
                        due: 2,
                        low: 0xA0,
                        high: 0xBF,
                    },
                ),
                0xE1..=0xEC | 0xEE..=0xEF => at(
                    Escape::None,
                    Utf8 {
                        due: 2,
                        ..UTF8_NONE
                    },
                ),
                0xED => at(
                    Escape::None,
                    Utf8 {
                        due: 2,
                        low: 0x80,
                        high: 0x9F,
                    },
                ),
                0xF0 => at(
                    Escape::None,
                    Utf8 {
                        due: 3,
                        low: 0x90,
                        high: 0xBF,
                    },
                ),
                0xF1..=0xF3 => at(
                    Escape::None,
                    Utf8 {
                        due: 3,
                        ..UTF8_NONE
                    },
                ),
                0xF4 => at(
                    Escape::None,
                    Utf8 {
                        due: 3,
                        low: 0x80,
                        high: 0x8F,
                    },
                ),
                _ => return false,
            };
            true
        }
    }
}

/// The number's next state after `b`, if `b` continues it.
fn number_next(num: Num, b: u8) -> Option<Num> {
    Some(match (num, b) {
        (Num::Minus, b'0') => Num::Zero,
        (Num::Minus, b'1'..=b'9') => Num::Int,
        (Num::Int, b'0'..=b'9') => Num::Int,
        (Num::Zero | Num::Int, b'.') => Num::Point,
        (Num::Point | Num::Frac, b'0'..=b'9') => Num::Frac,
        (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::Exp,
        (Num::Exp, b'+' | b'-') => Num::ExpSign,
        (Num::Exp | Num::ExpSign | Num::ExpDigits, b'0'..=b'9') => Num::ExpDigits,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> Option<Json> {
        let mut json = Json::new();
        json.push(text.as_bytes()).then_some(json)
    }

    #[test]
    fn takes_every_json_object_and_is_done_at_its_close() {
        for text in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,-2.5e+3,0,0.25,1E9,true,false,null,\"x\\n\\u00e9\\\"\"],\"b\":{\"c\":{}}}",
            "{\"k\": \"caf\u{e9} \u{1F600} \u{4e2d}\"}",
            "{\n  \"list\": [ ],\n  \"n\": -0\n}\n",
        ] {
            let json = whole(text).unwrap_or_else(|| panic!("refused {text:?}"));
            assert!(json.is_done(), "{text:?}");
            // Every text the recognizer takes is JSON, which serde agrees to.
            let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
            assert!(parsed.is_object());
        }
    }

    #[test]
    fn refuses_what_is_not_a_prefix_of_a_json_object() {
        for text in [
            "[]",
            "1",
            "\"a\"",
            "{a:1}",
            "{\"a\" 1}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":.5}",
            "{\"a\":1,}",
            "{\"a\":[1,]}",
            "{\"a\":tru}",
            "{\"a\":True}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12G4\"}",
            "{\"a\":\"tab\there\"}",
            "{\"a\":1]",
            "{}}",
            "{} {}",
            "{\"a\":NaN}",
        ] {
            assert!(whole(text).is_none_or(|j| !j.is_done()), "took {text:?}");
            let mut json = Json::new();
            let taken = text.bytes().take_while(|&b| json.push(&[b])).count();
            assert!(taken < text.len() || !json.is_done(), "{text:?}");
        }
        // Bad UTF-8 in a string: a lone continuation byte, an overlong form,
        // a surrogate, past U+10FFFF.
        for bad in [
            &b"\x80"[..],
            b"\xC0\xAF",
            b"\xED\xA0\x80",
            b"\xF4\x90\x80\x80",
        ] {
            let mut json = whole("{\"a\":\"").unwrap();
            assert!(!json.push(bad), "{bad:?}");
        }
    }

    #[test]
    fn accepts_answers_as_push_does_without_changing_anything() {
        let prefixes = [
            "",
            "{",
            "{\"a\"",
            "{\"a\":",
            "{\"a\":[1",
            "{\"a\":[{\"b\":\"x",
            "{\"a\":1}",
        ];
        let tokens = [
            "{", "}", "\"", "\":", " ", "1", "0.", "e5", ",", "]", "[", "true", "\\n", "\u{e9}",
            "\"}", "}}", "{\"", "\n\n", "1}", "1]", "-", "null,",
        ];
        for prefix in prefixes {
            let json = whole(prefix).unwrap();
            for token in tokens {
                let mut pushed = json.clone();
                assert_eq!(
                    json.accepts(token.as_bytes()),
                    pushed.push(token.as_bytes()),
                    "{prefix:?} + {token:?}"
                );
            }
            assert!(json.accepts(b""));
        }
    }

    #[test]
    fn blank_space_and_depth_are_bounded() {
        let mut json = whole("{\"a\":").unwrap();
        assert!(json.push(" ".repeat(WHITESPACE_RUN_MAX as usize).as_bytes()));
        assert!(!json.accepts(b" "));
        assert!(json.push(b"1"));
        let mut json = whole("{\"a\":").unwrap();
        assert!(json.push("[".repeat(DEPTH_MAX - 1).as_bytes()));
        assert!(!json.accepts(b"["));
        assert!(!json.accepts(b"{"));
        // Done: nothing but (bounded) whitespace.
        let json = whole("{}").unwrap();
        assert!(json.accepts(b"\n") && !json.accepts(b"x") && !json.accepts(b"{"));
    }

    #[test]
    fn random_bytes_never_panic_and_what_is_taken_stays_a_prefix() {
        let mut rng = bulkhead_kernels::rng::SplitMix64(17);
        let alphabet = b"{}[]\":,. -+0123456789eEtrufalsn\\u\n\xc3\xa9\x80";
        for _ in 0..2000 {
            let mut json = Json::new();
            let mut taken = Vec::new();
            for _ in 0..40 {
                let len = 1 + (rng.next_u64() % 4) as usize;
                let token: Vec<u8> = (0..len)
                    .map(|_| alphabet[(rng.next_u64() % alphabet.len() as u64) as usize])
                    .collect();
                let accepted = json.accepts(&token);
                assert_eq!(accepted, json.clone().push(&token));
                if json.push(&token) {
                    taken.extend_from_slice(&token);
                }
            }
            if json.is_done() {
                let text = std::str::from_utf8(&taken).unwrap();
                assert!(serde_json::from_str::<serde_json::Value>(text)
                    .unwrap()
                    .is_object());
            }
        }
    }
}
