//! Signed adverts: the record a node publishes in the DHT to say what it offers, and the
//! capability keys under which it registers as a provider.
//!
//! An advert is encoded canonically, signed with the publisher's identity key behind a
//! domain tag, and wrapped with the public key so any reader can check it against the
//! peer id it was published for. Readers call [`verify_advert`], which refuses oversized
//! bytes before decoding, forged or mismatched signatures, expired adverts and adverts
//! issued in the future beyond the tolerated clock skew. Refusing adverts whose sequence
//! number is lower than one already seen needs memory of earlier adverts and is done by
//! the node's advert book.

use serde::{Deserialize, Serialize};

use crate::encoding::{self, DecodeError};
use crate::gpu::{mig_profile, model_family, GpuState};
use crate::signing::{self, SignatureError};
use crate::time::{UnixMillis, MAX_CLOCK_SKEW_MS};
use crate::{Keypair, PeerId};

/// Domain-separation tag prefixed to every advert body before signing.
pub const ADVERT_SIGNING_TAG: &[u8] = b"gpunode/advert/v1\0";
/// Version of the advert format this build writes and reads.
pub const ADVERT_VERSION: u16 = 1;
/// Largest signed advert a reader will look at, in bytes.
pub const MAX_SIGNED_ADVERT_BYTES: usize = 16 * 1024;
/// Most addresses an advert may list. A requester dials a provider at every address its
/// advert names, so one listing hundreds (as many as fit in 16 KiB) would have every
/// requester that looks at it dial hundreds of endpoints of the advertiser's choosing.
/// A node with more addresses lists those reachable from anywhere first
/// (`gpunode_node::nat::best_reachable`).
pub const MAX_ADVERT_ADDRS: usize = 20;
/// Longest lifetime an advert may claim; longer ones are refused as malformed.
pub const MAX_ADVERT_TTL_MS: u64 = 24 * 3600 * 1000;

/// One GPU as advertised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertGpu {
    /// Index on the provider.
    pub index: u32,
    /// Stable identifier.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Idle, leased, or busy with the owner's work.
    pub state: GpuState,
    /// MIG mode on.
    pub mig_enabled: bool,
    /// CUDA compute capability.
    pub compute_capability: Option<(u32, u32)>,
    /// Reserved windows `[start, end)` (unix ms): the GPU is not free for a lease that
    /// overlaps one; it is free before, between and after them.
    pub reserved: Vec<(UnixMillis, UnixMillis)>,
}

/// What a node offers, as signed by it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Advert {
    /// Format version ([`ADVERT_VERSION`]).
    pub version: u16,
    /// The node that offers.
    pub publisher: PeerId,
    /// Increases with every change; readers keep the highest they have seen.
    pub seq: u64,
    /// When it was signed.
    pub issued_at_ms: UnixMillis,
    /// After this instant nobody should believe it.
    pub expires_at_ms: UnixMillis,
    /// GPUs on offer.
    pub gpus: Vec<AdvertGpu>,
    /// CPU cores on offer.
    pub cpu_cores: u32,
    /// RAM on offer in bytes.
    pub ram_bytes: u64,
    /// Executors the node runs (`wasm`, `container`).
    pub backends: Vec<String>,
    /// Price per GPU-hour in thousandths of a credit.
    pub price_per_gpu_hour_millicredits: u64,
    /// Addresses the node listens on.
    pub listen_addrs: Vec<String>,
    /// True when the GPUs are simulated (test networks).
    pub simulated: bool,
    /// True when the node has stopped offering (sent on shutdown).
    pub withdrawn: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct SignedAdvert {
    body: Vec<u8>,
    public_key: Vec<u8>,
    signature: Vec<u8>,
}

