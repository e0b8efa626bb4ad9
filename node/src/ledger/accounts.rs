//! The credit side of a node: [`Accounts`] holds the ledger, reputation, usage meters,
//! claims and refused receipts, and the admission rules that use them (standing, the
//! debt limit, the strangers' allowance). Claims are made and answered in
//! [`super::claims`]; they travel on the settlement protocol in [`super::settle`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpunode_protocol::lease::{LeaseId, RejectCode, Rejection};
use libp2p::identity::Keypair;
use libp2p::PeerId;
use tokio::sync::watch;

use super::meter::UsageMeter;
use super::reputation::Reputation;
use super::{credits, Ledger, LedgerError, LedgerWriter};
use crate::lease::LeaseRecord;
use crate::store::Store;

use super::claims::{ClaimBook, StoredClaim, CLAIMS_TREE};

/// Ways a node can be told to cheat, so test networks can check that cheats are caught
/// (and to act like an older version, so they can check it is still understood).
/// Never set from configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Misbehaviour {
    /// Bill this many times the metered run time (1 or 0: honest).
    pub inflate_billing: u64,
    /// Flip bytes in every output file before sending it.
    pub corrupt_outputs: bool,
    /// Announce the first output file under this name (a path that escapes, say).
    pub evil_output_name: Option<&'static str>,
    /// Charge this many times the advertised price in offers (0 or 1: honest).
    pub overcharge: u64,
    /// Offer every lease under this id (a provider trying to overwrite the requester's
    /// record of another lease).
    pub fixed_lease_id: Option<[u8; 16]>,
    /// Serve jobs only on the first job protocol, as providers did before
    /// `JOB_ENDS_LEASE_PROTOCOL` (not hostile: how requesters meet older providers).
    pub first_job_protocol_only: bool,
    /// Make no receipts: leases are never billed, and a requester that waits for the
    /// receipt waits in vain.
    pub withhold_receipts: bool,
}

/// The credit side of a node: ledger, reputation, usage meters, unsettled claims and the
/// admission rules that use them.
pub struct Accounts {
    /// The ledger.
    pub ledger: Arc<Ledger>,
    /// Scores of peers.
    pub reputation: Reputation,
    /// Usage of leases we provide, metered by our jobs.
    pub metered: UsageMeter,
    /// Usage of leases we hold, as observed here.
    pub observed: UsageMeter,
    pub(super) claims: Mutex<ClaimBook>,
    /// Provider side: ended leases whose last job is still stopping; their claims are
    /// made when it has ended.
    pub(super) deferred: Mutex<Vec<LeaseRecord>>,
    /// Requester side: receipts we refused, by lease (why), the newest
    /// [`MAX_REFUSED_KEPT`] until the process ends.
    pub(super) refused: Mutex<RefusedReceipts>,
    /// One whole-chain check at a time, and the last one's report with the head it
    /// checked (a dashboard asks again at each load; see
    /// [`Accounts::verify_ledger`]).
    pub(super) last_verify: tokio::sync::Mutex<Option<super::views::CheckedChain>>,
    /// The balance history as far as it was read (see [`Accounts::balance_history`]).
    pub(super) balance_series: Arc<Mutex<crate::overview::BalanceSeries>>,
    /// Bumped after every batch of claims we answered.
    pub(super) answered: watch::Sender<u64>,
    pub(super) store: Store,
    pub(super) keypair: Keypair,
    /// Credits a new peer may use here, millicredits.
    pub allowance_millicredits: u64,
    /// Debt past the allowance tolerated, millicredits.
    pub debt_limit_millicredits: u64,
    /// Lowest reputation admitted.
    pub min_reputation: f64,
    /// Strangers drawing on the allowance (bounded per day, see
    /// [`super::newcomers`]).
    pub newcomers: super::newcomers::Newcomers,
    /// Cheating switches for test networks.
    pub misbehaviour: Misbehaviour,
}

impl std::fmt::Debug for Accounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounts").finish_non_exhaustive()
    }
}

