//! One endpoint's event stream: sequence tracking, the trust state machine, and applying
//! batches to the index.
//!
//! # When events are believed
//!
//! The view is what we learned from events; the link is whether events can reach us.
//!
//! - **Fresh start** — a batch with sequence 0 while we had no sequence for the publisher, or a
//!   sequence that went back to 0 (a restarted publisher): the engine's cache was empty when its
//!   publisher started, so the endpoint is cleared (confirmed blocks *and* predictions: they
//!   describe the engine before its restart) and the view is complete: `Trusted`.
//! - **Joined** — the first batch has sequence > 0: the engine held blocks before we listened.
//!   Events are applied (what they say is true) but the view is `Partial(Joined)`.
//! - **Gap** — sequence > expected: stores and removals were missed, so confirmed blocks are
//!   withdrawn (predictions stay), the engine-block table is dropped (children of unknown
//!   parents cannot be re-hashed) and the view is `Partial(Gap)` from this batch on.
//! - **Lossy restart** — sequence went back but not to 0: as a fresh start, `Partial(Restart)`.
//! - **`AllBlocksCleared`** (every medium), in sequence: the engine's cache is empty, so the
//!   endpoint is cleared and the view becomes complete: `Trusted`, whatever it was.
//! - **Disconnected** — the connection to the publisher dropped, most often because the
//!   engine restarted (its in-flight requests, and what we predicted for them, are gone): the
//!   endpoint's entries are cleared, predictions included, and so is the table, and the state
//!   is `Distrusted(Disconnected)`. The next batch is judged as a first one: sequence 0 is a
//!   fresh start, anything else `Partial(Disconnected)`. (Restoring on a sequence that merely
//!   continues ours is unsafe: a restarted publisher whose first batches were lost while we
//!   reconnected can reach exactly our next number.)
//! - **Silent** — the router sent work that should have stored blocks and no message came for
//!   `silence_timeout_ms` (the subscription broke while the engine works on): confirmed blocks
//!   are withdrawn, predictions stay (they are all we have), the table is kept, and the state
//!   is `Distrusted(Silent)`. The next batch decides: in sequence, nothing was lost, so the
//!   table goes back into the index and the view is what it was; otherwise the rules above.
//!
//! A `Partial` view becomes `Trusted` only at a fresh start or a full clear: after a gap there
//! is no telling which blocks the engine still holds from before (a hot system prompt may stay
//! cached for days without a new event), and trusting early would make the router forget them.
//! While partial, predictions keep the full TTL, so the router does no worse than without
//! events; removals of blocks the events did store still erase them, predictions included.

use super::blocks::{Applied, EngineBlocks, Rehash};
use super::state::{Published, Reason, SourceState};
use super::wire::{Event, Message, WireError};
use crate::index::{EndpointId, OwnershipIndex};

/// Most data-parallel ranks tracked per endpoint (vLLM deployments run a few to a few dozen);
/// a message from a further rank is treated as malformed.
pub(crate) const MAX_DP_RANKS: usize = 256;

/// What the view of the engine's cache rests on (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum View {
    /// No batch applied yet.
    Empty,
    /// Every event since the engine's cache was empty.
    Complete,
    /// Some events were missed.
    Partial(Reason),
}

/// Counters of one endpoint's stream, for `/debug` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamCounters {
    /// Messages received (decodable or not).
    pub messages: u64,
    /// Events applied.
    pub events: u64,
    /// Engine blocks stored and mapped to blocks of ours.
    pub blocks_mapped: u64,
    /// Engine blocks stored that map to none of ours (multimodal or embedding keys, unknown
    /// parent, unknown adapter).
    pub blocks_unmapped: u64,
    /// Block copies removed.
    pub blocks_removed: u64,
    /// Removals of blocks we did not know of (stored before we listened).
    pub unknown_removed: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
    /// Events of other KV-cache groups or unknown types, skipped.
    pub skipped: u64,
    /// Sequence gaps.
    pub gaps: u64,
    /// Publisher restarts (sequence went back).
    pub restarts: u64,
    /// Undecodable messages.
    pub malformed: u64,
    /// Times confirmed blocks were withdrawn because events stopped (disconnect or silence).
    pub withdrawals: u64,
}

/// The per-endpoint state behind the endpoint's lock.
#[derive(Debug)]
pub(crate) struct Applier {
    ep: EndpointId,
    blocks: EngineBlocks,
    /// Next expected sequence per data-parallel rank, at most [`MAX_DP_RANKS`] of them.
    expected: Vec<(u32, u64)>,
    view: View,
    /// What a first batch that is not sequence 0 means: we joined a running stream, or came
    /// back to one after a disconnect.
    rejoin: Reason,
    /// Why events cannot reach us right now, if they cannot.
    link: Option<Reason>,
    max_engine_blocks: usize,
    /// Only this KV-cache group's events count.
    group_idx: u32,
    /// The stream was replaced or removed ([`Self::retire`]): a message a socket task had
    /// already routed here must not write to the index any more.
    retired: bool,
    pub(crate) counters: StreamCounters,
}

