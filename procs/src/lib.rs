//! Process-level test fixtures shared by the end-to-end tests (`tests/`) and `testnet`:
//! [`process::ServeProcess`] starts a real `gpunode serve`, waits until it listens and
//! stops it when dropped; [`images::shell_image`] writes a small container image archive
//! without docker; [`netlab`] builds a NAT lab of network namespaces and runs a team in
//! it.

pub mod images;
pub mod netlab;
pub mod process;
