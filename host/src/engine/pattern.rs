//! Regular expressions in structured output: a JSON Schema `pattern` (found
//! anywhere in a string, as validators search for it) and vLLM's `regex`
//! (the whole output text). Each is compiled once, when the request is read,
//! to a table the recognizer ([`super::json`]) steps a character at a time:
//! a character is taken only where some text the pattern accepts still
//! begins with the characters so far, so the model can never write itself
//! into a dead end, and a string's `minLength` and `maxLength` hold
//! together with it: a node of the table is a place in the pattern and a
//! count of characters up to `minLength`, and each node knows the fewest
//! characters to an accepted end, so a character is taken only where that
//! end still lies within `maxLength`.
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
/// Most nodes of a compiled pattern (places in it, times the counts of
/// characters that `minLength` tells apart).
pub const STATES_MAX: usize = 1 << 14;
/// Most bytes one pattern's table takes (see [`Pattern::compile`]): a
/// quarter of [`AUTOMATA_BYTES_MAX`], so that a schema's first costly
/// patterns leave room for others, and compiling one costs a few milliseconds.
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

/// A place in a compiled pattern's text: a node of its table and the
/// characters so far (as far as its `maxLength` tells counts apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PatternState {
    node: u16,
    count: u32,
}

/// A compiled pattern: a table of the texts it accepts, with the fewest
/// characters from each place to an accepted end, so that `maxLength`
/// holds without a place for each count.
#[derive(Clone, PartialEq)]
pub struct Pattern {
    /// Each ASCII byte's column ([`NO_COLUMN`] outside the alphabet): the
    /// characters the pattern does not tell apart share one.
    columns: [u8; 128],
    width: usize,
    /// `next[node * width + column]`: the node after a character of the
    /// column, [`DEAD`] where no accepted text goes on so. A node is the
    /// DFAs' states and the count of characters up to `minLength` (past it
    /// counts are alike); node 0 is the start, and every node leads to an
    /// accepted text.
    next: Box<[u16]>,
    /// The nodes where the text may end (their counts are `minLength`).
    accepting: Box<[bool]>,
    /// The fewest characters from each node to an accepted end.
    shortest: Box<[u32]>,
    /// The most characters (`u32::MAX`: no most).
    max: u32,
}

