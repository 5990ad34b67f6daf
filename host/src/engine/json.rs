//! Structured output: a byte-level recognizer of JSON text that a compiled
//! schema ([`super::schema`]) accepts, fed the bytes of each generated token,
//! so the sampler can refuse a token that would make the output anything but
//! a prefix of such a text, and end it once the value is complete. JSON mode
//! (`response_format: {"type": "json_object"}`) is the schema of any object.
//!
//! It is a pushdown automaton over RFC 8259's grammar: a stack of open
//! containers, each with its schema node (an object's next property, an
//! array's count of items), and the position within the current token of
//! JSON (string, escape, number, literal, property name). Strings must be
//! well-formed UTF-8 and hold no control characters. Whitespace between
//! tokens is one space, or one or two newlines and at most [`INDENT_MAX`]
//! spaces or tabs (llama.cpp's grammars allow the same), none comes before
//! the top-level value, and nesting is at
//! most [`DEPTH_MAX`] containers, so a model cannot stall in blank space,
//! deepen forever, or fill its output with runs of blank lines and tabs (a
//! small model does, where any whitespace may come). Where an `anyOf`'s alternatives begin alike, each is a reading
//! of the output followed side by side until the bytes tell them apart (at
//! most [`READINGS_MAX`]); a `choice` is plain text, read as its literals.
//!
//! [`Json::accepts`] tries a token's bytes without changing the recognizer and
//! without allocating while there is one reading (pushes past the stack's top
//! go to a small overlay), as the sampler asks it of many candidate tokens
//! per step.

use super::pattern::PatternState;
use super::schema::{
    unit_digits, Node, NodeId, Property, Schema, Source, ANY, ANY_ARRAY, ANY_LITERAL,
    BOUNDED_UNITS_MAX,
};
use std::sync::Arc;

/// Most spaces or tabs after the newlines of a gap between JSON tokens.
pub const INDENT_MAX: u32 = 20;

/// The whitespace of a gap between JSON tokens so far (a reading's
/// `whitespace`): none, one space (the gap is full), one newline (a second
/// may come), or two newlines or indentation: `WS_INDENTED + spaces or tabs`.
const WS_NONE: u32 = 0;
const WS_SPACE: u32 = 1;
const WS_NEWLINE: u32 = 2;
const WS_INDENTED: u32 = 3;

/// The gap's state after `b` (a whitespace byte) follows `state`, or `None`
/// where the gap cannot take it: `" "`, or `"\n"` or `"\n\n"` then up to
/// [`INDENT_MAX`] spaces or tabs.
fn gap_after(state: u32, b: u8) -> Option<u32> {
    match (state, b) {
        (WS_NONE, b' ') => Some(WS_SPACE),
        (WS_NONE, b'\n') => Some(WS_NEWLINE),
        (WS_NEWLINE, b'\n') => Some(WS_INDENTED),
        (WS_NEWLINE, b' ' | b'\t') => Some(WS_INDENTED + 1),
        (indented, b' ' | b'\t') if (WS_INDENTED..WS_INDENTED + INDENT_MAX).contains(&indented) => {
            Some(indented + 1)
        }
        _ => None,
    }
}
/// Most containers open at once.
pub const DEPTH_MAX: usize = 64;

/// A container on the stack, with what its schema says of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ctx {
    /// An object of declared properties (node `node`): `next` is the first
    /// that may still come, `current` the one whose value is being read.
    Object {
        node: NodeId,
        next: u16,
        current: u16,
    },
    /// An object of any keys, each value a `values`.
    Map { values: NodeId },
    /// An array (node `node`) and how many items it has begun.
    Array { node: NodeId, count: u32 },
}

/// Where the next byte falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A value of `node` must come; `close`: the array's `]` may instead;
    /// `item`: it is an array's item (counted against its `maxItems`).
    Value {
        node: NodeId,
        close: bool,
        item: bool,
    },
    /// An object's key must come; `close`: its `}` may instead.
    Key { close: bool },
    /// In a declared property's name (quotes included): the names whose
    /// first `at` bytes are the ones so far are `by_name[lo..hi]` (some of
    /// them in the object's window).
    Name { lo: u16, hi: u16, at: u32 },
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the container's close.
    AfterValue,
    /// In a string of `min` to `max` characters, `chars` begun; `key`: a
    /// map's key (a `:` follows it).
    Str {
        key: bool,
        escape: Escape,
        utf8: Utf8,
        chars: u32,
        min: u32,
        max: u32,
    },
    /// In a string of pattern `id` (quotes not included) at `state` of it;
    /// `escape`: after a `\`. `text`: vLLM's `regex`, written as is (not
    /// JSON: no quotes, no escapes).
    Pattern {
        id: u16,
        state: PatternState,
        escape: bool,
        text: bool,
    },
    /// In a number; `integer`: no fraction, no exponent; `bounded`: its
    /// digits so far, where the schema bounds it.
    Number {
        num: Num,
        integer: bool,
        bounded: Option<Bounded>,
    },
    /// In one of the values of literals node `node`: those whose first
    /// `at` bytes are the ones so far are `values[lo..hi]`.
    Literal {
        node: NodeId,
        lo: u16,
        hi: u16,
        at: u32,
    },
    /// The top-level value is complete: whitespace only.
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

/// A bounded number so far ([`Node::Number`]'s `bounds`): written with no
/// exponent and at most `unit` fraction digits, its value is a whole count
/// of units of 10^-`unit`, compared with the bounds exactly. A digit is
/// taken only where some number within the bounds still begins with the
/// digits so far, so a bounded number never leads to a dead end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bounded {
    /// The least and greatest value, in units.
    lo: i64,
    hi: i64,
    /// Every value is a multiple of this many units.
    step: i64,
    /// Fraction digits a unit is (0 for an integer).
    unit: u8,
    negative: bool,
    /// The digits so far, integer and fraction, as one whole number.
    digits: u64,
    /// How many of them are fraction digits.
    fraction: u8,
}

impl Bounded {
    fn new(lo: i64, hi: i64, step: i64, integer: bool) -> Bounded {
        Bounded {
            lo,
            hi,
            step,
            unit: unit_digits(integer) as u8,
            negative: false,
            digits: 0,
            fraction: 0,
        }
    }

    /// After byte `b`, which took the number to `num`: None where no number
    /// within the bounds begins so.
    fn after(mut self, num: Num, b: u8) -> Option<Bounded> {
        match (num, b) {
            (Num::Minus, b'-') => self.negative = true,
            (Num::Frac, b'0'..=b'9') if self.fraction >= self.unit => return None,
            (Num::Zero | Num::Int | Num::Frac, b'0'..=b'9') => {
                self.digits = self.digits.checked_mul(10)? + u64::from(b - b'0');
                self.fraction += u8::from(num == Num::Frac);
            }
            (Num::Point, b'.') => {}
            // No exponent.
            _ => return None,
        }
        self.reaches(num).then_some(self)
    }

    /// 10^`n`.
    fn pow10(n: u8) -> i128 {
        10i128.pow(u32::from(n))
    }

    /// Whether a number within the bounds (and within
    /// [`BOUNDED_UNITS_MAX`]) begins with the number so far, at `num`.
    fn reaches(&self, num: Num) -> bool {
        let (lo, hi) = (i128::from(self.lo), i128::from(self.hi));
        // The magnitudes, in units, within the bounds on this side of zero.
        let (want_lo, want_hi) = if self.negative {
            ((-hi).max(0), -lo)
        } else {
            (lo.max(0), hi)
        };
        let want_hi = want_hi.min(i128::from(BOUNDED_UNITS_MAX));
        // A multiple of the step within [a, b] and the wanted magnitudes.
        let step = i128::from(self.step);
        let meets = |a: i128, b: i128| {
            let (a, b) = (a.max(want_lo), b.min(want_hi));
            a <= b && (a + step - 1).div_euclid(step) * step <= b
        };
        let digits = i128::from(self.digits);
        let unit = Bounded::pow10(self.unit);
        match num {
            Num::Minus => meets(0, want_hi),
            Num::Zero => meets(0, unit - 1),
            // More integer digits, any number of them, then any fraction.
            Num::Int => {
                let mut scale = unit;
                while digits * scale <= want_hi {
                    if meets(digits * scale, (digits + 1) * scale - 1) {
                        return true;
                    }
                    scale *= 10;
                }
                false
            }
            Num::Point => meets(digits * unit, (digits + 1) * unit - 1),
            Num::Frac => {
                let scale = Bounded::pow10(self.unit - self.fraction);
                meets(digits * scale, (digits + 1) * scale - 1)
            }
            Num::Exp | Num::ExpSign | Num::ExpDigits => false,
        }
    }

    /// Whether the number may end here, at `num`: its value is within the
    /// bounds.
    fn ends(&self, num: Num) -> bool {
        let scale = match num {
            Num::Zero | Num::Int => Bounded::pow10(self.unit),
            Num::Frac => Bounded::pow10(self.unit - self.fraction),
            _ => return false,
        };
        let magnitude = i128::from(self.digits) * scale;
        let value = if self.negative { -magnitude } else { magnitude };
        (i128::from(self.lo)..=i128::from(self.hi)).contains(&value)
            && value.rem_euclid(i128::from(self.step)) == 0
    }
}

/// Most readings of the output kept at once: `anyOf` alternatives that
/// begin alike are each followed until the output tells them apart (the
/// first ones are kept where more would be; each is an instance's prefix).
pub const READINGS_MAX: usize = 16;

/// Most stack changes a token's bytes are tried with in an overlay; a
/// longer token is tried on a copy of the recognizer.
const OVERLAY_DEPTH: usize = 32;

