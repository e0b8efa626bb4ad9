//! `gpunode doctor`: the checks a user would otherwise ask about on a forum (data dir,
//! config, network route, how peers see this node, bootstrap peers, clocks, bubblewrap,
//! cgroups, NVML, the team certificate), each failed one printed with the exact fix.
//! It reads the config itself, so a config that does not load is one failed check, not
//! the end of the run; the network checks ask the running daemon.

use std::net::IpAddr;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;
use gpunode_node::api::ApiClient;
use gpunode_node::inbound::ip_of;
use gpunode_node::views::{NodeStatus, OfferView};
use gpunode_node::{DataDir, NodeConfig};
use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use serde::Serialize;

use crate::args::DoctorArgs;
use crate::helpers::print_json;
use crate::target::Target;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Fine.
    Ok,
    /// Works, but something will bite (or a feature is off).
    Warn,
    /// Broken: the fix says what to do.
    Fail,
    /// Not checked (does not apply, or needs the daemon).
    Skip,
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: &'static str,
    /// How it came out.
    pub verdict: Verdict,
    /// What was found.
    pub detail: String,
    /// The exact fix, for a warning or a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(name: &'static str, verdict: Verdict, detail: impl Into<String>) -> Check {
        Check {
            name,
            verdict,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Check {
        self.fix = Some(fix.into());
        self
    }
}

/// `gpunode doctor`: exits 1 when any check failed.
pub async fn doctor(
    data_dir: DataDir,
    config_path: Option<&Path>,
    args: &DoctorArgs,
) -> Result<ExitCode> {
    let mut checks = vec![check_data_dir(&data_dir)];
    let (config, config_check) = check_config(config_path);
    checks.push(config_check);
    checks.push(check_route(Path::new("/proc/net")));
    match Target::daemon(&data_dir).await {
        Some(api) => checks.extend(daemon_checks(&api, &config).await),
        None => checks.push(
            Check::new(
                "daemon",
                Verdict::Skip,
                "not running, so listen addresses, reachability, bootstrap peers and clocks are not checked",
            )
            .fix("start it with `gpunode serve`, then run `gpunode doctor` again"),
        ),
    }
    checks.push(check_sandbox(&config));
    checks.push(check_cgroups(&config));
    checks.push(check_gpus(&config));
    checks.push(check_team(&data_dir));
    if args.json {
        print_json(&checks)?;
    } else {
        print_checks(&mut std::io::stdout().lock(), &checks)?;
    }
    let failed = checks.iter().any(|c| c.verdict == Verdict::Fail);
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn print_checks(out: &mut impl std::io::Write, checks: &[Check]) -> std::io::Result<()> {
    for c in checks {
        let mark = match c.verdict {
            Verdict::Ok => "ok  ",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "skip",
        };
        writeln!(out, "{mark}  {}: {}", c.name, c.detail)?;
        if let Some(fix) = &c.fix {
            if c.verdict != Verdict::Ok {
                writeln!(out, "      fix: {fix}")?;
            }
        }
    }
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    let warned = checks.iter().filter(|c| c.verdict == Verdict::Warn).count();
    writeln!(out, "{failed} failed, {warned} warnings")
}

/// The data dir: owned by this user and closed to others (it holds the identity key).
fn check_data_dir(data_dir: &DataDir) -> Check {
    use std::os::unix::fs::MetadataExt;
    const NAME: &str = "data dir";
    let root = data_dir.root();
    let meta = match std::fs::metadata(root) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Check::new(
                NAME,
                Verdict::Warn,
                format!("{} does not exist yet", root.display()),
            )
            .fix("`gpunode serve` (or `gpunode id`) creates it, mode 0700");
        }
        Err(e) => {
            return Check::new(
                NAME,
                Verdict::Fail,
                format!("cannot read {}: {e}", root.display()),
            )
            .fix(format!(
                "check the path and its parents' permissions (`ls -ld {}`)",
                root.display()
            ));
        }
    };
    // /proc/self belongs to this process's effective user.
    let me = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    if meta.uid() != me {
        return Check::new(
            NAME,
            Verdict::Fail,
            format!(
                "{} belongs to uid {}, not to you (uid {me})",
                root.display(),
                meta.uid()
            ),
        )
        .fix(format!("chown -R {me} {}", root.display()));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Check::new(
            NAME,
            Verdict::Fail,
            format!(
                "{} has mode {mode:04o}: other users can read the identity key",
                root.display()
            ),
        )
        .fix(format!("chmod 700 {}", root.display()));
    }
    let key = data_dir.identity_file();
    if let Ok(m) = std::fs::metadata(&key) {
        if m.mode() & 0o077 != 0 {
            return Check::new(
                NAME,
                Verdict::Fail,
                format!("{} has mode {:04o}", key.display(), m.mode() & 0o777),
            )
            .fix(format!("chmod 600 {}", key.display()));
        }
    }
    Check::new(
        NAME,
        Verdict::Ok,
        format!("{} (mode {mode:04o}, yours)", root.display()),
    )
}

