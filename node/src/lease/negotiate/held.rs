//! Leases already held: listing them, renewing one as its requester, and cancelling one
//! from either side.

use std::time::Duration;

use gpunode_protocol::lease::{LeaseId, LeaseMessage, LeaseReply, RejectCode, Renewal};

use super::{LeaseError, Negotiator};
use crate::lease::book::{LeaseRole, LeaseState, SignedRenewal};
use crate::views::{CancelOutcome, LeaseView};
use crate::NodeError;

impl Negotiator {
    /// Every lease on this node, either side, newest first.
    pub async fn list_leases(&self) -> Result<Vec<LeaseView>, NodeError> {
        let records = self.client.list_leases().await?;
        Ok(records.iter().map(LeaseView::from).collect())
    }

    /// Extends an active lease we hold as requester by `extend`.
    pub async fn renew_lease(
        &self,
        prefix: &str,
        extend: Duration,
    ) -> Result<LeaseView, LeaseError> {
        let prefix = prefix.to_string();
        let record = self
            .client
            .resolve_lease(prefix)
            .await?
            .map_err(|e| LeaseError::NotFound(e.to_string()))?;
        if record.role != LeaseRole::Requester {
            return Err(LeaseError::Invalid(
                "only the requester renews a lease; this node is its provider".into(),
            ));
        }
        if record.state != LeaseState::Active {
            return Err(LeaseError::NotFound(format!(
                "lease {} is {}, not active",
                record.terms.lease_id,
                record.state.label()
            )));
        }
        let renewal = Renewal {
            lease_id: record.terms.lease_id,
            new_end_ms: record.terms.end_ms + extend.as_millis() as u64,
            nonce: rand::random(),
        };
        let signature = renewal
            .sign(&self.keypair)
            .map_err(|e| LeaseError::Invalid(e.to_string()))?;
        let provider = record.terms.provider;
        let addrs = self.addresses_of(provider).await;
        let message = LeaseMessage::Renew {
            renewal: renewal.clone(),
            signature: signature.clone(),
        };
        match self.send_lease(provider, addrs, message).await? {
            Ok(LeaseReply::Renewed {
                provider_sig,
                new_end_ms,
                ..
            }) if new_end_ms == renewal.new_end_ms => {
                let signed = SignedRenewal {
                    renewal,
                    requester_sig: signature,
                    provider_sig,
                };
                let record = self
                    .client
                    .apply_renewal(signed)
                    .await?
                    .map_err(|e| LeaseError::Invalid(e.to_string()))?;
                Ok(LeaseView::from(&record))
            }
            Ok(LeaseReply::Rejected(r)) => Err(LeaseError::Refused(r)),
            Ok(other) => Err(LeaseError::Invalid(format!("unexpected answer {other:?}"))),
            Err(e) => Err(LeaseError::Invalid(e.to_string())),
        }
    }

    /// Marks a lease ended here without telling the other party, for a lease whose
    /// provider ends it by protocol (a lease's only job on the job protocol that ends
    /// leases). A lease already over here is left as it is.
    pub async fn end_here(&self, lease: &LeaseId) -> Result<(), LeaseError> {
        match self.client.cancel_local(lease.to_string()).await? {
            Ok(_) => Ok(()),
            Err(r) if r.code == RejectCode::WrongState => Ok(()),
            Err(r) => Err(LeaseError::Refused(r)),
        }
    }

    /// Cancels a lease (either side): released here at once, then the other party is told.
    pub async fn cancel_lease(&self, prefix: &str) -> Result<CancelOutcome, LeaseError> {
        let prefix = prefix.to_string();
        let (record, cancellation, signature) =
            self.client
                .cancel_local(prefix)
                .await?
                .map_err(|r| match r.code {
                    RejectCode::UnknownLease | RejectCode::WrongState => {
                        LeaseError::NotFound(r.message)
                    }
                    _ => LeaseError::Refused(r),
                })?;
        let peer = record.peer();
        let addrs = self.addresses_of(peer).await;
        let answer = self
            .send_lease(
                peer,
                addrs,
                LeaseMessage::Cancel {
                    cancellation,
                    signature,
                },
            )
            .await?;
        let (peer_notified, peer_error) = match answer {
            Ok(LeaseReply::Cancelled { .. }) => (true, None),
            // Already over on the other side too (e.g. our first attempt got through).
            Ok(LeaseReply::Rejected(r)) if r.code == RejectCode::WrongState => (true, None),
            Ok(LeaseReply::Rejected(r)) => (false, Some(r.message)),
            Ok(other) => (false, Some(format!("unexpected answer {other:?}"))),
            Err(e) => (false, Some(e.to_string())),
        };
        Ok(CancelOutcome {
            lease: LeaseView::from(&record),
            peer_notified,
            peer_error,
        })
    }
}
