//! Time on the wire: unix milliseconds, and the clock skew tolerated between peers.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the unix epoch, as carried in every wire message.
pub type UnixMillis = u64;

/// How far a peer's clock may run ahead of ours before its messages are refused.
pub const MAX_CLOCK_SKEW_MS: u64 = 30_000;

/// The current wall-clock time in unix milliseconds.
pub fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