/// The recognizer's state at one point of the output: each reading of it.
#[derive(Clone, Debug)]
pub struct Json {
    schema: Arc<Schema>,
    /// At least one; at most [`READINGS_MAX`].
    readings: Vec<Reading>,
}

/// One reading of the output so far.
#[derive(Clone, Debug, PartialEq)]
struct Reading {
    stack: Vec<Ctx>,
    mode: Mode,
    whitespace: u32,
}

/// The stack as a token's bytes see it: the recognizer's, less what they
/// closed or changed (`depth`), plus what they opened or changed (`pushed`,
/// at most [`OVERLAY_DEPTH`]: no token of fewer bytes fills it).
#[derive(Clone)]
struct Overlay<'a> {
    base: &'a [Ctx],
    depth: usize,
    pushed: [Ctx; OVERLAY_DEPTH],
    pushed_len: usize,
}

/// What stepping one byte needs of a stack.
trait Stack {
    fn len(&self) -> usize;
    fn top(&self) -> Option<Ctx>;
    /// False when it cannot take another.
    fn push(&mut self, c: Ctx) -> bool;
    fn pop(&mut self) -> Option<Ctx>;
}

impl Stack for Vec<Ctx> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn top(&self) -> Option<Ctx> {
        self.last().copied()
    }
    fn push(&mut self, c: Ctx) -> bool {
        Vec::push(self, c);
        true
    }
    fn pop(&mut self) -> Option<Ctx> {
        Vec::pop(self)
    }
}

impl Stack for Overlay<'_> {
    fn len(&self) -> usize {
        self.depth + self.pushed_len
    }
    fn top(&self) -> Option<Ctx> {
        match self.pushed_len {
            0 => self.depth.checked_sub(1).map(|i| self.base[i]),
            n => Some(self.pushed[n - 1]),
        }
    }
    fn push(&mut self, c: Ctx) -> bool {
        if self.pushed_len == self.pushed.len() {
            return false;
        }
        self.pushed[self.pushed_len] = c;
        self.pushed_len += 1;
        true
    }
    fn pop(&mut self) -> Option<Ctx> {
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

impl Json {
    /// Before any output of a value `schema` accepts.
    pub fn new(schema: Arc<Schema>) -> Json {
        let root = schema.root();
        let mode = if schema.is_choice() {
            // Text, not JSON: one of the choices (at least one, none empty)
            // from the first byte on.
            Mode::Literal {
                node: root,
                lo: 0,
                hi: literals(&schema, root).len() as u16,
                at: 0,
            }
        } else if let Source::Regex(_) = schema.source() {
            // Text a regex matches whole, from the first byte on.
            let start = schema.pattern(0).start();
            if schema.pattern(0).is_final(start) {
                Mode::Done
            } else {
                Mode::Pattern {
                    id: 0,
                    state: start,
                    escape: false,
                    text: true,
                }
            }
        } else {
            Mode::Value {
                node: root,
                close: false,
                item: false,
            }
        };
        Json {
            schema,
            readings: vec![Reading {
                stack: Vec::new(),
                mode,
                whitespace: WS_NONE,
            }],
        }
    }

    /// Whether the top-level value is complete and nothing could extend it
    /// (only whitespace may follow: the output should end).
    pub fn is_done(&self) -> bool {
        self.readings.iter().all(|r| r.mode == Mode::Done)
    }

    /// Whether the output may end here: the top-level value is complete
    /// (a top-level number or literal may be complete and still go on).
    pub fn may_end(&self) -> bool {
        self.readings.iter().any(|r| match r.mode {
            Mode::Done => true,
            _ if !r.stack.is_empty() => false,
            Mode::Number { num, bounded, .. } => {
                num.complete() && bounded.is_none_or(|b| b.ends(num))
            }
            Mode::Literal { node, lo, at, .. } => {
                literals(&self.schema, node)[usize::from(lo)].len() == at as usize
            }
            Mode::Pattern {
                id,
                state,
                text: true,
                ..
            } => self.schema.pattern(id).accepts_end(state),
            _ => false,
        })
    }

    /// Whether `bytes` may follow the output so far (an empty token may).
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        if bytes.len() > OVERLAY_DEPTH {
            return self.clone().push(bytes);
        }
        self.readings.iter().any(|reading| {
            let cursor = Cursor {
                schema: &self.schema,
                stack: Overlay {
                    base: &reading.stack,
                    depth: reading.stack.len(),
                    pushed: [Ctx::Map { values: ANY }; OVERLAY_DEPTH],
                    pushed_len: 0,
                },
                mode: reading.mode,
                whitespace: reading.whitespace,
                forks: Vec::new(),
            };
            readings(cursor, bytes).any()
        })
    }

    /// Takes `bytes` (which [`Json::accepts`]); returns false, changing
    /// nothing, where they do not fit.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        let mut next: Vec<Reading> = Vec::new();
        for reading in &self.readings {
            let cursor = Cursor {
                schema: &self.schema,
                stack: reading.stack.clone(),
                mode: reading.mode,
                whitespace: reading.whitespace,
                forks: Vec::new(),
            };
            for c in readings(cursor, bytes).into_vec() {
                let reading = Reading {
                    stack: c.stack,
                    mode: c.mode,
                    whitespace: c.whitespace,
                };
                // Readings that met again (an ambiguous array item read to
                // its end either way) are one.
                if !next.contains(&reading) && next.len() < READINGS_MAX {
                    next.push(reading);
                }
            }
        }
        if next.is_empty() {
            return false;
        }
        self.readings = next;
        true
    }
}

/// What a token's bytes left of one reading.
enum Readings<C> {
    None,
    One(C),
    Many(Vec<C>),
}

impl<C> Readings<C> {
    fn any(&self) -> bool {
        match self {
            Readings::None => false,
            Readings::One(_) => true,
            Readings::Many(many) => !many.is_empty(),
        }
    }

    fn into_vec(self) -> Vec<C> {
        match self {
            Readings::None => Vec::new(),
            Readings::One(one) => vec![one],
            Readings::Many(many) => many,
        }
    }
}

/// Steps `cursor` through `bytes`: one reading, until a union's
/// alternatives that begin alike fork it; from there, breadth first, at
/// most [`READINGS_MAX`] (so a token costs a bounded number of steps
/// whatever the schema's unions).
fn readings<'a, S: Stack + Clone>(
    mut cursor: Cursor<'a, S>,
    bytes: &[u8],
) -> Readings<Cursor<'a, S>> {
    for (i, &b) in bytes.iter().enumerate() {
        let took = cursor.step(b);
        if cursor.forks.is_empty() {
            if !took {
                return Readings::None;
            }
            continue;
        }
        let forks = std::mem::take(&mut cursor.forks);
        let mut live: Vec<Cursor<'a, S>> = Vec::with_capacity(forks.len() + 1);
        if took {
            live.push(cursor);
        }
        live.extend(forks);
        live.truncate(READINGS_MAX);
        for &b in &bytes[i + 1..] {
            let mut next = Vec::with_capacity(live.len());
            for mut c in live {
                let took = c.step(b);
                let forks = std::mem::take(&mut c.forks);
                if took {
                    next.push(c);
                }
                next.extend(forks);
            }
            next.truncate(READINGS_MAX);
            live = next;
        }
        return Readings::Many(live);
    }
    Readings::One(cursor)
}

/// The state stepped byte by byte, over the recognizer's stack or an overlay.
struct Cursor<'a, S> {
    schema: &'a Schema,
    stack: S,
    mode: Mode,
    whitespace: u32,
    /// Other readings the last byte began (a union's other alternatives).
    forks: Vec<Cursor<'a, S>>,
}

/// Of `lo..hi`, entries of byte strings (`bytes(i)`) in byte order that
/// share their first `at` bytes and all have more, the range of those whose
/// next byte is `b` (empty where none): two binary searches, so a long
/// `enum` or many properties cost a tenant's request no more per byte than a
/// short one.
fn narrow<'a>(
    bytes: impl Fn(usize) -> &'a [u8],
    lo: usize,
    hi: usize,
    at: usize,
    b: u8,
) -> (usize, usize) {
    let first = lo + partition(lo, hi, |i| bytes(i)[at] < b);
    let last = lo + partition(lo, hi, |i| bytes(i)[at] <= b);
    (first, last)
}

/// How many of `lo..hi` (a prefix of them) satisfy `below`.
fn partition(lo: usize, hi: usize, below: impl Fn(usize) -> bool) -> usize {
    let (mut a, mut z) = (lo, hi);
    while a < z {
        let mid = a + (z - a) / 2;
        if below(mid) {
            a = mid + 1;
        } else {
            z = mid;
        }
    }
    a - lo
}

/// The properties a key may name after `next`: up to the first required one.
fn window(properties: &[Property], next: usize) -> usize {
    properties[next..]
        .iter()
        .position(|p| p.required)
        .map_or(properties.len(), |i| next + i + 1)
}

/// Whether an object may close with `next` the first property still due.
fn may_close(properties: &[Property], next: usize) -> bool {
    properties[next..].iter().all(|p| !p.required)
}

/// Object node `node`'s properties, and their indices in name order.
fn object(schema: &Schema, node: NodeId) -> (&[Property], &[u16]) {
    match schema.node(node) {
        Node::Object {
            properties,
            by_name,
        }
        | Node::Tagged {
            head: properties,
            by_name,
            ..
        } => (properties, by_name),
        _ => (&[], &[]),
    }
}

/// Object node `node`'s properties.
fn properties(schema: &Schema, node: NodeId) -> &[Property] {
    object(schema, node).0
}