/// Why an advert was refused. [`AdvertError::reason`] gives a metrics label.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdvertError {
    /// Bytes could not be decoded, or were too large.
    #[error("undecodable advert: {0}")]
    Decode(#[from] DecodeError),
    /// Signature or key problem.
    #[error("advert signature invalid: {0}")]
    Signature(#[from] SignatureError),
    /// Body names another publisher than the key that signed it.
    #[error("advert body names publisher {body} but was signed by {signer}")]
    PublisherMismatch {
        /// Publisher inside the body.
        body: Box<PeerId>,
        /// Peer of the signing key.
        signer: Box<PeerId>,
    },
    /// Written by an unknown format version.
    #[error("advert version {0} is not supported (this build reads version {ADVERT_VERSION})")]
    UnsupportedVersion(u16),
    /// Its expiry has passed.
    #[error("advert expired {ago_ms} ms ago")]
    Expired {
        /// How long ago.
        ago_ms: u64,
    },
    /// Issued further in the future than the tolerated clock skew.
    #[error("advert issued {ahead_ms} ms in the future (more than the {MAX_CLOCK_SKEW_MS} ms clock skew tolerated)")]
    FromFuture {
        /// How far ahead.
        ahead_ms: u64,
    },
    /// Expiry before issue time or lifetime beyond [`MAX_ADVERT_TTL_MS`].
    #[error("advert lifetime is invalid")]
    BadLifetime,
    /// Lists more than [`MAX_ADVERT_ADDRS`] addresses.
    #[error("advert lists {0} addresses (at most {MAX_ADVERT_ADDRS} allowed)")]
    TooManyAddresses(usize),
    /// A lower or equal sequence number than one already seen from the same publisher.
    #[error("advert sequence {got} is not newer than {known}")]
    Stale {
        /// Sequence received.
        got: u64,
        /// Highest sequence already known.
        known: u64,
    },
}

impl AdvertError {
    /// A short, stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            AdvertError::Decode(DecodeError::TooLarge { .. }) => "oversized",
            AdvertError::Decode(_) => "malformed",
            AdvertError::Signature(SignatureError::WrongKey { .. })
            | AdvertError::PublisherMismatch { .. } => "wrong_key",
            AdvertError::Signature(_) => "bad_signature",
            AdvertError::UnsupportedVersion(_) => "unsupported_version",
            AdvertError::Expired { .. } => "expired",
            AdvertError::FromFuture { .. } | AdvertError::BadLifetime => "bad_time",
            AdvertError::Stale { .. } => "stale",
            AdvertError::TooManyAddresses(_) => "too_many_addresses",
        }
    }
}

impl Advert {
    /// Signs the advert with the publisher's key and returns the record bytes.
    pub fn sign(&self, key: &Keypair) -> Result<Vec<u8>, SignatureError> {
        let body = encoding::encode(self);
        let signature = signing::sign(key, ADVERT_SIGNING_TAG, &body)?;
        Ok(encoding::encode(&SignedAdvert {
            body,
            public_key: key.public().encode_protobuf(),
            signature,
        }))
    }

    /// Number of GPUs in the advert that are idle.
    pub fn idle_gpus(&self) -> usize {
        self.gpus
            .iter()
            .filter(|g| g.state == GpuState::Idle)
            .count()
    }

    /// Whether the advert offers what `filter` asks for.
    pub fn matches(&self, filter: &OfferFilter) -> bool {
        if self.withdrawn {
            return false;
        }
        if let Some(backend) = &filter.backend {
            if !self
                .backends
                .iter()
                .any(|b| b.eq_ignore_ascii_case(backend))
            {
                return false;
            }
        }
        let wanted = filter.gpus.unwrap_or(
            if filter.gpu_model.is_some()
                || filter.gpu_slice.is_some()
                || filter.min_gpu_mem_bytes.is_some()
            {
                1
            } else {
                0
            },
        );
        let matching = self
            .gpus
            .iter()
            .filter(|g| filter.gpu_matches(&g.model, g.memory_bytes))
            .count();
        matching >= wanted as usize
    }
}

/// What a requester looks for in adverts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferFilter {
    /// GPU model or family (`A100`, `RTX4090`).
    pub gpu_model: Option<String>,
    /// A MIG slice profile (`1g.18gb`): only MIG instances of it match; without one,
    /// only whole GPUs do.
    #[serde(default)]
    pub gpu_slice: Option<String>,
    /// Least memory per GPU in bytes.
    pub min_gpu_mem_bytes: Option<u64>,
    /// Least number of matching GPUs (1 when a model or memory is asked for, else 0).
    pub gpus: Option<u32>,
    /// Backend that must be offered.
    pub backend: Option<String>,
}

