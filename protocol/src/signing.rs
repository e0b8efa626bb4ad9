//! Domain-separated ed25519 signatures with a node's libp2p identity key.
//!
//! Every signed structure in gpunode signs `TAG || canonical bytes`, where the tag names
//! the structure and its version, so a signature over an advert can never be replayed as
//! a signature over a lease (or the other way round).

use libp2p_identity::{Keypair, PeerId, PublicKey};

/// Why a signature could not be produced or checked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    /// The public key bytes are not a valid libp2p public key.
    #[error("public key is not a valid libp2p ed25519 key")]
    BadPublicKey,
    /// The key is valid but belongs to another peer than the one claimed.
    #[error("key belongs to peer {actual}, not to the claimed peer {claimed}")]
    WrongKey {
        /// Peer the message claims to come from.
        claimed: Box<PeerId>,
        /// Peer the key really belongs to.
        actual: Box<PeerId>,
    },
    /// The signature does not verify over the signed bytes.
    #[error("signature does not verify")]
    BadSignature,
    /// The local key cannot sign (it is not an ed25519 key).
    #[error("local key cannot sign: {0}")]
    CannotSign(String),
}

fn tagged(tag: &[u8], body: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(tag.len() + body.len());
    msg.extend_from_slice(tag);
    msg.extend_from_slice(body);
    msg
}

/// Signs `tag || body` with `key`.
pub fn sign(key: &Keypair, tag: &[u8], body: &[u8]) -> Result<Vec<u8>, SignatureError> {
    key.sign(&tagged(tag, body))
        .map_err(|e| SignatureError::CannotSign(e.to_string()))
}

/// Decodes a protobuf-encoded public key and checks that it belongs to `claimed`.
pub fn key_of(claimed: &PeerId, public_key: &[u8]) -> Result<PublicKey, SignatureError> {
    let key =
        PublicKey::try_decode_protobuf(public_key).map_err(|_| SignatureError::BadPublicKey)?;
    let actual = key.to_peer_id();
    if actual != *claimed {
        return Err(SignatureError::WrongKey {
            claimed: Box::new(*claimed),
            actual: Box::new(actual),
        });
    }
    Ok(key)
}

/// The public key inside an ed25519 peer id (an identity multihash of the protobuf key).
pub fn public_key_of(peer: &PeerId) -> Result<PublicKey, SignatureError> {
    let bytes = peer.to_bytes();
    // Identity multihash: code 0x00, then a one-byte length (keys are under 128 bytes).
    match bytes.as_slice() {
        [0x00, len, digest @ ..] if (*len as usize) == digest.len() && *len < 0x80 => {
            PublicKey::try_decode_protobuf(digest).map_err(|_| SignatureError::BadPublicKey)
        }
        _ => Err(SignatureError::BadPublicKey),
    }
}

/// Verifies `signature` over `tag || body` with `key`.
///
/// For ed25519 keys (every gpunode identity) this is the same rule as
/// [`verify_batch`]: small-order public keys and small-order `R` are refused, `s` must
/// be canonical, and the equation is checked with the cofactor, so a signature that
/// passes one check passes the other.
pub fn verify(
    key: &PublicKey,
    tag: &[u8],
    body: &[u8],
    signature: &[u8],
) -> Result<(), SignatureError> {
    let ok = match key.clone().try_into_ed25519() {
        Ok(k) => verify_ed25519(&k.to_bytes(), tag, body, signature),
        Err(_) => key.verify(&tagged(tag, body), signature),
    };
    if ok {
        Ok(())
    } else {
        Err(SignatureError::BadSignature)
    }
}

/// Verifies `signature` by `signer` over `tag || body`, under the rule of [`verify`],
/// with `signer`'s key taken from the id itself as [`public_key_of`] does. The key's
/// decoded form is kept (for the last [`MAX_CACHED_KEYS`] signers or fewer), so a peer
/// that signs often costs one key decoding, not one per signature.
pub fn verify_by(
    signer: &PeerId,
    tag: &[u8],
    body: &[u8],
    signature: &[u8],
) -> Result<(), SignatureError> {
    let Some(key) = cached_key(signer) else {
        // Not an ed25519 key, or not a usable one: the uncached check says why.
        return verify(&public_key_of(signer)?, tag, body, signature);
    };
    if verify_ed25519_point(&key, tag, body, signature) {
        Ok(())
    } else {
        Err(SignatureError::BadSignature)
    }
}

