//! Waiting for a condition: poll it with a deadline, never sleep a fixed time. Deadlines are on
//! tokio's clock, so a test with paused time sees them expire deterministically.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::HarnessError;

/// How often a condition is re-checked.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `check` every [`POLL_INTERVAL`] until it returns `Some`, for at most `timeout`;
/// `what` names the condition in the error.
pub async fn poll_until<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut check: F,
) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::Timeout {
                what: what.into(),
                timeout,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// [`poll_until`] for tests: panics with the condition's name when it times out.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll_until(what, timeout, check)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Polls `url` until it answers 2xx, for at most `timeout`.
pub async fn wait_http(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(), HarnessError> {
    poll_until(&format!("{url} to answer 2xx"), timeout, || async {
        let r = client.get(url).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn polls_until_the_condition_holds_and_times_out_with_its_name() {
        let mut calls = 0;
        let got = poll_until("three calls", Duration::from_secs(1), || {
            calls += 1;
            let n = calls;
            async move { (n == 3).then_some(n) }
        })
        .await
        .unwrap();
        assert_eq!(got, 3);

        let err = poll_until("never", Duration::ZERO, || async { None::<()> })
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "timed out after 0ns waiting for never");
    }
}