impl OfferFilter {
    /// The GPU part of a lease's requirements (model, slice, memory): which GPUs could
    /// serve it, however many are asked for and on whatever backend.
    pub fn for_gpus_of(r: &crate::lease::Requirements) -> OfferFilter {
        OfferFilter {
            gpu_model: r.gpu_model.clone(),
            gpu_slice: r.gpu_slice.clone(),
            min_gpu_mem_bytes: r.min_gpu_mem_bytes,
            gpus: None,
            backend: None,
        }
    }

    /// Whether one GPU satisfies the model and memory parts of the filter.
    pub fn gpu_matches(&self, model: &str, memory_bytes: u64) -> bool {
        match (&self.gpu_slice, mig_profile(model)) {
            (Some(want), Some(have)) if have.eq_ignore_ascii_case(want.trim()) => {}
            (None, None) => {}
            _ => return false,
        }
        if let Some(want) = &self.gpu_model {
            let family_match = model_family(model) == model_family(want);
            let name_match = model
                .to_ascii_uppercase()
                .contains(&want.to_ascii_uppercase());
            if !family_match && !name_match {
                return false;
            }
        }
        self.min_gpu_mem_bytes.is_none_or(|min| memory_bytes >= min)
    }

    /// The capability keys a requester looks up providers under for this filter: one
    /// key, or every shard of a shared key (see [`SHARED_KEY_BITS`]).
    pub fn lookup_keys(&self) -> Vec<Vec<u8>> {
        if let Some(model) = &self.gpu_model {
            vec![model_key(model)]
        } else if self.gpus.unwrap_or(0) > 0 || self.min_gpu_mem_bytes.is_some() {
            shard_keys(SHARED_GPU)
        } else if let Some(backend) = self.backend.as_ref().filter(|b| !is_everyones(b)) {
            vec![backend_key(backend)]
        } else {
            shard_keys(SHARED_ANY)
        }
    }
}

fn capability_key(name: &str) -> Vec<u8> {
    format!("/gpunode/v1/cap/{name}").into_bytes()
}

/// The key a GPU model's providers register under: its family's (`A100`, `RTX4090`).
pub fn model_key(model: &str) -> Vec<u8> {
    family_key(&model_family(model))
}

fn family_key(family: &str) -> Vec<u8> {
    capability_key(&format!("model/{family}"))
}

fn backend_key(backend: &str) -> Vec<u8> {
    capability_key(&format!("backend/{}", backend.to_ascii_lowercase()))
}

/// The keys nearly every provider registers under: `any` (every provider) and `gpu`
/// (has a GPU). Under one key each, every provider would walk to the same twenty peers
/// and open a connection to each: at 200 nodes that was a quarter of the connections
/// and CPU of a forming network (`docs/benchmarks.md`, "The keys every provider shares,
/// sharded"). So each is split into `2^SHARED_KEY_BITS` shards, and a provider registers
/// under the shard whose Kademlia key starts with the same bits as its own: the peers
/// nearest that shard key are its own neighbours, found by its bootstrap walk, already
/// connected, and holding its advert. A query for such a key looks up every shard (in
/// parallel): more requests than one key in a network of a few dozen nodes. Three bits
/// put about 20 nodes, Kademlia's k, in a shard at 160 nodes; in much larger networks a
/// shard's holders are again mostly peers a provider is not yet connected to, as with
/// one key, but eight groups of twenty share the load.
/// Every node must use the same value: changing it changes the DHT layout.
pub const SHARED_KEY_BITS: u32 = 3;
const SHARED_ANY: &str = "any";
const SHARED_GPU: &str = "gpu";

/// The first [`SHARED_KEY_BITS`] bits of the Kademlia key of `bytes` (a record key, or a
/// peer id's bytes): Kademlia places both at the SHA-256 of their bytes.
fn kademlia_prefix(bytes: &[u8]) -> u32 {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(bytes);
    u32::from(hash[0]) >> (8 - SHARED_KEY_BITS)
}

/// The shard of a shared key that `peer` registers under.
pub fn shard_of(peer: &PeerId) -> u32 {
    kademlia_prefix(&peer.to_bytes())
}

