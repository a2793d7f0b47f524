//! The byte-estimate fallback, for models without a tokenizer (or a chat that cannot be
//! rendered): the prompt length is `ceil(bytes / 4)` tokens ([`super::estimate_tokens`]) and the
//! block hashes are chained over fixed chunks of `4 * block_size` bytes of a canonical
//! serialization of the prompt, so routing affinity still works: a shared prefix of text gives
//! shared leading hashes, a change changes every hash from its chunk on, and namespaces separate
//! as for token blocks. These hashes never match token-block hashes (their chain root differs),
//! so an engine's KV events never confirm them.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::hash::BlockHasher;
use super::BYTES_PER_TOKEN_ESTIMATE;
use crate::request::{ContentPart, Prompt, PromptInput};

/// Feeds bytes and hashes every full chunk.
struct Chunker {
    /// The parent hash's 8 bytes (written when the chunk is full), then the chunk so far: a
    /// full chunk is hashed in one shot (the streaming hasher, fed the parent and the chunk
    /// apart, was 6% of a decision at 256 endpoints; both give the same hash).
    chunk: Vec<u8>,
    chunk_bytes: usize,
    parent: u64,
    max_blocks: usize,
    out: Vec<u64>,
}

impl Chunker {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.out.len() < self.max_blocks {
            let take = (PARENT_BYTES + self.chunk_bytes - self.chunk.len()).min(bytes.len());
            self.chunk.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.chunk.len() == PARENT_BYTES + self.chunk_bytes {
                self.chunk[..PARENT_BYTES].copy_from_slice(&self.parent.to_le_bytes());
                self.parent = xxh3_64_with_seed(&self.chunk, super::hash::BLOCK_HASH_SEED);
                self.out.push(self.parent);
                self.chunk.truncate(PARENT_BYTES);
            }
        }
    }

    fn full(&self) -> bool {
        self.out.len() >= self.max_blocks
    }
}

/// Room for the parent hash ahead of a chunk's bytes.
const PARENT_BYTES: usize = 8;

