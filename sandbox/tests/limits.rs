//! One test per limit and per outcome the wasm sandbox promises, with hostile guests
//! written in WAT: infinite loops, memory.grow bombs, stdout floods, writes outside
//! /output, host paths, invalid modules and unknown imports. Guests run on the test's
//! thread with epoch interruption (`Isolation::Thread`); `limits_in_worker.rs` runs the
//! same tests with each guest in a worker process.

const IN_WORKER_PROCESS: bool = false;

include!("common/limits_body.rs");
