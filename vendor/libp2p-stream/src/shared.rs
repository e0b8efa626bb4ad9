use std::{
    collections::{HashMap, hash_map::Entry},
    io,
    sync::{Arc, Mutex, MutexGuard},
};

use futures::channel::mpsc;
use libp2p_identity::PeerId;
use libp2p_swarm::{ConnectionId, Stream, StreamProtocol};
use rand::seq::IteratorRandom as _;

use crate::{AlreadyRegistered, IncomingStreams, handler::NewStream};

/// gpunode: the connection to `peer` a new stream takes: a random direct one, or a random
/// relayed one where none is direct. Upstream took any at random, so while a relayed
/// connection and the direct one a hole punch made were both open, half of all streams
/// went through the relay (where job data need not be allowed) and died when the
/// relayed connection closed.
fn preferred(
    connections: &HashMap<ConnectionId, (PeerId, bool)>,
    peer: PeerId,
) -> Option<ConnectionId> {
    let of_peer = |want_relayed: bool| {
        connections
            .iter()
            .filter(|(_, (p, relayed))| *p == peer && *relayed == want_relayed)
            .map(|(c, _)| *c)
            .choose(&mut rand::rng())
    };
    of_peer(false).or_else(|| of_peer(true))
}

pub(crate) struct Shared {
    /// Tracks the supported inbound protocols created via
    /// [`Control::accept`](crate::Control::accept).
    ///
    /// For each [`StreamProtocol`], we hold the [`mpsc::Sender`] corresponding to the
    /// [`mpsc::Receiver`] in [`IncomingStreams`].
    supported_inbound_protocols: HashMap<StreamProtocol, mpsc::Sender<(PeerId, Stream)>>,

    /// gpunode: each connection's peer, and whether it runs through a relay.
    connections: HashMap<ConnectionId, (PeerId, bool)>,
    senders: HashMap<ConnectionId, mpsc::Sender<NewStream>>,

    /// Tracks channel pairs for a peer whilst we are dialing them.
    pending_channels: HashMap<PeerId, (mpsc::Sender<NewStream>, mpsc::Receiver<NewStream>)>,

    /// Sender for peers we want to dial.
    ///
    /// We manage this through a channel to avoid locks as part of
    /// [`NetworkBehaviour::poll`](libp2p_swarm::NetworkBehaviour::poll).
    dial_sender: mpsc::UnboundedSender<PeerId>,
}

/// gpunode: how many inbound streams of one protocol may wait for their acceptor; a
/// stream past them is dropped, as upstream drops every stream past the first.
const INBOUND_BUFFER: usize = 64;

impl Shared {
    pub(crate) fn lock(shared: &Arc<Mutex<Shared>>) -> MutexGuard<'_, Shared> {
        shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Shared {
    pub(crate) fn new(dial_sender: mpsc::UnboundedSender<PeerId>) -> Self {
        Self {
            dial_sender,
            connections: Default::default(),
            senders: Default::default(),
            pending_channels: Default::default(),
            supported_inbound_protocols: Default::default(),
        }
    }

    pub(crate) fn accept(
        &mut self,
        protocol: StreamProtocol,
    ) -> Result<IncomingStreams, AlreadyRegistered> {
        self.supported_inbound_protocols
            .retain(|_, sender| !sender.is_closed());

        if self.supported_inbound_protocols.contains_key(&protocol) {
            return Err(AlreadyRegistered);
        }

        // gpunode: a buffer of `INBOUND_BUFFER` streams per protocol instead of none. With
        // `channel(0)` a stream that arrived while the acceptor had not yet taken the one
        // before was dropped (reset) silently: under load an honest peer's stream was lost
        // without a trace. The acceptor (gpunode's router) takes streams as fast as it
        // can and refuses, with a count, those past its own bound.
        let (sender, receiver) = mpsc::channel(INBOUND_BUFFER);
        self.supported_inbound_protocols
            .insert(protocol.clone(), sender);

        Ok(IncomingStreams::new(receiver))
    }

    /// Lists the protocols for which we have an active [`IncomingStreams`] instance.
    pub(crate) fn supported_inbound_protocols(&mut self) -> Vec<StreamProtocol> {
        self.supported_inbound_protocols
            .retain(|_, sender| !sender.is_closed());

        self.supported_inbound_protocols.keys().cloned().collect()
    }

    pub(crate) fn on_inbound_stream(
        &mut self,
        remote: PeerId,
        stream: Stream,
        protocol: StreamProtocol,
    ) {
        match self.supported_inbound_protocols.entry(protocol.clone()) {
            Entry::Occupied(mut entry) => match entry.get_mut().try_send((remote, stream)) {
                Ok(()) => {}
                Err(e) if e.is_full() => {
                    tracing::debug!(%protocol, "Channel is full, dropping inbound stream");
                }
                Err(e) if e.is_disconnected() => {
                    tracing::debug!(%protocol, "Channel is gone, dropping inbound stream");
                    entry.remove();
                }
                _ => unreachable!(),
            },
            Entry::Vacant(_) => {
                tracing::debug!(%protocol, "channel is gone, dropping inbound stream");
            }
        }
    }

    pub(crate) fn on_connection_closed(&mut self, conn: ConnectionId) {
        self.connections.remove(&conn);
        // gpunode: upstream kept every closed connection's sender, one entry per
        // connection the node ever had.
        self.senders.remove(&conn);
    }

    pub(crate) fn on_dial_failure(&mut self, peer: PeerId, reason: String) {
        let Some((_, mut receiver)) = self.pending_channels.remove(&peer) else {
            return;
        };

        while let Ok(new_stream) = receiver.try_recv() {
            let _ = new_stream
                .sender
                .send(Err(crate::OpenStreamError::Io(io::Error::new(
                    io::ErrorKind::NotConnected,
                    reason.clone(),
                ))));
        }
    }

    pub(crate) fn sender(&mut self, peer: PeerId) -> mpsc::Sender<NewStream> {
        let maybe_sender = preferred(&self.connections, peer).and_then(|c| self.senders.get(&c));

        match maybe_sender {
            Some(sender) => {
                tracing::debug!("Returning sender to existing connection");

                sender.clone()
            }
            None => {
                tracing::debug!(%peer, "Not connected to peer, initiating dial");

                let (sender, _) = self
                    .pending_channels
                    .entry(peer)
                    .or_insert_with(|| mpsc::channel(0));

                let _ = self.dial_sender.unbounded_send(peer); // gpunode: see `Behaviour::new`

                sender.clone()
            }
        }
    }

    /// gpunode: the connection counts from here, as its handler is made, not from the
    /// swarm's `ConnectionEstablished` that follows. A stream asked for in between took
    /// the peer for unconnected, asked for a dial that the connection made needless (and
    /// the swarm skipped), and waited for a connection that never came.
    pub(crate) fn receiver(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        relayed: bool,
    ) -> mpsc::Receiver<NewStream> {
        self.connections.insert(connection, (peer, relayed));
        if let Some((sender, receiver)) = self.pending_channels.remove(&peer) {
            tracing::debug!(%peer, %connection, "Returning existing pending receiver");

            self.senders.insert(connection, sender);
            return receiver;
        }

        tracing::debug!(%peer, %connection, "Creating new channel pair");

        let (sender, receiver) = mpsc::channel(0);
        self.senders.insert(connection, sender);

        receiver
    }
}