/// Shard `shard` of shared key `name`: `/gpunode/v1/cap/<name>/<shard>.<n>` with the
/// smallest `n` whose Kademlia key starts with the shard's bits (about eight tries).
fn shard_key(name: &str, shard: u32) -> Vec<u8> {
    (0u32..)
        .map(|n| capability_key(&format!("{name}/{shard}.{n}")))
        .find(|key| kademlia_prefix(key) == shard)
        .expect("some n puts the key in the shard")
}

/// Every shard of shared key `name`, in shard order.
fn shard_keys(name: &str) -> Vec<Vec<u8>> {
    (0..1 << SHARED_KEY_BITS)
        .map(|shard| shard_key(name, shard))
        .collect()
}

/// The shards of each shared key (`any`, `gpu`), each group in shard order: a DHT node
/// asked for the providers of one shard answers with those it holds of the others too,
/// so that in a network of a few dozen nodes, where every node holds most shards, a
/// query hears of every provider from its first answers.
pub fn shard_groups() -> Vec<Vec<Vec<u8>>> {
    [SHARED_ANY, SHARED_GPU].map(shard_keys).to_vec()
}

/// The backend every node runs unless its config leaves it out: a key for it would name
/// nearly every provider, as `any` does, and cost each of them one more walk to the same
/// twenty peers when it publishes. Its providers are looked up under `any` and filtered
/// by their adverts.
const EVERYONES_BACKEND: &str = "wasm";

fn is_everyones(backend: &str) -> bool {
    backend.eq_ignore_ascii_case(EVERYONES_BACKEND)
}

/// The DHT key under which `peer` stores its advert: its peer id's bytes, so the record
/// lives with the peers nearest to the node itself (Kademlia places a record at the
/// hash of its key, and a peer at the hash of its id's bytes). Publishing it walks to
/// the neighbours the node's own bootstrap lookup found and is already connected to,
/// rather than to twenty peers somewhere else.
pub fn advert_record_key(peer: &PeerId) -> Vec<u8> {
    peer.to_bytes()
}

/// If `key` is an advert record key, the peer it belongs to.
pub fn peer_of_advert_key(key: &[u8]) -> Option<PeerId> {
    PeerId::from_bytes(key).ok()
}

/// Every capability key an advert's publisher registers as provider under.
pub fn capability_keys(advert: &Advert) -> Vec<Vec<u8>> {
    let shard = shard_of(&advert.publisher);
    let mut keys = vec![shard_key(SHARED_ANY, shard)];
    if !advert.gpus.is_empty() {
        keys.push(shard_key(SHARED_GPU, shard));
    }
    let mut families: Vec<String> = advert.gpus.iter().map(|g| model_family(&g.model)).collect();
    families.sort();
    families.dedup();
    keys.extend(families.iter().map(|f| family_key(f)));
    keys.extend(
        advert
            .backends
            .iter()
            .filter(|b| !is_everyones(b))
            .map(|b| backend_key(b)),
    );
    keys
}

/// Checks advert record bytes published under `claimed`'s advert key at time `now`.
pub fn verify_advert(
    bytes: &[u8],
    claimed: &PeerId,
    now: UnixMillis,
) -> Result<Advert, AdvertError> {
    let signed: SignedAdvert = encoding::decode(bytes, MAX_SIGNED_ADVERT_BYTES)?;
    let key = signing::key_of(claimed, &signed.public_key)?;
    signing::verify(&key, ADVERT_SIGNING_TAG, &signed.body, &signed.signature)?;
    let advert: Advert = encoding::decode(&signed.body, MAX_SIGNED_ADVERT_BYTES)?;
    if advert.version != ADVERT_VERSION {
        return Err(AdvertError::UnsupportedVersion(advert.version));
    }
    if advert.publisher != *claimed {
        return Err(AdvertError::PublisherMismatch {
            body: Box::new(advert.publisher),
            signer: Box::new(*claimed),
        });
    }
    if advert.expires_at_ms < advert.issued_at_ms
        || advert.expires_at_ms - advert.issued_at_ms > MAX_ADVERT_TTL_MS
    {
        return Err(AdvertError::BadLifetime);
    }
    if advert.listen_addrs.len() > MAX_ADVERT_ADDRS {
        return Err(AdvertError::TooManyAddresses(advert.listen_addrs.len()));
    }
    check_advert_clock(&advert, now)?;
    Ok(advert)
}

