//! The `kvrouter.v1.KvEvents` service: pushed batches mapped to the wire events the ZMQ path
//! decodes, applied through the KV-event [`PushSink`].

use std::net::SocketAddr;

use tonic::{Request, Response, Status, Streaming};

use super::pb;
use crate::events::wire::{Batch, BlockRemoved, BlockStored, Event, ExtraKey};
use crate::events::{PushError, PushSink};
use crate::index::Medium;

/// `KvEvents`: event ingestion.
#[derive(Debug, Clone)]
pub(super) struct PushService {
    sink: PushSink,
}

impl PushService {
    pub(super) fn new(sink: PushSink) -> PushService {
        PushService { sink }
    }
}

#[tonic::async_trait]
impl pb::kv_events_server::KvEvents for PushService {
    async fn push_kv_events(
        &self,
        request: Request<Streaming<pb::KvEventBatch>>,
    ) -> Result<Response<pb::PushKvEventsResponse>, Status> {
        let mut inbound = request.into_inner();
        let mut seen: Vec<SocketAddr> = Vec::new();
        let mut totals = pb::PushKvEventsResponse::default();
        loop {
            let batch = match inbound.message().await {
                Ok(Some(batch)) => batch,
                Ok(None) => return Ok(Response::new(totals)),
                Err(status) => {
                    // The client vanished mid-stream: as a dropped ZMQ connection.
                    for &ep in &seen {
                        self.sink.link_lost(ep);
                    }
                    return Err(status);
                }
            };
            let endpoint = match batch.endpoint.as_str() {
                "" => *seen.last().ok_or_else(|| {
                    Status::invalid_argument("the first batch of a stream must name its endpoint")
                })?,
                s => s.parse::<SocketAddr>().map_err(|_| {
                    Status::invalid_argument(format!("endpoint {s:?} is not an ip:port"))
                })?,
            };
            if let Some(i) = seen.iter().position(|&e| e == endpoint) {
                seen.remove(i);
            }
            seen.push(endpoint);
            let seq = batch.seq;
            let wire = to_wire(batch)?;
            let events = wire.events.len() as u64;
            self.sink.apply(endpoint, seq, wire).map_err(|e| match e {
                PushError::UnknownEndpoint(_) => Status::not_found(e.to_string()),
                PushError::NotPushed(_) => Status::failed_precondition(e.to_string()),
            })?;
            totals.batches += 1;
            totals.events += events;
        }
    }
}

fn medium(name: &str) -> Medium {
    Medium::from_engine((!name.is_empty()).then_some(name))
}

/// A pushed batch as the ZMQ path's decoder would have produced it.
fn to_wire(batch: pb::KvEventBatch) -> Result<Batch, Status> {
    let mut events = Vec::with_capacity(batch.events.len());
    for (i, e) in batch.events.into_iter().enumerate() {
        events.push(match e.event {
            Some(pb::kv_event::Event::BlockStored(s)) => {
                if s.block_size == 0 {
                    return Err(Status::invalid_argument(format!(
                        "events[{i}].block_stored.block_size must be > 0"
                    )));
                }
                let extra_keys = (!s.extra_keys.is_empty()).then(|| {
                    s.extra_keys
                        .into_iter()
                        .map(|block| {
                            (!block.keys.is_empty())
                                .then(|| block.keys.into_iter().map(extra_key).collect())
                        })
                        .collect()
                });
                Event::Stored(BlockStored {
                    block_hashes: s.block_hashes,
                    parent_block_hash: s.parent_block_hash,
                    token_ids: s.token_ids,
                    block_size: s.block_size,
                    lora_id: s.lora_id,
                    medium: medium(&s.medium),
                    lora_name: s.lora_name.map(Into::into),
                    extra_keys,
                    group_idx: s.group_idx,
                })
            }
            Some(pb::kv_event::Event::BlockRemoved(r)) => Event::Removed(BlockRemoved {
                block_hashes: r.block_hashes,
                medium: medium(&r.medium),
                group_idx: r.group_idx,
            }),
            Some(pb::kv_event::Event::AllBlocksCleared(c)) => Event::Cleared {
                medium: c.medium.as_deref().map(medium),
            },
            None => Event::Unknown,
        });
    }
    Ok(Batch {
        ts_s: batch.ts,
        events,
        dp_rank: batch.data_parallel_rank,
    })
}

fn extra_key(k: pb::ExtraKey) -> ExtraKey {
    match k.key {
        Some(pb::extra_key::Key::Str(s)) => ExtraKey::Str(s.into()),
        Some(pb::extra_key::Key::Int(i)) => ExtraKey::Int(i128::from(i)),
        Some(pb::extra_key::Key::Other(_)) | None => ExtraKey::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_events_map_to_the_wire_events_of_the_zmq_path() {
        let stored = pb::BlockStored {
            block_hashes: vec![11, 12],
            parent_block_hash: Some(10),
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_id: None,
            medium: "cpu".into(),
            lora_name: Some("ad".into()),
            extra_keys: vec![
                pb::BlockExtraKeys {
                    keys: vec![pb::ExtraKey {
                        key: Some(pb::extra_key::Key::Str("salt".into())),
                    }],
                },
                pb::BlockExtraKeys { keys: vec![] },
            ],
            group_idx: None,
        };
        let batch = pb::KvEventBatch {
            endpoint: "127.0.0.1:1".into(),
            seq: 3,
            ts: 1.5,
            data_parallel_rank: Some(1),
            events: vec![
                pb::KvEvent {
                    event: Some(pb::kv_event::Event::BlockStored(stored)),
                },
                pb::KvEvent {
                    event: Some(pb::kv_event::Event::BlockRemoved(pb::BlockRemoved {
                        block_hashes: vec![11],
                        medium: String::new(),
                        group_idx: Some(0),
                    })),
                },
                pb::KvEvent {
                    event: Some(pb::kv_event::Event::AllBlocksCleared(
                        pb::AllBlocksCleared { medium: None },
                    )),
                },
            ],
        };
        let wire = to_wire(batch).unwrap();
        assert_eq!((wire.ts_s, wire.dp_rank), (1.5, Some(1)));
        let Event::Stored(s) = &wire.events[0] else {
            panic!("{:?}", wire.events[0])
        };
        assert_eq!(s.medium, Medium::Cpu);
        assert_eq!(s.parent_block_hash, Some(10));
        assert_eq!(s.lora_name.as_deref(), Some("ad"));
        assert_eq!(
            s.extra_keys,
            Some(vec![Some(vec![ExtraKey::Str("salt".into())]), None])
        );
        assert_eq!(
            wire.events[1],
            Event::Removed(BlockRemoved {
                block_hashes: vec![11],
                medium: Medium::Gpu,
                group_idx: Some(0)
            })
        );
        assert_eq!(wire.events[2], Event::Cleared { medium: None });
        let bad = pb::KvEventBatch {
            events: vec![pb::KvEvent {
                event: Some(pb::kv_event::Event::BlockStored(pb::BlockStored::default())),
            }],
            ..Default::default()
        };
        let err = to_wire(bad).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("block_size must be > 0"), "{err:?}");
    }
}