/// Credit settings.
#[derive(Debug, Clone, Copy)]
pub struct CreditPolicy {
    /// Credits a new peer may use, millicredits.
    pub allowance_millicredits: u64,
    /// Debt past the allowance tolerated, millicredits.
    pub debt_limit_millicredits: u64,
    /// Lowest reputation admitted.
    pub min_reputation: f64,
    /// New peer ids a day that may draw on the allowance outside a team (0: no limit).
    pub new_peers_on_credit_per_day: u32,
}

impl Accounts {
    /// Opens everything from `store`; spawn the returned writer.
    pub fn open(
        store: Store,
        keypair: Keypair,
        policy: CreditPolicy,
        misbehaviour: Misbehaviour,
    ) -> Result<(Arc<Accounts>, LedgerWriter), LedgerError> {
        let (ledger, writer) = Ledger::open(store.clone(), keypair.clone())?;
        let mut claims = ClaimBook::default();
        for (k, v) in store.scan(CLAIMS_TREE)? {
            if let (Ok(id), Ok(c)) = (<[u8; 16]>::try_from(k.as_slice()), StoredClaim::decode(&v)) {
                claims.insert(LeaseId(id), c);
            }
        }
        let accounts = Accounts {
            ledger,
            reputation: Reputation::open(store.clone())?,
            metered: UsageMeter::open(store.clone(), "metered")?,
            observed: UsageMeter::open(store.clone(), "observed")?,
            claims: Mutex::new(claims),
            deferred: Mutex::new(Vec::new()),
            refused: Mutex::new(RefusedReceipts::default()),
            last_verify: tokio::sync::Mutex::new(None),
            balance_series: Arc::default(),
            answered: watch::channel(0).0,
            store,
            keypair,
            allowance_millicredits: policy.allowance_millicredits,
            debt_limit_millicredits: policy.debt_limit_millicredits,
            min_reputation: policy.min_reputation,
            newcomers: super::newcomers::Newcomers::new(policy.new_peers_on_credit_per_day),
            misbehaviour,
        };
        Ok((Arc::new(accounts), writer))
    }

    pub(super) fn claims(&self) -> std::sync::MutexGuard<'_, ClaimBook> {
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `peer` has claimed from us and not settled, millicredits (disputed included).
    pub fn unsettled_with(&self, peer: &PeerId) -> u64 {
        self.claims().owed.get(peer).copied().unwrap_or(0)
    }

    /// Refused receipts whose reasons are kept (bounded).
    pub fn refused_count(&self) -> usize {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .why
            .len()
    }

    /// Unsettled claims: (pending, disputed).
    pub fn claim_counts(&self) -> (usize, usize) {
        let claims = self.claims();
        let disputed = claims.values().filter(|c| c.disputed.is_some()).count();
        (claims.len() - disputed, disputed)
    }

    /// Give-to-get standing of `peer` here, millicredits: the allowance, plus what it
    /// provided to us, minus what it used here (settled or claimed).
    pub fn standing(&self, peer: &PeerId) -> i128 {
        self.standing_with(peer, self.allowance_millicredits)
    }

    /// [`Accounts::standing`] with another allowance (a team policy's).
    pub fn standing_with(&self, peer: &PeerId, allowance_millicredits: u64) -> i128 {
        let a = self.ledger.account(peer);
        allowance_millicredits as i128 + a.spent as i128
            - a.earned as i128
            - self.unsettled_with(peer) as i128
    }

