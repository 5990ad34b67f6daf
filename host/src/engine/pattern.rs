//! Regular expressions in structured output: a JSON Schema `pattern` (found
//! anywhere in a string, as validators search for it) and vLLM's `regex`
//! (the whole output text). Each is compiled once, when the request is read,
//! to a table the recognizer ([`super::json`]) steps a character at a time:
//! a character is taken only where some text the pattern accepts still
//! begins with the characters so far, so the model can never write itself
//! into a dead end, and a string's `minLength` and `maxLength` are part of
//! the same table (a state is a place in the pattern and a count of
//! characters), so they hold together with it.
//!
//! The text a pattern writes holds printable ASCII, tab and newline only
//! ([`in_alphabet`]). Over those characters every regex dialect a client's
//! validator may use agrees on what `\d`, `\w`, `\s`, `\b` and `.` match
//! (ECMA-262's, Python's `re`, pydantic-core's Rust `regex`; they disagree
//! on other characters: Python's and Rust's `\d` take Arabic-Indic digits,
//! ECMA-262's does not), so the output matches the pattern whichever one
//! checks it. A pattern no such text matches is refused. The syntax is the
//! Rust `regex` crate's (pydantic-core's): lookaround and backreferences are
//! refused by name of the error.
//!
//! Compiling is bounded like any tenant input: [`PATTERN_BYTES_MAX`] bytes
//! of pattern, the automata's sizes ([`AUTOMATA_BYTES_MAX`]), and the table
//! ([`STATES_MAX`] states, [`TABLE_ENTRIES_MAX`] entries).

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::nfa::thompson;
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use regex_syntax::hir::{
    Class, ClassBytes, ClassBytesRange, ClassUnicode, ClassUnicodeRange, Hir, HirKind, Look,
    Repetition,
};
use std::collections::HashMap;

/// Most bytes of a pattern's text.
pub const PATTERN_BYTES_MAX: usize = 4096;
/// Most groups within groups a pattern may nest (parsing recurses).
const NEST_MAX: u32 = 64;
/// Most bytes of heap the automata of a schema's patterns may take in all
/// (each one's NFA, DFA, the DFA while it is made, and its table; a request's
/// tools share one alone and one together): bounds the work of compiling
/// them, which reading the
/// request does in the tenant's turn on the request lane (at most about
/// 20 ms of one core: BENCHMARKS.md). A typical pattern takes 5 to 15 KiB with its table.
pub const AUTOMATA_BYTES_MAX: usize = 512 << 10;
/// Most states of a compiled pattern (places in it, times the counts of
/// characters that `minLength` and `maxLength` tell apart).
pub const STATES_MAX: usize = 1 << 14;
/// Most bytes one pattern's table takes (see [`Pattern::compile`]): a
/// quarter of [`AUTOMATA_BYTES_MAX`], so that a schema's first long strings
/// leave room for others, and compiling one costs a few milliseconds.
pub const TABLE_BYTES_MAX: usize = AUTOMATA_BYTES_MAX / 4;
/// Most entries (states times the classes of characters the pattern tells
/// apart) of a compiled pattern's table: 2 bytes each.
pub const TABLE_ENTRIES_MAX: usize = 1 << 20;

/// The `format`s (JSON Schema's, as pydantic writes them) a string is held
/// to, each as the expression its whole text matches: what RFC 3339 and
/// RFC 4122 write, narrowed to what every client's parser takes (pydantic's
/// `datetime`, `date`, `time`, `timedelta`, `UUID`, `IPv4Address`,
/// `AnyUrl`): a year from 1000, no 29 February (a leap year's own), no leap
/// second, at most 6 fraction digits, a date-time's and a time's offset
/// written (`Z` or `+01:00`), lowercase hexadecimal, an http(s) URL. Other
/// formats (`email`, `hostname`, ...) stay annotations.
pub const FORMATS: &[(&str, &[&str])] = &[
    ("date", &[DATE]),
    ("time", &[TIME]),
    ("date-time", &[DATE, "T", TIME]),
    (
        "duration",
        &[
            r"P(?:\d{1,6}D(?:T",
            DURATION_TIME,
            r")?|T",
            DURATION_TIME,
            ")",
        ],
    ),
    (
        "uuid",
        &[r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"],
    ),
    ("ipv4", &[r"(?:(?:", OCTET, r")\.){3}(?:", OCTET, ")"]),
    (
        "uri",
        &[
            r"https?://[a-z0-9]+(?:-[a-z0-9]+)*(?:\.[a-z0-9]+(?:-[a-z0-9]+)*)*\.[a-z]{2,}(?:/[A-Za-z0-9._~-]*)*",
        ],
    ),
];

/// A valid date: 30 days hath September, April, June and November;
/// February 28.
const DATE: &str = r"[1-9]\d{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|02-(?:0[1-9]|1\d|2[0-8]))";
const TIME: &str =
    r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)";
