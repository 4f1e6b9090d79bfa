//! The network side of scd: QUIC endpoints (quinn) with mutual TLS under a cluster CA, the rkyv
//! wire types and their validating codec, layer-by-layer code streams with backpressure and
//! cancellation, and link emulation (pacing). No model math: code frames carry plain bytes and
//! shapes.
#![warn(missing_docs)]
