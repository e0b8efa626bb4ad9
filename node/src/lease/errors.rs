//! Why an operation on this node's own leases, or a lease message to a peer, failed.

use gpunode_protocol::lease::{LeaseId, Rejection};
use libp2p::PeerId;

/// Why this node could not find, record or change one of its leases.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LeaseOpError {
    /// The id prefix is too short to look up.
    #[error("lease id '{0}' is too short: give at least 4 hex digits")]
    TooShort(String),
    /// No lease has this id or prefix.
    #[error("no lease '{0}' on this node (see `gpunode leases`)")]
    Unknown(String),
    /// The prefix fits several leases.
    #[error("lease id '{0}' is ambiguous: give more digits")]
    Ambiguous(String),
    /// The lease was there a moment ago.
    #[error("lease vanished")]
    Vanished,
    /// A provider chose an id this node already holds (refused: it would overwrite it).
    #[error("the provider chose lease id {0}, which this node already holds; refused")]
    IdTaken(LeaseId),
    /// The book refused the change.
    #[error("{}", .0.message)]
    Refused(Rejection),
    /// The change could not be made durable.
    #[error("{0}")]
    Store(String),
}

/// A lease message that got no answer from its peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("peer {peer} did not answer: {reason}")]
pub struct LeaseSendError {
    /// The peer.
    pub peer: PeerId,
    /// What libp2p said.
    pub reason: String,
    /// Whether the connection failed (dial, closed, timed out, I/O) rather than the
    /// peer refusing the protocol: worth one more try on a fresh connection.
    pub transport: bool,
}