    /// Whether `peer` may take a lease that can cost up to `new_max` while its open
    /// leases here can cost up to `open_exposure` (millicredits).
    pub fn admit(
        &self,
        peer: &PeerId,
        open_exposure: u64,
        new_max: u64,
        allowance_override: Option<u64>,
    ) -> Result<(), Rejection> {
        // Outside a team, a peer that would draw on the allowance gets its share of the
        // strangers' allowance of the day (Sybil ids cannot mint credit).
        let now = gpunode_protocol::time::now_ms();
        let own = self.standing_with(peer, 0);
        let draws =
            allowance_override.is_none() && own - open_exposure as i128 - (new_max as i128) < 0;
        let allowance = match allowance_override {
            Some(a) => a,
            None if draws => self
                .newcomers
                .allowance_for(peer, self.allowance_millicredits, now),
            None => self.allowance_millicredits,
        };
        let score = self.reputation.score(peer);
        if score < self.min_reputation {
            return Err(Rejection::new(
                RejectCode::LowReputation,
                format!(
                    "your reputation with this provider is {score:.2}, below its minimum of {:.2} (after failed, disputed or mismatched work); it recovers with time",
                    self.min_reputation
                ),
            ));
        }
        let standing = self.standing_with(peer, allowance);
        let after = standing - open_exposure as i128 - new_max as i128;
        if after < -(self.debt_limit_millicredits as i128) {
            return Err(Rejection::new(
                RejectCode::DebtLimit,
                format!(
                    "debt limit reached: your standing with this provider is {:.3} credits (allowance {:.3}, plus what you provided it, minus what you used or owe), your open leases here can cost {:.3} and this one {:.3}, which would take you past its debt limit of {:.3}; provide resources to others (gpunode serve) to earn credits, or ask for less",
                    credits(standing),
                    credits(allowance),
                    credits(open_exposure),
                    credits(new_max),
                    credits(self.debt_limit_millicredits),
                ),
            ));
        }
        if draws {
            self.newcomers.drawing(peer, now);
        }
        Ok(())
    }
}

/// How many refused receipts' reasons are kept (a peer chooses the lease ids of the
/// claims it sends, so the map must not grow with them).
const MAX_REFUSED_KEPT: usize = 4096;

/// Why receipts were refused, by lease, the oldest forgotten first.
#[derive(Default)]
pub(super) struct RefusedReceipts {
    why: HashMap<LeaseId, String>,
    order: std::collections::VecDeque<LeaseId>,
}

impl RefusedReceipts {
    pub(super) fn insert(&mut self, lease: LeaseId, why: String) {
        if self.why.insert(lease, why).is_none() {
            self.order.push_back(lease);
        }
        while self.order.len() > MAX_REFUSED_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }

    pub(super) fn get(&self, lease: &LeaseId) -> Option<String> {
        self.why.get(lease).cloned()
    }
}

#[cfg(test)]
mod accounts_tests {
    use super::*;

