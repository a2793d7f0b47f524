//! Hard limits on a request body's shape, enforced while it is parsed, so an oversized
//! conversation is rejected (413) after reading at most one element past the limit, never after
//! building it.

use std::cell::Cell;

/// Most messages and content parts one request may carry. Built from the `routing` config
/// (`routing.max_messages`, `routing.max_content_parts`); [`Default`] holds the config defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most entries in a chat request's `messages`. Default 10000.
    pub max_messages: usize,
    /// Most content parts over all messages of a request (a string `content` is one part).
    /// Default 20000.
    pub max_content_parts: usize,
}

/// Default of [`RequestLimits::max_messages`].
pub const DEFAULT_MAX_MESSAGES: usize = 10_000;
/// Default of [`RequestLimits::max_content_parts`].
pub const DEFAULT_MAX_CONTENT_PARTS: usize = 20_000;

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_messages: DEFAULT_MAX_MESSAGES,
            max_content_parts: DEFAULT_MAX_CONTENT_PARTS,
        }
    }
}

/// Which limit a body went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LimitHit {
    /// The field, e.g. `messages`.
    pub field: &'static str,
    /// The limit it went over.
    pub limit: usize,
}

/// The counters of one parse. Visitors share it by reference (parsing is single-threaded), and
/// the first limit hit is remembered so the serde error it aborts with can be classified.
#[derive(Debug)]
pub(super) struct Budget {
    limits: RequestLimits,
    parts: Cell<usize>,
    hit: Cell<Option<LimitHit>>,
}

impl Budget {
    pub(super) fn new(limits: RequestLimits) -> Budget {
        Budget {
            limits,
            parts: Cell::new(0),
            hit: Cell::new(None),
        }
    }

    pub(super) fn max_messages(&self) -> usize {
        self.limits.max_messages
    }

    /// Counts one more content part; `Err` (and remembered) past the limit.
    pub(super) fn take_part<E: serde::de::Error>(&self) -> Result<(), E> {
        let n = self.parts.get() + 1;
        self.parts.set(n);
        if n > self.limits.max_content_parts {
            return Err(self.exceeded("content parts", self.limits.max_content_parts));
        }
        Ok(())
    }

    /// Remembers that `field` went over `limit` and returns the error that aborts parsing.
    pub(super) fn exceeded<E: serde::de::Error>(&self, field: &'static str, limit: usize) -> E {
        if self.hit.get().is_none() {
            self.hit.set(Some(LimitHit { field, limit }));
        }
        E::custom(format_args!("more than {limit} {field}"))
    }

    /// The first limit hit, if any.
    pub(super) fn hit(&self) -> Option<LimitHit> {
        self.hit.get()
    }
}
