//! The live policy: every request reads a snapshot once, when it starts, and keeps it to
//! its end; the tuner actor swaps it (see `mesh_actors::tuner`).

pub use mesh_actors::tuner::{LivePolicy, Snapshot};