/// The config file loads (or there is none, and the defaults apply).
fn check_config(path: Option<&Path>) -> (NodeConfig, Check) {
    const NAME: &str = "config";
    let (path, required) = match path {
        Some(p) => (Some(p.to_path_buf()), true),
        None => (DataDir::default_config_file(), false),
    };
    let Some(path) = path else {
        return (
            NodeConfig::default(),
            Check::new(NAME, Verdict::Ok, "no config file: defaults"),
        );
    };
    if required && !path.exists() {
        return (
            NodeConfig::default(),
            Check::new(NAME, Verdict::Fail, format!("{} does not exist", path.display()))
                .fix("create it (example.config.toml lists every key), or leave out --config / GPUNODE_CONFIG for the defaults"),
        );
    }
    match NodeConfig::load(&path, required) {
        Ok(c) if path.exists() => (c, Check::new(NAME, Verdict::Ok, path.display().to_string())),
        Ok(c) => (c, Check::new(NAME, Verdict::Ok, format!("{} absent: defaults", path.display()))),
        Err(e) => (
            NodeConfig::default(),
            Check::new(NAME, Verdict::Fail, format!("{} does not load: {e}", path.display()))
                .fix(format!("edit {} as the error says (example.config.toml lists every key); the checks below use the defaults", path.display())),
        ),
    }
}

/// A route off this machine: a default route, or at least one to a local network.
fn check_route(proc_net: &Path) -> Check {
    const NAME: &str = "network route";
    let routes = Routes::read(proc_net);
    if let Some(dev) = routes.default_via.first() {
        return Check::new(NAME, Verdict::Ok, format!("default route via {dev}"));
    }
    if let Some(dev) = routes.local.first() {
        return Check::new(
            NAME,
            Verdict::Warn,
            format!("no default route: only peers on the networks of {dev} can be reached"),
        )
        .fix("for peers outside this network, add a default route (`ip route` shows none); a team on one LAN needs nothing more");
    }
    Check::new(
        NAME,
        Verdict::Fail,
        "no network route besides loopback: no peer on another machine can reach this one, nor it them",
    )
    .fix("connect a network interface and bring it up (`ip addr`, `ip link set DEV up`), then check that `ip route` shows a default route")
}

/// Routes from `/proc/net/route` and `/proc/net/ipv6_route`: the interfaces with a
/// default route, and those with any other route (loopback left out).
#[derive(Debug, Default)]
struct Routes {
    default_via: Vec<String>,
    local: Vec<String>,
}

impl Routes {
    fn read(proc_net: &Path) -> Routes {
        let mut routes = Routes::default();
        // IPv4: Iface Destination Gateway Flags ...; destination 00000000 is the default.
        if let Ok(text) = std::fs::read_to_string(proc_net.join("route")) {
            for fields in text
                .lines()
                .skip(1)
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
            {
                if let [dev, dest, ..] = fields[..] {
                    routes.add(dev, dest == "00000000");
                }
            }
        }
        // IPv6: dest, dest prefix length, ..., device last; ::/0 is the default.
        if let Ok(text) = std::fs::read_to_string(proc_net.join("ipv6_route")) {
            for fields in text
                .lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
            {
                if let (Some(dest), Some(len), Some(dev)) =
                    (fields.first(), fields.get(1), fields.last())
                {
                    if dest.starts_with("fe80") || dest.starts_with("ff") {
                        continue; // link-local and multicast reach no other network
                    }
                    routes.add(dev, dest.chars().all(|c| c == '0') && *len == "00");
                }
            }
        }
        routes
    }

    fn add(&mut self, dev: &str, default: bool) {
        if dev == "lo" {
            return;
        }
        let list = if default {
            &mut self.default_via
        } else {
            &mut self.local
        };
        if !list.iter().any(|d| d == dev) {
            list.push(dev.to_string());
        }
    }
}

