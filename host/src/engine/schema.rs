//! Structured outputs (`response_format: {"type": "json_schema", ...}`): a
//! tenant's JSON Schema compiled into a graph of nodes that the JSON
//! recognizer ([`super::json`]) follows byte by byte, so that the output is
//! a JSON text the schema accepts. JSON mode (`json_object`) is the schema
//! `{"type": "object"}`.
//!
//! The subset is the one OpenAI's structured outputs and llama.cpp's
//! grammar converter share, and what pydantic's `model_json_schema()`
//! writes: `type` (one or several), `properties` with `required` (the
//! output writes them in the schema's order; optional ones may be left
//! out; no others are generated), `additionalProperties` as the value
//! schema of an object without `properties` (a map), `items`, `prefixItems`
//! (a tuple's items, then `items`'s), `minItems`,
//! `maxItems`, `minLength`, `maxLength`, `pattern` (a regular expression
//! found anywhere in the string) and a string's `format` where it is one of
//! [`FORMATS`](super::pattern::FORMATS) (both compiled with the lengths by
//! [`super::pattern`]), `minimum`, `maximum`,
//! `exclusiveMinimum`, `exclusiveMaximum`, a whole `multipleOf` (a bounded
//! number is written without an exponent, in whole units of
//! [`unit_digits`]; see [`BOUNDED_UNITS_MAX`]), `enum`, `const`, `anyOf` and
//! `oneOf` (`Optional[X]`; objects told apart by a first property that is
//! a constant of each, as pydantic's discriminated union and a required
//! tool call, are one reading (`Node::Tagged`); other alternatives that
//! begin alike, as `Union[A, B]` of two models, are read side by side
//! until the output tells them apart; a `oneOf`'s must begin differently or
//! be so told apart, so that the output fits exactly one), a
//! single-element `allOf`, and
//! `$ref` to any JSON pointer in the
//! document (`#/$defs/...`, recursion included). Annotations (`title`,
//! `description`, `default`, `examples`, other `format`s, ...) are read
//! past, as JSON Schema 2020-12 leaves `format` an annotation. An `anyOf`
//! alternative whose pattern needs lookaround or a backreference is left out
//! where another remains (pydantic's `Decimal`: a number, or such a string),
//! so every output is still an instance. Any other keyword is
//! refused with its name, never ignored: an output that a schema keyword
//! did not constrain would not validate against it. So is a keyword of one
//! type in a schema that names no type (it would accept any other type's
//! values, and constrain that type's).
//!
//! A schema is a tenant's input: its nodes, properties and enum values are
//! bounded ([`NODES_MAX`], [`PROPERTIES_MAX`], [`ENUM_VALUES_MAX`],
//! [`LITERAL_BYTES_MAX`]), and so are its patterns' automata, all together
//! ([`AUTOMATA_BYTES_MAX`]); a `$ref` chain that never reaches a schema and an
//! `anyOf` that contains itself are refused, and compiling never recurses
//! deeper than the document's own nesting (which the request parser bounds).

use super::pattern::{beyond_automata, format_regex, Pattern, AUTOMATA_BYTES_MAX};
use serde_json::Value;
use std::collections::HashMap;

/// Most nodes a compiled schema may hold (each property, item, alternative
/// and reference is one).
pub const NODES_MAX: usize = 1024;
/// Most properties an object schema may declare.
pub const PROPERTIES_MAX: usize = 256;
/// Most values an `enum` may list.
pub const ENUM_VALUES_MAX: usize = 256;
/// Most bytes of property names and `enum` and `const` values, written
/// compactly, in a schema.
pub const LITERAL_BYTES_MAX: usize = 64 * 1024;
/// How many times a schema's nodes and literal bytes the calls of a
/// request's tools may hold together ([`Schema::compile_together`]): 128
/// tools of a dozen nodes each.
pub const TOGETHER: usize = 4;
/// Most schemas within schemas (`items`, `properties`, `anyOf`, `$ref`
/// chains) compiling may follow: it recurses, on a server thread's stack.
pub const NESTING_MAX: usize = 64;

/// A node's index in its schema.
pub type NodeId = u32;

/// Fraction digits a number with bounds (`minimum`, `maximum`, ...) is
/// written with at most: its value is then a whole count of units of
/// 10^-6, which the recognizer compares with the bounds exactly.
pub const BOUNDED_FRACTION_DIGITS: u32 = 6;
/// Largest magnitude of a bounded number, in units: below 2^53, every
/// count of units divided by the unit's power of ten is the double a JSON
/// parser reads from the same digits (both are correctly rounded), so the
/// bounds hold for the value a client's validator sees.
pub const BOUNDED_UNITS_MAX: i64 = (1 << 53) - 1;

/// The power of ten a bounded number's units are of: 1 for an integer,
/// 10^-[`BOUNDED_FRACTION_DIGITS`] for a number.
pub fn unit_digits(integer: bool) -> u32 {
    if integer {
        0
    } else {
        BOUNDED_FRACTION_DIGITS
    }
}

/// Any JSON value.
pub(super) const ANY: NodeId = 0;
/// An object of any keys and values.
pub(super) const ANY_OBJECT: NodeId = 1;
/// An array of any values.
pub(super) const ANY_ARRAY: NodeId = 2;
/// `false`, `null` and `true`.
pub(super) const ANY_LITERAL: NodeId = 3;

/// What a value may be.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Node {
    /// Any JSON value.
    Any,
    /// A number; `integer`: no fraction and no exponent. `bounds`: the
    /// least and greatest value in units of [`unit`]`(integer)` (a bounded
    /// number is written with no exponent and at most
    /// [`BOUNDED_FRACTION_DIGITS`] fraction digits).
    /// `step`: every value is a multiple of it, in units (`multipleOf`;
    /// 1 without it).
    Number {
        integer: bool,
        bounds: Option<(i64, i64)>,
        step: i64,
    },
    /// A string of `min` to `max` characters.
    String { min: u32, max: u32 },
    /// A string that a `pattern` accepts (its lengths within the pattern's
    /// table): the schema's pattern `id`.
    Pattern { id: u16 },
    /// One of these values, written compactly (`enum`, `const`, `true`...),
    /// in byte order: the values that begin alike are neighbours.
    Literals(Vec<Box<[u8]>>),
    /// An array, `min` to `max` items: the first ones of `prefix`, in order
    /// (`prefixItems`, pydantic's `tuple`), the rest of `items`.
    Array {
        prefix: Box<[NodeId]>,
        items: NodeId,
        min: u32,
        max: u32,
    },
    /// An object of these properties, in this order; `by_name`: their
    /// indices in the byte order of their names.
    Object {
        properties: Vec<Property>,
        by_name: Vec<u16>,
    },
    /// An object of any keys, each value a `values`.
    Map { values: NodeId },
    /// One of these (none of them a union), in the schema's order.
    Union(Vec<NodeId>),
    /// A union of objects told apart by their first property (each
    /// required, named alike, its value one constant of its own): pydantic's
    /// discriminated union, a `tool_choice: "required"` call. Read as one
    /// object: its first property is `head`'s only one (`by_name`: `[0]`),
    /// its value one of the constants (a [`Node::Literals`] node, in byte
    /// order); once that value is written the object goes on as `bodies[i]`
    /// (the `i`-th constant's object), one reading however many there are.
    Tagged {
        head: Vec<Property>,
        by_name: Vec<u16>,
        bodies: Vec<NodeId>,
    },
    /// Another node (a `$ref`; none is left once compiled).
    Ref(NodeId),
}

/// A tagged union's alternative: its constant, as written, and its object.
type Tag = (Box<[u8]>, NodeId);

/// A declared property of an object.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Property {
    /// Its name as JSON writes it, quotes included.
    pub key: Box<[u8]>,
    pub value: NodeId,
    pub required: bool,
}

impl AsRef<[u8]> for Property {
    fn as_ref(&self) -> &[u8] {
        &self.key
    }
}

