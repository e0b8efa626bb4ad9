//! A NAT lab made of network namespaces (root only), for tests and benchmarks of
//! members behind NAT: a bridge that stands for the internet ([`WAN`]`.0/24`, a range
//! reserved for documentation and never routed), a public host on it, and hosts behind
//! router namespaces of their own that masquerade with iptables, either keeping the
//! source port (endpoint-independent mapping, what hole punching needs) or picking a
//! new one per destination (symmetric, `--random-fully`). Routers drop unsolicited
//! inbound packets, as home routers do. [`TeamLab`] runs a team in it: the public host
//! creates the team, the others join by invite and serve behind their NATs.
//!
//! Everything made here is removed on drop.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::process::{ServeProcess, SIGINT};

/// The lab's internet: `WAN.2` is the public host, `WAN.<lan>` the router of LAN
/// `192.168.<lan>.0/24`.
pub const WAN: &str = "198.51.100";

/// The port every lab node listens on (QUIC and TCP); each has a namespace of its own.
pub const LAB_PORT: u16 = 4170;

/// A NAT's mapping behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    /// The mapping keeps the source port for every destination: punches succeed.
    EndpointIndependent,
    /// A new port for each destination: what a peer learnt is useless to another.
    Symmetric,
}

/// The namespaces of one lab; removed on drop.
#[derive(Debug)]
pub struct Lab {
    tag: u32,
    names: Vec<String>,
}

