//! The ext_proc service's wire codec and its tonic service: Envoy's messages are decoded on the
//! async workers only when they are small.
//!
//! A BUFFERED request body arrives as ONE gRPC message, up to `routing.max_body_bytes` (32 MiB).
//! Gathering and decoding it copies the body twice (page faults included): ~10 ms of one async
//! worker for a near-limit body, during which the streams that worker serves wait. Profiled
//! under the flood bench (`cargo bench --bench flood`), these copies were the largest stalls of
//! the workers. So a message longer than the stream's `routing.heavy_body_bytes` is taken off
//! the wire as the frames h2 received ([`super::divert`]: no copy) and decoded in the heavy lane
//! ([`super::lanes`]), at the lowest CPU priority, queued behind the other heavy work. Smaller
//! messages (every header message, normal bodies) decode in place as before.
//!
//! The service is the generated `ExternalProcessorServer`'s, with this codec instead of
//! `ProstCodec` (the generated one cannot take another codec) and the request body wrapped.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Buf;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status, Streaming};

use super::divert::{Chunks, Divert, Diverted, Pace, PaceFlow};
use super::ExtProc;

/// The gRPC service name Envoy calls.
const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The one method's path.
const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// One message from Envoy, as the codec delivered it.
// Moved once per message, straight out of the codec: boxing the decoded message would cost an
// allocation per message to save a move.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Inbound {
    /// Small: decoded where it arrived.
    Decoded(ProcessingRequest),
    /// Longer than the stream's threshold: the encoded message as it arrived, to decode off
    /// the workers.
    Raw(Chunks),
    /// Longer than the threshold, and refused before it was all read: it waited too long for
    /// its turn at the long bodies' read rate (`divert::Pace`).
    Refused,
}

impl Inbound {
    /// Bytes held undecoded: a raw message's encoded length, 0 for a decoded one.
    pub fn raw_len(&self) -> usize {
        match self {
            Inbound::Decoded(_) | Inbound::Refused => 0,
            Inbound::Raw(chunks) => bytes::Buf::remaining(chunks),
        }
    }

    /// The message, decoding a raw one in the calling thread.
    pub fn decode(self) -> Result<ProcessingRequest, Status> {
        match self {
            Inbound::Decoded(msg) => Ok(msg),
            Inbound::Raw(chunks) => ProcessingRequest::decode(chunks).map_err(decode_error),
            Inbound::Refused => Err(Status::resource_exhausted("a long message was refused")),
        }
    }
}

/// A protobuf parse error as tonic's prost codec reports it (INTERNAL, per gRPC's status codes).
fn decode_error(error: prost::DecodeError) -> Status {
    Status::internal(error.to_string())
}

/// Decodes the messages that reach tonic in place, and hands on raw the long ones its stream's
/// [`Divert`] body took off the wire.
#[derive(Debug, Clone, Default)]
pub struct InboundCodec {
    diverted: Diverted,
}

impl InboundCodec {
    pub fn new(diverted: Diverted) -> InboundCodec {
        InboundCodec { diverted }
    }
}

impl Codec for InboundCodec {
    type Encode = ProcessingResponse;
    type Decode = Inbound;
    type Encoder = tonic_prost::ProstEncoder<ProcessingResponse>;
    type Decoder = InboundDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::new(Default::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        InboundDecoder {
            diverted: Arc::clone(&self.diverted),
            next: 0,
        }
    }
}

#[derive(Debug)]
pub struct InboundDecoder {
    diverted: Diverted,
    /// The number of the message tonic hands over next (messages are numbered from 0 in the
    /// order they arrived, as [`Divert`] numbers them).
    next: u64,
}

impl Decoder for InboundDecoder {
    type Item = Inbound;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Inbound>, Status> {
        let n = self.next;
        self.next += 1;
        inbound(buf, n, &self.diverted).map(Some)
    }
}

/// Message `n`, whose bytes tonic has in `buf`: a diverted one (tonic then holds only its empty
/// placeholder) is handed on raw, any other is decoded in place.
fn inbound(buf: &mut impl Buf, n: u64, diverted: &Diverted) -> Result<Inbound, Status> {
    {
        let mut queue = diverted.lock();
        if queue.front().is_some_and(|(m, _)| *m == n) {
            let (_, chunks) = queue.pop_front().expect("front exists");
            buf.advance(buf.remaining());
            if chunks.is_refused() {
                return Ok(Inbound::Refused);
            }
            return Ok(Inbound::Raw(chunks));
        }
    }
    ProcessingRequest::decode(buf)
        .map(Inbound::Decoded)
        .map_err(decode_error)
}

/// The ext_proc gRPC service (what `ExternalProcessorServer` is, with [`InboundCodec`]).
#[derive(Debug, Clone)]
pub struct ExtProcServer {
    inner: Arc<ExtProc>,
    max_message_bytes: usize,
    /// The byte rate long messages share, over every stream this server reads.
    pace: Arc<Pace>,
}

