//! The provider's side of fair sharing, as pure logic with the clock passed in.
//!
//! A provider keeps one [`Queue`] of lease requests it cannot grant yet. Each time a
//! requester asks again (or capacity changes) the provider makes a [`Plan`]: the queue
//! in policy order, each request placed on the provider's GPU timeline at the earliest
//! time it fits without delaying any request ranked above it or any reservation
//! (conservative backfill). Requests the plan starts now are granted; the others get
//! their position and estimated start. [`FairShare`] keeps each user's recent usage,
//! halving every half-life. Nothing here does I/O, so the node and the trace replay
//! run exactly the same rules.

pub mod fair_share;
pub mod plan;
pub mod queue;

pub use fair_share::FairShare;
pub use plan::{GpuTimeline, Placement, Plan};
pub use queue::{Order, Queue, Rank, Request, Standing, Ticket};

/// Milliseconds since the unix epoch (or since any fixed origin, in simulations).
pub type Millis = u64;

/// "in 3m 20s" style duration for explanations.
pub fn human_duration(ms: u64) -> String {
    let s = ms.div_ceil(1000);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}
