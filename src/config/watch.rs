//! Hot reload: poll the config file and report each changed version.
//!
//! Polling (rather than inotify) sees every way a file can change, including the atomic rename
//! editors and Kubernetes ConfigMap mounts use, and costs one small read per interval.

use std::path::PathBuf;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use super::{Config, LoadError};

/// A version that loaded but that the caller could not apply (it names a file not there yet:
/// a Secret mounted after its ConfigMap) is offered again this often (at least every
/// interval) while the file's text stays the same.
pub const RETRY_FAILED_APPLY: Duration = Duration::from_secs(5);

/// Checks `path` every `interval` and calls `on_change` with the parsed, validated config each
/// time its content changes (or with the error when the new content is invalid; the caller keeps
/// the previous config then). `on_change` returns whether the version is settled: `false` (it
/// could not be applied) offers the same version again after [`RETRY_FAILED_APPLY`]. Runs
/// until the returned task is aborted.
///
/// `initial_text` is the content already loaded, so the first poll does not report it again.
pub fn spawn_poller<F>(
    path: PathBuf,
    interval: Duration,
    initial_text: &str,
    on_change: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut(Result<Config, LoadError>) -> bool + Send + 'static,
{
    spawn_poller_with(
        path,
        interval,
        initial_text,
        Config::parse_and_validate,
        on_change,
    )
}

/// [`spawn_poller`] with the file's text turned into a config by `load` (text, origin), e.g.
/// [`Config::parse_adjust_validate`] with command-line overrides.
pub fn spawn_poller_with<F, L>(
    path: PathBuf,
    interval: Duration,
    initial_text: &str,
    load: L,
    mut on_change: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut(Result<Config, LoadError>) -> bool + Send + 'static,
    L: Fn(&str, &str) -> Result<Config, LoadError> + Send + 'static,
{
    let mut last_hash = xxh3_64(initial_text.as_bytes());
    // When the last version offered was not settled: when to offer it again.
    let mut retry_at: Option<tokio::time::Instant> = None;
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await; // the first tick is immediate; the file was just read
        loop {
            ticker.tick().await;
            let text = match tokio::fs::read_to_string(&path).await {
                Ok(text) => text,
                Err(source) => {
                    // A missing file mid-rename is normal; report it once per distinct state.
                    let hash = 0;
                    if hash != last_hash {
                        last_hash = hash;
                        retry_at = None;
                        on_change(Err(LoadError::Read {
                            path: path.display().to_string(),
                            source,
                        }));
                    }
                    continue;
                }
            };
            let hash = xxh3_64(text.as_bytes());
            let due = retry_at.is_some_and(|at| tokio::time::Instant::now() >= at);
            if hash == last_hash && !due {
                continue;
            }
            last_hash = hash;
            retry_at = None;
            if !on_change(load(&text, &path.display().to_string())) {
                retry_at = Some(tokio::time::Instant::now() + RETRY_FAILED_APPLY.max(interval));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const V1: &str = "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:1'}]}]";
    const V2: &str = "pools: [{name: a, models: [m], endpoints: [{address: '127.0.0.1:2'}]}]";

    #[tokio::test]
    async fn reports_changes_and_errors_but_not_unchanged_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, V1).unwrap();
        let seen: Arc<Mutex<Vec<Result<u16, String>>>> = Arc::default();
        let sink = seen.clone();
        let task = spawn_poller(path.clone(), Duration::from_millis(10), V1, move |r| {
            sink.lock().unwrap().push(
                r.map(|c| c.resolved_endpoints()[0].address.port())
                    .map_err(|e| e.to_string()),
            );
            true
        });
        let wait_for = |n: usize| {
            let seen = seen.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while seen.lock().unwrap().len() < n {
                    assert!(tokio::time::Instant::now() < deadline, "no reload seen");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        std::fs::write(&path, V2).unwrap();
        wait_for(1).await;
        std::fs::write(&path, "pools: [{name: a, endpoints: [{address: nope}]}]").unwrap();
        wait_for(2).await;
        task.abort();
        let seen = seen.lock().unwrap();
        // The unchanged initial content (port 1) is never reported: the first report is V2.
        assert_eq!(seen[0], Ok(2));
        let err = seen[1].as_ref().unwrap_err();
        assert!(err.contains("pools[0].endpoints[0].address"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_version_that_could_not_be_applied_is_offered_again_until_it_is() {
        // The text stays the same; what it names appears later (a Secret after its ConfigMap):
        // the caller's apply fails twice, then succeeds, and the version is offered no more.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, V1).unwrap();
        let offered = Arc::new(Mutex::new(0u32));
        let count = offered.clone();
        let task = spawn_poller(path.clone(), Duration::from_millis(100), V1, move |r| {
            assert!(r.is_ok());
            let mut n = count.lock().unwrap();
            *n += 1;
            *n >= 3
        });
        std::fs::write(&path, V2).unwrap();
        // Paused clock: each advance runs the poller's ticks up to it (file reads are real).
        for _ in 0..200 {
            tokio::time::advance(Duration::from_millis(100)).await;
            tokio::task::yield_now().await;
            if *offered.lock().unwrap() >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(*offered.lock().unwrap(), 3, "offered until applied");
        // Three retry periods in the same steps as above, so the poller's reads get their
        // turns (one advance would let it tick once, and a wrong re-offer could not show).
        let steps = RETRY_FAILED_APPLY.as_millis() * 3 / 100;
        for _ in 0..steps {
            tokio::time::advance(Duration::from_millis(100)).await;
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        task.abort();
        assert_eq!(*offered.lock().unwrap(), 3, "settled: not offered again");
    }
}
