//! The ext_proc service's wire codec and its tonic service: Envoy's messages are decoded on the
//! async workers only when they are small.
//!
//! A BUFFERED request body arrives as ONE gRPC message, up to `routing.max_body_bytes` (32 MiB).
//! Decoding it copies the body into a fresh allocation (page faults included): ~10 ms of one
//! async worker for a near-limit body, during which the streams that worker serves wait. Profiled
//! under the flood bench (`cargo bench --bench flood`), prost's copy was the largest single stall
//! of the workers. So a message longer than the stream's `routing.heavy_body_bytes` is taken out
//! of tonic's buffer as it is (no copy) and decoded in the heavy lane ([`super::lanes`]), at the
//! lowest CPU priority, queued behind the other heavy work. Smaller messages (every header
//! message, normal bodies) decode in place as before.
//!
//! The service is the generated `ExternalProcessorServer`'s, with this codec instead of
//! `ProstCodec` (the generated one cannot take another codec).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status, Streaming};

use super::ExtProc;

/// The gRPC service name Envoy calls.
const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The one method's path.
const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// One message from Envoy, as the codec delivered it.
#[derive(Debug)]
pub enum Inbound {
    /// Small: decoded where it arrived.
    Decoded(ProcessingRequest),
    /// Longer than the stream's threshold: the encoded message, to decode off the workers.
    Raw(Bytes),
}

impl Inbound {
    /// The message, decoding a raw one in the calling thread.
    pub fn decode(self) -> Result<ProcessingRequest, Status> {
        match self {
            Inbound::Decoded(msg) => Ok(msg),
            Inbound::Raw(bytes) => ProcessingRequest::decode(bytes).map_err(decode_error),
        }
    }
}

/// A protobuf parse error as tonic's prost codec reports it (INTERNAL, per gRPC's status codes).
fn decode_error(error: prost::DecodeError) -> Status {
    Status::internal(error.to_string())
}

/// Decodes messages up to `raw_above` bytes in place and passes longer ones on raw.
#[derive(Debug, Clone, Copy)]
pub struct InboundCodec {
    raw_above: usize,
}

impl InboundCodec {
    pub fn new(raw_above: usize) -> InboundCodec {
        InboundCodec { raw_above }
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
            raw_above: self.raw_above,
        }
    }
}

#[derive(Debug)]
pub struct InboundDecoder {
    raw_above: usize,
}

impl Decoder for InboundDecoder {
    type Item = Inbound;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Inbound>, Status> {
        inbound(buf, self.raw_above).map(Some)
    }
}

/// The whole message in `buf`: decoded if at most `raw_above` bytes long, else taken as it is
/// (`copy_to_bytes` of tonic's buffer splits it off without copying).
fn inbound(buf: &mut impl Buf, raw_above: usize) -> Result<Inbound, Status> {
    let len = buf.remaining();
    if len > raw_above {
        return Ok(Inbound::Raw(buf.copy_to_bytes(len)));
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
}

impl ExtProcServer {
    pub fn new(inner: ExtProc, max_message_bytes: usize) -> ExtProcServer {
        ExtProcServer {
            inner: Arc::new(inner),
            max_message_bytes,
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
    B: Body + Send + 'static,
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
        Box::pin(async move {
            // Read per stream, so a reload of `routing.heavy_body_bytes` applies to new streams.
            let raw_above = inner.raw_above();
            let mut grpc = tonic::server::Grpc::new(InboundCodec::new(raw_above))
                .apply_max_message_size_config(Some(max), Some(max));
            Ok(grpc.streaming(ProcessMethod(inner), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    /// What the decoder makes of one whole encoded message.
    fn decode_with(raw_above: usize, msg: &ProcessingRequest) -> Inbound {
        inbound(&mut Bytes::from(msg.encode_to_vec()), raw_above).unwrap()
    }

    #[test]
    fn small_messages_decode_in_place_and_long_ones_pass_raw_until_decoded() {
        let small = body_message(100);
        match decode_with(1024, &small) {
            Inbound::Decoded(msg) => assert_eq!(msg, small),
            Inbound::Raw(_) => panic!("a 100-byte body was not decoded in place"),
        }
        let long = body_message(4096);
        let inbound = decode_with(1024, &long);
        match &inbound {
            Inbound::Raw(bytes) => assert_eq!(bytes.len(), long.encoded_len()),
            Inbound::Decoded(_) => panic!("a 4 KiB body was decoded on the worker"),
        }
        assert_eq!(inbound.decode().unwrap(), long);
    }

    #[test]
    fn a_malformed_raw_message_is_an_internal_status_not_a_panic() {
        // Field 4 (request_body), length-delimited, claiming more bytes than follow.
        let garbage = Bytes::from_static(&[0x22, 0xff, 0x01, 0x00]);
        let status = Inbound::Raw(garbage).decode().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
    }
}
