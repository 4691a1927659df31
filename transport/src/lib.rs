//! mesh transport layer.