/// Literals node `node`'s values, as written.
fn literals(schema: &Schema, node: NodeId) -> &[Box<[u8]>] {
    match schema.node(node) {
        Node::Literals(values) => values,
        _ => &[],
    }
}

/// Array node `node`'s item at `index` (of its prefix, else of its
/// items), and how few and how many items it has.
fn array(schema: &Schema, node: NodeId, index: u32) -> (NodeId, u32, u32) {
    match schema.node(node) {
        Node::Array {
            prefix,
            items,
            min,
            max,
        } => {
            let item = usize::try_from(index)
                .ok()
                .and_then(|i| prefix.get(i))
                .unwrap_or(items);
            (*item, *min, *max)
        }
        _ => (ANY, 0, 0),
    }
}

impl<S: Stack + Clone> Cursor<'_, S> {
    /// This reading as it is, with no forks of its own.
    fn fork(&self) -> Self {
        Cursor {
            schema: self.schema,
            stack: self.stack.clone(),
            mode: self.mode,
            whitespace: self.whitespace,
            forks: Vec::new(),
        }
    }

    /// A value ended: after it, the container's `,` or close, or nothing.
    fn end_value(&mut self) {
        self.mode = if self.stack.len() == 0 {
            Mode::Done
        } else {
            Mode::AfterValue
        };
    }

    /// Value `index` of literals `node` ended: where it is a tagged
    /// object's first value (the object on top is a [`Node::Tagged`]: a
    /// value inside it would be in a container of its own), the object
    /// goes on as the alternative of that tag, its first property written.
    fn end_literal(&mut self, node: NodeId, index: usize) {
        if let Some(Ctx::Object { node: object, .. }) = self.stack.top() {
            if let Node::Tagged { head, bodies, .. } = self.schema.node(object) {
                debug_assert_eq!(head[0].value, node);
                self.replace_top(Ctx::Object {
                    node: bodies[index],
                    next: 1,
                    current: 0,
                });
            }
        }
        self.end_value();
    }

    fn replace_top(&mut self, ctx: Ctx) -> bool {
        self.stack.pop();
        self.stack.push(ctx)
    }

    fn open(&mut self, ctx: Ctx, mode: Mode) -> bool {
        if self.stack.len() >= DEPTH_MAX || !self.stack.push(ctx) {
            return false;
        }
        self.mode = mode;
        true
    }

    fn close(&mut self) -> bool {
        self.stack.pop();
        self.end_value();
        true
    }

    /// One byte: false where it cannot follow.
    fn step(&mut self, b: u8) -> bool {
        // A number or a literal ends at the first byte that does not
        // continue it, if it may end there: that byte is the next token's.
        match self.mode {
            Mode::Number {
                num,
                integer,
                bounded,
            } => {
                let next = number_next(num, b)
                    .filter(|next| !integer || matches!(next, Num::Zero | Num::Int))
                    .and_then(|next| match bounded {
                        None => Some((next, None)),
                        Some(so_far) => so_far.after(next, b).map(|a| (next, Some(a))),
                    });
                if let Some((num, bounded)) = next {
                    self.mode = Mode::Number {
                        num,
                        integer,
                        bounded,
                    };
                    return true;
                }
                if !num.complete() || bounded.is_some_and(|so_far| !so_far.ends(num)) {
                    return false;
                }
                self.end_value();
            }
            Mode::Literal { node, lo, hi, at } => {
                let values = literals(self.schema, node);
                let (lo, hi, at) = (usize::from(lo), usize::from(hi), at as usize);
                // The shortest of the range comes first: where it is complete,
                // the others go on.
                let complete = values[lo].len() == at;
                let (first, last) = narrow(|i| &values[i], lo + usize::from(complete), hi, at, b);
                if first < last {
                    self.literal(node, first, last, at + 1);
                    return true;
                }
                if !complete {
                    return false;
                }
                self.end_literal(node, lo);
            }
            _ => {}
        }
        // Whitespace between JSON tokens (not inside strings, names,
        // numbers or literals).
        let between = !matches!(
            self.mode,
            Mode::Str { .. } | Mode::Name { .. } | Mode::Pattern { .. }
        );
        if between && is_whitespace(b) {
            if self.mode == Mode::Done && self.schema.is_text() {
                // A choice or a regex's text is the output alone.
                return false;
            }
            if self.stack.top().is_none() && matches!(self.mode, Mode::Value { .. }) {
                // Before the top-level value: the output starts with it.
                return false;
            }
            return match gap_after(self.whitespace, b) {
                Some(state) => {
                    self.whitespace = state;
                    true
                }
                None => false,
            };
        }
        self.whitespace = WS_NONE;
        match self.mode {
            Mode::Value { node, close, item } => {
                if close && b == b']' {
                    return self.close();
                }
                self.begin(node, item, b)
            }
            Mode::Key { close } => match self.stack.top() {
                Some(Ctx::Object { node, next, .. }) => {
                    if b == b'}' {
                        return close && self.close();
                    }
                    let (properties, by_name) = object(self.schema, node);
                    self.name(properties, by_name, next, (0, by_name.len()), 0, b)
                }
                Some(Ctx::Map { .. }) => match b {
                    b'}' if close => self.close(),
                    b'"' => {
                        self.mode = Mode::Str {
                            key: true,
                            escape: Escape::None,
                            utf8: UTF8_NONE,
                            chars: 0,
                            min: 0,
                            max: u32::MAX,
                        };
                        true
                    }
                    _ => false,
                },
                _ => false,
            },
            Mode::Name { lo, hi, at } => {
                let Some(Ctx::Object { node, next, .. }) = self.stack.top() else {
                    return false;
                };
                let (properties, by_name) = object(self.schema, node);
                let range = (usize::from(lo), usize::from(hi));
                self.name(properties, by_name, next, range, at as usize, b)
            }
            Mode::Colon => {
                let node = match self.stack.top() {
                    Some(Ctx::Object { node, current, .. }) => {
                        properties(self.schema, node)[usize::from(current)].value
                    }
                    Some(Ctx::Map { values }) => values,
                    _ => return false,
                };
                if b != b':' {
                    return false;
                }
                self.mode = Mode::Value {
                    node,
                    close: false,
                    item: false,
                };
                true
            }
            Mode::AfterValue => self.after_value(b),
            Mode::Str {
                key,
                escape,
                utf8,
                chars,
                min,
                max,
            } => match string_next(escape, utf8, b) {
                None => false,
                Some(StrNext::Close) => {
                    if chars < min {
                        return false;
                    }
                    if key {
                        self.mode = Mode::Colon;
                    } else {
                        self.end_value();
                    }
                    true
                }
                Some(StrNext::In {
                    escape,
                    utf8,
                    begins_char,
                }) => {
                    if begins_char && chars >= max {
                        return false;
                    }
                    self.mode = Mode::Str {
                        key,
                        escape,
                        utf8,
                        chars: chars + u32::from(begins_char),
                        min,
                        max,
                    };
                    true
                }
            },
            Mode::Pattern {
                id,
                state,
                escape,
                text,
            } => self.pattern(id, state, escape, text, b),
            // (Stepped above: ended by here.)
            Mode::Number { .. } | Mode::Literal { .. } => false,
            Mode::Done => false,
        }
    }

    /// Byte `b` in a string of pattern `id`, at `state`: a character only
    /// where an accepted text goes on with it. In JSON (not `text`), `"`
    /// and `\` are written escaped (`\"`, `\\`), and so are tab and
    /// newline (`\t`, `\n`), the only characters of the pattern's text that
    /// JSON cannot hold as they are; `/` may be (`\/`); no other escape is
    /// taken (every character of the text has one of these forms).
    fn pattern(&mut self, id: u16, state: PatternState, escape: bool, text: bool, b: u8) -> bool {
        let pattern = self.schema.pattern(id);
        let c = match (text, escape, b) {
            (true, ..) => b,
            (false, true, b'"' | b'\\' | b'/') => b,
            (false, true, b'n') => b'\n',
            (false, true, b't') => b'\t',
            (false, true, _) => return false,
            (false, false, b'"') => {
                if !pattern.accepts_end(state) {
                    return false;
                }
                self.end_value();
                return true;
            }
            (false, false, b'\\') => {
                // Only where an escaped character may come.
                if !b"\"\\/\n\t"
                    .iter()
                    .any(|&c| pattern.next(state, c).is_some())
                {
                    return false;
                }
                self.mode = Mode::Pattern {
                    id,
                    state,
                    escape: true,
                    text,
                };
                return true;
            }
            // Tab and newline only escaped; no other control character.
            (false, false, 0x20..=0x7E) => b,
            (false, false, _) => return false,
        };
        let Some(state) = pattern.next(state, c) else {
            return false;
        };
        self.mode = if text && pattern.is_final(state) {
            // Nothing may follow: the output is complete.
            Mode::Done
        } else {
            Mode::Pattern {
                id,
                state,
                escape: false,
                text,
            }
        };
        true
    }

    /// In literals `lo..hi` of `node` at `at`: done at once where only a
    /// complete one is left (a string's closing quote, `true`, `null`).
    fn literal(&mut self, node: NodeId, lo: usize, hi: usize, at: usize) {
        let values = literals(self.schema, node);
        let complete = values[lo].len() == at;
        let longer = values[hi - 1].len() > at;
        if complete && !longer {
            self.end_literal(node, lo);
        } else {
            self.mode = Mode::Literal {
                node,
                lo: lo as u16,
                hi: hi as u16,
                at: at as u32,
            };
        }
    }

    /// Byte `b` at `at` of a property's name, where `by_name[range]` are the
    /// names that begin with the bytes so far: some name of the object's
    /// window (from `next` to its first required property) must go on with
    /// it. A name complete here is the only one left (a name written with
    /// its quotes is no other's prefix): its value comes next.
    fn name(
        &mut self,
        properties: &[Property],
        by_name: &[u16],
        next: u16,
        (lo, hi): (usize, usize),
        at: usize,
        b: u8,
    ) -> bool {
        let key = |i: usize| &*properties[usize::from(by_name[i])].key;
        let (first, last) = narrow(key, lo, hi, at, b);
        let window = usize::from(next)..window(properties, next.into());
        if !(first..last).any(|i| window.contains(&usize::from(by_name[i]))) {
            return false;
        }
        if key(first).len() > at + 1 {
            self.mode = Mode::Name {
                lo: first as u16,
                hi: last as u16,
                at: at as u32 + 1,
            };
            return true;
        }
        let Some(Ctx::Object { node, .. }) = self.stack.top() else {
            return false;
        };
        let property = by_name[first];
        self.mode = Mode::Colon;
        self.replace_top(Ctx::Object {
            node,
            next: property + 1,
            current: property,
        })
    }

    /// The first byte of a value of `node` (an array's item when `item`).
    fn begin(&mut self, node: NodeId, item: bool, b: u8) -> bool {
        if item {
            let Some(Ctx::Array {
                node: array_node,
                count,
            }) = self.stack.top()
            else {
                return false;
            };
            let (_, _, max) = array(self.schema, array_node, count);
            if count >= max
                || !self.replace_top(Ctx::Array {
                    node: array_node,
                    count: count + 1,
                })
            {
                return false;
            }
        }
        let schema = self.schema;
        match *schema.node(node) {
            Node::Any => match b {
                b'{' => self.open(Ctx::Map { values: ANY }, Mode::Key { close: true }),
                b'[' => self.begin(ANY_ARRAY, false, b),
                b'"' => self.begin_string(0, u32::MAX),
                b't' | b'f' | b'n' => self.begin(ANY_LITERAL, false, b),
                _ => self.begin_number(false, None, 1, b),
            },
            Node::Number {
                integer,
                bounds,
                step,
            } => self.begin_number(integer, bounds, step, b),
            Node::String { min, max } => b == b'"' && self.begin_string(min, max),
            Node::Pattern { id } => {
                if b != b'"' {
                    return false;
                }
                self.mode = Mode::Pattern {
                    id,
                    state: schema.pattern(id).start(),
                    escape: false,
                    text: false,
                };
                true
            }
            Node::Literals(ref values) => {
                let (first, last) = narrow(|i| &values[i], 0, values.len(), 0, b);
                if first == last {
                    return false;
                }
                self.literal(node, first, last, 1);
                true
            }
            Node::Array { .. } => {
                let (first, min, _) = array(schema, node, 0);
                b == b'['
                    && self.open(
                        Ctx::Array { node, count: 0 },
                        Mode::Value {
                            node: first,
                            close: min == 0,
                            item: true,
                        },
                    )
            }
            Node::Object { .. } | Node::Tagged { .. } => {
                let close = may_close(properties(schema, node), 0);
                b == b'{'
                    && self.open(
                        Ctx::Object {
                            node,
                            next: 0,
                            current: 0,
                        },
                        Mode::Key { close },
                    )
            }
            Node::Map { values } => {
                b == b'{' && self.open(Ctx::Map { values }, Mode::Key { close: true })
            }
            Node::Union(ref alternatives) => {
                // Every alternative that may begin with `b` is a reading;
                // the first is this one, the others fork from here.
                let bit = 1u128 << (b & 0x7F);
                let mut alternatives = alternatives
                    .iter()
                    .filter(|&&a| b < 0x80 && schema.first_bytes(a) & bit != 0);
                let Some(&first) = alternatives.next() else {
                    return false;
                };
                // (No more than the readings kept: the first ones are.)
                for &alternative in alternatives.take(READINGS_MAX - 1) {
                    let mut fork = self.fork();
                    if fork.begin(alternative, false, b) {
                        self.forks.push(fork);
                    }
                }
                self.begin(first, false, b)
            }
            Node::Ref(_) => false,
        }
    }

    fn begin_string(&mut self, min: u32, max: u32) -> bool {
        self.mode = Mode::Str {
            key: false,
            escape: Escape::None,
            utf8: UTF8_NONE,
            chars: 0,
            min,
            max,
        };
        true
    }

    fn begin_number(
        &mut self,
        integer: bool,
        bounds: Option<(i64, i64)>,
        step: i64,
        b: u8,
    ) -> bool {
        let num = match b {
            b'-' => Num::Minus,
            b'0' => Num::Zero,
            b'1'..=b'9' => Num::Int,
            _ => return false,
        };
        let bounded = match bounds {
            None => None,
            Some((lo, hi)) => match Bounded::new(lo, hi, step, integer).after(num, b) {
                None => return false,
                some => some,
            },
        };
        self.mode = Mode::Number {
            num,
            integer,
            bounded,
        };
        true
    }

    fn after_value(&mut self, b: u8) -> bool {
        match self.stack.top() {
            Some(Ctx::Object { node, next, .. }) => {
                let properties = properties(self.schema, node);
                match b {
                    b',' if usize::from(next) < properties.len() => {
                        self.mode = Mode::Key { close: false };
                        true
                    }
                    b'}' => may_close(properties, next.into()) && self.close(),
                    _ => false,
                }
            }
            Some(Ctx::Map { .. }) => match b {
                b',' => {
                    self.mode = Mode::Key { close: false };
                    true
                }
                b'}' => self.close(),
                _ => false,
            },
            Some(Ctx::Array { node, count }) => {
                // (`count` items begun: the next is at that index.)
                let (items, min, max) = array(self.schema, node, count);
                match b {
                    b',' if count < max => {
                        self.mode = Mode::Value {
                            node: items,
                            close: false,
                            item: true,
                        };
                        true
                    }
                    b']' if count >= min => self.close(),
                    _ => false,
                }
            }
            None => false,
        }
    }
}