impl Applier {
    pub(crate) fn new(
        ep: EndpointId,
        rehash: Rehash,
        max_engine_blocks: usize,
        group_idx: u32,
    ) -> Applier {
        Applier {
            ep,
            blocks: EngineBlocks::new(rehash),
            expected: Vec::new(),
            view: View::Empty,
            rejoin: Reason::Joined,
            link: Some(Reason::Connecting),
            max_engine_blocks,
            group_idx,
            retired: false,
            counters: StreamCounters::default(),
        }
    }

    /// The state to publish.
    pub(crate) fn state(&self) -> SourceState {
        match (self.link, self.view) {
            (Some(r), _) => SourceState::Distrusted(r),
            (None, View::Complete) => SourceState::Trusted,
            (None, View::Partial(r)) => SourceState::Partial(r),
            (None, View::Empty) => SourceState::Partial(Reason::Joined),
        }
    }

    /// Engine blocks tracked and their heap bytes.
    pub(crate) fn table_size(&self) -> (usize, usize) {
        (self.blocks.len(), self.blocks.heap_bytes())
    }

    /// The socket connected (no batch yet): events can flow, though we know nothing yet.
    pub(crate) fn connected(&mut self) {
        if self.link == Some(Reason::Connecting) {
            self.link = None;
        }
    }

    /// Events stopped reaching us: on `Disconnected` clear the endpoint and start over (the
    /// next batch is judged as a first one); otherwise withdraw its confirmed blocks and keep
    /// the table for the next batch to restore.
    pub(crate) fn link_lost(&mut self, reason: Reason, index: &OwnershipIndex) {
        if self.retired {
            return;
        }
        if reason == Reason::Disconnected {
            if self.link != Some(Reason::Disconnected) {
                self.counters.withdrawals += 1;
            }
            index.clear_endpoint(self.ep);
            self.blocks.clear();
            self.expected.clear();
            self.view = View::Empty;
            self.rejoin = Reason::Disconnected;
            self.link = Some(reason);
            return;
        }
        if self.link.is_some() {
            return;
        }
        self.link = Some(reason);
        self.blocks.withdraw(self.ep, index);
        self.counters.withdrawals += 1;
    }

    /// The stream is being replaced or removed (reload): what it confirmed goes, predictions
    /// stay, and nothing it receives from now on touches the index.
    pub(crate) fn retire(&mut self, index: &OwnershipIndex) {
        self.blocks.withdraw(self.ep, index);
        self.blocks.clear();
        self.retired = true;
    }

    /// Something outside the stream (health checks, metrics) saw the engine restart: its cache
    /// is gone, so everything the endpoint held goes and its publisher's next batch is taken as
    /// a fresh start.
    pub(crate) fn restarted(&mut self, index: &OwnershipIndex) {
        if self.retired {
            return;
        }
        index.clear_endpoint(self.ep);
        self.blocks.clear();
        self.expected.clear();
        self.view = View::Empty;
        self.rejoin = Reason::Restart;
        self.link = Some(Reason::Restart);
    }

    /// Applies one received message (or the error decoding it). `seq` is the sequence frame
    /// when it was readable even though the payload was not.
    pub(crate) fn on_message(&mut self, message: Received<'_>, index: &OwnershipIndex) {
        if self.retired {
            return;
        }
        self.counters.messages += 1;
        let message = match message {
            Ok(m) => m,
            Err((_, seq)) => {
                // Its events are lost: as a gap, from here on.
                self.counters.malformed += 1;
                if let Some((seq, rank)) = seq.filter(|&(_, rank)| self.has_room_for(rank)) {
                    // The payload, and with it the data-parallel rank, was unreadable: the
                    // sequence is placed only on a stream that has shown no other rank (a
                    // guessed rank 0 would be a phantom on a data-parallel engine).
                    if self.expected.iter().all(|&(r, _)| r == rank) {
                        self.set_expected(rank, seq.saturating_add(1));
                    }
                }
                self.link = None;
                self.lose(Reason::Malformed, index);
                return;
            }
        };
        let rank = message.batch.dp_rank.unwrap_or(0);
        if !self.has_room_for(rank) {
            // More data-parallel ranks than any engine runs: not a stream we can follow.
            self.counters.malformed += 1;
            self.link = None;
            self.lose(Reason::Malformed, index);
            return;
        }
        self.sequence(message.seq, rank, index);
        for event in &message.batch.events {
            self.apply(event, index);
        }
        if self.blocks.len() > self.max_engine_blocks {
            self.lose(Reason::Overflow, index);
        }
    }

    /// Whether `rank` has (or may get) an entry in the sequence table, which holds at most
    /// [`MAX_DP_RANKS`] ranks: the rank comes from the message, so the table must not grow on
    /// a publisher's word.
    /// Whether events of `group_idx` (absent: 0) are the KV-cache group this applier follows.
    pub(crate) fn follows_group(&self, group_idx: Option<u32>) -> bool {
        group_idx.unwrap_or(0) == self.group_idx
    }

    fn has_room_for(&self, rank: u32) -> bool {
        self.expected.len() < MAX_DP_RANKS || self.expected.iter().any(|&(r, _)| r == rank)
    }