/// A compiled schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Schema {
    nodes: Vec<Node>,
    /// The `pattern`s of [`Node::Pattern`]s, and vLLM's `regex`.
    patterns: Vec<Pattern>,
    /// The bytes each node's values may begin with ([`Schema::first_bytes`]).
    first: Vec<u128>,
    root: NodeId,
    /// What it was made from.
    source: Source,
}

/// What a schema was made from (what a request said).
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// JSON mode: any object.
    Object,
    /// A JSON Schema document.
    Document(Value),
    /// vLLM's `choice`: the output is exactly one of these texts (not JSON).
    Choice(Vec<String>),
    /// vLLM's `regex`: the output is a text the expression matches whole
    /// (not JSON).
    Regex(String),
}

/// Why a schema was refused: what, and where (a JSON pointer into it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaError {
    pub at: String,
    pub message: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.at.is_empty() { "/" } else { &self.at };
        write!(f, "{} (at {at})", self.message)
    }
}

impl Schema {
    /// JSON mode's schema: any object.
    pub fn object() -> Schema {
        let mut schema = Schema {
            root: ANY_OBJECT,
            ..Schema::base()
        };
        schema.index_first_bytes();
        schema
    }

    /// The nodes every schema starts with (an unconstrained value's).
    fn base() -> Schema {
        let literals = [&b"false"[..], b"null", b"true"];
        Schema {
            nodes: vec![
                Node::Any,
                Node::Map { values: ANY },
                Node::Array {
                    prefix: Box::new([]),
                    items: ANY,
                    min: 0,
                    max: u32::MAX,
                },
                Node::Literals(literals.iter().map(|&l| l.into()).collect()),
            ],
            patterns: Vec::new(),
            first: Vec::new(),
            root: ANY,
            source: Source::Object,
        }
    }

    /// Compiles `document`.
    pub fn compile(document: &Value) -> Result<Schema, SchemaError> {
        let mut budget = AUTOMATA_BYTES_MAX;
        Schema::compile_within(document, &mut budget)
    }

    /// Compiles `document`, its patterns' automata taking from `budget`
    /// (bytes): schemas compiled for one request share one
    /// [`AUTOMATA_BYTES_MAX`].
    pub fn compile_within(document: &Value, budget: &mut usize) -> Result<Schema, SchemaError> {
        Schema::compile_scaled(document, budget, 1)
    }

    /// Compiles `document`, the calls of a request's tools (each tool's
    /// parameters compiled alone first, within a schema's bounds): its
    /// nodes and literal bytes may be [`TOGETHER`] times a schema's.
    pub fn compile_together(document: &Value) -> Result<Schema, SchemaError> {
        let mut budget = AUTOMATA_BYTES_MAX;
        Schema::compile_scaled(document, &mut budget, TOGETHER)
    }

    fn compile_scaled(
        document: &Value,
        budget: &mut usize,
        scale: usize,
    ) -> Result<Schema, SchemaError> {
        let mut compiler = Compiler {
            document,
            schema: Schema::base(),
            refs: HashMap::new(),
            refs_order: Vec::new(),
            nodes_max: NODES_MAX * scale,
            literal_bytes: 0,
            literal_bytes_max: LITERAL_BYTES_MAX * scale,
            automata_bytes_left: *budget,
            depth: 0,
            one_of: Vec::new(),
            beyond_automata: false,
        };
        let root = compiler.node(document, "");
        *budget = compiler.automata_bytes_left;
        let root = root?;
        let mut schema = compiler.schema;
        schema.root = root;
        schema.resolve_refs()?;
        schema.flatten_unions()?;
        schema.tag_unions();
        for (id, at) in compiler.one_of {
            schema.check_exclusive(id, &at)?;
        }
        schema.index_first_bytes();
        schema.source = Source::Document(document.clone());
        Ok(schema)
    }

    /// vLLM's `choice`: the output is exactly one of `choices`, as written
    /// (no quotes, no whitespace around), and ends once no other could
    /// follow. Bounded as an `enum` is.
    pub fn choice(choices: &[String]) -> Result<Schema, SchemaError> {
        if choices.is_empty() || choices.iter().any(String::is_empty) {
            return Err(error("", "choice must list one or more non-empty texts"));
        }
        if choices.len() > ENUM_VALUES_MAX {
            return Err(error("", format!("more than {ENUM_VALUES_MAX} choices")));
        }
        if choices.iter().map(String::len).sum::<usize>() > LITERAL_BYTES_MAX {
            return Err(error(
                "",
                format!("more than {LITERAL_BYTES_MAX} bytes of choices"),
            ));
        }
        let mut values: Vec<Box<[u8]>> = choices.iter().map(|c| c.as_bytes().into()).collect();
        values.sort();
        values.dedup();
        let schema = Schema::base();
        Ok(schema.text(Node::Literals(values), Source::Choice(choices.to_vec())))
    }

    /// vLLM's `regex`: the output is a text `regex` matches whole (written
    /// as is: not JSON), and ends once nothing could follow. Its text holds
    /// printable ASCII, tab and newline ([`super::pattern`]).
    pub fn regex(regex: &str) -> Result<Schema, SchemaError> {
        let mut budget = AUTOMATA_BYTES_MAX;
        let pattern = Pattern::compile(regex, true, (0, u32::MAX), &mut budget)
            .map_err(|message| error("", message))?;
        let mut schema = Schema::base();
        schema.patterns.push(pattern);
        Ok(schema.text(Node::Pattern { id: 0 }, Source::Regex(regex.to_string())))
    }

    /// The schema of a text output (not JSON): `root`, made from `source`.
    fn text(mut self, root: Node, source: Source) -> Schema {
        self.nodes.push(root);
        self.root = self.nodes.len() as NodeId - 1;
        self.index_first_bytes();
        self.source = source;
        self
    }

    /// Notes each node's first bytes ([`Schema::first_bytes`]).
    fn index_first_bytes(&mut self) {
        self.first = (0..self.nodes.len() as NodeId)
            .map(|id| self.first_of(id))
            .collect();
    }

    /// What it was made from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Whether it is a `choice` (its output is text, not JSON).
    pub(super) fn is_choice(&self) -> bool {
        matches!(self.source, Source::Choice(_))
    }

    /// Whether its output is text, not JSON (a `choice` or a `regex`).
    pub(super) fn is_text(&self) -> bool {
        matches!(self.source, Source::Choice(_) | Source::Regex(_))
    }

    /// Pattern `id` of a [`Node::Pattern`].
    pub(super) fn pattern(&self, id: u16) -> &Pattern {
        &self.patterns[usize::from(id)]
    }

    pub(super) fn root(&self) -> NodeId {
        self.root
    }

    pub(super) fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Points every reference at the node its `$ref` chain ends on.
    fn resolve_refs(&mut self) -> Result<(), SchemaError> {
        let target = |nodes: &[Node], mut id: NodeId| {
            for _ in 0..=nodes.len() {
                match nodes[id as usize] {
                    Node::Ref(next) => id = next,
                    _ => return Ok(id),
                }
            }
            Err(SchemaError {
                at: String::new(),
                message: "a $ref chain that never reaches a schema".into(),
            })
        };
        let resolved: Vec<NodeId> = (0..self.nodes.len() as NodeId)
            .map(|id| target(&self.nodes, id))
            .collect::<Result<_, _>>()?;
        let r = |id: &mut NodeId| *id = resolved[*id as usize];
        r(&mut self.root);
        for node in &mut self.nodes {
            match node {
                Node::Array { items, prefix, .. } => {
                    r(items);
                    prefix.iter_mut().for_each(r);
                }
                Node::Map { values } => r(values),
                Node::Object { properties, .. } => {
                    properties.iter_mut().for_each(|p| r(&mut p.value))
                }
                Node::Union(alternatives) => alternatives.iter_mut().for_each(r),
                // (Made after references are resolved.)
                Node::Tagged { .. } => {}
                Node::Ref(id) => r(id),
                Node::Any
                | Node::Number { .. }
                | Node::String { .. }
                | Node::Pattern { .. }
                | Node::Literals(_) => {}
            }
        }
        Ok(())
    }

