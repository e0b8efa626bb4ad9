//! A stand-alone sandbox worker (the `gpunode` binary is one too): runs one guest for a
//! parent that uses `Isolation::Process`. The sandbox's own tests start this one.

fn main() {
    let is_worker =
        std::env::args().nth(1).as_deref() == Some(gpunode_sandbox::wasm::worker::WORKER_ARG);
    if !is_worker {
        eprintln!("this program is started by gpunode to run one sandboxed task; it is not for direct use");
        std::process::exit(2);
    }
    std::process::exit(gpunode_sandbox::wasm::worker::worker_main());
}
