//! The team policy: quotas, lending windows and priorities by role and job kind, signed
//! by the team key or an admin, and the checks of a request against it.

use libp2p_identity::{Keypair, PeerId};
use serde::{Deserialize, Serialize};

use super::certificates::verify_by_team_or_admin;
use super::{check_team, Role, SignedCertificate, TeamError, TeamId, POLICY_SIGNING_TAG};
use crate::encoding;
use crate::signing;
use crate::time::UnixMillis;

/// Interactive work (someone waits for it) or batch work (runs unattended).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Someone waits for it.
    #[default]
    Interactive,
    /// Runs unattended.
    Batch,
}

impl std::fmt::Display for JobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobKind::Interactive => "interactive",
            JobKind::Batch => "batch",
        })
    }
}

/// GPU-hour limits.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Quota {
    /// GPU-hours per day (team time), at each provider.
    pub gpu_hours_per_day: Option<f64>,
    /// GPU-hours per week (Monday to Sunday, team time), at each provider.
    pub gpu_hours_per_week: Option<f64>,
}

/// When work of one kind may run: days (0 = Monday .. 6 = Sunday) and minutes of the
/// day, team time; a window whose end is before its start runs past midnight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Which work.
    pub kind: JobKind,
    /// Days it starts on.
    pub days: Vec<u8>,
    /// First minute.
    pub start_min: u16,
    /// Minute it ends (exclusive; 1440 = midnight).
    pub end_min: u16,
}

/// The rules an admin sets for the whole team; every member's node enforces them on
/// team requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamPolicy {
    /// The team.
    pub team: TeamId,
    /// Grows with every new policy; nodes keep the highest.
    pub seq: u64,
    /// Who signed it.
    pub issuer: PeerId,
    /// Credits a member may use at each provider before giving back.
    pub allowance: f64,
    /// Serving priority of admins' work.
    pub priority_admin: i32,
    /// Serving priority of members' work.
    pub priority_member: i32,
    /// Whether a waiting request may stop running leases of a lower priority to start
    /// (they are charged only for the time they used).
    pub preempt_lower: bool,
    /// Limits for every member.
    pub quota: Quota,
    /// Limits for named members, instead of `quota`.
    pub member_quotas: Vec<(PeerId, Quota)>,
    /// When each kind of work may run (a kind without windows may run any time).
    pub windows: Vec<Window>,
    /// Team time: minutes east of UTC.
    pub utc_offset_min: i32,
}

/// A policy with its signature (and the issuer's admin certificate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedPolicy {
    /// The policy.
    pub policy: TeamPolicy,
    /// The issuer's signature.
    pub signature: Vec<u8>,
    /// The issuer's admin certificate when it is not the team key.
    pub issuer_cert: Option<SignedCertificate>,
}

impl SignedPolicy {
    /// Signs `policy` with `key`, an admin's (with `issuer_cert`) or the team key (without).
    pub fn sign(
        policy: TeamPolicy,
        key: &Keypair,
        issuer_cert: Option<SignedCertificate>,
    ) -> Result<SignedPolicy, TeamError> {
        let signature = signing::sign(key, POLICY_SIGNING_TAG, &encoding::encode(&policy))?;
        Ok(SignedPolicy {
            policy,
            signature,
            issuer_cert,
        })
    }

    /// Checks that the team key or an admin of `team` signed it.
    pub fn verify(&self, team: &TeamId, team_key: &[u8], now: UnixMillis) -> Result<(), TeamError> {
        let key = check_team(team, team_key, &self.policy.team)?;
        verify_by_team_or_admin(
            &key,
            &self.policy.issuer,
            self.issuer_cert.as_ref(),
            (team, team_key, now),
            POLICY_SIGNING_TAG,
            &encoding::encode(&self.policy),
            &self.signature,
        )
    }
}

/// What a member already used at this provider, GPU-milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Used {
    /// Today (team time).
    pub today_gpu_ms: u64,
    /// This week (team time).
    pub week_gpu_ms: u64,
}

const DAY_MS: i64 = 86_400_000;
const DAY_NAMES: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

