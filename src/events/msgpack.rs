//! A small msgpack reader over a byte slice: exactly what the KV-event decoder needs. It never
//! panics and never allocates on behalf of the input (lengths are checked against the bytes
//! left before anything is reserved), and nesting is bounded, so hostile payloads cost at most
//! their own size.

use rmp::Marker;

/// Deepest nesting [`Reader::skip`] follows (vLLM's payloads nest 4 levels).
const MAX_DEPTH: u32 = 32;

/// Why a payload could not be read. `at` is the byte offset of the offending value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("msgpack: expected {expected} at byte {at}")]
pub struct MsgpackError {
    /// Byte offset in the payload.
    pub at: usize,
    /// What the decoder needed there.
    pub expected: &'static str,
}

/// A cursor over one msgpack document.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A decoded integer: msgpack ints span `i64::MIN..=u64::MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    /// Non-negative.
    U(u64),
    /// Negative.
    I(i64),
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn err(&self, expected: &'static str) -> MsgpackError {
        MsgpackError {
            at: self.pos,
            expected,
        }
    }

    fn take(&mut self, n: usize, expected: &'static str) -> Result<&'a [u8], MsgpackError> {
        if self.remaining() < n {
            return Err(self.err(expected));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn be<const N: usize>(&mut self, expected: &'static str) -> Result<[u8; N], MsgpackError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, expected)?);
        Ok(out)
    }

    fn peek(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    fn marker(&mut self, expected: &'static str) -> Result<Marker, MsgpackError> {
        let m = self.peek().ok_or_else(|| self.err(expected))?;
        self.pos += 1;
        Ok(m)
    }

    /// Consumes a nil and returns true, or returns false and consumes nothing.
    pub(crate) fn nil(&mut self) -> bool {
        if self.peek() == Some(Marker::Null) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// True when the next value is a string.
    pub(crate) fn at_str(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
        )
    }

    /// True when the next value is an integer.
    pub(crate) fn at_int(&self) -> bool {
        matches!(
            self.peek(),
            Some(
                Marker::FixPos(_)
                    | Marker::FixNeg(_)
                    | Marker::U8
                    | Marker::U16
                    | Marker::U32
                    | Marker::U64
                    | Marker::I8
                    | Marker::I16
                    | Marker::I32
                    | Marker::I64
            )
        )
    }

    /// True when the next value is a map.
    pub(crate) fn at_map(&self) -> bool {
        matches!(
            self.peek(),
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
        )
    }

    pub(crate) fn int(&mut self) -> Result<Int, MsgpackError> {
        const E: &str = "an integer";
        let start = self.pos;
        let v = match self.marker(E)? {
            Marker::FixPos(v) => Int::U(u64::from(v)),
            Marker::FixNeg(v) => Int::I(i64::from(v)),
            Marker::U8 => Int::U(u64::from(u8::from_be_bytes(self.be(E)?))),
            Marker::U16 => Int::U(u64::from(u16::from_be_bytes(self.be(E)?))),
            Marker::U32 => Int::U(u64::from(u32::from_be_bytes(self.be(E)?))),
            Marker::U64 => Int::U(u64::from_be_bytes(self.be(E)?)),
            Marker::I8 => Int::I(i64::from(i8::from_be_bytes(self.be(E)?))),
            Marker::I16 => Int::I(i64::from(i16::from_be_bytes(self.be(E)?))),
            Marker::I32 => Int::I(i64::from(i32::from_be_bytes(self.be(E)?))),
            Marker::I64 => Int::I(i64::from_be_bytes(self.be(E)?)),
            _ => {
                self.pos = start;
                return Err(self.err(E));
            }
        };
        // Encoders may use a signed type for a non-negative value.
        Ok(match v {
            Int::I(i) if i >= 0 => Int::U(i as u64),
            v => v,
        })
    }

    /// A non-negative integer that fits `u64`.
    pub(crate) fn uint(&mut self, expected: &'static str) -> Result<u64, MsgpackError> {
        let start = self.pos;
        match self.int() {
            Ok(Int::U(v)) => Ok(v),
            _ => {
                self.pos = start;
                Err(self.err(expected))
            }
        }
    }

    /// A number as `f64` (floats, or integers as some encoders write whole seconds).
    pub(crate) fn f64(&mut self) -> Result<f64, MsgpackError> {
        const E: &str = "a number";
        match self.peek() {
            Some(Marker::F32) => {
                self.pos += 1;
                Ok(f64::from(f32::from_be_bytes(self.be(E)?)))
            }
            Some(Marker::F64) => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be(E)?))
            }
            _ => match self.int().map_err(|_| self.err(E))? {
                Int::U(v) => Ok(v as f64),
                Int::I(v) => Ok(v as f64),
            },
        }
    }

    fn str_len(&mut self) -> Result<Option<usize>, MsgpackError> {
        const E: &str = "a string";
        Ok(Some(match self.peek() {
            Some(Marker::FixStr(n)) => {
                self.pos += 1;
                usize::from(n)
            }
            Some(Marker::Str8) => {
                self.pos += 1;
                usize::from(u8::from_be_bytes(self.be(E)?))
            }
            Some(Marker::Str16) => {
                self.pos += 1;
                usize::from(u16::from_be_bytes(self.be(E)?))
            }
            Some(Marker::Str32) => {
                self.pos += 1;
                u32::from_be_bytes(self.be(E)?) as usize
            }
            _ => return Ok(None),
        }))
    }

    fn bin_len(&mut self) -> Result<Option<usize>, MsgpackError> {
        const E: &str = "bytes";
        Ok(Some(match self.peek() {
            Some(Marker::Bin8) => {
                self.pos += 1;
                usize::from(u8::from_be_bytes(self.be(E)?))
            }
            Some(Marker::Bin16) => {
                self.pos += 1;
                usize::from(u16::from_be_bytes(self.be(E)?))
            }
            Some(Marker::Bin32) => {
                self.pos += 1;
                u32::from_be_bytes(self.be(E)?) as usize
            }
            _ => return Ok(None),
        }))
    }

    /// A UTF-8 string.
    pub(crate) fn str(&mut self) -> Result<&'a str, MsgpackError> {
        let start = self.pos;
        let Some(n) = self.str_len()? else {
            return Err(self.err("a string"));
        };
        let bytes = self.take(n, "string bytes")?;
        std::str::from_utf8(bytes).map_err(|_| MsgpackError {
            at: start,
            expected: "a UTF-8 string",
        })
    }

    /// The bytes of a string or binary value.
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], MsgpackError> {
        let n = match self.str_len()? {
            Some(n) => n,
            None => self
                .bin_len()?
                .ok_or_else(|| self.err("bytes or a string"))?,
        };
        self.take(n, "bytes")
    }

    /// An array header; the length is checked against the bytes left (every element takes at
    /// least one), so a caller may reserve it.
    pub(crate) fn array_len(&mut self) -> Result<usize, MsgpackError> {
        const E: &str = "an array";
        let start = self.pos;
        let n = match self.marker(E)? {
            Marker::FixArray(n) => usize::from(n),
            Marker::Array16 => usize::from(u16::from_be_bytes(self.be(E)?)),
            Marker::Array32 => u32::from_be_bytes(self.be(E)?) as usize,
            _ => {
                self.pos = start;
                return Err(self.err(E));
            }
        };
        if n > self.remaining() {
            self.pos = start;
            return Err(self.err("an array no longer than the payload"));
        }
        Ok(n)
    }

    /// A map header (entries, each a key and a value).
    pub(crate) fn map_len(&mut self) -> Result<usize, MsgpackError> {
        const E: &str = "a map";
        let start = self.pos;
        let n = match self.marker(E)? {
            Marker::FixMap(n) => usize::from(n),
            Marker::Map16 => usize::from(u16::from_be_bytes(self.be(E)?)),
            Marker::Map32 => u32::from_be_bytes(self.be(E)?) as usize,
            _ => {
                self.pos = start;
                return Err(self.err(E));
            }
        };
        if n.saturating_mul(2) > self.remaining() {
            self.pos = start;
            return Err(self.err("a map no longer than the payload"));
        }
        Ok(n)
    }

    /// Skips one value of any type (unknown fields, future extensions).
    pub(crate) fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: u32) -> Result<(), MsgpackError> {
        const E: &str = "a value";
        if depth > MAX_DEPTH {
            return Err(self.err("nesting at most 32 deep"));
        }
        if let Some(n) = self.str_len()? {
            self.take(n, E)?;
            return Ok(());
        }
        if let Some(n) = self.bin_len()? {
            self.take(n, E)?;
            return Ok(());
        }
        let start = self.pos;
        match self.marker(E)? {
            Marker::Null | Marker::True | Marker::False => {}
            Marker::FixPos(_) | Marker::FixNeg(_) => {}
            Marker::U8 | Marker::I8 => {
                self.take(1, E)?;
            }
            Marker::U16 | Marker::I16 => {
                self.take(2, E)?;
            }
            Marker::U32 | Marker::I32 | Marker::F32 => {
                self.take(4, E)?;
            }
            Marker::U64 | Marker::I64 | Marker::F64 => {
                self.take(8, E)?;
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                self.pos = start;
                for _ in 0..self.array_len()? {
                    self.skip_at(depth + 1)?;
                }
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                self.pos = start;
                for _ in 0..self.map_len()? * 2 {
                    self.skip_at(depth + 1)?;
                }
            }
            Marker::FixExt1 => {
                self.take(2, E)?;
            }
            Marker::FixExt2 => {
                self.take(3, E)?;
            }
            Marker::FixExt4 => {
                self.take(5, E)?;
            }
            Marker::FixExt8 => {
                self.take(9, E)?;
            }
            Marker::FixExt16 => {
                self.take(17, E)?;
            }
            Marker::Ext8 => {
                let n = usize::from(u8::from_be_bytes(self.be(E)?));
                self.take(n + 1, E)?;
            }
            Marker::Ext16 => {
                let n = usize::from(u16::from_be_bytes(self.be(E)?));
                self.take(n + 1, E)?;
            }
            Marker::Ext32 => {
                let n = u32::from_be_bytes(self.be(E)?) as usize;
                self.take(n.saturating_add(1), E)?;
            }
            _ => {
                self.pos = start;
                return Err(self.err("a msgpack value (reserved marker)"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc(v: &rmpv::Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn integers_of_every_width_and_sign() {
        let cases: &[(rmpv::Value, Int)] = &[
            (rmpv::Value::from(5u8), Int::U(5)),
            (rmpv::Value::from(200u8), Int::U(200)),
            (rmpv::Value::from(60_000u16), Int::U(60_000)),
            (rmpv::Value::from(4_000_000_000u32), Int::U(4_000_000_000)),
            (rmpv::Value::from(u64::MAX), Int::U(u64::MAX)),
            (rmpv::Value::from(-3i8), Int::I(-3)),
            (rmpv::Value::from(-300i16), Int::I(-300)),
            (rmpv::Value::from(i64::MIN), Int::I(i64::MIN)),
        ];
        for (v, expected) in cases {
            let bytes = enc(v);
            let mut r = Reader::new(&bytes);
            assert_eq!(r.int().unwrap(), *expected, "{v:?}");
            assert_eq!(r.remaining(), 0);
        }
        // A non-negative value written with a signed marker is still unsigned.
        let mut buf = Vec::new();
        rmp::encode::write_i64(&mut buf, 7).unwrap();
        assert_eq!(Reader::new(&buf).int().unwrap(), Int::U(7));
    }

    #[test]
    fn skip_passes_over_nested_values_and_strings_are_checked() {
        let v = rmpv::Value::Map(vec![(
            "a".into(),
            rmpv::Value::Array(vec![
                rmpv::Value::Nil,
                1.5f64.into(),
                rmpv::Value::Binary(vec![1, 2, 3]),
                rmpv::Value::Ext(3, vec![0; 5]),
                rmpv::Value::Map(vec![]),
            ]),
        )]);
        let mut bytes = enc(&v);
        bytes.push(0xc3); // true, after
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.remaining(), 1);
        let bad_utf8 = [0xa2, 0xff, 0xfe];
        assert_eq!(
            Reader::new(&bad_utf8).str().unwrap_err().expected,
            "a UTF-8 string"
        );
    }

    #[test]
    fn lengths_beyond_the_payload_are_refused_before_any_allocation() {
        // Array32 claiming 4 billion elements in a 5-byte payload.
        let bytes = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(Reader::new(&bytes).array_len().is_err());
        let bytes = [0xdf, 0xff, 0xff, 0xff, 0xff];
        assert!(Reader::new(&bytes).map_len().is_err());
        // Deep nesting stops at the limit instead of overflowing the stack.
        let deep = vec![0x91u8; 10_000];
        assert!(Reader::new(&deep).skip().is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let mut r = Reader::new(&bytes);
            while r.remaining() > 0 && r.skip().is_ok() {}
            let _ = Reader::new(&bytes).int();
            let _ = Reader::new(&bytes).str();
            let _ = Reader::new(&bytes).bytes();
            let _ = Reader::new(&bytes).f64();
        }
    }
}
