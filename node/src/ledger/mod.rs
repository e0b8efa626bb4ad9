//! The node's side of the ledger: the crate `gpunode-ledger` (chain, balances,
//! reputation, meters; re-exported here) plus what needs the node: [`accounts`] (the
//! credit rules lease admission uses), [`claims`] (making, answering and resolving
//! claims), [`checks`] (whether a receipt agrees with the lease it bills), [`settle`]
//! (the settlement protocol) and [`views`] (what `gpunode ledger` and `peers` show).

pub use gpunode_ledger::*;

pub mod accounts;
pub mod checks;
pub mod claims;
pub mod settle;
pub mod views;
