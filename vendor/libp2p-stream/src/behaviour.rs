use core::fmt;
use std::{
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use futures::{StreamExt, channel::mpsc};
use libp2p_core::{Endpoint, Multiaddr, transport::PortUse};
use libp2p_identity::PeerId;
use libp2p_swarm::{
    self as swarm, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler,
    THandlerInEvent, THandlerOutEvent, ToSwarm, dial_opts::DialOpts,
};
use swarm::{
    ConnectionClosed, DialError, DialFailure,
    dial_opts::PeerCondition,
};

use crate::{Control, handler::Handler, shared::Shared};

/// gpunode: whether a connection at `addr` (the dialled address, or a listener's local
/// one) runs through a relay.
fn through_relay(addr: &Multiaddr) -> bool {
    addr.iter()
        .any(|p| p == libp2p_core::multiaddr::Protocol::P2pCircuit)
}

/// A generic behaviour for stream-oriented protocols.
pub struct Behaviour {
    shared: Arc<Mutex<Shared>>,
    dial_receiver: mpsc::UnboundedReceiver<PeerId>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self::new()
    }
}

impl Behaviour {
    pub fn new() -> Self {
        // gpunode: unbounded instead of `channel(0)`, whose one slot dropped the dial of a
        // second peer asked for before the swarm polled the first: a stream opened to that
        // peer then waited until something else connected to it. Only this node's own
        // `open_stream` calls feed it, and every swarm poll empties it.
        let (dial_sender, dial_receiver) = mpsc::unbounded();

        Self {
            shared: Arc::new(Mutex::new(Shared::new(dial_sender))),
            dial_receiver,
        }
    }

    /// Obtain a new [`Control`].
    pub fn new_control(&self) -> Control {
        Control::new(self.shared.clone())
    }
}

/// The protocol is already registered.
#[derive(Debug)]
pub struct AlreadyRegistered;

impl fmt::Display for AlreadyRegistered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "The protocol is already registered")
    }
}

impl std::error::Error for AlreadyRegistered {}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = Handler;
    type ToSwarm = ();

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        local_addr: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        // gpunode: a connection made to us through a relay has the circuit as its local
        // address (as `ConnectedPoint::is_relayed` reads it).
        Ok(Handler::new(
            peer,
            self.shared.clone(),
            Shared::lock(&self.shared).receiver(peer, connection_id, through_relay(local_addr)),
        ))
    }

    fn handle_established_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(Handler::new(
            peer,
            self.shared.clone(),
            Shared::lock(&self.shared).receiver(peer, connection_id, through_relay(addr)),
        ))
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            // gpunode: a connection is recorded as its handler is made (`Shared::receiver`),
            // before the swarm's `ConnectionEstablished`.
            FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => {
                Shared::lock(&self.shared).on_connection_closed(connection_id)
            }
            // gpunode: a connection whose handler we made and that another behaviour then
            // denied never comes as established or closed.
            FromSwarm::ListenFailure(swarm::ListenFailure { connection_id, .. }) => {
                Shared::lock(&self.shared).on_connection_closed(connection_id)
            }
            FromSwarm::DialFailure(DialFailure {
                peer_id,
                error,
                connection_id,
            }) => {
                let mut shared = Shared::lock(&self.shared);
                shared.on_connection_closed(connection_id); // gpunode: as above
                if let Some(peer_id) = peer_id {
                    if matches!(
                        error,
                        DialError::Transport(_)
                            | DialError::Denied { .. }
                            | DialError::NoAddresses
                            | DialError::WrongPeerId { .. }
                    ) {
                        // We can only forward the string repr but it is better than nothing.
                        shared.on_dial_failure(peer_id, error.to_string())
                    }
                }
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer_id: PeerId,
        _connection_id: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        libp2p_core::util::unreachable(event);
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        if let Poll::Ready(Some(peer)) = self.dial_receiver.poll_next_unpin(cx) {
            return Poll::Ready(ToSwarm::Dial {
                opts: DialOpts::peer_id(peer)
                    .condition(PeerCondition::DisconnectedAndNotDialing)
                    .build(),
            });
        }

        Poll::Pending
    }
}
