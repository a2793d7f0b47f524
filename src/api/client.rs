//! The client side of the admin API, as `kvrouter explain --admin URL` uses it.

use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use super::pb;
use crate::router::Explanation;

/// Explains `body` (sent to `path`, as `tenant`) on the router whose admin address is `url`
/// (`http://host:port`), presenting `token` if given. Errors are messages for the terminal.
pub async fn explain(
    url: &str,
    token: Option<&str>,
    body: Vec<u8>,
    path: &str,
    tenant: Option<&str>,
) -> Result<Explanation, String> {
    let channel = Channel::from_shared(url.trim_end_matches('/').to_string())
        .map_err(|e| format!("{url}: {e}"))?
        .connect()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let mut request = tonic::Request::new(pb::ExplainRequest {
        body,
        path: path.to_string(),
        tenant: tenant.map(str::to_string),
    });
    if let Some(token) = token {
        let value: MetadataValue<_> = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the admin token holds characters a header cannot carry".to_string())?;
        request.metadata_mut().insert("authorization", value);
    }
    let mut client = pb::admin_client::AdminClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    match client.explain(request).await {
        Ok(r) => Ok(super::explanation_from_pb(r.into_inner())),
        Err(status) => Err(format!("{} ({:?})", status.message(), status.code())),
    }
}
