//! mesh actors layer.
