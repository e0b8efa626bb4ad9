//! The checks of a lease request that change nothing: version, sender, key, clock,
//! nonce, this provider's policy, and when the lease would start.

use gpunode_protocol::lease::{
    LeaseRequest, RejectCode, Rejection, Renewal, LEASE_VERSION, RESERVATION_MIN_LEAD_MS,
};
use gpunode_protocol::signing;
use gpunode_protocol::time::{UnixMillis, MAX_CLOCK_SKEW_MS};
use gpunode_protocol::PeerId;

use super::{reject, LeaseBook, LeaseState, MAX_REQUEST_LIFETIME_MS, MAX_RESERVE_AHEAD_MS};

impl LeaseBook {
    /// The checks of a request that change nothing: version, sender, key, clock, nonce
    /// (not spent here) and this provider's policy. A request that passes may still find
    /// no capacity.
    pub fn check_request(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        self.check_valid(from, req, now)?;
        self.check_policy(from, req)
    }

    pub(super) fn check_valid(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        if req.version != LEASE_VERSION {
            return Err(reject(
                RejectCode::InvalidRequest,
                format!(
                    "lease protocol version {} is not supported (this node speaks {LEASE_VERSION})",
                    req.version
                ),
            ));
        }
        if req.requester != *from {
            return Err(reject(
                RejectCode::WrongKey,
                format!(
                    "request names requester {} but came from {from}",
                    req.requester
                ),
            ));
        }
        signing::key_of(from, &req.requester_key)?;
        if req.sent_at_ms > now + MAX_CLOCK_SKEW_MS {
            return Err(reject(
                RejectCode::ClockSkew,
                format!(
                    "your clock is {} ms ahead of the provider's (at most {MAX_CLOCK_SKEW_MS} ms is tolerated); fix your clock",
                    req.sent_at_ms - now
                ),
            ));
        }
        if req.expires_at_ms <= now {
            return Err(reject(
                RejectCode::ClockSkew,
                "the request had expired when it arrived; check your clock and retry",
            ));
        }
        if req.expires_at_ms > now.saturating_add(MAX_REQUEST_LIFETIME_MS) {
            return Err(reject(
                RejectCode::InvalidRequest,
                format!(
                    "the request says it expires more than {} s from now; at most that is accepted",
                    MAX_REQUEST_LIFETIME_MS / 1000
                ),
            ));
        }
        if self.nonces.contains_key(&(*from, req.nonce)) {
            return Err(reject(
                RejectCode::Replay,
                "this request's nonce was used before (replayed request)",
            ));
        }
        Ok(())
    }

    pub(super) fn check_policy(&self, from: &PeerId, req: &LeaseRequest) -> Result<(), Rejection> {
        let p = &self.policy;
        if p.deny_peers.contains(from)
            || (!p.allow_peers.is_empty() && !p.allow_peers.contains(from))
        {
            return Err(reject(
                RejectCode::PeerNotAllowed,
                "this provider does not lend to your peer id",
            ));
        }
        if !p
            .backends
            .iter()
            .any(|b| b.eq_ignore_ascii_case(&req.requirements.backend))
        {
            return Err(reject(
                RejectCode::BackendUnsupported,
                format!(
                    "backend '{}' is not offered here; this provider offers {}",
                    req.requirements.backend,
                    p.backends.join(", ")
                ),
            ));
        }
        if req.duration_ms < 1000 || req.duration_ms > p.max_duration_ms {
            return Err(reject(
                RejectCode::DurationOutOfPolicy,
                format!(
                    "duration {} s is outside this provider's limit of 1 s to {} s",
                    req.duration_ms / 1000,
                    p.max_duration_ms / 1000
                ),
            ));
        }
        if let Some(max) = req.max_price_per_gpu_hour_millicredits {
            if p.price_per_gpu_hour_millicredits > max {
                return Err(reject(
                    RejectCode::PriceTooHigh,
                    format!(
                        "price is {:.3} credits per GPU-hour, above your maximum of {:.3}",
                        p.price_per_gpu_hour_millicredits as f64 / 1000.0,
                        max as f64 / 1000.0
                    ),
                ));
            }
        }
        let held = self.gpus_held_by(from);
        if held.saturating_add(req.requirements.gpus) > p.max_gpus_per_peer {
            return Err(reject(
                RejectCode::PeerGpuLimit,
                format!(
                    "you hold {held} GPU{} here and may hold at most {} at once",
                    if held == 1 { "" } else { "s" },
                    p.max_gpus_per_peer
                ),
            ));
        }
        Ok(())
    }

    /// When a lease for `req` starts: now, or the requested later start (a reservation).
    pub(super) fn start_of(
        &self,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<UnixMillis, Rejection> {
        match req.start_at_ms {
            Some(at) if at > now + RESERVATION_MIN_LEAD_MS => {
                if at - now > MAX_RESERVE_AHEAD_MS {
                    return Err(reject(
                        RejectCode::InvalidRequest,
                        format!(
                            "a reservation may start at most {} days ahead",
                            MAX_RESERVE_AHEAD_MS / 86_400_000
                        ),
                    ));
                }
                Ok(at)
            }
            _ => Ok(now),
        }
    }

    /// The checks of a renewal that change nothing: a lease we provide to `from`, active
    /// or reserved, clear of others' reservations until the new end, signed, with a fresh
    /// nonce, moving the end later and within the policy's longest lease.
    pub(super) fn check_renewal(
        &self,
        from: &PeerId,
        renewal: &Renewal,
        requester_sig: &[u8],
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        let id = renewal.lease_id;
        let l = self.provided(&id)?;
        if l.terms.requester != *from {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("lease {id} is not yours"),
            ));
        }
        if !matches!(l.state, LeaseState::Active | LeaseState::Reserved) || l.terms.end_ms <= now {
            return Err(reject(
                RejectCode::WrongState,
                format!("lease {id} is not active"),
            ));
        }
        if let Some(g) = l.terms.gpus.iter().find(|g| {
            !self.clear_of_reservations(&g.uuid, l.terms.end_ms, renewal.new_end_ms, Some(id))
        }) {
            return Err(reject(
                RejectCode::NoCapacity,
                format!(
                    "GPU {} is reserved by someone else before the new end; renew for less",
                    g.index
                ),
            ));
        }
        renewal.verify(from, requester_sig)?;
        if self.nonces.contains_key(&(*from, renewal.nonce)) {
            return Err(reject(
                RejectCode::Replay,
                "this renewal's nonce was used before",
            ));
        }
        if renewal.new_end_ms <= l.terms.end_ms {
            return Err(reject(
                RejectCode::InvalidRequest,
                "a renewal must move the end later",
            ));
        }
        if renewal.new_end_ms - l.terms.start_ms > self.policy.max_duration_ms {
            return Err(reject(
                RejectCode::DurationOutOfPolicy,
                format!(
                    "the lease would last {} s; this provider allows at most {} s",
                    (renewal.new_end_ms - l.terms.start_ms) / 1000,
                    self.policy.max_duration_ms / 1000
                ),
            ));
        }
        Ok(())
    }
}
