//! mesh control layer.