/// Most signers' keys kept decoded by [`verify_by`]; when full, it starts afresh.
pub const MAX_CACHED_KEYS: usize = 4096;

/// Keys decoded by [`verify_by`], by signer.
static KEYS: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<PeerId, CachedKey>>> =
    std::sync::LazyLock::new(Default::default);

/// `peer`'s ed25519 key decoded, from the cache or decoded now (and kept); `None` for
/// an id without an ed25519 key or with a small-order one (never kept).
fn cached_key(peer: &PeerId) -> Option<CachedKey> {
    let kept = || KEYS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = kept().get(peer) {
        return Some(k.clone());
    }
    // Decoded outside the lock, which other checks share.
    let key = CachedKey::of(peer)?;
    keep_key(&mut kept(), *peer, key.clone(), MAX_CACHED_KEYS);
    Some(key)
}

/// Keeps `key` for `peer` in `keys`, which never holds more than `most` keys (when
/// full, it starts afresh).
fn keep_key(
    keys: &mut std::collections::HashMap<PeerId, CachedKey>,
    peer: PeerId,
    key: CachedKey,
    most: usize,
) {
    if keys.len() >= most && !keys.contains_key(&peer) {
        keys.clear();
    }
    keys.insert(peer, key);
}

/// One ed25519 signature under the rule of [`verify`].
fn verify_ed25519(key: &[u8; 32], tag: &[u8], body: &[u8], signature: &[u8]) -> bool {
    use curve25519_dalek::edwards::CompressedEdwardsY;

    let Some(point) = CompressedEdwardsY(*key).decompress() else {
        return false;
    };
    if point.is_small_order() {
        return false;
    }
    let key = CachedKey {
        compressed: *key,
        point,
    };
    verify_ed25519_point(&key, tag, body, signature)
}

/// One ed25519 signature under the rule of [`verify`], by a key already decoded and
/// checked not to be of small order.
fn verify_ed25519_point(key: &CachedKey, tag: &[u8], body: &[u8], signature: &[u8]) -> bool {
    use curve25519_dalek::edwards::{CompressedEdwardsY, EdwardsPoint};
    use curve25519_dalek::traits::IsIdentity;
    use curve25519_dalek::Scalar;
    use sha2::{Digest, Sha512};

    let Ok(sig) = <&[u8; 64]>::try_from(signature) else {
        return false;
    };
    let a = key.point;
    let key = &key.compressed;
    let Some(r) = CompressedEdwardsY(sig[..32].try_into().unwrap_or([0; 32])).decompress() else {
        return false;
    };
    if r.is_small_order() {
        return false;
    }
    let s: Option<Scalar> =
        Scalar::from_canonical_bytes(sig[32..].try_into().unwrap_or([0xff; 32])).into();
    let Some(s) = s else {
        return false;
    };
    let h = Scalar::from_hash(
        Sha512::new()
            .chain_update(&sig[..32])
            .chain_update(key)
            .chain_update(tag)
            .chain_update(body),
    );
    // [8](sB - hA - R) == 0
    let check = EdwardsPoint::vartime_double_scalar_mul_basepoint(&-h, &a, &s) - r;
    check.mul_by_cofactor().is_identity()
}

/// One signature in a batch: `signature` by `signer` over `tag || body`.
#[derive(Debug, Clone, Copy)]
pub struct BatchItem<'a> {
    /// Who signed (an ed25519 peer id, whose key it embeds).
    pub signer: &'a PeerId,
    /// Domain tag.
    pub tag: &'a [u8],
    /// Signed body.
    pub body: &'a [u8],
    /// The signature.
    pub signature: &'a [u8],
}

/// Signatures checked together per batch: large enough to amortise the multiscalar
/// multiplication, small enough to keep cores busy.
const BATCH: usize = 4096;