/// A duration's hours, minutes and seconds (after its `T`): one at least.
const DURATION_TIME: &str =
    r"(?:\d{1,6}H(?:\d{1,6}M)?(?:\d{1,6}S)?|\d{1,6}M(?:\d{1,6}S)?|\d{1,6}S)";
const OCTET: &str = r"25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d";

/// The expression a string of `format` matches whole, if it is one of
/// [`FORMATS`].
pub fn format_regex(format: &str) -> Option<String> {
    FORMATS
        .iter()
        .find(|(f, _)| *f == format)
        .map(|(_, parts)| parts.concat())
}

/// No state: the character leads to no text the pattern accepts.
const DEAD: u16 = u16::MAX;
/// Not a column: a byte outside the alphabet.
const NO_COLUMN: u8 = u8::MAX;

/// Whether a pattern's text may hold character `c`: printable ASCII, tab
/// and newline.
pub fn in_alphabet(c: u8) -> bool {
    matches!(c, b'\t' | b'\n' | 0x20..=0x7E)
}

/// A place in a compiled pattern's text.
pub type PatternState = u16;

/// A compiled pattern: a table of the texts it accepts, with their lengths.
#[derive(Clone, PartialEq)]
pub struct Pattern {
    /// Each ASCII byte's column ([`NO_COLUMN`] outside the alphabet): the
    /// characters the pattern does not tell apart share one.
    columns: [u8; 128],
    width: usize,
    /// `next[state * width + column]`: the state after a character of the
    /// column, [`DEAD`] where no accepted text goes on so. State 0 is the
    /// start; every state leads to an accepted text.
    next: Box<[u16]>,
    /// The states where the text may end.
    accepting: Box<[bool]>,
}

impl Pattern {
    /// Compiles `regex`; `whole`: the text must match it whole (vLLM's
    /// `regex`), else somewhere (JSON Schema's `pattern`); the text holds
    /// `min` to `max` characters (`u32::MAX`: no most). Its automata take
    /// from `budget`, the bytes left of [`AUTOMATA_BYTES_MAX`], its table
    /// at most [`TABLE_BYTES_MAX`] of them. Where its table within `max`
    /// would be larger (pydantic's `HttpUrl`: a URL of at most 2,083
    /// characters), the text is held to the longest length, at least `min`,
    /// whose table is not: a narrower set of texts, each still one the
    /// schema accepts.
    pub fn compile(
        regex: &str,
        whole: bool,
        lengths: (u32, u32),
        budget: &mut usize,
    ) -> Result<Pattern, String> {
        Pattern::compile_all(&[(regex, whole)], lengths, budget, "the pattern")
    }

    /// Compiles the texts that match every one of `regexes` (each whole or
    /// somewhere, as [`Pattern::compile`]'s), `what` in the messages.
    pub fn compile_all(
        regexes: &[(&str, bool)],
        lengths: (u32, u32),
        budget: &mut usize,
        what: &str,
    ) -> Result<Pattern, String> {
        let mut dfas = Vec::with_capacity(regexes.len());
        for &(regex, whole) in regexes {
            dfas.push(dfa_of(regex, whole, budget)?);
        }
        // A string of more characters than its table holds within its
        // bytes is held to fewer: (bounded) the table's counts are its
        // layers, each character adding one, so the layers before the one
        // that did not fit are that shorter string's table.
        let limit = (*budget).min(TABLE_BYTES_MAX);
        let held = match Pattern::tabulate(&dfas, lengths, what, limit) {
            Err(refused) => match refused.layer() {
                Some(count) if count > lengths.0 => {
                    Pattern::tabulate(&dfas, (lengths.0, count - 1), what, limit)
                }
                _ => Err(refused),
            },
            whole => whole,
        };
        let pattern = held.map_err(|refused| match refused {
            Refused::TooLarge { .. } if limit < *budget => format!(
                "{what} (with the string's minLength) needs a table larger than \
                 {TABLE_BYTES_MAX} bytes"
            ),
            Refused::TooLarge { .. } => too_large(),
            Refused::TooMany { .. } => format!(
                "{what} (with the string's minLength and maxLength) needs more than \
                 {STATES_MAX} states or {TABLE_ENTRIES_MAX} table entries"
            ),
            Refused::Other(message) => message,
        })?;
        *budget = budget.saturating_sub(pattern.next.len() * 2);
        Ok(pattern)
    }

