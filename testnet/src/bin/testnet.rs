//! `testnet`: start a local network of `gpunode serve` processes for demos, or run the
//! benchmarks over in-process networks.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use testnet::process::{ServeProcess, SIGINT};

/// jemalloc, as a `gpunode serve` daemon allocates.
#[global_allocator]
static HEAP: gpunode_node::allocator::Heap =
    gpunode_node::allocator::Heap::new(gpunode_node::allocator::Rule::Always);

#[derive(Debug, Parser)]
#[command(
    name = "testnet",
    about = "Local gpunode networks for demos and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Start N `gpunode serve` processes on 127.0.0.1 with simulated GPUs; Ctrl-C stops them.
    Up {
        /// Number of nodes.
        #[arg(long, default_value_t = 5)]
        nodes: usize,
        /// Simulated GPU specs, used round-robin.
        #[arg(
            long,
            value_delimiter = ';',
            default_value = "2xA100-80GB;1xT4-16GB;4xH100-80GB;1xRTX4090-24GB"
        )]
        gpus: Vec<String>,
        /// Where the nodes' data dirs go (default: a temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run a benchmark and print its figures as JSON lines.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
    /// Lease and cancel leases of one provider as fast as possible until killed, so the
    /// provider settles receipts with this node (the ledger crash test kills it).
    LedgerRequester {
        /// This node's data directory (kept across restarts).
        #[arg(long)]
        data_dir: PathBuf,
        /// The provider, /ip4/.../p2p/PEER_ID.
        #[arg(long)]
        provider: String,
        /// Concurrent lease loops.
        #[arg(long, default_value_t = 8)]
        workers: usize,
    },
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// The web dashboard: first paint and data shown with many providers and a long
    /// ledger, live-update delay, memory with the page open.
    Dashboard {
        /// Providers the node knows.
        #[arg(long, default_value_t = 200)]
        providers: usize,
        /// Entries in the node's ledger.
        #[arg(long, default_value_t = 10_000)]
        entries: u64,
        /// Page loads timed.
        #[arg(long, default_value_t = 7)]
        runs: usize,
        /// Live updates timed.
        #[arg(long, default_value_t = 10)]
        updates: usize,
    },
    /// Provider lookup time, DHT requests and memory per node.
    Discovery {
        /// Network sizes, comma separated.
        #[arg(long, value_delimiter = ',', default_value = "50,100,200")]
        nodes: Vec<usize>,
        /// Lookups per network.
        #[arg(long, default_value_t = 200)]
        lookups: usize,
        /// Skip the idle phase (some two minutes with nothing asked) and the idle
        /// memory, connection and CPU figures it gives: for comparing lookups and
        /// formation between builds quickly.
        #[arg(long)]
        no_idle: bool,
    },
    /// Lease negotiation round trip and leases per second of one provider.
    Lease {
        /// Sequential negotiations to time.
        #[arg(long, default_value_t = 500)]
        round_trips: usize,
        /// Concurrent requesters for the throughput run.
        #[arg(long, default_value_t = 16)]
        requesters: usize,
        /// Length of the throughput run, seconds.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Length of each lease, ms. Short leases end and settle (usage receipts) during
        /// the run; leases longer than the run measure negotiation alone.
        #[arg(long, default_value_t = 2_000)]
        lease_ms: u64,
        /// Keep the requesters' stores on disk too (their lease records and receipts
        /// flushed as in production); by default only the provider's store is.
        #[arg(long)]
        durable_requesters: bool,
        /// Run the provider on a runtime of its own with this many worker threads and
        /// report its CPU time per lease apart from the requesters' (0: one runtime for
        /// all, as before).
        #[arg(long, default_value_t = 0)]
        provider_threads: usize,
    },
    /// An honest job's time while one peer floods the provider with idle job streams
    /// and connection attempts, next to the quiet figure.
    Flood {
        /// Jobs timed each way.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Idle job streams the attacker holds.
        #[arg(long, default_value_t = 5000)]
        streams: usize,
        /// Connection attempts per second.
        #[arg(long, default_value_t = 500)]
        attempts_per_s: u32,
    },
    /// A provider's memory and disk over many refused lease requests from fresh
    /// identities.
    Sybil {
        /// Requests, each refused.
        #[arg(long, default_value_t = 100_000)]
        requests: usize,
        /// Requests per identity before a new one is made.
        #[arg(long, default_value_t = 100)]
        per_identity: usize,
    },
    /// Whole `gpunode run` of a trivial task on a warm 3-node network, CLI included.
    Dispatch {
        /// Runs to time (each way: provider lookup, and --peer).
        #[arg(long, default_value_t = 50)]
        runs: usize,
        /// Pause between runs, ms (0: back to back; a person running one task after
        /// another leaves seconds).
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
        /// Another `gpunode` binary to time side by side with this one (its own three
        /// daemons; runs alternate between the two): for comparing two builds when the
        /// machine's speed drifts from one round to the next.
        #[arg(long)]
        against: Option<PathBuf>,
    },
    /// Members behind NAT in a lab of network namespaces (root): time to the first job
    /// between two of them, hole-punch success per NAT type, direct vs relayed transfer.
    Nat {
        /// Punch attempts per NAT type.
        #[arg(long, default_value_t = 50)]
        attempts: usize,
        /// Job input size for the transfer rates, e.g. 64M.
        #[arg(long, default_value = "64M")]
        size: String,
        /// Timed transfers each way.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Throughput of a job input between two nodes over QUIC and TCP, next to iperf3.
    Transfer {
        /// Input size, e.g. 1G.
        #[arg(long, default_value = "1G")]
        size: String,
        /// Runs per transport.
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Receipts settled per second between two nodes (durable), and the time to verify
    /// a ledger of a million entries.
    Ledger {
        /// Leases to settle in the timed run.
        #[arg(long, default_value_t = 5000)]
        receipts: usize,
        /// Entries of the ledger to verify.
        #[arg(long, default_value_t = 1_000_000)]
        verify_entries: u64,
        /// Verification runs (the median is reported).
        #[arg(long, default_value_t = 3)]
        verify_runs: usize,
    },
    /// Start-to-exit time of `true`: plainly, under bubblewrap on the host's system
    /// (--host-env), and under bubblewrap on an unpacked image.
    ContainerStart {
        /// Runs of each.
        #[arg(long, default_value_t = 30)]
        runs: usize,
    },
    /// Replays the Alibaba GPU trace through providers' queues in virtual time, under
    /// the node's fair rule and under FCFS, and prints the figures of both.
    TraceReplay {
        /// Folder with openb_pod_list_default.csv and openb_node_list_gpu_node.csv.
        #[arg(long, default_value = "../shared/data/traces")]
        traces: std::path::PathBuf,
        /// GPUs of the sampled network (every k-th trace node).
        #[arg(long, default_value_t = 36)]
        gpus: u32,
        /// Tenants the jobs are spread over.
        #[arg(long, default_value_t = 8)]
        users: u32,
        /// Only the first N jobs (0 = all).
        #[arg(long, default_value_t = 0)]
        jobs: usize,
        /// Requests each provider places per plan.
        #[arg(long, default_value_t = 32)]
        depth: usize,
        /// Declared timeout as a multiple of the real run time.
        #[arg(long, default_value_t = 2.0)]
        overestimate: f64,
    },
    /// Replays the busiest slice of the Alibaba GPU trace on real nodes (simulated GPUs
    /// from the trace's node list, one client per user, sleep tasks), with every provider
    /// fair and then FCFS, and prints the figures of both.
    TraceNetwork {
        /// Folder with openb_pod_list_default.csv and openb_node_list_gpu_node.csv.
        #[arg(long, default_value = "../shared/data/traces")]
        traces: std::path::PathBuf,
        /// GPUs of the sampled network (every k-th trace node).
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// Jobs replayed.
        #[arg(long, default_value_t = 60)]
        jobs: usize,
        /// Tenants (client nodes).
        #[arg(long, default_value_t = 4)]
        users: u32,
        /// Wall milliseconds per trace hour.
        #[arg(long, default_value_t = 1000)]
        hour_ms: u64,
        /// Longest job, wall ms.
        #[arg(long, default_value_t = 8000)]
        max_run_ms: u64,
    },
    /// A compute kernel natively and as a wasm task; start time of a cached module.
    SandboxOverhead {
        /// Matrix size of the kernel.
        #[arg(long, default_value_t = 500)]
        n: usize,
        /// Runs of each.
        #[arg(long, default_value_t = 5)]
        runs: usize,
    },
}

fn gpunode_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("no parent dir")?;
    let bin = dir.join("gpunode");
    if !bin.exists() {
        eprintln!("building the gpunode binary first ...");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "-p", "gpunode"]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        if !cmd.status()?.success() {
            bail!("cargo build -p gpunode failed");
        }
    }
    Ok(bin)
}

