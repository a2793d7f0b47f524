//! Precise cache ownership from the engines' KV events (vLLM's ZMQ publisher).
//!
//! Predictions from our own routing decisions go wrong as soon as a replica evicts, restarts or
//! serves traffic we did not route. This module makes the [`crate::index::OwnershipIndex`]
//! follow what each engine reports it holds, and says per endpoint how far that report can be
//! believed ([`SourceState`]), so a decision can record which source it used.
//!
//! - [`wire`]: decoding vLLM's `[topic, sequence, msgpack batch]` messages (map and array
//!   encodings, unknown fields skipped, int or byte hashes).
//! - `blocks`: per endpoint, the engine's block hash -> our re-hashed blocks and chain state,
//!   with copy counts per medium.
//! - `apply`: sequence tracking and the trust state machine (the rules are on that page), and
//!   applying batches to the index.
//! - `subscriber`: the ZMQ SUB sockets (connect per endpoint, or one bound socket shared by
//!   many publishers told apart by topic) and their tasks.
//! - `endpoint`: one endpoint's stream (published state, applier behind a lock).
//! - `hub`: [`KvEvents`], built with the index it feeds and reconciled with each config, with
//!   the request path's queries
//!   ([`KvEvents::source_state`], [`KvEvents::record_routed`]) and silence detection.
//! - [`weighted_blocks`]: a match weighed by where the engine holds its blocks.
//!
//! # Which namespace an engine block belongs to
//!
//! The router hashes a request in `Namespace::new(base model, adapter, None)
//! .with_cache_salt(cache_salt)`, where `cache_salt` is the one the engine receives: the
//! tenant's keyed salt the router writes into the body (`tenancy.inject_cache_salt`), or else
//! the client's own. An engine block is re-hashed in
//! `Namespace::new(model, lora_name, None).with_cache_salt(salt)` where `model` is the
//! endpoint's first configured model (an engine serves one base model), `lora_name` comes from
//! the event and `salt` is the string key vLLM appends to the extra keys of a sequence's first
//! block when the request had a `cache_salt`. The two agree for every request, tenants
//! included. Only with injection turned off does a tenant's request hash in a router-only
//! namespace (`Namespace::new(.., tenant salt)`) that events never confirm: the engine then
//! shares its cache across tenants, and the router's isolation must not be bypassed by it.
//! Blocks whose extra keys hold anything else (multimodal items, prompt-embedding digests), an
//! adapter known only by integer id, or whose parent we never saw, map to no block of ours,
//! and neither do their children: we cannot reproduce their hashes.
//!
//! The engine's block size may differ from ours (vLLM on CPU: 128; ours: 16): each engine block
//! continues the chain from where its parent ended ([`crate::prefix::BlockHasher::extend`]).
//!
//! # Silence
//!
//! vLLM publishes nothing while idle, so silence alone means nothing. An endpoint is silent
//! when the router sent it a request that should make the engine store at least one new full
//! engine block (its prefix is longer, in whole engine blocks, than what the index showed
//! confirmed there) and no message at all has arrived for `kv_events.silence_timeout_ms` since.
//! Its confirmed blocks are then withdrawn (predictions stay) until the next message, which
//! restores them when its sequence shows nothing was lost. A dropped connection (in connect
//! mode; in bind mode, the publishers on that IP) is most often a restarted engine, so it clears
//! the endpoint's entries, predictions included, and the next batch starts over.

mod apply;
mod blocks;
mod endpoint;
mod gate;
mod hub;
mod msgpack;
mod replay;
mod state;
mod subscriber;
pub mod wire;

pub use apply::StreamCounters;
pub use hub::{EndpointEventsStatus, KvEvents, PushError, PushSink, SourceStates};
pub use msgpack::MsgpackError;
pub use state::{Reason, SourceState};

use crate::config::MediumWeights;
use crate::index::PrefixMatch;

/// Why the KV-event subscriptions could not all start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventsError {
    /// A bound socket could not bind.
    #[error("kv events: cannot bind {endpoint}: {message}")]
    Bind {
        /// The configured endpoint.
        endpoint: String,
        /// What the socket or the OS said.
        message: String,
    },
}

/// `m`'s matched blocks weighed by medium: GPU-resident and predicted blocks count `gpu`,
/// blocks the engine holds only offloaded count `cpu` when in CPU memory and `other` when only
/// on slower media. In blocks, so multiply by the block size for tokens.
pub fn weighted_blocks(m: &PrefixMatch, weights: &MediumWeights) -> f64 {
    let offloaded = f64::from(m.offloaded_blocks);
    let cpu = f64::from(m.cpu_blocks.min(m.offloaded_blocks));
    (f64::from(m.blocks) - offloaded) * weights.gpu
        + cpu * weights.cpu
        + (offloaded - cpu) * weights.other
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloaded_blocks_weigh_less() {
        let w = MediumWeights::default();
        // (blocks, confirmed, offloaded, of those in CPU memory) -> weighted blocks.
        let cases = [
            ((10, 10, 0, 0), 10.0),
            ((10, 10, 10, 10), 8.0),
            ((10, 4, 2, 2), 9.6),
            ((10, 10, 10, 0), 5.0),
            ((10, 10, 4, 2), 6.0 + 1.6 + 1.0),
            ((0, 0, 0, 0), 0.0),
        ];
        for ((blocks, confirmed_blocks, offloaded_blocks, cpu_blocks), expected) in cases {
            let m = PrefixMatch {
                blocks,
                confirmed_blocks,
                offloaded_blocks,
                cpu_blocks,
            };
            assert!((weighted_blocks(&m, &w) - expected).abs() < 1e-9, "{m:?}");
        }
    }
}
