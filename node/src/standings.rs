//! How a peer stands with this node, from its team and its accounts: membership, team
//! policy, credit, and serving order. One [`PeerStandings`] answers the lease desk and
//! orders the CPU slots of jobs, so both serve peers in the same order.

use std::sync::Arc;

use gpunode_protocol::lease::Rejection;
use gpunode_protocol::team::JobKind;
use gpunode_protocol::time::UnixMillis;
use gpunode_sched::Standing;
use libp2p::PeerId;

use crate::lease::Standings;
use crate::ledger::accounts::Accounts;
use crate::team::service::Team;

/// This node's view of its peers.
#[derive(Clone)]
pub struct PeerStandings {
    team: Option<Arc<Team>>,
    accounts: Arc<Accounts>,
}

impl PeerStandings {
    /// Standings from `team` (when the node is in one) and `accounts`.
    pub fn new(team: Option<Arc<Team>>, accounts: Arc<Accounts>) -> PeerStandings {
        PeerStandings { team, accounts }
    }
}

impl Standings for PeerStandings {
    fn may_lease(&self, peer: &PeerId) -> bool {
        // In a team every lease message is from a member, checked here and not only by
        // the connection allow-list (which also lets invite join identities in).
        self.team.as_ref().is_none_or(|t| t.is_member(peer))
    }

    fn team_policy(
        &self,
        peer: &PeerId,
        kind: JobKind,
        gpus: u32,
        duration_ms: u64,
        start: UnixMillis,
    ) -> Result<(), String> {
        match &self.team {
            Some(team) => team.check_lease(peer, kind, gpus, duration_ms, start),
            None => Ok(()),
        }
    }

    fn admit_credit(&self, peer: &PeerId, exposure: u64, new_max: u64) -> Result<(), Rejection> {
        let allowance = self.team.as_ref().and_then(|t| t.allowance_millicredits());
        self.accounts.admit(peer, exposure, new_max, allowance)
    }

    /// Inside a team: the role's priority, everyone's credit and reputation equal.
    /// Outside: credit standing with this node, then reputation.
    fn standing(&self, peer: &PeerId) -> Standing {
        match &self.team {
            Some(team) => Standing {
                priority: team.priority_of(peer),
                credit_millicredits: 0,
                reputation: 1.0,
            },
            None => Standing {
                priority: 0,
                credit_millicredits: self
                    .accounts
                    .standing(peer)
                    .clamp(i64::MIN as i128, i64::MAX as i128)
                    as i64,
                reputation: self.accounts.reputation.score(peer),
            },
        }
    }

    fn preempts(&self) -> bool {
        self.team.as_ref().is_some_and(|t| t.preempts())
    }
}