fn up(nodes: usize, gpus: Vec<String>, dir: Option<PathBuf>) -> Result<()> {
    let bin = gpunode_binary()?;
    let tmp = tempfile::Builder::new().prefix("gpunode-up").tempdir()?;
    let root = dir.unwrap_or_else(|| tmp.path().to_path_buf());
    let mut procs: Vec<ServeProcess> = Vec::new();
    for i in 0..nodes {
        let mut extra = vec![
            "--simulate-gpus".to_string(),
            gpus[i % gpus.len().max(1)].clone(),
        ];
        if let Some(first) = procs.first() {
            extra.push("--bootstrap".into());
            extra.push(first.addr.clone());
        }
        let p = ServeProcess::start(&bin, &root.join(format!("node{i}")), &extra)?;
        println!("node{i}  {}  pid {}  {}", p.peer_id, p.pid(), p.addr);
        procs.push(p);
    }
    println!();
    println!(
        "Try:  {} --data-dir {} offers",
        bin.display(),
        root.join("node0").display()
    );
    println!(
        "      {} --data-dir {} status",
        bin.display(),
        root.join("node0").display()
    );
    println!("Ctrl-C stops the network.");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async { tokio::signal::ctrl_c().await })?;
    for p in &mut procs {
        let _ = p.stop(SIGINT, Duration::from_secs(5));
    }
    Ok(())
}