    /// Replaces each union's alternatives by the non-union nodes they
    /// reach (alternatives that begin alike are read side by side: see
    /// [`super::json`]).
    fn flatten_unions(&mut self) -> Result<(), SchemaError> {
        for id in 0..self.nodes.len() {
            if !matches!(self.nodes[id], Node::Union(_)) {
                continue;
            }
            let mut leaves = Vec::new();
            self.leaves(id as NodeId, &mut Vec::new(), &mut leaves)?;
            self.nodes[id] = Node::Union(leaves);
        }
        Ok(())
    }

    /// Makes the objects of each union that are told apart by their first
    /// property one [`Node::Tagged`] (see there; each adds at most two
    /// nodes, so a schema holds at most three times its bound of nodes):
    /// then such a value is one reading of the output from its `{`, where
    /// side by side the alternatives would be as many readings as there are
    /// (more than [`super::json::READINGS_MAX`] could not all be followed).
    /// The union's other alternatives stay (`Optional[A | B]`'s null).
    /// Accepts exactly the values the union does.
    fn tag_unions(&mut self) {
        for id in 0..self.nodes.len() {
            let Node::Union(leaves) = &self.nodes[id] else {
                continue;
            };
            // Its objects of a constant first property named as the first
            // such object's (the others stay alternatives as they are).
            let mut key: Option<&[u8]> = None;
            let mut tagged: Vec<Tag> = Vec::new();
            for &leaf in leaves {
                if let Some((name, value)) = self.tag_of(leaf) {
                    if *key.get_or_insert(name) == name {
                        tagged.push((value.into(), leaf));
                    }
                }
            }
            tagged.sort();
            let distinct = tagged.windows(2).all(|w| w[0].0 != w[1].0);
            let (Some(key), true, true) = (key, tagged.len() >= 2, distinct) else {
                continue;
            };
            let key: Box<[u8]> = key.into();
            let (values, bodies): (Vec<Box<[u8]>>, Vec<NodeId>) = tagged.into_iter().unzip();
            // The tagged node where its first object was, in the schema's
            // order; in place of the union where it is all of it.
            let mut alternatives: Vec<NodeId> = Vec::with_capacity(leaves.len() - bodies.len() + 1);
            let mut at = None;
            for &leaf in leaves {
                if !bodies.contains(&leaf) {
                    alternatives.push(leaf);
                } else if at.is_none() {
                    at = Some(alternatives.len());
                    alternatives.push(leaf);
                }
            }
            self.nodes.push(Node::Literals(values));
            let node = Node::Tagged {
                head: vec![Property {
                    key,
                    value: self.nodes.len() as NodeId - 1,
                    required: true,
                }],
                by_name: vec![0],
                bodies,
            };
            if alternatives.len() == 1 {
                self.nodes[id] = node;
            } else {
                self.nodes.push(node);
                alternatives[at.expect("a tagged leaf")] = self.nodes.len() as NodeId - 1;
                self.nodes[id] = Node::Union(alternatives);
            }
        }
    }

    /// Where node `id` is an object whose first property is required and
    /// one constant: that property's name and the constant, as written.
    fn tag_of(&self, id: NodeId) -> Option<(&[u8], &[u8])> {
        let Node::Object { properties, .. } = self.node(id) else {
            return None;
        };
        let first = properties.first().filter(|p| p.required)?;
        match self.node(first.value) {
            Node::Literals(values) if values.len() == 1 => Some((&first.key, &values[0])),
            _ => None,
        }
    }

    /// A `oneOf`'s alternatives must begin differently, or be told apart by
    /// their first property ([`Node::Tagged`]): then the output fits
    /// exactly one of them.
    fn check_exclusive(&self, id: NodeId, at: &str) -> Result<(), SchemaError> {
        let Node::Union(leaves) = self.node(id) else {
            return Ok(());
        };
        for (i, &a) in leaves.iter().enumerate() {
            for &b in &leaves[..i] {
                if self.first_of(a) & self.first_of(b) != 0 {
                    return Err(error(
                        at,
                        "oneOf alternatives that may begin alike (two of one type) are not \
                         supported (anyOf's are)",
                    ));
                }
            }
        }
        Ok(())
    }

    fn leaves(
        &self,
        id: NodeId,
        visiting: &mut Vec<NodeId>,
        out: &mut Vec<NodeId>,
    ) -> Result<(), SchemaError> {
        let Node::Union(alternatives) = self.node(id) else {
            if !out.contains(&id) {
                out.push(id);
            }
            return Ok(());
        };
        if visiting.contains(&id) {
            return Err(SchemaError {
                at: String::new(),
                message: "an anyOf that contains itself".into(),
            });
        }
        visiting.push(id);
        for &alternative in alternatives {
            self.leaves(alternative, visiting, out)?;
        }
        visiting.pop();
        Ok(())
    }

    /// The bytes a value of node `id` may begin with: bit `b` for byte `b`
    /// (every first byte of a JSON value is ASCII).
    pub(super) fn first_bytes(&self, id: NodeId) -> u128 {
        self.first[id as usize]
    }

    fn first_of(&self, id: NodeId) -> u128 {
        let bit = |b: u8| 1u128 << (b & 0x7F);
        let digits = (b'0'..=b'9').fold(bit(b'-'), |bits, b| bits | bit(b));
        match self.node(id) {
            Node::Any => {
                bit(b'{') | bit(b'[') | bit(b'"') | bit(b't') | bit(b'f') | bit(b'n') | digits
            }
            Node::Number { .. } => digits,
            Node::String { .. } | Node::Pattern { .. } => bit(b'"'),
            Node::Literals(values) => values.iter().fold(0, |bits, v| bits | bit(v[0])),
            Node::Array { .. } => bit(b'['),
            Node::Object { .. } | Node::Map { .. } | Node::Tagged { .. } => bit(b'{'),
            // (Flattened: its alternatives are no unions.)
            Node::Union(alternatives) => alternatives
                .iter()
                .fold(0, |bits, &a| bits | self.first_of(a)),
            Node::Ref(_) => u128::MAX,
        }
    }
}

/// Keywords that say nothing of what a value may be.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "format",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    // OpenAPI's (pydantic writes it beside a discriminated union's oneOf):
    // a hint where to look; the alternatives' constants are what holds.
    "discriminator",
    "deprecated",
    "readOnly",
    "writeOnly",
    "contentEncoding",
    "contentMediaType",
];

/// Keywords this compiler reads.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
];

/// Keywords that constrain values of one type only: an untyped schema
/// with one of them would accept any value but constrain that type's.
const TYPED_KEYWORDS: &[&str] = &[
    "required",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
];

/// `s`'s `multipleOf`, in units of [`unit_digits`]`(integer)`: a whole
/// number (a fractional one is refused: validators disagree on them, as
/// Python's jsonschema finds 0.9 no multiple of 0.3).
fn multiple_of(
    s: &serde_json::Map<String, Value>,
    integer: bool,
    at: &str,
) -> Result<Option<i64>, SchemaError> {
    let Some(m) = s.get("multipleOf") else {
        return Ok(None);
    };
    let units = 10i64.pow(unit_digits(integer));
    match m.as_f64() {
        Some(m) if m >= 1.0 && m.fract() == 0.0 && m * (units as f64) <= BOUNDED_UNITS_MAX as f64 => {
            Ok(Some(m as i64 * units))
        }
        _ => Err(error(
            at,
            "multipleOf must be a whole number from 1 (a fractional one is not supported by this server)",
        )),
    }
}