impl ExtProcServer {
    pub fn new(inner: ExtProc, max_message_bytes: usize) -> ExtProcServer {
        let pace = Pace::new(0).counted(
            inner.metrics.heavy_body_held_seconds(),
            inner.metrics.heavy_body_refused(),
        );
        ExtProcServer {
            inner: Arc::new(inner),
            max_message_bytes,
            pace: Arc::new(pace),
        }
    }
}

impl tonic::server::NamedService for ExtProcServer {
    const NAME: &'static str = SERVICE;
}

/// The `Process` method: one stream per request.
struct ProcessMethod(Arc<ExtProc>);

impl tonic::server::StreamingService<Inbound> for ProcessMethod {
    type Response = ProcessingResponse;
    type ResponseStream = super::ReplyStream;
    type Future = BoxFuture<Response<super::ReplyStream>, Status>;

    fn call(&mut self, request: Request<Streaming<Inbound>>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { Ok(inner.process(request)) })
    }
}

impl<B> Service<http::Request<B>> for ExtProcServer
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS_PATH {
            return Box::pin(
                async move { Ok(Status::unimplemented("no such method").into_http()) },
            );
        }
        let inner = Arc::clone(&self.inner);
        let max = self.max_message_bytes;
        let pace = Arc::clone(&self.pace);
        Box::pin(async move {
            // Read per stream, so a reload of `routing.heavy_body_bytes` (and its rate) applies
            // to new streams.
            let (raw_above, (rate, burst), max_wait) = inner.long_body_settings();
            pace.set(rate, burst);
            let diverted = Diverted::default();
            // The stream learns its tenant from its headers message and sets it here, for
            // the Divert reading its body's frames afterwards.
            let flow = PaceFlow::default();
            let mut req = req.map(|body| {
                Divert::new(body, raw_above, max, Arc::clone(&diverted)).paced(
                    pace,
                    flow.clone(),
                    max_wait,
                )
            });
            req.extensions_mut().insert(flow);
            let mut grpc = tonic::server::Grpc::new(InboundCodec::new(diverted))
                .apply_max_message_size_config(Some(max), Some(max));
            Ok(grpc.streaming(ProcessMethod(inner), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Msg;
    use envoy_types::pb::envoy::service::ext_proc::v3::HttpBody;

    fn body_message(len: usize) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Msg::RequestBody(HttpBody {
                body: vec![b'x'; len],
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn encoded(msg: &ProcessingRequest) -> Chunks {
        Chunks::from(Bytes::from(msg.encode_to_vec()))
    }

    #[test]
    fn diverted_messages_come_up_raw_in_their_place_and_the_rest_decode_in_place() {
        let (small, long) = (body_message(100), body_message(4096));
        // Messages 0 and 2 were short; 1 was diverted, and tonic holds its empty placeholder.
        let diverted = Diverted::default();
        diverted.lock().push_back((1, encoded(&long)));
        let mut decoder = InboundCodec::new(Arc::clone(&diverted)).decoder();
        let mut decode = |bytes: Vec<u8>| {
            let mut buf = Bytes::from(bytes);
            let n = decoder.next;
            decoder.next += 1;
            inbound(&mut buf, n, &decoder.diverted).unwrap()
        };
        match decode(small.encode_to_vec()) {
            Inbound::Decoded(msg) => assert_eq!(msg, small),
            other => panic!("message 0 was not diverted: {}", other.raw_len()),
        }
        let raw = decode(Vec::new());
        match &raw {
            Inbound::Raw(chunks) => assert_eq!(chunks.remaining(), long.encoded_len()),
            _ => panic!("the diverted message 1 was not handed on raw"),
        }
        assert_eq!(raw.decode().unwrap(), long);
        match decode(small.encode_to_vec()) {
            Inbound::Decoded(msg) => assert_eq!(msg, small),
            other => panic!("message 2 was not diverted: {}", other.raw_len()),
        }
        assert!(diverted.lock().is_empty());
    }

    #[test]
    fn a_refused_long_message_comes_up_as_refused_in_its_place() {
        let small = body_message(100);
        let diverted = Diverted::default();
        diverted.lock().push_back((1, Chunks::refused()));
        let mut buf = Bytes::from(small.encode_to_vec());
        assert!(matches!(
            inbound(&mut buf, 0, &diverted),
            Ok(Inbound::Decoded(_))
        ));
        let mut placeholder = Bytes::new();
        let refused = inbound(&mut placeholder, 1, &diverted).unwrap();
        assert!(matches!(refused, Inbound::Refused));
        assert_eq!(refused.raw_len(), 0);
        assert!(diverted.lock().is_empty());
    }

    #[test]
    fn a_malformed_raw_message_is_an_internal_status_not_a_panic() {
        // Field 4 (request_body), length-delimited, claiming more bytes than follow.
        let garbage = Chunks::from(Bytes::from_static(&[0x22, 0xff, 0x01, 0x00]));
        let status = Inbound::Raw(garbage).decode().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
    }
}
