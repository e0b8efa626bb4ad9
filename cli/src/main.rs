//! `gpunode`: share GPUs peer to peer.
//!
//! The binary is thin: it parses flags (clap, in [`args`]), folds them over the config
//! file, and calls into `gpunode-node` from one module per command group ([`cmd`]).
//! Whether a command talks to the daemon over the local API socket or starts a node
//! in this process is decided in [`target`]. Errors are printed once, with their
//! causes, and exit with code 2.

mod args;
mod cmd;
mod helpers;
mod output;
mod systemd;
mod target;

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use gpunode_node::DataDir;

use crate::args::{Cli, Command, LeaseCommand, ReservationAction, ReservationsArgs};

/// jemalloc for a daemon (`gpunode serve`), glibc's for the short commands and the sandbox
/// workers ([`gpunode_node::allocator`] says why).
#[global_allocator]
static HEAP: gpunode_node::allocator::Heap =
    gpunode_node::allocator::Heap::new(gpunode_node::allocator::Rule::WhenArgument("serve"));

fn main() -> ExitCode {
    // A provider runs each wasm task in a child process of this same binary.
    if std::env::args().nth(1).as_deref() == Some(gpunode_sandbox::wasm::worker::WORKER_ARG) {
        std::process::exit(gpunode_sandbox::wasm::worker::worker_main());
    }
    gpunode_node::heap::limit_arenas();
    let cli = Cli::parse();
    let mut builder = if talks_to_a_daemon(&cli) {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(dispatch(cli)) {
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

/// Runs the command the flags name.
async fn dispatch(cli: Cli) -> Result<ExitCode> {
    // Neither needs a data dir or a config.
    match &cli.command {
        Command::Completions { shell } => return cmd::docs::completions(*shell),
        Command::Man { dir } => return cmd::docs::man(dir.as_deref()),
        _ => {}
    }
    let data_dir = match &cli.data_dir {
        Some(d) => DataDir::new(d),
        None => DataDir::default_location()?,
    };
    if let Command::Doctor(args) = &cli.command {
        // Reads the config itself: one that does not load is a failed check there.
        return cmd::doctor::doctor(data_dir, cli.config.as_deref(), args).await;
    }
    let config = helpers::load_config(cli.config.as_deref())?;
    match cli.command {
        Command::Completions { .. } | Command::Man { .. } | Command::Doctor(_) => {
            unreachable!("handled above")
        }
        Command::Serve(args) => cmd::serve::serve(data_dir, config, args).await,
        Command::Offers(args) => cmd::offers::offers(data_dir, config, args).await,
        Command::Status(args) => cmd::status::status(data_dir, args).await,
        Command::Dashboard { no_open } => cmd::status::dashboard(data_dir, no_open).await,
        Command::Id => cmd::status::id(&data_dir),
        Command::Lease(LeaseCommand::Request(args)) => {
            cmd::lease::request(data_dir, config, args).await
        }
        Command::Lease(LeaseCommand::Renew(args)) => {
            cmd::lease::renew(data_dir, config, args).await
        }
        Command::Lease(LeaseCommand::Cancel(args)) => {
            cmd::lease::cancel(data_dir, config, args).await
        }
        Command::Leases(args) => cmd::lease::leases(data_dir, config, args).await,
        Command::Reserve(args) => cmd::lease::request(data_dir, config, args.into()).await,
        Command::Reservations(ReservationsArgs { action, json }) => match action {
            Some(ReservationAction::Cancel(args)) => {
                cmd::lease::cancel(data_dir, config, args).await
            }
            Some(ReservationAction::Renew(args)) => cmd::lease::renew(data_dir, config, args).await,
            None => cmd::lease::reservations(data_dir, config, json).await,
        },
        Command::Run(args) => cmd::run::run(data_dir, config, args).await,
        Command::Jobs(args) => cmd::jobs::jobs(data_dir, args.json).await,
        Command::Logs(args) => cmd::jobs::logs(data_dir, args).await,
        Command::Cancel(args) => cmd::jobs::cancel(data_dir, args).await,
        Command::Why(args) => cmd::jobs::why(data_dir, args).await,
        Command::Ledger(args) => cmd::ledger::ledger(data_dir, config, args).await,
        Command::Peers(args) => cmd::ledger::peers(data_dir, config, args.json).await,
        Command::Team(team) => cmd::team::team(data_dir, team).await,
    }
}

/// Whether this command is a client of a running daemon: it then runs on one thread, so
/// its calls to the daemon do not hop between threads (each hop a wake-up; about 0.8 ms
/// of a `gpunode run`). The daemon itself, and a command that runs a node in this
/// process because no daemon is running, get a thread per core: they serve peers and
/// move data.
fn talks_to_a_daemon(cli: &Cli) -> bool {
    if matches!(cli.command, Command::Serve(_)) {
        return false;
    }
    let data_dir = match &cli.data_dir {
        Some(d) => DataDir::new(d),
        None => match DataDir::default_location() {
            Ok(d) => d,
            Err(_) => return false,
        },
    };
    data_dir.api_socket().exists()
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