    /// The table of the states of `dfas` (each with its start) that an
    /// alphabet text reaches together, each with its count of characters
    /// (up to `max`; without one, up to `min`, past which counts are alike),
    /// less those from which no text all of them accept goes on. The
    /// table's bytes (2 an entry) take from `budget` too: a short pattern
    /// with a long `maxLength` makes a small DFA and a large table.
    fn tabulate(
        dfas: &[(Dfa, StateID)],
        (min, max): (u32, u32),
        what: &str,
        limit: usize,
    ) -> Result<Pattern, Refused> {
        // One column for each set of the DFAs' classes that the alphabet
        // meets (characters no DFA tells apart share one).
        let mut columns = [NO_COLUMN; 128];
        let mut firsts: Vec<u8> = Vec::new();
        let mut class_column: HashMap<Vec<u8>, u8> = HashMap::new();
        for c in (0..128u8).filter(|&c| in_alphabet(c)) {
            let classes: Vec<u8> = dfas.iter().map(|(d, _)| d.byte_classes().get(c)).collect();
            columns[usize::from(c)] = *class_column.entry(classes).or_insert_with(|| {
                firsts.push(c);
                firsts.len() as u8 - 1
            });
        }
        let width = firsts.len();
        if width * 2 > limit {
            // Not even the start's row.
            return Err(Refused::TooLarge { count: None });
        }
        let bounded = max != u32::MAX;
        // Breadth first from the start: (the DFAs' states, characters).
        type Place = (Box<[StateID]>, u32);
        let start: Place = (dfas.iter().map(|&(_, start)| start).collect(), 0);
        let mut ids: HashMap<Place, u32> = HashMap::from([(start.clone(), 0)]);
        let mut states: Vec<Place> = vec![start];
        let mut edges: Vec<u32> = Vec::new();
        let mut i = 0;
        while i < states.len() {
            for &c in &firsts {
                let (from, count) = &states[i];
                let to: Option<Box<[StateID]>> = from
                    .iter()
                    .zip(dfas)
                    .map(|(&state, (dfa, _))| {
                        let to = dfa.next_state(state, c);
                        (!dfa.is_dead_state(to) && !dfa.is_quit_state(to)).then_some(to)
                    })
                    .collect();
                let count = if bounded {
                    count + 1
                } else {
                    (count + 1).min(min)
                };
                let Some(to) = to.filter(|_| count <= max) else {
                    edges.push(u32::MAX);
                    continue;
                };
                let next = states.len() as u32;
                let id = *ids.entry((to.clone(), count)).or_insert(next);
                if id == next {
                    // (Bounded, a state's count is its layer.)
                    let layer = bounded.then_some(count);
                    if states.len() >= STATES_MAX || (states.len() + 1) * width > TABLE_ENTRIES_MAX
                    {
                        return Err(Refused::TooMany { count: layer });
                    }
                    if (states.len() + 1) * width * 2 > limit {
                        return Err(Refused::TooLarge { count: layer });
                    }
                    states.push((to, count));
                }
                edges.push(id);
            }
            i += 1;
        }
        let accepting: Vec<bool> = states
            .iter()
            .map(|(at, count)| {
                *count >= min
                    && at
                        .iter()
                        .zip(dfas)
                        .all(|(&state, (dfa, _))| dfa.is_match_state(dfa.next_eoi_state(state)))
            })
            .collect();
        // The states from which an accepted text goes on: back from the
        // accepting ones.
        let mut into: Vec<Vec<u32>> = vec![Vec::new(); states.len()];
        for (from, row) in edges.chunks(width.max(1)).enumerate() {
            for &to in row.iter().filter(|&&to| to != u32::MAX) {
                into[to as usize].push(from as u32);
            }
        }
        let mut live = accepting.clone();
        let mut todo: Vec<u32> = (0..states.len() as u32)
            .filter(|&s| live[s as usize])
            .collect();
        while let Some(s) = todo.pop() {
            for &from in &into[s as usize] {
                if !live[from as usize] {
                    live[from as usize] = true;
                    todo.push(from);
                }
            }
        }
        if !live[0] {
            let within = if min > 0 || bounded {
                " within the string's minLength and maxLength"
            } else {
                ""
            };
            return Err(Refused::Other(format!(
                "no text of printable ASCII{within} matches {what}"
            )));
        }
        // The live states, renumbered in order (the start stays 0).
        let mut renumbered = vec![DEAD; states.len()];
        let mut n = 0u16;
        for (s, _) in live.iter().enumerate().filter(|(_, &l)| l) {
            renumbered[s] = n;
            n += 1;
        }
        let mut next = Vec::with_capacity(usize::from(n) * width);
        let mut kept_accepting = Vec::with_capacity(usize::from(n));
        for s in (0..states.len()).filter(|&s| live[s]) {
            next.extend(edges[s * width..(s + 1) * width].iter().map(|&to| {
                if to == u32::MAX {
                    DEAD
                } else {
                    renumbered[to as usize]
                }
            }));
            kept_accepting.push(accepting[s]);
        }
        Ok(Pattern {
            columns,
            width,
            next: next.into(),
            accepting: kept_accepting.into(),
        })
    }

