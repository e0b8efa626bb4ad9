//! Time on the wire: unix milliseconds, and the clock skew tolerated between peers.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the unix epoch, as carried in every wire message.
pub type UnixMillis = u64;

/// How far a peer's clock may run ahead of ours before its messages are refused.
pub const MAX_CLOCK_SKEW_MS: u64 = 30_000;

/// The current wall-clock time in unix milliseconds.
pub fn now_ms() -> UnixMillis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// "2026-12-01 20:00:05 UTC".
pub fn format_utc(ms: UnixMillis) -> String {
    let secs = (ms / 1000) as i64;
    let (y, mo, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{mo:02}-{d:02} {:02}:{:02}:{:02} UTC",
        s / 3600,
        (s % 3600) / 60,
        s % 60
    )
}

/// Parses "2026-12-01 20:00" or "2026-12-01T20:00:05", in UTC, or with a "+01:00" /
/// "-05:00" / "Z" suffix; the error says what is expected.
pub fn parse_utc(text: &str) -> Result<UnixMillis, String> {
    let bad = || {
        format!(
            "'{text}' is not a date and time: write YYYY-MM-DD HH:MM[:SS] (UTC), optionally followed by Z or an offset such as +01:00"
        )
    };
    let t = text.trim();
    let (t, offset_min) = if let Some(rest) = t.strip_suffix('Z') {
        (rest, 0i64)
    } else if t.len() > 16
        && (t[t.len() - 6..].starts_with('+') || t[t.len() - 6..].starts_with('-'))
    {
        let (body, off) = t.split_at(t.len() - 6);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let h: i64 = off[1..3].parse().map_err(|_| bad())?;
        let m: i64 = off[4..6].parse().map_err(|_| bad())?;
        if &off[3..4] != ":" || h > 14 || m > 59 {
            return Err(bad());
        }
        (body.trim_end(), sign * (h * 60 + m))
    } else {
        (t, 0)
    };
    let (date, time) = t.split_once([' ', 'T']).ok_or_else(bad)?;
    let d: Vec<&str> = date.split('-').collect();
    let c: Vec<&str> = time.trim().split(':').collect();
    if d.len() != 3 || !(2..=3).contains(&c.len()) {
        return Err(bad());
    }
    let num = |s: &str| s.parse::<u32>().map_err(|_| bad());
    let (y, mo, day) = (num(d[0])? as i64, num(d[1])?, num(d[2])?);
    let (h, mi) = (num(c[0])?, num(c[1])?);
    let s = if c.len() == 3 { num(c[2])? } else { 0 };
    let month_len = [
        31,
        if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 {
            29
        } else {
            28
        },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1970..=9999).contains(&y)
        || !(1..=12).contains(&mo)
        || day == 0
        || day > month_len[mo as usize - 1]
        || h > 23
        || mi > 59
        || s > 59
    {
        return Err(bad());
    }
    let secs =
        days_from_civil(y, mo, day) * 86_400 + (h * 3600 + mi * 60 + s) as i64 - offset_min * 60;
    u64::try_from(secs * 1000).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip_and_bad_ones_say_what_to_write() {
        let t = parse_utc("2026-12-01 20:00").unwrap();
        assert_eq!(t, 1_796_155_200_000);
        assert_eq!(format_utc(t), "2026-12-01 20:00:00 UTC");
        assert_eq!(parse_utc("2026-12-01T21:00:00+01:00").unwrap(), t);
        assert_eq!(parse_utc("2026-12-01 20:00Z").unwrap(), t);
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(
            parse_utc("2024-02-29 00:00").map(format_utc).unwrap(),
            "2024-02-29 00:00:00 UTC"
        );
        for bad in [
            "tomorrow",
            "2026-13-01 10:00",
            "2025-02-29 10:00",
            "2026-12-01",
            "2026-12-01 24:00",
            "2026-12-01 10:00+1",
        ] {
            let e = parse_utc(bad).unwrap_err();
            assert!(e.contains("YYYY-MM-DD HH:MM"), "{bad}: {e}");
        }
    }
}
