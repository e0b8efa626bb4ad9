//! Canonical binary encoding of wire types (the only module that touches bincode).
//!
//! Canonical means: fixed-width integers, little endian, no trailing bytes accepted, so
//! the same value always gives the same bytes and both parties sign the same thing.
//! Decoding refuses input longer than the caller's limit before it reads anything, and
//! bincode's own allocation limit stops length prefixes that claim more than that.

use serde::{de::DeserializeOwned, Serialize};

/// Upper bound on any single decoded value, whatever the caller's own limit.
pub const MAX_DECODE_BYTES: usize = 16 * 1024 * 1024;

type Canonical = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Fixint,
    bincode::config::Limit<MAX_DECODE_BYTES>,
>;

fn config() -> Canonical {
    bincode::config::standard()
        .with_fixed_int_encoding()
        .with_little_endian()
        .with_limit::<MAX_DECODE_BYTES>()
}

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// The input is larger than allowed for this kind of message.
    #[error("message of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Bytes received.
        len: usize,
        /// Bytes allowed.
        limit: usize,
    },
    /// The bytes do not form a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A valid message was followed by extra bytes.
    #[error("malformed message: {0} unexpected trailing bytes")]
    TrailingBytes(usize),
}

/// Encodes a value canonically.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Encoding into a Vec fails only for types serde cannot represent (none of ours)
    // or values above MAX_DECODE_BYTES, which no wire type reaches.
    bincode::serde::encode_to_vec(value, config()).unwrap_or_default()
}

/// Decodes a value, refusing inputs over `limit` bytes and trailing garbage.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], limit: usize) -> Result<T, DecodeError> {
    let limit = limit.min(MAX_DECODE_BYTES);
    if bytes.len() > limit {
        return Err(DecodeError::TooLarge {
            len: bytes.len(),
            limit,
        });
    }
    let (value, used) = bincode::serde::decode_from_slice::<T, _>(bytes, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if used != bytes.len() {
        return Err(DecodeError::TrailingBytes(bytes.len() - used));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Sample {
        a: u32,
        b: Vec<u8>,
        c: String,
    }

    #[test]
    fn round_trip_is_exact() {
        let s = Sample {
            a: 7,
            b: vec![1, 2, 3],
            c: "x".into(),
        };
        let bytes = encode(&s);
        assert_eq!(decode::<Sample>(&bytes, 1024), Ok(s));
    }

    #[test]
    fn oversized_input_is_refused_before_decoding() {
        let bytes = vec![0u8; 2048];
        assert_eq!(
            decode::<Sample>(&bytes, 1024),
            Err(DecodeError::TooLarge {
                len: 2048,
                limit: 1024
            })
        );
    }

    #[test]
    fn trailing_bytes_and_garbage_are_rejected() {
        let mut bytes = encode(&Sample {
            a: 1,
            b: vec![],
            c: String::new(),
        });
        bytes.push(0);
        assert_eq!(
            decode::<Sample>(&bytes, 1024),
            Err(DecodeError::TrailingBytes(1))
        );
        assert!(matches!(
            decode::<Sample>(&[0xff; 9], 1024),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn huge_length_prefix_does_not_allocate() {
        // a: u32, then a Vec length prefix claiming u64::MAX / 2 elements.
        let mut bytes = vec![0u8; 4];
        bytes.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(matches!(
            decode::<Sample>(&bytes, 1024),
            Err(DecodeError::Malformed(_))
        ));
    }
}
