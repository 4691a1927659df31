//! tiers