/// Chained hashes of full byte chunks of `prompt` (at most `max_blocks`), under `hasher`'s
/// byte-chunk root. Chat messages are serialized as role, `0x1E`, then each part (text bytes, or
/// `0x1D` and the media hash), then `0x1F`. A batch prompt hashes its first element.
///
/// `tools` (a chat request's tools as JSON text) is fed first, then `0x1c`: templates render
/// them ahead of the conversation, so requests differing only in tools differ from the start.
pub(crate) fn byte_block_hashes(
    prompt: &Prompt<'_>,
    tools: Option<&str>,
    hasher: &BlockHasher,
    max_blocks: usize,
) -> Vec<u64> {
    let chunk_bytes = hasher.block_size_tokens() as usize * BYTES_PER_TOKEN_ESTIMATE;
    // Sized once: growing both by doubling was a dozen reallocations a decision. The text's
    // bytes bound the chunks (roles and separators add a few bytes a message).
    let fed = prompt.text_bytes() + tools.map_or(0, str::len);
    let mut chunk = Vec::with_capacity(PARENT_BYTES + chunk_bytes);
    chunk.resize(PARENT_BYTES, 0);
    let mut c = Chunker {
        chunk,
        chunk_bytes,
        parent: hasher.root(),
        max_blocks,
        out: Vec::with_capacity((fed / chunk_bytes.max(1) + 1).min(max_blocks)),
    };
    match prompt {
        Prompt::Chat(messages) => {
            if let Some(tools) = tools {
                c.feed(tools.as_bytes());
                c.feed(&[0x1c]);
            }
            for m in messages {
                if c.full() {
                    break;
                }
                c.feed(m.role.as_bytes());
                c.feed(&[0x1e]);
                for part in &m.content {
                    match part {
                        ContentPart::Text(t) => c.feed(t.as_bytes()),
                        ContentPart::Image(h) | ContentPart::Media(h) => {
                            c.feed(&[0x1d]);
                            c.feed(&h.to_le_bytes());
                        }
                    }
                }
                c.feed(&[0x1f]);
            }
        }
        Prompt::Input(PromptInput::Text(t)) => c.feed(t.as_bytes()),
        Prompt::Input(PromptInput::Texts(ts)) => {
            if let Some(t) = ts.first() {
                c.feed(t.as_bytes());
            }
        }
        // Token-id prompts are hashed as tokens by the caller.
        Prompt::Input(PromptInput::Tokens(_) | PromptInput::TokenLists(_)) | Prompt::None => {}
    }
    c.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::Namespace;
    use std::borrow::Cow;

    fn text(s: &str) -> Prompt<'_> {
        Prompt::Input(PromptInput::Text(Cow::Borrowed(s)))
    }

    #[test]
    fn chunks_are_chained_namespaced_and_capped() {
        let ns = Namespace::new("m", None, None);
        let h = BlockHasher::for_byte_chunks(&ns, 2); // 8-byte chunks
        let a = byte_block_hashes(&text("0123456789abcdefXYZ"), None, &h, usize::MAX);
        assert_eq!(a.len(), 2, "only full chunks");
        let b = byte_block_hashes(&text("0123456789abcdeF"), None, &h, usize::MAX);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_eq!(
            byte_block_hashes(&text("0123456789abcdefXYZ"), None, &h, 1),
            a[..1]
        );
        let other = BlockHasher::for_byte_chunks(&Namespace::new("m", None, Some("t")), 2);
        assert_ne!(
            byte_block_hashes(&text("0123456789abcdef"), None, &other, 9)[0],
            a[0]
        );
    }

    /// The hash of a chunk is xxh3 (block seed) over the parent's 8 little-endian bytes and
    /// the chunk, as it was when the two were streamed apart: byte identities recorded by an
    /// older router (shared index, decision logs) stay comparable. Chunks fed in pieces that
    /// straddle chunk ends give the same chain.
    #[test]
    fn a_chunks_hash_is_xxh3_of_its_parent_then_its_bytes() {
        let ns = Namespace::new("m", None, None);
        let h = BlockHasher::for_byte_chunks(&ns, 2); // 8-byte chunks
        let streamed = |parent: u64, chunk: &[u8]| {
            let mut x = xxhash_rust::xxh3::Xxh3::with_seed(crate::prefix::hash::BLOCK_HASH_SEED);
            x.update(&parent.to_le_bytes());
            x.update(chunk);
            x.digest()
        };
        let first = streamed(h.root(), b"01234567");
        let second = streamed(first, b"89abcdef");
        assert_eq!(
            byte_block_hashes(&text("0123456789abcdefXY"), None, &h, usize::MAX),
            vec![first, second]
        );
        let mut c = Chunker {
            chunk: vec![0; PARENT_BYTES],
            chunk_bytes: 8,
            parent: h.root(),
            max_blocks: usize::MAX,
            out: Vec::new(),
        };
        for piece in [&b"012"[..], b"3456789a", b"bcdef"] {
            c.feed(piece);
        }
        assert_eq!(c.out, vec![first, second]);
        // Chunks past 240 bytes take xxh3's long-input path (64-token blocks: 256 bytes).
        let h = BlockHasher::for_byte_chunks(&ns, 64);
        let long: String = (0..600)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let first = streamed(h.root(), &long.as_bytes()[..256]);
        let second = streamed(first, &long.as_bytes()[256..512]);
        assert_eq!(
            byte_block_hashes(&text(&long), None, &h, usize::MAX),
            vec![first, second]
        );
    }

    #[test]
    fn chat_serialization_separates_roles_and_media() {
        let ns = Namespace::new("m", None, None);
        let h = BlockHasher::for_byte_chunks(&ns, 1); // 4-byte chunks
        let chat = |role: &'static str, parts: Vec<ContentPart<'static>>| {
            Prompt::Chat(vec![crate::request::ChatMessage {
                role: Cow::Borrowed(role),
                content: parts,
                extra: None,
            }])
        };
        let t = |s: &'static str| ContentPart::Text(Cow::Borrowed(s));
        let user = byte_block_hashes(&chat("user", vec![t("hello world")]), None, &h, 99);
        let system = byte_block_hashes(&chat("system", vec![t("hello world")]), None, &h, 99);
        assert_ne!(user[0], system[0]);
        let img1 = byte_block_hashes(
            &chat("user", vec![t("hello"), ContentPart::Image(1)]),
            None,
            &h,
            99,
        );
        let img2 = byte_block_hashes(
            &chat("user", vec![t("hello"), ContentPart::Image(2)]),
            None,
            &h,
            99,
        );
        assert_eq!(img1[..2], img2[..2], "text before the image is shared");
        assert_ne!(img1.last(), img2.last());
        // Tools come first: other tools, another prefix from the first chunk; the same tools,
        // the same prefix.
        let long = || chat("user", vec![t("hello world, a longer question")]);
        let a = byte_block_hashes(&long(), Some(r#"[{"a":1}]"#), &h, 99);
        let b = byte_block_hashes(&long(), Some(r#"[{"b":1}]"#), &h, 99);
        assert_ne!(a[0], b[0]);
        assert_eq!(a, byte_block_hashes(&long(), Some(r#"[{"a":1}]"#), &h, 99));
        assert_ne!(a[0], byte_block_hashes(&long(), None, &h, 99)[0]);
    }
}