/// What a string's byte leads to.
enum StrNext {
    /// Still in the string; `begins_char`: the byte began a character.
    In {
        escape: Escape,
        utf8: Utf8,
        begins_char: bool,
    },
    /// The closing quote.
    Close,
}

/// The string's next state after `b`, if `b` may come.
fn string_next(escape: Escape, utf8: Utf8, b: u8) -> Option<StrNext> {
    let at = |escape, utf8| {
        Some(StrNext::In {
            escape,
            utf8,
            begins_char: false,
        })
    };
    let begins = |escape, utf8| {
        Some(StrNext::In {
            escape,
            utf8,
            begins_char: true,
        })
    };
    if utf8.due > 0 {
        if !(utf8.low..=utf8.high).contains(&b) {
            return None;
        }
        return at(
            escape,
            Utf8 {
                due: utf8.due - 1,
                ..UTF8_NONE
            },
        );
    }
    match escape {
        Escape::Backslash => match b {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => at(Escape::None, utf8),
            b'u' => at(Escape::Unicode(0), utf8),
            _ => None,
        },
        Escape::Unicode(n) => {
            if !b.is_ascii_hexdigit() {
                return None;
            }
            at(
                if n == 3 {
                    Escape::None
                } else {
                    Escape::Unicode(n + 1)
                },
                utf8,
            )
        }
        Escape::None => {
            let lead = |due, low, high| begins(Escape::None, Utf8 { due, low, high });
            match b {
                b'"' => Some(StrNext::Close),
                b'\\' => begins(Escape::Backslash, utf8),
                0x00..=0x1F | 0x7F => None,
                0x20..=0x7E => begins(Escape::None, utf8),
                // UTF-8 leads (RFC 3629): no overlong forms, no surrogates,
                // nothing past U+10FFFF.
                0xC2..=0xDF => lead(1, 0x80, 0xBF),
                0xE0 => lead(2, 0xA0, 0xBF),
                0xE1..=0xEC | 0xEE..=0xEF => lead(2, 0x80, 0xBF),
                0xED => lead(2, 0x80, 0x9F),
                0xF0 => lead(3, 0x90, 0xBF),
                0xF1..=0xF3 => lead(3, 0x80, 0xBF),
                0xF4 => lead(3, 0x80, 0x8F),
                _ => None,
            }
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
        let mut json = Json::new(Arc::new(Schema::object()));
        json.push(text.as_bytes()).then_some(json)
    }

    #[test]
    fn takes_every_json_object_and_is_done_at_its_close() {
        for text in [
            "{}",
            "{\"a\": 1}",
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
            let mut json = Json::new(Arc::new(Schema::object()));
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
        // The output starts with its value.
        let json = whole("").unwrap();
        assert!(!json.accepts(b" ") && !json.accepts(b"\n") && json.accepts(b"{"));
        // A gap is one space, or one or two newlines and an indentation.
        let mut json = whole("{\"a\":").unwrap();
        assert!(json.push(b" "));
        for more in [" ", "\n", "\t", "\r"] {
            assert!(!json.accepts(more.as_bytes()), "{more:?} after a space");
        }
        assert!(json.push(b"[1"));
        let indent = " ".repeat(INDENT_MAX as usize - 1);
        for gap in ["\n", "\n\n", "\n\t\t", &format!("\n\n\t{indent}")] {
            assert!(json.accepts(format!("{gap},2").as_bytes()), "{gap:?}");
        }
        for gap in ["\n\n\n", "\r\n", "\t", "\n \n", &format!("\n {indent} ")] {
            assert!(!json.accepts(gap.as_bytes()), "{gap:?}");
        }
        // Each gap counts afresh.
        assert!(json.push(format!("\n{indent} ,\n{indent} 2]").as_bytes()));
        assert!(json.push(b"}"));
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
            let mut json = Json::new(Arc::new(Schema::object()));
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

    fn under(document: serde_json::Value) -> Json {
        Json::new(Arc::new(Schema::compile(&document).unwrap()))
    }

    fn takes(json: &Json, text: &str) -> bool {
        let mut json = json.clone();
        json.push(text.as_bytes()) && json.is_done()
    }

    /// What pydantic writes for a model with a nested model, an optional
    /// field, a bounded list, an enum and a recursive child list.
    fn pydantic() -> serde_json::Value {
        serde_json::json!({
            "$defs": {
                "Point": {"properties": {"x": {"type": "integer"}, "y": {"type": "number"}},
                          "required": ["x", "y"], "type": "object"},
                "Tree": {"properties": {"name": {"type": "string", "minLength": 1, "maxLength": 4},
                                        "children": {"items": {"$ref": "#/$defs/Tree"}, "type": "array"}},
                         "required": ["name", "children"], "type": "object"}
            },
            "properties": {
                "at": {"$ref": "#/$defs/Point"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
                "tags": {"items": {"type": "string"}, "type": "array", "minItems": 1, "maxItems": 2},
                "kind": {"enum": ["cat", "car", 12, 1]},
                "tree": {"$ref": "#/$defs/Tree"},
                "extra": {"type": "object", "additionalProperties": {"type": "boolean"}},
                "pet": {"anyOf": [{"$ref": "#/$defs/Point"}, {"$ref": "#/$defs/Tree"}]}
            },
            "required": ["at", "tags", "kind", "tree"],
            "type": "object"
        })
    }

    #[test]
    fn a_schema_takes_its_instances_in_order_and_nothing_else() {
        let json = under(pydantic());
        for text in [
            r#"{"at":{"x":1,"y":-2.5e3},"tags":["a"],"kind":"cat","tree":{"name":"r","children":[]}}"#,
            r#"{ "at": {"x": -0, "y": 7}, "note": null, "tags": ["a", "b\u00e9"], "kind": 12,
                "tree": {"name": "root", "children": [{"name": "é", "children": []}]},
                "extra": {"k": true, "": false} }"#,
            r#"{"at":{"x":1,"y":2},"note":"n","tags":[""],"kind":1,"tree":{"name":"\"","children":[]},"extra":{}}"#,
        ] {
            assert!(takes(&json, text), "refused {text}");
        }
        for text in [
            // A required property missing, out of order, unknown, twice.
            r#"{"tags":["a"],"kind":"cat","tree":{"name":"r","children":[]}}"#,
            r#"{"tags":["a"],"at":{"x":1,"y":2},"kind":"cat","tree":{"name":"r","children":[]}}"#,
            r#"{"at":{"x":1,"y":2},"zzz":1}"#,
            r#"{"at":{"x":1,"y":2},"at":{"x":1,"y":2}}"#,
            // Wrong types: a fraction for an integer, a string for a number.
            r#"{"at":{"x":1.5,"y":2}}"#,
            r#"{"at":{"x":1e3,"y":2}}"#,
            r#"{"at":{"x":1,"y":"2"}}"#,
            // null where the schema has no null; a number in the optional string.
            r#"{"at":null}"#,
            r#"{"at":{"x":1,"y":2},"note":3}"#,
            // Too few items, too many; an enum value not listed, a prefix of one.
            r#"{"at":{"x":1,"y":2},"tags":[]}"#,
            r#"{"at":{"x":1,"y":2},"tags":["a","b","c"]}"#,
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":"ca"}"#,
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":"dog"}"#,
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":123}"#,
            // A string under minLength, over maxLength (characters, not bytes).
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":1,"tree":{"name":"","children":[]}}"#,
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":1,"tree":{"name":"ééééé","children":[]}}"#,
            // A map's values keep their schema.
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":1,"tree":{"name":"a","children":[]},"extra":{"k":1}}"#,
        ] {
            assert!(!takes(&json, text), "took {text}");
        }
        // Four characters of two bytes each are within maxLength 4.
        assert!(takes(
            &json,
            r#"{"at":{"x":1,"y":2},"tags":["a"],"kind":1,"tree":{"name":"éééé","children":[]}}"#
        ));
    }

    #[test]
    fn names_and_values_that_begin_alike_are_told_apart_within_the_window() {
        // "ab" may come before the required "a", "abc" only after it.
        let json = under(serde_json::json!({
            "properties": {"ab": {"type": "integer"}, "a": {"type": "integer"},
                           "abc": {"enum": [1, 12, 123, "1", "12"]}},
            "required": ["a"]
        }));
        for text in [
            r#"{"ab":1,"a":2,"abc":123}"#,
            r#"{"a":1}"#,
            r#"{"ab":1,"a":2}"#,
            r#"{"a":1,"abc":1}"#,
            r#"{"a":1,"abc":12}"#,
            r#"{"a":1,"abc":123}"#,
            r#"{"a":1,"abc":"12"}"#,
        ] {
            assert!(takes(&json, text), "refused {text}");
        }
        for text in [
            r#"{"abc":1,"a":1}"#,
            r#"{"a":1,"ab":2}"#,
            r#"{"ab":1}"#,
            r#"{"a":1,"abc":1234}"#,
            r#"{"a":1,"abc":13}"#,
            r#"{"a":1,"abc":"123"}"#,
            r#"{"a":1,"abcd":1}"#,
            r#"{"a":1,"abc":2}"#,
        ] {
            assert!(!takes(&json, text), "took {text}");
        }
        // The literal that is complete where another goes on ends at the
        // next byte that is not the other's.
        let mut json = under(serde_json::json!({"items": {"enum": [1, 12, 123]}}));
        assert!(
            json.push(b"[12") && json.accepts(b"3") && json.accepts(b",") && !json.accepts(b"4")
        );
        assert!(json.push(b",123,1]") && json.is_done());
    }

    #[test]
    fn a_choice_is_one_of_its_texts_as_written() {
        let choices = ["positive", "negative", "pos", "né {"].map(String::from);
        let json = Json::new(Arc::new(Schema::choice(&choices).unwrap()));
        for text in ["positive", "negative", "né {"] {
            let mut taken = json.clone();
            assert!(taken.push(text.as_bytes()) && taken.is_done(), "{text}");
        }
        // "pos" may end, or go on to "positive".
        let mut pos = json.clone();
        assert!(pos.push(b"pos") && pos.may_end() && !pos.is_done());
        assert!(pos.accepts(b"itive") && !pos.accepts(b"e"));
        // Not JSON: no quotes, no whitespace before, nothing else.
        for text in [
            "\"positive\"",
            " positive",
            "neg",
            "po",
            "positives",
            "negative ",
            "x",
        ] {
            let mut taken = json.clone();
            assert!(
                !(taken.push(text.as_bytes()) && taken.may_end()),
                "took {text}"
            );
        }
        assert!(Schema::choice(&[]).is_err());
        assert!(Schema::choice(&["a".into(), String::new()]).is_err());
    }

    #[test]
    fn a_pattern_string_is_written_matching_it_and_escaped_as_json() {
        let json = under(serde_json::json!({
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
                "quoted": {"type": "string", "pattern": "^\"\\\\/\t\n$"},
                "tag": {"type": "string", "pattern": "x", "maxLength": 3}
            },
            "required": ["code"]
        }));
        for text in [
            r#"{"code":"ABC-12"}"#,
            r#"{"code":"ZZZ-00","tag":"axb"}"#,
            r#"{"code":"ZZZ-00","tag":"x"}"#,
            r#"{"code":"ABC-12","quoted":"\"\\/\t\n"}"#,
            r#"{"code":"ABC-12","quoted":"\"\\\/\t\n"}"#,
        ] {
            assert!(takes(&json, text), "refused {text}");
        }
        for text in [
            r#"{"code":"AB-12"}"#,
            r#"{"code":"ABC-123"}"#,
            r#"{"code":"abc-12"}"#,
            r#"{"code":"\u0041BC-12"}"#,
            r#"{"code":"ABC-12","tag":"axbx"}"#,
            r#"{"code":"ABC-12","tag":"ab"}"#,
            "{\"code\":\"ABC-12\",\"quoted\":\"\\\"\\\\/\t\\n\"}",
        ] {
            assert!(!takes(&json, text), "took {text}");
        }
        // A character is taken only where the pattern goes on with it: the
        // third letter cannot be a digit, nor the string close early.
        let mut code = json.clone();
        assert!(code.push(br#"{"code":"AB"#));
        assert!(code.accepts(b"C") && !code.accepts(b"1") && !code.accepts(b"\""));
        assert!(!code.accepts(b"\\"), "no escaped character may come");
    }

    #[test]
    fn pattern_strings_are_never_stuck_and_end_matching_as_a_regex_engine_finds() {
        let document = serde_json::json!({
            "type": "object",
            "properties": {
                "email": {"type": "string", "pattern": "^[\\w.+-]+@[\\w-]+\\.[a-z]{2,}$", "maxLength": 24},
                "id": {"type": "string", "pattern": "\\d{3}", "minLength": 5, "maxLength": 8},
                "words": {"type": "string", "pattern": "^\\w+( \\w+)*$"},
                "free": {"type": "string", "pattern": "\\bk"}
            },
            "required": ["email", "id", "words", "free"]
        });
        let root = under(document.clone());
        let regex = |key: &str| {
            regex_automata::meta::Regex::new(
                document["properties"][key]["pattern"].as_str().unwrap(),
            )
            .unwrap()
        };
        let mut rng = bulkhead_kernels::rng::SplitMix64(41);
        let bytes: Vec<u8> = (0u8..=0x7F).chain([0xC3, 0xE9]).collect();
        for _ in 0..200 {
            let mut json = root.clone();
            let mut text = Vec::new();
            while !json.is_done() {
                let next: Vec<u8> = bytes
                    .iter()
                    .copied()
                    .filter(|&b| json.accepts(&[b]))
                    .collect();
                assert!(
                    !next.is_empty(),
                    "dead end at {}",
                    String::from_utf8_lossy(&text)
                );
                // Closing quotes and the next key come sooner, so that
                // walks end.
                let b = *next
                    .iter()
                    .find(|&&b| b == b'"' && rng.next_u64().is_multiple_of(3))
                    .unwrap_or(&next[(rng.next_u64() % next.len() as u64) as usize]);
                assert!(json.push(&[b]));
                text.push(b);
                assert!(text.len() < 16384, "{}", String::from_utf8_lossy(&text));
            }
            let value: serde_json::Value = serde_json::from_slice(&text).unwrap();
            for key in ["email", "id", "words", "free"] {
                let field = value[key].as_str().unwrap();
                assert!(regex(key).is_match(field), "{key}: {field:?}");
                let chars = field.chars().count() as u64;
                let property = &document["properties"][key];
                assert!(
                    property["minLength"].as_u64().is_none_or(|m| chars >= m),
                    "{field:?}"
                );
                assert!(
                    property["maxLength"].as_u64().is_none_or(|m| chars <= m),
                    "{field:?}"
                );
            }
        }
    }

    #[test]
    fn a_tuple_takes_its_prefix_in_order_then_its_items() {
        // pydantic's tuple[int, str]: exactly two, each of its own schema.
        let pair = under(
            serde_json::json!({"type": "array", "maxItems": 2, "minItems": 2,
            "prefixItems": [{"type": "integer"}, {"type": "string"}]}),
        );
        assert!(takes(&pair, r#"[1,"a"]"#) && takes(&pair, r#"[ -7 , "" ]"#));
        for text in [r#"["a",1]"#, "[1]", r#"[1,"a",2]"#, "[]", r#"[1,2]"#] {
            assert!(!takes(&pair, text), "took {text}");
        }
        // A prefix, then any number of items of another schema.
        let rest = under(serde_json::json!({"prefixItems": [{"type": "integer"}],
            "items": {"type": "boolean"}}));
        for text in ["[]", "[1]", "[1,true,false]"] {
            assert!(takes(&rest, text), "refused {text}");
        }
        for text in ["[true]", "[1,2]"] {
            assert!(!takes(&rest, text), "took {text}");
        }
        // items: false ends the array with its prefix.
        let closed = under(serde_json::json!({"type": "array", "items": false,
            "prefixItems": [{"const": "x"}]}));
        assert!(takes(&closed, "[]") && takes(&closed, r#"["x"]"#));
        assert!(!takes(&closed, r#"["x","x"]"#));
    }

    #[test]
    fn a_regex_is_its_text_as_written_and_ends_when_nothing_can_follow() {
        let json = Json::new(Arc::new(Schema::regex("\\d{3}-[a-z]+").unwrap()));
        let mut taken = json.clone();
        assert!(taken.push(b"123-a") && taken.may_end() && !taken.is_done());
        assert!(taken.accepts(b"bc") && !taken.accepts(b"1") && !taken.accepts(b"\""));
        // Not JSON, matched whole: no quotes, no space before, nothing after.
        for text in ["\"123-a\"", " 123-a", "12-a", "123-", "123-a "] {
            let mut taken = json.clone();
            assert!(
                !(taken.push(text.as_bytes()) && taken.may_end()),
                "took {text}"
            );
        }
        let mut yes = Json::new(Arc::new(Schema::regex("(yes|no)\n").unwrap()));
        assert!(yes.push(b"yes") && !yes.may_end());
        assert!(yes.push(b"\n") && yes.is_done() && !yes.accepts(b" "));
        assert!(Schema::regex("(?<=a)b").is_err());
        assert!(Schema::regex("\u{e9}").is_err());
    }

    #[test]
    fn alternatives_that_begin_alike_are_read_side_by_side() {
        // pydantic's list[Union[Cat, Dog]]: two objects told apart by a
        // property's value, then by the properties that follow.
        let json = under(serde_json::json!({
            "$defs": {
                "Cat": {"properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                        "required": ["kind", "lives"], "type": "object"},
                "Dog": {"properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                        "required": ["kind", "good"], "type": "object"}
            },
            "properties": {"pets": {"type": "array",
                "items": {"anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}},
            "required": ["pets"], "type": "object"
        }));
        assert!(takes(
            &json,
            r#"{"pets":[{"kind":"cat","lives":9},{"kind":"dog","good":true},{"kind":"cat","lives":1}]}"#
        ));
        for text in [
            r#"{"pets":[{"kind":"cat","good":true}]}"#,
            r#"{"pets":[{"kind":"dog","lives":9}]}"#,
            r#"{"pets":[{"kind":"cow"}]}"#,
            r#"{"pets":[{"lives":9}]}"#,
        ] {
            assert!(!takes(&json, text), "took {text}");
        }
        // Told apart by their first property's constant: one reading
        // (Node::Tagged), its alternative chosen once the constant is written.
        let mut walk = json.clone();
        assert!(walk.push(br#"{"pets":[{"kind":""#) && walk.readings.len() == 1);
        assert!(walk.push(b"d") && walk.readings.len() == 1);
        assert!(walk.accepts(br#"og","good":false}"#) && !walk.accepts(br#"og","lives":"#));
        // Told apart later (the constant second): two readings from the
        // item's "{" until its kind's value differs; readings that meet again
        // (each item read to its end) are one.
        let json = under(serde_json::json!({
            "items": {"anyOf": [
                {"properties": {"name": {"type": "string"}, "kind": {"const": "cat"},
                                "lives": {"type": "integer"}},
                 "required": ["name", "kind", "lives"], "type": "object"},
                {"properties": {"name": {"type": "string"}, "kind": {"const": "dog"},
                                "good": {"type": "boolean"}},
                 "required": ["name", "kind", "good"], "type": "object"}
            ]},
            "type": "array"
        }));
        let mut walk = json.clone();
        assert!(walk.push(b"[") && walk.readings.len() == 1);
        assert!(walk.push(br#"{"name":"x","kind":""#) && walk.readings.len() == 2);
        assert!(walk.push(b"d") && walk.readings.len() == 1);
        assert!(walk.accepts(br#"og","good":false}"#) && !walk.accepts(br#"og","lives":"#));
        assert!(walk.push(br#"og","good":false},"#) && walk.readings.len() == 1);
        let mut walk = under(serde_json::json!({
            "items": {"anyOf": [{"type": "integer"}, {"type": "number"}]}
        }));
        assert!(walk.push(b"[1") && walk.readings.len() == 2);
        assert!(walk.push(b",") && walk.readings.len() == 1);
        assert!(walk.push(b"2.5]") && walk.is_done());
        // At the top, a complete reading and one that goes on: it may end.
        let mut one = under(serde_json::json!({"anyOf": [{"const": 1}, {"type": "integer"}]}));
        assert!(one.push(b"1") && one.may_end() && !one.is_done());
        assert!(one.push(b"2") && one.may_end());
        // Readings are bounded: sixteen alternatives alike (arrays of the
        // same, told apart only by maxItems), nested, stay within
        // READINGS_MAX however deep the token goes.
        let alike: Vec<serde_json::Value> = (1..=16)
            .map(|k| serde_json::json!({"type": "array", "items": {"$ref": "#"}, "maxItems": k}))
            .collect();
        let mut deep = under(serde_json::json!({"anyOf": alike}));
        assert!(deep.push(b"[[[[") && deep.readings.len() == READINGS_MAX);
        // As many alike as a schema may hold: a byte forks no more readings
        // than are kept, and the first ones are.
        let many: Vec<serde_json::Value> = (0..500)
            .map(|k| serde_json::json!({"type": "array", "items": {"$ref": "#"}, "maxItems": k}))
            .collect();
        let mut wide = under(serde_json::json!({"anyOf": many}));
        assert!(wide.push(b"[[") && wide.readings.len() == READINGS_MAX);
        assert!(wide.accepts(b"]]") && !wide.accepts(b"]]]"));
        assert!(deep.accepts(b"[]]]]]") && deep.push(b"]]]]") && deep.is_done());
    }

    #[test]
    fn a_top_level_value_ends_when_nothing_could_extend_it() {
        // A string, an object, a literal: done at their last byte.
        for (document, text) in [
            (serde_json::json!({"type": "string"}), "\"a\""),
            (serde_json::json!({"enum": ["a", "b"]}), "\"b\""),
            (serde_json::json!({"type": "boolean"}), "true"),
            (serde_json::json!({"type": "array", "maxItems": 0}), "[]"),
        ] {
            let mut json = under(document);
            assert!(
                json.push(text.as_bytes()) && json.is_done() && json.may_end(),
                "{text}"
            );
        }
        // A number, and an enum whose value is another's prefix, may end or go on.
        let mut json = under(serde_json::json!({"type": "integer"}));
        assert!(json.push(b"-") && !json.may_end());
        assert!(json.push(b"12") && json.may_end() && !json.is_done());
        assert!(json.accepts(b"3") && !json.accepts(b".") && json.accepts(b" "));
        let mut json = under(serde_json::json!({"enum": [1, 12]}));
        assert!(json.push(b"1") && json.may_end() && !json.is_done());
        assert!(json.accepts(b"2") && !json.accepts(b"3"));
        assert!(json.push(b"2") && json.is_done());
        // Within an object a property's value never ends the output.
        let mut json = under(serde_json::json!({"properties": {"n": {"type": "number"}}}));
        assert!(json.push(b"{\"n\":1") && !json.may_end());
    }

    /// `tool_choice: "required"`'s output over `n` tools, tool `i` taking
    /// one integer `x{i}`: objects told apart by their first property.
    fn calls(n: usize) -> serde_json::Value {
        let alternatives: Vec<serde_json::Value> = (0..n)
            .map(|i| {
                serde_json::json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": format!("t{i}")},
                        "arguments": {"type": "object",
                                      "properties": {format!("x{i}"): {"type": "integer"}},
                                      "required": [format!("x{i}")]}
                    },
                    "required": ["name", "arguments"]
                })
            })
            .collect();
        serde_json::json!({"type": "array", "minItems": 1, "items": {"anyOf": alternatives}})
    }

    #[test]
    fn objects_told_apart_by_their_first_property_are_one_reading() {
        // 128 alternatives, eight times what could be read side by side:
        // every one is reached, and only with its own arguments.
        let json = under(calls(128));
        assert!(matches!(
            json.schema.node(array(&json.schema, json.schema.root(), 0).0),
            Node::Tagged { bodies, .. } if bodies.len() == 128
        ));
        for i in [0, 1, 15, 16, 17, 100, 127] {
            let call = format!(r#"[{{"name":"t{i}","arguments":{{"x{i}":{i}}}}}]"#);
            assert!(takes(&json, &call), "refused {call}");
            let other = (i + 1) % 128;
            for text in [
                format!(r#"[{{"name":"t{i}","arguments":{{"x{other}":1}}}}]"#),
                format!(r#"[{{"name":"t{i}","arguments":{{}}}}]"#),
                format!(r#"[{{"name":"t{i}","arguments":{{"x{i}":1}},"name":"t{i}"}}]"#),
                format!(r#"[{{"arguments":{{"x{i}":1}},"name":"t{i}"}}]"#),
            ] {
                assert!(!takes(&json, &text), "took {text}");
            }
            // One reading at every byte.
            let mut walk = json.clone();
            for b in call.bytes() {
                assert!(walk.push(&[b]) && walk.readings.len() == 1, "{call}");
            }
        }
        for text in [
            r#"[{"name":"t128","arguments":{"x128":1}}]"#,
            r#"[{"name":"t","arguments":{}}]"#,
            r#"[{"name":"t12x","arguments":{"x12":1}}]"#,
            r#"[]"#,
        ] {
            assert!(!takes(&json, text), "took {text}");
        }
        assert!(takes(
            &json,
            r#"[ { "name" : "t3" , "arguments" : { "x3" : 1 } } , {"name":"t30","arguments":{"x30":-2}} ]"#
        ));
        // A name that is another's prefix ("t1" of "t12"), and constants
        // that are not strings (1 of 12, ended by what follows them).
        let mut walk = json.clone();
        assert!(walk.push(br#"[{"name":"t1"#) && walk.accepts(b"2") && walk.accepts(b"\""));
        assert!(
            walk.push(br#"2","arguments":{"x"#) && walk.accepts(b"12") && !walk.accepts(b"1\"")
        );
        let numbered = under(serde_json::json!({"anyOf": [
            {"type": "object", "properties": {"v": {"const": 1}, "a": {"type": "string"}},
             "required": ["v", "a"]},
            {"type": "object", "properties": {"v": {"const": 12}, "b": {"type": "integer"}},
             "required": ["v"]},
            {"type": "object", "properties": {"v": {"const": true}}, "required": ["v"]}
        ]}));
        assert!(matches!(
            numbered.schema.node(numbered.schema.root()),
            Node::Tagged { .. }
        ));
        for text in [
            r#"{"v":1,"a":"x"}"#,
            r#"{ "v" : 12 , "b" : 3 }"#,
            r#"{"v":12}"#,
            r#"{"v":true}"#,
        ] {
            assert!(takes(&numbered, text), "refused {text}");
        }
        for text in [
            r#"{"v":1}"#,
            r#"{"v":1,"b":3}"#,
            r#"{"v":12,"a":"x"}"#,
            r#"{"v":2}"#,
            r#"{"v":true,"a":"x"}"#,
        ] {
            assert!(!takes(&numbered, text), "took {text}");
        }
    }

    #[test]
    fn a_unions_tagged_objects_are_one_reading_beside_its_other_alternatives() {
        // pydantic's Optional[A | B | ...] of 20 models told apart by `kind`:
        // anyOf [oneOf [refs], null]; flattened, the objects and the null.
        let defs: serde_json::Map<String, serde_json::Value> = (0..20)
            .map(|i| {
                (
                    format!("M{i}"),
                    serde_json::json!({"type": "object",
                    "properties": {"kind": {"const": format!("m{i}"), "type": "string"},
                                   format!("f{i}"): {"type": "integer"}},
                    "required": ["kind", format!("f{i}")]}),
                )
            })
            .collect();
        let refs: Vec<serde_json::Value> = (0..20)
            .map(|i| serde_json::json!({"$ref": format!("#/$defs/M{i}")}))
            .collect();
        let json = under(serde_json::json!({
            "$defs": defs,
            "type": "object",
            "properties": {"pet": {"anyOf": [
                {"oneOf": refs, "discriminator": {"propertyName": "kind"}},
                {"type": "null"},
                {"type": "object", "properties": {"free": {"type": "boolean"}}, "required": ["free"]}
            ]}},
            "required": ["pet"]
        }));
        for i in [0, 15, 16, 19] {
            let text = format!(r#"{{"pet":{{"kind":"m{i}","f{i}":1}}}}"#);
            assert!(takes(&json, &text), "refused {text}");
            assert!(!takes(
                &json,
                &format!(r#"{{"pet":{{"kind":"m{i}","f{}":1}}}}"#, (i + 1) % 20)
            ));
        }
        assert!(takes(&json, r#"{"pet":null}"#) && takes(&json, r#"{"pet":{"free":true}}"#));
        // The tagged objects are one reading beside the other object.
        let mut walk = json.clone();
        assert!(walk.push(br#"{"pet":{"#) && walk.readings.len() == 2);
        assert!(walk.push(br#""kind":"m1"#) && walk.readings.len() == 1);
        assert!(walk.push(br#"7","f17":2}}"#) && walk.is_done());
    }

    #[test]
    fn only_distinct_first_constants_make_a_tagged_union() {
        let alike = |first: serde_json::Value, second: serde_json::Value| {
            Schema::compile(&serde_json::json!({"anyOf": [
                {"type": "object", "properties": {"k": first, "a": {"type": "integer"}},
                 "required": ["k", "a"]},
                {"type": "object", "properties": {"k": second, "b": {"type": "integer"}},
                 "required": ["k", "b"]}
            ]}))
            .unwrap()
        };
        let tagged = |s: &Schema| matches!(s.node(s.root()), Node::Tagged { .. });
        assert!(tagged(&alike(
            serde_json::json!({"const": "x"}),
            serde_json::json!({"const": "y"})
        )));
        // The same constant twice, an enum of two, a type: read side by
        // side, and still each alternative's instances taken.
        for (first, second, took, refused) in [
            (
                serde_json::json!({"const": "x"}),
                serde_json::json!({"const": "x"}),
                r#"{"k":"x","b":1}"#,
                r#"{"k":"y","b":1}"#,
            ),
            (
                serde_json::json!({"enum": ["x", "z"]}),
                serde_json::json!({"const": "y"}),
                r#"{"k":"z","a":1}"#,
                r#"{"k":"y","a":1}"#,
            ),
            (
                serde_json::json!({"type": "string"}),
                serde_json::json!({"const": "y"}),
                r#"{"k":"y","a":1}"#,
                r#"{"k":"x","b":1}"#,
            ),
        ] {
            let schema = alike(first.clone(), second);
            assert!(!tagged(&schema), "{first}");
            let json = Json::new(Arc::new(schema));
            assert!(
                takes(&json, r#"{"k":"x","a":1}"#) && takes(&json, took),
                "{first}"
            );
            assert!(!takes(&json, refused), "{first}");
        }
        // An optional first property is no tag: `{"a": 1}` fits the first.
        let optional = Schema::compile(&serde_json::json!({"anyOf": [
            {"type": "object", "properties": {"k": {"const": "x"}, "a": {"type": "integer"}},
             "required": ["a"]},
            {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"]}
        ]}))
        .unwrap();
        assert!(!tagged(&optional));
        assert!(takes(&Json::new(Arc::new(optional)), r#"{"a":1}"#));
    }

    #[test]
    fn random_walks_over_a_tagged_union_end_in_its_instances() {
        let json = under(calls(40));
        let pieces = [
            "[",
            "{",
            "\"name\":",
            "\"t",
            "1",
            "2",
            "3",
            "\"",
            ",",
            "\"arguments\":",
            "{",
            "\"x1",
            "\"x12",
            "\"x3",
            ":",
            "7",
            "}",
            "]",
            " ",
        ];
        // After 30 random pieces, the first of these that fits.
        let closing = [
            "\"",
            "}",
            "]",
            ":",
            "7",
            "\"arguments\":",
            ",",
            "{",
            "name\":",
            "arguments\":",
            "t",
            "x",
            "1",
            "2",
            "3",
            "0",
        ];
        // One reading at every piece, whatever the 40 alternatives.
        let ended = walk_pieces(&json, 11, 1000, 30, &pieces, &closing, |walk| {
            assert_eq!(walk.readings.len(), 1)
        });
        for text in &ended {
            // Every call names a tool and gives exactly its argument.
            let calls: serde_json::Value = serde_json::from_str(text).unwrap();
            for call in calls.as_array().unwrap() {
                let name = call["name"].as_str().unwrap();
                let i: usize = name[1..].parse().unwrap();
                assert!(i < 40, "{text}");
                let arguments = call["arguments"].as_object().unwrap();
                assert_eq!(arguments.len(), 1, "{text}");
                assert!(arguments[&format!("x{i}")].is_i64(), "{text}");
            }
        }
        let ended = ended.len();
        assert!(ended > 900, "only {ended} walks ended");
    }

    /// Random walks over `json`, pieces standing for a model's tokens:
    /// `walks` of 200 pieces each, the first `random` drawn from `pieces`
    /// (seeded by `seed`), then the first of `closing` that fits, or else a
    /// drawn one. `accepts` must answer as `push` does; `each` sees the
    /// recognizer after each piece taken. The texts of the walks that
    /// completed a value.
    fn walk_pieces(
        json: &Json,
        seed: u64,
        walks: usize,
        random: usize,
        pieces: &[&str],
        closing: &[&str],
        each: impl Fn(&Json),
    ) -> Vec<String> {
        let mut rng = bulkhead_kernels::rng::SplitMix64(seed);
        let mut done = Vec::new();
        for _ in 0..walks {
            let mut walk = json.clone();
            let mut taken = String::new();
            for step in 0..200 {
                let mut piece = pieces[(rng.next_u64() % pieces.len() as u64) as usize];
                if step >= random {
                    piece = closing
                        .iter()
                        .find(|p| walk.accepts(p.as_bytes()))
                        .unwrap_or(&piece);
                }
                let accepted = walk.accepts(piece.as_bytes());
                assert_eq!(
                    accepted,
                    walk.clone().push(piece.as_bytes()),
                    "{taken} + {piece}"
                );
                if walk.push(piece.as_bytes()) {
                    taken.push_str(piece);
                    each(&walk);
                }
            }
            if walk.is_done() {
                done.push(taken);
            }
        }
        done
    }

    #[test]
    fn accepts_answers_as_push_does_under_a_schema() {
        let json = under(pydantic());
        // Pieces of instances, so that walks get deep.
        let pieces = [
            "{",
            "}",
            "[",
            "]",
            "\"",
            ",",
            ":",
            " ",
            "\"at\"",
            "\"x\":",
            "\"y\":",
            "1",
            "-2",
            ".5",
            "e3",
            "\"tags\":",
            "\"a\"",
            "\"kind\":",
            "\"cat\"",
            "12",
            "\"tree\":",
            "{\"name\":\"r\",\"children\":[",
            "]}",
            "null",
            "true",
            "\"note\":",
            "é",
            "\"extra\":",
            "\"pet\":{",
            "\"x\":1,\"y\":2}",
            "\"name\":\"p\",",
        ];
        // After 40 random pieces, the first of these that fits: what closes
        // first (a string, then a container), then what a required
        // property needs.
        let closing = [
            "\"",
            "a",
            "}",
            "]",
            ",",
            ":",
            "\"y\":",
            "1",
            "\"tags\":",
            "\"a\"",
            "\"kind\":",
            "\"tree\":",
            "{\"name\":\"r\",\"children\":[",
            "\"at\":",
            "{",
            "\"x\":",
            "a",
            "t",
            "x",
            "y",
            "g",
            "s",
            "k",
            "i",
            "n",
            "d",
            "r",
            "e",
            "c",
        ];
        let done = walk_pieces(&json, 5, 2000, 40, &pieces, &closing, |_| {});
        for taken in &done {
            let value: serde_json::Value = serde_json::from_str(taken).unwrap();
            let at = &value["at"];
            assert!(at["x"].is_i64() && at["y"].is_number(), "{taken}");
            assert!(value["tags"]
                .as_array()
                .is_some_and(|t| (1..=2).contains(&t.len())));
        }
        let done = done.len();
        assert!(done > 1000, "{done} of 2000 walks completed an instance");
    }

    /// Walks of a bounded number, byte by byte among those it takes: it is
    /// never at a dead end (it may end, or some byte goes on), and where it
    /// may end, the text is a JSON number whose double is within the
    /// schema's bounds.
    fn walks_stay_within(document: serde_json::Value, walks: usize) -> usize {
        let root = under(document.clone());
        let mut rng = bulkhead_kernels::rng::SplitMix64(23);
        let ok = |v: f64| {
            let check = |key: &str, pass: &dyn Fn(f64, f64) -> bool| {
                document[key].as_f64().is_none_or(|m| pass(v, m))
            };
            check("minimum", &|v, m| v >= m)
                && check("maximum", &|v, m| v <= m)
                && check("exclusiveMinimum", &|v, m| v > m)
                && check("exclusiveMaximum", &|v, m| v < m)
                && (document["type"] != "integer" || v.fract() == 0.0)
                && document["multipleOf"]
                    .as_f64()
                    .is_none_or(|m| (v / m).fract() == 0.0)
        };
        let mut ended = 0;
        for _ in 0..walks {
            let mut json = root.clone();
            let mut text = String::new();
            for _ in 0..24 {
                let next: Vec<u8> = b"-0123456789.eE+"
                    .iter()
                    .copied()
                    .filter(|&b| json.accepts(&[b]))
                    .collect();
                let ends = json.may_end();
                assert!(ends || !next.is_empty(), "{document}: dead end at {text:?}");
                if ends {
                    let v: f64 = text.parse().unwrap();
                    assert!(ok(v), "{document}: {text:?} ({v}) may end");
                    assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok());
                    if next.is_empty() || rng.next_u64().is_multiple_of(4) {
                        ended += 1;
                        break;
                    }
                }
                let b = next[(rng.next_u64() % next.len() as u64) as usize];
                assert!(json.push(&[b]));
                text.push(b as char);
            }
        }
        ended
    }

    #[test]
    fn a_bounded_number_is_written_within_its_bounds_and_never_stuck() {
        for document in [
            serde_json::json!({"type": "integer", "minimum": 0, "maximum": 100}),
            serde_json::json!({"type": "integer", "minimum": -5, "maximum": 5}),
            serde_json::json!({"type": "integer", "exclusiveMinimum": 99, "exclusiveMaximum": 101}),
            serde_json::json!({"type": "integer", "minimum": 1000}),
            serde_json::json!({"type": "integer", "maximum": -1000}),
            serde_json::json!({"type": "integer", "minimum": 17, "maximum": 17}),
            serde_json::json!({"type": "number", "minimum": 0, "maximum": 1}),
            serde_json::json!({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001}),
            serde_json::json!({"type": "number", "minimum": -2.5, "maximum": -2.25}),
            serde_json::json!({"type": "number", "minimum": 0.1, "exclusiveMaximum": 0.3}),
            serde_json::json!({"type": "number", "minimum": 1e6}),
            serde_json::json!({"type": "number", "maximum": 1e-3}),
            serde_json::json!({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
            serde_json::json!({"type": "integer", "multipleOf": 7}),
            serde_json::json!({"type": "number", "multipleOf": 3, "exclusiveMinimum": -10, "maximum": 10}),
        ] {
            let ended = walks_stay_within(document.clone(), 400);
            assert!(ended > 100, "{document}: {ended} of 400 walks ended");
        }
    }

    #[test]
    fn a_bounded_number_takes_every_value_within_as_written_and_nothing_past() {
        let percent = under(serde_json::json!({"type": "integer", "minimum": 0, "maximum": 100}));
        for n in -150..=250 {
            let text = n.to_string();
            assert_eq!(
                takes_number(&percent, &text),
                (0..=100).contains(&n),
                "{text}"
            );
        }
        for text in ["-0", "1e1", "1.0", "007", "-"] {
            assert!(!takes_number(&percent, text) || text == "-0", "{text}");
        }
        let share = under(serde_json::json!({"type": "number", "minimum": 0, "maximum": 1}));
        for (text, within) in [
            ("0", true),
            ("1", true),
            ("1.0", true),
            ("1.000000", true),
            ("0.5", true),
            ("0.999999", true),
            ("-0", true),
            ("-0.0", true),
            ("0.000001", true),
            ("1.000001", false),
            ("1.5", false),
            ("2", false),
            ("-0.1", false),
            ("-1", false),
            // Past what a bounded number is written with.
            ("0.0000001", false),
            ("5e-1", false),
            ("0.5E0", false),
        ] {
            assert_eq!(takes_number(&share, text), within, "{text}");
        }
        // Multiples of 5 within [0, 100], as written.
        let fives = under(serde_json::json!({"type": "integer", "multipleOf": 5,
                                             "minimum": 0, "maximum": 100}));
        for n in -20..=120 {
            let within = (0..=100).contains(&n) && n % 5 == 0;
            assert_eq!(takes_number(&fives, &n.to_string()), within, "{n}");
        }
        // Within an object: the bound holds where the property's value is.
        let point = under(serde_json::json!({
            "type": "object", "required": ["x"],
            "properties": {"x": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}}}));
        assert!(takes(&point, r#"{"x": 9}"#));
        assert!(takes(&point, r#"{"x":1 }"#));
        assert!(!takes(&point, r#"{"x": 0}"#));
        assert!(!takes(&point, r#"{"x": 10}"#));
        assert!(!takes(&point, r#"{"x": -1}"#));
    }

    /// Whether a top-level number `text` is taken whole (and may end there).
    fn takes_number(json: &Json, text: &str) -> bool {
        let mut json = json.clone();
        json.push(text.as_bytes()) && json.may_end()
    }
}
