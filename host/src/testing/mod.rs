//! What Rewind's own tests and benches share, built only with the `testing` feature (the
//! tests turn it on): nats-server processes on loopback, and an authority that always
//! holds. The conformance suites of the storage traits are behind the same feature.

pub mod nats;
