//! List + watch of one collection, kept as a map of its objects by name: the API server's
//! protocol for following a set of objects.
//!
//! 1. **List** the collection (pages of 500), remember the list's `resourceVersion`.
//! 2. **Watch** from that version (`allowWatchBookmarks`, `timeoutSeconds=290`): each line is an
//!    event `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`. Object events edit
//!    the map and advance the version; a bookmark only advances it.
//! 3. The server ends a watch after its timeout: watch again from the last version. A watch
//!    that fails on the way (connection reset, a silent connection past the timeout) is retried
//!    from the last version after a backoff.
//! 4. **410 Gone** (an `ERROR` event with code 410, or the watch request's own status): the
//!    version is too old for the server's history; list again (the map is replaced whole).
//!
//! The callback sees the whole map after the list and after every event that changed it.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::client::ApiClient;
use super::KubeError;

/// The server ends each watch after this many seconds (it may end it sooner).
const WATCH_TIMEOUT_S: u64 = 290;
/// A watch silent this much longer than its timeout is dead (no bookmark, no end).
const WATCH_GRACE: Duration = Duration::from_secs(30);
/// Objects per list page.
const PAGE_LIMIT: u32 = 500;
/// First and longest wait after a failed list or watch.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A watch that ends sooner than this without an event is taken as a failure (as client-go's
/// reflector takes a very short watch): a proxy answering and closing at once must not make a
/// request loop.
const SHORT_WATCH: Duration = Duration::from_secs(1);

/// An object kept by a [`Reflector`].
pub trait Object: DeserializeOwned + Send + Sync + 'static {
    /// Its name (unique in the watched collection).
    fn name(&self) -> &str;
}

/// Follows one collection (`path`, e.g. `/api/v1/namespaces/llm/pods`, narrowed by `query`,
/// e.g. `labelSelector=app%3Dqwen3-8b`).
#[derive(Debug)]
pub struct Reflector {
    client: ApiClient,
    path: String,
    query: String,
}

#[derive(Deserialize)]
struct List<T> {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(default = "Vec::new")]
    items: Vec<T>,
}

#[derive(Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct ListMeta {
    resource_version: String,
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    object: serde_json::Value,
}

/// Why a watch stopped.
enum Ended {
    /// The server ended it (its timeout): watch again from the last version. With the events
    /// it delivered.
    Closed { events: usize },
    /// 410 Gone: list again.
    Expired,
}

impl Reflector {
    /// A reflector over `path?query`.
    pub fn new(client: ApiClient, path: String, query: String) -> Reflector {
        Reflector {
            client,
            path,
            query,
        }
    }

    fn url(&self, extra: &str) -> String {
        let mut q = self.query.clone();
        if !q.is_empty() && !extra.is_empty() {
            q.push('&');
        }
        q.push_str(extra);
        format!("{}?{q}", self.path)
    }

