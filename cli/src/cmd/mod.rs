//! One module per command group; each takes the parsed flags and does the work,
//! through [`crate::target::Target`] when it needs the daemon or a node.

pub mod docs;
pub mod doctor;
pub mod follow;
pub mod jobs;
pub mod lease;
pub mod ledger;
pub mod offers;
pub mod run;
pub mod serve;
pub mod status;
pub mod team;