/// The least and greatest value, in units of [`unit_digits`]`(integer)`,
/// that `s`'s `minimum`, `maximum`, `exclusiveMinimum` and
/// `exclusiveMaximum` allow (None without any of them); refused where none
/// is within [`BOUNDED_UNITS_MAX`] units.
fn number_bounds(
    s: &serde_json::Map<String, Value>,
    integer: bool,
    at: &str,
) -> Result<Option<(i64, i64)>, SchemaError> {
    let bound = |key: &str| -> Result<Option<f64>, SchemaError> {
        match s.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(Value::Bool(_)) if key.starts_with("exclusive") => Err(error(
                at,
                format!("{key} must be a number (JSON Schema 2020-12), not a boolean"),
            )),
            Some(_) => Err(error(at, format!("{key} must be a number"))),
        }
    };
    let (minimum, maximum) = (bound("minimum")?, bound("maximum")?);
    let (above, below) = (bound("exclusiveMinimum")?, bound("exclusiveMaximum")?);
    if [minimum, maximum, above, below].iter().all(Option::is_none) {
        return Ok(None);
    }
    let scale = 10f64.powi(unit_digits(integer) as i32);
    // A count of units is the double that count / 10^digits is; both
    // tests are monotone in it, so the least and greatest passing counts
    // bound all passing ones.
    let value = |u: i64| u as f64 / scale;
    let low_ok =
        |u: i64| minimum.is_none_or(|m| value(u) >= m) && above.is_none_or(|m| value(u) > m);
    let high_ok =
        |u: i64| maximum.is_none_or(|m| value(u) <= m) && below.is_none_or(|m| value(u) < m);
    let (lo_max, hi_min) = (BOUNDED_UNITS_MAX + 1, -BOUNDED_UNITS_MAX - 1);
    let estimate = |m: Option<f64>, round: fn(f64) -> f64, default: i64| {
        m.map_or(default, |m| {
            (round(m * scale) as i64).clamp(-BOUNDED_UNITS_MAX - 1, BOUNDED_UNITS_MAX + 1)
        })
    };
    // The least passing count from an estimate: down while the one below
    // passes, up while this one does not (a few steps: the estimate is
    // within rounding of it).
    let tighter = |a: Option<f64>, b: Option<f64>, pick: fn(f64, f64) -> f64| match (a, b) {
        (Some(a), Some(b)) => Some(pick(a, b)),
        (a, b) => a.or(b),
    };
    let mut lo = estimate(
        tighter(minimum, above, f64::max),
        f64::ceil,
        -BOUNDED_UNITS_MAX,
    );
    while lo > -BOUNDED_UNITS_MAX && low_ok(lo - 1) {
        lo -= 1;
    }
    while lo < lo_max && !low_ok(lo) {
        lo += 1;
    }
    let mut hi = estimate(
        tighter(maximum, below, f64::min),
        f64::floor,
        BOUNDED_UNITS_MAX,
    );
    while hi < BOUNDED_UNITS_MAX && high_ok(hi + 1) {
        hi += 1;
    }
    while hi > hi_min && !high_ok(hi) {
        hi -= 1;
    }
    let (lo, hi) = (lo.max(-BOUNDED_UNITS_MAX), hi.min(BOUNDED_UNITS_MAX));
    if lo > hi {
        let what = if integer { "integer" } else { "number" };
        return Err(error(
            at,
            format!(
                "no {what} of at most {BOUNDED_FRACTION_DIGITS} fraction digits and below 2^53 units is within its bounds"
            ),
        ));
    }
    Ok(Some((lo, hi)))
}

/// The values of `s`'s `enum` or `const` (`key`) that its other keywords
/// accept: the output is one of them, so a value they refuse must not be
/// written (a string must match `pattern`, `s`'s compiled). Refused where
/// none is left, or beside a keyword of objects' or arrays' contents (not
/// checked here).
fn kept_beside(
    s: &serde_json::Map<String, Value>,
    values: &[Value],
    key: &str,
    at: &str,
    pattern: Option<Pattern>,
) -> Result<Vec<Value>, SchemaError> {
    for other in [
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
    ] {
        if s.contains_key(other) {
            return Err(error(
                at,
                format!("{key} beside {other} is not supported by this server"),
            ));
        }
    }
    let number = |v: &Value, bound: &str, pass: fn(f64, f64) -> bool| match (
        v.as_f64(),
        s.get(bound).and_then(Value::as_f64),
    ) {
        (Some(v), Some(bound)) => pass(v, bound),
        _ => true,
    };
    let count = |n: usize, bound: &str, pass: fn(u64, u64) -> bool| {
        s.get(bound)
            .and_then(Value::as_u64)
            .is_none_or(|bound| pass(n as u64, bound))
    };
    let typed = |v: &Value, t: &str| match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "number" => v.is_number(),
        "integer" => v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        _ => false,
    };
    let accepts = |v: &Value| {
        let type_ok = match s.get("type") {
            None => true,
            Some(Value::String(t)) => typed(v, t),
            Some(Value::Array(ts)) => ts.iter().any(|t| t.as_str().is_some_and(|t| typed(v, t))),
            Some(_) => false,
        };
        let in_enum = key != "const"
            || s.get("enum")
                .and_then(Value::as_array)
                .is_none_or(|e| e.contains(v));
        let chars = v.as_str().map(|t| t.chars().count());
        let items = v.as_array().map(Vec::len);
        type_ok
            && in_enum
            && chars.is_none_or(|n| count(n, "minLength", |n, b| n >= b))
            && chars.is_none_or(|n| count(n, "maxLength", |n, b| n <= b))
            && items.is_none_or(|n| count(n, "minItems", |n, b| n >= b))
            && items.is_none_or(|n| count(n, "maxItems", |n, b| n <= b))
            && number(v, "minimum", |v, b| v >= b)
            && number(v, "maximum", |v, b| v <= b)
            && number(v, "exclusiveMinimum", |v, b| v > b)
            && number(v, "exclusiveMaximum", |v, b| v < b)
            && number(v, "multipleOf", |v, b| (v / b).fract() == 0.0)
            && v.as_str()
                .is_none_or(|t| pattern.as_ref().is_none_or(|p| p.matches(t)))
    };
    let kept: Vec<Value> = values.iter().filter(|v| accepts(v)).cloned().collect();
    if kept.is_empty() {
        return Err(error(
            at,
            format!("no value of {key} meets the schema's other keywords"),
        ));
    }
    Ok(kept)
}

struct Compiler<'a> {
    document: &'a Value,
    schema: Schema,
    /// Each `$ref` compiled so far, by its pointer, and the pointers in
    /// the order they were.
    refs: HashMap<String, NodeId>,
    refs_order: Vec<String>,
    nodes_max: usize,
    literal_bytes: usize,
    literal_bytes_max: usize,
    /// What is left of the budget for the patterns' automata.
    automata_bytes_left: usize,
    /// Schemas being compiled, each within the one before.
    depth: usize,
    /// The `oneOf` unions, and where.
    one_of: Vec<(NodeId, String)>,
    /// Set where the last error was a pattern no automaton holds.
    beyond_automata: bool,
}

fn error(at: &str, message: impl Into<String>) -> SchemaError {
    SchemaError {
        at: at.to_string(),
        message: message.into(),
    }
}

/// How far a [`Compiler`] had come: what [`Compiler::roll_back`] returns to.
struct Mark {
    nodes: usize,
    patterns: usize,
    refs: usize,
    one_of: usize,
}