/// What the running daemon says: listen addresses, how peers see it, bootstrap peers
/// connected, and clocks against peers' adverts.
async fn daemon_checks(api: &ApiClient, config: &NodeConfig) -> Vec<Check> {
    let status: NodeStatus = match api.get_json("/v1/status").await {
        Ok(s) => s,
        Err(e) => {
            return vec![Check::new(
                "daemon",
                Verdict::Fail,
                format!("the daemon did not answer: {e}"),
            )
            .fix("restart it (`gpunode serve`); its log says what went wrong")];
        }
    };
    let offers: Vec<OfferView> = api.get_json("/v1/offers").await.unwrap_or_default();
    vec![
        Check::new(
            "daemon",
            Verdict::Ok,
            format!("running as {}", status.peer_id),
        ),
        check_listen(&status, config),
        check_reachability(&status),
        check_bootstrap(&status, config),
        check_clock(&offers, gpunode_protocol::time::now_ms()),
    ]
}

fn port_of(addr: &Multiaddr) -> Option<(&'static str, u16)> {
    addr.iter().find_map(|p| match p {
        Protocol::Udp(port) => Some(("UDP", port)),
        Protocol::Tcp(port) => Some(("TCP", port)),
        _ => None,
    })
}

const LISTEN_FIX: &str = "listen = [\"/ip4/0.0.0.0/udp/4001/quic-v1\", \"/ip4/0.0.0.0/tcp/4001\"] in config.toml (a fixed port that a router can forward)";

fn check_listen(status: &NodeStatus, config: &NodeConfig) -> Check {
    const NAME: &str = "listen addresses";
    let addrs: Vec<Multiaddr> = status
        .listen_addrs
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect();
    let list = status.listen_addrs.join(", ");
    if addrs.is_empty() {
        return Check::new(NAME, Verdict::Fail, "the daemon listens nowhere").fix(LISTEN_FIX);
    }
    if addrs
        .iter()
        .all(|a| ip_of(a).is_some_and(|ip| ip.is_loopback()))
    {
        return Check::new(
            NAME,
            Verdict::Warn,
            format!("{list}: loopback only, so peers on other machines cannot connect"),
        )
        .fix(LISTEN_FIX);
    }
    if config
        .listen
        .iter()
        .any(|a| port_of(a).is_some_and(|(_, p)| p == 0))
    {
        return Check::new(
            NAME,
            Verdict::Warn,
            format!("{list}: the port is picked at random on each start, so no router rule can follow it"),
        )
        .fix(LISTEN_FIX);
    }
    Check::new(NAME, Verdict::Ok, list)
}

/// How peers see this node: the addresses they report (identify) against those it
/// listens on. Different ones mean a NAT in between.
pub(crate) fn check_reachability(status: &NodeStatus) -> Check {
    const NAME: &str = "reachability";
    if status.connected_peers.is_empty() {
        return Check::new(NAME, Verdict::Warn, "no peer connected, so none can say how it sees this node")
            .fix("add a peer: bootstrap = [\"/ip4/ADDR/udp/PORT/quic-v1/p2p/PEER_ID\"] in config.toml (`gpunode status` on that machine prints it), or `gpunode team join TOKEN`");
    }
    let listen: Vec<Multiaddr> = status
        .listen_addrs
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect();
    let own_ips: Vec<IpAddr> = listen.iter().filter_map(ip_of).collect();
    let observed: Vec<Multiaddr> = status
        .observed_addrs
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect();
    let Some(seen) = observed.first() else {
        return Check::new(
            NAME,
            Verdict::Ok,
            "peers connected; none has reported how it sees this node yet",
        );
    };
    let seen_ip = ip_of(seen);
    let unspecified = own_ips.iter().any(|ip| ip.is_unspecified());
    if seen_ip.is_some_and(|ip| {
        own_ips.contains(&ip) || ip.is_loopback() || unspecified && is_private(ip)
    }) {
        return Check::new(
            NAME,
            Verdict::Ok,
            format!("peers see this node at {seen}, an address it has"),
        );
    }
    let (proto, port) = listen.iter().find_map(port_of).unwrap_or(("UDP", 4001));
    let relayed = status.reachability.contains("relayed via");
    let now = if relayed {
        format!(
            "; team members reach it through a relay ({}), and directly only where a hole punch succeeds (about 70% of NATs)",
            status.reachability
        )
    } else {
        ", and peers outside cannot dial it".to_string()
    };
    Check::new(
        NAME,
        Verdict::Warn,
        format!("peers see this node at {seen}, not at an address it listens on: it is behind NAT{now}"),
    )
    .fix(format!(
        "forward {proto} port {port} on the router to this machine (or set upnp = true in config.toml if the router offers UPnP), listening on a fixed port ({LISTEN_FIX}); in a team, a member with a public address relays for the others"
    ))
}