fn run(cmd: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(cmd).args(args).output().with_context(|| {
        format!("cannot run {cmd} (the NAT lab needs root, iproute2 and iptables)")
    })?;
    if !out.status.success() {
        bail!(
            "{cmd} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl Lab {
    /// The internet and the public host (`pub`, at `WAN.2`).
    pub fn new() -> Result<Lab> {
        let mut lab = Lab {
            tag: std::process::id() % 100_000,
            names: Vec::new(),
        };
        let wan = lab.add("wan")?;
        run("ip", &["-n", &wan, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &wan, "link", "set", "br0", "up"])?;
        lab.add("pub")?;
        lab.on_wan("pub", "eth0", 2)?;
        Ok(lab)
    }

    /// The namespace of host `name`.
    pub fn ns(&self, name: &str) -> String {
        format!("gpn{}-{name}", self.tag)
    }

    fn add(&mut self, name: &str) -> Result<String> {
        let ns = self.ns(name);
        run("ip", &["netns", "add", &ns])?;
        self.names.push(ns.clone());
        run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Plugs namespace `name` into the internet as `WAN.host` on interface `dev`.
    fn on_wan(&self, name: &str, dev: &str, host: u8) -> Result<()> {
        let (wan, ns) = (self.ns("wan"), self.ns(name));
        let port = format!("w-{name}");
        run(
            "ip",
            &[
                "link", "add", &port, "netns", &wan, "type", "veth", "peer", "name", dev, "netns",
                &ns,
            ],
        )?;
        run("ip", &["-n", &wan, "link", "set", &port, "master", "br0"])?;
        run("ip", &["-n", &wan, "link", "set", &port, "up"])?;
        let addr = format!("{WAN}.{host}/24");
        run("ip", &["-n", &ns, "addr", "add", &addr, "dev", dev])?;
        run("ip", &["-n", &ns, "link", "set", dev, "up"])
    }

    /// Host `name` at `192.168.<lan>.2`, behind router `r<name>` at `WAN.<lan>`.
    pub fn behind_nat(&mut self, name: &str, lan: u8, nat: Nat) -> Result<()> {
        let router = format!("r{name}");
        let r = self.add(&router)?;
        let h = self.add(name)?;
        self.on_wan(&router, "wan0", lan)?;
        run(
            "ip",
            &[
                "link", "add", "lan0", "netns", &r, "type", "veth", "peer", "name", "eth0",
                "netns", &h,
            ],
        )?;
        let (gw, host) = (format!("192.168.{lan}.1"), format!("192.168.{lan}.2"));
        run(
            "ip",
            &["-n", &r, "addr", "add", &format!("{gw}/24"), "dev", "lan0"],
        )?;
        run(
            "ip",
            &[
                "-n",
                &h,
                "addr",
                "add",
                &format!("{host}/24"),
                "dev",
                "eth0",
            ],
        )?;
        run("ip", &["-n", &r, "link", "set", "lan0", "up"])?;
        run("ip", &["-n", &h, "link", "set", "eth0", "up"])?;
        run("ip", &["-n", &h, "route", "add", "default", "via", &gw])?;
        run(
            "ip",
            &[
                "netns",
                "exec",
                &r,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
        )?;
        let ipt = |args: &[&str]| run("ip", &[&["netns", "exec", &r, "iptables"], args].concat());
        let masquerade = [
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "wan0",
            "-j",
            "MASQUERADE",
        ];
        match nat {
            Nat::EndpointIndependent => ipt(&masquerade)?,
            Nat::Symmetric => ipt(&[&masquerade[..], &["--random-fully"]].concat())?,
        }
        ipt(&[
            "-A",
            "INPUT",
            "-i",
            "wan0",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        ])?;
        ipt(&["-A", "INPUT", "-i", "wan0", "-j", "DROP"])
    }

    /// A script in `dir` that runs `binary` inside host `name`'s namespace (with
    /// `RUST_LOG` set to `$GPUNODE_LAB_LOG` when that is set, to debug a lab).
    pub fn launcher(&self, name: &str, binary: &Path, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(format!("in-{name}.sh"));
        let script = format!(
            "#!/bin/sh\n[ -n \"$GPUNODE_LAB_LOG\" ] && export RUST_LOG=\"$GPUNODE_LAB_LOG\"\nexec ip netns exec {} {} \"$@\"\n",
            self.ns(name),
            binary.display()
        );
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        Ok(path)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for n in self.names.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// A team in a [`Lab`]: the public host (`pub`) created it and serves; members join by
/// invite from hosts behind NAT and serve there, bootstrapped to it.
pub struct TeamLab {
    /// The public member.
    pub public: ServeProcess,
    /// Members started with [`TeamLab::start_member`], by host name.
    pub members: Vec<(String, ServeProcess)>,
    binary: PathBuf,
    dir: PathBuf,
    // Last: the processes stop before their namespaces go.
    lab: Lab,
}

impl TeamLab {
    /// The lab with a host behind NAT per entry of `hosts` (LANs numbered from 11), and
    /// the public member serving; data dirs go under `dir`.
    pub fn start(binary: &Path, dir: &Path, hosts: &[(&str, Nat)]) -> Result<TeamLab> {
        let mut lab = Lab::new()?;
        for (i, (name, nat)) in hosts.iter().enumerate() {
            lab.behind_nat(name, 11 + i as u8, *nat)?;
        }
        let public_dir = dir.join("pub");
        let created = cli(binary, &public_dir, &["team", "create", "lab"])?;
        if !created.status.success() {
            bail!("team create: {}", String::from_utf8_lossy(&created.stderr));
        }
        let public = ServeProcess::start(
            &lab.launcher("pub", binary, dir)?,
            &public_dir,
            &listen_args(LAB_PORT),
        )?;
        let team = TeamLab {
            public,
            members: Vec::new(),
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
            lab,
        };
        for (name, _) in hosts {
            team.join(name)?;
        }
        Ok(team)
    }

    /// The data dir of host `name`.
    pub fn data_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The public member's address, for `--bootstrap`.
    pub fn bootstrap(&self) -> String {
        format!(
            "/ip4/{WAN}.2/udp/{LAB_PORT}/quic-v1/p2p/{}",
            self.public.peer_id
        )
    }

    /// Host `name` joins the team with a fresh invite.
    fn join(&self, name: &str) -> Result<()> {
        let token = cli(
            &self.binary,
            &self.public.data_dir,
            &["team", "invite", "--uses", "1"],
        )?;
        if !token.status.success() {
            bail!("team invite: {}", String::from_utf8_lossy(&token.stderr));
        }
        let token = String::from_utf8_lossy(&token.stdout).trim().to_string();
        let launcher = self.lab.launcher(name, &self.binary, &self.dir)?;
        // A join that fails leaves nothing behind, so it may simply be tried again (the
        // public member may still be settling in right after it started).
        let mut why = String::new();
        for _ in 0..3 {
            let joined = Command::new(&launcher)
                .arg("--data-dir")
                .arg(self.data_dir(name))
                .args(["team", "join", &token])
                .output()?;
            if joined.status.success() {
                return Ok(());
            }
            why = String::from_utf8_lossy(&joined.stderr).into_owned();
            std::thread::sleep(Duration::from_secs(1));
        }
        bail!("team join on {name}: {why}")
    }

    /// Starts (or restarts) `gpunode serve` on host `name`, listening on `port` (0: a
    /// new one each time), with `extra` flags.
    pub fn start_member(&mut self, name: &str, port: u16, extra: &[String]) -> Result<()> {
        self.stop_member(name);
        let args = [
            &listen_args(port)[..],
            &["--bootstrap".to_string(), self.bootstrap()],
            extra,
        ]
        .concat();
        let p = ServeProcess::start(
            &self.lab.launcher(name, &self.binary, &self.dir)?,
            &self.data_dir(name),
            &args,
        )?;
        self.members.push((name.to_string(), p));
        Ok(())
    }

    /// Stops `gpunode serve` on host `name`, if it runs.
    pub fn stop_member(&mut self, name: &str) {
        if let Some(i) = self.members.iter().position(|(n, _)| n == name) {
            let (_, mut p) = self.members.remove(i);
            let _ = p.stop(SIGINT, Duration::from_secs(10));
        }
    }

    /// The member serving on host `name`.
    pub fn member(&self, name: &str) -> Option<&ServeProcess> {
        self.members.iter().find(|(n, _)| n == name).map(|(_, p)| p)
    }

    /// Runs `gpunode ARGS` against host `name`'s daemon (through its control socket).
    pub fn cli(&self, name: &str, args: &[&str]) -> Result<Output> {
        let dir = if name == "pub" {
            self.public.data_dir.clone()
        } else {
            self.data_dir(name)
        };
        cli(&self.binary, &dir, args)
    }

    /// Stops every node.
    pub fn stop(&mut self) {
        let names: Vec<String> = self.members.iter().map(|(n, _)| n.clone()).collect();
        for n in names {
            self.stop_member(&n);
        }
        let _ = self.public.stop(SIGINT, Duration::from_secs(10));
    }

    /// The lab underneath.
    pub fn lab(&self) -> &Lab {
        &self.lab
    }
}

impl Drop for TeamLab {
    fn drop(&mut self) {
        self.stop();
    }
}

fn listen_args(port: u16) -> Vec<String> {
    vec![
        "--listen".into(),
        format!("/ip4/0.0.0.0/udp/{port}/quic-v1"),
        "--listen".into(),
        format!("/ip4/0.0.0.0/tcp/{port}"),
    ]
}

/// `gpunode --data-dir DIR ARGS` with no config file of the user's.
fn cli(binary: &Path, dir: &Path, args: &[&str]) -> Result<Output> {
    Ok(Command::new(binary)
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .env("GPUNODE_CONFIG", "/dev/null")
        .output()?)
}