    fn set_expected(&mut self, rank: u32, next: u64) -> Option<u64> {
        match self.expected.iter_mut().find(|(r, _)| *r == rank) {
            Some((_, e)) => Some(std::mem::replace(e, next)),
            None => {
                self.expected.push((rank, next));
                None
            }
        }
    }

    /// Sequence bookkeeping before a batch is applied.
    fn sequence(&mut self, seq: u64, rank: u32, index: &OwnershipIndex) {
        let expected = self.set_expected(rank, seq.saturating_add(1));
        let link_was_lost = self.link.take().is_some();
        match expected {
            None if seq == 0 && self.expected.len() == 1 => self.fresh_start(index),
            None => {
                // The engine ran before we listened; or another data-parallel rank appeared,
                // whose cache was empty if it starts at 0.
                if seq != 0 && matches!(self.view, View::Empty | View::Complete) {
                    self.view = View::Partial(self.rejoin);
                } else if self.view == View::Empty {
                    self.view = View::Complete;
                }
                if link_was_lost {
                    self.blocks.restore(self.ep, index);
                }
            }
            Some(e) if seq == e => {
                if link_was_lost {
                    self.blocks.restore(self.ep, index);
                }
            }
            Some(e) if seq > e => {
                self.counters.gaps += 1;
                if !link_was_lost {
                    self.blocks.withdraw(self.ep, index);
                }
                self.blocks.clear();
                self.view = View::Partial(Reason::Gap);
            }
            Some(_) => {
                self.counters.restarts += 1;
                if seq == 0 && self.expected.len() == 1 {
                    self.fresh_start(index);
                } else {
                    index.clear_endpoint(self.ep);
                    self.blocks.clear();
                    self.view = View::Partial(Reason::Restart);
                }
            }
        }
    }

    fn fresh_start(&mut self, index: &OwnershipIndex) {
        self.rejoin = Reason::Joined;
        index.clear_endpoint(self.ep);
        self.blocks.clear();
        self.view = View::Complete;
    }

    /// Events were lost: confirmed blocks go (predictions stay) and the table with them.
    fn lose(&mut self, reason: Reason, index: &OwnershipIndex) {
        self.blocks.withdraw(self.ep, index);
        self.blocks.clear();
        self.view = View::Partial(reason);
    }

    fn apply(&mut self, event: &Event, index: &OwnershipIndex) {
        let ep = self.ep;
        let applied = match event {
            Event::Stored(s) if self.follows_group(s.group_idx) => self.blocks.store(s, ep, index),
            Event::Removed(r) if self.follows_group(r.group_idx) => {
                self.blocks.remove(r, ep, index)
            }
            Event::Cleared { medium: None } => {
                self.counters.clears += 1;
                index.clear_endpoint(ep);
                self.blocks.clear();
                self.view = View::Complete;
                Applied::default()
            }
            Event::Cleared { medium: Some(m) } => {
                self.counters.clears += 1;
                self.blocks.clear_medium(*m, ep, index);
                Applied::default()
            }
            Event::Stored(_) | Event::Removed(_) | Event::Unknown => {
                self.counters.skipped += 1;
                return;
            }
        };
        let c = &mut self.counters;
        c.events += 1;
        c.blocks_mapped += applied.mapped;
        c.blocks_unmapped += applied.unmapped;
        c.blocks_removed += applied.removed;
        c.unknown_removed += applied.unknown_removed;
    }
}

/// A message as [`Applier::on_message`] takes it: decoded, or the error with the sequence (and
/// rank 0) when at least the sequence frame was readable.
pub(crate) type Received<'a> = Result<Message<'a>, (WireError, Option<(u64, u32)>)>;

/// Decodes a multipart message's frames for [`apply_and_publish`].
pub(crate) fn decode<F: AsRef<[u8]>>(frames: &[F]) -> Received<'_> {
    super::wire::decode_message(frames).map_err(|e| {
        let seq = match frames {
            [_, seq, _] => <[u8; 8]>::try_from(seq.as_ref())
                .ok()
                .map(|b| (u64::from_be_bytes(b), 0)),
            _ => None,
        };
        (e, seq)
    })
}

/// Applies a message to an endpoint and publishes the resulting state.
pub(crate) fn apply_and_publish(
    applier: &mut Applier,
    published: &Published,
    message: Received<'_>,
    index: &OwnershipIndex,
    now_ms: u64,
) {
    if let Ok(m) = &message {
        // The engine's block size, from the blocks of the group followed: not from an
        // offloading connector's placeholder (size 0) or another KV-cache group's blocks.
        for e in &m.batch.events {
            if let Event::Stored(s) = e {
                if s.block_size > 0 && applier.follows_group(s.group_idx) {
                    published
                        .engine_block_size
                        .store(s.block_size, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }
    applier.on_message(message, index);
    published
        .last_message_ms
        .store(now_ms.max(1), std::sync::atomic::Ordering::Release);
    published
        .expect_since_ms
        .store(0, std::sync::atomic::Ordering::Release);
    published.set(applier.state(), now_ms);
}

#[cfg(test)]
mod tests;