fn is_private(ip: IpAddr) -> bool {
    gpunode_node::nat::scope_of_ip(ip) == gpunode_node::nat::Scope::Private
}

fn check_bootstrap(status: &NodeStatus, config: &NodeConfig) -> Check {
    const NAME: &str = "bootstrap";
    if config.bootstrap.is_empty() {
        return Check::new(
            NAME,
            Verdict::Ok,
            "none configured (mDNS on the LAN, or a team's members)",
        );
    }
    let mut missing = Vec::new();
    for addr in &config.bootstrap {
        let peer = addr.iter().find_map(|p| match p {
            Protocol::P2p(id) => Some(id.to_string()),
            _ => None,
        });
        if !peer.is_some_and(|id| status.connected_peers.contains(&id)) {
            missing.push(addr.to_string());
        }
    }
    if missing.is_empty() {
        return Check::new(
            NAME,
            Verdict::Ok,
            format!("connected to all {}", config.bootstrap.len()),
        );
    }
    let first = config
        .bootstrap
        .iter()
        .find(|a| missing.contains(&a.to_string()));
    let port = first
        .and_then(port_of)
        .map(|(proto, port)| format!("{proto} port {port}"))
        .unwrap_or_else(|| "its port".into());
    Check::new(
        NAME,
        Verdict::Fail,
        format!("not connected to {} of {}: {}", missing.len(), config.bootstrap.len(), missing.join(", ")),
    )
    .fix(format!(
        "check that the peer runs `gpunode serve` at that address (`gpunode status` there prints it, with /p2p/ID) and that {port} is open to this machine"
    ))
}

/// Clocks against peers: an advert dated ahead of this clock means one of the two is
/// off (leases and certificates carry times).
fn check_clock(offers: &[OfferView], now_ms: u64) -> Check {
    const NAME: &str = "clock";
    const TOLERANCE_MS: u64 = 30_000;
    if offers.is_empty() {
        return Check::new(NAME, Verdict::Skip, "no peer adverts to compare with");
    }
    let ahead = offers
        .iter()
        .filter(|o| o.issued_at_ms > now_ms + TOLERANCE_MS)
        .max_by_key(|o| o.issued_at_ms);
    match ahead {
        None => Check::new(
            NAME,
            Verdict::Ok,
            format!(
                "no advert of {} peers is dated ahead of this clock",
                offers.len()
            ),
        ),
        Some(o) => Check::new(
            NAME,
            Verdict::Warn,
            format!(
                "peer {} dates its advert {} s ahead of this clock: one of the two clocks is off",
                o.peer_id,
                (o.issued_at_ms - now_ms) / 1000
            ),
        )
        .fix(
            "keep both clocks in sync: `timedatectl set-ntp true` (or run chrony) on each machine",
        ),
    }
}

fn container_backend(config: &NodeConfig) -> bool {
    config.backends.iter().any(|b| b == "container")
}

