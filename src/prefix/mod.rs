//! Prefix identity: how long a prompt is in tokens and, later, its chained block hashes.
//!
//! Raw prompt text enters this module and never leaves it: callers get counts and hashes.

/// Bytes of text per token assumed when a model has no tokenizer configured. Byte-pair
/// tokenizers average 3.5-4.5 bytes per token on English text; 4 errs towards fewer tokens.
pub const BYTES_PER_TOKEN_ESTIMATE: usize = 4;

/// The byte-estimate fallback: `ceil(bytes / 4)` tokens.
pub fn estimate_tokens(text_bytes: usize) -> u64 {
    text_bytes.div_ceil(BYTES_PER_TOKEN_ESTIMATE) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(estimate_tokens(0), 0);
        assert_eq!(estimate_tokens(1), 1);
        assert_eq!(estimate_tokens(4), 1);
        assert_eq!(estimate_tokens(4000), 1000);
    }
}
