//! Rate-limited decision log, one per VM. Every connection and DNS decision goes through
//! [`DecisionLog::record`]; a token bucket bounds how many lines a guest can cause, and the
//! first line after a dry spell says how many decisions were suppressed. Lines carry the
//! host, port, kind and verdict, never payloads or secret values.

use std::sync::Mutex;
use std::time::Instant;

use crate::policy::DenyReason;

/// How a decision was reached.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Tls,
    Http,
    Tcp,
    Dns,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Tls => "tls",
            Kind::Http => "http",
            Kind::Tcp => "tcp",
            Kind::Dns => "dns",
        }
    }
}

struct Bucket {
    tokens: f64,
    last: Instant,
    suppressed: u64,
}

/// Per-VM token bucket in front of `tracing`. The mutex guards only the bucket counters.
pub(crate) struct DecisionLog {
    vm: String,
    burst: f64,
    per_second: f64,
    bucket: Mutex<Bucket>,
}

impl DecisionLog {
    pub(crate) fn new(vm: &str, burst: u32, per_second: u32) -> Self {
        DecisionLog {
            vm: vm.to_string(),
            burst: f64::from(burst.max(1)),
            per_second: f64::from(per_second),
            bucket: Mutex::new(Bucket {
                tokens: f64::from(burst.max(1)),
                last: Instant::now(),
                suppressed: 0,
            }),
        }
    }

    /// Takes a token; returns `Some(suppressed_before)` when this line may be written.
    fn admit(&self) -> Option<u64> {
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(b.last).as_secs_f64() * self.per_second;
        b.tokens = (b.tokens + refill).min(self.burst);
        b.last = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Some(std::mem::take(&mut b.suppressed))
        } else {
            b.suppressed += 1;
            None
        }
    }

    /// Logs one decision. `host` is the name decided on (SNI, Host, query name) if any.
    pub(crate) fn record(
        &self,
        kind: Kind,
        host: Option<&str>,
        dst: Option<std::net::SocketAddrV4>,
        verdict: Result<(), DenyReason>,
    ) {
        let Some(suppressed) = self.admit() else {
            return;
        };
        if suppressed > 0 {
            tracing::warn!(
                target: "warren_egress::decision",
                vm = %self.vm,
                suppressed,
                "{suppressed} egress decisions suppressed"
            );
        }
        let host = host.unwrap_or("-");
        let dst = dst.map(|d| d.to_string()).unwrap_or_else(|| "-".into());
        match verdict {
            Ok(()) => tracing::info!(
                target: "warren_egress::decision",
                vm = %self.vm, kind = kind.as_str(), host, dst = %dst, verdict = "allow",
                "egress allowed"
            ),
            Err(reason) => tracing::info!(
                target: "warren_egress::decision",
                vm = %self.vm, kind = kind.as_str(), host, dst = %dst, verdict = "deny",
                reason = reason.as_str(),
                "egress denied"
            ),
        }
    }

    /// Logs a blocked placeholder (a security event): secret name and host only.
    pub(crate) fn secret_blocked(&self, secret: &str, host: &str) {
        if self.admit().is_some() {
            tracing::warn!(
                target: "warren_egress::decision",
                vm = %self.vm, secret, host, verdict = "deny",
                reason = DenyReason::SecretOutOfScope.as_str(),
                "placeholder sent to a host outside its scope; request blocked"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bucket_suppresses_after_burst_and_counts() {
        let log = DecisionLog::new("vm", 3, 0);
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), None);
        assert_eq!(log.admit(), None);
        // Refill by hand: the next admitted line reports the two suppressed ones.
        log.bucket.lock().expect("lock").tokens = 1.0;
        assert_eq!(log.admit(), Some(2));
    }
}
