//! [`NodeError`]: why a node could not start or answer, one variant per cause.

use crate::{api, config, data_dir, inventory, ledger, network, router, store, team};

/// Why a node could not start or answer.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Data directory or identity problem.
    #[error(transparent)]
    DataDir(#[from] data_dir::DataDirError),
    /// Store problem.
    #[error(transparent)]
    Store(#[from] store::StoreError),
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// Simulated GPU spec problem.
    #[error(transparent)]
    Inventory(#[from] inventory::SpecError),
    /// Swarm setup problem.
    #[error(transparent)]
    Network(#[from] network::NetworkSetupError),
    /// An address could not be bound.
    #[error("cannot listen on {addr}: {reason}. Is another gpunode running? Choose another address with --listen")]
    Listen {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The local API could not start.
    #[error(transparent)]
    Api(#[from] api::ApiError),
    /// The sandbox or job service could not start.
    #[error("cannot set up the sandbox: {0}")]
    Sandbox(String),
    /// A stream to a peer could not be opened.
    #[error("cannot open a {protocol} stream: {reason}")]
    Stream {
        /// The stream protocol.
        protocol: String,
        /// Why not.
        reason: String,
    },
    /// An exchange with a peer failed on the wire.
    #[error("{0}")]
    Exchange(#[from] std::io::Error),
    /// The ledger could not be opened.
    #[error(transparent)]
    Ledger(#[from] ledger::LedgerError),
    /// The team files could not be used.
    #[error(transparent)]
    Team(#[from] team::TeamOpError),
    /// A stream protocol could not be served.
    #[error(transparent)]
    Route(#[from] router::RouteError),
    /// The node has stopped.
    #[error("the node has stopped")]
    Stopped,
}
