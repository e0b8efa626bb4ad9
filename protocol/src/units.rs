//! Human units on the command line and in config: sizes like `40G` and durations like `30m`.

use std::time::Duration;

/// Why a size or duration could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("'{input}' is not a valid {what}: {hint}")]
pub struct UnitError {
    input: String,
    what: &'static str,
    hint: &'static str,
}

const SIZE_HINT: &str =
    "use a number with an optional unit K, M, G or T (powers of 1024), e.g. 40G or 512M";
const DURATION_HINT: &str =
    "use a number with a unit ms, s, m, h or d, e.g. 30m, 2h or 7d (combine as 1h30m)";

/// Parses a byte size: `40G`, `40GB`, `40GiB`, `512M`, `1024` (bytes). Units are binary.
pub fn parse_bytes(input: &str) -> Result<u64, UnitError> {
    let err = || UnitError {
        input: input.to_string(),
        what: "size",
        hint: SIZE_HINT,
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err());
    }
    let value: f64 = num.parse().map_err(|_| err())?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        "T" | "TB" | "TIB" => 1 << 40,
        _ => return Err(err()),
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes for people: `80G`, `16G`, `512M`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("T", 1 << 40),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
    ];
    for (name, size) in UNITS {
        if bytes >= size {
            let v = bytes as f64 / size as f64;
            return if (v - v.round()).abs() < 0.05 {
                format!("{}{name}", v.round())
            } else {
                format!("{v:.1}{name}")
            };
        }
    }
    format!("{bytes}B")
}

/// Parses a duration: `30m`, `2h`, `7d`, `500ms`, `1h30m`. A bare number is refused.
pub fn parse_duration(input: &str) -> Result<Duration, UnitError> {
    let err = || UnitError {
        input: input.to_string(),
        what: "duration",
        hint: DURATION_HINT,
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err());
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(err)?;
        if digits == 0 {
            return Err(err());
        }
        let n: u128 = rest[..digits].parse().map_err(|_| err())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit_ms: u128 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(err()),
        };
        total_ms = total_ms
            .checked_add(n.checked_mul(unit_ms).ok_or_else(err)?)
            .ok_or_else(err)?;
        rest = &rest[unit_len..];
    }
    u64::try_from(total_ms)
        .map(Duration::from_millis)
        .map_err(|_| err())
}

/// Formats a duration compactly for people: `3s`, `4m`, `2h`, `5d`.
pub fn format_age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("40G"), Ok(40 << 30));
        assert_eq!(parse_bytes("40GiB"), Ok(40 << 30));
        assert_eq!(parse_bytes("512m"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5K"), Ok(1536));
        assert_eq!(parse_bytes("100"), Ok(100));
        for bad in ["", "G", "40X", "-1G", "4 0G", "1e999G"] {
            assert!(parse_bytes(bad).is_err(), "{bad} should fail");
        }
        assert_eq!(format_bytes(80 << 30), "80G");
        assert_eq!(format_bytes(1536 << 20), "1.5G");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86400)));
        for bad in ["", "30", "m", "3x", "1h-2m", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad} should fail");
        }
    }
}
