//! The sandbox's limit and outcome tests (see `limits.rs`), with each guest in a worker
//! process (`Isolation::Process`): deadline, cancellation and output caps are enforced
//! from outside by killing the worker, memory limits inside it.

const IN_WORKER_PROCESS: bool = true;

include!("common/limits_body.rs");
