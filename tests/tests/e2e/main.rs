//! End-to-end tests of the `gpunode` binary as users run it, one test binary for all of
//! them (each binary links libp2p and wasmtime; one instead of eight saves gigabytes of
//! disk and minutes of linking).

mod common;

mod bad_input;
mod container;
mod dashboard;
mod doctor;
mod interop;
mod lease;
mod ledger;
mod mdns;
mod nat;
mod packaging;
mod run;
mod serve;
mod team;
