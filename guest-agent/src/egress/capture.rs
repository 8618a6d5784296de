//! Egress capture (work in progress).
