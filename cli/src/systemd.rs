//! Running under systemd: readiness and stopping told to the service manager
//! (`sd_notify`, for `Type=notify` units: `READY=1` once the node listens, `STOPPING=1`
//! when it begins to shut down), and whether the journal already stamps each log line.
//! Outside systemd (no `NOTIFY_SOCKET`, no `JOURNAL_STREAM`) both do nothing.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (`READY=1`, `STOPPING=1`, `STATUS=...`, one per line) to the service
/// manager if it asked for notifications; a failure is logged, never fatal.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&socket, state) {
        tracing::warn!("cannot notify systemd at {}: {e}", socket.to_string_lossy());
    }
}

fn send(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(socket);
    match bytes.strip_prefix(b"@") {
        // An abstract socket name (Linux).
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            sock.send_to(state.as_bytes(), socket)?;
        }
    }
    Ok(())
}

/// Whether stderr goes to the journal, which stamps every line itself (systemd sets
/// `JOURNAL_STREAM` to the device and inode of that stream).
pub fn logging_to_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = value.to_str().and_then(|v| v.split_once(':')) else {
        return false;
    };
    // Only if stderr is still that stream (not redirected by whoever started us).
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse() == Ok(meta.dev()) && ino.parse() == Ok(meta.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_reach_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("gpunode-test-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let abstract_listener = UnixDatagram::bind_addr(&addr).unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = abstract_listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");

        // Nobody listening: an error for the caller to log, not a panic.
        assert!(send(dir.path().join("absent").as_os_str(), "READY=1").is_err());
    }
}