impl Pattern {
    /// Compiles `regex`; `whole`: the text must match it whole (vLLM's
    /// `regex`), else somewhere (JSON Schema's `pattern`); the text holds
    /// `min` to `max` characters (`u32::MAX`: no most). Its automata take
    /// from `budget`, the bytes left of [`AUTOMATA_BYTES_MAX`], its table
    /// at most [`TABLE_BYTES_MAX`] of them. A `maxLength` costs nothing
    /// more: pydantic's `HttpUrl` (a URL of at most 2,083 characters) has
    /// the table of a URL of any length.
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
        let limit = (*budget).min(TABLE_BYTES_MAX);
        let pattern =
            Pattern::tabulate(&dfas, lengths, what, limit).map_err(|refused| match refused {
                Refused::TooLarge if limit < *budget => format!(
                    "{what} (with the string's minLength) needs a table larger than \
                     {TABLE_BYTES_MAX} bytes"
                ),
                Refused::TooLarge => too_large(),
                Refused::TooMany => format!(
                    "{what} (with the string's minLength) needs more than {STATES_MAX} \
                     states or {TABLE_ENTRIES_MAX} table entries"
                ),
                Refused::Other(message) => message,
            })?;
        *budget = budget.saturating_sub(pattern.bytes());
        Ok(pattern)
    }

    /// The table of the states of `dfas` (each with its start) that an
    /// alphabet text reaches together, each with its count of characters up
    /// to `min` (past which counts are alike), less those from which no
    /// text all of them accept goes on; and each node's fewest characters
    /// to an accepted end, which `max` is held to as the text is written.
    /// The table's bytes take from `limit`.
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
        // A node's row, its shortest and whether it accepts.
        let node_bytes = width * 2 + 5;
        if node_bytes > limit {
            // Not even the start's row.
            return Err(Refused::TooLarge);
        }
        // Breadth first from the start: (the DFAs' states, characters up to min).
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
                let Some(to) = to else {
                    edges.push(u32::MAX);
                    continue;
                };
                let count = (count + 1).min(min);
                let next = states.len() as u32;
                let id = *ids.entry((to.clone(), count)).or_insert(next);
                if id == next {
                    if states.len() >= STATES_MAX || (states.len() + 1) * width > TABLE_ENTRIES_MAX
                    {
                        return Err(Refused::TooMany);
                    }
                    if (states.len() + 1) * node_bytes > limit {
                        return Err(Refused::TooLarge);
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
        // Each node's fewest characters to an accepted end: breadth first,
        // back from the accepting nodes (unreached: no accepted text goes on).
        let mut into: Vec<Vec<u32>> = vec![Vec::new(); states.len()];
        for (from, row) in edges.chunks(width.max(1)).enumerate() {
            for &to in row.iter().filter(|&&to| to != u32::MAX) {
                into[to as usize].push(from as u32);
            }
        }
        let mut shortest = vec![u32::MAX; states.len()];
        let mut queue: std::collections::VecDeque<u32> = (0..states.len() as u32)
            .filter(|&s| accepting[s as usize])
            .collect();
        for &s in &queue {
            shortest[s as usize] = 0;
        }
        while let Some(s) = queue.pop_front() {
            let far = shortest[s as usize] + 1;
            for &from in &into[s as usize] {
                if shortest[from as usize] == u32::MAX {
                    shortest[from as usize] = far;
                    queue.push_back(from);
                }
            }
        }
        if shortest[0] == u32::MAX || shortest[0] > max {
            let within = if min > 0 || max != u32::MAX {
                " within the string's minLength and maxLength"
            } else {
                ""
            };
            return Err(Refused::Other(format!(
                "no text of printable ASCII{within} matches {what}"
            )));
        }
        // The live nodes, renumbered in order (the start stays 0).
        let live = |s: usize| shortest[s] != u32::MAX;
        let mut renumbered = vec![DEAD; states.len()];
        let mut n = 0u16;
        for s in (0..states.len()).filter(|&s| live(s)) {
            renumbered[s] = n;
            n += 1;
        }
        let mut next = Vec::with_capacity(usize::from(n) * width);
        let mut kept_accepting = Vec::with_capacity(usize::from(n));
        let mut kept_shortest = Vec::with_capacity(usize::from(n));
        for s in (0..states.len()).filter(|&s| live(s)) {
            next.extend(edges[s * width..(s + 1) * width].iter().map(|&to| {
                if to == u32::MAX {
                    DEAD
                } else {
                    renumbered[to as usize]
                }
            }));
            kept_accepting.push(accepting[s]);
            kept_shortest.push(shortest[s]);
        }
        Ok(Pattern {
            columns,
            width,
            next: next.into(),
            accepting: kept_accepting.into(),
            shortest: kept_shortest.into(),
            max,
        })
    }

    /// The state before any character.
    pub fn start(&self) -> PatternState {
        PatternState { node: 0, count: 0 }
    }

    /// The state after character `c`, if an accepted text of at most `max`
    /// characters goes on with it.
    pub fn next(&self, state: PatternState, c: u8) -> Option<PatternState> {
        let column = *self.columns.get(usize::from(c))?;
        if column == NO_COLUMN {
            return None;
        }
        let node = self.next[usize::from(state.node) * self.width + usize::from(column)];
        let (count, left) = self.after(state)?;
        (node != DEAD && self.shortest[usize::from(node)] <= left)
            .then_some(PatternState { node, count })
    }

    /// One character on from `state`: its count, and how many characters
    /// may follow it (counted only where there is a most).
    fn after(&self, state: PatternState) -> Option<(u32, u32)> {
        if self.max == u32::MAX {
            return Some((0, u32::MAX));
        }
        let count = state.count + 1;
        Some((count, self.max.checked_sub(count)?))
    }

    /// Whether the text may end here.
    pub fn accepts_end(&self, state: PatternState) -> bool {
        self.accepting[usize::from(state.node)]
    }

    /// Whether no character may follow: the text ends here.
    pub fn is_final(&self, state: PatternState) -> bool {
        let Some((_, left)) = self.after(state) else {
            return true;
        };
        let row = usize::from(state.node) * self.width;
        self.next[row..row + self.width]
            .iter()
            .all(|&to| to == DEAD || self.shortest[usize::from(to)] > left)
    }

    /// Whether the pattern accepts `text`.
    pub fn matches(&self, text: &str) -> bool {
        text.bytes()
            .try_fold(self.start(), |state, c| self.next(state, c))
            .is_some_and(|state| self.accepts_end(state))
    }

    /// Bytes of its table: rows, and each node's shortest and end.
    fn bytes(&self) -> usize {
        self.next.len() * 2 + self.accepting.len() * 5
    }
}

impl std::fmt::Debug for Pattern {
    // (Its table is thousands of numbers; the schema's source has the text.)
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pattern")
            .field("nodes", &self.accepting.len())
            .field("columns", &self.width)
            .field("max", &self.max)
            .finish()
    }
}

/// Why a table was not made.
enum Refused {
    /// It would pass the bytes it may take.
    TooLarge,
    /// It would pass [`STATES_MAX`] or [`TABLE_ENTRIES_MAX`].
    TooMany,
    Other(String),
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

