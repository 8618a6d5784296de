//! Egress dns (work in progress).