    /// The state before any character.
    pub fn start(&self) -> PatternState {
        0
    }

    /// The state after character `c`, if an accepted text goes on with it.
    pub fn next(&self, state: PatternState, c: u8) -> Option<PatternState> {
        let column = *self.columns.get(usize::from(c))?;
        if column == NO_COLUMN {
            return None;
        }
        let to = self.next[usize::from(state) * self.width + usize::from(column)];
        (to != DEAD).then_some(to)
    }

    /// Whether the text may end here.
    pub fn accepts_end(&self, state: PatternState) -> bool {
        self.accepting[usize::from(state)]
    }

    /// Whether no character may follow: the text ends here.
    pub fn is_final(&self, state: PatternState) -> bool {
        let row = usize::from(state) * self.width;
        self.next[row..row + self.width]
            .iter()
            .all(|&to| to == DEAD)
    }

    /// Whether the pattern accepts `text`.
    pub fn matches(&self, text: &str) -> bool {
        text.bytes()
            .try_fold(self.start(), |state, c| self.next(state, c))
            .is_some_and(|state| self.accepts_end(state))
    }

    /// Entries of its table (its size, at 2 bytes each).
    pub fn entries(&self) -> usize {
        self.next.len()
    }
}

impl std::fmt::Debug for Pattern {
    // (Its table is thousands of numbers; the schema's source has the text.)
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pattern")
            .field("states", &self.accepting.len())
            .field("columns", &self.width)
            .finish()
    }
}

/// The refusal of patterns past [`AUTOMATA_BYTES_MAX`].
/// Why a table was not made.
enum Refused {
    /// It would pass the bytes it may take; bounded, at the state of
    /// `count` characters (all states of fewer fit).
    TooLarge {
        count: Option<u32>,
    },
    /// It would pass [`STATES_MAX`] or [`TABLE_ENTRIES_MAX`] (so too).
    TooMany {
        count: Option<u32>,
    },
    Other(String),
}

impl Refused {
    /// Where it ran out of room, bounded: the count of characters of the
    /// first state that did not fit.
    fn layer(&self) -> Option<u32> {
        match self {
            Refused::TooLarge { count } | Refused::TooMany { count } => *count,
            Refused::Other(_) => None,
        }
    }
}

fn too_large() -> String {
    format!("the patterns make automata larger than {AUTOMATA_BYTES_MAX} bytes in all")
}

