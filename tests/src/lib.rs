//! Multi-node integration tests.
