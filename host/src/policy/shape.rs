//! A component's shape, checked before it is compiled: compiling is the
//! costliest thing an upload does (a 1.2 MB component of 200,000 empty
//! functions took 21.6 s and 1.3 GB to compile), and its cost follows the
//! functions, code and locals a component holds, which a parse of its
//! sections counts in milliseconds without compiling anything.

use wasmparser::{Encoding, Parser, Payload};

/// Most functions defined in all of a component's core modules together.
pub const FUNCTIONS_MAX: u32 = 10_000;
/// Most bytes of function bodies in all of them.
pub const CODE_BYTES_MAX: u64 = 4 << 20;
/// Most locals one function may declare.
pub const LOCALS_PER_FUNCTION_MAX: u64 = 10_000;
/// Most bytes of data segments in all of them.
pub const DATA_BYTES_MAX: u64 = 4 << 20;
/// Most core modules and components nested in one component.
pub const MODULES_MAX: u32 = 32;

/// What a component holds, as counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// Functions defined (not imported).
    pub functions: u32,
    /// Bytes of their bodies.
    pub code_bytes: u64,
    /// The most locals any one declares.
    pub locals_max: u64,
    /// Bytes of data segments.
    pub data_bytes: u64,
    /// Core modules and components, the outer one included.
    pub modules: u32,
}

/// Counts `bytes`' shape, refusing it (with a message naming the limit) as
/// soon as it passes one, or when it does not parse.
pub fn check(bytes: &[u8]) -> Result<Shape, String> {
    let mut shape = Shape::default();
    let over = |what: &str, max: u64| format!("it has more {what} than a plugin may ({max})");
    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| format!("not a valid WebAssembly component: {e}"))?;
        match payload {
            Payload::Version { encoding, .. } => {
                shape.modules += 1;
                if shape.modules > MODULES_MAX {
                    return Err(over("nested modules", u64::from(MODULES_MAX)));
                }
                if shape.modules == 1 && encoding != Encoding::Component {
                    return Err("a core WebAssembly module, not a component".into());
                }
            }
            Payload::FunctionSection(reader) => {
                shape.functions = shape.functions.saturating_add(reader.count());
                if shape.functions > FUNCTIONS_MAX {
                    return Err(over("functions", u64::from(FUNCTIONS_MAX)));
                }
            }
            Payload::CodeSectionStart { size, .. } => {
                shape.code_bytes += u64::from(size);
                if shape.code_bytes > CODE_BYTES_MAX {
                    return Err(over("bytes of code", CODE_BYTES_MAX));
                }
            }
            Payload::CodeSectionEntry(body) => {
                let mut locals: u64 = 0;
                let reader = body
                    .get_locals_reader()
                    .map_err(|e| format!("not a valid WebAssembly component: {e}"))?;
                for local in reader {
                    let (count, _) =
                        local.map_err(|e| format!("not a valid WebAssembly component: {e}"))?;
                    locals += u64::from(count);
                    if locals > LOCALS_PER_FUNCTION_MAX {
                        return Err(over("locals in one function", LOCALS_PER_FUNCTION_MAX));
                    }
                }
                shape.locals_max = shape.locals_max.max(locals);
            }
            Payload::DataSection(reader) => {
                for data in reader {
                    let data =
                        data.map_err(|e| format!("not a valid WebAssembly component: {e}"))?;
                    shape.data_bytes += data.data.len() as u64;
                    if shape.data_bytes > DATA_BYTES_MAX {
                        return Err(over("bytes of data", DATA_BYTES_MAX));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leb(mut n: u64, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }

    fn section(id: u8, body: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        leb(body.len() as u64, out);
        out.extend_from_slice(body);
    }

    /// A component holding one core module of `functions` empty functions
    /// with `locals` locals each.
    pub fn component(functions: u64, locals: u64) -> Vec<u8> {
        let mut module = b"\0asm\x01\0\0\0".to_vec();
        section(1, &[1, 0x60, 0, 0], &mut module);
        let mut funcs = Vec::new();
        leb(functions, &mut funcs);
        funcs.extend(std::iter::repeat_n(0u8, functions as usize));
        section(3, &funcs, &mut module);
        let mut body = Vec::new();
        if locals > 0 {
            body.push(1);
            leb(locals, &mut body);
            body.push(0x7f);
        } else {
            body.push(0);
        }
        body.push(0x0b);
        let mut code = Vec::new();
        leb(functions, &mut code);
        for _ in 0..functions {
            leb(body.len() as u64, &mut code);
            code.extend_from_slice(&body);
        }
        section(10, &code, &mut module);
        let mut out = b"\0asm\x0d\0\x01\0".to_vec();
        section(1, &module, &mut out);
        out
    }

    #[test]
    fn a_component_within_the_limits_is_counted() {
        let shape = check(&component(100, 3)).unwrap();
        assert_eq!(
            (shape.functions, shape.locals_max, shape.modules),
            (100, 3, 2)
        );
    }

    #[test]
    fn too_many_functions_or_locals_are_refused_before_compiling() {
        let error = check(&component(200_000, 0)).unwrap_err();
        assert!(error.contains("functions"), "{error}");
        let error = check(&component(10, 100_000)).unwrap_err();
        assert!(error.contains("locals"), "{error}");
        let error = check(b"\0asm\x01\0\0\0").unwrap_err();
        assert!(error.contains("core WebAssembly module"), "{error}");
        assert!(check(b"garbage").is_err());
    }
}