impl TeamPolicy {
    /// Day of the week (0 = Monday), minute of the day, start of today and of this week
    /// (unix ms), all in team time.
    pub fn team_time(&self, now: UnixMillis) -> (u8, u16, UnixMillis, UnixMillis) {
        let local = now as i64 + self.utc_offset_min as i64 * 60_000;
        let days = local.div_euclid(DAY_MS);
        // 1970-01-01 was a Thursday (3).
        let weekday = (days + 3).rem_euclid(7) as u8;
        let minute = (local.rem_euclid(DAY_MS) / 60_000) as u16;
        let offset = self.utc_offset_min as i64 * 60_000;
        let today = (days * DAY_MS - offset).max(0) as u64;
        let week = ((days - weekday as i64) * DAY_MS - offset).max(0) as u64;
        (weekday, minute, today, week)
    }

    /// The quota of `member`.
    pub fn quota_of(&self, member: &PeerId) -> Quota {
        self.member_quotas
            .iter()
            .find(|(p, _)| p == member)
            .map(|(_, q)| *q)
            .unwrap_or(self.quota)
    }

    /// Whether a lease of `gpus` for `duration_ms` of `kind` work by `member` breaks the
    /// policy at `now`; the error names the rule.
    pub fn check(
        &self,
        member: &PeerId,
        kind: JobKind,
        gpus: u32,
        duration_ms: u64,
        used: Used,
        now: UnixMillis,
    ) -> Result<(), String> {
        let (weekday, minute, _, _) = self.team_time(now);
        let windows: Vec<&Window> = self.windows.iter().filter(|w| w.kind == kind).collect();
        if !windows.is_empty() && !windows.iter().any(|w| w.contains(weekday, minute)) {
            let allowed: Vec<String> = windows.iter().map(|w| w.describe()).collect();
            return Err(format!(
                "team policy: {kind} work may run only {} (team time); it is {} {:02}:{:02} now (rule: window)",
                allowed.join(", "),
                DAY_NAMES[weekday as usize % 7],
                minute / 60,
                minute % 60
            ));
        }
        let asked = gpus as f64 * duration_ms as f64 / 3_600_000.0;
        let q = self.quota_of(member);
        for (limit, used_ms, rule) in [
            (q.gpu_hours_per_day, used.today_gpu_ms, "gpu_hours_per_day"),
            (q.gpu_hours_per_week, used.week_gpu_ms, "gpu_hours_per_week"),
        ] {
            if let Some(limit) = limit {
                let used_h = used_ms as f64 / 3_600_000.0;
                if used_h + asked > limit + 1e-9 {
                    return Err(format!(
                        "team policy quota {rule} = {limit}: you have {used_h:.2} GPU-hours at this provider already and this lease asks {asked:.2} (rule: quota.{rule})"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Serving priority of a role.
    pub fn priority(&self, role: Role) -> i32 {
        match role {
            Role::Admin => self.priority_admin,
            Role::Member => self.priority_member,
        }
    }
}

/// Whether a weekly window that starts on `days` at `start_min` and ends at `end_min`
/// (exclusive; an end before the start runs past midnight) covers `minute` of `weekday`
/// (0 = Monday).
pub fn window_covers(days: &[u8], start_min: u16, end_min: u16, weekday: u8, minute: u16) -> bool {
    if start_min < end_min {
        days.contains(&weekday) && minute >= start_min && minute < end_min
    } else {
        let yesterday = (weekday + 6) % 7;
        (days.contains(&weekday) && minute >= start_min)
            || (days.contains(&yesterday) && minute < end_min)
    }
}

impl Window {
    /// Whether the window covers `minute` of `weekday`.
    pub fn contains(&self, weekday: u8, minute: u16) -> bool {
        window_covers(&self.days, self.start_min, self.end_min, weekday, minute)
    }

    /// Like "mon-fri 18:00-09:00".
    pub fn describe(&self) -> String {
        let days: Vec<&str> = self
            .days
            .iter()
            .map(|d| DAY_NAMES[*d as usize % 7])
            .collect();
        format!(
            "{} {:02}:{:02}-{:02}:{:02}",
            days.join(","),
            self.start_min / 60,
            self.start_min % 60,
            self.end_min / 60,
            self.end_min % 60
        )
    }
}