/// A compiled expression's DFA.
type Dfa = dense::DFA<Vec<u32>>;

/// `regex`'s DFA over the alphabet, matching the text whole or (not
/// `whole`) somewhere, and its anchored start; its automata take from
/// `budget`.
fn dfa_of(regex: &str, whole: bool, budget: &mut usize) -> Result<(Dfa, StateID), String> {
    if regex.len() > PATTERN_BYTES_MAX {
        return Err(format!(
            "the pattern is longer than {PATTERN_BYTES_MAX} bytes"
        ));
    }
    let hir = regex_syntax::ParserBuilder::new()
        .nest_limit(NEST_MAX)
        .build()
        .parse(regex)
        .map_err(|e| {
            format!(
                "the pattern is not one this server reads: {}",
                syntax_error(&e)
            )
        })?;
    let hir = within_alphabet(&hir);
    let hir = if whole {
        hir
    } else {
        // Found anywhere: any text before it and after it.
        let any = || {
            Hir::repetition(Repetition {
                min: 0,
                max: None,
                greedy: true,
                sub: Box::new(Hir::class(Class::Unicode(alphabet()))),
            })
        };
        Hir::concat(vec![any(), hir, any()])
    };
    let nfa = thompson::Compiler::new()
        .configure(
            thompson::Config::new()
                .nfa_size_limit(Some(*budget))
                .which_captures(thompson::WhichCaptures::None),
        )
        .build_from_hir(&hir)
        .map_err(|_| too_large())?;
    *budget = budget
        .checked_sub(nfa.memory_usage())
        .ok_or_else(too_large)?;
    let dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                // Every match, so that a match that ends at the text's end
                // is seen whatever matched before it.
                .match_kind(MatchKind::All)
                .start_kind(StartKind::Anchored)
                .determinize_size_limit(Some(*budget))
                .dfa_size_limit(Some(*budget)),
        )
        .build_from_nfa(&nfa)
        .map_err(|_| too_large())?;
    *budget = budget
        .checked_sub(dfa.memory_usage())
        .ok_or_else(too_large)?;
    let start = dfa
        .start_state(&start::Config::new().anchored(Anchored::Yes))
        .map_err(|e| format!("the pattern has no start: {e}"))?;
    Ok((dfa, start))
}

/// A parse error's kind and where, on one line.
/// Whether `regex` is valid but beyond what any DFA holds: lookaround or
/// a backreference (ECMA-262's and Python's, not Rust's).
pub fn beyond_automata(regex: &str) -> bool {
    use regex_syntax::ast::ErrorKind;
    matches!(
        regex_syntax::ast::parse::ParserBuilder::new()
            .nest_limit(NEST_MAX)
            .build()
            .parse(regex),
        Err(e) if matches!(
            e.kind(),
            ErrorKind::UnsupportedLookAround | ErrorKind::UnsupportedBackreference
        )
    )
}

fn syntax_error(e: &regex_syntax::Error) -> String {
    match e {
        regex_syntax::Error::Parse(e) => {
            format!("{}, at its byte {}", e.kind(), e.span().start.offset)
        }
        regex_syntax::Error::Translate(e) => {
            format!("{}, at its byte {}", e.kind(), e.span().start.offset)
        }
        other => other.to_string(),
    }
}

/// The alphabet as a class of characters.
fn alphabet() -> ClassUnicode {
    ClassUnicode::new([
        ClassUnicodeRange::new('\t', '\n'),
        ClassUnicodeRange::new(' ', '~'),
    ])
}

