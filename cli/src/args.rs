//! The command line: every flag, subcommand and help text (clap derive types). Flags
//! that several commands share are defined once here and flattened into each.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Share idle GPUs with peers, and run work on theirs, without any central server.
#[derive(Debug, Parser)]
#[command(name = "gpunode", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// Data directory holding identity key, store and control socket
    /// [default: ~/.local/share/gpunode].
    #[arg(long, global = true, env = "GPUNODE_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Config file (TOML) [default: ~/.config/gpunode/config.toml].
    #[arg(long, global = true, env = "GPUNODE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node that lends this machine's idle GPUs (runs until Ctrl-C or SIGTERM).
    Serve(ServeArgs),
    /// List providers currently offering matching resources.
    Offers(OffersArgs),
    /// Show the local node: peer id, addresses, peers, advert and GPUs.
    Status(StatusArgs),
    /// Print this node's peer id (creating the identity on first use).
    Id,
    /// Negotiate, renew or cancel a GPU lease.
    #[command(subcommand)]
    Lease(LeaseCommand),
    /// List leases on this node, as provider and as requester.
    Leases(LeasesArgs),
    /// Book GPUs for later: a signed lease that starts at --at and lasts --for; run jobs
    /// in it with `gpunode run --reservation ID`.
    Reserve(ReserveArgs),
    /// List your reservations (leases that start later); cancel or renew one.
    Reservations(ReservationsArgs),
    /// Run a WASI task (.wasm or .wat) on a provider: output streams back live, output
    /// files land in --output, and the exit code is the task's.
    Run(RunArgs),
    /// List jobs submitted through the daemon.
    Jobs(JobsArgs),
    /// Print a job's output (stdout and stderr).
    Logs(LogsArgs),
    /// Stop a running job.
    Cancel(JobArgs),
    /// Why a job is not running (yet): what each provider said, and what would help.
    Why(WhyArgs),
    /// Credits: balance, balance with each peer, recent entries; verify or export the
    /// hash-chained ledger.
    Ledger(LedgerArgs),
    /// Known peers with reputation, jobs done for us, failures, disputes and balance.
    Peers(PeersArgs),
    /// Check this machine's setup (data dir, config, network route, how peers see this
    /// node, bootstrap peers, clocks, bubblewrap, cgroups, NVML, team certificate) and
    /// print the exact fix for each problem; exits 1 when a check fails.
    Doctor(DoctorArgs),
    /// Print the link to this machine's web dashboard (and open it where $BROWSER is set).
    Dashboard {
        /// Only print the link, even where a browser is configured.
        #[arg(long)]
        no_open: bool,
    },
    /// Print a shell completion script: `gpunode completions bash > /etc/bash_completion.d/gpunode`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page, or write one per command into --dir (for packaging).
    Man {
        /// Write gpunode.1, gpunode-serve.1, ... into this directory.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Private team networks: create, invite, join, members, add, revoke, leave.
    #[command(subcommand)]
    Team(TeamCommand),
}

