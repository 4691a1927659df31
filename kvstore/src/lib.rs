//! mesh kvstore layer.