/// `hir` over the alphabet only: its classes and literals lose the
/// characters outside it, and its Unicode word boundaries are ASCII ones
/// (the same over the alphabet). Captures are dropped (nothing reads them).
fn within_alphabet(hir: &Hir) -> Hir {
    match hir.kind() {
        HirKind::Empty => Hir::empty(),
        HirKind::Literal(literal) => {
            if literal.0.iter().all(|&c| in_alphabet(c)) {
                Hir::literal(literal.0.clone())
            } else {
                Hir::fail()
            }
        }
        HirKind::Class(Class::Unicode(class)) => {
            let mut class = class.clone();
            class.intersect(&alphabet());
            Hir::class(Class::Unicode(class))
        }
        HirKind::Class(Class::Bytes(class)) => {
            let mut class = class.clone();
            class.intersect(&ClassBytes::new([
                ClassBytesRange::new(b'\t', b'\n'),
                ClassBytesRange::new(b' ', b'~'),
            ]));
            Hir::class(Class::Bytes(class))
        }
        HirKind::Look(look) => Hir::look(match *look {
            Look::WordUnicode => Look::WordAscii,
            Look::WordUnicodeNegate => Look::WordAsciiNegate,
            Look::WordStartUnicode => Look::WordStartAscii,
            Look::WordEndUnicode => Look::WordEndAscii,
            Look::WordStartHalfUnicode => Look::WordStartHalfAscii,
            Look::WordEndHalfUnicode => Look::WordEndHalfAscii,
            other => other,
        }),
        HirKind::Repetition(repetition) => Hir::repetition(Repetition {
            sub: Box::new(within_alphabet(&repetition.sub)),
            ..repetition.clone()
        }),
        HirKind::Capture(capture) => within_alphabet(&capture.sub),
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(within_alphabet).collect()),
        HirKind::Alternation(subs) => Hir::alternation(subs.iter().map(within_alphabet).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(regex: &str, whole: bool, lengths: (u32, u32)) -> Result<Pattern, String> {
        let mut budget = AUTOMATA_BYTES_MAX;
        Pattern::compile(regex, whole, lengths, &mut budget)
    }

    fn search(regex: &str) -> Pattern {
        compile(regex, false, (0, u32::MAX)).unwrap()
    }

    #[test]
    fn a_pattern_is_found_anywhere_and_a_regex_matches_whole() {
        let p = search("b+c");
        for text in ["bc", "abbcd", "xxbc"] {
            assert!(p.matches(text), "{text}");
        }
        for text in ["", "cb", "b", "ac"] {
            assert!(!p.matches(text), "{text}");
        }
        let anchored = search("^[A-Z]{3}-[0-9]{2}$");
        assert!(anchored.matches("ABC-12"));
        for text in ["ABC-1", "xABC-12", "ABC-12x", "abc-12"] {
            assert!(!anchored.matches(text), "{text}");
        }
        let whole = compile("b+c", true, (0, u32::MAX)).unwrap();
        assert!(whole.matches("bbc"));
        assert!(!whole.matches("abc") && !whole.matches("bcd"));
    }

    #[test]
    fn perl_classes_mean_their_ascii_selves() {
        let p = search(r"^\d\w\s\S\.$");
        assert!(p.matches("7_ x."));
        assert!(p.matches("0a\tZ."));
        // Not an Arabic-Indic digit, nor a non-ASCII letter: no character
        // outside the alphabet is ever taken.
        assert!(!p.matches("\u{663}a x."));
        assert!(!p.matches("0é x."));
        assert!(search(r"^\bword\b").matches("word!"));
        assert!(!search(r"^\bword\b").matches("words"));
    }

    #[test]
    fn lengths_hold_beside_the_pattern() {
        let p = compile("^[a-z]*$", false, (2, 4)).unwrap();
        for text in ["ab", "abc", "abcd"] {
            assert!(p.matches(text), "{text}");
        }
        for text in ["", "a", "abcde"] {
            assert!(!p.matches(text), "{text}");
        }
        // Only even lengths: 3 to 3 has none.
        let even = "^(aa)*$";
        assert!(compile(even, false, (3, 3)).is_err());
        let p = compile(even, false, (3, 5)).unwrap();
        assert!(p.matches("aaaa") && !p.matches("aa") && !p.matches("aaaaaa"));
        // A least length alone: counts past it are alike.
        let p = compile("x", false, (3, u32::MAX)).unwrap();
        assert!(p.matches("x  ") && p.matches("     x") && !p.matches("xx"));
    }

    #[test]
    fn no_state_leads_to_a_dead_end() {
        for (regex, lengths) in [
            (r"^\d{3}-\d{4}$", (0, u32::MAX)),
            (r"^[\w.+-]+@[\w-]+\.[a-z]{2,}$", (0, 40)),
            ("(ab|cd)+e?", (1, 9)),
            ("^(aa)*$", (3, 7)),
            (r"^\w+(\s\w+)*$", (5, u32::MAX)),
        ] {
            let p = compile(regex, false, lengths).unwrap();
            for state in 0..p.accepting.len() as u16 {
                assert!(
                    p.accepts_end(state) || !p.is_final(state),
                    "{regex}: state {state} neither ends nor goes on"
                );
            }
        }
    }

    #[test]
    fn hostile_or_foreign_patterns_are_refused_by_name() {
        let refused = |regex: &str, lengths: (u32, u32), says: &str| {
            let e = compile(regex, false, lengths).unwrap_err();
            assert!(e.contains(says), "{regex}: {e}");
        };
        refused("(?=a)b", (0, u32::MAX), "look-around");
        refused(r"(a)\1", (0, u32::MAX), "backreference");
        refused("a{", (0, u32::MAX), "not one this server reads");
        refused("^é$", (0, u32::MAX), "no text of printable ASCII");
        refused("^a+$", (0, 0), "minLength and maxLength");
        refused("((a{50}){50}){50}", (0, u32::MAX), "larger than");
        refused(
            &"a".repeat(PATTERN_BYTES_MAX + 1),
            (0, u32::MAX),
            "longer than",
        );
        refused(&"(".repeat(100), (0, u32::MAX), "not one this server reads");
        // A DFA of 2^16 states (the n-th character from the end is an a).
        refused("(a|b)*a(a|b){16}$", (0, u32::MAX), "larger than");
    }

    #[test]
    fn a_string_whose_table_would_not_fit_is_held_to_a_shorter_length() {
        // pydantic's HttpUrl: a URL of 1 to 2,083 characters, whose table
        // (a state for each place and count) would take about 1.2 MB.
        let url = format_regex("uri").unwrap();
        let mut budget = AUTOMATA_BYTES_MAX;
        let held =
            Pattern::compile_all(&[(url.as_str(), true)], (1, 2083), &mut budget, "uri").unwrap();
        let taken = AUTOMATA_BYTES_MAX - budget;
        assert!(
            taken <= TABLE_BYTES_MAX && taken > TABLE_BYTES_MAX * 9 / 10,
            "{taken}"
        );
        // The longest text it takes: a URL of some hundreds of characters.
        let longest = (1..=2083)
            .rev()
            .find(|&n| held.matches(&format!("https://a.io/{}", "x".repeat(n - 13))))
            .unwrap();
        assert!((150..2083).contains(&longest), "{longest}");
        assert!(!held.matches(&format!("https://a.io/{}", "x".repeat(longest - 12))));
        assert!(held.matches("http://a.io") && !held.matches("ftp://a.io"));
        // Every state still ends or goes on, up to the held length.
        for state in 0..held.accepting.len() as u16 {
            assert!(held.accepts_end(state) || !held.is_final(state));
        }
        // A schema's first such strings leave room for more: four at the
        // most each, then the rest held shorter, then refused.
        let mut budget = AUTOMATA_BYTES_MAX;
        let mut lengths = Vec::new();
        let refusal = loop {
            match Pattern::compile_all(&[(url.as_str(), true)], (1, 2083), &mut budget, "uri") {
                Ok(p) => lengths.push(p.accepting.len()),
                Err(e) => break e,
            }
            assert!(lengths.len() < 64, "{lengths:?}");
        };
        assert!(
            lengths.len() >= 4 && lengths[..4].iter().all(|&n| n == lengths[0]),
            "{lengths:?}"
        );
        assert!(
            refusal.contains("in all") || refusal.contains("no text"),
            "{refusal}"
        );
        // Not below minLength: a pattern whose shortest text's table would
        // not fit is refused.
        let e = compile("^[a-z]*$", false, (40_000, 60_000)).unwrap_err();
        assert!(e.contains("states") || e.contains("larger than"), "{e}");
        // Without a maxLength nothing is held: a DFA too large is refused.
        assert!(compile("(a|b)*a(a|b){16}$", false, (0, u32::MAX)).is_err());
    }

    #[test]
    fn formats_take_what_every_clients_parser_takes() {
        let format = |name: &str| {
            let regex = format_regex(name).unwrap();
            compile(&regex, true, (0, u32::MAX)).unwrap()
        };
        for (name, taken, refused) in [
            (
                "date",
                &["2024-02-28", "1999-12-31", "2023-04-30", "1000-01-01"][..],
                &[
                    "2024-02-29",
                    "2024-04-31",
                    "0999-01-01",
                    "2024-13-01",
                    "2024-1-01",
                ][..],
            ),
            (
                "time",
                &["23:59:59Z", "00:00:00.123456+05:30", "12:00:00-23:59"],
                &[
                    "24:00:00Z",
                    "12:00:60Z",
                    "12:00:00",
                    "12:00:00.1234567Z",
                    "12:00Z",
                ],
            ),
            (
                "date-time",
                &["2024-06-01T12:30:00Z", "2024-06-30T00:00:00.5+01:00"],
                &[
                    "2024-06-01 12:30:00Z",
                    "2024-06-01T12:30:00",
                    "2024-06-31T12:30:00Z",
                ],
            ),
            (
                "duration",
                &["P1D", "PT1H30M", "P2DT3S", "PT0S", "PT1H2M3S"],
                &["P", "PT", "P1DT", "P1H", "PT1D"],
            ),
            (
                "uuid",
                &["123e4567-e89b-12d3-a456-426614174000"],
                &[
                    "123e4567e89b12d3a456426614174000",
                    "123E4567-E89B-12D3-A456-426614174000",
                ],
            ),
            (
                "ipv4",
                &["255.255.255.255", "0.0.0.0", "10.1.20.199"],
                &["256.1.1.1", "01.1.1.1", "1.1.1", "1.1.1.1.1"],
            ),
            (
                "uri",
                &["https://example.com/a/b", "http://a-b.example.org"],
                &["ftp://example.com", "https://localhost", "https://-a.com"],
            ),
        ] {
            let p = format(name);
            for text in taken {
                assert!(p.matches(text), "{name}: refused {text}");
            }
            for text in refused {
                assert!(!p.matches(text), "{name}: took {text}");
            }
            for state in 0..p.accepting.len() as u16 {
                assert!(
                    p.accepts_end(state) || !p.is_final(state),
                    "{name}: {state}"
                );
            }
        }
        assert!(format_regex("email").is_none());
        // A pattern and a format at once: both hold.
        let mut budget = AUTOMATA_BYTES_MAX;
        let date = format_regex("date").unwrap();
        let both = Pattern::compile_all(
            &[("^2024-", false), (&date, true)],
            (0, u32::MAX),
            &mut budget,
            "both",
        )
        .unwrap();
        assert!(both.matches("2024-05-01") && !both.matches("2023-05-01"));
        let none =
            Pattern::compile_all(&[("x", false), (&date, true)], (0, 64), &mut budget, "both");
        assert_eq!(
            none.unwrap_err(),
            "no text of printable ASCII within the string's minLength and maxLength matches both"
        );
    }

    #[test]
    fn a_long_max_length_takes_its_table_from_the_budget() {
        // A tiny DFA, a table of 5,000 counts: a few fit, not a schema's
        // thousand.
        let mut budget = AUTOMATA_BYTES_MAX;
        let mut compiled = 0;
        let refusal = loop {
            match Pattern::compile("^[a-z]*$", false, (0, 5_000), &mut budget) {
                Ok(_) => compiled += 1,
                Err(e) => break e,
            }
            assert!(compiled < 64, "{compiled} tables of 5,000 counts");
        };
        assert!(
            compiled >= 1 && refusal.contains("in all"),
            "{compiled}: {refusal}"
        );
    }

    #[test]
    fn a_requests_patterns_share_one_budget() {
        // An e-mail address's pattern takes a few KiB of automata: a
        // schema may hold dozens, not thousands.
        let email = r"^[\w.+-]+@[\w-]+\.[a-z]{2,}$";
        let mut budget = AUTOMATA_BYTES_MAX;
        let mut compiled = 0;
        let refusal = loop {
            match Pattern::compile(email, false, (0, 64), &mut budget) {
                Ok(_) => compiled += 1,
                Err(e) => break e,
            }
        };
        assert!((20..1000).contains(&compiled), "{compiled}");
        assert!(refusal.contains("in all"), "{refusal}");
    }
}