fn main() -> Result<()> {
    // Logs only when asked (`RUST_LOG=gpunode_node=debug`): a bench's figures are
    // printed on stdout, its log goes to stderr.
    if let Ok(filter) = std::env::var("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
    match Cli::parse().command {
        Cmd::Up { nodes, gpus, dir } => up(nodes, gpus, dir),
        Cmd::Bench { which } => bench(which),
        Cmd::LedgerRequester {
            data_dir,
            provider,
            workers,
        } => runtime()?.block_on(testnet::ledger::churn_requester(
            &data_dir, &provider, workers,
        )),
    }
}

/// A multi-threaded runtime for the in-process networks.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Prints one benchmark figure as a JSON line.
fn print(report: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string(report)?);
    Ok(())
}

/// `testnet bench WHICH`: runs one benchmark and prints its figures. One arm per
/// benchmark, each only handing its flags on (a little over 80 lines, kept whole so
/// every benchmark's entry point reads in one place).
fn bench(which: Bench) -> Result<()> {
    match which {
        Bench::Discovery {
            nodes,
            lookups,
            no_idle,
        } => discovery(&nodes, lookups, !no_idle),
        Bench::Lease {
            round_trips,
            requesters,
            seconds,
            lease_ms,
            durable_requesters,
            provider_threads,
        } => print(&runtime()?.block_on(testnet::bench::lease(
            round_trips,
            requesters,
            seconds,
            lease_ms,
            durable_requesters,
            provider_threads,
        ))?),
        Bench::Flood {
            runs,
            streams,
            attempts_per_s,
        } => print(&runtime()?.block_on(testnet::bench_hostile::flood(
            runs,
            streams,
            attempts_per_s,
        ))?),
        Bench::Sybil {
            requests,
            per_identity,
        } => {
            let rt = runtime()?;
            print(&rt.block_on(testnet::bench_hostile::sybil(
                &gpunode_binary()?,
                requests,
                per_identity.max(1),
            ))?)
        }
        Bench::Dispatch {
            runs,
            pause_ms,
            against,
        } => {
            let pause = Duration::from_millis(pause_ms);
            let mut binaries = vec![gpunode_binary()?];
            if let Some(other) = against {
                if !other.is_file() {
                    bail!("--against {}: no such file", other.display());
                }
                binaries.push(other);
            }
            for report in testnet::bench_jobs::dispatch(&binaries, runs, pause)? {
                print(&report)?;
            }
            Ok(())
        }
        Bench::Transfer { size, runs } => transfer(&size, runs),
        Bench::Nat {
            attempts,
            size,
            runs,
        } => {
            let bytes = gpunode_protocol::units::parse_bytes(&size)
                .map_err(|e| anyhow::anyhow!("invalid --size: {e}"))?;
            print(&testnet::bench_nat::nat(
                &gpunode_binary()?,
                attempts,
                bytes,
                runs,
            )?)
        }
        Bench::Dashboard {
            providers,
            entries,
            runs,
            updates,
        } => print(&runtime()?.block_on(testnet::bench_dashboard::dashboard(
            &gpunode_binary()?,
            providers,
            entries,
            runs,
            updates,
        ))?),
        Bench::Ledger {
            receipts,
            verify_entries,
            verify_runs,
        } => print(&runtime()?.block_on(testnet::ledger::bench(
            receipts,
            verify_entries,
            verify_runs,
        ))?),
        Bench::ContainerStart { runs } => {
            for report in testnet::bench_container::container_start(runs)? {
                print(&report)?;
            }
            Ok(())
        }
        Bench::TraceReplay {
            traces,
            gpus,
            users,
            jobs,
            depth,
            overestimate,
        } => trace_replay(&traces, gpus, users, jobs, depth, overestimate),
        Bench::TraceNetwork {
            traces,
            gpus,
            jobs,
            users,
            hour_ms,
            max_run_ms,
        } => trace_network(
            &traces,
            gpus,
            testnet::trace_network::NetworkReplay {
                jobs,
                users,
                hour_ms,
                max_run_ms,
            },
        ),
        Bench::SandboxOverhead { n, runs } => sandbox_overhead(n, runs),
    }
}

