//! Tables and text for people: offers, status and the local GPU table.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::time::Duration;

use gpunode_node::inventory::InventorySnapshot;
use gpunode_node::jobs::RunningJobView;
use gpunode_node::{NodeStatus, OfferView};
use gpunode_protocol::gpu::{GpuInfo, GpuState};
use gpunode_protocol::time::now_ms;
use gpunode_protocol::units::{format_age, format_bytes};

/// `12D3KooW…abcdef`: enough of a peer id to tell peers apart in a table.
pub fn short_peer(id: &str) -> String {
    if id.len() <= 16 {
        return id.to_string();
    }
    format!("{}…{}", &id[..8], &id[id.len() - 6..])
}

fn table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    writeln!(
        out,
        "{}",
        line(header.iter().map(|s| s.to_string()).collect())
    )?;
    for row in rows {
        writeln!(out, "{}", line(row.clone()))?;
    }
    Ok(())
}

/// GPUs of an offer grouped by model: `2x A100-80GB 80G (1 idle, 1 leased)`.
pub fn gpu_summary(offer: &OfferView) -> String {
    if offer.gpus.is_empty() {
        return "none (CPU only)".to_string();
    }
    // Per model: count, idle, leased, busy with the owner, off-hours.
    let mut groups: BTreeMap<(String, u64), [usize; 5]> = BTreeMap::new();
    for g in &offer.gpus {
        let e = groups.entry((g.model.clone(), g.memory_bytes)).or_default();
        e[0] += 1;
        match g.state {
            GpuState::Idle => e[1] += 1,
            GpuState::Leased => e[2] += 1,
            GpuState::OwnerBusy => e[3] += 1,
            GpuState::OffHours => e[4] += 1,
        }
    }
    groups
        .into_iter()
        .map(|((model, mem), [n, idle, leased, busy, off])| {
            let state = [
                (idle, "idle"),
                (leased, "leased"),
                (busy, "busy"),
                (off, "off-hours"),
            ]
            .iter()
            .filter(|(c, _)| *c > 0)
            .map(|(c, w)| format!("{c} {w}"))
            .collect::<Vec<_>>()
            .join(", ");
            format!("{n}x {model} {} ({state})", format_bytes(mem))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The `gpunode offers` table.
pub fn print_offers(out: &mut impl Write, offers: &[OfferView]) -> io::Result<()> {
    if offers.is_empty() {
        return writeln!(out, "No matching offers found.");
    }
    let now = now_ms();
    let rows: Vec<Vec<String>> = offers
        .iter()
        .map(|o| {
            vec![
                short_peer(&o.peer_id),
                gpu_summary(o),
                o.cpu_cores.to_string(),
                format_bytes(o.ram_bytes),
                o.backends.join(","),
                format!("{:.2}", o.price_per_gpu_hour),
                if o.simulated { "simulated" } else { "real" }.to_string(),
                format_age(Duration::from_millis(now.saturating_sub(o.issued_at_ms))),
                reserved_summary(o, now),
            ]
        })
        .collect();
    table(
        out,
        &[
            "PEER",
            "GPUS",
            "CPUS",
            "RAM",
            "BACKENDS",
            "PRICE/GPU-H",
            "KIND",
            "AGE",
            "RESERVED (UTC; free outside)",
        ],
        &rows,
    )
}

/// "gpu0 12-01 20:00-23:00" for each reservation window still to come, or "-".
fn reserved_summary(o: &OfferView, now: u64) -> String {
    let short = |ms: u64| format_utc(ms)[5..16].to_string();
    let windows: Vec<String> = o
        .gpus
        .iter()
        .flat_map(|g| {
            g.reserved
                .iter()
                .filter(|(_, e)| *e > now)
                .map(move |(s, e)| format!("gpu{} {}-{}", g.index, short(*s), &short(*e)[6..]))
        })
        .collect();
    if windows.is_empty() {
        "-".into()
    } else {
        windows.join(", ")
    }
}

/// The `gpunode status` text.
pub fn print_status(out: &mut impl Write, s: &NodeStatus) -> io::Result<()> {
    writeln!(out, "Peer ID:        {}", s.peer_id)?;
    writeln!(out, "Version:        {}", s.version)?;
    writeln!(out, "Listening on:   {}", s.listen_addrs.join(", "))?;
    writeln!(
        out,
        "Peers:          {} connected, {} in routing table",
        s.connected_peers.len(),
        s.routing_table_size
    )?;
    if let Some(seen) = s.observed_addrs.first() {
        let behind_nat =
            crate::cmd::doctor::check_reachability(s).verdict == crate::cmd::doctor::Verdict::Warn;
        let note = if behind_nat {
            " (not an address it listens on: behind NAT; `gpunode doctor` says what to do)"
        } else {
            ""
        };
        writeln!(out, "Seen by peers:  {seen}{note}")?;
    }
    if !s.reachability.is_empty() {
        writeln!(out, "Reachability:   {}", s.reachability)?;
    }
    let a = &s.advert;
    if !a.enabled {
        writeln!(out, "Advert:         none (client node)")?;
    } else if a.seq == 0 {
        writeln!(out, "Advert:         not yet published")?;
    } else {
        let now = now_ms();
        writeln!(
            out,
            "Advert:         seq {}, issued {} ago, expires in {}, stored at {} peers{}",
            a.seq,
            format_age(Duration::from_millis(now.saturating_sub(a.issued_at_ms))),
            format_age(Duration::from_millis(a.expires_at_ms.saturating_sub(now))),
            a.stored_at_peers,
            if a.publishing { " (publishing)" } else { "" }
        )?;
    }
    let inv = &s.inventory;
    if inv.gpus.is_empty() {
        return writeln!(out, "GPUs:           none found (serving CPU-only)");
    }
    print_gpus(out, inv)?;
    if s.running_jobs.is_empty() {
        return Ok(());
    }
    print_running_jobs(out, &s.running_jobs)
}

/// The local GPU table of `gpunode status`.
fn print_gpus(out: &mut impl Write, inv: &InventorySnapshot) -> io::Result<()> {
    let kind = if inv.simulated() {
        "simulated".to_string()
    } else {
        format!(
            "driver {}",
            inv.driver_version.as_deref().unwrap_or("unknown")
        )
    };
    writeln!(out, "GPUs ({kind}):")?;
    let rows: Vec<Vec<String>> = inv.gpus.iter().map(gpu_row).collect();
    table(
        out,
        &[
            "IDX", "NAME", "UUID", "MEMORY", "UTIL", "TEMP", "MIG", "CC", "STATE", "PIDS",
        ],
        &rows,
    )
}

fn gpu_row(g: &GpuInfo) -> Vec<String> {
    vec![
        g.index.to_string(),
        g.name.clone(),
        g.uuid.clone(),
        format!(
            "{} / {}",
            format_bytes(g.memory_used_bytes),
            format_bytes(g.memory_total_bytes)
        ),
        format!("{}%", g.utilization_percent),
        g.temperature_c
            .map(|t| format!("{t}C"))
            .unwrap_or_else(|| "-".to_string()),
        match g.mig_enabled {
            Some(true) => "on",
            Some(false) => "off",
            None => "n/a",
        }
        .to_string(),
        g.compute_capability
            .map(|(a, b)| format!("{a}.{b}"))
            .unwrap_or_else(|| "-".to_string()),
        g.state.label().to_string(),
        if g.processes.is_empty() {
            "-".to_string()
        } else {
            g.processes
                .iter()
                .map(|p| p.pid.to_string())
                .collect::<Vec<_>>()
                .join(",")
        },
    ]
}

/// The jobs this node runs for peers, in `gpunode status`.
fn print_running_jobs(out: &mut impl Write, jobs: &[RunningJobView]) -> io::Result<()> {
    writeln!(out, "Jobs running here for peers:")?;
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let (gpu_s, peak, util) = match &j.gpu {
                Some(g) => (
                    format!("{:.1}s", g.gpu_ms as f64 / 1000.0),
                    format_bytes(g.peak_memory_bytes),
                    format!("{}%", g.utilization_percent),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            vec![
                j.lease_id.chars().take(12).collect(),
                j.gpus.len().to_string(),
                gpu_s,
                peak,
                util,
                if j.paused { "paused" } else { "running" }.to_string(),
            ]
        })
        .collect();
    table(
        out,
        &["LEASE", "GPUS", "GPU TIME", "PEAK GPU MEM", "UTIL", "STATE"],
        &rows,
    )
}

pub use gpunode_protocol::time::format_utc;

fn gpus_of(v: &gpunode_node::LeaseView) -> String {
    if v.gpus.is_empty() {
        return "none".to_string();
    }
    v.gpus
        .iter()
        .map(|g| format!("{} ({}, {})", g.uuid, g.model, format_bytes(g.memory_bytes)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One lease in full.
pub fn print_lease(out: &mut impl Write, v: &gpunode_node::LeaseView) -> io::Result<()> {
    let now = now_ms();
    let role = match v.role {
        gpunode_node::lease::LeaseRole::Provider => "you are the provider",
        gpunode_node::lease::LeaseRole::Requester => "you are the requester",
    };
    writeln!(out, "Lease {}  ({}, {role})", v.lease_id, v.state.label())?;
    writeln!(out, "  provider    {}", v.provider)?;
    writeln!(out, "  requester   {}", v.requester)?;
    writeln!(out, "  GPUs        {}", gpus_of(v))?;
    writeln!(
        out,
        "  CPUs, RAM   {}, {}",
        v.cpus,
        format_bytes(v.mem_bytes)
    )?;
    writeln!(out, "  backend     {}", v.backend)?;
    writeln!(out, "  start       {}", format_utc(v.start_ms))?;
    let left = if v.end_ms > now {
        format!(
            " (in {})",
            format_age(Duration::from_millis(v.end_ms - now))
        )
    } else {
        String::new()
    };
    writeln!(out, "  end         {}{left}", format_utc(v.end_ms))?;
    if v.renewals > 0 {
        writeln!(out, "  renewals    {}", v.renewals)?;
    }
    writeln!(
        out,
        "  price       {:.2} credits per GPU-hour, at most {:.3} credits",
        v.price_per_gpu_hour, v.max_amount
    )?;
    writeln!(
        out,
        "  signatures  provider {}, requester {}",
        v.provider_signature, v.requester_signature
    )
}

/// The `gpunode leases` table.
pub fn print_leases(out: &mut impl Write, leases: &[gpunode_node::LeaseView]) -> io::Result<()> {
    if leases.is_empty() {
        return writeln!(out, "No leases on this node.");
    }
    let now = now_ms();
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|v| {
            let (role, peer) = match v.role {
                gpunode_node::lease::LeaseRole::Provider => ("provider", &v.requester),
                gpunode_node::lease::LeaseRole::Requester => ("requester", &v.provider),
            };
            let ends = if v.end_ms > now {
                format!("in {}", format_age(Duration::from_millis(v.end_ms - now)))
            } else {
                format!("{} ago", format_age(Duration::from_millis(now - v.end_ms)))
            };
            let gpus = match v.gpus.first() {
                Some(g) => format!("{}x {}", v.gpus.len(), g.model),
                None => "-".to_string(),
            };
            vec![
                v.lease_id[..12].to_string(),
                role.to_string(),
                short_peer(peer),
                gpus,
                v.state.label().to_string(),
                format_utc(v.start_ms),
                ends,
                format!("{:.2}", v.price_per_gpu_hour),
            ]
        })
        .collect();
    table(
        out,
        &[
            "ID",
            "ROLE",
            "PEER",
            "GPUS",
            "STATE",
            "START",
            "ENDS",
            "PRICE/GPU-H",
        ],
        &rows,
    )
}

/// The `gpunode jobs` table.
pub fn print_jobs(out: &mut impl Write, jobs: &[gpunode_node::jobs::JobView]) -> io::Result<()> {
    if jobs.is_empty() {
        return writeln!(out, "No jobs yet. Start one with `gpunode run TASK.wasm`.");
    }
    let now = now_ms();
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let took = j.ended_ms.unwrap_or(now).saturating_sub(j.submitted_ms);
            let result = match (&j.summary, &j.error) {
                (Some(s), _) => match &s.outcome {
                    gpunode_protocol::job::JobOutcome::Exited(c) => format!("exit {c}"),
                    other => format!("{other:?}").to_lowercase(),
                },
                (None, Some(e)) => e.chars().take(40).collect(),
                (None, None) => "-".into(),
            };
            let task = j
                .module
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            vec![
                j.job_id.clone(),
                match j.waiting.as_ref().and_then(|w| w.queue.as_ref()) {
                    Some((_, q)) => match q.estimated_start_ms {
                        Some(t) => format!(
                            "waiting #{} ~{}",
                            q.position,
                            format_age(Duration::from_millis(t.saturating_sub(now)))
                        ),
                        None => format!("waiting #{}", q.position),
                    },
                    None => j.state.label().to_string(),
                },
                j.provider
                    .as_deref()
                    .map(short_peer)
                    .unwrap_or_else(|| "-".into()),
                format_utc(j.submitted_ms),
                format_age(Duration::from_millis(took)),
                result,
                match j.summary.as_ref().and_then(|s| s.gpu) {
                    Some(g) => format!(
                        "{:.1}s {}",
                        g.gpu_ms as f64 / 1000.0,
                        format_bytes(g.peak_memory_bytes)
                    ),
                    None => "-".into(),
                },
                task,
            ]
        })
        .collect();
    table(
        out,
        &[
            "JOB",
            "STATE",
            "PROVIDER",
            "SUBMITTED",
            "TIME",
            "RESULT",
            "GPU",
            "TASK",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::advert::AdvertGpu;

    fn gpu(model: &str, gib: u64, state: GpuState) -> AdvertGpu {
        AdvertGpu {
            index: 0,
            uuid: "GPU-x".into(),
            model: model.into(),
            memory_bytes: gib << 30,
            state,
            mig_enabled: false,
            compute_capability: None,
            reserved: Vec::new(),
        }
    }

    #[test]
    fn gpu_summary_names_each_state() {
        let offer = OfferView {
            peer_id: "p".into(),
            gpus: vec![
                gpu("A100-80GB", 80, GpuState::Idle),
                gpu("A100-80GB", 80, GpuState::Leased),
                gpu("T4-16GB", 16, GpuState::OwnerBusy),
            ],
            cpu_cores: 8,
            ram_bytes: 1 << 30,
            backends: vec!["wasm".into()],
            price_per_gpu_hour: 1.0,
            simulated: true,
            seq: 1,
            issued_at_ms: 0,
            expires_at_ms: 1,
            listen_addrs: vec![],
            rtt_ms: None,
            reputation: None,
        };
        assert_eq!(
            gpu_summary(&offer),
            "2x A100-80GB 80G (1 idle, 1 leased); 1x T4-16GB 16G (1 busy)"
        );
    }

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(1_796_033_976_000), "2026-11-30 10:19:36 UTC");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }
}