    #[test]
    fn sybil_strangers_cannot_mint_credit_but_team_members_keep_theirs() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = Store::open(dir.path()).expect("store");
        let (accounts, _writer) = Accounts::open(
            store,
            Keypair::generate_ed25519(),
            CreditPolicy {
                allowance_millicredits: 10_000,
                debt_limit_millicredits: 0,
                min_reputation: 0.0,
                new_peers_on_credit_per_day: 2,
            },
            Misbehaviour::default(),
        )
        .expect("open");
        // The first new id may use its whole allowance, the second half of it.
        let first = PeerId::random();
        accounts.admit(&first, 0, 10_000, None).expect("first");
        let second = PeerId::random();
        assert!(accounts.admit(&second, 0, 10_000, None).is_err());
        accounts
            .admit(&second, 0, 5_000, None)
            .expect("second, half");
        // Then fresh ids get nothing, however many are made.
        for _ in 0..50 {
            let sybil = PeerId::random();
            let err = accounts.admit(&sybil, 0, 1, None).expect_err("sybil");
            assert_eq!(err.code, RejectCode::DebtLimit);
        }
        // The first keeps its share; a team's allowance is not limited this way.
        accounts
            .admit(&first, 0, 10_000, None)
            .expect("first again");
        accounts
            .admit(&PeerId::random(), 0, 10_000, Some(10_000))
            .expect("a team member");
    }

    /// A receipt for lease `n` in which `provider` served `requester` for a second (one
    /// credit).
    fn settled(
        provider: &Keypair,
        requester: &Keypair,
        n: u8,
    ) -> gpunode_protocol::receipt::SettledReceipt {
        crate::ledger::testing::settled(provider, requester, n, 1_000)
    }

    /// Accounts of a new identity in a new store, with the ledger writer running.
    struct Running {
        _dir: tempfile::TempDir,
        store: Store,
        me: Keypair,
        accounts: Arc<Accounts>,
        stop: watch::Sender<bool>,
        writer: tokio::task::JoinHandle<()>,
    }

    impl Running {
        fn start() -> Running {
            let dir = tempfile::tempdir().expect("tmp");
            let store = Store::open(dir.path()).expect("store");
            let me = Keypair::generate_ed25519();
            let (accounts, writer) = Accounts::open(
                store.clone(),
                me.clone(),
                CreditPolicy {
                    allowance_millicredits: 0,
                    debt_limit_millicredits: 0,
                    min_reputation: 0.0,
                    new_peers_on_credit_per_day: 0,
                },
                Misbehaviour::default(),
            )
            .expect("open");
            let (stop, stop_rx) = watch::channel(false);
            Running {
                _dir: dir,
                store,
                me,
                accounts,
                stop,
                writer: tokio::spawn(writer.run(stop_rx)),
            }
        }

        async fn stop(self) {
            let _ = self.stop.send(true);
            self.writer.await.expect("writer");
        }
    }

    async fn record(accounts: &Accounts, receipt: gpunode_protocol::receipt::SettledReceipt) {
        for r in accounts.ledger.record(vec![receipt]).await {
            r.expect("recorded");
        }
    }

    /// Overwrites entry `seq` on disk behind the ledger's back.
    fn damage(store: &Store, seq: u64) {
        let mut key = vec![b'e'];
        key.extend_from_slice(&seq.to_be_bytes());
        store
            .put_durable("ledger", &key, b"not an entry")
            .expect("damage");
    }

    #[tokio::test]
    async fn the_balance_history_reads_only_new_entries_and_follows_the_chain() {
        let run = Running::start();
        let (accounts, store, me) = (&run.accounts, &run.store, &run.me);
        let peer = Keypair::generate_ed25519();
        let empty = accounts.balance_history(10).await.expect("history");
        assert_eq!((empty.entries, empty.points.len()), (0, 0));
        record(accounts, settled(me, &peer, 1)).await;
        let one = accounts.balance_history(10).await.expect("history");
        assert_eq!(one.entries, 1);
        assert_eq!(one.points.last().map(|p| p.1), Some(1.0), "earned 1 credit");
        record(accounts, settled(&peer, me, 2)).await;
        let two = accounts.balance_history(10).await.expect("history");
        assert_eq!(two.entries, 2);
        assert_eq!(
            two.points.iter().map(|p| p.1).collect::<Vec<_>>(),
            [1.0, 0.0]
        );
        // Entry 1 damaged on disk: it was read already, so the history does not read it
        // again (a new receipt costs one entry's read, however long the chain).
        damage(store, 1);
        assert_eq!(accounts.balance_history(10).await.expect("history"), two);
        run.stop().await;
    }

    #[tokio::test]
    async fn a_reused_check_is_of_the_same_head_and_a_new_check_reads_the_chain() {
        let run = Running::start();
        let (accounts, store, me) = (&run.accounts, &run.store, &run.me);
        let peer = Keypair::generate_ed25519();
        record(accounts, settled(me, &peer, 1)).await;
        let first = accounts.verify_ledger(true).await.expect("verify");
        assert_eq!((first.entries, first.first_bad.clone()), (1, None));

        // The chain grew: a reused check is a new one.
        record(accounts, settled(me, &peer, 2)).await;
        let grown = accounts.verify_ledger(true).await.expect("verify");
        assert_eq!((grown.entries, grown.first_bad.clone()), (2, None));

        // An entry damaged on disk behind the ledger's back (the head unchanged): the
        // reused report is the last check's; a new check reads the chain and finds it.
        damage(store, 2);
        assert_eq!(accounts.verify_ledger(true).await.expect("verify"), grown);
        let checked = accounts.verify_ledger(false).await.expect("verify");
        assert_eq!(
            checked.first_bad.as_ref().map(|b| b.seq),
            Some(2),
            "{checked:?}"
        );
        run.stop().await;
    }

    /// A lease `me` provided to `requester` that ended as `state`.
    fn provided(
        me: &Keypair,
        requester: PeerId,
        n: u8,
        state: crate::lease::LeaseState,
    ) -> crate::lease::LeaseRecord {
        use gpunode_protocol::lease::{LeaseTerms, LEASE_VERSION};
        let terms = LeaseTerms {
            version: LEASE_VERSION,
            lease_id: LeaseId([n; 16]),
            provider: me.public().to_peer_id(),
            requester,
            gpus: Vec::new(),
            cpus: 1,
            mem_bytes: 1 << 20,
            backend: "wasm".into(),
            start_ms: 100_000,
            end_ms: 102_000,
            price_per_gpu_hour_millicredits: 0,
            request_nonce: n.into(),
            offer_expires_ms: 101_000,
        };
        crate::lease::LeaseRecord {
            signed_end_ms: terms.end_ms,
            provider_sig: Vec::new(),
            requester_sig: Some(Vec::new()),
            renewals: Vec::new(),
            role: crate::lease::LeaseRole::Provider,
            state,
            updated_ms: 101_500,
            terms,
        }
    }

    /// Claims for leases that ran to their end wait for company (at most `LINGER`);
    /// a claim for a lease ended early is due at once and takes the waiting ones along,
    /// and when more wait than one message carries, the due ones go first.
    #[tokio::test(start_paused = true)]
    async fn claims_of_leases_that_ran_out_linger_and_an_early_end_sends_them_all() {
        use crate::lease::LeaseState::{Cancelled, Completed};
        use crate::ledger::claims::LINGER;
        let run = Running::start();
        let (accounts, me) = (&run.accounts, &run.me);
        let (requester, other) = (PeerId::random(), PeerId::random());
        let start = tokio::time::Instant::now();
        accounts.make_claims(&[provided(me, requester, 1, Completed)]);
        tokio::time::advance(LINGER / 2).await;
        accounts.make_claims(&[
            provided(me, requester, 2, Completed),
            provided(me, other, 3, Completed),
        ]);
        let (due, next) = accounts.due_peers(tokio::time::Instant::now(), |_| false);
        assert!(due.is_empty(), "nothing due yet: {due:?}");
        assert_eq!(next, Some(start + LINGER), "the oldest claim sets the time");

        tokio::time::advance(LINGER / 2).await;
        let (due, next) = accounts.due_peers(tokio::time::Instant::now(), |_| false);
        assert_eq!(due, vec![requester], "its first claim is due");
        assert_eq!(
            next,
            Some(start + LINGER + LINGER / 2),
            "the other's is later"
        );
        assert_eq!(accounts.waiting_claims(&requester, 10).len(), 2, "both go");
        // A requester that awaits a claim (a stream was opened ahead for it) gets its
        // claims at once.
        let (due, _) = accounts.due_peers(tokio::time::Instant::now(), |p| *p == other);
        let mut both = vec![requester, other];
        both.sort();
        let mut sorted = due.clone();
        sorted.sort();
        assert_eq!(sorted, both);

        // A lease ended early: its claim is due now, and with one claim to a message it
        // is the one sent.
        accounts.make_claims(&[provided(me, other, 4, Cancelled)]);
        let (mut due, _) = accounts.due_peers(tokio::time::Instant::now(), |_| false);
        due.sort();
        assert_eq!(due, both);
        let first = accounts.waiting_claims(&other, 1);
        assert_eq!(
            first.iter().map(|c| c.receipt.lease_id).collect::<Vec<_>>(),
            vec![LeaseId([4; 16])]
        );
        assert_eq!(accounts.waiting_claims(&other, 10).len(), 2);
        run.stop().await;
    }

    #[test]
    fn refused_receipts_are_bounded_oldest_first() {
        let mut r = RefusedReceipts::default();
        for i in 0..(MAX_REFUSED_KEPT + 10) as u32 {
            let mut id = [0u8; 16];
            id[..4].copy_from_slice(&i.to_le_bytes());
            r.insert(LeaseId(id), format!("why {i}"));
        }
        assert_eq!(r.why.len(), MAX_REFUSED_KEPT);
        assert_eq!(r.get(&LeaseId([0; 16])), None, "the oldest went first");
        let mut last = [0u8; 16];
        last[..4].copy_from_slice(&((MAX_REFUSED_KEPT + 9) as u32).to_le_bytes());
        assert!(r.get(&LeaseId(last)).is_some());
    }
}
