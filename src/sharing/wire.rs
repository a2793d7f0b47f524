//! One shared decision on the wire: a few fixed fields and the block hashes, little-endian.
//!
//! ```text
//! b"KVD" version(1) origin(u64) sent_unix_ms(u64)
//! endpoint: family(4|6) ip(4|16 bytes) port(u16)
//! model: len(u16) utf-8 bytes
//! hashes: count(u32) count * u64
//! ```
//!
//! No prompt text: the hashes are chained and seeded by the namespace (model, adapter, tenant
//! salt), so they name a prefix without revealing it. Decoding checks every length against
//! what is left, so a hostile or truncated message is an error, never a panic or a large
//! allocation.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::SharedDecision;

const MAGIC: &[u8; 3] = b"KVD";
const VERSION: u8 = 1;
/// More hashes than any prompt the router accepts would cut (32 MiB bodies at 16-token blocks
/// stay far below it).
pub const MAX_HASHES: usize = 1 << 20;

/// Why a message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a shared decision, or a version this build does not read.
    #[error("not a kvrouter shared decision (version {0})")]
    Foreign(u8),
    /// Shorter than its fields say, or longer.
    #[error("truncated or oversized message")]
    Length,
    /// A field out of range (address family, model not UTF-8, too many hashes).
    #[error("bad field: {0}")]
    Field(&'static str),
}

/// Encodes `d`.
pub fn encode(d: &SharedDecision) -> Vec<u8> {
    let model = d.model.as_bytes();
    let model = &model[..model.len().min(u16::MAX as usize)];
    let mut out = Vec::with_capacity(48 + model.len() + d.hashes.len() * 8);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&d.origin.to_le_bytes());
    out.extend_from_slice(&d.sent_unix_ms.to_le_bytes());
    match d.endpoint.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out.extend_from_slice(&d.endpoint.port().to_le_bytes());
    out.extend_from_slice(&(model.len() as u16).to_le_bytes());
    out.extend_from_slice(model);
    out.extend_from_slice(&(d.hashes.len() as u32).to_le_bytes());
    for h in &d.hashes {
        out.extend_from_slice(&h.to_le_bytes());
    }
    out
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Length);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
}

/// Decodes one message.
pub fn decode(bytes: &[u8]) -> Result<SharedDecision, WireError> {
    let mut r = Reader(bytes);
    if r.take(3).ok() != Some(MAGIC.as_slice()) {
        return Err(WireError::Foreign(0));
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(WireError::Foreign(version));
    }
    let origin = u64::from_le_bytes(r.array()?);
    let sent_unix_ms = u64::from_le_bytes(r.array()?);
    let ip = match r.u8()? {
        4 => IpAddr::V4(Ipv4Addr::from(r.array::<4>()?)),
        6 => IpAddr::V6(Ipv6Addr::from(r.array::<16>()?)),
        _ => return Err(WireError::Field("address family")),
    };
    let port = u16::from_le_bytes(r.array()?);
    let model_len = u16::from_le_bytes(r.array()?) as usize;
    let model = std::str::from_utf8(r.take(model_len)?)
        .map_err(|_| WireError::Field("model"))?
        .to_string();
    let count = u32::from_le_bytes(r.array()?) as usize;
    if count > MAX_HASHES {
        return Err(WireError::Field("hash count"));
    }
    if r.0.len() != count * 8 {
        return Err(WireError::Length);
    }
    let hashes =
        r.0.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
    Ok(SharedDecision {
        origin,
        sent_unix_ms,
        endpoint: SocketAddr::new(ip, port),
        model,
        hashes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(endpoint: &str) -> SharedDecision {
        SharedDecision {
            origin: 0xdead_beef_0123_4567,
            sent_unix_ms: 1_764_000_000_123,
            endpoint: endpoint.parse().unwrap(),
            model: "llama".into(),
            hashes: vec![1, u64::MAX, 0x0102_0304_0506_0708],
        }
    }

    #[test]
    fn round_trips_v4_and_v6() {
        for ep in ["10.0.0.5:8000", "[fd00::7]:8001"] {
            let d = sample(ep);
            assert_eq!(decode(&encode(&d)).unwrap(), d);
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        let bytes = encode(&sample("10.0.0.5:8000"));
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "prefix of {n} bytes decoded");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), Err(WireError::Length));
    }

    #[test]
    fn foreign_messages_and_huge_counts_are_refused_without_allocating() {
        assert_eq!(decode(b"hello world"), Err(WireError::Foreign(0)));
        let mut bytes = encode(&sample("10.0.0.5:8000"));
        bytes[3] = 9;
        assert_eq!(decode(&bytes), Err(WireError::Foreign(9)));
        let mut bytes = encode(&SharedDecision {
            hashes: vec![],
            ..sample("10.0.0.5:8000")
        });
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&bytes), Err(WireError::Field("hash count")));
    }
}