#[derive(Debug, Subcommand)]
pub enum TeamCommand {
    /// Make a team key on this machine (its admin) and print the team id.
    Create {
        /// A name for the team (shown locally).
        name: String,
    },
    /// Print a join token for a new machine (needs the running daemon).
    Invite {
        /// How long the token works, e.g. 7d, 12h.
        #[arg(long, value_name = "DURATION", default_value = "7d")]
        expires: String,
        /// How many machines may join with it.
        #[arg(long, value_name = "N", default_value_t = 1)]
        uses: u32,
        /// member or admin.
        #[arg(long, default_value = "member")]
        role: String,
    },
    /// Join the team of TOKEN (with the daemon stopped).
    Join {
        /// The token `gpunode team invite` printed.
        token: String,
    },
    /// List the team's members.
    Members {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Admit a known peer id without a token (admins).
    Add {
        /// The peer id.
        peer: String,
        /// member or admin.
        #[arg(long, default_value = "member")]
        role: String,
    },
    /// Revoke a member (admins): it loses access and its leases.
    Revoke {
        /// The peer id.
        peer: String,
    },
    /// Leave the team (with the daemon stopped).
    Leave,
    /// Show or set the team policy (quotas, priorities, allowance, time windows).
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum PolicyAction {
    /// Print the current policy as an editable file.
    Show,
    /// Sign and spread the policy in FILE (admins); see docs/teams.md for the format.
    Set {
        /// The policy file (TOML).
        file: std::path::PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct LedgerArgs {
    #[command(subcommand)]
    pub action: Option<LedgerAction>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// How many recent entries to show.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub recent: usize,
}

#[derive(Debug, Subcommand)]
pub enum LedgerAction {
    /// Check the whole chain and every signature; names the first bad entry.
    Verify {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write every entry to stdout.
    Export {
        /// csv or json.
        #[arg(long, value_name = "FORMAT", default_value = "csv")]
        format: String,
    },
}

#[derive(Debug, Args)]
pub struct PeersArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    /// The task: a WASI preview 1 module (.wasm) or its text form (.wat). Container
    /// jobs take none: their command follows `--`.
    #[arg(value_name = "TASK")]
    pub task: Option<PathBuf>,
    /// Executor: `wasm` (a TASK file) or `container` (a command after `--`, under
    /// bubblewrap, with GPUs) [default: container with --image or --host-env, else wasm].
    #[arg(long, value_name = "BACKEND", value_parser = ["wasm", "container"])]
    pub backend: Option<String>,
    /// Container image archive to run in (`docker save`, `podman save`, OCI archive).
    #[arg(long, value_name = "ARCHIVE", conflicts_with = "host_env")]
    pub image: Option<PathBuf>,
    /// Run the container on the provider's own system software, read-only (where the
    /// provider allows it): for machines that already carry CUDA and PyTorch.
    #[arg(long)]
    pub host_env: bool,
    /// File or directory the task sees under /input (repeatable).
    #[arg(long, value_name = "PATH")]
    pub input: Vec<PathBuf>,
    /// Where the files the task writes to /output go: DIR itself when it does not exist
    /// yet, else a new DIR/JOB_ID; nothing there is ever replaced
    /// [default: ./gpunode-out/JOB_ID].
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Most bytes of outputs the provider may send back, e.g. 2G [default: 16G].
    #[arg(long, value_name = "SIZE")]
    pub max_output: Option<String>,
    /// Most output files the provider may send back [default: 10000].
    #[arg(long, value_name = "N")]
    pub max_output_files: Option<u32>,
    /// Send the job's inputs and outputs through a team relay when the provider cannot
    /// be reached directly (hole punching failed) [config: allow_relayed_data].
    #[arg(long)]
    pub allow_relayed_data: bool,
    /// GPUs to lease.
    #[arg(long, default_value_t = 0)]
    pub gpus: u32,
    /// GPU model or family, e.g. A100.
    #[arg(long, value_name = "MODEL")]
    pub gpu_model: Option<String>,
    #[command(flatten)]
    pub slice: GpuSlice,
    /// CPU cores to lease.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// Memory to lease; also the task's memory limit, e.g. 2G.
    #[arg(long, value_name = "SIZE", default_value = "512M")]
    pub mem: String,
    /// Wall-clock limit of the task, e.g. 10m.
    #[arg(long, value_name = "DURATION", default_value = "10m")]
    pub timeout: String,
    #[command(flatten)]
    pub price: MaxPrice,
    /// Run on this provider only (peer id).
    #[arg(long, value_name = "PEER")]
    pub peer: Option<String>,
    /// Environment variable for the task, NAME=VALUE (repeatable).
    #[arg(long, value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Other providers to try if one fails before the task ends.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub retries: u32,
    /// Instruction budget (deterministic metering; slower).
    #[arg(long, value_name = "UNITS")]
    pub fuel: Option<u64>,
    /// Run on N different providers and compare outputs; a disagreement is broken by
    /// one more run and costs the odd one out reputation (deterministic tasks only).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=5))]
    pub replicas: u32,
    /// Unattended batch work (team policies may allow it only at some hours).
    #[arg(long)]
    pub batch: bool,
    /// When no provider can take the job now, wait and ask again until one can
    /// [default inside a team].
    #[arg(long, conflicts_with = "no_wait")]
    pub wait: bool,
    /// Fail at once when no provider can take the job now [default outside a team].
    #[arg(long)]
    pub no_wait: bool,
    /// Run inside this reservation (id or prefix, see `gpunode reservations`), waiting for
    /// its start.
    #[arg(long, value_name = "ID", conflicts_with_all = ["peer", "replicas"])]
    pub reservation: Option<String>,
    /// Submit to the daemon, print the job id and return.
    #[arg(long)]
    pub detach: bool,
    /// No progress bars or status lines, only the task's output; with a daemon, returns
    /// as soon as the outputs are in (not with --replicas), and the daemon settles the
    /// receipt on its own (`gpunode jobs` shows it running until then).
    #[arg(long, short)]
    pub quiet: bool,
    /// Arguments passed to the task; for container jobs, the command and its arguments.
    #[arg(last = true, value_name = "ARGS")]
    pub args: Vec<String>,
}

#[derive(Debug, Args)]
pub struct WhyArgs {
    /// Job id (or a unique prefix).
    pub job: String,
    /// Print JSON instead of sentences.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// Job id (or a unique prefix).
    pub job: String,
    /// Keep printing until the job ends.
    #[arg(long, short)]
    pub follow: bool,
}

#[derive(Debug, Args)]
pub struct JobArgs {
    /// Job id (or a unique prefix).
    pub job: String,
}

#[derive(Debug, Subcommand)]
pub enum LeaseCommand {
    /// Find a provider (or ask --peer), negotiate a signed lease and print it.
    Request(LeaseRequestArgs),
    /// Extend an active lease you hold.
    Renew(LeaseRenewArgs),
    /// End a lease now (either side); its resources are released at once.
    Cancel(LeaseCancelArgs),
}

#[derive(Debug, Args)]
pub struct LeaseRequestArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    #[command(flatten)]
    pub provider: ProviderGpus,
    /// GPU model or family, e.g. A100.
    #[arg(long, value_name = "MODEL")]
    pub gpu_model: Option<String>,
    #[command(flatten)]
    pub slice: GpuSlice,
    #[command(flatten)]
    pub size: LeaseSize,
    /// How long, e.g. 30m.
    #[arg(long, value_name = "DURATION")]
    pub duration: String,
    #[command(flatten)]
    pub price: MaxPrice,
    /// Executor: wasm or container.
    #[arg(long, default_value = "wasm")]
    pub backend: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Unattended batch work (team policies may allow it only at some hours).
    #[arg(long)]
    pub batch: bool,
    /// Start later (a reservation): "2026-12-01 20:00" (UTC), or with +01:00 or Z.
    #[arg(long, value_name = "TIME")]
    pub at: Option<String>,
}

#[derive(Debug, Args)]
pub struct ReserveArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    #[command(flatten)]
    pub provider: ProviderGpus,
    /// GPU model or family, e.g. H100.
    #[arg(long, value_name = "MODEL")]
    pub gpu_model: Option<String>,
    #[command(flatten)]
    pub size: LeaseSize,
    /// Executor: wasm or container.
    #[arg(long, default_value = "wasm")]
    pub backend: String,
    /// When it starts: "2026-12-01 20:00" (UTC), or with +01:00 or Z.
    #[arg(long, value_name = "TIME")]
    pub at: String,
    /// How long, e.g. 3h.
    #[arg(long = "for", value_name = "DURATION")]
    pub length: String,
    #[command(flatten)]
    pub price: MaxPrice,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl From<ReserveArgs> for LeaseRequestArgs {
    fn from(r: ReserveArgs) -> LeaseRequestArgs {
        LeaseRequestArgs {
            net: r.net,
            provider: r.provider,
            gpu_model: r.gpu_model,
            slice: GpuSlice { gpu_slice: None },
            size: r.size,
            duration: r.length,
            price: r.price,
            backend: r.backend,
            json: r.json,
            batch: false,
            at: Some(r.at),
        }
    }
}

#[derive(Debug, Args)]
pub struct ReservationsArgs {
    #[command(subcommand)]
    pub action: Option<ReservationAction>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ReservationAction {
    /// Give a reservation back (before or during it).
    Cancel(LeaseCancelArgs),
    /// Make a reservation longer.
    Renew(LeaseRenewArgs),
}

#[derive(Debug, Args)]
pub struct LeaseRenewArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    /// Lease id (or a unique prefix of at least 4 hex digits).
    pub id: String,
    /// How much longer, e.g. 30m.
    #[arg(long = "for", value_name = "DURATION")]
    pub extend: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LeaseCancelArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    /// Lease id (or a unique prefix of at least 4 hex digits).
    pub id: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct LeasesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Which provider to ask and how many GPUs (`lease request`, `reserve`).
#[derive(Debug, Args, Clone)]
pub struct ProviderGpus {
    /// Ask this provider only (peer id).
    #[arg(long, value_name = "PEER")]
    pub peer: Option<String>,
    /// Number of GPUs.
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
}

/// What a lease needs besides GPUs: memory per GPU, CPU cores and RAM (`lease request`,
/// `reserve`).
#[derive(Debug, Args, Clone)]
pub struct LeaseSize {
    /// Least memory per GPU, e.g. 24G.
    #[arg(long, value_name = "SIZE")]
    pub min_gpu_mem: Option<String>,
    /// CPU cores.
    #[arg(long, default_value_t = 1)]
    pub cpus: u32,
    /// RAM, e.g. 16G.
    #[arg(long, value_name = "SIZE", default_value = "1G")]
    pub mem: String,
}

/// `--gpu-slice` (`run`, `lease request`, `offers`).
#[derive(Debug, Args, Clone)]
pub struct GpuSlice {
    /// A MIG slice instead of a whole GPU, e.g. 1g.18gb (see `gpunode offers`).
    #[arg(long, value_name = "PROFILE")]
    pub gpu_slice: Option<String>,
}

/// `--max-price` (`run`, `lease request`, `reserve`).
#[derive(Debug, Args, Clone)]
pub struct MaxPrice {
    /// Highest acceptable price, credits per GPU-hour.
    #[arg(long, value_name = "CREDITS")]
    pub max_price: Option<f64>,
}

/// Network flags shared by commands that start a node.
#[derive(Debug, Args, Clone, Default)]
pub struct NetworkArgs {
    /// Peer to connect to at start, as a multiaddr (repeatable; adds to the config's list).
    #[arg(long, value_name = "MULTIADDR")]
    pub bootstrap: Vec<String>,
    /// Do not look for peers on the local network by mDNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// Without a daemon: how long to look for peers before asking, e.g. 5s.
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    pub discover_for: String,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    /// Address to listen on (repeatable; replaces the config's list),
    /// e.g. /ip4/0.0.0.0/udp/4170/quic-v1 or /ip4/0.0.0.0/tcp/4170.
    #[arg(long, value_name = "MULTIADDR")]
    pub listen: Vec<String>,
    /// Serve simulated GPUs (test networks only), e.g. 2xA100-80GB,1xT4-16GB.
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    /// Price per GPU-hour, in credits.
    #[arg(long, value_name = "CREDITS")]
    pub price: Option<f64>,
    /// Executors to offer, comma separated (wasm, container).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub backends: Option<Vec<String>>,
    /// Also serve /metrics on this localhost address, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// Serve the web dashboard here (a loopback IP:PORT; default 127.0.0.1:4171).
    #[arg(long, value_name = "ADDR")]
    pub dashboard_addr: Option<String>,
    /// Do not serve the web dashboard.
    #[arg(long)]
    pub no_dashboard: bool,
    /// How long an advert stays valid, e.g. 10m.
    #[arg(long, value_name = "DURATION")]
    pub advert_ttl: Option<String>,
    /// How often to read the GPU inventory, e.g. 2s.
    #[arg(long, value_name = "DURATION")]
    pub inventory_poll: Option<String>,
    /// Pre-shared key for TCP (64 hex digits, the same on every team machine): hides
    /// the node from anyone without it. QUIC cannot use it.
    #[arg(long, value_name = "HEX")]
    pub team_psk: Option<String>,
}

#[derive(Debug, Args)]
pub struct OffersArgs {
    #[command(flatten)]
    pub net: NetworkArgs,
    /// GPU model or family, e.g. A100, H100, RTX4090.
    #[arg(long, value_name = "MODEL")]
    pub gpu_model: Option<String>,
    #[command(flatten)]
    pub slice: GpuSlice,
    /// Least memory per GPU, e.g. 40G.
    #[arg(long, value_name = "SIZE")]
    pub min_gpu_mem: Option<String>,
    /// Least number of matching GPUs.
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// Backend the provider must offer (wasm, container).
    #[arg(long, value_name = "NAME")]
    pub backend: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `gpunode doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print the checks as JSON.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    /// clap's own checks of every command's definition.
    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// A command takes the global flags on either side of its name, its own flags, and
    /// refuses what it does not know.
    #[test]
    fn commands_parse_their_flags_and_the_global_ones() {
        let cli = Cli::try_parse_from([
            "gpunode",
            "run",
            "t.wasm",
            "--data-dir",
            "/d",
            "--quiet",
            "--peer",
            "P",
        ])
        .expect("parses");
        assert_eq!(cli.data_dir.as_deref(), Some(std::path::Path::new("/d")));
        let Command::Run(run) = cli.command else {
            panic!("not run: {:?}", cli.command)
        };
        assert!(run.quiet);
        assert_eq!(run.peer.as_deref(), Some("P"));
        let cli =
            Cli::try_parse_from(["gpunode", "--config", "/c", "team", "invite"]).expect("parses");
        assert_eq!(cli.config.as_deref(), Some(std::path::Path::new("/c")));
        let err = Cli::try_parse_from(["gpunode", "run", "t.wasm", "--no-such-flag"])
            .expect_err("refused");
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        let help = Cli::try_parse_from(["gpunode", "run", "--help"]).expect_err("help");
        assert!(help.to_string().contains("--quiet"), "{help}");
    }
}
