//! Decisions about a node's own QUIC address and its seeds, kept pure for tests.
//!
//! A node advertises the address peers dial. Listening on `0.0.0.0` (as in a container)
//! needs an explicit advertised address: the unspecified address is not one peers can
//! dial. Seed lists are often written once for a whole pool (every pod gets
//! `mesh-0.mesh-peers:7070`), so a seed that names this node itself is skipped, and a
//! node whose seeds are all itself starts the cluster.

use std::net::SocketAddr;

/// The address this node advertises to peers: `advertise` when set, else the bound
/// address, which must then be one peers can dial (not `0.0.0.0` or `[::]`, not port 0).
pub fn advertised_addr(
    bound: SocketAddr,
    advertise: Option<SocketAddr>,
) -> Result<SocketAddr, String> {
    if let Some(a) = advertise {
        if a.ip().is_unspecified() || a.port() == 0 {
            return Err(format!(
                "advertised QUIC address {a} is not one peers can dial: give a host address and a port"
            ));
        }
        return Ok(a);
    }
    if bound.ip().is_unspecified() {
        return Err(format!(
            "QUIC listens on {bound}, which peers cannot dial: set the address they should use \
             (`mesh join --advertise HOST:PORT`, `[cluster] advertise`)"
        ));
    }
    Ok(bound)
}

/// Whether `seed` (`HOST:PORT`) names this node without resolving it: its host is the
/// node's name or a DNS name whose first label is the node's name (a StatefulSet pod
/// `mesh-0` reached as `mesh-0.mesh-peers.ns.svc.cluster.local`), or it is the
/// advertised address itself.
pub fn names_self(seed: &str, me: &str, advertised: SocketAddr) -> bool {
    if seed.parse::<SocketAddr>().ok() == Some(advertised) {
        return true;
    }
    let host = match seed.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => seed,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    !me.is_empty()
        && (host.eq_ignore_ascii_case(me)
            || host
                .split_once('.')
                .is_some_and(|(first, _)| first.eq_ignore_ascii_case(me)))
}

/// The resolved addresses of a seed that are not this node's own.
pub fn others(
    resolved: impl IntoIterator<Item = SocketAddr>,
    advertised: SocketAddr,
) -> Vec<SocketAddr> {
    resolved.into_iter().filter(|a| *a != advertised).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_unspecified_listen_address_needs_an_advertised_one() {
        let e = advertised_addr(a("0.0.0.0:7070"), None).unwrap_err();
        assert!(e.contains("--advertise"), "{e}");
    }

    #[test]
    fn the_advertised_address_wins_over_the_bound_one() {
        assert_eq!(
            advertised_addr(a("0.0.0.0:7070"), Some(a("10.1.2.3:7070"))).unwrap(),
            a("10.1.2.3:7070")
        );
    }

    #[test]
    fn a_bound_host_address_is_advertised_as_is() {
        assert_eq!(
            advertised_addr(a("127.0.0.1:7071"), None).unwrap(),
            a("127.0.0.1:7071")
        );
    }

    #[test]
    fn an_unspecified_advertised_address_is_refused() {
        assert!(advertised_addr(a("10.0.0.1:7070"), Some(a("0.0.0.0:7070"))).is_err());
        assert!(advertised_addr(a("10.0.0.1:7070"), Some(a("10.0.0.1:0"))).is_err());
    }

    #[test]
    fn a_pod_dns_name_starting_with_the_node_name_is_self() {
        let me = a("10.0.0.5:7070");
        assert!(names_self(
            "mesh-0.mesh-peers.default.svc.cluster.local:7070",
            "mesh-0",
            me
        ));
        assert!(names_self("mesh-0:7070", "mesh-0", me));
    }

    #[test]
    fn another_pods_name_is_not_self() {
        let me = a("10.0.0.5:7070");
        assert!(!names_self("mesh-1.mesh-peers:7070", "mesh-0", me));
        assert!(!names_self("mesh-00.mesh-peers:7070", "mesh-0", me));
        assert!(!names_self("x.mesh-0.svc:7070", "mesh-0", me));
    }

    #[test]
    fn the_advertised_address_as_a_seed_is_self() {
        let me = a("10.0.0.5:7070");
        assert!(names_self("10.0.0.5:7070", "n", me));
        assert!(!names_self("10.0.0.5:7071", "n", me));
    }

    #[test]
    fn resolved_addresses_of_this_node_are_left_out() {
        let me = a("10.0.0.5:7070");
        assert_eq!(
            others([me, a("10.0.0.6:7070")], me),
            vec![a("10.0.0.6:7070")]
        );
    }
}