    /// Runs until dropped, calling `on_change` with every object after each list and each event
    /// that changed the map. Errors are logged and retried with backoff; never returns.
    pub async fn run<T: Object>(&self, mut on_change: impl FnMut(&BTreeMap<String, T>)) {
        let mut backoff = BACKOFF_MIN;
        let mut objects: BTreeMap<String, T> = BTreeMap::new();
        'list: loop {
            let mut version = match self.list(&mut objects).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(path = %self.path, error = %e, retry_in = ?backoff, "Kubernetes list failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            };
            backoff = BACKOFF_MIN;
            on_change(&objects);
            loop {
                let started = tokio::time::Instant::now();
                match self.watch(&mut version, &mut objects, &mut on_change).await {
                    Ok(Ended::Closed { events: 0 }) if started.elapsed() < SHORT_WATCH => {
                        tracing::warn!(path = %self.path, retry_in = ?backoff, "Kubernetes watch ended at once; resuming after a backoff");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                    Ok(Ended::Closed { .. }) => backoff = BACKOFF_MIN,
                    Ok(Ended::Expired) => {
                        tracing::info!(path = %self.path, %version, "watch expired (410 Gone); listing again");
                        continue 'list;
                    }
                    Err(KubeError::Status { code: 410, .. }) => continue 'list,
                    Err(e) => {
                        tracing::warn!(path = %self.path, error = %e, retry_in = ?backoff, "Kubernetes watch failed; resuming from resourceVersion {version}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                    }
                }
            }
        }
    }

    /// Lists every page into `objects` (replacing it); returns the list's version.
    async fn list<T: Object>(
        &self,
        objects: &mut BTreeMap<String, T>,
    ) -> Result<String, KubeError> {
        let mut fresh = BTreeMap::new();
        let mut token: Option<String> = None;
        loop {
            let mut extra = format!("limit={PAGE_LIMIT}");
            if let Some(t) = &token {
                extra.push_str(&format!("&continue={}", encode(t)));
            }
            let body = self.client.get(&self.url(&extra)).await?;
            let page: List<T> = serde_json::from_slice(&body)
                .map_err(|e| KubeError::Protocol(format!("list {}: {e}", self.path)))?;
            for item in page.items {
                fresh.insert(item.name().to_string(), item);
            }
            match page.metadata.continue_token.filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t),
                None => {
                    *objects = fresh;
                    return Ok(page.metadata.resource_version);
                }
            }
        }
    }

    /// One watch from `version`, applying its events until it ends.
    async fn watch<T: Object>(
        &self,
        version: &mut String,
        objects: &mut BTreeMap<String, T>,
        on_change: &mut impl FnMut(&BTreeMap<String, T>),
    ) -> Result<Ended, KubeError> {
        let extra = format!(
            "watch=true&allowWatchBookmarks=true&timeoutSeconds={WATCH_TIMEOUT_S}&resourceVersion={}",
            encode(version)
        );
        let mut lines = self.client.watch(&self.url(&extra)).await?;
        let idle = Duration::from_secs(WATCH_TIMEOUT_S) + WATCH_GRACE;
        let mut events = 0;
        loop {
            let line = tokio::time::timeout(idle, lines.next_line())
                .await
                .map_err(|_| KubeError::Transport(format!("watch silent for {idle:?}")))??;
            let Some(line) = line else {
                return Ok(Ended::Closed { events });
            };
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let event: Event = serde_json::from_slice(&line)
                .map_err(|e| KubeError::Protocol(format!("watch {}: {e}", self.path)))?;
            events += 1;
            let event_version = event.object["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_string);
            match event.kind.as_str() {
                "ADDED" | "MODIFIED" | "DELETED" => {
                    let object: T = serde_json::from_value(event.object).map_err(|e| {
                        KubeError::Protocol(format!(
                            "watch {}: {} event: {e}",
                            self.path, event.kind
                        ))
                    })?;
                    if event.kind == "DELETED" {
                        objects.remove(object.name());
                    } else {
                        objects.insert(object.name().to_string(), object);
                    }
                    if let Some(v) = event_version {
                        *version = v;
                    }
                    on_change(objects);
                }
                "BOOKMARK" => {
                    if let Some(v) = event_version {
                        *version = v;
                    }
                }
                "ERROR" => {
                    let code = event.object["code"].as_u64().unwrap_or(0);
                    if code == 410 {
                        return Ok(Ended::Expired);
                    }
                    return Err(KubeError::Status {
                        code: u16::try_from(code).unwrap_or(0),
                        message: event.object["message"]
                            .as_str()
                            .unwrap_or("watch error")
                            .to_string(),
                    });
                }
                other => {
                    tracing::debug!(path = %self.path, kind = other, "ignoring a watch event of unknown type")
                }
            }
        }
    }
}

/// Percent-encodes a query value (RFC 3986 unreserved characters pass through).
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            super::encode("app=qwen3-8b,tier in (gpu)"),
            "app%3Dqwen3-8b%2Ctier%20in%20%28gpu%29"
        );
    }
}
