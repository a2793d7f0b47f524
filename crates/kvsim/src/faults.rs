//! HTTP-level faults a replica has been told to show: an injected failure for generation
//! requests (`POST /admin/fail`) and the down time of a simulated restart. The replica owns
//! this state; the request handlers ask it whether to refuse, the admin handlers change it.
//! Durations are real (tokio) time, not divided by `time_scale`.

use std::time::Duration;

use axum::http::StatusCode;
use tokio::time::Instant;

/// How a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The response status.
    pub status: StatusCode,
    /// The error message.
    pub message: String,
}

/// The faults in force. Default: none.
#[derive(Debug, Default)]
pub struct Faults {
    fail: Option<FailFault>,
    down_until: Option<Instant>,
}

#[derive(Debug)]
struct FailFault {
    status: StatusCode,
    remaining: Option<u64>,
    until: Option<Instant>,
    message: String,
}

impl Faults {
    /// A 503 while the replica is "restarting" (every non-admin route answers it).
    pub fn down(&mut self) -> Option<Refusal> {
        match self.down_until {
            Some(t) if Instant::now() < t => Some(Refusal {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the replica is restarting".into(),
            }),
            Some(_) => {
                self.down_until = None;
                None
            }
            None => None,
        }
    }

    /// The refusal for the next generation request, if any: the down time first, then the
    /// injected failure (whose count this consumes).
    pub fn refuse_generation(&mut self) -> Option<Refusal> {
        if let Some(refusal) = self.down() {
            return Some(refusal);
        }
        let fail = self.fail.as_mut()?;
        let expired = fail.until.is_some_and(|t| Instant::now() >= t) || fail.remaining == Some(0);
        if expired {
            self.fail = None;
            return None;
        }
        if let Some(n) = &mut fail.remaining {
            *n -= 1;
        }
        Some(Refusal {
            status: fail.status,
            message: fail.message.clone(),
        })
    }

    /// Fails generation requests with `status` and `message`: the next `count` of them (all
    /// when `None`), for `duration` (until cleared when `None`).
    pub fn fail(
        &mut self,
        status: StatusCode,
        count: Option<u64>,
        duration: Option<Duration>,
        message: String,
    ) {
        self.fail = Some(FailFault {
            status,
            remaining: count,
            until: duration.map(|d| Instant::now() + d),
            message,
        });
    }

    /// Stops failing requests.
    pub fn clear_fail(&mut self) {
        self.fail = None;
    }

    /// A restart: the injected failure is dropped and every non-admin route answers 503 for
    /// `down` (nothing when zero).
    pub fn restart(&mut self, down: Duration) {
        self.fail = None;
        self.down_until = (!down.is_zero()).then(|| Instant::now() + down);
    }

    /// The injected failure's status and remaining count, for the admin state report.
    pub fn failing(&self) -> Option<(u16, Option<u64>)> {
        self.fail.as_ref().map(|f| (f.status.as_u16(), f.remaining))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn counted_and_timed_failures_expire() {
        let mut f = Faults::default();
        assert_eq!(f.refuse_generation(), None);
        f.fail(StatusCode::BAD_GATEWAY, Some(2), None, "boom".into());
        assert_eq!(f.failing(), Some((502, Some(2))));
        for _ in 0..2 {
            assert_eq!(
                f.refuse_generation().map(|r| r.status),
                Some(StatusCode::BAD_GATEWAY)
            );
        }
        assert_eq!(f.refuse_generation(), None, "the count is used up");
        assert_eq!(f.failing(), None);

        f.fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            Some(Duration::from_secs(1)),
            "x".into(),
        );
        assert!(f.refuse_generation().is_some());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(f.refuse_generation(), None, "the duration is over");

        f.fail(StatusCode::INTERNAL_SERVER_ERROR, None, None, "x".into());
        f.restart(Duration::from_millis(500));
        assert_eq!(
            f.refuse_generation().map(|r| r.status),
            Some(StatusCode::SERVICE_UNAVAILABLE)
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(f.down(), None);
        assert_eq!(f.refuse_generation(), None, "a restart clears the failure");
    }
}
