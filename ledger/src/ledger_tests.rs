use super::*;
pub(crate) use crate::testing::settled;

struct Running {
    _stop: watch::Sender<bool>,
    writer: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        drop(self._stop);
        self.writer.await.expect("writer");
    }
}

async fn open(store: &Store, key: &Keypair) -> (Arc<Ledger>, Running) {
    let (ledger, writer) = Ledger::open(store.clone(), key.clone()).expect("open");
    let (stop, rx) = watch::channel(false);
    let writer = tokio::spawn(writer.run(rx));
    (
        ledger,
        Running {
            _stop: stop,
            writer,
        },
    )
}

#[tokio::test]
async fn appends_chain_balances_and_survive_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (me, a, b) = (
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
        Keypair::generate_ed25519(),
    );
    {
        let store = Store::open(dir.path()).expect("store");
        let (ledger, running) = open(&store, &me).await;
        // We provided 5 s to a (5 credits) and used 2 s of b (2 credits).
        let r = ledger
            .record(vec![settled(&me, &a, 1, 5_000), settled(&b, &me, 2, 2_000)])
            .await;
        assert_eq!(r, vec![Ok(Recorded::New(1)), Ok(Recorded::New(2))]);
        assert_eq!(ledger.balance(), 3_000);
        assert_eq!(ledger.account(&a.public().to_peer_id()).earned, 5_000);
        assert_eq!(ledger.account(&b.public().to_peer_id()).spent, 2_000);
        running.stop().await;
    }
    let store = Store::open(dir.path()).expect("reopen");
    let (ledger, _stop) = open(&store, &me).await;
    assert_eq!(ledger.head().seq, 2);
    assert_eq!(ledger.balance(), 3_000);
    let report = ledger.verify().expect("verify");
    assert_eq!(report.first_bad, None, "{report:?}");
    assert_eq!((report.entries, report.signatures), (2, 4));
    let recent = ledger.recent(10).expect("recent");
    assert_eq!(recent.len(), 2);
    assert_eq!(recent[0].seq, 2);
    assert_eq!(recent[0].direction, "spent");
    assert_eq!(recent[1].prev, "0".repeat(64));
    assert_eq!(recent[0].prev, recent[1].hash);
}

#[tokio::test]
async fn same_receipt_twice_is_one_entry_and_another_for_the_lease_is_a_duplicate() {
    let store = Store::temporary().expect("store");
    let (me, a) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let (ledger, _stop) = open(&store, &me).await;
    let first = settled(&me, &a, 9, 1_000);
    assert_eq!(
        ledger.record(vec![first.clone()]).await,
        vec![Ok(Recorded::New(1))]
    );
    let again = ledger
        .record(vec![first.clone(), settled(&me, &a, 9, 4_000)])
        .await;
    assert_eq!(again[0], Ok(Recorded::AlreadyThere(1)));
    assert!(matches!(
        again[1],
        Err(LedgerError::Duplicate { seq: 1, .. })
    ));
    // Inside one batch too.
    let batch = ledger
        .record(vec![
            settled(&me, &a, 10, 1_000),
            settled(&me, &a, 10, 2_000),
        ])
        .await;
    assert!(batch[0].is_ok() && matches!(batch[1], Err(LedgerError::Duplicate { .. })));
    assert_eq!(ledger.head().seq, 2);
    assert_eq!(ledger.balance(), 2_000);
}

/// Rewrites stored entry `seq` with `edit` applied (what an attacker with disk access
/// could do).
fn tamper(store: &Store, seq: u64, edit: impl FnOnce(&mut Entry)) {
    let key = entry_key(seq);
    let bytes = store.get(TREE, &key).expect("get").expect("entry");
    let mut e = Entry::decode(&bytes).expect("decode");
    edit(&mut e);
    store.put(TREE, &key, &encoding::encode(&e)).expect("put");
}

#[tokio::test]
async fn a_check_while_receipts_settle_is_clean_and_an_entry_past_the_head_is_not() {
    let store = Store::temporary().expect("store");
    let (me, a) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let (ledger, _stop) = open(&store, &me).await;
    for lease in 1..=3u8 {
        ledger.record(vec![settled(&me, &a, lease, 1_000)]).await;
    }
    // A check reads the head and accounts, then the writer appends two more entries
    // before the check reaches the end of the chain.
    let (head, accounts) = (ledger.head(), ledger.accounts());
    for lease in 4..=5u8 {
        ledger.record(vec![settled(&me, &a, lease, 1_000)]).await;
    }
    let report = ledger.verify_up_to(&head, &accounts).expect("verify");
    assert_eq!(report.first_bad, None, "{report:?}");
    assert_eq!(report.entries, 3);
    assert_eq!(ledger.verify().expect("verify").entries, 5);
    // An entry written past the head by someone else is found.
    let bytes = store
        .get(TREE, &entry_key(5))
        .expect("get")
        .expect("entry 5");
    let mut forged = Entry::decode(&bytes).expect("decode");
    forged.seq = 6;
    store
        .put(TREE, &entry_key(6), &encoding::encode(&forged))
        .expect("put");
    let bad = ledger.verify().expect("verify").first_bad.expect("found");
    assert_eq!(bad.seq, 6, "{bad:?}");
    let early = ledger.verify_up_to(&head, &accounts).expect("verify");
    assert_eq!(early.first_bad.map(|b| b.seq), Some(6));
}

