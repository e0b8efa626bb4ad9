//! The team policy as admins write it (TOML) and as providers enforce it.
//!
//! ```toml
//! allowance = 100.0           # credits a member may use at each provider
//! utc_offset = "+01:00"       # team time
//! [priority]
//! admin = 10
//! member = 0
//! preempt = false             # may higher-priority work stop lower-priority leases?
//! [quota]                     # GPU-hours at each provider
//! gpu_hours_per_day = 8.0
//! gpu_hours_per_week = 30.0
//! [[quota.member]]
//! peer = "12D3KooW..."
//! gpu_hours_per_day = 16.0
//! [[window]]                  # a kind without windows may run any time
//! kind = "interactive"
//! days = "mon-fri"
//! hours = "09:00-18:00"
//! [[window]]
//! kind = "batch"
//! days = "mon-fri"
//! hours = "18:00-09:00"
//! ```
//!
//! Quotas count the GPU-hours of leases a provider granted the member (what a lease
//! reserves, granted today or this week in team time): each provider enforces them for
//! its own GPUs, with nothing to coordinate.

use std::collections::HashMap;
use std::sync::Mutex;

use gpunode_protocol::team::{JobKind, Quota, TeamId, TeamPolicy, Used, Window};
use gpunode_protocol::time::UnixMillis;
use libp2p::PeerId;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default = "default_allowance")]
    allowance: f64,
    #[serde(default)]
    utc_offset: Option<String>,
    #[serde(default)]
    priority: PriorityFile,
    #[serde(default)]
    quota: QuotaFile,
    #[serde(default)]
    window: Vec<WindowFile>,
}

