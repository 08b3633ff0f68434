//! One client's part of a shared limit: a `key: []` concurrency or adaptive limit lets one
//! client address (IPv6 by its /64) hold at most `client_share` of its slots, so that one
//! client's long-lived requests cannot take them all. Addresses in `client_ip.trusted_proxies`
//! and `limits.connections_per_client_exempt` (loopback by default) have no part of their own:
//! behind a mesh or an ingress every client looks like them. Must never: admit a request its
//! shared limit refuses (a part only narrows), or allocate for a client it already tracks.

use std::net::IpAddr;
use std::sync::Arc;

use super::store::Store;
use super::{concurrency_idle, Nanos};
use crate::key::{client_of, Cidr};
use crate::limit::concurrency::Concurrency;

/// The part of a shared limit's slots one client may hold.
pub(super) struct Share {
    fraction: f64,
    clients: Store<Arc<Concurrency>>,
}

/// What a client's part says of one more request.
pub(super) enum Part {
    /// The client has no part (an exempt address): the shared limit alone decides.
    Exempt,
    /// A slot of the client's part, given back with the shared one's permit.
    Taken(Arc<Concurrency>),
    /// The client holds its whole part already.
    Full,
}

impl Share {
    pub(super) fn new(fraction: f64, clients: Store<Arc<Concurrency>>) -> Self {
        Share { fraction, clients }
    }

    /// Slots one client may hold of `limit`: at least one.
    pub(super) fn of(&self, limit: u32) -> u32 {
        ((f64::from(limit) * self.fraction).ceil() as u32).clamp(1, limit.max(1))
    }

    /// A slot of `client`'s part of `limit` slots.
    pub(super) fn take(&self, client: IpAddr, limit: u32, now: Nanos, exempt: &[Cidr]) -> Part {
        if exempt.iter().any(|c| c.contains(client)) {
            return Part::Exempt;
        }
        let key = client_key(client);
        let part = self.of(limit);
        let (taken, _) = self
            .clients
            .with(key.as_slice(), now, concurrency_idle, |c| c.try_take(part));
        taken.map_or(Part::Full, Part::Taken)
    }

    /// How many slots `client` holds of its part of `limit`, and that part; `None` for an
    /// exempt address. Takes nothing (`explain`).
    pub(super) fn peek(&self, client: IpAddr, limit: u32, exempt: &[Cidr]) -> Option<(u32, u32)> {
        if exempt.iter().any(|c| c.contains(client)) {
            return None;
        }
        let key = client_key(client);
        let held = self
            .clients
            .map
            .get(key.as_slice())
            .map_or(0, |c| c.in_flight());
        Some((held, self.of(limit)))
    }

    /// Forgets clients that hold nothing.
    pub(super) fn sweep(&self) -> usize {
        self.clients.sweep(concurrency_idle)
    }
}

/// The key a client's part is kept under: its address (an IPv6 one by its /64).
fn client_key(client: IpAddr) -> smallvec::SmallVec<[u8; 16]> {
    match client_of(client) {
        IpAddr::V4(a) => smallvec::SmallVec::from_slice(&a.octets()),
        IpAddr::V6(a) => smallvec::SmallVec::from_slice(&a.octets()),
    }
}