/// Checks many signatures at once, spread over the machine's cores. Returns the index of
/// the first item that does not verify.
///
/// This is ed25519 batch verification (as in ed25519-dalek's `verify_batch`: random
/// 128-bit coefficients z, and `[-Σ z·s]B + Σ z·R + Σ (z·k)·A == 0` after the cofactor),
/// with one change: the terms of signatures by the same key are merged into one point,
/// so a ledger whose receipts all carry this node's signature and those of a few peers
/// needs half the points (about 40% less time). When a batch fails, its signatures are
/// checked one by one (strictly) to name the first bad one.
pub fn verify_batch(items: &[BatchItem<'_>]) -> Result<(), usize> {
    verify_in_batches(items, BATCH)
}

/// Like [`verify_batch`], on the calling thread only (for callers that spread work over
/// cores themselves).
pub fn verify_batch_here(items: &[BatchItem<'_>]) -> Result<(), usize> {
    verify_here(items, BATCH)
}

fn verify_here(items: &[BatchItem<'_>], batch: usize) -> Result<(), usize> {
    let mut keys = KeyCache::default();
    for (c, chunk) in items.chunks(batch).enumerate() {
        verify_chunk(chunk, &mut keys).map_err(|i| c * batch + i)?;
    }
    Ok(())
}

fn verify_in_batches(items: &[BatchItem<'_>], batch: usize) -> Result<(), usize> {
    let batches = items.len().div_ceil(batch);
    // One batch (every settlement message: a few receipts) is checked on this thread: a
    // thread started and joined for it cost more than the check, and asking for the
    // cores reads the cgroup files every time.
    if batches <= 1 {
        return verify_here(items, batch);
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(batches);
    if threads <= 1 {
        return verify_here(items, batch);
    }
    let per_thread = items.len().div_ceil(threads).max(1);
    let first_bad = std::thread::scope(|s| {
        let workers: Vec<_> = items
            .chunks(per_thread)
            .enumerate()
            .map(|(t, part)| {
                s.spawn(move || {
                    let mut keys = KeyCache::default();
                    for (c, chunk) in part.chunks(batch).enumerate() {
                        if let Err(i) = verify_chunk(chunk, &mut keys) {
                            return Some(t * per_thread + c * batch + i);
                        }
                    }
                    None
                })
            })
            .collect();
        workers
            .into_iter()
            .filter_map(|w| w.join().unwrap_or(Some(0)))
            .min()
    });
    match first_bad {
        Some(i) => Err(i),
        None => Ok(()),
    }
}

/// A signer's key in the forms verification needs.
#[derive(Clone)]
struct CachedKey {
    compressed: [u8; 32],
    point: curve25519_dalek::EdwardsPoint,
}

impl CachedKey {
    /// `peer`'s ed25519 key, decoded; `None` for an id without one, or with a key of
    /// small order (which would verify forged signatures).
    fn of(peer: &PeerId) -> Option<CachedKey> {
        let compressed = public_key_of(peer)
            .ok()?
            .try_into_ed25519()
            .ok()?
            .to_bytes();
        let point = curve25519_dalek::edwards::CompressedEdwardsY(compressed).decompress()?;
        if point.is_small_order() {
            return None;
        }
        Some(CachedKey { compressed, point })
    }
}

#[derive(Default)]
struct KeyCache {
    index: std::collections::HashMap<PeerId, Option<usize>>,
    keys: Vec<CachedKey>,
}

impl KeyCache {
    /// The position of `peer`'s key, decoded once.
    fn get(&mut self, peer: &PeerId) -> Option<usize> {
        if let Some(i) = self.index.get(peer) {
            return *i;
        }
        // From the keys kept for single checks: a signer decoded once for either.
        let key = cached_key(peer);
        let i = key.map(|k| {
            self.keys.push(k);
            self.keys.len() - 1
        });
        self.index.insert(*peer, i);
        i
    }
}

/// One batch; on failure, finds the first bad item one by one.
fn verify_chunk(chunk: &[BatchItem<'_>], keys: &mut KeyCache) -> Result<(), usize> {
    use curve25519_dalek::edwards::CompressedEdwardsY;
    use curve25519_dalek::traits::{IsIdentity, VartimeMultiscalarMul};
    use curve25519_dalek::{EdwardsPoint, Scalar};
    use sha2::{Digest, Sha512};

    let mut base = Scalar::ZERO;
    let mut r_points = Vec::with_capacity(chunk.len());
    let mut r_coeffs = Vec::with_capacity(chunk.len());
    let mut key_coeffs: Vec<Scalar> = Vec::new();
    let mut decodable = true;
    for item in chunk {
        let parts = keys.get(item.signer).and_then(|k| {
            let sig: &[u8; 64] = item.signature.try_into().ok()?;
            let r = CompressedEdwardsY(sig[..32].try_into().ok()?)
                .decompress()
                .filter(|r| !r.is_small_order())?;
            let s: Option<Scalar> = Scalar::from_canonical_bytes(sig[32..].try_into().ok()?).into();
            Some((k, sig, r, s?))
        });
        let Some((k, sig, r, s)) = parts else {
            // Found below, in order.
            decodable = false;
            break;
        };
        let h = Scalar::from_hash(
            Sha512::new()
                .chain_update(&sig[..32])
                .chain_update(keys.keys[k].compressed)
                .chain_update(item.tag)
                .chain_update(item.body),
        );
        let z = Scalar::from(rand::random::<u128>());
        base -= z * s;
        r_points.push(r);
        r_coeffs.push(z);
        if key_coeffs.len() <= k {
            key_coeffs.resize(k + 1, Scalar::ZERO);
        }
        key_coeffs[k] += z * h;
    }
    if decodable {
        let sum = EdwardsPoint::vartime_multiscalar_mul(
            std::iter::once(base)
                .chain(r_coeffs)
                .chain(key_coeffs.iter().copied()),
            std::iter::once(curve25519_dalek::constants::ED25519_BASEPOINT_POINT)
                .chain(r_points)
                .chain(keys.keys[..key_coeffs.len()].iter().map(|k| k.point)),
        );
        if sum.mul_by_cofactor().is_identity() {
            return Ok(());
        }
    }
    for (i, item) in chunk.iter().enumerate() {
        let k = keys.get(item.signer).ok_or(i)?;
        if !verify_ed25519(
            &keys.keys[k].compressed,
            item.tag,
            item.body,
            item.signature,
        ) {
            return Err(i);
        }
    }
    // Each signature passes alone under the same cofactored rule, so the batch can fail
    // only with probability 2^-128 (its random coefficients): reject it as a whole.
    Err(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_bound_to_tag_body_and_key() {
        let k = Keypair::generate_ed25519();
        let sig = sign(&k, b"t1", b"body").expect("sign");
        assert_eq!(verify(&k.public(), b"t1", b"body", &sig), Ok(()));
        assert_eq!(
            verify(&k.public(), b"t2", b"body", &sig),
            Err(SignatureError::BadSignature)
        );
        assert_eq!(
            verify(&k.public(), b"t1", b"bodY", &sig),
            Err(SignatureError::BadSignature)
        );
        let other = Keypair::generate_ed25519();
        assert_eq!(
            verify(&other.public(), b"t1", b"body", &sig),
            Err(SignatureError::BadSignature)
        );
    }

    #[test]
    fn batch_verification_finds_the_first_bad_signature() {
        let keys: Vec<Keypair> = (0..3).map(|_| Keypair::generate_ed25519()).collect();
        let peers: Vec<PeerId> = keys.iter().map(|k| k.public().to_peer_id()).collect();
        let bodies: Vec<Vec<u8>> = (0..2500u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let mut sigs: Vec<Vec<u8>> = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| sign(&keys[i % 3], b"t", b).expect("sign"))
            .collect();
        let items = |sigs: &[Vec<u8>]| -> Result<(), usize> {
            let items: Vec<BatchItem<'_>> = bodies
                .iter()
                .enumerate()
                .map(|(i, b)| BatchItem {
                    signer: &peers[i % 3],
                    tag: b"t",
                    body: b,
                    signature: &sigs[i],
                })
                .collect();
            // Small batches, so several threads and several batches per thread run.
            let small = verify_in_batches(&items, 300);
            assert_eq!(small, verify_batch(&items));
            small
        };
        assert_eq!(items(&sigs), Ok(()));
        sigs[2100][5] ^= 1;
        sigs[1500] = sigs[1501].clone();
        assert_eq!(items(&sigs), Err(1500));
        sigs[7] = b"short".to_vec();
        assert_eq!(items(&sigs), Err(7));
        assert_eq!(verify_batch(&[]), Ok(()));
    }

    #[test]
    fn small_order_keys_and_points_are_refused_in_single_and_batch_checks() {
        // The identity point as public key, R = identity and s = 0: the classic forgery
        // that a cofactorless check without a small-order test accepts for any message.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let weak = libp2p_identity::ed25519::PublicKey::try_from_bytes(&identity)
            .expect("dalek decodes the identity point");
        let weak: PublicKey = weak.into();
        let peer = weak.to_peer_id();
        let mut forged = [0u8; 64];
        forged[..32].copy_from_slice(&identity);
        assert!(
            weak.verify(b"tbody", &forged),
            "the forgery works without the checks"
        );
        assert_eq!(
            verify(&weak, b"t", b"body", &forged),
            Err(SignatureError::BadSignature)
        );
        let item = BatchItem {
            signer: &peer,
            tag: b"t",
            body: b"body",
            signature: &forged,
        };
        assert_eq!(verify_batch(&[item]), Err(0));
        // A real key with a small-order R is refused too.
        let k = Keypair::generate_ed25519();
        let good_peer = k.public().to_peer_id();
        let mut sig = sign(&k, b"t", b"body").expect("sign");
        assert_eq!(verify(&k.public(), b"t", b"body", &sig), Ok(()));
        sig[..32].copy_from_slice(&identity);
        assert!(verify(&k.public(), b"t", b"body", &sig).is_err());
        let item = BatchItem {
            signer: &good_peer,
            tag: b"t",
            body: b"body",
            signature: &sig,
        };
        assert_eq!(verify_batch(&[item]), Err(0));
    }

    /// The check by signer id, with its kept keys, gives the answers of the check by
    /// key, the first time and after; a small-order key is refused and never kept; and
    /// the kept keys stay within their bound.
    #[test]
    fn checks_by_signer_id_agree_with_checks_by_key_and_keep_few_keys() {
        let k = Keypair::generate_ed25519();
        let peer = k.public().to_peer_id();
        let other = Keypair::generate_ed25519().public().to_peer_id();
        let sig = sign(&k, b"t1", b"body").expect("sign");
        for _ in 0..2 {
            assert_eq!(verify_by(&peer, b"t1", b"body", &sig), Ok(()));
            assert_eq!(
                verify_by(&peer, b"t2", b"body", &sig),
                Err(SignatureError::BadSignature)
            );
            assert_eq!(
                verify_by(&peer, b"t1", b"bodY", &sig),
                Err(SignatureError::BadSignature)
            );
            assert_eq!(
                verify_by(&other, b"t1", b"body", &sig),
                Err(SignatureError::BadSignature)
            );
            assert_eq!(
                verify_by(&peer, b"t1", b"body", b"short"),
                Err(SignatureError::BadSignature)
            );
        }
        // Not an ed25519 id at all.
        let hashed = PeerId::random();
        assert_eq!(
            verify_by(&hashed, b"t1", b"body", &sig),
            Err(SignatureError::BadPublicKey)
        );

        // The identity point as key with R = identity, s = 0 verifies any message
        // without the small-order checks.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let weak: PublicKey = libp2p_identity::ed25519::PublicKey::try_from_bytes(&identity)
            .expect("dalek decodes the identity point")
            .into();
        let weak_peer = weak.to_peer_id();
        let mut forged = [0u8; 64];
        forged[..32].copy_from_slice(&identity);
        for _ in 0..2 {
            assert_eq!(
                verify_by(&weak_peer, b"t", b"body", &forged),
                Err(SignatureError::BadSignature)
            );
        }
        assert!(
            CachedKey::of(&weak_peer).is_none(),
            "a small-order key is not kept"
        );
        // A real key with a small-order R.
        let mut bad_r = sig.clone();
        bad_r[..32].copy_from_slice(&identity);
        assert!(verify_by(&peer, b"t1", b"body", &bad_r).is_err());

        let mut keys = std::collections::HashMap::new();
        for _ in 0..5 {
            let p = Keypair::generate_ed25519().public().to_peer_id();
            let key = CachedKey::of(&p).expect("an ed25519 key");
            keep_key(&mut keys, p, key, 2);
            assert!(keys.len() <= 2, "{} keys kept", keys.len());
            assert!(keys.contains_key(&p), "the newest is kept");
        }
    }

    #[test]
    fn key_must_match_claimed_peer() {
        let k = Keypair::generate_ed25519();
        let other = Keypair::generate_ed25519();
        let bytes = k.public().encode_protobuf();
        assert!(key_of(&k.public().to_peer_id(), &bytes).is_ok());
        assert!(matches!(
            key_of(&other.public().to_peer_id(), &bytes),
            Err(SignatureError::WrongKey { .. })
        ));
        assert_eq!(
            key_of(&k.public().to_peer_id(), b"junk").err(),
            Some(SignatureError::BadPublicKey)
        );
    }
}