impl Compiler<'_> {
    fn mark(&self) -> Mark {
        Mark {
            nodes: self.schema.nodes.len(),
            patterns: self.schema.patterns.len(),
            refs: self.refs_order.len(),
            one_of: self.one_of.len(),
        }
    }

    /// Forgets what was compiled since `mark`: its nodes and patterns, and
    /// its references (one left would point at a node no longer there). What
    /// it took of the bounds stays taken.
    fn roll_back(&mut self, mark: Mark) {
        self.schema.nodes.truncate(mark.nodes);
        self.schema.patterns.truncate(mark.patterns);
        for pointer in self.refs_order.drain(mark.refs..) {
            self.refs.remove(&pointer);
        }
        self.one_of.truncate(mark.one_of);
    }

    fn push(&mut self, node: Node, at: &str) -> Result<NodeId, SchemaError> {
        if self.schema.nodes.len() >= self.nodes_max {
            let most = self.nodes_max;
            return Err(error(at, format!("more than {most} schema nodes")));
        }
        self.schema.nodes.push(node);
        Ok(self.schema.nodes.len() as NodeId - 1)
    }

    /// The node of schema `s`, found at pointer `at`.
    fn node(&mut self, s: &Value, at: &str) -> Result<NodeId, SchemaError> {
        if self.depth >= NESTING_MAX {
            return Err(error(
                at,
                format!("schemas nested (or referenced) more than {NESTING_MAX} deep"),
            ));
        }
        self.depth += 1;
        let node = self.node_within(s, at);
        self.depth -= 1;
        node
    }

    fn node_within(&mut self, s: &Value, at: &str) -> Result<NodeId, SchemaError> {
        let s = match s {
            Value::Bool(true) => return Ok(ANY),
            Value::Bool(false) => return Err(error(at, "the schema false accepts no value")),
            Value::Object(s) => s,
            _ => return Err(error(at, "a schema must be an object or a boolean")),
        };
        for key in s.keys() {
            if !KEYWORDS.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
                return Err(error(
                    at,
                    format!("the keyword {key:?} is not supported by this server"),
                ));
            }
        }
        // The combinators stand alone: with siblings they would intersect.
        let constraining = |except: &str| {
            s.keys()
                .filter(|k| KEYWORDS.contains(&k.as_str()) && k.as_str() != except)
                .cloned()
                .collect::<Vec<_>>()
        };
        for combinator in ["$ref", "anyOf", "oneOf", "allOf"] {
            if s.contains_key(combinator) {
                let others = constraining(combinator);
                if !others.is_empty() {
                    return Err(error(
                        at,
                        format!("{combinator} beside {others:?} is not supported (it would intersect them)"),
                    ));
                }
            }
        }
        if let Some(reference) = s.get("$ref") {
            return self.reference(reference, at);
        }
        for combinator in ["anyOf", "oneOf"] {
            if let Some(alternatives) = s.get(combinator) {
                let at = format!("{at}/{combinator}");
                let alternatives = alternatives
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| error(&at, "must be a non-empty array of schemas"))?;
                let mut ids = Vec::with_capacity(alternatives.len());
                let mut left_out = None;
                for (i, alternative) in alternatives.iter().enumerate() {
                    let mark = self.mark();
                    self.beyond_automata = false;
                    match self.node(alternative, &format!("{at}/{i}")) {
                        Ok(id) => ids.push(id),
                        // An anyOf's alternative whose pattern no automaton
                        // holds (pydantic's Decimal as a string) is left out
                        // where another is not: every output is still an
                        // instance, never of that alternative. (Not a
                        // oneOf's: an output of another might be one of its
                        // instances too.)
                        Err(e) if combinator == "anyOf" && self.beyond_automata => {
                            self.beyond_automata = false;
                            self.roll_back(mark);
                            left_out.get_or_insert(e);
                        }
                        Err(e) => return Err(e),
                    }
                }
                if let (true, Some(e)) = (ids.is_empty(), left_out) {
                    return Err(e);
                }
                let id = self.push(Node::Union(ids), &at)?;
                if combinator == "oneOf" {
                    self.one_of.push((id, at));
                }
                return Ok(id);
            }
        }
        if let Some(all) = s.get("allOf") {
            let at = format!("{at}/allOf");
            return match all.as_array().map(Vec::as_slice) {
                Some([one]) => self.node(one, &format!("{at}/0")),
                _ => Err(error(&at, "only an allOf of one schema is supported")),
            };
        }
        if let Some(value) = s.get("const") {
            let pattern = self.pattern(s, (0, u32::MAX), at)?;
            let at = format!("{at}/const");
            let values = kept_beside(s, std::slice::from_ref(value), "const", &at, pattern)?;
            return self.literals(&values, &at);
        }
        if let Some(values) = s.get("enum") {
            let pattern = self.pattern(s, (0, u32::MAX), at)?;
            let at = format!("{at}/enum");
            let values = values
                .as_array()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| error(&at, "must be a non-empty array"))?;
            let values = kept_beside(s, values, "enum", &at, pattern)?;
            return self.literals(&values, &at);
        }
        let types: Vec<&str> = match s.get("type") {
            None => {
                // Untyped: what the keywords present imply, else anything.
                if s.contains_key("properties") || s.contains_key("additionalProperties") {
                    vec!["object"]
                } else if s.contains_key("items") || s.contains_key("prefixItems") {
                    vec!["array"]
                } else if let Some(key) = TYPED_KEYWORDS.iter().find(|k| s.contains_key(**k)) {
                    // It would constrain the values of one type among any.
                    return Err(error(
                        at,
                        format!("{key} without a type is not supported by this server (name the type it is for)"),
                    ));
                } else {
                    return Ok(ANY);
                }
            }
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if !ts.is_empty() => ts
                .iter()
                .map(|t| t.as_str().ok_or_else(|| error(at, "type must name types")))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(error(at, "type must be a string or a non-empty array")),
        };
        let mut ids = Vec::with_capacity(types.len());
        for t in types {
            ids.push(self.typed(s, t, at)?);
        }
        match ids.as_slice() {
            [one] => Ok(*one),
            _ => self.push(Node::Union(ids), at),
        }
    }

    /// A node of type `t` with the keywords of `s` that apply to it.
    fn typed(
        &mut self,
        s: &serde_json::Map<String, Value>,
        t: &str,
        at: &str,
    ) -> Result<NodeId, SchemaError> {
        let count = |key: &str| -> Result<Option<u32>, SchemaError> {
            s.get(key)
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| error(at, format!("{key} must be a whole number")))
                })
                .transpose()
        };
        let bounds = |min: &str, max: &str| -> Result<(u32, u32), SchemaError> {
            let (lo, hi) = (count(min)?.unwrap_or(0), count(max)?.unwrap_or(u32::MAX));
            if lo > hi {
                return Err(error(at, format!("{min} is above {max}")));
            }
            Ok((lo, hi))
        };
        let node = match t {
            "null" => return self.literals(&[Value::Null], at),
            "boolean" => return self.literals(&[Value::Bool(false), Value::Bool(true)], at),
            "number" | "integer" => {
                let integer = t == "integer";
                let step = multiple_of(s, integer, at)?;
                let bounds = match (number_bounds(s, integer, at)?, step) {
                    (None, None) => None,
                    (bounds, _) => Some(bounds.unwrap_or((-BOUNDED_UNITS_MAX, BOUNDED_UNITS_MAX))),
                };
                let step = step.unwrap_or(1);
                if let Some((lo, hi)) = bounds {
                    // The least multiple of the step from `lo`.
                    let first = lo.div_euclid(step) * step;
                    let first = if first < lo { first + step } else { first };
                    if first > hi {
                        return Err(error(at, "no multiple of multipleOf is within the bounds"));
                    }
                }
                Node::Number {
                    integer,
                    bounds,
                    step,
                }
            }
            "string" => {
                let (min, max) = bounds("minLength", "maxLength")?;
                match self.pattern(s, (min, max), at)? {
                    None => Node::String { min, max },
                    Some(pattern) => {
                        let id = u16::try_from(self.schema.patterns.len())
                            .map_err(|_| error(at, "too many patterns"))?;
                        self.schema.patterns.push(pattern);
                        Node::Pattern { id }
                    }
                }
            }
            "array" => {
                let (min, mut max) = bounds("minItems", "maxItems")?;
                let prefix = match s.get("prefixItems") {
                    None => Vec::new(),
                    Some(Value::Array(schemas)) => schemas
                        .iter()
                        .enumerate()
                        .map(|(i, p)| self.node(p, &format!("{at}/prefixItems/{i}")))
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(error(at, "prefixItems must be an array of schemas")),
                };
                let items = match s.get("items") {
                    None | Some(Value::Bool(true)) => ANY,
                    // No items past the prefix (pydantic's fixed tuples).
                    Some(Value::Bool(false)) => {
                        max = max.min(u32::try_from(prefix.len()).unwrap_or(u32::MAX));
                        if min > max {
                            return Err(error(
                                at,
                                "minItems is above the items prefixItems and items: false allow",
                            ));
                        }
                        ANY
                    }
                    Some(Value::Array(_)) => {
                        return Err(error(
                            at,
                            "items as an array (draft 2019's tuple) is not supported by this \
                             server (prefixItems is)",
                        ));
                    }
                    Some(items) => self.node(items, &format!("{at}/items"))?,
                };
                Node::Array {
                    prefix: prefix.into(),
                    items,
                    min,
                    max,
                }
            }
            "object" => self.object(s, at)?,
            other => return Err(error(at, format!("unknown type {other:?}"))),
        };
        self.push(node, at)
    }

    fn object(
        &mut self,
        s: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<Node, SchemaError> {
        let additional = s.get("additionalProperties");
        let Some(properties) = s.get("properties") else {
            return Ok(match additional {
                Some(Value::Bool(false)) => Node::Object {
                    properties: Vec::new(),
                    by_name: Vec::new(),
                },
                None | Some(Value::Bool(true)) => Node::Map { values: ANY },
                Some(values) => Node::Map {
                    values: self.node(values, &format!("{at}/additionalProperties"))?,
                },
            });
        };
        let properties = properties
            .as_object()
            .ok_or_else(|| error(at, "properties must be an object"))?;
        if properties.len() > PROPERTIES_MAX {
            return Err(error(at, format!("more than {PROPERTIES_MAX} properties")));
        }
        let required: Vec<&str> = match s.get("required") {
            None => Vec::new(),
            Some(Value::Array(names)) => names
                .iter()
                .map(|n| {
                    n.as_str()
                        .ok_or_else(|| error(at, "required must list property names"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(error(at, "required must be an array")),
        };
        if let Some(missing) = required.iter().find(|r| !properties.contains_key(**r)) {
            return Err(error(
                at,
                format!("required property {missing:?} is not in properties"),
            ));
        }
        let mut compiled = Vec::with_capacity(properties.len());
        for (name, value) in properties {
            self.count_bytes(name.len(), at)?;
            let pointer = format!(
                "{at}/properties/{}",
                name.replace('~', "~0").replace('/', "~1")
            );
            compiled.push(Property {
                key: serde_json::to_vec(name)
                    .expect("a string serializes")
                    .into_boxed_slice(),
                value: self.node(value, &pointer)?,
                required: required.contains(&name.as_str()),
            });
        }
        let mut by_name: Vec<u16> = (0..compiled.len() as u16).collect();
        by_name.sort_by(|&a, &b| {
            compiled[usize::from(a)]
                .key
                .cmp(&compiled[usize::from(b)].key)
        });
        Ok(Node::Object {
            properties: compiled,
            by_name,
        })
    }

    fn literals(&mut self, values: &[Value], at: &str) -> Result<NodeId, SchemaError> {
        if values.len() > ENUM_VALUES_MAX {
            return Err(error(at, format!("more than {ENUM_VALUES_MAX} values")));
        }
        let mut written: Vec<Box<[u8]>> = Vec::with_capacity(values.len());
        for value in values {
            let bytes = serde_json::to_vec(value).expect("a JSON value serializes");
            self.count_bytes(bytes.len(), at)?;
            written.push(bytes.into_boxed_slice());
        }
        written.sort();
        written.dedup();
        self.push(Node::Literals(written), at)
    }

    fn count_bytes(&mut self, bytes: usize, at: &str) -> Result<(), SchemaError> {
        self.literal_bytes += bytes;
        if self.literal_bytes > self.literal_bytes_max {
            let most = self.literal_bytes_max;
            return Err(error(
                at,
                format!("more than {most} bytes of property names and enum and const values"),
            ));
        }
        Ok(())
    }

    /// `s`'s `pattern` and `format` (one of
    /// [`FORMATS`](super::pattern::FORMATS)), where it has
    /// them, compiled together for strings of `lengths` characters.
    fn pattern(
        &mut self,
        s: &serde_json::Map<String, Value>,
        lengths: (u32, u32),
        at: &str,
    ) -> Result<Option<Pattern>, SchemaError> {
        let pattern = match s.get("pattern") {
            None => None,
            Some(regex) => Some(
                regex
                    .as_str()
                    .ok_or_else(|| error(&format!("{at}/pattern"), "must be a string"))?,
            ),
        };
        let format = s.get("format").and_then(Value::as_str);
        let format_regex = format.and_then(format_regex);
        let (regexes, what, at) = match (pattern, &format_regex) {
            (None, None) => return Ok(None),
            (Some(p), None) => (
                vec![(p, false)],
                "the pattern".to_string(),
                format!("{at}/pattern"),
            ),
            (None, Some(f)) => (
                vec![(f.as_str(), true)],
                format!("the format {:?}", format.unwrap_or_default()),
                format!("{at}/format"),
            ),
            (Some(p), Some(f)) => (
                vec![(p, false), (f.as_str(), true)],
                format!(
                    "the pattern and the format {:?}",
                    format.unwrap_or_default()
                ),
                at.to_string(),
            ),
        };
        Pattern::compile_all(&regexes, lengths, &mut self.automata_bytes_left, &what)
            .map(Some)
            .map_err(|message| {
                self.beyond_automata = pattern.is_some_and(beyond_automata);
                error(&at, message)
            })
    }

    /// A `$ref`: a JSON pointer into the document, compiled once.
    fn reference(&mut self, reference: &Value, at: &str) -> Result<NodeId, SchemaError> {
        let at = format!("{at}/$ref");
        let pointer = reference
            .as_str()
            .and_then(|r| r.strip_prefix('#'))
            .ok_or_else(|| {
                error(
                    &at,
                    "only references within the schema (\"#...\") are supported",
                )
            })?;
        if let Some(&id) = self.refs.get(pointer) {
            return Ok(id);
        }
        let target = self
            .document
            .pointer(pointer)
            .ok_or_else(|| error(&at, format!("{pointer:?} is not in the schema")))?;
        // The reference's node first, so that a reference back to it (a
        // recursive type) finds it; it points at the target once compiled.
        let id = self.push(Node::Ref(ANY), &at)?;
        self.refs.insert(pointer.to_string(), id);
        self.refs_order.push(pointer.to_string());
        let target = self.node(target, &format!("#{pointer}"))?;
        self.schema.nodes[id as usize] = Node::Ref(target);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refusal(document: Value) -> String {
        Schema::compile(&document).unwrap_err().to_string()
    }

    fn bounds(document: Value) -> Option<(i64, i64)> {
        let schema = Schema::compile(&document).unwrap();
        match schema.node(schema.root()) {
            Node::Number { bounds, .. } => *bounds,
            other => panic!("{document}: {other:?}"),
        }
    }

    #[test]
    fn an_enums_values_are_those_its_other_keywords_accept() {
        let values = |document: Value| {
            let schema = Schema::compile(&document).unwrap();
            match schema.node(schema.root()) {
                Node::Literals(values) => values
                    .iter()
                    .map(|v| String::from_utf8(v.to_vec()).unwrap())
                    .collect::<Vec<_>>(),
                other => panic!("{document}: {other:?}"),
            }
        };
        // What pydantic writes for a Literal: all kept.
        assert_eq!(
            values(json!({"enum": ["b", "a"], "type": "string"})),
            ["\"a\"", "\"b\""]
        );
        for (document, kept) in [
            (
                json!({"type": "string", "enum": ["a", 1, null]}),
                vec!["\"a\""],
            ),
            (
                json!({"type": ["integer", "null"], "enum": [1, 1.5, 2.0, null, "x"]}),
                vec!["1", "2.0", "null"],
            ),
            (
                json!({"enum": ["ab", "abcd"], "maxLength": 3}),
                vec!["\"ab\""],
            ),
            (
                json!({"enum": [1, 5, 10], "minimum": 2, "exclusiveMaximum": 10}),
                vec!["5"],
            ),
            (json!({"enum": [[1], [1, 2]], "maxItems": 1}), vec!["[1]"]),
            (json!({"const": "a", "enum": ["a", "b"]}), vec!["\"a\""]),
            (
                json!({"enum": [3, 4, 6.0], "multipleOf": 3}),
                vec!["3", "6.0"],
            ),
        ] {
            assert_eq!(values(document.clone()), kept, "{document}");
        }
    }

    #[test]
    fn number_bounds_are_the_least_and_greatest_value_in_units() {
        let u = BOUNDED_UNITS_MAX;
        // Integers: whole units; fractional and exclusive bounds round in.
        for (document, want) in [
            (json!({"type": "integer"}), None),
            (json!({"type": "integer", "minimum": 0}), Some((0, u))),
            (json!({"type": "integer", "maximum": -3}), Some((-u, -3))),
            (
                json!({"type": "integer", "minimum": 1.5, "maximum": 9.99}),
                Some((2, 9)),
            ),
            (
                json!({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
                Some((1, 9)),
            ),
            // The tighter of both forms.
            (
                json!({"type": "integer", "minimum": 3, "exclusiveMinimum": 5,
                       "maximum": 7, "exclusiveMaximum": 100}),
                Some((6, 7)),
            ),
            (json!({"type": "integer", "minimum": -1e300}), Some((-u, u))),
            // Numbers: units of 10^-6.
            (
                json!({"type": "number", "minimum": 0, "maximum": 1}),
                Some((0, 1_000_000)),
            ),
            (
                json!({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
                Some((1, 999_999)),
            ),
            (
                json!({"type": "number", "minimum": -2.5, "maximum": 0.000001}),
                Some((-2_500_000, 1)),
            ),
            // 0.1 is a double a little above a tenth: 100000 units is the
            // double 0.1, which meets it, as a validator reading "0.1" finds.
            (
                json!({"type": "number", "minimum": 0.1}),
                Some((100_000, u)),
            ),
            (
                json!({"type": "number", "exclusiveMaximum": 0.3}),
                Some((-u, 299_999)),
            ),
        ] {
            assert_eq!(bounds(document.clone()), want, "{document}");
        }
        // Each bound is exactly where a double comparison flips.
        for (m, exclusive) in [
            (0.1, false),
            (0.3, true),
            (123.456789, false),
            (-7.25, true),
        ] {
            let key = if exclusive {
                "exclusiveMinimum"
            } else {
                "minimum"
            };
            let (lo, _) = bounds(json!({"type": "number", key: m})).unwrap();
            let value = |u: i64| u as f64 / 1e6;
            let passes = |u: i64| {
                if exclusive {
                    value(u) > m
                } else {
                    value(u) >= m
                }
            };
            assert!(passes(lo) && !passes(lo - 1), "{key} {m}: {lo}");
        }
    }

    #[test]
    fn refuses_what_it_would_not_enforce_naming_the_keyword() {
        for (document, says) in [
            (json!({"type": "array", "uniqueItems": true}), "\"uniqueItems\""),
            (
                json!({"type": "string", "pattern": "(?=a)"}),
                "look-around, including look-ahead and look-behind, is not supported, at its byte 0 (at /pattern)",
            ),
            (json!({"type": "string", "pattern": 5}), "must be a string"),
            (json!({"pattern": "a"}), "pattern without a type"),
            (
                json!({"type": "array", "prefixItems": [{}], "items": false, "minItems": 2}),
                "minItems is above",
            ),
            (json!({"type": "array", "prefixItems": {}}), "prefixItems must be an array"),
            (
                json!({"enum": [[1]], "prefixItems": [{}]}),
                "enum beside prefixItems",
            ),
            (
                json!({"type": "string", "format": "date", "maxLength": 9}),
                "no text of printable ASCII within the string's minLength and maxLength matches the format \"date\" (at /format)",
            ),
            (
                json!({"type": "string", "pattern": "^ab$", "maxLength": 1}),
                "within the string's minLength and maxLength",
            ),
            (
                json!({"type": "string", "enum": ["ab", "cd"], "pattern": "^x"}),
                "no value of enum",
            ),
            (
                json!({"type": "number", "multipleOf": 0.5}),
                "multipleOf must be a whole number",
            ),
            (
                json!({"type": "integer", "multipleOf": 0}),
                "multipleOf must",
            ),
            (
                json!({"type": "integer", "multipleOf": "2"}),
                "multipleOf must",
            ),
            (
                json!({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}),
                "no multiple",
            ),
            (json!({"multipleOf": 2}), "multipleOf without a type"),
            // An enum or const none of whose values the rest accepts.
            (
                json!({"type": "string", "enum": [1, 2]}),
                "no value of enum",
            ),
            (json!({"const": "abc", "maxLength": 2}), "no value of const"),
            (json!({"const": "a", "enum": ["b"]}), "no value of const"),
            (
                json!({"enum": [{"a": 1}], "required": ["a"]}),
                "enum beside required",
            ),
            // Type-specific keywords in an untyped schema.
            (json!({"minimum": 0}), "minimum without a type"),
            (json!({"maxLength": 3}), "maxLength without a type"),
            (json!({"required": ["a"]}), "required without a type"),
            // Bounds no number meets, or of the wrong form.
            (
                json!({"type": "integer", "minimum": 2, "maximum": 1}),
                "within its bounds",
            ),
            (
                json!({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}),
                "within its bounds",
            ),
            (
                json!({"type": "number", "minimum": 1e300}),
                "within its bounds",
            ),
            (
                json!({"type": "number", "minimum": 0.1000001, "maximum": 0.1000009}),
                "within its bounds",
            ),
            (
                json!({"type": "number", "exclusiveMinimum": true}),
                "not a boolean",
            ),
            (
                json!({"type": "number", "maximum": "1"}),
                "must be a number",
            ),
            (
                json!({"type": "array", "uniqueItems": true}),
                "\"uniqueItems\"",
            ),
            (
                json!({"type": "array", "contains": {"type": "integer"}}),
                "\"contains\"",
            ),
            (json!({"type": "array", "items": [{}]}), "tuple"),
            (json!({"type": "date"}), "unknown type"),
            (json!(false), "accepts no value"),
            (json!(3), "object or a boolean"),
            (
                json!({"type": "string", "minLength": 3, "maxLength": 2}),
                "above",
            ),
            (json!({"type": "string", "maxLength": -1}), "whole number"),
            (json!({"enum": []}), "non-empty"),
            (json!({"$ref": "#/$defs/missing"}), "not in the schema"),
            (
                json!({"$ref": "https://example.com/s.json"}),
                "within the schema",
            ),
            (json!({"$ref": "#"}), "never reaches"),
            (json!({"$ref": "#/$defs/a", "type": "string"}), "intersect"),
            (json!({"allOf": [{}, {}]}), "allOf of one"),
            (
                json!({"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
                "contains itself",
            ),
            (
                json!({"type": "object", "properties": {"a": {}}, "required": ["b"]}),
                "\"b\" is not in properties",
            ),
        ] {
            let message = refusal(document.clone());
            assert!(message.contains(says), "{document}: {message}");
        }
        // The bounds on a tenant's input.
        let many: serde_json::Map<String, Value> = (0..=PROPERTIES_MAX)
            .map(|i| (format!("p{i}"), json!({})))
            .collect();
        assert!(refusal(json!({"properties": many})).contains("properties"));
        let values: Vec<u32> = (0..=ENUM_VALUES_MAX as u32).collect();
        assert!(refusal(json!({"enum": values})).contains("values"));
        let long = "x".repeat(LITERAL_BYTES_MAX);
        assert!(refusal(json!({"const": long})).contains("bytes"));
        let deep = (0..NESTING_MAX).fold(json!({}), |s, _| json!({"items": s}));
        assert!(refusal(deep).contains("deep"));
        // A chain of references nests as deep as it is long.
        let chain: serde_json::Map<String, Value> = (0..NESTING_MAX)
            .map(|i| {
                (
                    format!("a{i}"),
                    json!({"$ref": format!("#/$defs/a{}", i + 1)}),
                )
            })
            .collect();
        assert!(refusal(json!({"$defs": chain, "$ref": "#/$defs/a0"})).contains("deep"));
        let wide: serde_json::Map<String, Value> = (0..PROPERTIES_MAX)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        let wide = json!({"type": "object", "properties": wide});
        let nodes: serde_json::Map<String, Value> =
            (0..5).map(|i| (format!("o{i}"), wide.clone())).collect();
        assert!(refusal(json!({"properties": nodes})).contains("nodes"));
    }

    #[test]
    fn an_any_ofs_alternative_beyond_automata_is_left_out_where_another_remains() {
        // What the OpenAI client sends for pydantic's Decimal fields (plain,
        // and with max_digits=6, decimal_places=2): a number, or a string
        // whose pattern needs lookahead.
        let decimal = json!({
            "properties": {
                "price": {"anyOf": [{"type": "number"},
                                    {"pattern": "^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$", "type": "string"}]},
                "amount": {"anyOf": [{"type": "number"},
                                     {"pattern": "^(?!^[-+.]*$)[+-]?0*(?:\\d{0,4}|(?=[\\d.]{1,7}0*$)\\d{0,4}\\.\\d{0,2}0*$)",
                                      "type": "string"}]}
            },
            "required": ["price", "amount"], "type": "object", "additionalProperties": false
        });
        let schema = Schema::compile(&decimal).unwrap();
        let json = crate::engine::json::Json::new(std::sync::Arc::new(schema));
        let takes = |text: &str| {
            let mut json = json.clone();
            json.push(text.as_bytes()) && json.is_done()
        };
        assert!(takes(r#"{"price":12.5,"amount":-3}"#));
        assert!(!takes(r#"{"price":"12.5","amount":1}"#));
        // Alone, or beside alternatives refused for another reason, it is
        // refused as before; so is a oneOf's (an instance of another
        // alternative might be one of its too).
        let lookahead = json!({"type": "string", "pattern": "^(?=a)a+$"});
        for document in [
            json!({"anyOf": [lookahead.clone()]}),
            json!({"anyOf": [lookahead.clone(), {"type": "string", "pattern": "(?<=b)c"}]}),
            json!({"oneOf": [lookahead.clone(), {"type": "integer"}]}),
            lookahead.clone(),
        ] {
            assert!(
                refusal(document.clone()).contains("look-around"),
                "{document}"
            );
        }
        let other =
            refusal(json!({"anyOf": [lookahead.clone(), {"type": "array", "uniqueItems": true}]}));
        assert!(other.contains("uniqueItems"), "{other}");
        // What the left-out alternative compiled is forgotten: a reference
        // made within it is compiled again where it is used elsewhere (and
        // refused there), never the placeholder it left.
        let shared = json!({
            "$defs": {"S": lookahead},
            "properties": {"a": {"anyOf": [{"$ref": "#/$defs/S"}, {"type": "integer"}]},
                           "b": {"$ref": "#/$defs/S"}},
            "type": "object"
        });
        let refused = Schema::compile(&shared).unwrap_err();
        assert!(
            refused.at.starts_with("#/$defs/S") && refused.message.contains("look-around"),
            "{refused}"
        );
        let mut only_a = shared.clone();
        only_a["properties"].as_object_mut().unwrap().remove("b");
        let schema = Schema::compile(&only_a).unwrap();
        let json = crate::engine::json::Json::new(std::sync::Arc::new(schema));
        let mut a = json.clone();
        assert!(a.push(br#"{"a":7}"#) && a.is_done());
        assert!(!json.clone().push(br#"{"a":"aa"#));
    }

    #[test]
    fn a_one_of_compiles_where_its_alternatives_are_told_apart() {
        // What the OpenAI client sends for pydantic's discriminated union
        // (`Field(discriminator="pet_type")`): a oneOf of objects whose
        // first property is a constant of its own, and OpenAPI's
        // `discriminator` beside it.
        let document = json!({
            "$defs": {
                "Cat": {"properties": {"pet_type": {"const": "cat", "title": "Pet Type", "type": "string"},
                                       "meows": {"title": "Meows", "type": "integer"}},
                        "required": ["pet_type", "meows"], "title": "Cat", "type": "object",
                        "additionalProperties": false},
                "Dog": {"properties": {"pet_type": {"const": "dog", "title": "Pet Type", "type": "string"},
                                       "barks": {"title": "Barks", "type": "number"}},
                        "required": ["pet_type", "barks"], "title": "Dog", "type": "object",
                        "additionalProperties": false}
            },
            "properties": {"pet": {"discriminator": {"mapping": {"cat": "#/$defs/Cat", "dog": "#/$defs/Dog"},
                                                     "propertyName": "pet_type"},
                                   "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "title": "Pet"}},
            "required": ["pet"], "title": "Owner", "type": "object", "additionalProperties": false
        });
        let schema = Schema::compile(&document).unwrap();
        let Node::Object { properties, .. } = schema.node(schema.root()) else {
            panic!("{schema:?}");
        };
        assert!(
            matches!(schema.node(properties[0].value), Node::Tagged { bodies, .. } if bodies.len() == 2)
        );
        let json = crate::engine::json::Json::new(std::sync::Arc::new(schema));
        let takes = |text: &str| {
            let mut json = json.clone();
            json.push(text.as_bytes()) && json.is_done()
        };
        assert!(takes(r#"{"pet":{"pet_type":"dog","barks":1.5}}"#));
        assert!(!takes(r#"{"pet":{"pet_type":"dog","meows":1}}"#));
        // Alternatives of one type not told apart by a first constant (or by
        // the same one) are refused: the output could fit both.
        for alike in [
            json!({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                             {"type": "object", "properties": {"b": {"type": "integer"}}}]}),
            json!({"oneOf": [
                {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": 1}, "b": {"type": "integer"}},
                 "required": ["k"]}]}),
            json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
        ] {
            let refusal = refusal(alike.clone());
            assert!(
                refusal.contains("oneOf alternatives that may begin alike"),
                "{alike}: {refusal}"
            );
        }
        assert!(Schema::compile(&json!({"oneOf": [{"type": "string"}, {"type": "null"}]})).is_ok());
    }

    #[test]
    fn compiles_pydantic_shapes_with_refs_and_optionals() {
        // What pydantic 2 writes for a model with a nested model, an
        // Optional field, a list, a Literal and a recursive child list.
        let document = json!({
            "$defs": {
                "Point": {
                    "properties": {"x": {"title": "X", "type": "integer"},
                                   "y": {"title": "Y", "type": "integer"}},
                    "required": ["x", "y"], "title": "Point", "type": "object"
                },
                "Node": {
                    "properties": {"name": {"type": "string"},
                                   "children": {"items": {"$ref": "#/$defs/Node"}, "type": "array"}},
                    "required": ["name", "children"], "type": "object"
                }
            },
            "properties": {
                "name": {"title": "Name", "type": "string", "maxLength": 20},
                "at": {"$ref": "#/$defs/Point"},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
                "tags": {"items": {"type": "string"}, "type": "array", "maxItems": 3},
                "kind": {"enum": ["a", "b"], "type": "string"},
                "tree": {"$ref": "#/$defs/Node"},
                "when": {"type": "string", "format": "date-time"}
            },
            "required": ["name", "at", "kind", "tree"],
            "title": "Thing", "type": "object"
        });
        let schema = Schema::compile(&document).unwrap();
        let Node::Object { properties, .. } = schema.node(schema.root()) else {
            panic!("{schema:?}");
        };
        // In the document's order, not sorted.
        let keys: Vec<&[u8]> = properties.iter().map(|p| &*p.key).collect();
        assert_eq!(
            keys,
            [
                &b"\"name\""[..],
                b"\"at\"",
                b"\"note\"",
                b"\"tags\"",
                b"\"kind\"",
                b"\"tree\"",
                b"\"when\""
            ]
        );
        let required: Vec<bool> = properties.iter().map(|p| p.required).collect();
        assert_eq!(required, [true, true, false, false, true, true, false]);
        // No reference is left: `at` is the Point object itself.
        assert!(
            matches!(schema.node(properties[1].value), Node::Object { properties: p, .. } if p.len() == 2)
        );
        assert!(matches!(schema.node(properties[2].value), Node::Union(a) if a.len() == 2));
        // The recursive child list's items are the Node object again.
        let tree = properties[5].value;
        let Node::Object {
            properties: node, ..
        } = schema.node(tree)
        else {
            panic!()
        };
        assert!(matches!(schema.node(node[1].value), Node::Array { items, .. } if *items == tree));
        assert_eq!(schema.source(), &Source::Document(document));
        // JSON mode's schema: any object.
        assert_eq!(
            Schema::object().node(Schema::object().root()),
            &Node::Map { values: ANY }
        );
    }
}
