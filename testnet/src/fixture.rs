//! The test fixture: a network described in one chain of calls, with its clients, so a
//! test reads as its scenario's steps.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use std::time::Duration;
//! use testnet::TestNet;
//! let net = TestNet::gpu_providers(&["1xA100-80GB", "2xT4-16GB"])
//!     .with_clients(2)
//!     .clients_see_offers(Duration::from_secs(60))
//!     .start()
//!     .await?;
//! let lease = net.client(0).handle.request_lease(
//!     gpunode_node::LeaseSpec::new(1, 60_000).peer(net.provider_id(1)),
//! );
//! # let _ = lease.await;
//! net.shutdown().await; // clients first, then providers
//! # Ok(()) }
//! ```

use std::time::Duration;

use anyhow::{Context, Result};
use gpunode_node::{Misbehaviour, NodeConfig};
use gpunode_protocol::advert::OfferFilter;

use crate::{TestNet, TestNetConfig, Transport};

/// A test network to start: its providers' config and how many clients join it.
#[derive(Debug, Clone)]
pub struct TestNetBuilder {
    config: TestNetConfig,
    clients: usize,
    offers_within: Option<Duration>,
}

impl TestNet {
    /// `n` providers without GPUs.
    pub fn providers(n: usize) -> TestNetBuilder {
        TestNet::configured(TestNetConfig::new(vec![None; n]))
    }

    /// One provider per simulated GPU spec (`"2xA100-80GB"`).
    pub fn gpu_providers(specs: &[&str]) -> TestNetBuilder {
        TestNet::configured(TestNetConfig::new(
            specs.iter().map(|s| Some(s.to_string())).collect(),
        ))
    }

    /// Providers as `config` describes them.
    pub fn configured(config: TestNetConfig) -> TestNetBuilder {
        TestNetBuilder {
            config,
            clients: 0,
            offers_within: None,
        }
    }
}

impl TestNetBuilder {
    /// Adjusts provider `i`'s config before it starts (price, policy, ...).
    pub fn tweak(mut self, tweak: fn(usize, &mut NodeConfig)) -> TestNetBuilder {
        self.config.tweak = Some(tweak);
        self
    }

    /// Makes provider `i` cheat as `misbehaviour(i)` says.
    pub fn misbehaviour(mut self, misbehaviour: fn(usize) -> Misbehaviour) -> TestNetBuilder {
        self.config.misbehaviour = Some(misbehaviour);
        self
    }

    /// Listens on `transport` instead of QUIC.
    pub fn transport(mut self, transport: Transport) -> TestNetBuilder {
        self.config.transport = transport;
        self
    }

    /// Providers' adverts live this long.
    pub fn advert_ttl(mut self, ttl: Duration) -> TestNetBuilder {
        self.config.advert_ttl = ttl;
        self
    }

    /// Starts `n` client nodes too ([`TestNet::client`]), once the providers run.
    pub fn with_clients(mut self, n: usize) -> TestNetBuilder {
        self.clients = n;
        self
    }

    /// Before [`TestNetBuilder::start`] returns, every client sees every provider's
    /// offer, waiting up to `timeout`.
    pub fn clients_see_offers(mut self, timeout: Duration) -> TestNetBuilder {
        self.offers_within = Some(timeout);
        self
    }

    /// Starts the providers, then the clients, and waits as asked.
    pub async fn start(self) -> Result<TestNet> {
        let mut net = TestNet::start(self.config).await?;
        for _ in 0..self.clients {
            net.add_client().await?;
        }
        if let Some(timeout) = self.offers_within {
            let providers = net.nodes.len();
            for client in net.clients() {
                TestNet::wait_for_offers(&client.handle, &OfferFilter::default(), timeout, |o| {
                    o.len() == providers
                })
                .await
                .context("a client does not see every provider's offer")?;
            }
        }
        Ok(net)
    }
}
