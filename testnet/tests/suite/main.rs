//! Networks of real nodes on 127.0.0.1, one test binary for all of them (each binary
//! links libp2p and wasmtime, so one binary instead of seven saves gigabytes of disk
//! and minutes of linking).

mod containers;
mod discovery;
mod history;
mod hostile_peers;
mod jobs;
mod leases;
mod ledger;
mod ledger_crash;
mod owner;
mod reservations;
mod teams;
mod waiting;

/// Waits until `check` holds, looking every 100 ms; fails the test, naming `what`, once
/// `bound` has passed.
async fn eventually(what: &str, bound: std::time::Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + bound;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {bound:?}: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