/// The checks of [`verify_advert`] that depend on the time `now`: not issued more than
/// the tolerated clock skew ahead, not expired. An advert that passed every other check
/// once passes them again whenever its bytes are the same.
pub fn check_advert_clock(advert: &Advert, now: UnixMillis) -> Result<(), AdvertError> {
    if advert.issued_at_ms > now + MAX_CLOCK_SKEW_MS {
        return Err(AdvertError::FromFuture {
            ahead_ms: advert.issued_at_ms - now,
        });
    }
    if advert.expires_at_ms <= now {
        return Err(AdvertError::Expired {
            ago_ms: now - advert.expires_at_ms,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn slices_match_only_slice_requests_and_whole_gpus_only_whole_requests() {
        let whole = OfferFilter::default();
        let slice = OfferFilter {
            gpu_slice: Some("1g.18gb".into()),
            ..OfferFilter::default()
        };
        assert!(whole.gpu_matches("NVIDIA H200", 141 << 30));
        assert!(!whole.gpu_matches("NVIDIA H200 MIG 1g.18gb", 18 << 30));
        assert!(slice.gpu_matches("NVIDIA H200 MIG 1g.18gb", 18 << 30));
        assert!(!slice.gpu_matches("NVIDIA H200 MIG 2g.35gb", 35 << 30));
        assert!(!slice.gpu_matches("NVIDIA H200", 141 << 30));
    }

    use super::*;

    fn sample(key: &Keypair, seq: u64, now: UnixMillis) -> Advert {
        Advert {
            version: ADVERT_VERSION,
            publisher: key.public().to_peer_id(),
            seq,
            issued_at_ms: now,
            expires_at_ms: now + 60_000,
            gpus: vec![AdvertGpu {
                index: 0,
                uuid: "GPU-sim-0".into(),
                model: "A100-80GB".into(),
                memory_bytes: 80 << 30,
                state: GpuState::Idle,
                mig_enabled: false,
                compute_capability: Some((8, 0)),
                reserved: Vec::new(),
            }],
            cpu_cores: 8,
            ram_bytes: 64 << 30,
            backends: vec!["wasm".into()],
            price_per_gpu_hour_millicredits: 1000,
            listen_addrs: vec!["/ip4/127.0.0.1/udp/1/quic-v1".into()],
            simulated: true,
            withdrawn: false,
        }
    }

    const NOW: UnixMillis = 1_800_000_000_000;

    #[test]
    fn signed_advert_verifies() {
        let k = Keypair::generate_ed25519();
        let a = sample(&k, 1, NOW);
        let bytes = a.sign(&k).expect("sign");
        assert_eq!(verify_advert(&bytes, &a.publisher, NOW), Ok(a));
    }

    #[test]
    fn tampered_field_is_rejected() {
        let k = Keypair::generate_ed25519();
        let a = sample(&k, 1, NOW);
        let mut signed: SignedAdvert =
            encoding::decode(&a.sign(&k).expect("sign"), 1 << 20).expect("decode");
        let mut body: Advert = encoding::decode(&signed.body, 1 << 20).expect("decode");
        body.price_per_gpu_hour_millicredits = 1;
        signed.body = encoding::encode(&body);
        let err = verify_advert(&encoding::encode(&signed), &a.publisher, NOW).unwrap_err();
        assert_eq!(err.reason(), "bad_signature");
        // Flipping a single byte of the body also breaks it.
        let mut bytes = a.sign(&k).expect("sign");
        let n = bytes.len();
        bytes[n - 100] ^= 1;
        assert!(verify_advert(&bytes, &a.publisher, NOW).is_err());
    }

    #[test]
    fn wrong_key_is_rejected() {
        let k = Keypair::generate_ed25519();
        let mallory = Keypair::generate_ed25519();
        // Mallory signs an advert that claims to be k's.
        let a = sample(&k, 1, NOW);
        let bytes = a.sign(&mallory).expect("sign");
        let err = verify_advert(&bytes, &a.publisher, NOW).unwrap_err();
        assert_eq!(err.reason(), "wrong_key");
        // Mallory's own valid advert stored under k's key.
        let m = sample(&mallory, 1, NOW);
        let err = verify_advert(&m.sign(&mallory).expect("sign"), &a.publisher, NOW).unwrap_err();
        assert_eq!(err.reason(), "wrong_key");
        // Body naming another publisher than the signer.
        let mut forged = sample(&mallory, 1, NOW);
        forged.publisher = a.publisher;
        let err = verify_advert(
            &forged.sign(&mallory).expect("sign"),
            &mallory.public().to_peer_id(),
            NOW,
        )
        .unwrap_err();
        assert!(matches!(err, AdvertError::PublisherMismatch { .. }));
    }

    #[test]
    fn expired_and_future_adverts_are_rejected() {
        let k = Keypair::generate_ed25519();
        let a = sample(&k, 1, NOW);
        let bytes = a.sign(&k).expect("sign");
        let err = verify_advert(&bytes, &a.publisher, NOW + 60_000).unwrap_err();
        assert_eq!(err.reason(), "expired");
        let err = verify_advert(&bytes, &a.publisher, NOW - MAX_CLOCK_SKEW_MS - 1).unwrap_err();
        assert_eq!(err.reason(), "bad_time");
        // Within the skew it is accepted.
        assert!(verify_advert(&bytes, &a.publisher, NOW - MAX_CLOCK_SKEW_MS).is_ok());
        let mut long = sample(&k, 1, NOW);
        long.expires_at_ms = NOW + MAX_ADVERT_TTL_MS + 1;
        let err = verify_advert(&long.sign(&k).expect("sign"), &a.publisher, NOW).unwrap_err();
        assert_eq!(err, AdvertError::BadLifetime);
    }

    /// An advert naming more addresses than [`MAX_ADVERT_ADDRS`] (our own bound) is
    /// refused, though properly signed: requesters would dial each.
    #[test]
    fn an_advert_listing_more_addresses_than_a_node_has_is_refused() {
        let k = Keypair::generate_ed25519();
        let mut a = sample(&k, 1, NOW);
        a.listen_addrs = (0..MAX_ADVERT_ADDRS)
            .map(|i| format!("/ip4/192.0.2.1/udp/{}/quic-v1", 1000 + i))
            .collect();
        assert!(verify_advert(&a.sign(&k).expect("sign"), &a.publisher, NOW).is_ok());
        a.listen_addrs.push("/ip4/192.0.2.1/udp/999/quic-v1".into());
        let err = verify_advert(&a.sign(&k).expect("sign"), &a.publisher, NOW).unwrap_err();
        assert_eq!(err, AdvertError::TooManyAddresses(MAX_ADVERT_ADDRS + 1));
        assert_eq!(err.reason(), "too_many_addresses");
    }

    #[test]
    fn oversized_record_rejected_before_decoding() {
        let k = Keypair::generate_ed25519();
        let bytes = vec![0u8; MAX_SIGNED_ADVERT_BYTES + 1];
        let err = verify_advert(&bytes, &k.public().to_peer_id(), NOW).unwrap_err();
        assert_eq!(err.reason(), "oversized");
        let err = verify_advert(b"garbage", &k.public().to_peer_id(), NOW).unwrap_err();
        assert_eq!(err.reason(), "malformed");
    }

    #[test]
    fn filters_and_capability_keys() {
        let k = Keypair::generate_ed25519();
        let mut a = sample(&k, 1, NOW);
        a.gpus.push(AdvertGpu {
            model: "Tesla T4".into(),
            memory_bytes: 16 << 30,
            ..a.gpus[0].clone()
        });
        let f = |m: Option<&str>, mem: Option<u64>, n: Option<u32>| OfferFilter {
            gpu_model: m.map(str::to_string),
            gpu_slice: None,
            min_gpu_mem_bytes: mem,
            gpus: n,
            backend: None,
        };
        assert!(a.matches(&f(Some("A100"), None, None)));
        assert!(a.matches(&f(Some("t4"), None, None)));
        assert!(!a.matches(&f(Some("H100"), None, None)));
        assert!(a.matches(&f(None, Some(40 << 30), Some(1))));
        assert!(!a.matches(&f(None, Some(40 << 30), Some(2))));
        assert!(a.matches(&f(None, None, Some(2))));
        let keys = capability_keys(&a);
        // A query finds the advert when one of the keys it looks up is one the advert's
        // publisher registered under: the model's key, or its shard of a shared one.
        let found = |filter: &OfferFilter, keys: &[Vec<u8>]| {
            filter
                .lookup_keys()
                .iter()
                .filter(|k| keys.contains(k))
                .count()
        };
        assert_eq!(f(Some("A100"), None, None).lookup_keys().len(), 1);
        assert_eq!(found(&f(Some("A100"), None, None), &keys), 1);
        assert_eq!(found(&f(Some("NVIDIA T4"), None, None), &keys), 1);
        assert_eq!(found(&f(None, None, Some(1)), &keys), 1);
        assert_eq!(found(&f(None, Some(40 << 30), None), &keys), 1);
        assert_eq!(found(&OfferFilter::default(), &keys), 1);
        assert_eq!(found(&f(Some("H100"), None, None), &keys), 0);
        a.withdrawn = true;
        assert!(!a.matches(&OfferFilter::default()));
        a.withdrawn = false;
        // Every node's backend has no key of its own: its providers are those under
        // `any`, filtered on their adverts. Another backend has one.
        let wasm = OfferFilter {
            backend: Some("WASM".into()),
            ..OfferFilter::default()
        };
        assert_eq!(wasm.lookup_keys(), OfferFilter::default().lookup_keys());
        a.backends = vec!["wasm".into(), "container".into()];
        let keys = capability_keys(&a);
        assert!(!keys
            .iter()
            .any(|k| k.starts_with(b"/gpunode/v1/cap/backend/wasm")));
        let container = OfferFilter {
            backend: Some("container".into()),
            ..OfferFilter::default()
        };
        assert_eq!(
            container.lookup_keys(),
            vec![b"/gpunode/v1/cap/backend/container".to_vec()]
        );
        assert_eq!(found(&container, &keys), 1);
        assert!(a.matches(&wasm) && a.matches(&container));
        a.backends = vec!["container".into()];
        assert!(
            !a.matches(&wasm),
            "found under `any`, left out by the filter"
        );
        a.withdrawn = true;
        assert!(!a.matches(&OfferFilter::default()));
        assert_eq!(
            peer_of_advert_key(&advert_record_key(&a.publisher)),
            Some(a.publisher)
        );
        assert_eq!(peer_of_advert_key(b"/gpunode/v1/cap/model/A100"), None);
        assert_eq!(peer_of_advert_key(b""), None);
    }

    /// A provider registers under the shard of `any` and `gpu` whose Kademlia key starts
    /// like its own, so the peers nearest it are its own neighbours; a query looks up
    /// every shard, so it finds every provider whatever its shard.
    #[test]
    fn shared_keys_are_sharded_next_to_their_providers() {
        use sha2::Digest;
        let shards = 1usize << SHARED_KEY_BITS;
        for name in [SHARED_ANY, SHARED_GPU] {
            let keys = shard_keys(name);
            assert_eq!(keys.len(), shards);
            for (shard, key) in keys.iter().enumerate() {
                assert_eq!(kademlia_prefix(key) as usize, shard);
                assert_eq!(
                    key,
                    &shard_key(name, shard as u32),
                    "the same on every node"
                );
                let first = sha2::Sha256::digest(key)[0];
                assert_eq!(usize::from(first >> (8 - SHARED_KEY_BITS)), shard);
            }
            let mut distinct = keys.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), shards);
        }
        assert_ne!(shard_keys(SHARED_ANY), shard_keys(SHARED_GPU));

        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let k = Keypair::generate_ed25519();
            let a = sample(&k, 1, NOW);
            let shard = shard_of(&a.publisher);
            seen.insert(shard);
            let first = sha2::Sha256::digest(a.publisher.to_bytes())[0];
            assert_eq!(u32::from(first >> (8 - SHARED_KEY_BITS)), shard);
            let keys = capability_keys(&a);
            for shared in [SHARED_ANY, SHARED_GPU] {
                let own = shard_key(shared, shard);
                assert!(keys.contains(&own), "{shared} shard {shard}");
                let others = shard_keys(shared).into_iter().filter(|k| *k != own);
                assert!(others.into_iter().all(|k| !keys.contains(&k)));
            }
        }
        assert_eq!(seen.len(), shards, "providers spread over every shard");
    }
}
