//! Set-ups shared by the process-level tests.

use gpunode_procs::process::ServeProcess;

/// A provider on a fresh QUIC port and a requester daemon bootstrapped to it.
pub fn provider_and_requester(dir: &std::path::Path) -> (ServeProcess, ServeProcess) {
    let bin = gpunode_e2e::gpunode_bin();
    let listen = format!(
        "/ip4/127.0.0.1/udp/{}/quic-v1",
        gpunode_e2e::free_udp_port()
    );
    let provider =
        ServeProcess::start(&bin, &dir.join("p"), &["--listen".into(), listen]).expect("provider");
    let requester = ServeProcess::start(
        &bin,
        &dir.join("r"),
        &["--bootstrap".into(), provider.addr.clone()],
    )
    .expect("requester");
    (provider, requester)
}
