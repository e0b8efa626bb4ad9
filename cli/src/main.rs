//! `gpunode`: share GPUs peer to peer.
//!
//! The binary is thin: it parses flags (clap), folds them over the config file, and
//! calls into `gpunode-node`. Commands that need the daemon talk to it over the local
//! API socket; `offers` starts a short-lived client node when no daemon runs. Errors are
//! printed once, with their causes, and exit with code 2.

mod args;
mod commands;
mod jobs;
mod ledger;
mod output;
mod team;

use std::process::ExitCode;

use args::{
    Cli, Command, JobArgs, LeaseCancelArgs, LeaseCommand, LeaseRenewArgs, LeaseRequestArgs,
    LeasesArgs, LedgerAction, LedgerArgs, LogsArgs, NetworkArgs, OffersArgs, PolicyAction,
    ReservationAction, ReservationsArgs, RunArgs, ServeArgs, StatusArgs, TeamCommand, WhyArgs,
};
use clap::Parser;

fn main() -> ExitCode {
    // A provider runs each wasm task in a child process of this same binary.
    if std::env::args().nth(1).as_deref() == Some(gpunode_sandbox::wasm::worker::WORKER_ARG) {
        std::process::exit(gpunode_sandbox::wasm::worker::worker_main());
    }
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(err) => {
            if is_broken_pipe(&err) {
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(2)
        }
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
