//! Leases on the node side.
//!
//! [`book::LeaseBook`] is the state machine (request -> offered -> active -> completed |
//! expired | cancelled | failed), plain code driven by messages and `now`, unit-tested
//! without a network; it never over-commits because every change goes through it on
//! the event loop. [`desk`] takes every admission decision around it (lending hours, team
//! policy, credit, the queue, preemption, owner rules) and says what follows. [`codec`] puts lease messages on a libp2p request-response stream
//! with hard size limits. [`negotiate`] is the requester's side of a negotiation.
//! [`turns`] tells a queued requester when GPUs freed for it.

pub mod book;
pub mod codec;
pub mod desk;
pub mod errors;
pub mod negotiate;
pub mod persist;
pub mod policy;
pub mod turns;

pub use book::{LeaseBook, LeaseRecord, LeaseRole, LeaseState};
pub use desk::{Effects, LeaseDesk, Standings};
pub use errors::{LeaseOpError, LeaseSendError};
pub use negotiate::describe_place;
pub use policy::{Capacity, GpuSlot, LeasePolicy};
