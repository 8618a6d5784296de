//! Egress fake (work in progress).