    /// Every state some text reaches.
    fn reachable(p: &Pattern) -> Vec<PatternState> {
        let mut seen = std::collections::HashSet::from([p.start()]);
        let mut todo = vec![p.start()];
        while let Some(state) = todo.pop() {
            for c in (0..128u8).filter(|&c| in_alphabet(c)) {
                if let Some(to) = p.next(state, c) {
                    if seen.insert(to) {
                        todo.push(to);
                    }
                }
            }
        }
        seen.into_iter().collect()
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
            for state in reachable(&p) {
                assert!(
                    p.accepts_end(state) || !p.is_final(state),
                    "{regex}: {state:?} neither ends nor goes on"
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
    fn a_long_max_length_is_held_exactly_at_no_cost_in_table() {
        // pydantic's HttpUrl: a URL of 1 to 2,083 characters. A table of a
        // place for each count would take about 1.2 MB; this one is the
        // table of a URL of any length.
        let url = format_regex("uri").unwrap();
        let table = |lengths| {
            let mut budget = AUTOMATA_BYTES_MAX;
            let p =
                Pattern::compile_all(&[(url.as_str(), true)], lengths, &mut budget, "uri").unwrap();
            (p, AUTOMATA_BYTES_MAX - budget)
        };
        let (held, taken) = table((1, 2083));
        let (free, taken_free) = table((1, u32::MAX));
        assert_eq!(held.bytes(), free.bytes());
        assert_eq!(taken, taken_free);
        assert!(taken < 64 << 10, "{taken}");
        let of = |n: usize| format!("https://a.io/{}", "x".repeat(n - 13));
        assert!(held.matches(&of(2083)) && !held.matches(&of(2084)));
        assert!(free.matches(&of(2084)));
        assert!(held.matches("http://a.io") && !held.matches("ftp://a.io"));
        // Near its most, only what can still end in time is taken.
        let mut state = held.start();
        for c in format!("https://a.io/{}", "x".repeat(2067)).bytes() {
            state = held.next(state, c).unwrap();
        }
        assert!(held.next(state, b'x').is_some() && held.accepts_end(state));
        let mut state = held.start();
        for c in format!("https://{}", "a".repeat(2072)).bytes() {
            state = held.next(state, c).unwrap();
        }
        // 2,080 characters of a host's first label: it needs "." and two
        // letters more, so another letter would leave too few.
        assert!(held.next(state, b'a').is_none() && held.next(state, b'.').is_some());
        assert!(!held.accepts_end(state));
        // A schema's budget holds dozens of them.
        let mut budget = AUTOMATA_BYTES_MAX;
        let mut compiled = 0;
        while Pattern::compile_all(&[(url.as_str(), true)], (1, 2083), &mut budget, "uri").is_ok() {
            compiled += 1;
            assert!(compiled < 1000);
        }
        assert!(compiled >= 12, "{compiled}");
        // A minLength still counts: a pattern whose shortest text's table
        // would not fit is refused.
        let e = compile("^[a-z]*$", false, (40_000, 60_000)).unwrap_err();
        assert!(e.contains("states") || e.contains("larger than"), "{e}");
        // Without a maxLength, a DFA too large is refused.
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
            for state in reachable(&p) {
                assert!(
                    p.accepts_end(state) || !p.is_final(state),
                    "{name}: {state:?}"
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
    fn a_max_length_takes_every_text_up_to_it_and_none_past() {
        // A tiny DFA: the same table with a most of 5,000 as without one.
        let bounded = compile("^[a-z]*$", false, (0, 5_000)).unwrap();
        let free = compile("^[a-z]*$", false, (0, u32::MAX)).unwrap();
        assert_eq!(bounded.bytes(), free.bytes());
        assert!(bounded.matches(&"a".repeat(5_000)) && !bounded.matches(&"a".repeat(5_001)));
        // At its most, nothing may follow: the text ends.
        let mut state = bounded.start();
        for _ in 0..5_000 {
            state = bounded.next(state, b'q').unwrap();
        }
        assert!(bounded.is_final(state) && bounded.accepts_end(state));
        // Lengths of a pattern's own rhythm: (aaa)+ within 4 to 8 is 6 only.
        let p = compile("^(aaa)+$", false, (4, 8)).unwrap();
        let taken: Vec<usize> = (0..12).filter(|&n| p.matches(&"a".repeat(n))).collect();
        assert_eq!(taken, [6]);
        // And from each place only a character that still ends in time:
        // after 6, another a would need 9.
        let mut state = p.start();
        for _ in 0..6 {
            state = p.next(state, b'a').unwrap();
        }
        assert!(p.next(state, b'a').is_none() && p.is_final(state));
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
