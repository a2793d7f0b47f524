//! A cursor over one msgpack document for the KV-event decoder: values are read with
//! `rmp::decode` (which reads ints, floats, strings and lengths from a slice without
//! allocating); what this file adds is what `rmp` lacks:
//!
//! - **Offsets**: every error says at which byte the offending value starts.
//! - **Lengths checked before anything is reserved**: an array or map header's length is
//!   refused when the bytes left cannot hold that many elements (each takes at least one
//!   byte), so a caller may size a vector from it; see [`Reader::array_len`] for the bound.
//! - **A bounded skip** of any value, nested at most [`MAX_DEPTH`] deep (`rmp`'s
//!   `MessageLen` estimator would do it, but panics on extension values).
//!
//! It never panics on any input, so a hostile payload costs at most its own size.

use rmp::decode::{self as dec};
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

    /// Runs an `rmp` reader on the bytes left and moves past what it read; on error the cursor
    /// stays on the value.
    fn read<T, E>(
        &mut self,
        expected: &'static str,
        f: impl FnOnce(&mut &'a [u8]) -> Result<T, E>,
    ) -> Result<T, MsgpackError> {
        let mut rest = &self.buf[self.pos..];
        let v = f(&mut rest).map_err(|_| self.err(expected))?;
        self.pos = self.buf.len() - rest.len();
        Ok(v)
    }

    fn take(&mut self, n: usize, expected: &'static str) -> Result<&'a [u8], MsgpackError> {
        if self.remaining() < n {
            return Err(self.err(expected));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn peek(&self) -> Option<Marker> {
        self.buf.get(self.pos).map(|&b| Marker::from_u8(b))
    }

    /// Consumes a nil and returns true, or returns false and consumes nothing.
    pub(crate) fn nil(&mut self) -> bool {
        self.read("nil", dec::read_nil).is_ok()
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

    /// An integer of any width and sign (msgpack ints span `i64::MIN..=u64::MAX`).
    pub(crate) fn int(&mut self) -> Result<i128, MsgpackError> {
        self.read("an integer", dec::read_int::<i128, _>)
    }

    /// A non-negative integer that fits `u64` (encoders may use a signed type for it).
    pub(crate) fn uint(&mut self, expected: &'static str) -> Result<u64, MsgpackError> {
        self.read(expected, dec::read_int::<u64, _>)
    }

    /// A number as `f64` (floats, or integers as some encoders write whole seconds).
    pub(crate) fn f64(&mut self) -> Result<f64, MsgpackError> {
        const E: &str = "a number";
        match self.peek() {
            Some(Marker::F32) => self.read(E, dec::read_f32).map(f64::from),
            Some(Marker::F64) => self.read(E, dec::read_f64),
            _ => self.read(E, dec::read_int::<i128, _>).map(|v| v as f64),
        }
    }

    /// A UTF-8 string, borrowed from the payload.
    pub(crate) fn str(&mut self) -> Result<&'a str, MsgpackError> {
        let at = self.pos;
        let (s, rest) = dec::read_str_from_slice(&self.buf[at..]).map_err(|e| MsgpackError {
            at,
            expected: match e {
                dec::DecodeStringError::InvalidUtf8(..) => "a UTF-8 string",
                _ => "a string",
            },
        })?;
        self.pos = self.buf.len() - rest.len();
        Ok(s)
    }

    /// The bytes of a string or binary value, borrowed from the payload.
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], MsgpackError> {
        let at = self.pos;
        let n = if self.at_str() {
            self.read("bytes", dec::read_str_len)?
        } else {
            self.read("bytes or a string", dec::read_bin_len)?
        };
        self.take(n as usize, "bytes")
            .inspect_err(|_| self.pos = at)
    }

    /// An array header. Its length is at most the bytes left (every element takes at least
    /// one); reserve room for it with [`Self::capacity_for`].
    pub(crate) fn array_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let n = self.read("an array", dec::read_array_len)? as usize;
        if n > self.remaining() {
            self.pos = at;
            return Err(self.err("an array no longer than the payload"));
        }
        Ok(n)
    }

    /// A map header (entries, each a key and a value), checked as [`Self::array_len`].
    pub(crate) fn map_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let n = self.read("a map", dec::read_map_len)? as usize;
        if n.saturating_mul(2) > self.remaining() {
            self.pos = at;
            return Err(self.err("a map no longer than the payload"));
        }
        Ok(n)
    }

    /// How many elements of a claimed array of `n` to reserve room for up front, each taking
    /// at least `min_element_bytes` of the payload and `element_size` bytes decoded: no more
    /// than the bytes left could hold, and no more memory than the bytes left, so a lying
    /// header cannot make the decoder reserve on its word (a vector grows as real elements
    /// arrive).
    pub(crate) fn capacity_for(
        &self,
        n: usize,
        min_element_bytes: usize,
        element_size: usize,
    ) -> usize {
        let left = self.remaining();
        n.min(left / min_element_bytes.max(1))
            .min(left / element_size.max(1))
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
        let Some(marker) = self.peek() else {
            return Err(self.err(E));
        };
        match marker {
            Marker::Null => self.read(E, dec::read_nil),
            Marker::True | Marker::False => self.read(E, dec::read_bool).map(drop),
            Marker::F32 | Marker::F64 => self.f64().map(drop),
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                let n = self.read(E, dec::read_str_len)?;
                self.take(n as usize, E).map(drop)
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = self.read(E, dec::read_bin_len)?;
                self.take(n as usize, E).map(drop)
            }
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                for _ in 0..self.array_len()? {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                for _ in 0..self.map_len()? * 2 {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => {
                let meta = self.read(E, dec::read_ext_meta)?;
                self.take(meta.size as usize, E).map(drop)
            }
            Marker::Reserved => Err(self.err("a msgpack value (reserved marker)")),
            _ => self.int().map(drop),
        }
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
        let cases: &[(rmpv::Value, i128)] = &[
            (rmpv::Value::from(5u8), 5),
            (rmpv::Value::from(200u8), 200),
            (rmpv::Value::from(60_000u16), 60_000),
            (rmpv::Value::from(4_000_000_000u32), 4_000_000_000),
            (rmpv::Value::from(u64::MAX), i128::from(u64::MAX)),
            (rmpv::Value::from(-3i8), -3),
            (rmpv::Value::from(-300i16), -300),
            (rmpv::Value::from(i64::MIN), i128::from(i64::MIN)),
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
        assert_eq!(Reader::new(&buf).uint("u").unwrap(), 7);
        // A negative one is not, and the cursor stays on it for the error's offset.
        let mut r = Reader::new(&[0xff]);
        assert_eq!(r.uint("u").unwrap_err().at, 0);
        assert_eq!(r.int().unwrap(), -1);
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