/// bubblewrap, where the container backend is on: installed, and able to make a sandbox.
fn check_sandbox(config: &NodeConfig) -> Check {
    const NAME: &str = "bubblewrap";
    if !container_backend(config) {
        return Check::new(
            NAME,
            Verdict::Skip,
            "the container backend is off (wasm tasks need nothing)",
        );
    }
    let bwrap = match gpunode_sandbox::container::ContainerConfig::detect() {
        Ok(c) => c.bwrap,
        Err(e) => {
            return Check::new(NAME, Verdict::Fail, e.to_string())
                .fix("apt-get install bubblewrap (or scripts/install-deps.sh)")
        }
    };
    let out = std::process::Command::new(&bwrap)
        .args([
            "--ro-bind",
            "/",
            "/",
            "--unshare-all",
            "--die-with-parent",
            "true",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => Check::new(NAME, Verdict::Ok, format!("{} makes sandboxes", bwrap.display())),
        Ok(o) => Check::new(
            NAME,
            Verdict::Fail,
            format!("{} cannot make a sandbox: {}", bwrap.display(), String::from_utf8_lossy(&o.stderr).trim()),
        )
        .fix("allow unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` (Debian) or `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 24.04)"),
        Err(e) => Check::new(NAME, Verdict::Fail, format!("cannot run {}: {e}", bwrap.display()))
            .fix("apt-get install --reinstall bubblewrap"),
    }
}

/// Cgroups for container jobs: a child group with the memory and pids controllers.
fn check_cgroups(config: &NodeConfig) -> Check {
    const NAME: &str = "cgroups";
    if !container_backend(config) {
        return Check::new(NAME, Verdict::Skip, "the container backend is off");
    }
    if gpunode_sandbox::container::cgroups_delegated() {
        Check::new(
            NAME,
            Verdict::Ok,
            "container jobs get their own cgroup (memory and process limits)",
        )
    } else {
        Check::new(
            NAME,
            Verdict::Warn,
            "no writable cgroup with the memory and pids controllers: container jobs fall back to per-process rlimits",
        )
        .fix("run the daemon with delegated cgroups: `systemd-run -p Delegate=yes --scope gpunode serve`, or Delegate=yes in its systemd unit")
    }
}

fn check_gpus(config: &NodeConfig) -> Check {
    const NAME: &str = "NVML";
    if let Some(spec) = &config.simulate_gpus {
        return Check::new(
            NAME,
            Verdict::Skip,
            format!("simulated GPUs ({spec}) for a test network"),
        );
    }
    match gpunode_node::inventory::NvmlInventory::init() {
        Ok(inv) => {
            use gpunode_node::inventory::GpuInventory;
            let n = inv.snapshot().map(|s| s.gpus.len()).unwrap_or(0);
            Check::new(NAME, Verdict::Ok, format!("{n} NVIDIA GPU(s) found"))
        }
        Err(reason) => Check::new(
            NAME,
            Verdict::Warn,
            format!("no NVIDIA GPU found ({reason}): this node lends CPU slots only"),
        )
        .fix("install the NVIDIA driver so that libnvidia-ml.so.1 loads (`nvidia-smi` must list the GPUs)"),
    }
}

/// The team certificate: how long until it expires.
fn check_team(data_dir: &DataDir) -> Check {
    const NAME: &str = "team certificate";
    const DAY_MS: u64 = 24 * 3600 * 1000;
    let rejoin = "ask a team admin for a new token (`gpunode team invite` on their machine), then `gpunode team join TOKEN` here with the daemon stopped";
    match gpunode_node::team::TeamState::load(data_dir.root()) {
        Ok(None) => Check::new(NAME, Verdict::Skip, "not in a team"),
        Err(e) => Check::new(NAME, Verdict::Fail, e.to_string()).fix(rejoin),
        Ok(Some(state)) => {
            let now = gpunode_protocol::time::now_ms();
            let expires = state.own.cert.expires_ms;
            let team = &state.name;
            if expires <= now {
                Check::new(
                    NAME,
                    Verdict::Fail,
                    format!("the certificate for team {team} has expired"),
                )
                .fix(rejoin)
            } else if expires - now < 7 * DAY_MS {
                Check::new(
                    NAME,
                    Verdict::Warn,
                    format!("the certificate for team {team} expires in {} h", (expires - now) / 3_600_000),
                )
                .fix(format!("keep the daemon running and connected to an admin, which renews it; or {rejoin}"))
            } else {
                Check::new(
                    NAME,
                    Verdict::Ok,
                    format!("team {team}, valid {} more days", (expires - now) / DAY_MS),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_net(route: &str, ipv6: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("route"), route).unwrap();
        std::fs::write(dir.path().join("ipv6_route"), ipv6).unwrap();
        dir
    }

    const HEADER: &str = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n";

    #[test]
    fn routes_tell_default_lan_only_and_none() {
        let default = proc_net(
            &format!("{HEADER}eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\neth0\t0000000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"),
            "",
        );
        let c = check_route(default.path());
        assert_eq!(
            (c.verdict, c.detail.as_str()),
            (Verdict::Ok, "default route via eth0")
        );

        let lan = proc_net(
            &format!("{HEADER}veth0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"),
            "",
        );
        let c = check_route(lan.path());
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.detail.contains("veth0"), "{c:?}");

        // Loopback and IPv6 link-local routes only (a namespace with nothing else).
        let none = proc_net(
            HEADER,
            "fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0\n\
             00000000000000000000000000000001 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001       lo\n",
        );
        let c = check_route(none.path());
        assert_eq!(c.verdict, Verdict::Fail, "{c:?}");
        assert!(c.fix.unwrap().contains("ip route"));
        // Unreadable files are no route at all, not a crash.
        let c = check_route(Path::new("/nonexistent"));
        assert_eq!(c.verdict, Verdict::Fail);
    }

    fn status(listen: &[&str], observed: &[&str], peers: usize) -> NodeStatus {
        let mut s: NodeStatus = serde_json::from_value(serde_json::json!({
            "peer_id": "x", "version": "0", "listen_addrs": [], "connected_peers": [],
            "routing_table_size": 0,
            "advert": gpunode_node::views::AdvertStatus::default(),
            "inventory": {"gpus": [], "driver_version": null, "source": "none"},
        }))
        .unwrap();
        s.listen_addrs = listen.iter().map(|a| a.to_string()).collect();
        s.observed_addrs = observed.iter().map(|a| a.to_string()).collect();
        s.connected_peers = (0..peers).map(|i| format!("peer{i}")).collect();
        s
    }

    #[test]
    fn a_node_seen_at_another_address_is_behind_nat_and_told_which_port_to_forward() {
        let natted = status(
            &["/ip4/192.168.1.10/udp/4001/quic-v1"],
            &["/ip4/203.0.113.5/udp/40123/quic-v1"],
            2,
        );
        let c = check_reachability(&natted);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(
            c.detail.contains("203.0.113.5") && c.detail.contains("NAT"),
            "{c:?}"
        );
        assert!(c.fix.unwrap().contains("UDP port 4001"));
        let mut relayed = natted.clone();
        relayed.reachability = "behind NAT, relayed via 12D3KooWRelay".into();
        let c = check_reachability(&relayed);
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.detail.contains("relayed via 12D3KooWRelay"), "{c:?}");
        assert!(c.fix.unwrap().contains("upnp = true"));

        let direct = status(
            &["/ip4/198.51.100.7/udp/4001/quic-v1"],
            &["/ip4/198.51.100.7/udp/4001/quic-v1"],
            1,
        );
        assert_eq!(check_reachability(&direct).verdict, Verdict::Ok);
        let alone = status(&["/ip4/198.51.100.7/udp/4001/quic-v1"], &[], 0);
        let c = check_reachability(&alone);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.fix.unwrap().contains("bootstrap"));
    }

    #[test]
    fn loopback_or_random_ports_are_flagged_with_the_listen_line_to_use() {
        let config = NodeConfig::default();
        let lo = status(&["/ip4/127.0.0.1/udp/4001/quic-v1"], &[], 0);
        let c = check_listen(&lo, &config);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.fix.unwrap().contains("listen = ["));
        let random = NodeConfig {
            listen: vec!["/ip4/0.0.0.0/udp/0/quic-v1".parse().unwrap()],
            ..NodeConfig::default()
        };
        let c = check_listen(
            &status(&["/ip4/10.0.0.2/udp/39999/quic-v1"], &[], 0),
            &random,
        );
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.detail.contains("random"));
    }

    #[test]
    fn an_advert_dated_ahead_names_the_peer_and_the_fix() {
        let offer = |issued: u64| -> OfferView {
            let mut o: OfferView = serde_json::from_value(serde_json::json!({
                "peer_id": "12D3KooWpeer", "gpus": [], "cpu_cores": 1, "ram_bytes": 0, "backends": [],
                "price_per_gpu_hour": 0.0, "simulated": true, "seq": 1, "issued_at_ms": 0,
                "expires_at_ms": 0, "listen_addrs": [],
            }))
            .unwrap();
            o.issued_at_ms = issued;
            o
        };
        let now = 1_000_000_000;
        assert_eq!(
            check_clock(&[offer(now - 60_000)], now).verdict,
            Verdict::Ok
        );
        let c = check_clock(&[offer(now - 1), offer(now + 120_000)], now);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(
            c.detail.contains("12D3KooWpeer") && c.detail.contains("120 s"),
            "{c:?}"
        );
        assert_eq!(check_clock(&[], now).verdict, Verdict::Skip);
    }
}