/// `bench discovery`: one network of each size.
fn discovery(nodes: &[usize], lookups: usize, idle_phase: bool) -> Result<()> {
    let rt = runtime()?;
    for n in nodes {
        print(&rt.block_on(testnet::bench::discovery(*n, lookups, idle_phase))?)?;
    }
    Ok(())
}

/// `bench sandbox-overhead`: the kernel built natively and for wasm, then timed.
fn sandbox_overhead(n: usize, runs: usize) -> Result<()> {
    let (native, wasm) = testnet::bench_jobs::build_kernel()?;
    let worker = gpunode_binary()?;
    for report in testnet::bench_jobs::sandbox_overhead(&native, &wasm, &worker, n, runs)? {
        print(&report)?;
    }
    Ok(())
}

/// `bench transfer`: job inputs and outputs of `size` each way.
fn transfer(size: &str, runs: usize) -> Result<()> {
    let bytes = gpunode_protocol::units::parse_bytes(size)
        .map_err(|e| anyhow::anyhow!("invalid --size: {e}"))?;
    let rt = runtime()?;
    for report in rt.block_on(testnet::bench_jobs::transfer(bytes, runs))? {
        print(&report)?;
    }
    Ok(())
}

/// The trace's GPU nodes, `gpus` of them sampled.
fn trace_nodes(traces: &Path, gpus: u32) -> Result<Vec<testnet::trace_replay::TraceNode>> {
    use testnet::trace_replay as tr;
    Ok(tr::sample_nodes(
        &tr::load_nodes(&traces.join("openb_node_list_gpu_node.csv"))?,
        gpus,
    ))
}

/// `bench trace-replay`: the trace through providers' queues in virtual time, fair
/// rule then first come first served.
fn trace_replay(
    traces: &Path,
    gpus: u32,
    users: u32,
    jobs: usize,
    depth: usize,
    overestimate: f64,
) -> Result<()> {
    use testnet::trace_replay as tr;
    let mut list = tr::load_jobs(&traces.join("openb_pod_list_default.csv"), users)?;
    if jobs > 0 {
        list.truncate(jobs);
    }
    let nodes = trace_nodes(traces, gpus)?;
    for order in [
        gpunode_sched::Order::Fair,
        gpunode_sched::Order::Easy,
        gpunode_sched::Order::Fcfs,
    ] {
        let config = tr::ReplayConfig {
            depth,
            overestimate,
            ..tr::ReplayConfig::default()
        };
        print(&tr::replay(&list, &nodes, order, config))?;
    }
    Ok(())
}

/// `bench trace-network`: the trace's busiest window on real nodes, fair rule then
/// first come first served.
fn trace_network(
    traces: &Path,
    gpus: u32,
    cfg: testnet::trace_network::NetworkReplay,
) -> Result<()> {
    use testnet::trace_network as tn;
    let all =
        testnet::trace_replay::load_jobs(&traces.join("openb_pod_list_default.csv"), cfg.users)?;
    let nodes = trace_nodes(traces, gpus)?;
    let window = tn::busiest_window(&all, cfg.jobs, &cfg);
    let rt = runtime()?;
    for order in [
        gpunode_node::config::QueueOrder::Fair,
        gpunode_node::config::QueueOrder::Easy,
        gpunode_node::config::QueueOrder::Fcfs,
    ] {
        print(&rt.block_on(tn::replay_network(&window, &nodes, order, cfg))?)?;
    }
    Ok(())
}
