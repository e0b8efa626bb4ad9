//! The node's side of teams: the crate `gpunode-team` (membership state, certificates,
//! revocations, invites, policy; re-exported here) plus what needs the network:
//! [`service`] answers joins, keeps members' knowledge in sync and renews certificates;
//! [`join`] is the joiner's side.

pub use gpunode_team::*;

pub mod join;
pub mod service;