#[tokio::test]
async fn verify_names_the_first_bad_entry() {
    let (me, a) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let fresh = || async {
        let store = Store::temporary().expect("store");
        let (ledger, stop) = open(&store, &me).await;
        let receipts = (1..=6)
            .map(|i| settled(&me, &a, i, 1_000 * i as u64))
            .collect();
        assert!(ledger.record(receipts).await.iter().all(Result::is_ok));
        (store, ledger, stop)
    };

    let (store, ledger, _s) = fresh().await;
    tamper(&store, 4, |e| e.receipt.receipt.amount_millicredits += 1);
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    // The edit breaks entry 4's signatures and entry 5's link; the first is named.
    assert_eq!(bad.seq, 4, "{bad:?}");

    // A lease counted twice, both receipts properly signed (a writer's bug or a
    // tampered store with the keys at hand): named at its second entry.
    let (store, ledger, _s) = fresh().await;
    let (me2, a2) = (me.clone(), a.clone());
    tamper(&store, 4, move |e| {
        e.receipt.receipt.lease_id = LeaseId([2; 16]);
        e.receipt.provider_sig = e.receipt.receipt.sign(&me2).expect("sign");
        e.receipt.requester_sig = e.receipt.receipt.sign(&a2).expect("sign");
    });
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    assert_eq!(bad.seq, 4, "{bad:?}");
    assert!(bad.reason.contains("counted twice"), "{}", bad.reason);

    // An amount that does not follow from its usage, signed by both.
    let (store, ledger, _s) = fresh().await;
    let (me2, a2) = (me.clone(), a.clone());
    tamper(&store, 5, move |e| {
        e.receipt.receipt.amount_millicredits += 1;
        e.receipt.provider_sig = e.receipt.receipt.sign(&me2).expect("sign");
        e.receipt.requester_sig = e.receipt.receipt.sign(&a2).expect("sign");
    });
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    assert_eq!(bad.seq, 5, "{bad:?}");
    assert!(bad.reason.contains("does not follow"), "{}", bad.reason);

    let (store, ledger, _s) = fresh().await;
    tamper(&store, 3, |e| e.receipt.requester_sig[0] ^= 1);
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    assert_eq!(bad.seq, 3);
    assert!(bad.reason.contains("requester"), "{}", bad.reason);

    let (store, ledger, _s) = fresh().await;
    store.remove(TREE, &entry_key(2)).expect("remove");
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    assert_eq!(bad.seq, 2, "{bad:?}");

    let (store, ledger, _s) = fresh().await;
    store.remove(TREE, &entry_key(6)).expect("remove last");
    let bad = ledger.verify().expect("verify").first_bad.expect("caught");
    assert!(bad.reason.contains("head"), "{bad:?}");

    let (store, ledger, _s) = fresh().await;
    store
        .put(
            TREE,
            &account_key(&a.public().to_peer_id()),
            &encoding::encode(&PeerAccount::default()),
        )
        .expect("put");
    let (reopened, _w) = Ledger::open(store.clone(), me.clone()).expect("reopen");
    drop(ledger);
    let bad = reopened
        .verify()
        .expect("verify")
        .first_bad
        .expect("caught");
    assert!(bad.reason.contains("balances"), "{bad:?}");
}

#[test]
fn entries_written_with_format_1_receipts_still_decode_and_verify() {
    use gpunode_protocol::receipt::{SettledReceiptV1, UsageReceiptV1};
    let (p, r) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    // A format-1 receipt, signed over its format-1 bytes, as an older node stored it.
    let mut receipt = settled(&p, &r, 7, 5_000).receipt;
    receipt.version = 1;
    let old = SettledReceiptV1 {
        receipt: UsageReceiptV1::from(&receipt),
        provider_sig: receipt.sign(&p).expect("sign"),
        requester_sig: receipt.sign(&r).expect("sign"),
    };
    let bytes = encoding::encode(&chain::EntryV1 {
        seq: 1,
        prev: [0; 32],
        recorded_ms: 9,
        receipt: old.clone(),
    });
    let entry = Entry::decode(&bytes).expect("a format-1 entry decodes");
    assert_eq!(entry.receipt.receipt.version, 1);
    assert_eq!(entry.receipt.receipt.peak_gpu_memory_bytes, 0);
    assert_eq!(entry.receipt.receipt.billed_ms, 5_000);
    let provider = p.public().to_peer_id();
    entry
        .receipt
        .receipt
        .verify(&provider, &entry.receipt.provider_sig)
        .expect("its signature still checks");
    // Current entries are read as they are.
    let mut current = settled(&p, &r, 8, 5_000);
    current.receipt.peak_gpu_memory_bytes = 3 << 30;
    let bytes = encoding::encode(&Entry {
        seq: 2,
        prev: [1; 32],
        recorded_ms: 10,
        receipt: current.clone(),
    });
    assert_eq!(Entry::decode(&bytes).expect("decodes").receipt, current);
    assert!(Entry::decode(&bytes[..bytes.len() - 1]).is_err());
}