fn default_allowance() -> f64 {
    100.0
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct PriorityFile {
    #[serde(default)]
    admin: i32,
    #[serde(default)]
    member: i32,
    #[serde(default)]
    preempt: bool,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct QuotaFile {
    gpu_hours_per_day: Option<f64>,
    gpu_hours_per_week: Option<f64>,
    #[serde(default)]
    member: Vec<MemberQuotaFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemberQuotaFile {
    peer: String,
    gpu_hours_per_day: Option<f64>,
    gpu_hours_per_week: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WindowFile {
    kind: String,
    days: String,
    #[serde(default = "all_day")]
    hours: String,
}

fn all_day() -> String {
    "00:00-24:00".into()
}

const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

fn day(name: &str) -> Result<u8, String> {
    DAYS.iter()
        .position(|d| *d == name.trim().to_ascii_lowercase())
        .map(|i| i as u8)
        .ok_or_else(|| format!("unknown day '{name}': use mon, tue, wed, thu, fri, sat, sun"))
}

/// "mon-fri", "sat,sun", "mon" → day numbers.
pub fn days(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (day(a)?, day(b)?);
                let mut d = a;
                loop {
                    out.push(d);
                    if d == b {
                        break;
                    }
                    d = (d + 1) % 7;
                }
            }
            None => out.push(day(part)?),
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// "19:30" → minutes of the day (0 to 1440).
pub fn minute(text: &str) -> Result<u16, String> {
    let (h, m) = text
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("'{text}' is not a time of day like 09:00"))?;
    let (h, m): (u16, u16) = (
        h.parse().map_err(|_| format!("bad hour in '{text}'"))?,
        m.parse().map_err(|_| format!("bad minute in '{text}'"))?,
    );
    if m >= 60 || h > 24 || (h == 24 && m != 0) {
        return Err(format!("'{text}' is not a time of day like 09:00"));
    }
    Ok(h * 60 + m)
}

/// "+01:00" → minutes east of UTC.
pub fn offset(text: &str) -> Result<i32, String> {
    let t = text.trim();
    let (sign, rest) = match t.chars().next() {
        Some('+') => (1, &t[1..]),
        Some('-') => (-1, &t[1..]),
        _ => return Err(format!("utc_offset '{t}' must look like +01:00 or -05:30")),
    };
    let m =
        minute(rest).map_err(|_| format!("utc_offset '{t}' must look like +01:00 or -05:30"))?;
    Ok(sign * m as i32)
}

fn check_hours(name: &str, v: Option<f64>) -> Result<Option<f64>, String> {
    match v {
        Some(h) if !(h.is_finite() && h >= 0.0) => Err(format!(
            "{name} must be a non-negative number of GPU-hours, not {h}"
        )),
        other => Ok(other),
    }
}

/// Parses a policy file for `team`; the error names what to fix.
pub fn parse(text: &str, team: TeamId, issuer: PeerId, seq: u64) -> Result<TeamPolicy, String> {
    let f: PolicyFile = toml::from_str(text).map_err(|e| format!("invalid policy file: {e}"))?;
    if !(f.allowance.is_finite() && f.allowance >= 0.0) {
        return Err(format!(
            "allowance must be a non-negative number of credits, not {}",
            f.allowance
        ));
    }
    let mut member_quotas = Vec::new();
    for m in f.quota.member {
        let peer: PeerId = m
            .peer
            .trim()
            .parse()
            .map_err(|_| format!("quota.member peer '{}' is not a peer id", m.peer))?;
        member_quotas.push((
            peer,
            Quota {
                gpu_hours_per_day: check_hours("gpu_hours_per_day", m.gpu_hours_per_day)?,
                gpu_hours_per_week: check_hours("gpu_hours_per_week", m.gpu_hours_per_week)?,
            },
        ));
    }
    let mut windows = Vec::new();
    for w in f.window {
        let kind = match w.kind.trim().to_ascii_lowercase().as_str() {
            "interactive" => JobKind::Interactive,
            "batch" => JobKind::Batch,
            other => return Err(format!("window kind '{other}': use interactive or batch")),
        };
        let (a, b) = w
            .hours
            .split_once('-')
            .ok_or_else(|| format!("window hours '{}' must look like 09:00-18:00", w.hours))?;
        let (start_min, end_min) = (minute(a)?, minute(b)?);
        if start_min == end_min {
            return Err(format!("window hours '{}' are empty", w.hours));
        }
        windows.push(Window {
            kind,
            days: days(&w.days)?,
            start_min,
            end_min,
        });
    }
    Ok(TeamPolicy {
        team,
        seq,
        issuer,
        allowance: f.allowance,
        priority_admin: f.priority.admin,
        priority_member: f.priority.member,
        preempt_lower: f.priority.preempt,
        quota: Quota {
            gpu_hours_per_day: check_hours("gpu_hours_per_day", f.quota.gpu_hours_per_day)?,
            gpu_hours_per_week: check_hours("gpu_hours_per_week", f.quota.gpu_hours_per_week)?,
        },
        member_quotas,
        windows,
        utc_offset_min: match f.utc_offset {
            Some(o) => offset(&o)?,
            None => 0,
        },
    })
}

/// The policy written back as a file an admin can edit.
pub fn to_toml(p: &TeamPolicy) -> String {
    let mut out = format!(
        "# team policy, version {}\nallowance = {}\nutc_offset = \"{}{:02}:{:02}\"\n\n[priority]\nadmin = {}\nmember = {}\npreempt = {}\n\n[quota]\n",
        p.seq,
        p.allowance,
        if p.utc_offset_min < 0 { '-' } else { '+' },
        p.utc_offset_min.unsigned_abs() / 60,
        p.utc_offset_min.unsigned_abs() % 60,
        p.priority_admin,
        p.priority_member,
        p.preempt_lower
    );
    let quota = |q: &Quota| {
        let mut s = String::new();
        if let Some(h) = q.gpu_hours_per_day {
            s += &format!("gpu_hours_per_day = {h}\n");
        }
        if let Some(h) = q.gpu_hours_per_week {
            s += &format!("gpu_hours_per_week = {h}\n");
        }
        s
    };
    out += &quota(&p.quota);
    for (peer, q) in &p.member_quotas {
        out += &format!("\n[[quota.member]]\npeer = \"{peer}\"\n{}", quota(q));
    }
    for w in &p.windows {
        let (days, hours) = w
            .describe()
            .split_once(' ')
            .map_or((String::new(), String::new()), |(a, b)| {
                (a.to_string(), b.to_string())
            });
        out += &format!(
            "\n[[window]]\nkind = \"{}\"\ndays = \"{days}\"\nhours = \"{hours}\"\n",
            w.kind
        );
    }
    out
}

/// Grants kept per member (older ones are folded away by the week's horizon).
const MAX_GRANTS_PER_MEMBER: usize = 100_000;

/// GPU-hours granted to each member by this provider, for quotas. Saved with the team
/// state ([`Grants::save`]), so a provider's restart does not reset anyone's quota.
#[derive(Debug, Default)]
pub struct Grants(Mutex<GrantBook>);

/// Grants by member (time, GPU-ms), and whether they changed since the last save.
type GrantBook = (HashMap<PeerId, Vec<(UnixMillis, u64)>>, bool);

impl Grants {
    fn lock(&self) -> std::sync::MutexGuard<'_, GrantBook> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The grants saved at `path` (none when the file is missing or unreadable).
    pub fn load(path: &std::path::Path) -> Grants {
        let map = std::fs::read(path)
            .ok()
            .and_then(|bytes| {
                gpunode_protocol::encoding::decode::<Vec<(PeerId, Vec<(UnixMillis, u64)>)>>(
                    &bytes,
                    64 << 20,
                )
                .ok()
            })
            .map(|v| v.into_iter().collect())
            .unwrap_or_default();
        Grants(Mutex::new((map, false)))
    }

    /// Writes the grants to `path` (atomically) if they changed since the last save.
    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let bytes = {
            let mut g = self.lock();
            if !g.1 {
                return Ok(());
            }
            g.1 = false;
            let list: Vec<(&PeerId, &Vec<(UnixMillis, u64)>)> = g.0.iter().collect();
            gpunode_protocol::encoding::encode(&list)
        };
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)
    }

    /// Counts a lease of `gpu_ms` granted to `peer` at `at`.
    pub fn record(&self, peer: PeerId, at: UnixMillis, gpu_ms: u64) {
        let mut g = self.lock();
        g.1 = true;
        let list = g.0.entry(peer).or_default();
        list.push((at, gpu_ms));
        // Nothing older than a week and a day matters.
        let horizon = at.saturating_sub(8 * 86_400_000);
        list.retain(|(t, _)| *t >= horizon);
        if list.len() > MAX_GRANTS_PER_MEMBER {
            // Fold the oldest two into one (their sum at the later time): totals for
            // the day and week stay right or err towards more use.
            let (t, a) = list.remove(0);
            list[0] = (list[0].0.max(t), list[0].1.saturating_add(a));
        }
    }

    /// What `peer` was granted since the start of today and of this week.
    pub fn used(&self, peer: &PeerId, today: UnixMillis, week: UnixMillis) -> Used {
        let g = self.lock();
        let mut used = Used::default();
        for (t, ms) in g.0.get(peer).map(Vec::as_slice).unwrap_or_default() {
            if *t >= week {
                used.week_gpu_ms += ms;
            }
            if *t >= today {
                used.today_gpu_ms += ms;
            }
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
allowance = 50.0
utc_offset = "+01:00"
[priority]
admin = 10
preempt = true
[quota]
gpu_hours_per_day = 8.0
gpu_hours_per_week = 30
[[quota.member]]
peer = "12D3KooWGr7oHuzfKEQ5oNp8hqHz2PbLdyZVe9vfzAEsh7pAnRzc"
gpu_hours_per_day = 16.0
[[window]]
kind = "interactive"
days = "mon-fri"
hours = "09:00-18:00"
[[window]]
kind = "batch"
days = "fri-mon"
hours = "18:00-09:00"
"#;

    #[test]
    fn a_policy_file_parses_and_prints_back() {
        let team = TeamId([1; 32]);
        let issuer = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let p = parse(EXAMPLE, team, issuer, 3).expect("parses");
        assert_eq!(p.allowance, 50.0);
        assert_eq!(p.utc_offset_min, 60);
        assert_eq!(p.priority_admin, 10);
        assert!(p.preempt_lower);
        assert_eq!(p.quota.gpu_hours_per_week, Some(30.0));
        assert_eq!(p.member_quotas.len(), 1);
        assert_eq!(p.windows[0].days, vec![0, 1, 2, 3, 4]);
        assert_eq!(
            p.windows[1].days,
            vec![0, 4, 5, 6],
            "fri-mon wraps the week"
        );
        assert_eq!((p.windows[1].start_min, p.windows[1].end_min), (1080, 540));
        let again = parse(&to_toml(&p), team, issuer, 3).expect("round trip");
        assert_eq!(again, p);
    }

    #[test]
    fn bad_policy_files_say_what_to_fix() {
        let team = TeamId([1; 32]);
        let issuer = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let err = |text: &str| parse(text, team, issuer, 1).unwrap_err();
        assert!(err("quotas = 1").contains("quotas"));
        assert!(err("[quota]\ngpu_hours_per_day = -1").contains("gpu_hours_per_day"));
        assert!(
            err("[[window]]\nkind = \"gaming\"\ndays = \"mon\"").contains("interactive or batch")
        );
        assert!(err("[[window]]\nkind = \"batch\"\ndays = \"funday\"").contains("unknown day"));
        assert!(
            err("[[window]]\nkind = \"batch\"\ndays = \"mon\"\nhours = \"9-5\"")
                .contains("time of day")
        );
        assert!(err("utc_offset = \"1h\"").contains("+01:00"));
        assert!(err("[[quota.member]]\npeer = \"bob\"").contains("peer id"));
    }

    #[test]
    fn grants_count_today_and_this_week() {
        let g = Grants::default();
        let p = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let day = 86_400_000;
        g.record(p, 10 * day + 5, 1_000);
        g.record(p, 12 * day + 5, 2_000);
        let used = g.used(&p, 12 * day, 9 * day);
        assert_eq!(used.today_gpu_ms, 2_000);
        assert_eq!(used.week_gpu_ms, 3_000);
    }

    #[test]
    fn quota_usage_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("grants");
        let p = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let day = 86_400_000;
        let g = Grants::default();
        g.record(p, 10 * day + 5, 1_000);
        g.record(p, 12 * day + 5, 2_000);
        g.save(&path).expect("save");
        // A restart: the same usage counts against the quota.
        let back = Grants::load(&path);
        assert_eq!(
            back.used(&p, 12 * day, 9 * day),
            g.used(&p, 12 * day, 9 * day)
        );
        // A damaged file is no usage, not a crash.
        std::fs::write(&path, b"garbage").expect("write");
        assert_eq!(Grants::load(&path).used(&p, 0, 0), Used::default());
    }
}
