//! Wire types, ids, canonical encoding and signatures shared by every gpunode crate.
//!
//! This crate owns what crosses the wire and what gets signed: it has no I/O, no tokio
//! and never imports the node. Everything that decodes bytes from a peer enforces a size
//! limit before allocating and returns a typed error instead of panicking.

pub mod advert;
pub mod encoding;
pub mod gpu;
pub mod job;
pub mod lease;
pub mod receipt;
pub mod signing;
pub mod team;
pub mod time;
pub mod units;

pub use libp2p_identity::{Keypair, PeerId, PublicKey};
