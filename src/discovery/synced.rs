//! [`Published`]: a sink in front of the router's that remembers which sources have published
//! at least once, so `serve` reports ready only after every Kubernetes source has listed its
//! pods (as the reference endpoint picker waits for its pool).

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::sync::watch;

use super::{EndpointSink, SetChange};
use crate::config::ResolvedEndpoint;

/// Forwards to another sink and keeps the set of sources that have published.
pub struct Published {
    inner: Arc<dyn EndpointSink>,
    keys: watch::Sender<BTreeSet<String>>,
}

impl std::fmt::Debug for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published")
            .field("keys", &*self.keys.borrow())
            .finish()
    }
}

impl Published {
    /// In front of `inner`.
    pub fn new(inner: Arc<dyn EndpointSink>) -> Published {
        Published {
            inner,
            keys: watch::Sender::new(BTreeSet::new()),
        }
    }

    /// Whether every source in `keys` has published (and not been removed since).
    pub fn all_published(&self, keys: &[String]) -> bool {
        let published = self.keys.borrow();
        keys.iter().all(|k| published.contains(k))
    }

    /// Notified after every publish or removal.
    pub fn subscribe(&self) -> watch::Receiver<BTreeSet<String>> {
        self.keys.subscribe()
    }
}

impl EndpointSink for Published {
    fn publish(&self, source: &str, endpoints: Vec<ResolvedEndpoint>) -> SetChange {
        let change = self.inner.publish(source, endpoints);
        self.keys
            .send_if_modified(|keys| keys.insert(source.to_string()));
        change
    }

    fn remove(&self, source: &str) -> SetChange {
        let change = self.inner.remove(source);
        self.keys.send_if_modified(|keys| keys.remove(source));
        change
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Registry;

    #[test]
    fn remembers_who_published_until_removed() {
        let reg = Arc::new(Registry::new(&[]));
        let p = Published::new(reg.clone());
        let keys = vec!["kubernetes:a".to_string()];
        assert!(!p.all_published(&keys));
        assert!(p.all_published(&[]));
        p.publish("kubernetes:a", Vec::new());
        assert!(p.all_published(&keys));
        assert_eq!(
            reg.sources(),
            vec!["kubernetes:a".to_string(), "static".into()]
        );
        p.remove("kubernetes:a");
        assert!(!p.all_published(&keys));
    }
}
