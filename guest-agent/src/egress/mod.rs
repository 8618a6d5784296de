//! Guest side of egress: how programs inside the VM (or the sandbox's
//! network namespace) reach the network only through the host's egress
//! proxy.
//!
//! Stage 2 building blocks live here: the fake-IP table ([`fake`]), the DNS
//! stub that hands out those addresses ([`dns`]) and the transparent TCP
//! capture ([`capture`]). The relay, the upstream dialer and the single
//! start-up call are added alongside them.

pub mod capture;
pub mod dns;
pub mod fake;
