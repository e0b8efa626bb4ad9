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

/// Verifies `signature` over `tag || body` with `key`.
pub fn verify(
    key: &PublicKey,
    tag: &[u8],
    body: &[u8],
    signature: &[u8],
) -> Result<(), SignatureError> {
    if key.verify(&tagged(tag, body), signature) {
        Ok(())
    } else {
        Err(SignatureError::BadSignature)
    }
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
